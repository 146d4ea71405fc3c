"""ModelAvailable and the ModelFetchFailed Event through the running operator (kopf against the
kmock emulator over loopback): the operator reads the runtime pods' fetch-model init
containers, writes the condition, and posts one Warning Event per transition to Failed.
There is no kubelet: the test writes the pod and its init container status itself."""

from __future__ import annotations

import copy

import pytest

from tokenlane.operator.clients import reads
from tokenlane.operator.controllers.handlers import reconcile_model_service

pytestmark = pytest.mark.timeout(60)

NS = "tokenlane-demo"
SMOL = {
    "apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
    "metadata": {"name": "smol"},
    "spec": {"model": {"path": "/models/smol",
                       "source": {"huggingFace": {"repo": "acme/private-7b", "tokenSecretRef": {"name": "hf"}}},
                       "cache": {"pvc": {"claimName": "model-cache"}}},
             "engine": {"device": "cpu"}, "gpus": {"count": 0}},
}
GATED = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                      "message": "401 Client Error: Repository acme/private-7b is gated"}},
         "restartCount": 2, "name": "fetch-model", "ready": False, "image": "x", "imageID": ""}
DONE = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}, "restartCount": 3,
        "name": "fetch-model", "ready": True, "image": "x", "imageID": ""}


async def _pod_of(cluster, deployment: str, name: str, init_status: dict) -> None:
    """A pod as the ReplicaSet would make it from the Deployment's template, with a status as
    the kubelet would report it."""
    template = cluster.obj("deployments", deployment)["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": template["metadata"]["labels"],
                        "annotations": template["metadata"]["annotations"], "uid": f"uid-pod-{name}"},
           "spec": copy.deepcopy(template["spec"]),
           "status": {"phase": "Pending", "initContainerStatuses": [init_status]}}
    await cluster.client.create(reads.PODS, pod)


async def _set_init_status(cluster, name: str, init_status: dict) -> None:
    await cluster.client.merge_patch(reads.PODS, NS, name, {"status": {"initContainerStatuses": [init_status]}},
                                     subresource="status")


def _fetch_events(cluster, name="smol"):
    return cluster.events_about("ModelService", name, "ModelFetchFailed")


async def test_fetch_failure_sets_condition_and_one_event_per_transition(cluster, tiny_samples):
    await cluster.create(SMOL)
    await cluster.create(tiny_samples[0])  # a ModelService with nothing to fetch, alongside
    await cluster.wait_for(lambda: cluster.condition("modelservices", "smol", "ModelAvailable")["reason"] == "NoPods",
                           what="ModelAvailable=Unknown/NoPods")
    await cluster.wait_for(lambda: cluster.condition("modelservices", "tiny", "ModelAvailable")["reason"]
                           == "NoDownload", what="tiny: ModelAvailable=True/NoDownload")

    await _pod_of(cluster, "smol", "smol-abc12", GATED)
    await reconcile_model_service(cluster.op, NS, "smol")
    cond = cluster.condition("modelservices", "smol", "ModelAvailable")
    assert (cond["status"], cond["reason"]) == ("False", "Failed")
    assert "401 Client Error: Repository acme/private-7b is gated" in cond["message"]
    events = await cluster.wait_for(lambda: _fetch_events(cluster), what="ModelFetchFailed Event")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert "is gated" in events[0]["message"]

    # Later reconciles while it keeps failing: no new Event, no status write.
    await reconcile_model_service(cluster.op, NS, "smol")
    await reconcile_model_service(cluster.op, NS, "smol")
    assert len(_fetch_events(cluster)) == 1

    # The token is fixed, the kubelet's next try succeeds: Ready.
    await _set_init_status(cluster, "smol-abc12", DONE)
    await reconcile_model_service(cluster.op, NS, "smol")
    cond = cluster.condition("modelservices", "smol", "ModelAvailable")
    assert (cond["status"], cond["reason"]) == ("True", "Ready")
    assert cond["message"] == "hf://acme/private-7b@main fetched into the cache"

    # A new failure is a new transition: a second Event.
    await _pod_of(cluster, "smol", "smol-def34", GATED)
    await reconcile_model_service(cluster.op, NS, "smol")
    assert cluster.condition("modelservices", "smol", "ModelAvailable")["reason"] == "Failed"
    assert len(await cluster.wait_for(lambda: len(_fetch_events(cluster)) == 2 and _fetch_events(cluster),
                                      what="second ModelFetchFailed Event")) == 2

    # The other ModelService is unaffected.
    await reconcile_model_service(cluster.op, NS, "tiny")
    assert cluster.condition("modelservices", "tiny", "ModelAvailable")["reason"] == "NoDownload"
    assert not _fetch_events(cluster, "tiny")


async def test_pods_the_operator_may_not_list_leave_the_rest_of_the_reconcile_alone(cluster):
    """An install whose RBAC lacks `list pods`: ModelAvailable says so, everything else is rendered."""
    cluster.kmock["get /api/v1/namespaces/tokenlane-demo/pods"] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": 'pods is forbidden: User "system:serviceaccount:tokenlane-system:tokenlane-operator" '
                   'cannot list resource "pods"'}
    await cluster.create(SMOL)
    cond = await cluster.wait_for(lambda: (c := cluster.condition("modelservices", "smol", "ModelAvailable"))
                                  and c["reason"] == "PodsUnreadable" and c, what="ModelAvailable=PodsUnreadable")
    assert cond["status"] == "Unknown" and "cannot list resource" in cond["message"]
    assert cluster.obj("deployments", "smol") and cluster.obj("configmaps", "smol-config")
    assert cluster.condition("modelservices", "smol", "Degraded")["status"] == "False"
