"""spec.parallelism against the kmock emulator: with the LeaderWorkerSet kind served, a pipeline
renders a LeaderWorkerSet (no Deployment), a group's readiness flows into status through the
operator's watch, and going back to one stage swaps it for a Deployment; without the kind, the
ModelService gets a condition and a Warning Event and what runs is left alone."""

from __future__ import annotations

import copy

import pytest
from operator_harness import NS, running_cluster  # tests/operator, put on sys.path by conftest

from tokenlane.operator.clients import kube as k8s
from tokenlane.runtime.config import loads_config

pytestmark = pytest.mark.timeout(60)

LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
LEADER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture
async def lws_cluster(kmock):
    """The operator against an emulator that serves LeaderWorkerSets from the start (so kopf
    watches them, as on a cluster with the lws CRD installed)."""
    kmock.resources[LWS] = kmock.ResourceInfo(kind="LeaderWorkerSet", namespaced=True,
                                              verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                                              subresources={"status", "scale"})
    async with running_cluster(kmock) as c:
        yield c


def lws(cluster, name="tiny"):
    for (res, ns, name_), obj in cluster.kmock.objects.items():
        if res.plural == "leaderworkersets" and ns == NS and name_ == name and not obj.deleted:
            return copy.deepcopy(obj.raw)
    return None


def with_parallelism(msvc: dict, parallelism: dict) -> dict:
    msvc = copy.deepcopy(msvc)
    msvc["spec"]["parallelism"] = parallelism
    return msvc


async def test_a_pipeline_is_a_leader_worker_set_and_back(lws_cluster, tiny_samples):
    cluster = lws_cluster
    msvc, *_ = tiny_samples
    await cluster.create(with_parallelism(msvc, {"tensor": 2, "pipeline": 2}))
    group = await cluster.wait_for(lambda: lws(cluster), what="the LeaderWorkerSet")
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 2 and group["spec"]["replicas"] == 1
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-modelservice-tiny"
    assert cluster.obj("deployments", "tiny") is None
    service = await cluster.wait_for(lambda: cluster.obj("services", "tiny"), what="the Service")
    assert service["spec"]["selector"][LEADER_LABEL] == "0"
    config = loads_config(cluster.obj("configmaps", "tiny-config")["data"]["runtime.yaml"])
    assert (config.engine.tensor_parallel_size, config.engine.pipeline_parallel_size) == (2, 2)

    # Play the LeaderWorkerSet controller: the group became ready. The operator's watch of
    # LeaderWorkerSets brings it into status (replicas count groups).
    await cluster.client.merge_patch(k8s.LEADER_WORKER_SETS, NS, "tiny",
                                     {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
                                     subresource="status")
    await cluster.wait_for(lambda: cluster.condition("modelservices", "tiny", "Ready")["status"] == "True",
                           what="Ready=True from the group's readiness")
    status = cluster.obj("modelservices", "tiny")["status"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert f"{LEADER_LABEL}=0" in status["selector"]

    # Scaled: the groups follow spec.replicas.
    await cluster.patch_spec("modelservices", "tiny", {"replicas": 2})
    await cluster.wait_for(lambda: lws(cluster)["spec"]["replicas"] == 2, what="two groups")

    # One stage again: a Deployment, and the LeaderWorkerSet is deleted (never two serving stacks).
    await cluster.patch_spec("modelservices", "tiny", {"parallelism": {"tensor": 2, "pipeline": 1}})
    deployment = await cluster.wait_for(lambda: cluster.obj("deployments", "tiny"), what="the Deployment")
    assert deployment["spec"]["replicas"] == 2
    await cluster.wait_for(lambda: lws(cluster) is None, what="the LeaderWorkerSet deleted")
    # (The Service's selector loses the leader label by server-side apply on a real server; the
    # emulator's PATCH merges dicts, so it cannot show that here: test_parallelism.py does.)


async def test_without_the_crd_a_condition_and_an_event_and_nothing_changes(cluster, tiny_samples):
    msvc, *_ = tiny_samples
    await cluster.create(msvc)
    deployment = await cluster.wait_for(lambda: cluster.obj("deployments", "tiny"), what="the Deployment")
    config = cluster.obj("configmaps", "tiny-config")

    await cluster.patch_spec("modelservices", "tiny", {"parallelism": {"pipeline": 2}})
    ready = await cluster.wait_for(
        lambda: (c := cluster.condition("modelservices", "tiny", "Ready")) and c["reason"] == "LeaderWorkerSetUnavailable"
        and c, what="Ready=False LeaderWorkerSetUnavailable")
    assert ready["status"] == "False" and "leaderworkerset.x-k8s.io/v1" in ready["message"]
    assert cluster.condition("modelservices", "tiny", "Degraded")["reason"] == "LeaderWorkerSetUnavailable"
    [event] = await cluster.wait_for(lambda: cluster.events_about("ModelService", "tiny", "LeaderWorkerSetUnavailable"),
                                     what="the Warning Event")
    assert event["type"] == "Warning" and "spec.parallelism.pipeline is 2" in event["message"]
    # What ran keeps running: the old Deployment and config are untouched.
    assert cluster.obj("deployments", "tiny") == deployment
    assert cluster.obj("configmaps", "tiny-config") == config
    assert lws(cluster) is None
