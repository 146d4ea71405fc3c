"""spec.parallelism (pure): what the builders render for each layout, checked against the
upstream LeaderWorkerSet CRD's schema (../shared/k8s/thirdparty-crds); the planner's switch
between a Deployment and a LeaderWorkerSet; status and the autoscaler with groups as replicas."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from tokenlane.operator.api import schema
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.operator.controllers import scaling
from tokenlane.operator.desired import builders, planner
from tokenlane.operator.desired import status as status_mod
from tokenlane.operator.policy import rollout
from tokenlane.runtime.config import loads_config

# As tests/cluster/cluster_harness.py finds ../shared/k8s.
SHARED_K8S = Path(os.environ.get("TOKENLANE_SHARED_K8S", Path(__file__).resolve().parents[2].parent / "shared" / "k8s"))
UPSTREAM_CRD = SHARED_K8S / "thirdparty-crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LEADER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GATEWAY = {"inferencePool": {"enabled": True, "endpointPicker": {"service": "epp"}}}


def msvc(parallelism=None, gpus=1, **extra):
    spec = {"model": {"path": "/models/base"}, "gpus": {"count": gpus}, **extra}
    if parallelism is not None:
        spec["parallelism"] = parallelism
    return parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 3},
                                "spec": spec})


def objects(desired, kind):
    return [o for o in desired.objects if o["kind"] == kind]


def only(desired, kind, name="m"):
    [obj] = [o for o in objects(desired, kind) if o["metadata"]["name"] == name]
    return obj


def engine_of(desired) -> dict:
    config = yaml.safe_load(only(desired, "ConfigMap", "m-config")["data"]["runtime.yaml"])
    return config["engine"]


@pytest.fixture(scope="module")
def upstream_schema():
    if not UPSTREAM_CRD.exists():
        pytest.skip(f"the upstream LeaderWorkerSet CRD is not at {UPSTREAM_CRD}")
    crd = yaml.load(UPSTREAM_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def upstream_failures(upstream_schema, obj) -> list[str]:
    """What the API server's structural schema would refuse (the CRD carries no CEL rules)."""
    validator = jsonschema.Draft4Validator(schema.to_jsonschema(upstream_schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


# (id, spec.parallelism, gpus.count) -> (workload kind, group size, runtime.yaml engine keys, GPUs per pod)
LAYOUTS = [
    ("unset", None, 1, "Deployment", None, {}, 1),
    ("explicit ones", {"tensor": 1, "pipeline": 1}, 1, "Deployment", None, {}, 1),
    ("tensor 4", {"tensor": 4}, 4, "Deployment", None, {"tensorParallelSize": 4}, 4),
    ("tensor 2 on the CPU", {"tensor": 2}, 0, "Deployment", None, {"tensorParallelSize": 2}, 0),
    ("pipeline 2", {"pipeline": 2}, 1, "LeaderWorkerSet", 2, {"pipelineParallelSize": 2}, 1),
    ("tensor 2 x pipeline 2", {"tensor": 2, "pipeline": 2}, 2, "LeaderWorkerSet", 2,
     {"tensorParallelSize": 2, "pipelineParallelSize": 2}, 2),
    ("pipeline 4 on the CPU", {"pipeline": 4}, 0, "LeaderWorkerSet", 4, {"pipelineParallelSize": 4}, 0),
]


@pytest.mark.parametrize("what,parallelism,gpus,kind,size,engine_keys,gpus_per_pod", LAYOUTS,
                         ids=[c[0] for c in LAYOUTS])
def test_layouts(what, parallelism, gpus, kind, size, engine_keys, gpus_per_pod):
    desired = builders.build(msvc(parallelism, gpus, replicas=3), [])
    [workload] = [o for o in desired.objects if o["kind"] in ("Deployment", "LeaderWorkerSet")]
    assert (workload["kind"], workload["metadata"]["name"], workload["spec"]["replicas"]) == (kind, "m", 3)
    engine = engine_of(desired)
    assert {k: engine[k] for k in ("tensorParallelSize", "pipelineParallelSize") if k in engine} == engine_keys
    config = loads_config(only(desired, "ConfigMap", "m-config")["data"]["runtime.yaml"])
    assert (config.engine.tensor_parallel_size, config.engine.pipeline_parallel_size) == \
        (engine_keys.get("tensorParallelSize"), engine_keys.get("pipelineParallelSize"))  # unset: None
    if kind == "LeaderWorkerSet":
        assert workload["spec"]["leaderWorkerTemplate"]["size"] == size
        templates = [workload["spec"]["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate")]
    else:
        templates = [workload["spec"]["template"]]
    for template in templates:
        limits = template["spec"]["containers"][0]["resources"].get("limits") or {}
        assert limits.get("nvidia.com/gpu", 0) == gpus_per_pod


def test_no_parallelism_keeps_the_restart_hash_and_every_object():
    """Existing ModelServices render byte for byte as before: no engine key, the same hash."""
    before = builders.build(msvc(), [])
    for layout in ({"tensor": 1}, {"pipeline": 1}, {"tensor": 1, "pipeline": 1}):
        after = builders.build(msvc(layout), [])
        assert after.objects == before.objects
        assert after.shared.config.restart_hash() == before.shared.config.restart_hash()
    assert builders.build(msvc({"tensor": 2}, 2), []).shared.config.restart_hash() != \
        before.shared.config.restart_hash()


def test_the_leader_worker_set(upstream_schema):
    model = msvc({"tensor": 2, "pipeline": 3}, 2, replicas=2, gateway=GATEWAY)
    desired = builders.build(model, [])
    lws = only(desired, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert not upstream_failures(upstream_schema, lws)
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its workers joined
    owner = lws["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ModelService", "u-1", True)
    leader, worker = (spec["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate"))
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    # The same pods but for the probes, the rendezvous port and the scrape annotations.
    for key in ("image", "command", "args", "env", "resources", "volumeMounts", "startupProbe", "livenessProbe"):
        assert lc[key] == wc[key], key
    assert leader["spec"]["volumes"] == worker["spec"]["volumes"]
    assert leader["metadata"]["labels"] == worker["metadata"]["labels"]
    assert leader["metadata"]["annotations"][builders.ANNOTATION_RESTART_HASH] == \
        worker["metadata"]["annotations"][builders.ANNOTATION_RESTART_HASH]
    assert lc["args"][:3] == ["serve", "--config", "/etc/tokenlane/runtime.yaml"]
    assert {"name": "TOKENLANE_DIST_PORT", "value": "29500"} in lc["env"]
    assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in lc["ports"]
    assert [p["name"] for p in wc["ports"]] == ["http"]
    assert lc["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert wc["readinessProbe"]["httpGet"]["path"] == "/health"  # workers serve no API
    assert all(c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"} for c in (lc, wc))
    assert "prometheus.io/scrape" in leader["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]  # workers export no /metrics
    assert {"name": "shm", "mountPath": "/dev/shm"} in lc["volumeMounts"]
    assert {"name": "config", "configMap": {"name": "m-config"}} in leader["spec"]["volumes"]

    # The Service and the InferencePool send requests to the groups' leaders only; the
    # PodDisruptionBudget counts every pod of the pool.
    pod_labels = leader["metadata"]["labels"]
    leaders = {**builders.selector_labels(model, "shared"), LEADER_LABEL: "0"}
    assert only(desired, "Service")["spec"]["selector"] == leaders
    assert only(desired, "InferencePool")["spec"]["selector"]["matchLabels"] == leaders
    pdb = only(desired, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert LEADER_LABEL not in pdb and pdb.items() <= pod_labels.items()
    # The labels the LeaderWorkerSet controller sets are its own: never in the templates.
    assert LEADER_LABEL not in pod_labels


def test_dedicated_lanes_are_groups_too():
    lane = parse_serving_lane({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
                               "metadata": {"name": "batch", "namespace": "ns", "uid": "l-1"},
                               "spec": {"modelServiceRef": {"name": "m"}, "isolation": "dedicated",
                                        "dedicated": {"replicas": 2}}})
    desired = builders.build(msvc({"pipeline": 2}), [lane])
    assert {o["metadata"]["name"] for o in objects(desired, "LeaderWorkerSet")} == {"m", "m-batch"}
    assert not objects(desired, "Deployment")
    assert only(desired, "LeaderWorkerSet", "m-batch")["spec"]["replicas"] == 2
    assert only(desired, "Service", "m-batch")["spec"]["selector"][LEADER_LABEL] == "0"


def test_the_router_stays_a_deployment():
    desired = builders.build(msvc({"pipeline": 2}, router={"enabled": True}), [])
    assert [o["metadata"]["name"] for o in objects(desired, "Deployment")] == ["m-router"]
    assert [o["metadata"]["name"] for o in objects(desired, "LeaderWorkerSet")] == ["m"]


BAD = [
    ({"tensor": 2}, 1, "gpus.count must equal parallelism.tensor"),
    ({"tensor": 4, "pipeline": 2}, 8, "gpus.count must equal parallelism.tensor"),
    ({"tensor": 0}, 0, "tensor"),
    ({"pipeline": 65}, 1, "pipeline"),
    ({"tensor": 17}, 0, "tensor"),
    ({"data": 2}, 1, "unknown field"),
]


@pytest.mark.parametrize("parallelism,gpus,message", BAD, ids=[str(c[0]) for c in BAD])
def test_bad_parallelism_is_refused_naming_the_field(parallelism, gpus, message):
    with pytest.raises(ValueError, match="spec.parallelism") as err:
        msvc(parallelism, gpus)
    assert message in str(err.value)


def test_simulated_executor_cannot_run_ranks():
    """The runtime's own rule, through the builders: the operator refuses the spec with it."""
    with pytest.raises(ValueError, match="tensorParallelSize"):
        builders.build(msvc({"tensor": 2}, 2, engine={"executor": "simulated"}), [])


# --------------------------------------------------------------------------- planner


def _stored(desired) -> list[dict]:
    """The objects as a server without managed fields stores them (the planner compares subsets)."""
    return copy.deepcopy(desired.objects)


@pytest.mark.parametrize("before,after,created,deleted", [
    (None, {"pipeline": 2}, "LeaderWorkerSet", "Deployment"),
    ({"pipeline": 2}, None, "Deployment", "LeaderWorkerSet"),
], ids=["to groups", "back to a deployment"])
def test_switching_deletes_the_other_kind(before, after, created, deleted):
    old = _stored(builders.build(msvc(before), []))
    new = builders.build(msvc(after), []).objects
    actions = planner.plan(new, old, "m")
    verbs = [(a.verb, a.key[1]) for a in actions]
    assert ("create", created) in verbs and verbs[-1] == ("delete", deleted)
    assert ("apply", "Service") in verbs  # its selector: leaders only, or every pod
    assert [v for v in verbs if v[0] == "delete"] == [("delete", deleted)]  # no two serving stacks
    assert planner.plan(new, _stored(builders.build(msvc(after), [])), "m") == []  # then steady


def test_scaling_changes_only_the_replicas():
    two = builders.build(msvc({"pipeline": 2}, replicas=2), []).objects
    three = builders.build(msvc({"pipeline": 2}, replicas=3), []).objects
    actions = planner.plan(three, copy.deepcopy(two), "m")
    assert [(a.verb, a.key[1]) for a in actions] == [("apply", "LeaderWorkerSet")]
    # Not a new revision for the rollout guard: replicas are left out of it.
    assert rollout.revision_of(two) == rollout.revision_of(three)


# --------------------------------------------------------------------------- status and the autoscaler


def _lws_status(replicas, ready, updated):
    return {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
            "conditions": [{"type": "Available", "status": "True"}]}


def test_status_counts_groups_and_selects_leaders():
    model = msvc({"pipeline": 2}, replicas=2)
    desired = builders.build(model, [])
    lws = {**only(desired, "LeaderWorkerSet"), "status": _lws_status(2, 1, 2)}
    status = status_mod.model_service_status(model, desired, {"m": lws}, "2026-01-01T00:00:00Z")
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 1, 2)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodsNotReady") and "m 1/2 ready" in ready["message"]
    assert status["selector"] == builders.selector_string({**builders.selector_labels(model, "shared"),
                                                           LEADER_LABEL: "0"})
    lws["status"] = _lws_status(2, 2, 2)
    status = status_mod.model_service_status(model, desired, {"m": lws}, "2026-01-01T00:00:00Z")
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "True"


def test_the_autoscaler_reads_the_groups():
    autoscaling = {"enabled": True, "maxReplicas": 4, "prometheusUrl": "http://prometheus:9090"}
    model = msvc({"pipeline": 2}, replicas=2, autoscaling=autoscaling)
    lws = {"kind": "LeaderWorkerSet", "metadata": {"name": "m"}, "spec": {"replicas": 3},
           "status": _lws_status(3, 2, 3)}
    # A Deployment left over from before the switch is not the pool.
    stale = {"kind": "Deployment", "metadata": {"name": "m"}, "spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    assert scaling._shared_deployment_replicas([stale, lws], model) == 3
    sample = scaling.fleet_sample({}, 0.0, 60.0, {})
    assert scaling.with_ready_replicas(sample, [stale, lws], model).ready_replicas == 2
    # The decision's replicas are rendered as the LeaderWorkerSet's (groups).
    decided = parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                   "metadata": {"name": "m", "namespace": "ns", "uid": "u-1"},
                                   "spec": model.spec, "status": {"autoscaling": {"desiredReplicas": 4}}})
    assert only(builders.build(decided, []), "LeaderWorkerSet")["spec"]["replicas"] == 4
