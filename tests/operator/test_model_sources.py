"""Model sources (spec.model.source.huggingFace / s3, spec.model.cache): the typed spec, the
rendered fetch-model init container and volumes, and the ModelAvailable condition (pure)."""

from __future__ import annotations

import copy

import pytest

from tokenlane.operator.api.resources import parse_model_service
from tokenlane.operator.api.spec import HuggingFaceSource, ModelCacheKind, S3Source
from tokenlane.operator.desired import builders, status

BASE = {
    "apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
    "metadata": {"name": "smol", "namespace": "ml", "uid": "u-1"},
    "spec": {"model": {"path": "/models/smol"}, "engine": {"device": "cpu"}, "gpus": {"count": 0}},
}
HF = {"huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
HF_FULL = {"huggingFace": {"repo": "acme/private-7b", "revision": "v2", "tokenSecretRef": {"name": "hf", "key": "token"},
                           "allowPatterns": ["*.json", "*.safetensors"], "endpoint": "https://hf-mirror.internal"}}
S3 = {"s3": {"uri": "s3://weights/llama/8b", "endpoint": "http://minio.storage:9000", "region": "eu-west-1",
             "credentialsSecretRef": {"name": "s3-creds"}}}
S3_BARE = {"s3": {"uri": "s3://weights/llama/8b"}}
PVC_CACHE = {"pvc": {"claimName": "model-cache"}}
NODE_CACHE = {"nodeLocal": {"path": "/var/cache/tokenlane"}}


def msvc(source=None, cache=None, **model):
    body = copy.deepcopy(BASE)
    if source is not None:
        body["spec"]["model"]["source"] = copy.deepcopy(source)
    if cache is not None:
        body["spec"]["model"]["cache"] = copy.deepcopy(cache)
    body["spec"]["model"].update(model)
    return parse_model_service(body)


def pod_spec(m):
    dep = next(o for o in builders.build(m, []).objects if o["kind"] == "Deployment")
    return dep["spec"]["template"]


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


# --------------------------------------------------------------------------- typed spec


def test_typed_source_defaults_and_fields():
    hf = msvc(HF).settings.model_source
    assert hf.kind == "huggingFace" and hf.cache is None
    assert hf.fetched == HuggingFaceSource("HuggingFaceTB/SmolLM2-135M-Instruct", "main")
    assert hf.description == "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main"
    full = msvc(HF_FULL, PVC_CACHE).settings.model_source
    assert full.fetched.token.name == "hf" and full.fetched.token.key == "token"
    assert full.fetched.allow_patterns == ("*.json", "*.safetensors")
    assert full.cache.kind == ModelCacheKind.PVC and full.cache.claim_name == "model-cache"
    default_key = msvc({"huggingFace": {"repo": "a/b", "tokenSecretRef": {"name": "hf"}}}).settings.model_source
    assert default_key.fetched.token.key == "HF_TOKEN"
    s3 = msvc(S3, NODE_CACHE).settings.model_source
    assert s3.fetched == S3Source("s3://weights/llama/8b", "http://minio.storage:9000", "eu-west-1", "s3-creds")
    assert s3.cache.kind == ModelCacheKind.NODE_LOCAL and s3.cache.path == "/var/cache/tokenlane"
    assert msvc({"pvc": {"claimName": "w"}}).settings.model_source.fetched is None


@pytest.mark.parametrize("source,cache,message", [
    ({**HF, **S3}, None, "set at most one of pvc, hostPath, tinyModel, huggingFace, s3"),
    ({"pvc": {"claimName": "w"}}, PVC_CACHE, "cache needs a huggingFace or s3 source"),
    (None, PVC_CACHE, "cache needs a huggingFace or s3 source"),
    (HF, {**PVC_CACHE, **NODE_CACHE}, "set at most one of pvc, nodeLocal"),
    ({"huggingFace": {"repo": "no-org"}}, None, "repo"),
    ({"s3": {"uri": "gs://bucket/x"}}, None, "uri"),
])
def test_bad_sources_are_refused_naming_the_key(source, cache, message):
    with pytest.raises(ValueError, match=message):
        msvc(source, cache)


def test_source_path_must_lie_under_models():
    with pytest.raises(ValueError, match="path must lie under /models/"):
        msvc(HF, path="/weights/smol")


# --------------------------------------------------------------------------- builders

# (source, cache, args after "fetch-model SOURCE DEST", env of the init container beyond HOME/HF_*)
CASES = [
    pytest.param(HF, None, ["--revision", "main", "--termination-log", "/dev/termination-log"], {}, id="hf-public"),
    pytest.param(HF_FULL, PVC_CACHE,
                 ["--cache-dir", "/model-cache", "--revision", "v2", "--termination-log", "/dev/termination-log",
                  "--allow-patterns", "*.json", "*.safetensors"],
                 {"HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "token"}},
                  "HF_ENDPOINT": "https://hf-mirror.internal"}, id="hf-private-mirror-pvc-cache"),
    pytest.param(S3, NODE_CACHE,
                 ["--cache-dir", "/model-cache", "--endpoint-url", "http://minio.storage:9000",
                  "--region", "eu-west-1", "--termination-log", "/dev/termination-log"],
                 {"AWS_ACCESS_KEY_ID": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}},
                  "AWS_SECRET_ACCESS_KEY": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}},
                  "AWS_SESSION_TOKEN": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SESSION_TOKEN",
                                                         "optional": True}}}, id="s3-minio-node-cache"),
    pytest.param(S3_BARE, None, ["--termination-log", "/dev/termination-log"], {}, id="s3-ambient-credentials"),
]


@pytest.mark.parametrize("source,cache,args,secret_env", CASES)
def test_fetch_model_init_container(source, cache, args, secret_env):
    m = msvc(source, cache)
    template = pod_spec(m)
    spec = template["spec"]
    (init,) = spec["initContainers"]
    uri = m.settings.model_source.fetched.uri
    assert init["name"] == "fetch-model" and init["image"] == m.spec["image"]
    assert init["command"] == ["tokenlane"] and init["args"] == ["fetch-model", uri, "/models/smol", *args]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert init["resources"]["requests"] and init["resources"]["limits"]["memory"]
    assert init["securityContext"]["readOnlyRootFilesystem"] and init["securityContext"]["runAsNonRoot"]
    env = env_of(init)
    assert env["HOME"] == "/tmp"
    assert {k: v for k, v in env.items() if k not in ("HOME", "HF_HOME", "HF_HUB_DISABLE_TELEMETRY")} == secret_env
    # Secrets are referenced, never inlined: no env value holds a credential.
    assert not any("value" in e for e in init["env"] if e["name"] in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY"))
    assert template["metadata"]["annotations"][builders.ANNOTATION_MODEL_SOURCE] == m.settings.model_source.description

    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    runtime = spec["containers"][0]
    run_mounts = {v["name"]: v for v in runtime["volumeMounts"]}
    init_mounts = {v["name"]: v for v in init["volumeMounts"]}
    assert init_mounts["models"]["mountPath"] == run_mounts["models"]["mountPath"] == "/models"
    assert run_mounts["models"]["readOnly"] and not init_mounts["models"].get("readOnly")
    if cache is None:
        assert "model-cache" not in volumes and "model-cache" not in init_mounts and "model-cache" not in run_mounts
    else:
        # DEST is a link into the cache: both containers see it at the same path.
        assert init_mounts["model-cache"]["mountPath"] == run_mounts["model-cache"]["mountPath"] == "/model-cache"
        assert run_mounts["model-cache"]["readOnly"] and not init_mounts["model-cache"].get("readOnly")
        if "pvc" in cache:
            assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
        else:
            assert volumes["model-cache"]["hostPath"] == {"path": "/var/cache/tokenlane", "type": "DirectoryOrCreate"}


@pytest.mark.parametrize("source,cache,args,secret_env", CASES)
def test_rendered_args_parse_with_the_fetch_model_command(source, cache, args, secret_env):
    """The contract with `tokenlane fetch-model`: its own parser reads what the operator renders."""
    fetch = pytest.importorskip("tokenlane.runtime.sources.fetch")
    m = msvc(source, cache)
    (init,) = pod_spec(m)["spec"]["initContainers"]
    parsed = fetch.build_parser().parse_args(init["args"][1:])
    fetched = m.settings.model_source.fetched
    assert (parsed.source, parsed.dest) == (fetched.uri, "/models/smol")
    assert parsed.cache_dir == (None if cache is None else "/model-cache")
    assert parsed.termination_log == "/dev/termination-log"
    if isinstance(fetched, HuggingFaceSource):
        assert parsed.revision == fetched.revision and parsed.allow_patterns == list(fetched.allow_patterns)
    else:
        assert (parsed.endpoint_url, parsed.region) == (fetched.endpoint, fetched.region)


@pytest.mark.parametrize("source", [None, {"pvc": {"claimName": "w"}}, {"hostPath": {"path": "/w"}},
                                    {"tinyModel": {"arch": "llama"}}])
def test_other_sources_render_no_fetch(source):
    template = pod_spec(msvc(source))
    inits = [c["name"] for c in template["spec"].get("initContainers") or []]
    assert "fetch-model" not in inits
    assert builders.ANNOTATION_MODEL_SOURCE not in template["metadata"]["annotations"]
    assert "model-cache" not in {v["name"] for v in template["spec"]["volumes"]}


def test_source_and_cache_stay_out_of_runtime_yaml():
    m = msvc(HF_FULL, PVC_CACHE)
    text = builders.build(m, []).shared.config_text
    assert "source" not in text and "cache" not in text.replace("kvCache", "").replace("Caching", "")
    assert "/models/smol" in text


def test_changing_the_source_rolls_the_pods():
    one = pod_spec(msvc(HF))
    other = pod_spec(msvc({"huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "v1"}}))
    assert one != other


# --------------------------------------------------------------------------- ModelAvailable


def pod(name, init_status=None, source="hf://HuggingFaceTB/SmolLM2-135M-Instruct@main", deleting=False):
    meta = {"name": name, "annotations": {builders.ANNOTATION_MODEL_SOURCE: source}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    st = {"initContainerStatuses": [{"name": "fetch-model", **init_status}]} if init_status else {}
    return {"metadata": meta, "status": st}


RUNNING = {"state": {"running": {"startedAt": "t"}}, "restartCount": 0}
DONE = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
FAILED = {"state": {"terminated": {"exitCode": 1, "reason": "Error",
                                   "message": "Repository Not Found for url: https://huggingface.co/api/models/x"}}}
BACKOFF = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
           "lastState": {"terminated": {"exitCode": 1, "message": "403 Forbidden: gated repo"}}, "restartCount": 3}
RETRYING = {"state": {"running": {"startedAt": "t"}},
            "lastState": {"terminated": {"exitCode": 1, "message": "403 Forbidden: gated repo"}}, "restartCount": 4}
NO_SECRET = {"state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}}
BACKOFF_NO_MESSAGE = {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}}


@pytest.mark.parametrize("pods,status_,reason,in_message", [
    ([], "Unknown", "NoPods", "fetched when a pod starts"),
    ([pod("p-a")], "False", "Downloading", "fetching hf://HuggingFaceTB/SmolLM2-135M-Instruct@main"),
    ([pod("p-a", RUNNING)], "False", "Downloading", "init container fetch-model"),
    ([pod("p-a", DONE), pod("p-b", RUNNING)], "True", "Ready", "fetched"),
    ([pod("p-a", FAILED)], "False", "Failed", "Repository Not Found for url"),
    ([pod("p-a", DONE), pod("p-b", BACKOFF)], "False", "Failed", "pod p-b: 403 Forbidden: gated repo (exit code 1)"),
    ([pod("p-a", RETRYING)], "False", "Failed", "403 Forbidden: gated repo"),
    ([pod("p-a", NO_SECRET)], "False", "Failed", 'CreateContainerConfigError: secret "hf" not found'),
    ([pod("p-a", BACKOFF_NO_MESSAGE)], "False", "Failed", "CrashLoopBackOff: back-off 10s"),
    ([pod("p-a", FAILED), pod("p-b", FAILED)], "False", "Failed", "in pod p-a (and 1 more pod(s))"),
    # Pods of another source (a rollout in progress) or on their way out do not count.
    ([pod("old", FAILED, source="hf://acme/typo@main"), pod("p-a", DONE)], "True", "Ready", "fetched"),
    ([pod("p-a", FAILED, deleting=True)], "Unknown", "NoPods", ""),
])
def test_model_available_from_init_container_states(pods, status_, reason, in_message):
    cond = status.model_available(msvc(HF), pods)
    assert (cond["type"], cond["status"], cond["reason"]) == ("ModelAvailable", status_, reason), cond
    assert in_message in cond["message"]


def test_model_available_when_the_pods_cannot_be_read():
    cond = status.model_available(msvc(HF), None, pods_error="403 Forbidden: cannot list pods")
    assert (cond["status"], cond["reason"]) == ("Unknown", "PodsUnreadable") and "403 Forbidden" in cond["message"]


def test_model_available_without_a_download():
    for source, says in [(None, "read from the image at /models/smol"),
                         ({"pvc": {"claimName": "w"}}, "PersistentVolumeClaim w"),
                         ({"hostPath": {"path": "/w"}}, "node path /w"),
                         ({"tinyModel": {}}, "tinyModel")]:
        cond = status.model_available(msvc(source), None)
        assert (cond["status"], cond["reason"]) == ("True", "NoDownload") and says in cond["message"]


def test_model_available_is_part_of_the_status_and_quiet_when_unchanged():
    m = msvc(S3, PVC_CACHE)
    desired = builders.build(m, [])
    pods = [pod("p-a", DONE, source="s3://weights/llama/8b")]
    first = status.model_service_status(m, desired, {}, "t1", pods=pods)
    cond = next(c for c in first["conditions"] if c["type"] == "ModelAvailable")
    assert cond["reason"] == "Ready" and cond["message"] == "s3://weights/llama/8b fetched into the cache"
    m.status["conditions"] = first["conditions"]
    again = status.model_service_status(m, desired, {}, "t2", pods=pods)
    assert status.status_patch(first, again) is None
