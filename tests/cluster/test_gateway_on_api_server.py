"""spec.gateway.inferencePool and spec.adapters on a real API server.

With the Gateway API Inference Extension's InferencePool CRD installed (pinned in
../shared/k8s/thirdparty-crds), the operator, running as its ServiceAccount under the namespaced
overlay's RBAC, applies the InferencePool of a ModelService with two LoRA adapters; the API
server accepts it under the upstream schema and CEL rules. Adding a third adapter on the claim
already mounted rewrites the ConfigMap only: the Deployment's pod template (and its generation)
stays. A repeated adapter name is refused by the server (spec.adapters is a list-map). Deleting
the ModelService garbage-collects the pool (the controller manager follows its owner reference).

The tests of this module run in order and share one installation (module fixtures)."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster_harness import (
    SHARED_K8S,
    WORKLOAD_NS,
    Cluster,
    OperatorProcess,
    condition,
    rbac_denials,
    start_namespaced_operator,
    wait_for,
)

POOL_CRD_FILE = SHARED_K8S / "thirdparty-crds" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_CRD = "inferencepools.inference.networking.k8s.io"
NAME = "gw-lora"
SQL = {"name": "sql", "source": {"pvc": {"claimName": "lora-adapters", "path": "sql"}}}
CHAT = {"name": "chat", "source": {"pvc": {"claimName": "lora-adapters", "path": "chat"}}}
LAW = {"name": "law", "source": {"pvc": {"claimName": "lora-adapters", "path": "law"}}}
MSVC = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": NAME, "namespace": WORKLOAD_NS},
        "spec": {"model": {"path": "/models/tiny", "source": {"tinyModel": {}}},
                 "engine": {"device": "cpu", "maxLoras": 2, "maxLoraRank": 16}, "gpus": {"count": 0},
                 "adapters": [SQL, CHAT],
                 "tenants": [{"name": "analytics", "adapters": ["sql"]}],
                 "gateway": {"inferencePool": {"enabled": True,
                                               "endpointPicker": {"service": f"{NAME}-epp",
                                                                  "failureMode": "FailOpen"}}}}}


def _pool(cluster: Cluster) -> dict | None:
    return cluster.get(POOL_CRD, NAME, WORKLOAD_NS)


@pytest.fixture(scope="module")
def pool_crd(crds: Cluster):
    if not POOL_CRD_FILE.exists():
        pytest.skip(f"the upstream InferencePool CRD is not at {POOL_CRD_FILE}")
    installed = crds.get("crd", POOL_CRD) is None
    if installed:
        crds.kubectl("apply", "--server-side", "--field-manager=tokenlane-cluster-tests", "-f", str(POOL_CRD_FILE))
    wait_for(lambda: (condition(crds.get("crd", POOL_CRD), "Established") or {}).get("status") == "True",
             what=f"{POOL_CRD} Established")
    yield crds
    if installed:  # other modules of the session see the cluster as it was
        crds.kubectl("delete", "crd", POOL_CRD, "--wait=true", "--timeout=120s", check=False)


@pytest.fixture(scope="module")
def operator(pool_crd: Cluster, tmp_path_factory):
    process = start_namespaced_operator(pool_crd, tmp_path_factory.mktemp("gateway"), "tokenlane-operator-gateway")
    yield process
    process.stop()
    pool_crd.kubectl("-n", WORKLOAD_NS, "delete", "msvc", NAME, "--ignore-not-found", "--wait=false", check=False)
    print(process.log()[-4000:])


def test_api_server_accepts_the_rendered_inference_pool(pool_crd: Cluster, operator: OperatorProcess):
    pool_crd.apply([MSVC])  # our CRD's schema and CEL accept the adapters and the gateway
    pool = wait_for(lambda: _pool(pool_crd), timeout=120, what="the InferencePool")
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/instance": NAME,
                                               "app.kubernetes.io/component": "runtime",
                                               "tokenlane.dev/pool": "shared"}
    assert spec["targetPorts"] == [{"number": 8000}]
    assert spec["endpointPickerRef"]["name"] == f"{NAME}-epp"
    assert spec["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert spec["endpointPickerRef"]["port"] == {"number": 9002}
    msvc = pool_crd.get("msvc", NAME, WORKLOAD_NS)
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ModelService", msvc["metadata"]["uid"], True)
    # The same selector finds the Deployment's pods: the pool is the runtime's.
    deployment = wait_for(lambda: pool_crd.get("deployment", NAME, WORKLOAD_NS), what="the Deployment")
    assert spec["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not rbac_denials(operator.log())


def test_an_adapter_on_a_mounted_claim_changes_only_the_configmap(pool_crd: Cluster, operator: OperatorProcess):
    def config() -> dict:
        cm = pool_crd.get("configmap", f"{NAME}-config", WORKLOAD_NS)
        return yaml.safe_load(cm["data"]["runtime.yaml"]) if cm else {}

    wait_for(lambda: [a["name"] for a in config().get("model", {}).get("adapters", [])] == ["sql", "chat"],
             what="two adapters in runtime.yaml")
    before = pool_crd.get("deployment", NAME, WORKLOAD_NS)
    pool_crd.kubectl("-n", WORKLOAD_NS, "patch", "msvc", NAME, "--type=merge",
                     "-p", json.dumps({"spec": {"adapters": [SQL, CHAT, LAW]}}))
    adapters = wait_for(lambda: (a := config().get("model", {}).get("adapters", [])) and len(a) == 3 and a,
                        timeout=120, what="the third adapter in runtime.yaml")
    assert adapters[2] == {"name": "law", "path": "/adapters/pvc-lora-adapters/law"}
    after = pool_crd.get("deployment", NAME, WORKLOAD_NS)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"]


def test_deleting_the_model_service_collects_the_pool(pool_crd: Cluster, operator: OperatorProcess):
    assert _pool(pool_crd) is not None
    pool_crd.kubectl("-n", WORKLOAD_NS, "delete", "msvc", NAME, "--wait=false")
    wait_for(lambda: _pool(pool_crd) is None, timeout=120, what="the InferencePool garbage-collected")


def test_duplicate_adapter_names_are_refused_by_the_server(pool_crd: Cluster, operator: OperatorProcess):
    """spec.adapters is a list-map keyed by name: the server itself refuses a repeated name."""
    doc = json.loads(json.dumps(MSVC))
    doc["metadata"]["name"] = "gw-duplicate"
    doc["spec"]["adapters"] = [SQL, {**CHAT, "name": "sql"}]
    result = pool_crd.kubectl("create", "--dry-run=server", "-n", WORKLOAD_NS, "-f", "-",
                              input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0 and "Duplicate value" in result.stderr, result.stderr
