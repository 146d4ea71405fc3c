"""The operator's InferencePool and adapters against the kmock emulator: the pool is applied where
the server serves the kind (a Warning Event where it does not), and adding an adapter on a volume
already mounted rewrites the ConfigMap only, never the Deployment."""

from __future__ import annotations

import copy

import pytest

from tokenlane.operator.desired.builders import ANNOTATION_RESTART_HASH
from tokenlane.runtime.config import loads_config

pytestmark = pytest.mark.timeout(60)

POOLS = "inference.networking.k8s.io/v1/inferencepools"
GATEWAY = {"inferencePool": {"enabled": True, "endpointPicker": {"service": "tiny-epp", "failureMode": "FailOpen"}}}


def with_gateway_and_adapters(msvc: dict, adapters: list[dict]) -> dict:
    msvc = copy.deepcopy(msvc)
    msvc["spec"]["gateway"] = GATEWAY
    msvc["spec"]["adapters"] = adapters
    return msvc


def pool(cluster, name="tiny"):
    for (res, _ns, name_), obj in cluster.kmock.objects.items():
        if res.plural == "inferencepools" and name_ == name and not obj.deleted:
            return copy.deepcopy(obj.raw)
    return None


SQL = {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql"}}}
CHAT = {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "chat"}}}


async def test_pool_applied_and_adapter_added_without_touching_the_deployment(cluster, tiny_samples, kmock):
    kmock.resources[POOLS] = kmock.ResourceInfo(kind="InferencePool", namespaced=True,
                                                verbs={"get", "list", "watch", "create", "update", "patch",
                                                       "delete"})
    msvc, *_ = tiny_samples
    await cluster.create(with_gateway_and_adapters(msvc, [SQL]))
    applied = await cluster.wait_for(lambda: pool(cluster), what="InferencePool")
    assert applied["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert applied["spec"]["selector"]["matchLabels"]["tokenlane.dev/pool"] == "shared"
    assert applied["metadata"]["ownerReferences"][0]["uid"] == "uid-modelservice-tiny"
    await cluster.wait_for(lambda: cluster.obj("configmaps", "tiny-config"), what="ConfigMap")
    deployment = cluster.obj("deployments", "tiny")

    await cluster.patch_spec("modelservices", "tiny", {"adapters": [SQL, CHAT]})
    config = await cluster.wait_for(
        lambda: (c := loads_config(cluster.obj("configmaps", "tiny-config")["data"]["runtime.yaml"]))
        and len(c.model.adapters or ()) == 2 and c, what="the second adapter in runtime.yaml")
    assert [a.path for a in config.model.adapters] == ["/adapters/pvc-loras/sql", "/adapters/pvc-loras/chat"]
    after = cluster.obj("deployments", "tiny")
    assert after["spec"]["template"] == deployment["spec"]["template"]
    assert after["spec"]["template"]["metadata"]["annotations"][ANNOTATION_RESTART_HASH] == \
        deployment["spec"]["template"]["metadata"]["annotations"][ANNOTATION_RESTART_HASH]

    await cluster.patch_spec("modelservices", "tiny", {"gateway": {"inferencePool": {"enabled": False}}})
    await cluster.wait_for(lambda: pool(cluster) is None, what="the InferencePool deleted")


async def test_missing_crd_is_an_event_and_the_rest_is_rendered(cluster, tiny_samples):
    msvc, *_ = tiny_samples
    await cluster.create(with_gateway_and_adapters(msvc, []))
    event = (await cluster.wait_for(lambda: cluster.events_about("ModelService", "tiny", "InferencePoolUnavailable"),
                                    what="InferencePoolUnavailable Event"))[0]
    assert event["type"] == "Warning" and "inference.networking.k8s.io" in event["message"]
    await cluster.wait_for(lambda: cluster.obj("deployments", "tiny"), what="the Deployment")
    assert pool(cluster) is None
