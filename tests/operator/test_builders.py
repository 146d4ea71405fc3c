"""Builders: table-driven checks of the rendered objects and runtime configs (pure, no cluster)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tokenlane.operator.desired import builders
from tokenlane.operator.desired.builders import Overrides, build
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.runtime.config import loads_config

ROOT = Path(__file__).resolve().parents[2]


def _docs(name):
    return [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / name).read_text())
            if d and d.get("kind") in ("ModelService", "ServingLane")]


def _parse(docs, uid="u-1"):
    msvc_doc = copy.deepcopy(docs[0])
    msvc_doc["metadata"]["uid"] = uid
    return parse_model_service(msvc_doc), [parse_serving_lane(d) for d in docs[1:]]


@pytest.fixture
def llama():
    return _parse(_docs("llama3-8b.yaml"))


@pytest.fixture
def tiny():
    return _parse(_docs("tiny-cpu.yaml"))


def by_kind(desired, kind, name=None):
    objs = [o for o in desired.objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return objs[0] if name else objs


def container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_object_set_for_three_lanes(llama):
    msvc, lanes = llama
    desired = build(msvc, lanes)
    names = [(o["kind"], o["metadata"]["name"]) for o in desired.objects]
    assert names == [
        ("ConfigMap", "llama3-8b-config"), ("ConfigMap", "llama3-8b-long-context-config"),
        ("Deployment", "llama3-8b"), ("Service", "llama3-8b"),
        ("Deployment", "llama3-8b-long-context"), ("Service", "llama3-8b-long-context"),
        ("PodDisruptionBudget", "llama3-8b"),
    ]
    with_sm = build(msvc, lanes, service_monitor_available=True)
    assert [o["metadata"]["name"] for o in with_sm.objects if o["kind"] == "ServiceMonitor"] == [
        "llama3-8b", "llama3-8b-long-context"]


def test_runtime_yaml_is_loadable_by_the_runtime(llama):
    msvc, lanes = llama
    desired = build(msvc, lanes)
    shared = loads_config(by_kind(desired, "ConfigMap", "llama3-8b-config")["data"]["runtime.yaml"])
    assert [l.name for l in shared.lanes] == ["interactive", "batch"]  # priority order
    assert shared.lane_budgets("interactive").max_active_sequences == 96
    assert shared.lane_budgets("batch").queue_timeout_ms == 600000
    assert shared.scheduler.kv_cache_high_watermark == 0.88
    assert shared.tenants[0].lanes == ["interactive"]  # long-context is served elsewhere
    dedicated = loads_config(by_kind(desired, "ConfigMap", "llama3-8b-long-context-config")["data"]["runtime.yaml"])
    assert [l.name for l in dedicated.lanes] == ["long-context"]
    assert dedicated.lanes[0].default and dedicated.lanes[0].match.is_empty
    assert dedicated.tenants[0].default_lane is None and dedicated.tenants[0].lanes == ["long-context"]


def test_pod_security_probes_and_scrape(llama):
    msvc, lanes = llama
    dep = by_kind(build(msvc, lanes).objects and build(msvc, lanes), "Deployment", "llama3-8b")
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/cache", "/etc/tokenlane", "/models", "/dev/shm"} <= mounts
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["memory"] == "32Gi"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["automountServiceAccountToken"] is False
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "llama3-8b-config"
    # Mounted as a folder (no subPath) so the kubelet updates the file in place: hot reload.
    assert not any(m.get("subPath") for m in c["volumeMounts"] if m["name"] == "config")
    assert dep["metadata"]["ownerReferences"][0] == {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                                     "name": "llama3-8b", "uid": "u-1", "controller": True,
                                                     "blockOwnerDeletion": True}


def test_cpu_only_tiny_model(tiny):
    msvc, lanes = tiny
    dep = by_kind(build(msvc, lanes), "Deployment", "tiny")
    c = container(dep)
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "/dev/shm" not in {m["mountPath"] for m in c["volumeMounts"]}
    init = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"] == ["make-tiny-model", "/models/tiny-llama", "--arch", "llama"]
    assert init["securityContext"]["readOnlyRootFilesystem"]


@pytest.mark.parametrize("change,restarts", [
    ({"scheduler": {"maxBatchedTokens": 4096}}, False),
    ({"scheduler": {"kvCacheHighWatermark": 0.8}}, False),
    ({"tenants": []}, False),
    ({"model": {"maxModelLen": 16384}}, True),
    ({"engine": {"continuousBatching": False}}, True),
    ({"engine": {"blockSize": 32}}, True),
])
def test_restart_hash_covers_only_restart_fields(llama, change, restarts):
    msvc, lanes = llama
    before = build(msvc, lanes)
    spec = copy.deepcopy(msvc.spec)
    for section, values in change.items():
        if isinstance(values, dict):
            spec[section].update(values)
        else:
            spec[section] = values
    after = build(type(msvc)(ref=msvc.ref, spec=spec), lanes)
    h = lambda d: by_kind(d, "Deployment", "llama3-8b")["spec"]["template"]["metadata"]["annotations"][
        builders.ANNOTATION_RESTART_HASH]
    assert (h(before) != h(after)) is restarts
    template = lambda d: by_kind(d, "Deployment", "llama3-8b")["spec"]["template"]
    if not restarts:
        assert template(before) == template(after)  # no pod roll for budget changes
        assert by_kind(before, "ConfigMap", "llama3-8b-config") != by_kind(after, "ConfigMap", "llama3-8b-config")


def test_overrides_flow_into_config_and_effective_budgets(llama):
    msvc, lanes = llama
    overrides = Overrides(scheduler={"maxBatchedTokens": 6144}, lanes={"interactive": {"prefillChunkSize": 256}})
    desired = build(msvc, lanes, overrides=overrides)
    cfg = loads_config(by_kind(desired, "ConfigMap", "llama3-8b-config")["data"]["runtime.yaml"])
    assert cfg.scheduler.max_batched_tokens == 6144 and cfg.lane("interactive").prefill_chunk_size == 256
    eb = desired.effective_budgets
    assert eb["scheduler"]["maxBatchedTokens"] == 6144
    assert eb["lanes"]["interactive"]["prefillChunkSize"] == 256
    assert eb["lanes"]["long-context"]["pool"] == "long-context"
    assert Overrides.from_status({"overrides": {"lanes": {"batch": {"maxWaitingRequests": 10}}}}).lanes == {
        "batch": {"maxWaitingRequests": 10}}
    with pytest.raises(ValueError):
        build(msvc, lanes, overrides=Overrides(scheduler={"kvCacheHighWatermark": 0.99}))


def _lane(name, **spec):
    return parse_serving_lane({"metadata": {"name": name, "namespace": "tokenlane-demo"},
                               "spec": {"modelServiceRef": {"name": "llama3-8b"}, **spec}})


@pytest.mark.parametrize("extra,rejected,reason", [
    (dict(laneName="interactive"), True, "already used"),
    (dict(default=True), True, "already has a default lane"),
    (dict(budgets={"maxBatchedTokens": 100, "prefillChunkSize": 200}), None, None),  # CEL rule: parse fails
    (dict(match={"tenants": ["nobody"]}), True, "unknown tenant"),
    (dict(**{"class": "batch"}), False, None),
])
def test_lane_admission(llama, extra, rejected, reason):
    msvc, lanes = llama
    if rejected is None:
        with pytest.raises(ValueError):
            _lane("zz-extra", **extra)
        return
    desired = build(msvc, lanes + [_lane("zz-extra", **extra)])
    assert ("zz-extra" in desired.rejected) is rejected
    if reason:
        assert reason in desired.rejected["zz-extra"]
    assert {l.lane_name for l in desired.admitted} >= {"interactive", "long-context", "batch"}


def test_lanes_of_other_services_and_deleting_lanes_are_ignored(llama):
    msvc, lanes = llama
    other = parse_serving_lane({"metadata": {"name": "x"}, "spec": {"modelServiceRef": {"name": "other"}}})
    deleting = parse_serving_lane({"metadata": {"name": "y", "deletionTimestamp": "2026-01-01T00:00:00Z"},
                                   "spec": {"modelServiceRef": {"name": "llama3-8b"}}})
    desired = build(msvc, lanes + [other, deleting])
    assert {l.ref.name for l in desired.admitted} == {l.ref.name for l in lanes}


def test_no_uid_no_owner_reference(llama):
    msvc, lanes = _parse(_docs("llama3-8b.yaml"), uid=None)
    assert all("ownerReferences" not in o["metadata"] for o in build(msvc, lanes).objects)


def test_long_names_are_refused(llama):
    msvc, lanes = llama
    long_lane = _lane("l", laneName="a" * 60, isolation="dedicated")
    desired_names = None
    with pytest.raises(ValueError, match="longer than 63"):
        build(msvc, [long_lane])
    assert desired_names is None
