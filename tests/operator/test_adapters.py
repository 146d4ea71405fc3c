"""spec.adapters and tenants[].adapters: rendered into runtime.yaml, and adding an adapter changes
only the ConfigMap (hot reload) wherever its volume or source kind is already in use (pure)."""

from __future__ import annotations

import pytest

from tokenlane.operator.api.resources import parse_model_service
from tokenlane.operator.api.spec import AdapterSourceKind
from tokenlane.operator.desired import builders
from tokenlane.runtime.config import loads_config

PVC_SQL = {"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "team-a/sql"}}}
PVC_CHAT = {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "team-b/chat/"}}}
PVC_OTHER_CLAIM = {"name": "law", "source": {"pvc": {"claimName": "legal-loras"}}}
HOST = {"name": "host", "source": {"hostPath": {"path": "/srv/loras/host"}}}
HF_A = {"name": "hf-a", "source": {"huggingFace": {"repo": "org/lora-a"}}}
HF_B = {"name": "hf-b", "source": {"huggingFace": {"repo": "org/lora-b", "revision": "v2"}}}
S3_A = {"name": "s3-a", "source": {"s3": {"uri": "s3://loras/a"}}}
S3_B = {"name": "s3-b", "source": {"s3": {"uri": "s3://loras/b"}}}

PVC_MODEL = {"path": "/models/base", "source": {"pvc": {"claimName": "models"}}}
HF_MODEL = {"path": "/models/base", "source": {"huggingFace": {"repo": "org/base", "tokenSecretRef": {"name": "hf"}}},
            "cache": {"pvc": {"claimName": "model-cache"}}}
S3_MODEL = {"path": "/models/base", "source": {"s3": {"uri": "s3://weights/base", "endpoint": "http://minio:9000",
                                                      "region": "eu-1", "credentialsSecretRef": {"name": "s3"}}}}


def msvc(adapters=(), model=None, tenants=None):
    spec = {"model": dict(model or PVC_MODEL), "adapters": [dict(a) for a in adapters]}
    if tenants is not None:
        spec["tenants"] = tenants
    return parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                "metadata": {"name": "m", "namespace": "ns", "uid": "u-1"}, "spec": spec})


def objects(desired, kind):
    return [o for o in desired.objects if o["kind"] == kind]


def runtime(container_of):
    return next(c for c in container_of["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime")


@pytest.mark.parametrize("adapter,path", [
    (PVC_SQL, "/adapters/pvc-loras/team-a/sql"),
    (PVC_CHAT, "/adapters/pvc-loras/team-b/chat"),
    (PVC_OTHER_CLAIM, "/adapters/pvc-legal-loras"),
    (HF_A, "hf://org/lora-a@main"),
    (HF_B, "hf://org/lora-b@v2"),
    (S3_A, "s3://loras/a"),
])
def test_adapter_path_in_runtime_yaml(adapter, path):
    desired = builders.build(msvc([adapter]), [])
    config = loads_config(desired.shared.config_text)  # what the runtime loads
    assert [(a.name, a.path) for a in config.model.adapters] == [(adapter["name"], path)]


def test_mounted_adapter_lies_in_its_volume_mount():
    desired = builders.build(msvc([PVC_SQL, PVC_OTHER_CLAIM, HOST]), [])
    config = loads_config(desired.shared.config_text)
    dep = objects(desired, "Deployment")[0]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = [m for m in runtime(dep)["volumeMounts"] if m["mountPath"].startswith("/adapters/")]
    assert len(mounts) == 3 and all(m["readOnly"] for m in mounts)
    for adapter in config.model.adapters:
        mount = next(m for m in mounts
                     if adapter.path == m["mountPath"] or adapter.path.startswith(m["mountPath"] + "/"))
        volume = volumes[mount["name"]]
        assert volume.get("persistentVolumeClaim", {}).get("readOnly", True)
        assert volume.get("hostPath", {}).get("type", "Directory") == "Directory"
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v} \
        == {"models", "loras", "legal-loras"}


def test_tenant_allowed_adapters_reach_runtime_yaml():
    tenants = [{"name": "team-a", "adapters": ["sql"]}, {"name": "team-b"}]
    config = loads_config(builders.build(msvc([PVC_SQL, PVC_CHAT], tenants=tenants), []).shared.config_text)
    assert {t.name: t.adapters for t in config.tenants} == {"team-a": ["sql"], "team-b": None}


def test_no_adapters_renders_no_adapter_keys():
    text = builders.build(msvc(), []).shared.config_text
    assert "adapters" not in text and "adapterCacheDir" not in text


def test_adapter_cache_dir_only_with_a_cache_and_a_fetched_adapter():
    assert loads_config(builders.build(msvc([HF_A], model=HF_MODEL), []).shared.config_text) \
        .model.adapter_cache_dir == builders.ADAPTER_CACHE_DIR
    assert loads_config(builders.build(msvc([HF_A]), []).shared.config_text).model.adapter_cache_dir is None
    assert loads_config(builders.build(msvc([PVC_SQL], model=HF_MODEL), []).shared.config_text) \
        .model.adapter_cache_dir is None


# Adding the second adapter of a kind or volume in use leaves the Deployment (pod template and its
# restart hash) as it was: only the ConfigMap changes, and the runtime reloads it. The first adapter
# of a fetched kind or on a new volume changes the pod (a volume, the Hub online, credentials).
HOT_CASES = [
    ("pvc, same claim", PVC_MODEL, [PVC_SQL], [PVC_SQL, PVC_CHAT], False),
    ("pvc, removed, claim still used", PVC_MODEL, [PVC_SQL, PVC_CHAT], [PVC_CHAT], False),
    ("pvc, new claim", PVC_MODEL, [PVC_SQL], [PVC_SQL, PVC_OTHER_CLAIM], True),
    ("hostPath, new folder", PVC_MODEL, [], [HOST], True),
    ("s3 without credentials to add", PVC_MODEL, [], [S3_A], False),
    ("first huggingFace", PVC_MODEL, [], [HF_A], True),
    ("second huggingFace", PVC_MODEL, [HF_A], [HF_A, HF_B], False),
    ("huggingFace beside a pvc adapter", PVC_MODEL, [HF_A, PVC_SQL], [HF_A, HF_B, PVC_SQL], False),
    ("first fetched, with a cache", HF_MODEL, [], [HF_A], True),
    ("second fetched, with a cache", HF_MODEL, [HF_A], [HF_A, HF_B], False),
    ("s3 of an s3 model", S3_MODEL, [S3_A], [S3_A, S3_B], False),
    ("first s3 of an s3 model", S3_MODEL, [], [S3_A], True),
]


@pytest.mark.parametrize("what,model,before,after,pods_change", HOT_CASES, ids=[c[0] for c in HOT_CASES])
def test_adding_an_adapter_changes_the_pods_only_for_a_new_volume_or_kind(what, model, before, after, pods_change):
    old, new = builders.build(msvc(before, model=model), []), builders.build(msvc(after, model=model), [])
    # The runtime treats model.adapters as hot: the restart hash never moves with them...
    assert old.shared.config.restart_hash() == new.shared.config.restart_hash() or pods_change
    assert objects(old, "ConfigMap") != objects(new, "ConfigMap")
    # ...and the pod template moves only where the pod needs something new.
    assert (objects(old, "Deployment") != objects(new, "Deployment")) == pods_change


def test_restart_hash_ignores_the_adapters_themselves():
    """model.adapters is not a restart field: the hash on the pod template is that of the same
    spec without adapters when nothing else about the pod changes."""
    base = builders.build(msvc(), []).shared.config
    for adapters in ([PVC_SQL], [PVC_SQL, PVC_CHAT], [S3_A, S3_B], [HF_A]):
        config = builders.build(msvc(adapters), []).shared.config
        assert config.restart_hash() == base.restart_hash()
        assert base.reloadable_changes_only(config) and config.reloadable_changes_only(base)


def test_fetched_adapters_get_the_hub_online_and_the_model_sources_credentials():
    dep = objects(builders.build(msvc([HF_A], model=HF_MODEL), []), "Deployment")[0]
    env = {e["name"]: e for e in runtime(dep)["env"]}
    assert "HF_HUB_OFFLINE" not in env
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    cache_mount = next(m for m in runtime(dep)["volumeMounts"] if m["name"] == "model-cache")
    assert cache_mount["readOnly"] is False  # the runtime writes /model-cache/adapters

    dep = objects(builders.build(msvc([S3_A], model=S3_MODEL), []), "Deployment")[0]
    env = {e["name"]: e for e in runtime(dep)["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://minio:9000" and env["AWS_REGION"]["value"] == "eu-1"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}

    dep = objects(builders.build(msvc([PVC_SQL], model=HF_MODEL), []), "Deployment")[0]
    env = {e["name"] for e in runtime(dep)["env"]}
    assert "HF_TOKEN" not in env and "HF_HUB_OFFLINE" in env  # no fetched adapter: no credentials in the runtime


@pytest.mark.parametrize("adapters,model,message", [
    ([PVC_SQL, {**PVC_CHAT, "name": "sql"}], PVC_MODEL, "duplicate name(s) sql"),
    ([{**S3_A, "name": "base"}], PVC_MODEL, "is the served model's name"),
    ([{**S3_A, "name": "served"}], {**PVC_MODEL, "servedName": "served"}, "is the served model's name"),
    ([{"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "a/../../b"}}}], PVC_MODEL,
     "must stay inside the volume"),
    ([{"name": "sql", "source": {}}], PVC_MODEL, "set exactly one of"),
])
def test_bad_adapters_are_refused_naming_the_field(adapters, model, message):
    with pytest.raises(ValueError, match="spec.adapters") as err:
        msvc(adapters, model=model)
    assert message in str(err.value)


def test_typed_adapter_spec():
    settings = msvc([PVC_SQL, HF_B, S3_A, HOST]).settings
    assert [(a.name, a.kind, a.fetched) for a in settings.adapters] == [
        ("sql", AdapterSourceKind.PVC, False), ("hf-b", AdapterSourceKind.HUGGING_FACE, True),
        ("s3-a", AdapterSourceKind.S3, True), ("host", AdapterSourceKind.HOST_PATH, False)]
    assert settings.adapters[0].path == "team-a/sql" and settings.adapters[0].claim_name == "loras"
    assert settings.adapters[1].source_uri == "hf://org/lora-b@v2"


def test_a_lane_matches_requests_by_model_name():
    from tokenlane.operator.api.resources import parse_serving_lane

    lane = parse_serving_lane({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
                               "metadata": {"name": "sql", "namespace": "ns"},
                               "spec": {"modelServiceRef": {"name": "m"}, "match": {"models": ["sql"]}}})
    desired = builders.build(msvc([PVC_SQL]), [lane])
    assert not desired.rejected
    config = loads_config(desired.shared.config_text)
    assert {lc.name: lc.match.models for lc in config.lanes} == {"sql": ["sql"]}
