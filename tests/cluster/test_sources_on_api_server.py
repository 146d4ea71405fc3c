"""Model sources on a real API server: ModelServices with an s3 source and a PVC cache and with a
huggingFace source and a token Secret pass the CRD schema and CEL rules; the operator, running
as its ServiceAccount under the namespaced overlay's RBAC, renders Deployments whose fetch-model
init container, volumes and secretKeyRefs the API server accepts (and the controller manager
turns into pods that pass the namespace's restricted Pod Security admission); that ServiceAccount
cannot read Secrets; and a fetch-model init container whose status the test writes as failed
(there is no kubelet) turns ModelAvailable to Failed with its message and posts one Event.

The tests of this module run in order and share one installation (module fixtures)."""

from __future__ import annotations

import json

import pytest

from cluster_harness import (
    OPERATOR_SA,
    WORKLOAD_NS,
    Cluster,
    OperatorProcess,
    condition,
    rbac_denials,
    start_namespaced_operator,
    wait_for,
)

SA_USER = f"system:serviceaccount:{OPERATOR_SA[0]}:{OPERATOR_SA[1]}"
GATED_MESSAGE = "401 Client Error: Cannot access gated repo acme/private-7b (fetch-model test)"

SECRETS = [
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": WORKLOAD_NS},
     "stringData": {"HF_TOKEN": "hf_not_a_real_token"}},
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds", "namespace": WORKLOAD_NS},
     "stringData": {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}},
]
CACHE_CLAIM = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": "model-cache", "namespace": WORKLOAD_NS},
               "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}}


def model_service(name: str, source: dict, cache: dict | None = None) -> dict:
    model = {"path": f"/models/{name}", "source": source}
    if cache:
        model["cache"] = cache
    return {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
            "metadata": {"name": name, "namespace": WORKLOAD_NS},
            "spec": {"model": model, "engine": {"device": "cpu"}, "gpus": {"count": 0}}}


S3_MSVC = model_service("src-s3", {"s3": {"uri": "s3://weights/llama/8b", "endpoint": "http://minio.storage:9000",
                                          "region": "us-east-1", "credentialsSecretRef": {"name": "s3-creds"}}},
                        {"pvc": {"claimName": "model-cache"}})
HF_MSVC = model_service("src-hf", {"huggingFace": {"repo": "acme/private-7b", "revision": "v1",
                                                   "tokenSecretRef": {"name": "hf-token"},
                                                   "allowPatterns": ["*.json", "*.safetensors"]}})


@pytest.fixture(scope="module")
def operator(crds: Cluster, tmp_path_factory):
    process = start_namespaced_operator(crds, tmp_path_factory.mktemp("sources"), "tokenlane-operator-sources")
    yield process
    process.stop()
    for msvc in (S3_MSVC, HF_MSVC):
        crds.kubectl("-n", WORKLOAD_NS, "delete", "msvc", msvc["metadata"]["name"], "--ignore-not-found",
                     "--wait=false", check=False)
    crds.kubectl("-n", WORKLOAD_NS, "delete", "secret,pvc", "hf-token", "s3-creds", "model-cache",
                 "--ignore-not-found", check=False)
    print(process.log()[-4000:])


@pytest.fixture(scope="module")
def applied(crds: Cluster, operator: OperatorProcess) -> Cluster:
    crds.apply(SECRETS + [CACHE_CLAIM])
    crds.apply([S3_MSVC, HF_MSVC])  # the CRD schema and CEL rules accept both
    return crds


def _deployment(cluster: Cluster, name: str) -> dict:
    return wait_for(lambda: cluster.get("deployment", name, WORKLOAD_NS), timeout=120, what=f"Deployment {name}")


def _pods(cluster: Cluster, name: str) -> list[dict]:
    out = cluster.kubectl("-n", WORKLOAD_NS, "get", "pods", "-l", f"app.kubernetes.io/instance={name}",
                          "-o", "json").stdout
    return json.loads(out)["items"]


def _fetch_events(cluster: Cluster, name: str) -> list[dict]:
    out = cluster.kubectl("-n", WORKLOAD_NS, "get", "events", "--field-selector",
                          f"reason=ModelFetchFailed,involvedObject.name={name}", "-o", "json").stdout
    return json.loads(out)["items"]


def test_api_server_accepts_the_rendered_init_container_volumes_and_secret_refs(applied: Cluster):
    s3 = _deployment(applied, "src-s3")["spec"]["template"]["spec"]
    (init,) = s3["initContainers"]
    assert init["name"] == "fetch-model" and init["args"][:3] == ["fetch-model", "s3://weights/llama/8b",
                                                                  "/models/src-s3"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert refs["AWS_SESSION_TOKEN"]["optional"] is True
    volumes = {v["name"]: v for v in s3["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "model-cache"
    assert "emptyDir" in volumes["models"]

    hf = _deployment(applied, "src-hf")["spec"]["template"]["spec"]
    (init,) = hf["initContainers"]
    assert init["args"][:3] == ["fetch-model", "hf://acme/private-7b", "/models/src-hf"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    # The controller manager made the pods: the pod spec passed the API server's validation and
    # the namespace's restricted Pod Security admission, init container included.
    for name in ("src-s3", "src-hf"):
        pods = wait_for(lambda: _pods(applied, name), timeout=120, what=f"pods of {name}")
        assert pods[0]["spec"]["initContainers"][0]["name"] == "fetch-model"


def test_operator_service_account_cannot_read_secrets(applied: Cluster):
    def can(verb: str, resource: str) -> str:
        result = applied.kubectl("auth", "can-i", verb, resource, "-n", WORKLOAD_NS, f"--as={SA_USER}", check=False)
        return result.stdout.strip()

    for verb in ("get", "list", "watch"):
        assert can(verb, "secrets") == "no", f"the operator may {verb} Secrets"
    assert can("list", "pods") == "yes"  # the fetch-model init containers' states


def test_failed_fetch_turns_model_available_failed_with_one_event(applied: Cluster, operator: OperatorProcess):
    wait_for(lambda: (condition(applied.get("msvc", "src-hf", WORKLOAD_NS), "ModelAvailable") or {})
             .get("reason") in ("Downloading", "NoPods"), timeout=120, what="ModelAvailable before any fetch")
    pod = wait_for(lambda: _pods(applied, "src-hf"), timeout=120, what="a pod of src-hf")[0]
    # Play the kubelet: the init container failed with the source's message and is backing off.
    status = {"status": {"initContainerStatuses": [{
        "name": "fetch-model", "ready": False, "restartCount": 2, "image": pod["spec"]["initContainers"][0]["image"],
        "imageID": "",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": GATED_MESSAGE,
                                     "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:01Z"}},
    }]}}
    applied.kubectl("-n", WORKLOAD_NS, "patch", "pod", pod["metadata"]["name"], "--subresource=status",
                    "--type=merge", "-p", json.dumps(status))
    # Pod status changes are not watched; a Deployment event runs the reconcile now (else the 60 s timer).
    applied.kubectl("-n", WORKLOAD_NS, "annotate", "deployment", "src-hf", "test.tokenlane.dev/poke=1", "--overwrite")

    failed = wait_for(lambda: (c := condition(applied.get("msvc", "src-hf", WORKLOAD_NS), "ModelAvailable"))
                      and c["reason"] == "Failed" and c, timeout=120, what="ModelAvailable=Failed")
    assert failed["status"] == "False" and GATED_MESSAGE in failed["message"]
    events = wait_for(lambda: _fetch_events(applied, "src-hf"), timeout=60, what="the ModelFetchFailed Event")
    assert len(events) == 1 and events[0]["type"] == "Warning" and GATED_MESSAGE in events[0]["message"]

    # More reconciles while it keeps failing: still one Event.
    seen = operator.reconciles()
    applied.kubectl("-n", WORKLOAD_NS, "annotate", "deployment", "src-hf", "test.tokenlane.dev/poke=2", "--overwrite")
    wait_for(lambda: operator.reconciles() > seen, timeout=60, what="another reconcile")
    assert len(_fetch_events(applied, "src-hf")) == 1

    # The other ModelService is unaffected, and no request of the operator was refused.
    other = condition(applied.get("msvc", "src-s3", WORKLOAD_NS), "ModelAvailable")
    assert other is not None and other["reason"] != "Failed"
    assert not _fetch_events(applied, "src-s3")
    assert not rbac_denials(operator.log())
