"""End-to-end: the operator against a real Kubernetes cluster (kind, minikube, k3d, any).

    KUBECONFIG=~/.kube/config python -m pytest -m e2e tests/e2e

What it does: applies crds/ (server-side, `-k`), starts `tokenlane operator --namespace <ns>
--standalone` as a subprocess, applies the CPU-only sample into a fresh namespace, and checks
the Deployment / Service / ConfigMap / PDB, owner references (garbage collection), status
(observedGeneration, selector, conditions), `kubectl scale msvc` through the scale
subresource, a lane change (ConfigMap updated in place, pod template unchanged), CRD
validation (the API server refuses an invalid spec via CEL), and deletion; it deletes its
namespace at the end. Pods need the runtime image (TOKENLANE_E2E_IMAGE, default the CRD's
default image); readiness of pods is only awaited with TOKENLANE_E2E_WAIT_READY=1.
Skipped with a clear reason when no cluster is reachable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _cluster_reason() -> str | None:
    if not shutil.which("kubectl"):
        return "kubectl not found"
    if not os.environ.get("KUBECONFIG") and not (Path.home() / ".kube" / "config").exists():
        return "no cluster configured (set KUBECONFIG)"
    try:
        result = subprocess.run(["kubectl", "version", "-o", "json", "--request-timeout=5s"], capture_output=True,
                                text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "cluster not reachable (kubectl version timed out)"
    if result.returncode != 0 or "serverVersion" not in result.stdout:
        return f"cluster not reachable: {result.stderr.strip()[:200]}"
    return None


_REASON = _cluster_reason()
if _REASON:
    pytestmark = [pytest.mark.e2e, pytest.mark.skip(reason=f"e2e: {_REASON}")]


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
    return result


def get(kind: str, name: str, ns: str) -> dict | None:
    result = kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def wait_for(predicate, timeout: float = 90, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    ns = f"tokenlane-e2e-{uuid.uuid4().hex[:6]}"
    # -k: crds/ holds a kustomization.yaml, which `-f crds/` would send to the API server.
    kubectl("apply", "--server-side", "--field-manager=tokenlane-e2e", "-k", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            "crd/modelservices.tokenlane.dev", "crd/servinglanes.tokenlane.dev")
    kubectl("create", "namespace", ns)
    # The log goes to a file: nobody reads a pipe until the end, and a full pipe blocks the operator.
    log_path = tmp_path_factory.mktemp("e2e") / "operator.log"
    with open(log_path, "w") as log:
        operator = subprocess.Popen(
            [sys.executable, "-m", "tokenlane.cli", "operator", "--namespace", ns, "--standalone",
             "--metrics-port", "0", "--liveness", "", "--log-format", "plain"],
            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        yield ns
    finally:
        # While the operator still runs: it removes its finalizers (after a failed test too),
        # so the namespace does not hang in Terminating.
        kubectl("delete", "modelservices,servinglanes", "--all", "-n", ns, "--wait=true", "--timeout=60s",
                check=False)
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        print(log_path.read_text()[-5000:])


def sample_docs(ns: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text()) if d]
    image = os.environ.get("TOKENLANE_E2E_IMAGE")
    for d in docs:
        d["metadata"]["namespace"] = ns
        if d["kind"] == "ModelService" and image:
            d["spec"]["image"] = image
    return docs


def test_lifecycle(namespace):
    ns = namespace
    docs = sample_docs(ns)
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    dep = wait_for(lambda: get("deployment", "tiny", ns), what="Deployment tiny")
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "ModelService"
    assert get("service", "tiny", ns) and get("poddisruptionbudget", "tiny", ns)
    cm = wait_for(lambda: get("configmap", "tiny-config", ns), what="ConfigMap")
    assert "name: interactive" in cm["data"]["runtime.yaml"] and "name: batch" in cm["data"]["runtime.yaml"]
    msvc = wait_for(lambda: (get("modelservice", "tiny", ns) or {}).get("status", {}).get("observedGeneration")
                    and get("modelservice", "tiny", ns), what="status")
    assert msvc["status"]["lanes"] == 2
    assert "tokenlane.dev/pool=shared" in msvc["status"]["selector"]
    assert {c["type"] for c in msvc["status"]["conditions"]} >= {"Ready", "Progressing", "Degraded"}
    # Printer columns and short names work.
    assert "tiny" in kubectl("get", "msvc", "-n", ns).stdout
    assert "tiny-batch" in kubectl("get", "lane", "-n", ns).stdout

    # Scale through the scale subresource (kubectl scale / HPA).
    kubectl("scale", "msvc/tiny", "--replicas=2", "-n", ns)
    wait_for(lambda: get("deployment", "tiny", ns)["spec"]["replicas"] == 2, what="scaled Deployment")

    # Change a lane: ConfigMap changes in place, the pod template does not (no restart).
    template_before = get("deployment", "tiny", ns)["spec"]["template"]
    kubectl("patch", "servinglane", "tiny-batch", "-n", ns, "--type=merge",
            "-p", json.dumps({"spec": {"budgets": {"maxWaitingRequests": 99}}}))
    wait_for(lambda: "maxWaitingRequests: 99" in get("configmap", "tiny-config", ns)["data"]["runtime.yaml"],
             what="lane budget in the ConfigMap")
    assert get("deployment", "tiny", ns)["spec"]["template"] == template_before

    # The API server refuses an invalid spec (CEL rule) before the operator sees it.
    bad = kubectl("patch", "modelservice", "tiny", "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"scheduler": {"kvCacheHighWatermark": 0.99}}}), check=False)
    assert bad.returncode != 0 and "kvCacheHighWatermark" in bad.stderr

    if os.environ.get("TOKENLANE_E2E_WAIT_READY"):
        wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                             for c in get("modelservice", "tiny", ns)["status"]["conditions"]),
                 timeout=600, what="Ready=True")

    # Delete: owned objects go (operator + garbage collection), lanes report the missing parent.
    kubectl("delete", "modelservice", "tiny", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: get("deployment", "tiny", ns) is None and get("configmap", "tiny-config", ns) is None,
             what="owned objects deleted")
    wait_for(lambda: any(c.get("reason") == "ModelServiceNotFound"
                         for c in get("servinglane", "tiny-batch", ns)["status"]["conditions"]),
             what="lane condition ModelServiceNotFound")
    kubectl("delete", "servinglane", "--all", "-n", ns, "--wait=true", "--timeout=60s")
