"""Pure builders: (ModelService, its ServingLanes, tuning overrides) -> the desired objects.

No I/O and no clock: the same inputs always give the same objects, so `tokenlane render`,
the golden tests and the operator agree byte for byte.

What gets built for a ModelService `m` (namespace of `m`):
- ConfigMap `m-config` with `runtime.yaml` (the shared pool's RuntimeConfig, rendered and
  validated by `tokenlane.runtime.config`, the schema the runtime itself loads);
- Deployment `m` (runtime pods), Service `m`, PodDisruptionBudget `m`, ServiceMonitor `m`
  (only when the Prometheus Operator's CRD exists);
- with `spec.parallelism.pipeline` > 1, LeaderWorkerSet `m` (leaderworkerset.x-k8s.io/v1)
  instead of each Deployment: replicas are groups of `pipeline` pods, one pipeline stage each,
  and the Service (and InferencePool) select the groups' leaders only; the runtime config
  carries `engine.tensorParallelSize` / `pipelineParallelSize` (docs/parallelism.md);
- for each lane with `isolation: dedicated`: ConfigMap `m-<lane>-config`, Deployment and
  Service `m-<lane>` (a pool serving only that lane, default for every request it gets).
- with `spec.router.enabled`: Deployment and Service `m-router` running `tokenlane router` in
  front of the shared pool (docs/fleet.md).
- with `spec.gateway.inferencePool.enabled`: InferencePool `m` (inference.networking.k8s.io/v1)
  selecting the shared pool's pods, for a Gateway API Inference Extension gateway.

LoRA adapters (`spec.adapters`) go into runtime.yaml's `model.adapters` (hot in the runtime, not
in the restart hash). The pod template depends only on which adapter volumes (one per claim or
node folder, read-only under /adapters) and which fetched kinds (huggingFace: the Hub online;
the model source's credentials of that kind) are in use: an adapter whose volume or kind is
already in use changes only the ConfigMap.

Model sources (`spec.model.source`): pvc and hostPath are mounted read-only at /models;
tinyModel and the fetched sources (huggingFace, s3) fill an emptyDir there from an init
container (`make-tiny-model`, `fetch-model`), the latter through `spec.model.cache` mounted at
/model-cache in both containers. Credentials are secretKeyRefs only: no Secret is ever read.

Replicas of the shared pool: `spec.replicas`, or while `spec.autoscaling.enabled` the
autoscaler's decision in `status.autoscaling.desiredReplicas` (`shared_replicas`).

Hot reload vs restart: the ConfigMap is mounted as a folder (not subPath) so the kubelet
updates it in place and the runtime reloads budgets without a restart. The pod template
carries only `tokenlane.dev/restart-hash` = RuntimeConfig.restart_hash() (model + engine
fields), so budget changes never roll the pods while model/engine changes do.

Tuning hook: `Overrides` carries the tuner's / rollout guard's values
(`scheduler` keys, `lanes[laneName]` budget keys, `engine` keys such as continuousBatching)
layered over the spec. The operator reads them from ModelService `status.overrides`
(`Overrides.from_status`), so a tuner writes status.overrides and triggers a reconcile; the
rendered result is reported as `status.effectiveBudgets` (`Desired.effective_budgets`).
Runtime configs are built only through `RuntimeConfig.from_dict`, with its type checks.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from tokenlane.operator.api.resources import API_VERSION, ModelService, ServingLane, lane_sort_key
from tokenlane.operator.api.spec import AdapterSourceKind, AdapterSpec, HuggingFaceSource, ModelCacheKind, S3Source
from tokenlane.runtime.config import LANE_KNOBS, RuntimeConfig, dumps_config

FIELD_MANAGER = "tokenlane-operator"
MANAGED_BY = "tokenlane-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_VERSION = "app.kubernetes.io/version"
LABEL_MODEL_SERVICE = "tokenlane.dev/model-service"
LABEL_POOL = "tokenlane.dev/pool"  # "shared" or the dedicated lane's name
ANNOTATION_RESTART_HASH = "tokenlane.dev/restart-hash"
ANNOTATION_CONFIG_HASH = "tokenlane.dev/config-hash"
ANNOTATION_APPLIED_HASH = "tokenlane.dev/applied-hash"
# On the pod template of a fetched source: what its fetch-model init container downloads, so the
# ModelAvailable condition reads only pods fetching the current source.
ANNOTATION_MODEL_SOURCE = "tokenlane.dev/model-source"

SHARED_POOL = "shared"
CONFIG_DIR = "/etc/tokenlane"
CONFIG_FILE = "runtime.yaml"
MODELS_DIR = "/models"
MODEL_CACHE_DIR = "/model-cache"  # spec.model.cache, at the same path in the init and runtime containers
ADAPTERS_DIR = "/adapters"  # pvc and hostPath adapter volumes, one mount per volume
ADAPTER_CACHE_DIR = f"{MODEL_CACHE_DIR}/adapters"  # where the runtime fetches adapters with a model cache
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
# Set by the LeaderWorkerSet controller on its pods: "0" on a group's leader.
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER, WORKER = "leader", "worker"  # the pods of a group (a Deployment's pods are leaders)
DIST_PORT = 29500  # the rendezvous of a group's ranks, on its leader (TOKENLANE_DIST_PORT)
DIST_PORT_NAME = "dist"
FETCH_MODEL_CONTAINER = "fetch-model"
TERMINATION_LOG = "/dev/termination-log"
# The fetch is network- and disk-bound: a modest request, and a memory limit for the HTTP buffers.
FETCH_MODEL_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
RUN_AS_USER = 10001  # the image's non-root user (manifests/images)

LANE_BUDGET_KEYS = tuple(k.key for k in LANE_KNOBS)  # a ServingLane's spec.budgets, status.overrides.lanes


# --------------------------------------------------------------------------- inputs / outputs


@dataclass(frozen=True)
class Overrides:
    """Tuned values layered over spec: camelCase keys as in runtime.yaml."""

    scheduler: Mapping[str, Any] = field(default_factory=dict)  # global budget keys
    lanes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # laneName -> LANE_BUDGET_KEYS
    engine: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"continuousBatching": False}

    @classmethod
    def from_status(cls, status: Optional[Mapping[str, Any]]) -> "Overrides":
        raw = (status or {}).get("overrides") or {}
        return cls(scheduler=dict(raw.get("scheduler") or {}), lanes={k: dict(v) for k, v in (raw.get("lanes") or {}).items()},
                   engine=dict(raw.get("engine") or {}))


@dataclass
class Pool:
    """One Deployment's worth of runtime pods and the config they load."""

    name: str  # SHARED_POOL or the dedicated lane's laneName
    object_name: str  # Deployment / Service name
    config: RuntimeConfig
    config_text: str
    replicas: int
    lanes: list[str]


@dataclass
class Desired:
    objects: list[dict]  # ordered: ConfigMaps first so pods find their config
    pools: list[Pool]
    admitted: list[ServingLane]
    rejected: dict[str, str]  # ServingLane metadata.name -> why it is not served
    effective_budgets: dict[str, Any]

    @property
    def shared(self) -> Pool:
        return self.pools[0]


# --------------------------------------------------------------------------- runtime config


def _lane_dict(lane: ServingLane, overrides: Overrides, *, dedicated_pool: bool) -> dict[str, Any]:
    """One `lanes[]` entry of runtime.yaml: the lane's spec with its tuned budgets over it."""
    spec = lane.spec
    caps = {**(spec.get("budgets") or {}), **overrides.lanes.get(lane.lane_name, {})}
    unknown = sorted(set(caps) - set(LANE_BUDGET_KEYS))
    if unknown:
        raise ValueError(f"lane {lane.lane_name}: unknown budget key(s) {unknown}")
    return {
        "name": lane.lane_name,
        "class": spec["class"],
        "priority": spec["priority"],
        "weight": spec["weight"],
        # A dedicated pool serves exactly this lane: everything it receives lands here.
        "default": True if dedicated_pool else bool(spec.get("default")),
        **({"continuousBatching": spec["continuousBatching"]} if "continuousBatching" in spec else {}),
        **caps,
        "slo": spec.get("slo") or {},
        "match": {} if dedicated_pool else spec.get("match") or {},
    }


def _tenant_dicts(msvc: ModelService, pool_lanes: list[str]) -> list[dict[str, Any]]:
    """Tenants restricted to the lanes a pool serves (a tenant allowed none of them is left out)."""
    out = []
    for t in msvc.spec.get("tenants") or []:
        allowed = [name for name in t.get("lanes") or [] if name in pool_lanes]
        if t.get("lanes") and not allowed:
            continue
        default_lane = t.get("defaultLane")
        if default_lane not in pool_lanes or (allowed and default_lane not in allowed):
            default_lane = None
        tenant = {"name": t["name"], "apiKeySha256": t.get("apiKeySha256"), "defaultLane": default_lane,
                  "lanes": allowed, "weight": t.get("weight"), "tokensPerMinute": t.get("tokensPerMinute"),
                  "adapters": list(t["adapters"]) if t.get("adapters") else None}
        out.append({k: v for k, v in tenant.items() if v is not None})
    return out


def _adapter_volume_key(adapter: AdapterSpec) -> str:
    """The folder under /adapters where the adapter's volume is mounted: one per claim, one per
    node folder, so an adapter on a volume already mounted changes no pod template."""
    if adapter.kind == AdapterSourceKind.PVC:
        return f"pvc-{adapter.claim_name}"
    return f"host-{hashlib.sha256(adapter.path.encode()).hexdigest()[:12]}"


def adapter_path(adapter: AdapterSpec) -> str:
    """`model.adapters[].path` in runtime.yaml: the mounted folder, or the URI the runtime fetches."""
    if adapter.fetched:
        return adapter.source_uri
    folder = posixpath.join(ADAPTERS_DIR, _adapter_volume_key(adapter))
    return posixpath.join(folder, adapter.path) if adapter.kind == AdapterSourceKind.PVC and adapter.path else folder


def _model_dict(msvc: ModelService) -> dict[str, Any]:
    """The `model` section: the spec's model (its `source` and `cache` say where the operator
    mounts the weights from: not runtime keys) and the adapters. Only `adapters` is hot in the
    runtime; `adapterCacheDir` is rendered only while a fetched adapter exists, so specs without
    adapters keep their restart hash."""
    model = {k: v for k, v in msvc.spec["model"].items() if k not in ("source", "cache")}
    adapters = msvc.settings.adapters
    if adapters:
        model["adapters"] = [{"name": a.name, "path": adapter_path(a)} for a in adapters]
    if msvc.settings.model_source.cache is not None and any(a.fetched for a in adapters):
        model["adapterCacheDir"] = ADAPTER_CACHE_DIR
    return model


def _parallel_engine_keys(msvc: ModelService) -> dict[str, int]:
    """spec.parallelism as runtime.yaml's engine keys, only where above 1: a ModelService without
    parallelism keeps its restart hash (and its pods)."""
    parallelism = msvc.settings.parallelism
    return {key: size for key, size in (("tensorParallelSize", parallelism.tensor),
                                        ("pipelineParallelSize", parallelism.pipeline)) if size > 1}


def runtime_config(msvc: ModelService, lanes: list[ServingLane], overrides: Overrides, *,
                   dedicated_pool: bool = False) -> RuntimeConfig:
    """The RuntimeConfig of one pool; raises ValueError (ConfigError) when the combination is invalid."""
    spec = msvc.spec
    lane_dicts = [_lane_dict(lane, overrides, dedicated_pool=dedicated_pool)
                  for lane in sorted(lanes, key=lambda l: (-l.spec["priority"], l.lane_name))]
    return RuntimeConfig.from_dict({
        "model": _model_dict(msvc),
        "engine": {**spec["engine"], **overrides.engine, **_parallel_engine_keys(msvc)},
        "scheduler": {**spec["scheduler"], **overrides.scheduler},
        "lanes": lane_dicts,
        "tenants": _tenant_dicts(msvc, [lane["name"] for lane in lane_dicts]),
    })


def admit_lanes(msvc: ModelService, lanes: list[ServingLane], overrides: Overrides
                ) -> tuple[list[ServingLane], dict[str, str]]:
    """Lanes that can be served, oldest first; each other lane with the reason it cannot.

    One bad lane never breaks the others: a lane is admitted only if the config with it and
    the lanes admitted before it is valid (duplicate names, a second default lane, caps that
    contradict the global budgets, unknown tenants are refused with the runtime's message).
    """
    admitted: list[ServingLane] = []
    rejected: dict[str, str] = {}
    for lane in sorted(lanes, key=lane_sort_key):
        if lane.parent != msvc.name or lane.deleting:
            continue
        shared = [l for l in admitted if not l.dedicated]
        try:
            if any(l.lane_name == lane.lane_name for l in admitted):
                raise ValueError(f"lane name {lane.lane_name!r} is already used by another ServingLane of "
                                 f"{msvc.name}")
            if lane.dedicated:
                runtime_config(msvc, [lane], overrides, dedicated_pool=True)
            else:
                if lane.spec.get("default") and any(l.spec.get("default") for l in shared):
                    raise ValueError(f"{msvc.name} already has a default lane")
                runtime_config(msvc, shared + [lane], overrides)
        except ValueError as exc:
            rejected[lane.ref.name] = str(exc)
            continue
        admitted.append(lane)
    return admitted, rejected


# --------------------------------------------------------------------------- objects


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def common_labels(msvc: ModelService) -> dict[str, str]:
    return {
        LABEL_NAME: "tokenlane",
        LABEL_INSTANCE: msvc.name,
        LABEL_COMPONENT: "runtime",
        LABEL_PART_OF: "tokenlane",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_MODEL_SERVICE: msvc.name,
    }


def selector_labels(msvc: ModelService, pool: str) -> dict[str, str]:
    return {LABEL_INSTANCE: msvc.name, LABEL_COMPONENT: "runtime", LABEL_POOL: pool}


def serving_selector(msvc: ModelService, pool: str) -> dict[str, str]:
    """The pods that serve the API: every pod of the pool, or only the groups' leaders (the
    workers run pipeline stages and answer /health alone)."""
    labels = selector_labels(msvc, pool)
    if msvc.settings.parallelism.grouped:
        labels[LABEL_LWS_WORKER_INDEX] = "0"
    return labels


def selector_string(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(msvc: ModelService) -> Optional[dict]:
    if not msvc.ref.uid:
        return None  # rendering without a cluster: the API server would need a uid
    return {"apiVersion": API_VERSION, "kind": "ModelService", "name": msvc.name, "uid": msvc.ref.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(msvc: ModelService, name: str, pool: str, annotations: Optional[dict] = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": msvc.namespace,
                            "labels": {**common_labels(msvc), LABEL_POOL: pool}}
    if annotations:
        meta["annotations"] = dict(annotations)
    owner = owner_reference(msvc)
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def _model_volume(msvc: ModelService) -> Optional[dict]:
    source = msvc.spec["model"].get("source") or {}
    if "pvc" in source:
        return {"name": "models", "persistentVolumeClaim": {"claimName": source["pvc"]["claimName"], "readOnly": True}}
    if "hostPath" in source:
        return {"name": "models", "hostPath": {"path": source["hostPath"]["path"], "type": "Directory"}}
    if "tinyModel" in source:
        return {"name": "models", "emptyDir": {"sizeLimit": "1Gi"}}
    if msvc.settings.model_source.fetched is not None:
        # No size limit: without a cache the checkpoint itself lands here.
        return {"name": "models", "emptyDir": {}}
    return None


def _model_cache_volume(msvc: ModelService) -> Optional[dict]:
    cache = msvc.settings.model_source.cache
    if cache is None:
        return None
    if cache.kind == ModelCacheKind.PVC:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    return {"name": "model-cache", "hostPath": {"path": cache.path, "type": "DirectoryOrCreate"}}


def fetch_model_args(msvc: ModelService) -> list[str]:
    """The arguments of `tokenlane fetch-model` for a huggingFace or s3 source."""
    source = msvc.settings.model_source
    fetched = source.fetched
    args = ["fetch-model", fetched.uri, posixpath.normpath(msvc.spec["model"]["path"])]
    if source.cache is not None:
        args += ["--cache-dir", MODEL_CACHE_DIR]
    if isinstance(fetched, HuggingFaceSource):
        args += ["--revision", fetched.revision]
    else:
        if fetched.endpoint:
            args += ["--endpoint-url", fetched.endpoint]
        if fetched.region:
            args += ["--region", fetched.region]
    args += ["--termination-log", TERMINATION_LOG]
    if isinstance(fetched, HuggingFaceSource) and fetched.allow_patterns:
        args += ["--allow-patterns", *fetched.allow_patterns]  # last: the option takes every value after it
    return args


def fetch_model_env(msvc: ModelService) -> list[dict]:
    """Environment of the fetch-model init container: credentials as secretKeyRefs only (the
    kubelet resolves them; the operator never reads a Secret)."""
    fetched = msvc.settings.model_source.fetched
    env: list[dict] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"},
                       {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if isinstance(fetched, HuggingFaceSource):
        if fetched.token is not None:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": fetched.token.name,
                                                                           "key": fetched.token.key}}})
        if fetched.endpoint:
            env.append({"name": "HF_ENDPOINT", "value": fetched.endpoint})
    elif fetched.credentials_secret:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            ref: dict[str, Any] = {"name": fetched.credentials_secret, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def fetch_model_container(msvc: ModelService) -> dict:
    """The init container downloading a huggingFace or s3 source into the models volume (through
    the cache when there is one). On failure it exits 1 with the source's message in its
    termination message, and the kubelet retries it with its crash-loop back-off."""
    spec = msvc.spec
    mounts = [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if msvc.settings.model_source.cache is not None:
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
    return {
        "name": FETCH_MODEL_CONTAINER,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tokenlane"],
        "args": fetch_model_args(msvc),
        "env": fetch_model_env(msvc),
        "resources": {part: dict(values) for part, values in FETCH_MODEL_RESOURCES.items()},
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }


def _adapter_volumes(msvc: ModelService) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of the pvc and hostPath adapters: one read-only volume per claim or node
    folder, at /adapters/<key>, in a stable order."""
    keys: dict[str, AdapterSpec] = {}
    for adapter in msvc.settings.adapters:
        if not adapter.fetched:
            keys.setdefault(_adapter_volume_key(adapter), adapter)
    volumes, mounts = [], []
    for key, adapter in sorted(keys.items()):
        name = f"adapters-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        if adapter.kind == AdapterSourceKind.PVC:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": adapter.claim_name,
                                                                     "readOnly": True}})
        else:
            volumes.append({"name": name, "hostPath": {"path": adapter.path, "type": "Directory"}})
        mounts.append({"name": name, "mountPath": posixpath.join(ADAPTERS_DIR, key), "readOnly": True})
    return volumes, mounts


def _adapter_fetch_env(msvc: ModelService) -> list[dict]:
    """What the runtime container needs to fetch huggingFace / s3 adapters: the model source's
    credentials, endpoint and region when it is of the same kind (secretKeyRefs only). Rendered
    per kind in use, so a second adapter of a kind changes no pod template."""
    kinds = {a.kind for a in msvc.settings.adapters}
    fetched = msvc.settings.model_source.fetched
    env: list[dict] = []
    if AdapterSourceKind.HUGGING_FACE in kinds and isinstance(fetched, HuggingFaceSource):
        env += [e for e in fetch_model_env(msvc) if e["name"] in ("HF_TOKEN", "HF_ENDPOINT")]
    if AdapterSourceKind.S3 in kinds and isinstance(fetched, S3Source):
        env += [e for e in fetch_model_env(msvc) if e["name"].startswith("AWS_")]
        if fetched.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL_S3", "value": fetched.endpoint})
        if fetched.region:
            env.append({"name": "AWS_REGION", "value": fetched.region})
    return env


def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _resources(msvc: ModelService) -> dict:
    spec = msvc.spec
    res = spec.get("resources") or {}
    out: dict[str, Any] = {}
    for part in ("requests", "limits"):
        if res.get(part):
            out[part] = dict(res[part])
    gpus = spec["gpus"]
    if gpus["count"] > 0:
        # Extended resources: the limit is the request (the scheduler copies it).
        out.setdefault("limits", {})[gpus["resourceName"]] = gpus["count"]
    return out


def pod_template(msvc: ModelService, pool: Pool, restart_hash: str, role: str = LEADER) -> dict:
    """The runtime pods' template. `role`: LEADER (a Deployment's pods, a group's leader: the API
    server, and stage 0 when grouped) or WORKER (a group's pods 1..pipeline-1: worker ranks that
    answer only GET /health, on the same port). Every pod runs the same command; a grouped pod
    finds its rank from the LeaderWorkerSet's environment (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
    LWS_WORKER_INDEX) and the rendezvous port (TOKENLANE_DIST_PORT)."""
    spec = msvc.spec
    port = spec["port"]
    grouped = msvc.settings.parallelism.grouped
    selector = selector_labels(msvc, pool.name)
    pod_labels = {**dict(spec.get("podLabels") or {}), **common_labels(msvc), **selector}
    pod_annotations = dict(spec.get("podAnnotations") or {})
    if spec["monitoring"]["scrapeAnnotations"] and role == LEADER:  # workers export no /metrics
        pod_annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                "prometheus.io/path": "/metrics"})
    pod_annotations[ANNOTATION_RESTART_HASH] = restart_hash

    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/cache"},
    ]
    volumes: list[dict] = [
        {"name": "config", "configMap": {"name": f"{pool.object_name}-config"}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    if spec["gpus"]["count"] > 0:
        # torch / NCCL use shared memory; the default 64Mi /dev/shm is too small.
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
    model_volume = _model_volume(msvc)
    init_containers = []
    if model_volume:
        volumes.append(model_volume)
        source = spec["model"]["source"]
        mount = {"name": "models", "mountPath": MODELS_DIR, "readOnly": "tinyModel" not in source}
        if "pvc" in source and source["pvc"].get("subPath"):
            mount["subPath"] = source["pvc"]["subPath"]
        mounts.append(mount)
        cache_volume = _model_cache_volume(msvc)
        if cache_volume:
            volumes.append(cache_volume)
            # The models folder holds a link into the cache: mounted at the same path as in the init container.
            # Writable while an adapter is fetched: the runtime downloads it into /model-cache/adapters.
            mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR,
                           "readOnly": not any(a.fetched for a in msvc.settings.adapters)})
        if msvc.settings.model_source.fetched is not None:
            init_containers.append(fetch_model_container(msvc))
            pod_annotations[ANNOTATION_MODEL_SOURCE] = msvc.settings.model_source.description
        if "tinyModel" in source:
            init_containers.append({
                "name": "make-tiny-model",
                "image": spec["image"],
                "imagePullPolicy": spec["imagePullPolicy"],
                "command": ["tokenlane"],
                "args": ["make-tiny-model", posixpath.normpath(spec["model"]["path"]),
                         "--arch", source["tinyModel"]["arch"]],
                "env": [{"name": "HOME", "value": "/tmp"}],
                "securityContext": _container_security(),
                "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
            })

    adapter_volumes, adapter_mounts = _adapter_volumes(msvc)
    volumes += adapter_volumes
    mounts += adapter_mounts
    # The runtime reaches the Hub only to fetch huggingFace adapters.
    hub_online = any(a.kind == AdapterSourceKind.HUGGING_FACE for a in msvc.settings.adapters)
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        *([] if hub_online else [{"name": "HF_HUB_OFFLINE", "value": "1"}]),
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
        {"name": "TOKENLANE_LOG_LEVEL", "value": spec["logLevel"]},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *_adapter_fetch_env(msvc),
        *([{"name": "TOKENLANE_DIST_PORT", "value": str(DIST_PORT)}] if grouped else []),
    ]
    env += [{"name": e["name"], "value": e.get("value", "")} for e in spec.get("env") or []]

    def probe(path: str, period: int, failures: int, timeout: int = 3) -> dict:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": timeout,
                "failureThreshold": failures}

    container = {
        "name": "runtime",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tokenlane"],
        "args": ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(port)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  # The group's rendezvous (torch.distributed's store), reached at LWS_LEADER_ADDRESS.
                  *([{"name": DIST_PORT_NAME, "containerPort": DIST_PORT, "protocol": "TCP"}]
                    if grouped and role == LEADER else [])],
        "env": env,
        "resources": _resources(msvc),
        # Loading weights can take minutes: the startup probe holds off liveness until /health answers.
        "startupProbe": probe("/health", 10, 180),
        "livenessProbe": probe("/health", 10, 6, timeout=5),
        # A worker serves no API: it is ready while it is joined and healthy.
        "readinessProbe": probe("/ready" if role == LEADER else "/health", 5, 3),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the runtime never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,  # let the runtime drain in-flight streams
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "serviceAccountName",
                "runtimeClassName", "imagePullSecrets"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    return {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec}


def deployment(msvc: ModelService, pool: Pool, restart_hash: str) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(msvc, pool.object_name, pool.name),
        "spec": {
            "replicas": pool.replicas,
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": selector_labels(msvc, pool.name)},
            # Never below the desired count during a rollout (needs room for one extra pod).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(msvc, pool, restart_hash),
        },
    }


def leader_worker_set(msvc: ModelService, pool: Pool, restart_hash: str) -> dict:
    """A pool whose replicas are groups of spec.parallelism.pipeline pods (a LeaderWorkerSet,
    leaderworkerset.x-k8s.io/v1): pod k of a group is pipeline stage k; the leader (k = 0) also
    serves the API. A pod that fails recreates its whole group (the ranks cannot rejoin one by
    one). Workers are created with the leader, not after it is ready: the leader is ready only
    once every stage has joined."""
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(msvc, pool.object_name, pool.name),
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            # As the Deployment: never below the desired count during a rollout (room for one extra group).
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": msvc.settings.parallelism.pipeline,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(msvc, pool, restart_hash, LEADER),
                "workerTemplate": pod_template(msvc, pool, restart_hash, WORKER),
            },
        },
    }


def workload(msvc: ModelService, pool: Pool, restart_hash: str) -> dict:
    """The pool's pods: a Deployment, or a LeaderWorkerSet when spec.parallelism.pipeline > 1."""
    if msvc.settings.parallelism.grouped:
        return leader_worker_set(msvc, pool, restart_hash)
    return deployment(msvc, pool, restart_hash)


def service(msvc: ModelService, pool: Pool) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(msvc, pool.object_name, pool.name),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(msvc, pool.name),
            "ports": [{"name": "http", "port": msvc.spec["port"], "targetPort": "http", "protocol": "TCP",
                       "appProtocol": "http"}],
        },
    }


def config_map(msvc: ModelService, pool: Pool) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(msvc, f"{pool.object_name}-config", pool.name,
                              {ANNOTATION_CONFIG_HASH: _hash(pool.config_text)}),
        "data": {CONFIG_FILE: pool.config_text},
    }


def pod_disruption_budget(msvc: ModelService, pool: Pool) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(msvc, pool.object_name, pool.name),
        "spec": {"maxUnavailable": msvc.spec["disruptionBudget"]["maxUnavailable"],
                 "selector": {"matchLabels": selector_labels(msvc, pool.name)}},
    }


def service_monitor(msvc: ModelService, pool: Pool) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(msvc, pool.object_name, pool.name),
        "spec": {
            "selector": {"matchLabels": {LABEL_INSTANCE: msvc.name, LABEL_COMPONENT: "runtime",
                                         LABEL_POOL: pool.name, LABEL_MANAGED_BY: MANAGED_BY}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": msvc.spec["monitoring"]["interval"]}],
        },
    }


# --------------------------------------------------------------------------- replicas and the router


def shared_replicas(msvc: ModelService) -> int:
    """Pods of the shared pool: spec.replicas, or, while spec.autoscaling is enabled, the
    autoscaler's last decision (status.autoscaling.desiredReplicas) within its bounds. Before
    the first decision it is spec.replicas within the bounds."""
    autoscaling = msvc.settings.autoscaling
    if not autoscaling.enabled:
        return msvc.spec["replicas"]
    # The CRD's rules, for servers and files that do not check them (kmock, `tokenlane render`).
    if autoscaling.max_replicas is None:
        raise ValueError("spec.autoscaling: autoscaling.enabled needs autoscaling.maxReplicas")
    if not autoscaling.prometheus_url:
        raise ValueError("spec.autoscaling: autoscaling.enabled needs autoscaling.prometheusUrl")
    low, high = autoscaling.min_replicas, autoscaling.max_replicas
    if low > high:
        raise ValueError(f"spec.autoscaling: minReplicas ({low}) must be <= maxReplicas ({high})")
    decided = ((msvc.status or {}).get("autoscaling") or {}).get("desiredReplicas")
    wanted = msvc.spec["replicas"] if decided is None else int(decided)
    return max(low, min(high, wanted))


ROUTER_COMPONENT = "router"


def router_name(msvc: ModelService) -> str:
    return f"{msvc.name}-router"


def router_selector(msvc: ModelService) -> dict[str, str]:
    return {LABEL_INSTANCE: msvc.name, LABEL_COMPONENT: ROUTER_COMPONENT}


def _router_metadata(msvc: ModelService) -> dict:
    meta: dict[str, Any] = {"name": router_name(msvc), "namespace": msvc.namespace,
                            "labels": {**common_labels(msvc), LABEL_COMPONENT: ROUTER_COMPONENT}}
    owner = owner_reference(msvc)
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def router_deployment(msvc: ModelService, shared: Pool) -> dict:
    """`tokenlane router` in front of the shared pool. It finds the pods through the EndpointSlices
    of the pool's Service, and reads the pool's runtime.yaml once at start (tenants, lane rules)."""
    spec = msvc.spec
    router = spec["router"]
    port = spec["port"]
    res = router.get("resources") or {}

    def probe(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
                "failureThreshold": failures}

    container = {
        "name": "router",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tokenlane"],
        "args": ["router", "--endpointslice-service", shared.object_name, "--namespace", msvc.namespace,
                 "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(port),
                 "--log-level", spec["logLevel"]],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {part: dict(res[part]) for part in ("requests", "limits") if res.get(part)},
        "livenessProbe": probe("/health", 10, 6),
        # Ready while a replica is, or while it can hold requests for one (scale from zero:
        # a router out of its Service could never receive the request that wakes the pool).
        "readinessProbe": probe("/ready", 5, 3),
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router["serviceAccountName"],
        "automountServiceAccountToken": True,  # the router watches EndpointSlices
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": f"{shared.object_name}-config"}},
                    {"name": "tmp", "emptyDir": {}}],
    }
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    selector = router_selector(msvc)
    template_meta: dict[str, Any] = {"labels": {**common_labels(msvc), **selector}}
    if spec["monitoring"]["scrapeAnnotations"]:  # the router's own picks and upstream errors
        template_meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                        "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_metadata(msvc),
        "spec": {
            "replicas": router["replicas"],
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def router_service(msvc: ModelService) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_metadata(msvc),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(msvc),
            "ports": [{"name": "http", "port": msvc.spec["port"], "targetPort": "http", "protocol": "TCP",
                       "appProtocol": "http"}],
        },
    }


def inference_pool(msvc: ModelService) -> dict:
    """An InferencePool (Gateway API Inference Extension) selecting the shared pool's pods on the
    API port: a gateway's HTTPRoute sends to it and its endpoint picker chooses the pod. Dedicated
    lanes' pools are not in it (they serve only their lane)."""
    picker = msvc.settings.inference_pool
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _metadata(msvc, msvc.name, SHARED_POOL),
        "spec": {
            "selector": {"matchLabels": serving_selector(msvc, SHARED_POOL)},
            "targetPorts": [{"number": msvc.spec["port"]}],
            "appProtocol": "http",
            "endpointPickerRef": {"kind": "Service", "name": picker.picker_service,
                                  "port": {"number": picker.picker_port},
                                  "failureMode": picker.failure_mode.value},
        },
    }


def _with_applied_hash(obj: dict) -> dict:
    """Stamp the hash of the object as built: the planner compares it to see removed fields too."""
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED_HASH] = _hash(obj)
    return obj


def effective_budgets(pools: list[Pool]) -> dict[str, Any]:
    out: dict[str, Any] = {"lanes": {}}
    shared = pools[0]
    out["scheduler"] = {k: v for k, v in shared.config.to_dict()["scheduler"].items()}
    for pool in pools:
        for name in pool.lanes:
            budgets = pool.config.lane_budgets(name)
            out["lanes"][name] = {"pool": pool.name, **{k.key: getattr(budgets, k.attr) for k in LANE_KNOBS}}
    return out


def build(msvc: ModelService, lanes: list[ServingLane], *, overrides: Optional[Overrides] = None,
          service_monitor_available: bool = False, inference_pool_available: bool = True) -> Desired:
    """Every object the operator wants for `msvc`, in apply order. Raises ValueError if the
    ModelService itself (with no lane) cannot make a valid runtime config.
    `inference_pool_available`: whether the server serves InferencePools (the operator leaves the
    pool out, with a Warning Event, where the CRD is not installed)."""
    overrides = overrides or Overrides()
    runtime_config(msvc, [], overrides)  # the ModelService alone must be valid
    admitted, rejected = admit_lanes(msvc, lanes, overrides)
    shared_lanes = [l for l in admitted if not l.dedicated]
    pools: list[Pool] = []
    shared_config = runtime_config(msvc, shared_lanes, overrides)
    pools.append(Pool(SHARED_POOL, msvc.name, shared_config, dumps_config(shared_config), shared_replicas(msvc),
                      [lc.name for lc in shared_config.lanes]))
    for lane in admitted:
        if lane.dedicated:
            cfg = runtime_config(msvc, [lane], overrides, dedicated_pool=True)
            pools.append(Pool(lane.lane_name, f"{msvc.name}-{lane.lane_name}", cfg, dumps_config(cfg),
                              lane.spec.get("dedicated", {}).get("replicas", 1), [lane.lane_name]))
    for pool in pools:
        if len(pool.object_name) > 63:
            raise ValueError(f"object name {pool.object_name!r} is longer than 63 characters; "
                             "shorten the ModelService name or the lane's laneName")
    routed = bool((msvc.spec.get("router") or {}).get("enabled"))
    if routed and any(pool.object_name == router_name(msvc) for pool in pools):
        raise ValueError(f"the router's objects are named {router_name(msvc)!r}, as a dedicated lane's pool: "
                         "rename that lane's laneName or turn spec.router off")

    objects: list[dict] = [config_map(msvc, pool) for pool in pools]
    for pool in pools:
        objects.append(workload(msvc, pool, pool.config.restart_hash()))
        objects.append(service(msvc, pool))
    shared = pools[0]
    if routed:
        objects += [router_deployment(msvc, shared), router_service(msvc)]
    if msvc.spec["disruptionBudget"]["enabled"]:
        objects.append(pod_disruption_budget(msvc, shared))
    if service_monitor_available and msvc.spec["monitoring"]["serviceMonitor"]:
        objects.extend(service_monitor(msvc, pool) for pool in pools)
    if inference_pool_available and msvc.settings.inference_pool.enabled:
        objects.append(inference_pool(msvc))
    objects = [_with_applied_hash(obj) for obj in objects]
    return Desired(objects=objects, pools=pools, admitted=admitted, rejected=rejected,
                   effective_budgets=effective_budgets(pools))


def endpoint(msvc: ModelService, pool: Pool) -> str:
    """Where clients of this pool send requests: the router in front of the shared pool when
    `spec.router` is on, else the pool's own Service."""
    routed = bool((msvc.spec.get("router") or {}).get("enabled"))
    name = router_name(msvc) if routed and pool.name == SHARED_POOL else pool.object_name
    return f"http://{name}.{msvc.namespace}.svc:{msvc.spec['port']}"
