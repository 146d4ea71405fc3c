"""Against a real cluster (`pytest -m e2e`, KUBECONFIG): the API server itself accepts every
overlay and the samples (server-side dry run: admission, schemas, CEL rules). Installs the
CRDs for real (the dry run of custom resources needs them); creates nothing else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from manifests_helpers import KUSTOMIZATIONS, ROOT, kubectl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster() -> str:
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
    return binary


@pytest.mark.parametrize("rel", [k for k in KUSTOMIZATIONS if "monitoring" not in k and "argocd" not in k]
                         + ["manifests/samples"])
def test_api_server_accepts(cluster, rel):
    result = subprocess.run([cluster, "apply", "--server-side", "--dry-run=server", "-k", str(ROOT / rel)],
                            capture_output=True, text=True, timeout=120)
    # Namespaced objects in namespaces the dry run did not create are the only expected refusal.
    errors = [line for line in result.stderr.splitlines() if line.strip() and "namespaces \"" not in line]
    assert result.returncode == 0 or not errors, result.stderr
