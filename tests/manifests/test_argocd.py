"""Argo CD: the Lua health checks give the right status for ModelService and ServingLane
objects in every state the operator writes, argocd-cm carries exactly those scripts, and the
Applications point at paths that render."""

from __future__ import annotations

import copy

import pytest
from manifests_helpers import MANIFESTS, ROOT, render

lupa = pytest.importorskip("lupa", reason="lupa (a Python Lua runtime) runs the health scripts")

HEALTH = MANIFESTS / "argocd" / "health"
SCRIPTS = {"ModelService": HEALTH / "modelservice.lua", "ServingLane": HEALTH / "servinglane.lua"}


def run_health(kind: str, obj: dict) -> dict:
    """Run the script the way Argo CD does: `obj` is a global table, the chunk returns hs."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPTS[kind].read_text())
    return {"status": result["status"], "message": result["message"]}


def _cond(type_: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


def _obj(kind: str, generation: int = 2, status: dict | None = None) -> dict:
    obj = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": kind,
           "metadata": {"name": "llm", "namespace": "tokenlane", "generation": generation},
           "spec": {}}
    if status is not None:
        obj["status"] = status
    return obj


READY = _cond("Ready", "True", "AllReplicasReady", "2/2 pods ready")
NOT_READY = _cond("Ready", "False", "PodsStarting", "0/2 pods ready")
PROGRESSING = _cond("Progressing", "True", "RollingOut", "new pod template rolling out")
NOT_PROGRESSING = _cond("Progressing", "False", "RolloutComplete")
DEGRADED = _cond("Degraded", "True", "InvalidSpec", "scheduler.prefillChunkSize exceeds maxBatchedTokens")
NOT_DEGRADED = _cond("Degraded", "False", "AsExpected")
ROLLED_BACK = _cond("RolledBack", "True", "SLORegression", "ttft p95 1.9s > 1.2x the previous 0.4s")
SLO_MISSED = _cond("SLOMet", "False", "TTFTAboveTarget", "ttft p95 0.9s > 0.5s")

CASES = [
    # (name, status, expected health, a word the message must contain)
    ("no status yet", None, "Progressing", "operator"),
    ("generation not observed", {"observedGeneration": 1, "conditions": [READY]}, "Progressing", "generation 2"),
    ("no observedGeneration", {"conditions": [READY]}, "Progressing", "generation 2"),
    ("ready", {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2,
               "conditions": [READY, NOT_PROGRESSING, NOT_DEGRADED]}, "Healthy", ""),
    ("rolling out", {"observedGeneration": 2, "conditions": [READY, PROGRESSING, NOT_DEGRADED]},
     "Progressing", "rolling out"),
    ("pods starting", {"observedGeneration": 2, "conditions": [NOT_READY]}, "Progressing", "PodsStarting"),
    ("no conditions", {"observedGeneration": 2}, "Progressing", ""),
    ("degraded", {"observedGeneration": 2, "conditions": [NOT_READY, DEGRADED]}, "Degraded", "InvalidSpec"),
    ("degraded wins over progressing", {"observedGeneration": 2, "conditions": [PROGRESSING, DEGRADED]},
     "Degraded", "prefillChunkSize"),
    ("rolled back while ready", {"observedGeneration": 2, "conditions": [READY, ROLLED_BACK]},
     "Degraded", "SLORegression"),
    ("rolled back flag cleared", {"observedGeneration": 2,
                                  "conditions": [READY, _cond("RolledBack", "False", "Recovered")]},
     "Healthy", ""),
]


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
@pytest.mark.parametrize("name,status,expected,word", CASES, ids=[c[0] for c in CASES])
def test_health(kind, name, status, expected, word):
    health = run_health(kind, _obj(kind, status=copy.deepcopy(status)))
    assert health["status"] == expected, (name, health)
    assert word in health["message"], (name, health)


def test_model_service_reports_ready_replicas():
    status = {"observedGeneration": 2, "replicas": 3, "readyReplicas": 3, "conditions": [READY]}
    assert run_health("ModelService", _obj("ModelService", status=status))["message"] == "3/3 replicas ready"


def test_lane_missing_its_slo_is_healthy_but_says_so():
    # An SLO miss is for alerts and the tuner, not a sync failure; the message shows it.
    status = {"observedGeneration": 2, "conditions": [_cond("Ready", "True", "Served"), SLO_MISSED]}
    health = run_health("ServingLane", _obj("ServingLane", status=status))
    assert health["status"] == "Healthy" and "TTFTAboveTarget" in health["message"]


def test_lane_whose_model_service_is_missing_is_degraded():
    status = {"observedGeneration": 2, "conditions": [
        _cond("Ready", "False", "ModelServiceNotFound", "no ModelService llm"),
        _cond("Degraded", "True", "ModelServiceNotFound", "no ModelService llm")]}
    assert run_health("ServingLane", _obj("ServingLane", status=status))["status"] == "Degraded"


def test_operator_condition_types_are_the_ones_the_scripts_read():
    """The scripts read the condition types the CRDs document."""
    crd_text = (ROOT / "crds" / "modelservices.tokenlane.dev.yaml")
    if not crd_text.exists():
        pytest.skip("CRDs not generated yet")
    for kind, script in SCRIPTS.items():
        text = script.read_text()
        for type_ in ("Ready", "Progressing", "Degraded", "RolledBack"):
            assert f'condition("{type_}")' in text, (kind, type_)
            assert type_ in crd_text.read_text()


def test_argocd_cm_carries_the_scripts_verbatim():
    (cm,) = [o for o in render("manifests/argocd") if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["name"] == "argocd-cm" and cm["metadata"]["namespace"] == "argocd"
    assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "argocd"
    for kind, script in SCRIPTS.items():
        assert cm["data"][f"resource.customizations.health.tokenlane.dev_{kind}"] == script.read_text()


def test_applications_point_at_paths_that_render_and_ignore_nothing():
    apps = [o for o in render("manifests/argocd") if o["kind"] == "Application"]
    assert {a["metadata"]["name"] for a in apps} == {"tokenlane-platform", "tokenlane-models"}
    waves = {a["metadata"]["name"]: int(a["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"]) for a in apps}
    assert waves["tokenlane-platform"] < waves["tokenlane-models"]
    for app in apps:
        spec = app["spec"]
        assert "ignoreDifferences" not in spec, "the operator never writes spec: nothing to ignore"
        path = spec["source"]["path"]
        assert (ROOT / path / "kustomization.yaml").exists(), f"{app['metadata']['name']}: {path} has no kustomization"
        assert render(path)
        assert spec["destination"]["server"] == "https://kubernetes.default.svc"


def _operator_objects(deployment_status: dict | None, replicas: int | None = None):
    """The CPU sample's ModelService and lanes with the status the operator itself computes
    (operator/desired/status.py) for a given state of the shared Deployment."""
    model = pytest.importorskip("tokenlane.operator.api.resources")
    builders = pytest.importorskip("tokenlane.operator.desired.builders")
    status = pytest.importorskip("tokenlane.operator.desired.status")
    from manifests_helpers import SAMPLE, load_yaml_docs

    docs = load_yaml_docs(SAMPLE)
    for doc in docs:
        doc["metadata"]["generation"] = 3
    (msvc_body,) = [d for d in docs if d["kind"] == "ModelService"]
    if replicas is not None:
        msvc_body["spec"]["replicas"] = replicas
    lane_bodies = [d for d in docs if d["kind"] == "ServingLane"]
    msvc = model.parse_model_service(msvc_body)
    lanes = [model.parse_serving_lane(body) for body in lane_bodies]
    desired = builders.build(msvc, lanes)
    deployments = {} if deployment_status is None else {desired.pools[0].object_name: {"status": deployment_status}}
    now = "2026-01-01T00:00:00Z"
    msvc_body["status"] = status.model_service_status(msvc, desired, deployments, now)
    for body, lane in zip(lane_bodies, lanes):
        body["status"] = status.lane_status(lane, msvc, desired, deployments, now)
    return msvc_body, lane_bodies


DEPLOYMENT_STATES = [
    ("ready", {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}, "Healthy"),
    ("pods starting", {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1}, "Progressing"),
    ("no deployment yet", None, "Progressing"),
    ("progress deadline exceeded", {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": "ReplicaSet tiny-abc has timed out progressing"}]}, "Degraded"),
]


@pytest.mark.parametrize("name,deployment_status,expected", DEPLOYMENT_STATES, ids=[s[0] for s in DEPLOYMENT_STATES])
def test_health_of_the_status_the_operator_really_writes(name, deployment_status, expected):
    msvc, lanes = _operator_objects(deployment_status)
    assert run_health("ModelService", msvc)["status"] == expected, msvc["status"]["conditions"]
    for lane in lanes:
        assert run_health("ServingLane", lane)["status"] == expected, lane["status"]["conditions"]


def test_a_model_service_scaled_to_zero_is_healthy():
    msvc, _ = _operator_objects({"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}, replicas=0)
    assert any(c["reason"] == "ScaledToZero" for c in msvc["status"]["conditions"]), msvc["status"]
    assert run_health("ModelService", msvc)["status"] == "Healthy"


def test_health_of_a_lane_the_operator_finds_orphaned_or_invalid():
    model = pytest.importorskip("tokenlane.operator.api.resources")
    status = pytest.importorskip("tokenlane.operator.desired.status")
    _, lanes = _operator_objects(None)
    body = lanes[0]
    lane = model.parse_serving_lane(body)
    orphan = {**body, "status": status.lane_status(lane, None, None, {}, "2026-01-01T00:00:00Z")}
    health = run_health("ServingLane", orphan)
    assert health["status"] == "Degraded" and "ModelServiceNotFound" in health["message"]
    invalid = {**body, "status": status.invalid_status({}, 3, "spec.class: 'x' is not one of [...]", "2026-01-01T00:00:00Z")}
    assert run_health("ServingLane", invalid)["status"] == "Degraded"
