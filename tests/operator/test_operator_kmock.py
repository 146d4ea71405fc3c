"""The kopf operator against the kmock Kubernetes emulator over real HTTP (loopback).

Scenarios: create, update (budgets hot-reload without a restart hash change; model change
changes it), lane add / remove / dedicated, delete, invalid spec, missing parent, and the
status written back (observedGeneration, selector, effective budgets, conditions).
"""

from __future__ import annotations

import copy

import pytest
from operator_harness import operator_writes, spec_writes  # tests/operator, put on sys.path by conftest

from tokenlane.operator.desired.builders import ANNOTATION_RESTART_HASH
from tokenlane.runtime.config import loads_config

pytestmark = pytest.mark.timeout(60)


def runtime_yaml(cluster, name="tiny-config"):
    cm = cluster.obj("configmaps", name)
    return loads_config(cm["data"]["runtime.yaml"]) if cm else None


def restart_hash(cluster, name="tiny"):
    dep = cluster.obj("deployments", name)
    return dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_RESTART_HASH]


async def test_create_renders_objects_and_status(cluster, tiny_samples):
    msvc, *lanes = tiny_samples
    await cluster.create(msvc)
    for lane in lanes:
        await cluster.create(lane)

    status = await cluster.wait_for(lambda: (cluster.obj("modelservices", "tiny").get("status") or {})
                                    .get("lanes") == 2 and cluster.obj("modelservices", "tiny")["status"],
                                    what="ModelService status")
    assert [l.name for l in runtime_yaml(cluster).lanes] == ["interactive", "batch"]
    dep = cluster.obj("deployments", "tiny")
    assert dep["spec"]["replicas"] == 1
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ModelService" and owner["uid"] == "uid-modelservice-tiny" and owner["controller"]
    assert cluster.obj("services", "tiny")["spec"]["ports"][0]["port"] == 8000
    assert cluster.obj("poddisruptionbudgets", "tiny")["spec"]["maxUnavailable"] == 1
    assert status["observedGeneration"] == 1
    assert status["selector"] == ("app.kubernetes.io/component=runtime,app.kubernetes.io/instance=tiny,"
                                  "tokenlane.dev/pool=shared")
    assert status["effectiveBudgets"]["lanes"]["interactive"]["maxActiveSequences"] == 8
    assert status["effectiveBudgets"]["lanes"]["batch"]["queueTimeoutMs"] == 600000
    ready = {c["type"]: c for c in status["conditions"]}
    assert ready["Ready"]["status"] == "False" and ready["Ready"]["reason"] == "PodsNotReady"  # no pods in kmock
    assert ready["Degraded"]["status"] == "False"
    lane_status = await cluster.wait_for(lambda: cluster.obj("servinglanes", "tiny-batch").get("status", {})
                                         .get("effectiveBudgets"), what="lane status")
    assert lane_status["maxWaitingRequests"] == 48  # the lane's cap, below the global 64


async def test_deployment_readiness_flows_into_status(cluster, tiny_samples):
    msvc, *lanes = tiny_samples
    await cluster.create(msvc)
    await cluster.wait_for(lambda: cluster.obj("deployments", "tiny"), what="Deployment")
    # Play the Deployment controller: the pods became ready.
    from tokenlane.operator.clients import kube as k8s
    await cluster.client.merge_patch(k8s.DEPLOYMENTS, "tokenlane-demo", "tiny",
                                     {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
                                     subresource="status")
    await cluster.wait_for(lambda: cluster.condition("modelservices", "tiny", "Ready")["status"] == "True",
                           what="Ready=True")
    st = cluster.obj("modelservices", "tiny")["status"]
    assert st["readyReplicas"] == 1 and st["replicas"] == 1


async def test_budget_update_hot_reloads_without_restart(cluster, tiny_samples):
    msvc, interactive, _ = tiny_samples
    await cluster.create(msvc)
    await cluster.create(interactive)
    # Status is written after every object is applied: waiting for it avoids racing the applies.
    await cluster.wait_for(lambda: (cluster.obj("modelservices", "tiny").get("status") or {}).get("lanes") == 1)
    before = restart_hash(cluster)
    cm_before = cluster.obj("configmaps", "tiny-config")["metadata"]["annotations"]["tokenlane.dev/config-hash"]

    await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"maxBatchedTokens": 1024}})
    await cluster.wait_for(lambda: runtime_yaml(cluster).scheduler.max_batched_tokens == 1024, what="new budget")
    assert restart_hash(cluster) == before  # budgets never restart pods
    assert cluster.obj("configmaps", "tiny-config")["metadata"]["annotations"]["tokenlane.dev/config-hash"] != cm_before
    await cluster.wait_for(lambda: cluster.obj("modelservices", "tiny")["status"]["observedGeneration"] == 2)

    # A lane budget change re-renders the ModelService's ConfigMap too.
    await cluster.patch_spec("servinglanes", "tiny-interactive", {"budgets": {"maxActiveSequences": 4}})
    await cluster.wait_for(lambda: runtime_yaml(cluster).lane("interactive").max_active_sequences == 4)
    assert restart_hash(cluster) == before

    # Scaling (what `kubectl scale msvc` / an HPA does through the scale subresource).
    await cluster.patch_spec("modelservices", "tiny", {"replicas": 3})
    await cluster.wait_for(lambda: cluster.obj("deployments", "tiny")["spec"]["replicas"] == 3, what="scaled")
    assert restart_hash(cluster) == before

    # A model change does restart them.
    await cluster.patch_spec("modelservices", "tiny", {"model": {"maxModelLen": 512}})
    await cluster.wait_for(lambda: restart_hash(cluster) != before, what="restart hash change")


async def test_lane_add_remove_and_dedicated(cluster, llama_samples):
    msvc, interactive, long_ctx, batch = llama_samples
    await cluster.create(msvc)
    await cluster.create(interactive)
    await cluster.wait_for(lambda: runtime_yaml(cluster, "llama3-8b-config"))
    await cluster.create(long_ctx)
    await cluster.create(batch)
    await cluster.wait_for(lambda: cluster.obj("services", "llama3-8b-long-context"), what="dedicated pool")
    assert cluster.obj("deployments", "llama3-8b-long-context")
    dedicated = runtime_yaml(cluster, "llama3-8b-long-context-config")
    assert [l.name for l in dedicated.lanes] == ["long-context"] and dedicated.lanes[0].default
    await cluster.wait_for(lambda: [l.name for l in runtime_yaml(cluster, "llama3-8b-config").lanes]
                           == ["interactive", "batch"])
    dep = cluster.obj("deployments", "llama3-8b")
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    st = await cluster.wait_for(lambda: cluster.obj("modelservices", "llama3-8b")["status"].get("lanes") == 3
                                and cluster.obj("modelservices", "llama3-8b")["status"])
    assert st["laneNames"] == ["batch", "interactive", "long-context"]

    # Remove the dedicated lane: its Deployment/Service/ConfigMap go away (planner deletes).
    await cluster.delete("servinglanes", "llama3-8b-long-context")
    await cluster.wait_for(lambda: cluster.obj("deployments", "llama3-8b-long-context") is None,
                           what="dedicated pool removed")
    assert cluster.obj("configmaps", "llama3-8b-long-context-config") is None
    await cluster.wait_for(lambda: cluster.obj("servinglanes", "llama3-8b-long-context") is None,
                           what="the lane's finalizer released")
    await cluster.wait_for(lambda: cluster.obj("modelservices", "llama3-8b")["status"]["lanes"] == 2)

    # Remove a shared lane: the ConfigMap drops it.
    await cluster.delete("servinglanes", "llama3-8b-batch")
    await cluster.wait_for(lambda: [l.name for l in runtime_yaml(cluster, "llama3-8b-config").lanes]
                           == ["interactive"])


async def test_missing_parent_then_parent_appears(cluster, tiny_samples):
    msvc, interactive, _ = tiny_samples
    await cluster.create(interactive)
    cond = await cluster.wait_for(lambda: cluster.condition("servinglanes", "tiny-interactive", "Ready"))
    assert cond["status"] == "False" and cond["reason"] == "ModelServiceNotFound"
    assert cluster.obj("configmaps", "tiny-config") is None
    await cluster.wait_for(lambda: any(e.get("reason") == "ModelServiceNotFound" for e in cluster.events()),
                           what="a ModelServiceNotFound event")

    await cluster.create(msvc)
    await cluster.wait_for(lambda: runtime_yaml(cluster) and [l.name for l in runtime_yaml(cluster).lanes]
                           == ["interactive"], what="lane picked up")
    await cluster.wait_for(lambda: cluster.condition("servinglanes", "tiny-interactive", "Ready")["reason"]
                           == "PodsNotReady")


async def test_invalid_specs_get_conditions_and_events(cluster, tiny_samples):
    msvc, interactive, batch = tiny_samples
    bad = copy.deepcopy(msvc)
    bad["metadata"]["name"] = "broken"
    bad["spec"]["scheduler"]["kvCacheHighWatermark"] = 0.99  # above the reject watermark 0.95
    await cluster.create(bad)
    cond = await cluster.wait_for(lambda: cluster.condition("modelservices", "broken", "Degraded"))
    assert cond["status"] == "True" and cond["reason"] == "InvalidSpec"
    assert "kvCacheHighWatermark" in cond["message"]
    assert cluster.obj("deployments", "broken") is None
    event = (await cluster.wait_for(lambda: cluster.events_about("ModelService", "broken", "InvalidSpec"),
                                    what="an InvalidSpec Event about the ModelService"))[0]
    assert event["type"] == "Warning" and "kvCacheHighWatermark" in event["message"]
    assert event["involvedObject"]["uid"] == "uid-modelservice-broken"

    # A good ModelService with one invalid lane and one lane clashing: the rest keeps working.
    await cluster.create(msvc)
    await cluster.create(interactive)
    bad_lane = copy.deepcopy(batch)
    bad_lane["spec"]["budgets"] = {"prefillChunkSize": 1024, "maxBatchedTokens": 256}
    await cluster.create(bad_lane)
    clash = copy.deepcopy(batch)
    clash["metadata"]["name"] = "tiny-interactive-2"
    clash["spec"]["laneName"] = "interactive"
    await cluster.create(clash)
    await cluster.wait_for(lambda: cluster.condition("servinglanes", "tiny-batch", "Ready")["reason"] == "InvalidSpec")
    await cluster.wait_for(lambda: cluster.condition("servinglanes", "tiny-interactive-2", "Ready")["reason"]
                           == "Rejected")
    assert [l.name for l in runtime_yaml(cluster).lanes] == ["interactive"]
    deg = await cluster.wait_for(lambda: cluster.condition("modelservices", "tiny", "Degraded")["reason"]
                                 == "LanesRejected" and cluster.condition("modelservices", "tiny", "Degraded"))
    assert deg["status"] == "True" and "already used" in deg["message"]
    # Every refusal is an Event too (uniquely named, so the emulator stores each of them).
    lane_event = (await cluster.wait_for(lambda: cluster.events_about("ServingLane", "tiny-batch", "InvalidSpec"),
                                         what="an InvalidSpec Event about the lane"))[0]
    assert lane_event["type"] == "Warning" and "prefillChunkSize" in lane_event["message"]
    rejected = (await cluster.wait_for(lambda: cluster.events_about("ServingLane", "tiny-interactive-2", "Rejected"),
                                       what="a Rejected Event about the clashing lane"))[0]
    assert "already used" in rejected["message"]
    await cluster.wait_for(lambda: cluster.events_about("ModelService", "tiny", "Reconciled"),
                           what="a Reconciled Event (posted after the status write)")

    # Fixing the lane spec admits it.
    await cluster.patch_spec("servinglanes", "tiny-batch", {"budgets": {"maxBatchedTokens": 2048}})
    await cluster.wait_for(lambda: "batch" in [l.name for l in runtime_yaml(cluster).lanes], what="fixed lane")


async def test_delete_model_service_removes_owned_objects(cluster, tiny_samples):
    msvc, interactive, _ = tiny_samples
    await cluster.create(msvc)
    await cluster.create(interactive)
    await cluster.wait_for(lambda: cluster.obj("deployments", "tiny") and cluster.obj("poddisruptionbudgets", "tiny"))
    await cluster.delete("modelservices", "tiny")
    await cluster.wait_for(lambda: not ({"tiny"} & (cluster.names("deployments") | cluster.names("services")
                                                     | cluster.names("poddisruptionbudgets")))
                           and not cluster.names("configmaps"), what="owned objects deleted")
    await cluster.wait_for(lambda: cluster.obj("modelservices", "tiny") is None, what="finalizer released")
    cond = await cluster.wait_for(lambda: cluster.condition("servinglanes", "tiny-interactive", "Ready")
                                  if cluster.condition("servinglanes", "tiny-interactive", "Ready")["reason"]
                                  == "ModelServiceNotFound" else None)
    assert cond["status"] == "False"
    lane_status = cluster.obj("servinglanes", "tiny-interactive")["status"]
    assert "endpoint" not in lane_status and "effectiveBudgets" not in lane_status  # stale keys dropped


async def test_steady_state_makes_no_writes(cluster, tiny_samples):
    msvc, interactive, _ = tiny_samples
    await cluster.create(msvc)
    await cluster.create(interactive)
    await cluster.wait_for(lambda: (cluster.obj("modelservices", "tiny").get("status") or {}).get("lanes") == 1)
    from tokenlane.operator.controllers.handlers import reconcile_model_service
    import asyncio
    await asyncio.sleep(0.5)  # let the events of our own writes settle
    # The reconcile that wrote `lanes: 1` still holds the lock while it writes the lane's
    # status and its Event: wait it out (and any queued behind it) rather than racing it.
    async with cluster.op.lock_for("tokenlane-demo", "tiny"):
        pass
    before = len(list(cluster.kmock))
    await reconcile_model_service(cluster.op, "tokenlane-demo", "tiny")
    writes = [r for r in list(cluster.kmock)[before:]
              if r.headers.get("User-Agent") == "tokenlane-operator"  # ours, not kopf's bookkeeping
              and str(getattr(r.method, "value", r.method)).upper() in ("POST", "PATCH", "PUT", "DELETE")]
    assert writes == [], [(r.method, str(r.url)) for r in writes]


async def test_api_calls_are_recorded(cluster, tiny_samples):
    """Every API call the operator makes is listed in api_calls.json (the RBAC input)."""
    msvc, interactive, _ = tiny_samples
    await cluster.create(msvc)
    await cluster.create(interactive)
    await cluster.wait_for(lambda: (cluster.obj("modelservices", "tiny").get("status") or {}).get("lanes") == 1)
    cluster.record_calls()
    missing = cluster.unlisted_calls()
    assert not missing, f"calls missing from {cluster.api_calls_file.name}; regenerate with TOKENLANE_REGEN_API_CALLS=1: {missing}"


async def test_operator_never_writes_spec(cluster, llama_samples):
    """Spec belongs to the user (GitOps): no request of the operator (kopf's or ours) carries one."""
    for doc in llama_samples:
        await cluster.create(doc)
    await cluster.wait_for(lambda: (cluster.obj("modelservices", "llama3-8b").get("status") or {}).get("lanes") == 3)
    await cluster.patch_spec("servinglanes", "llama3-8b-batch", {"priority": 20})
    await cluster.wait_for(lambda: cluster.obj("servinglanes", "llama3-8b-batch")["status"]["observedGeneration"] == 2)
    assert operator_writes(cluster.kmock), "the operator wrote nothing at all?"
    assert spec_writes(cluster.kmock) == []
