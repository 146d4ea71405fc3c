"""Against a real cluster (`pytest -m e2e`, KUBECONFIG): the API server itself accepts every
overlay and the samples (server-side dry run: admission, schemas, CEL rules). Installs the
CRDs and the namespaces the manifests name for real (the dry run of custom resources needs the
CRDs, and of namespaced objects their namespace); creates nothing else and deletes the
namespaces it created."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from manifests_helpers import KUSTOMIZATIONS, ROOT, kubectl, render

pytestmark = pytest.mark.e2e
RELS = [k for k in KUSTOMIZATIONS if "monitoring" not in k and "argocd" not in k] + ["manifests/samples"]


@pytest.fixture(scope="module")
def cluster():
    config = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if not Path(config.split(os.pathsep)[0]).exists():
        pytest.skip("no cluster: set KUBECONFIG to run the e2e suite")
    binary = kubectl()
    probe = subprocess.run([binary, "version", "--request-timeout=10s"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cluster from KUBECONFIG not reachable: {probe.stderr.strip()[:200]}")
    result = subprocess.run([binary, "apply", "--server-side", "-k", str(ROOT / "crds")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    subprocess.run([binary, "wait", "--for=condition=Established", "--timeout=60s",
                    "crd/modelservices.tokenlane.dev", "crd/servinglanes.tokenlane.dev",
                    "crd/kopfpeerings.kopf.dev", "crd/clusterkopfpeerings.kopf.dev"], check=True, timeout=90)
    # A dry run creates no Namespace, so every object in one would only be refused with
    # `namespaces "x" not found`, never validated: create the namespaces the install creates.
    wanted = sorted({o["metadata"]["namespace"] for rel in RELS for o in render(rel) if o["metadata"].get("namespace")}
                    | {o["metadata"]["name"] for rel in RELS for o in render(rel) if o["kind"] == "Namespace"})
    existing = subprocess.run([binary, "get", "namespaces", "-o", "name"], capture_output=True, text=True,
                              check=True, timeout=60).stdout.split()
    created = [n for n in wanted if f"namespace/{n}" not in existing]
    for name in created:
        subprocess.run([binary, "create", "namespace", name], check=True, capture_output=True, timeout=60)
    yield binary
    if created:
        subprocess.run([binary, "delete", "namespace", *created, "--wait=false"], capture_output=True, timeout=60)


@pytest.mark.parametrize("rel", RELS)
def test_api_server_accepts(cluster, rel):
    result = subprocess.run([cluster, "apply", "--server-side", "--dry-run=server", "-k", str(ROOT / rel)],
                            capture_output=True, text=True, timeout=120)
    # Warnings (e.g. of a cluster's pod-security defaults) are the cluster's business; errors are ours.
    errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Warning:")]
    assert result.returncode == 0 and not errors, result.stderr
    assert result.stdout.count("(server dry run)") == len(render(rel)), result.stdout
