"""The CRD schemas of ModelService and ServingLane, as Python data: the one source of truth.

`crds/*.yaml` are generated from this module (`python -m tokenlane.operator.api.schema crds/`;
tests/operator/test_crds.py fails when they are stale). The same schema drives
`apply_defaults` (what the API server does to a stored object, so `tokenlane render` sees
what the cluster would store) and `to_jsonschema` (type/range checks without a cluster).

The budget knobs (`spec.scheduler`, a ServingLane's `spec.budgets`, the tuning bounds) come
from the runtime's knob table (`tokenlane.runtime.config.KNOBS`), their defaults from its
`SchedulerConfig`: the CRDs and the runtime cannot disagree.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from tokenlane.runtime.config import LANE_KNOBS, SCHEDULER_KNOBS, TUNED_KNOBS, Knob, LaneConfig, SchedulerConfig, _camel
from tokenlane.runtime.config import DEFAULT_MAX_REFUSED_SHARE
from tokenlane.runtime.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, MAX_LORA_RANK

GROUP = "tokenlane.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_IMAGE = "ghcr.io/tokenlane/tokenlane:0.1.0"

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Model sources (spec.model.source): what `tokenlane fetch-model` accepts.
HF_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
URL_PATTERN = r"^https?://[^\s]+$"
HF_TOKEN_DEFAULT_KEY = "HF_TOKEN"  # the key of spec.model.source.huggingFace.tokenSecretRef


# --------------------------------------------------------------------------- helpers


def _obj(desc: str, props: dict, *, required: Optional[list] = None, rules: Optional[list] = None,
         defaulted: bool = False, **extra: Any) -> dict:
    """An object schema. `defaulted`: an absent object is defaulted to one holding every nested
    default. Complete, not `{}`: the API server checks a default against the schema's CEL rules
    as written, without filling nested defaults first, so `default: {}` fails every rule that
    reads a key (found on kube-apiserver 1.28; offline CEL checks cannot see it)."""
    out: dict[str, Any] = {"type": "object", "description": desc, "properties": props}
    if required:
        out["required"] = required
    if defaulted:
        out["default"] = apply_defaults(out, {})
    if rules:
        out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    out.update(extra)
    return out


def _int(desc: str, *, default: Optional[int] = None, minimum: Optional[int] = None,
         maximum: Optional[int] = None, fmt: str = "int64") -> dict:
    out: dict[str, Any] = {"type": "integer", "format": fmt, "description": desc}
    if default is not None:
        out["default"] = default
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _num(desc: str, *, default: Optional[float] = None, minimum: Optional[float] = None,
         maximum: Optional[float] = None, exclusive_minimum: bool = False) -> dict:
    out: dict[str, Any] = {"type": "number", "description": desc}
    if default is not None:
        out["default"] = default
    if minimum is not None:
        out["minimum"] = minimum
        if exclusive_minimum:
            out["exclusiveMinimum"] = True
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _str(desc: str, *, default: Optional[str] = None, enum: Optional[list] = None,
         pattern: Optional[str] = None, max_length: Optional[int] = 253, min_length: Optional[int] = None) -> dict:
    out: dict[str, Any] = {"type": "string", "description": desc}
    if default is not None:
        out["default"] = default
    if enum:
        out["enum"] = enum
    if pattern:
        out["pattern"] = pattern
    if max_length and not enum:
        out["maxLength"] = max_length
    if min_length:
        out["minLength"] = min_length
    return out


def _bool(desc: str, *, default: Optional[bool] = None) -> dict:
    out: dict[str, Any] = {"type": "boolean", "description": desc}
    if default is not None:
        out["default"] = default
    return out


def _duration(desc: str, default: str) -> dict:
    return _str(desc + " A Go-style duration such as 30s, 5m, 1h30m.", default=default,
                pattern=DURATION_PATTERN, max_length=32)


def _string_map(desc: str, max_props: int = 64) -> dict:
    return {"type": "object", "description": desc, "maxProperties": max_props,
            "additionalProperties": {"type": "string", "maxLength": 1024}}


def _quantity_map(desc: str) -> dict:
    return {"type": "object", "description": desc, "maxProperties": 16,
            "additionalProperties": {"anyOf": [{"type": "integer"}, {"type": "string"}],
                                     "x-kubernetes-int-or-string": True}}


def _knob(knob: Knob, desc: str, default: Any = None) -> dict:
    """The schema of one budget knob (its type and range from the knob table)."""
    if knob.type is int:
        return _int(desc, default=default, minimum=int(knob.minimum),
                    maximum=None if knob.maximum is None else int(knob.maximum))
    return _num(desc, default=default, minimum=knob.minimum, maximum=knob.maximum,
                exclusive_minimum=knob.exclusive_minimum)


def _in_field_order(cls: type, props: dict) -> dict:
    """`props` in the order of the runtime dataclass's fields (as runtime.yaml renders them)."""
    order = [_camel(f.name) for f in dataclasses.fields(cls)]
    return dict(sorted(props.items(), key=lambda item: order.index(item[0])))


def _budget_bounds(desc: str) -> dict:
    """min/max of each knob the tuner may move."""
    def bound(knob: Knob, desc: str) -> dict:
        if knob.type is int:
            return _int(desc, minimum=int(knob.minimum))
        return _num(desc, minimum=knob.minimum, maximum=None if knob.maximum is None else float(knob.maximum))

    return _obj(desc, {
        k.key: _obj(f"Bounds for {k.key}.", {"min": bound(k, "Lowest value the tuner may set."),
                                             "max": bound(k, "Highest value the tuner may set.")},
                    rules=[("!has(self.min) || !has(self.max) || self.min <= self.max", "min must be <= max")])
        for k in TUNED_KNOBS
    })


def _conditions() -> dict:
    return {
        "type": "array",
        "description": "Latest observations of the object's state (Ready, Progressing, Degraded, SLOMet, RolledBack).",
        "maxItems": 16,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": _obj("One condition.", {
            "type": _str("Condition type.", max_length=64),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("Machine-readable CamelCase reason.", max_length=128),
            "message": _str("Human-readable explanation.", max_length=4096),
            "lastTransitionTime": {"type": "string", "format": "date-time",
                                   "description": "When status last changed."},
            "observedGeneration": _int("The spec generation this condition was computed from.", minimum=0),
        }, required=["type", "status"]),
    }


def _secret_key_ref(desc: str, default_key: str) -> dict:
    return _obj(desc, {
        "name": _str("Secret name.", pattern=DNS_SUBDOMAIN_PATTERN, max_length=253),
        "key": _str(f"Key in the Secret; default {default_key}.", default=default_key, min_length=1,
                    max_length=253),
    }, required=["name"])


def _free_object(desc: str) -> dict:
    return {"type": "object", "description": desc, "x-kubernetes-preserve-unknown-fields": True}


# --------------------------------------------------------------------------- shared parts

# The defaults the API server fills in: the runtime's own.
SCHEDULER_DEFAULTS = {_camel(f.name): f.default for f in dataclasses.fields(SchedulerConfig) if f.default is not None}


def _scheduler() -> dict:
    d = SCHEDULER_DEFAULTS
    props = {k.key: _knob(k, k.doc, d.get(k.key)) for k in SCHEDULER_KNOBS}
    props["policy"] = _str("decode-first schedules running decodes before new prefill chunks; mixed interleaves.",
                           default=d["policy"], enum=["decode-first", "mixed"])
    props["stepTimeBudget"] = _str("auto caps each step's estimated time so the tightest TPOT target of the running "
                                   "lanes holds; off bounds steps by the token budgets only.",
                                   default=d["stepTimeBudget"],
                                   enum=["off", "auto"])
    return _obj(
        "Global scheduler budgets of every runtime pod (hot-reloaded, no restart). Lanes may cap them; "
        "with tuning enabled the operator adjusts the effective values within the tuning bounds.",
        _in_field_order(SchedulerConfig, props),
        defaulted=True,
        rules=[
            ("self.kvCacheHighWatermark < self.kvCacheRejectWatermark && self.kvCacheRejectWatermark <= 1.0",
             "kvCacheHighWatermark must be < kvCacheRejectWatermark <= 1"),
            ("self.prefillChunkSize <= self.maxBatchedTokens", "prefillChunkSize must be <= maxBatchedTokens"),
            ("self.maxActiveSequences <= self.maxBatchedTokens",
             "maxActiveSequences must be <= maxBatchedTokens (each running sequence needs a token per step)"),
        ],
    )


def _toleration() -> dict:
    return _obj("A toleration, as in a Pod spec.", {
        "key": _str("Taint key.", max_length=316),
        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _str("Taint value.", max_length=63),
        "effect": _str("Taint effect; empty matches all.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": _int("For NoExecute: how long the pod stays bound after the taint appears."),
    })


# --------------------------------------------------------------------------- ModelService


def model_service_spec() -> dict:
    model = _obj(
        "The checkpoint to serve (changing it restarts the pods).",
        {
            "path": _str("Folder of a Hugging Face checkpoint inside the container (config.json, safetensors, "
                         "tokenizer). With a source, it must lie under /models, where the source is mounted.",
                         min_length=1, max_length=1024),
            "servedName": _str("Model name in the OpenAI API; default: the folder's name.", max_length=253),
            "dtype": _str("Weight and activation dtype; auto = bfloat16 on GPU, float32 on CPU.", default="auto",
                          enum=["auto", "float32", "float16", "bfloat16"]),
            "maxModelLen": _int("Prompt + output token cap; default: the checkpoint's.", minimum=1),
            "tokenizer": _str("Tokenizer folder if not `path`.", max_length=1024),
            "source": _obj(
                "Where the weights come from; at most one. Without a source the image must contain `path`.",
                {
                    "pvc": _obj("A PersistentVolumeClaim holding checkpoints, mounted read-only at /models.", {
                        "claimName": _str("Name of the claim in the ModelService's namespace.", max_length=253,
                                          min_length=1),
                        "subPath": _str("Folder inside the volume to mount.", max_length=1024),
                    }, required=["claimName"]),
                    "hostPath": _obj("A node folder mounted read-only at /models (single-node and dev clusters).", {
                        "path": _str("Absolute node path.", pattern=r"^/", max_length=1024),
                    }, required=["path"]),
                    "tinyModel": _obj("Generate a small random-weight checkpoint into /models at pod start "
                                      "(demos and CI; no download).", {
                        "arch": _str("Architecture of the tiny model.", default="llama", enum=["llama", "qwen2"]),
                    }),
                    "huggingFace": _obj(
                        "Download a Hugging Face Hub repository into `path` at pod start (an init container "
                        "running `tokenlane fetch-model`); with `cache`, once per revision for every replica.", {
                            "repo": _str("Repository id, ORG/NAME.", pattern=HF_REPO_PATTERN, max_length=200,
                                         min_length=3),
                            "revision": _str("Branch, tag or commit.", default="main", pattern=r"^[^\s]+$",
                                             max_length=255),
                            "tokenSecretRef": _secret_key_ref(
                                "A Secret in the ModelService's namespace holding an access token (HF_TOKEN), for "
                                "private or gated repositories. Only referenced: the operator never reads it.",
                                HF_TOKEN_DEFAULT_KEY),
                            "allowPatterns": {"type": "array", "maxItems": 64,
                                              "description": "Download only the files matching these globs "
                                                             "(e.g. *.safetensors, *.json); default: every file.",
                                              "items": {"type": "string", "minLength": 1, "maxLength": 256}},
                            "endpoint": _str("Hub endpoint (HF_ENDPOINT), for mirrors and proxies; default: "
                                             "https://huggingface.co.", pattern=URL_PATTERN, max_length=1024),
                        }, required=["repo"]),
                    "s3": _obj(
                        "Download the objects under an S3 prefix into `path` at pod start (an init container "
                        "running `tokenlane fetch-model`); with `cache`, once for every replica.", {
                            "uri": _str("s3://BUCKET/PREFIX of the checkpoint's files.", pattern=S3_URI_PATTERN,
                                        max_length=1024),
                            "endpoint": _str("Endpoint of an S3-compatible store (MinIO, Ceph, R2); default: AWS.",
                                             pattern=URL_PATTERN, max_length=1024),
                            "region": _str("Region of the bucket (AWS_REGION).", max_length=64),
                            "credentialsSecretRef": _obj(
                                "A Secret in the ModelService's namespace with the keys AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY and optionally AWS_SESSION_TOKEN. Only referenced: the "
                                "operator never reads it. Unset: the pod's own credentials, if any.", {
                                    "name": _str("Secret name.", pattern=DNS_SUBDOMAIN_PATTERN, max_length=253),
                                }, required=["name"]),
                        }, required=["uri"]),
                },
                rules=[("(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.tinyModel) ? 1 : 0)"
                        " + (has(self.huggingFace) ? 1 : 0) + (has(self.s3) ? 1 : 0) <= 1",
                        "set at most one of pvc, hostPath, tinyModel, huggingFace, s3")],
            ),
            "cache": _obj(
                "Where huggingFace and s3 sources keep downloaded checkpoints, shared by the replicas: a "
                "revision is downloaded once and later pods start from the cache. At most one of pvc, "
                "nodeLocal. Unset: every pod downloads into its own emptyDir.",
                {
                    "pvc": _obj("A ReadWriteMany PersistentVolumeClaim (created by you) shared by every replica.", {
                        "claimName": _str("Name of the claim in the ModelService's namespace.", max_length=253,
                                          min_length=1),
                    }, required=["claimName"]),
                    "nodeLocal": _obj("A node folder (hostPath) shared by the replicas on the same node; it must "
                                      "be writable by the runtime's user (uid 10001).", {
                        "path": _str("Absolute node path.", pattern=r"^/", max_length=1024),
                    }, required=["path"]),
                },
                rules=[("!(has(self.pvc) && has(self.nodeLocal))", "set at most one of pvc, nodeLocal")],
            ),
        },
        required=["path"],
        rules=[("!has(self.source) || self.path.startsWith('/models/')",
                "with a source, path must lie under /models/ (where the source is mounted)"),
               ("!has(self.cache) || (has(self.source) && (has(self.source.huggingFace) || has(self.source.s3)))",
                "cache needs a huggingFace or s3 source (the other sources download nothing)")],
    )
    engine = _obj(
        "Memory layout and execution mode of the runtime (changing these restarts the pods).",
        {
            "blockSize": _int("Tokens per KV-cache block (a power of two).", default=16, minimum=1, maximum=256),
            "kvCacheBlocks": _int("Explicit KV pool size in blocks; default: sized from gpuMemoryUtilization.", minimum=1),
            "gpuMemoryUtilization": _num("Share of GPU memory for weights + KV cache.", default=0.9, minimum=0,
                                         maximum=1, exclusive_minimum=True),
            "cpuKvCacheGib": _num("KV pool size on CPU when kvCacheBlocks is not set.", default=1.0, minimum=0,
                                  exclusive_minimum=True),
            "continuousBatching": _bool("false = request-level static batching (the conservative fallback).",
                                        default=True),
            "enablePrefixCaching": _bool("Share KV blocks of common prompt prefixes.", default=True),
            "device": _str("auto, cpu or cuda.", default="auto", enum=["auto", "cpu", "cuda"]),
            "cpuComputeDtype": _str("Dtype of the dense layers on the CPU: auto = float32 when the CPU has no "
                                    "native bf16/fp16 matmul, model = the model dtype, float32. The KV cache "
                                    "keeps the model dtype.", default="auto", enum=["auto", "model", "float32"]),
            "kvCacheDtype": _str("Dtype of the KV cache: auto = the model dtype; bfloat16 or float16 halve a "
                                 "float32 model's KV memory (twice the blocks) and the bytes decode "
                                 "attention reads, at bf16/fp16 rounding of keys and values; fp8_e4m3 or "
                                 "fp8_e5m2 store one byte per value (twice bf16's blocks) with per-layer "
                                 "scales from the checkpoint (k_scale/v_scale) or calibrated at start.",
                                 default="auto",
                                 enum=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]),
            "attentionBackend": _str("auto = Triton on CUDA; on the CPU the C decode kernel (native) when a C "
                                     "compiler is present, else torch.", default="auto",
                                     enum=["auto", "torch", "triton", "native"]),
            "cudaGraphs": _bool("Replay CUDA graphs recorded at start-up for decode steps (needs CUDA and the "
                                "triton attention backend).", default=False),
            "cudaGraphMaxBatch": _int("Largest decode batch with a CUDA graph; larger batches run eager.",
                                      default=64, minimum=1, maximum=512),
            "executor": _str("model runs the weights; simulated uses a cost model (benchmarks).", default="model",
                             enum=["model", "simulated"]),
            "simulatorProfile": _str("Cost-model profile for executor=simulated.", max_length=128),
            "seed": _int("Sampling seed of the engine.", default=0, minimum=0),
            "cpuThreads": _int("torch compute threads of the engine on the CPU; unset = one per usable core.",
                               minimum=1, maximum=1024),
            "coreProcess": _bool("Run the engine and its step loop in a process of their own (the engine core), "
                                 "so the HTTP server's Python never holds up a step. Unset: on where the server "
                                 "has a core of its own (a GPU model with 2 or more cores; on the CPU, when "
                                 "cpuBind leaves the server CPUs), else off."),
            "cpuBind": _str("Thread placement on the CPU: auto (unset) from 8 cores up leaves the first core to "
                            "the HTTP server and pins one compute thread to each other core, below that "
                            "(or under a CPU quota, without exclusive CPUs) pins nothing; none pins nothing; "
                            "a CPU list such as 2-15 or 0,2,4-7 pins compute thread i to the i-th CPU "
                            "listed and leaves the other CPUs to the server.",
                            pattern=r"^(auto|none|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$", max_length=1024),
            "maxLoras": _int(f"LoRA adapters resident in device slots at once (and in one step); others wait for "
                             f"a slot. Unset: {DEFAULT_MAX_LORAS}.", minimum=1, maximum=256, fmt="int32"),
            "maxLoraRank": _int(f"Largest LoRA rank a slot holds; a higher-rank adapter is refused. Unset: "
                                f"{DEFAULT_MAX_LORA_RANK}.", minimum=1, maximum=MAX_LORA_RANK, fmt="int32"),
            "kvOffload": _obj("A host-memory tier for the prefix cache: cached blocks evicted from the device "
                              "pool are copied to (pinned) host memory and copied back on a later prefix hit "
                              "instead of being recomputed. Unset: no tier.", {
                "hostBytes": _int("Host memory for the tier in bytes (e.g. 8589934592 = 8 GiB); refused at "
                                  "start if more than the node's available memory. Count it in the pod's "
                                  "memory limit.", minimum=1),
            }, required=["hostBytes"]),
        },
        defaulted=True,
        rules=[("self.blockSize in [1, 2, 4, 8, 16, 32, 64, 128, 256]", "blockSize must be a power of two"),
               ("!has(self.kvOffload) || !has(self.enablePrefixCaching) || self.enablePrefixCaching",
                "kvOffload keeps prefix-cache blocks, so it needs enablePrefixCaching: true")],
    )
    tenants = {
        "type": "array",
        "description": "Teams calling the API: API key (as a SHA-256 hex digest, never the key) and allowed lanes.",
        "maxItems": 256,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": _obj("One tenant.", {
            "name": _str("Tenant name (DNS label).", pattern=DNS_LABEL_PATTERN, max_length=63),
            "apiKeySha256": _str("sha256 hex digest of the tenant's API key.", pattern=r"^[0-9a-f]{64}$", max_length=64),
            "defaultLane": _str("Lane of requests that name none.", max_length=63),
            "lanes": {"type": "array", "description": "Allowed lanes (laneName); empty = all.", "maxItems": 64,
                      "items": {"type": "string", "maxLength": 63}},
            "weight": _num("Fair share of a lane's new requests among its waiting tenants (tokens served / weight); "
                           "unset = 1.", minimum=0, maximum=1000, exclusive_minimum=True),
            "tokensPerMinute": _int("Token-rate limit, prompt + output tokens per minute; over it requests get 429 "
                                    "tenant_rate_limit with Retry-After. Unset = unlimited.", minimum=1),
            "adapters": {"type": "array", "description": "Allowed LoRA adapters (names of spec.adapters); others "
                                                         "get 404 model_not_found. Empty = all.", "maxItems": 64,
                         "items": {"type": "string", "maxLength": 63}},
        }, required=["name"]),
    }
    return _obj(
        "Desired state of a served model: the runtime pods, their global budgets, tuning and rollout policy.",
        {
            "replicas": _int("Runtime pods of the shared pool (scale subresource: kubectl scale, HPA).", default=1,
                             minimum=0, maximum=1000, fmt="int32"),
            "image": _str("Runtime container image.", default=DEFAULT_IMAGE, max_length=512, min_length=1),
            "imagePullPolicy": _str("Image pull policy.", default="IfNotPresent",
                                    enum=["Always", "IfNotPresent", "Never"]),
            "imagePullSecrets": {"type": "array", "description": "Secrets for pulling the image.", "maxItems": 16,
                                 "items": _obj("A secret reference.", {"name": _str("Secret name.", max_length=253)},
                                               required=["name"])},
            "model": model,
            "engine": engine,
            "scheduler": _scheduler(),
            "parallelism": _parallelism(),
            "gpus": _obj("Accelerators per pod.", {
                "count": _int("Accelerators per pod; 0 runs on CPU.", default=1, minimum=0, maximum=16, fmt="int32"),
                "resourceName": _str("Extended resource name of the accelerator.", default="nvidia.com/gpu",
                                     pattern=r"^([a-z0-9.-]+/)?[a-z0-9A-Z._-]+$", max_length=253),
            }, defaulted=True),
            "resources": _obj("CPU and memory of the runtime container (accelerators come from `gpus`).", {
                "requests": _quantity_map("Requested resources, e.g. cpu: 4, memory: 32Gi."),
                "limits": _quantity_map("Resource limits."),
            }),
            "nodeSelector": _string_map("Node labels the pods must match."),
            "tolerations": {"type": "array", "description": "Taints the pods tolerate (e.g. GPU node taints).",
                            "maxItems": 32, "items": _toleration()},
            "affinity": _free_object("Pod affinity, as in a Pod spec."),
            "priorityClassName": _str("PriorityClass of the pods.", max_length=253),
            "serviceAccountName": _str("ServiceAccount of the pods; default: the namespace's default.", max_length=253),
            "runtimeClassName": _str("RuntimeClass of the pods (e.g. nvidia).", max_length=253),
            "podAnnotations": _string_map("Extra annotations on the pods."),
            "podLabels": _string_map("Extra labels on the pods."),
            "env": {"type": "array", "description": "Extra environment variables of the runtime container.",
                    "maxItems": 64,
                    "items": _obj("A variable.", {"name": _str("Name.", max_length=253, min_length=1),
                                                  "value": _str("Value.", max_length=4096)}, required=["name"])},
            "port": _int("HTTP port of the runtime (OpenAI API, /health, /ready, /metrics).", default=8000,
                         minimum=1, maximum=65535, fmt="int32"),
            "logLevel": _str("Runtime log level.", default="info", enum=["debug", "info", "warning", "error"]),
            "tenants": tenants,
            "adapters": _adapters(),
            "disruptionBudget": _obj("PodDisruptionBudget of the runtime pods.", {
                "enabled": _bool("Create a PodDisruptionBudget.", default=True),
                "maxUnavailable": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
                                   "description": "Pods that may be down for voluntary disruptions (number or percent).",
                                   "default": 1},
            }, defaulted=True),
            "monitoring": _obj("Prometheus scraping of the runtime pods.", {
                "serviceMonitor": _bool("Create a ServiceMonitor when the Prometheus Operator's CRD exists.", default=True),
                "interval": _duration("Scrape interval.", "15s"),
                "scrapeAnnotations": _bool("Put prometheus.io/* scrape annotations on the pods.", default=True),
            }, defaulted=True),
            "tuning": _obj(
                "Closed-loop tuning of the lanes' budgets from Prometheus metrics (within bounds).",
                {
                    "enabled": _bool("Let the operator tune effective budgets.", default=False),
                    "prometheusUrl": _str("Base URL of the Prometheus HTTP API.", pattern=r"^https?://", max_length=1024),
                    "interval": _duration("How often the tuner decides.", "60s"),
                    "cooldown": _duration("Minimum time between two changes of one knob.", "300s"),
                    "window": _duration("Range of the PromQL rate/quantile queries.", "5m"),
                    "maxStepPercent": _int("Largest relative change of a knob per decision.", default=25, minimum=1,
                                           maximum=100),
                    "bounds": _budget_bounds("Global bounds of the tuned budgets."),
                },
                defaulted=True,
                rules=[("!self.enabled || has(self.prometheusUrl)", "tuning.enabled needs tuning.prometheusUrl")],
            ),
            "rollout": _obj(
                "How a new revision (runtime config or pod template) is verified and rolled back.",
                {
                    "verificationWindow": _duration("How long SLO metrics are compared after a change.", "300s"),
                    "progressDeadline": _duration("How long new pods may take to become ready.", "600s"),
                    "regression": _obj("Regression thresholds against the previous revision.", {
                        "ttftP95Percent": _num("Allowed TTFT p95 increase, percent.", default=25, minimum=0),
                        "tpotP95Percent": _num("Allowed TPOT p95 increase, percent.", default=25, minimum=0),
                        "errorRatePercent": _num("Allowed error/rejection rate increase, percentage points.",
                                                 default=5, minimum=0, maximum=100),
                    }, defaulted=True),
                    "fallback": _obj("What to apply when even the last-known-good revision misses its SLOs badly.", {
                        "policy": _str("LastKnownGood only restores; Conservative also lowers budgets; "
                                       "StaticBatching also turns continuous batching off.",
                                       default="LastKnownGood", enum=["LastKnownGood", "Conservative", "StaticBatching"]),
                        "budgetPercent": _int("Conservative profile: budgets scaled to this percent.", default=50,
                                              minimum=1, maximum=100),
                        "missFactor": _num("Fall back when a lane's p95 exceeds its target by this factor.",
                                           default=2.0, minimum=1.0),
                        "after": _duration("How long the misses must last before the fallback is applied.", "5m"),
                    }, defaulted=True),
                },
                defaulted=True,
            ),
            "autoscaling": _autoscaling(),
            "router": _router(),
            "gateway": _gateway(),
        },
        required=["model"],
        rules=[
            # An adapter is asked for by name in `model`: it must not shadow the base model.
            ("!has(self.adapters) || self.adapters.all(a, has(self.model.servedName) ? a.name != self.model.servedName"
             " : !(self.model.path == a.name || self.model.path.endsWith('/' + a.name)"
             " || self.model.path.endsWith('/' + a.name + '/')))",
             "adapters[].name must differ from the served model name (model.servedName, default the folder's name)"),
            # Scale from zero: only the router can hold the requests that arrive while no pod runs.
            ("!has(self.autoscaling) || !self.autoscaling.enabled || self.autoscaling.minReplicas > 0 "
             "|| (has(self.router) && self.router.enabled)",
             "autoscaling.minReplicas 0 needs router.enabled (the router holds requests while no pod runs)"),
            # One rank per GPU: the pod's GPUs are its tensor-parallel ranks (0 GPUs: ranks on the CPU).
            (PARALLELISM_GPUS_RULE, PARALLELISM_GPUS_MESSAGE),
        ],
    )


# runtime.yaml engine keys the CRD sets from another field (the builders render them from it).
ENGINE_KEYS_ELSEWHERE = {"tensorParallelSize": "parallelism.tensor", "pipelineParallelSize": "parallelism.pipeline"}
MAX_TENSOR_PARALLEL = 16  # GPUs per pod (gpus.count's maximum)
MAX_PIPELINE_PARALLEL = 64  # pods per group
PARALLELISM_GPUS_RULE = ("!has(self.parallelism) || !has(self.parallelism.tensor) || self.gpus.count == 0 "
                         "|| self.gpus.count == self.parallelism.tensor")
PARALLELISM_GPUS_MESSAGE = ("parallelism.tensor is the GPUs per pod (one rank each): gpus.count must equal "
                            "parallelism.tensor, or be 0 to run the ranks on the CPU")


def _parallelism() -> dict:
    """spec.parallelism: the runtime's engine.tensorParallelSize / pipelineParallelSize, and the
    workload kind (a LeaderWorkerSet of `pipeline` pods per group when pipeline > 1)."""
    return _obj(
        "Serve a model larger than one GPU (docs/parallelism.md). Changing it restarts the pods. Unset: one "
        "GPU, one pod per replica.",
        {
            "tensor": _int("Tensor-parallel ranks per pod, one per GPU (gpus.count must equal it): each layer is "
                           "split across them.", default=1, minimum=1, maximum=MAX_TENSOR_PARALLEL, fmt="int32"),
            "pipeline": _int("Pipeline stages, one pod each: above 1 every replica is a LeaderWorkerSet group of "
                             "this many pods (the leader serves the API and runs stage 0, worker k runs stage k), "
                             "and replicas count groups.", default=1, minimum=1, maximum=MAX_PIPELINE_PARALLEL,
                             fmt="int32"),
        },
    )


def _autoscaling() -> dict:
    """spec.autoscaling: operator/policy/autoscaler.py's AutoscalingPolicy (docs/fleet.md)."""
    lane = _obj("Scaling targets of one lane (at least one).", {
        "lane": _str("The lane's laneName.", pattern=DNS_LABEL_PATTERN, max_length=63),
        "queueDelayP95Ms": _num("Queue delay p95 to scale for, milliseconds.", minimum=0, exclusive_minimum=True),
        "sloAttainmentPercent": _num("Share of the lane's requests whose time to first token meets the lane's "
                                     "slo.ttftP95Ms, percent (below 100).", minimum=0, maximum=100,
                                     exclusive_minimum=True),
    }, required=["lane"], rules=[
        ("has(self.queueDelayP95Ms) || has(self.sloAttainmentPercent)",
         "a lane target needs queueDelayP95Ms or sloAttainmentPercent"),
        ("!has(self.sloAttainmentPercent) || self.sloAttainmentPercent < 100.0", "sloAttainmentPercent must be < 100"),
    ])

    def stabilization(what: str, pick: str, default: str) -> dict:
        return _obj(f"Stabilization of {what}s (as an HPA's behavior).", {
            "stabilizationWindow": _duration(f"A {what} goes to the {pick} recommendation of this window.", default),
        }, defaulted=True)

    return _obj(
        "Replica autoscaling of the shared pool from Prometheus metrics (replicas are groups with "
        "parallelism.pipeline above 1). While enabled the operator owns the Deployment's (LeaderWorkerSet's) "
        "replicas and spec.replicas is ignored; never together with an HPA or KEDA on this "
        "ModelService or its Deployment.",
        {
            "enabled": _bool("Let the operator size the shared pool.", default=False),
            "prometheusUrl": _str("Base URL of the Prometheus HTTP API.", pattern=r"^https?://", max_length=1024),
            "minReplicas": _int("Fewest pods. 0: scale to zero when idle (needs spec.router.enabled, which holds "
                                "the requests that wake the pool).", default=1, minimum=0, maximum=1000,
                                fmt="int32"),
            "scaleToZeroAfter": _duration("With minReplicas 0: how long the pool must see no request (none "
                                          "arriving, running or held) before it scales to zero.", "15m"),
            "maxReplicas": _int("Most pods.", minimum=1, maximum=1000, fmt="int32"),
            "interval": _duration("How often the operator decides.", "30s"),
            "window": _duration("Range of the PromQL rate/quantile queries.", "2m"),
            "scaleUp": stabilization("scale-up", "lowest", "0s"),
            "scaleDown": stabilization("scale-down", "highest", "5m"),
            "kvUsageTarget": _num("Average KV-cache usage over the pods to size for.", default=0.75, minimum=0,
                                  maximum=1, exclusive_minimum=True),
            "runningShareTarget": _num("A lane's running sequences per pod, as a share of its maxActiveSequences, "
                                       "at which a pod counts as fully loaded (unset: not checked).", minimum=0,
                                       maximum=1, exclusive_minimum=True),
            "headroomReplicas": _num("Spare capacity, in pods, on top of what the running share measures "
                                     "(default 0).", minimum=0, maximum=1000),
            "targetUtilization": _num("Share of their measured throughput that saturated pods run at after a "
                                      "scale-up sized by the queue (default 0.8).", minimum=0, maximum=1,
                                      exclusive_minimum=True),
            "lanes": {"type": "array", "description": "Per-lane targets.", "maxItems": 64,
                      "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["lane"], "items": lane},
        },
        rules=[
            ("!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
            ("!self.enabled || has(self.maxReplicas)", "autoscaling.enabled needs autoscaling.maxReplicas"),
            ("!self.enabled || has(self.prometheusUrl)", "autoscaling.enabled needs autoscaling.prometheusUrl"),
        ],
    )


ADAPTER_NAME_PATTERN = DNS_LABEL_PATTERN  # a model name in the API and a metric label value


def _adapters() -> dict:
    """spec.adapters: LoRA adapters served over the base model (docs/operations.md#lora-adapters)."""
    source = _obj(
        "Where the adapter (a PEFT folder: adapter_config.json and adapter_model.safetensors) comes from; "
        "exactly one. pvc and hostPath are mounted read-only under /adapters; huggingFace and s3 are fetched "
        "by the runtime when it loads the adapter, into /model-cache/adapters when spec.model.cache is set.",
        {
            "pvc": _obj("A folder in a PersistentVolumeClaim. Each claim is mounted once, read-only, at "
                        "/adapters/pvc-<claimName>: adapters added on a claim already mounted need no restart.", {
                "claimName": _str("Name of the claim in the ModelService's namespace.", pattern=DNS_SUBDOMAIN_PATTERN,
                                  max_length=253, min_length=1),
                "path": _str("The adapter's folder inside the volume; default: its root.", pattern=r"^[^/]",
                             max_length=1024),
            }, required=["claimName"],
                rules=[("!has(self.path) || !(self.path == '..' || self.path.startsWith('../') "
                        "|| self.path.contains('/../') || self.path.endsWith('/..'))",
                        "path must stay inside the volume (no '..')")]),
            "hostPath": _obj("A node folder, mounted read-only at /adapters/host-<hash of the path> (single-node "
                             "and dev clusters; a new folder adds a volume, so the pods roll once).", {
                "path": _str("Absolute node path of the adapter's folder.", pattern=r"^/", max_length=1024),
            }, required=["path"]),
            "huggingFace": _obj("A Hugging Face Hub repository, fetched by the runtime with the pod's Hub "
                                "credentials (those of spec.model.source.huggingFace, if any).", {
                "repo": _str("Repository id, ORG/NAME.", pattern=HF_REPO_PATTERN, max_length=200, min_length=3),
                "revision": _str("Branch, tag or commit.", default="main", pattern=r"^[^\s@]+$", max_length=255),
            }, required=["repo"]),
            "s3": _obj("The objects under an S3 prefix, fetched by the runtime with the pod's S3 credentials, "
                       "endpoint and region (those of spec.model.source.s3, if any).", {
                "uri": _str("s3://BUCKET/PREFIX of the adapter's files.", pattern=S3_URI_PATTERN, max_length=1024),
            }, required=["uri"]),
        },
        rules=[("(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.huggingFace) ? 1 : 0)"
                " + (has(self.s3) ? 1 : 0) == 1", "set exactly one of pvc, hostPath, huggingFace, s3")],
    )
    return {
        "type": "array",
        "description": "LoRA adapters served over the base model, each asked for by its name in a request's "
                       "`model`. Adding or removing one reloads the runtime's config without a restart "
                       "(docs/operations.md#lora-adapters).",
        "maxItems": 64,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": _obj("One adapter.", {
            "name": _str("Adapter name: the `model` of its requests (a DNS label).", pattern=ADAPTER_NAME_PATTERN,
                         max_length=63, min_length=1),
            "source": source,
        }, required=["name", "source"]),
    }


def _gateway() -> dict:
    """spec.gateway: the Gateway API Inference Extension (docs/fleet.md#inferencepool-behind-a-gateway)."""
    picker = _obj("The endpoint picker (EPP) Service the gateway asks which pod serves each request.", {
        "service": _str("Name of the endpoint picker's Service in the ModelService's namespace.",
                        pattern=DNS_LABEL_PATTERN, max_length=63, min_length=1),
        "port": _int("Port of the endpoint picker's ext-proc (gRPC) service.", default=9002, minimum=1,
                     maximum=65535, fmt="int32"),
        "failureMode": _str("What the gateway does when the picker is unreachable: FailOpen sends the request "
                            "to a pod of the pool anyway, FailClose refuses it.", default="FailClose",
                            enum=["FailOpen", "FailClose"]),
    }, required=["service"])
    return _obj("Gateway API integration.", {
        "inferencePool": _obj(
            "An InferencePool (inference.networking.k8s.io/v1) named as the ModelService, selecting the shared "
            "pool's pods on the API port, for a Gateway API Inference Extension gateway (HTTPRoute backendRef) "
            "and its endpoint picker. Needs the InferencePool CRD installed; spec.router keeps working beside it.",
            {
                "enabled": _bool("Render the InferencePool.", default=False),
                "endpointPicker": picker,
            },
            rules=[("!self.enabled || has(self.endpointPicker)",
                    "inferencePool.enabled needs inferencePool.endpointPicker")],
        ),
    })


def _router() -> dict:
    """spec.router: `tokenlane router` in front of the shared pool (docs/fleet.md)."""
    return _obj(
        "A `tokenlane router` Deployment and Service (<name>-router) in front of the shared pool: it routes by lane, "
        "load and prompt prefix, and finds the pods through the pool Service's EndpointSlices.",
        {
            "enabled": _bool("Render the router.", default=False),
            "replicas": _int("Router pods.", default=1, minimum=0, maximum=100, fmt="int32"),
            "serviceAccountName": _str("ServiceAccount of the router pods; it must be allowed to get, list and "
                                       "watch EndpointSlices in the namespace (manifests/base/router-rbac.yaml).",
                                       default="tokenlane-router", max_length=253),
            "resources": _obj("CPU and memory of the router container.", {
                "requests": _quantity_map("Requested resources."),
                "limits": _quantity_map("Resource limits."),
            }),
        },
    )


def model_service_status() -> dict:
    return _obj("Observed state, written by the operator only.", {
        "observedGeneration": _int("The spec generation last reconciled.", minimum=0),
        "replicas": _int("Pods of the shared pool (scale subresource); groups of pods with parallelism.pipeline "
                         "above 1.", minimum=0, fmt="int32"),
        "readyReplicas": _int("Ready pods (groups) of the shared pool.", minimum=0, fmt="int32"),
        "updatedReplicas": _int("Pods on the current pod template.", minimum=0, fmt="int32"),
        "selector": _str("Label selector of the shared pool's pods (scale subresource, HPA).", max_length=1024),
        "lanes": _int("Lanes served (admitted ServingLanes).", minimum=0, fmt="int32"),
        "laneNames": {"type": "array", "description": "Admitted lanes.", "maxItems": 64,
                      "items": {"type": "string", "maxLength": 63}},
        "restartHash": _str("Hash of the restart-only runtime fields on the pod template.", max_length=64),
        "configHash": _str("Hash of the rendered runtime.yaml of the shared pool.", max_length=64),
        "endpoint": _str("In-cluster URL of the shared pool.", max_length=512),
        "conditions": _conditions(),
        "effectiveBudgets": _free_object("Budgets in force: `scheduler` (global) and `lanes.<laneName>` "
                                         "(each lane's caps applied), after tuning overrides."),
        "overrides": _free_object("Tuned values layered over spec (written by the tuner / rollout guard): "
                                  "`scheduler`, `lanes.<laneName>`, `engine`."),
        "tuning": _free_object("Tuner state and last decisions."),
        "rollout": _free_object("Rollout guard state: revisions, last-known-good, rollbacks."),
        "autoscaling": _obj("The autoscaler's last decision (written when it changes).", {
            "currentReplicas": _int("Replicas of the shared pool's Deployment when it decided.", minimum=0, fmt="int32"),
            "desiredReplicas": _int("Replicas it decided on.", minimum=0, fmt="int32"),
            "reason": _str("ScaledUp, ScaledDown, Holding, MetricsUnavailable, ScaledFromZero, ScaledToZero or "
                           "Disabled.", max_length=64),
            "message": _str("Why, with the numbers of the decision that last changed this status.", max_length=4096),
            "lastScaleTime": {"type": "string", "format": "date-time", "description": "When it last changed replicas."},
        }),
    })


# --------------------------------------------------------------------------- ServingLane


def serving_lane_spec() -> dict:
    budgets = _obj(
        "Caps on the ModelService's global budgets for this lane (hot-reloaded).",
        _in_field_order(LaneConfig, {k.key: _knob(k, k.lane_doc) for k in LANE_KNOBS}),
        rules=[("!has(self.prefillChunkSize) || !has(self.maxBatchedTokens) || self.prefillChunkSize <= self.maxBatchedTokens",
                "prefillChunkSize must be <= maxBatchedTokens"),
               ("!has(self.kvCacheReserved) || self.kvCacheReserved < 1.0",
                "kvCacheReserved must be < 1 (some of the KV cache stays shared)"),
               ("!has(self.kvCacheReserved) || !has(self.maxKvCacheShare) || self.kvCacheReserved <= self.maxKvCacheShare",
                "kvCacheReserved must be <= maxKvCacheShare")],
    )
    return _obj(
        "A traffic class of a ModelService: its queue, share of each step, caps and latency SLO.",
        {
            "modelServiceRef": _obj("The ModelService in the same namespace this lane belongs to.", {
                "name": _str("ModelService name.", max_length=253, min_length=1),
            }, required=["name"]),
            "laneName": _str("Lane name in the runtime (X-Lane header, metrics label); default: metadata.name.",
                             pattern=DNS_LABEL_PATTERN, max_length=63),
            "class": _str("Lane class.", default="interactive", enum=["interactive", "long-context", "batch"]),
            "priority": _int("Higher is served first among lanes with work.", default=50, minimum=0, maximum=1000),
            "weight": _num("Fair share of the token budget among lanes of equal priority.", default=1.0, minimum=0,
                           maximum=1000, exclusive_minimum=True),
            "default": _bool("Requests matching no rule go to this lane (at most one per ModelService).", default=False),
            "continuousBatching": _bool(
                "false = static batching for this lane only: its requests start as a fresh batch once its previous "
                "batch has finished; the other lanes keep continuous batching (hot-reloaded). Unset: true."),
            "budgets": budgets,
            "slo": _obj("Latency targets (95th percentile, milliseconds) and the availability target.", {
                "ttftP95Ms": _num("Time to first token.", minimum=0, exclusive_minimum=True),
                "tpotP95Ms": _num("Time per output token.", minimum=0, exclusive_minimum=True),
                "e2eP95Ms": _num("End-to-end request latency.", minimum=0, exclusive_minimum=True),
                "maxRefusedShare": _num(
                    "Largest share (0..1) of the lane's requests refused (429, 503) or timed out in the "
                    f"queue (504) per window. Unset: {DEFAULT_MAX_REFUSED_SHARE:g} for a lane with a TTFT or "
                    "TPOT target, none otherwise. Part of SLOMet and of the tuner's objective.",
                    minimum=0, maximum=1),
            }),
            "match": _obj(
                "Classifier rules for requests that name no lane (tried in lane order).",
                {
                    "minPromptTokens": _int("Prompts at least this long go here.", minimum=1),
                    "maxPromptTokens": _int("Prompts at most this long go here.", minimum=1),
                    "tenants": {"type": "array", "description": "Requests of these tenants go here.", "maxItems": 64,
                                "items": {"type": "string", "maxLength": 63}},
                    "models": {"type": "array", "description": "Requests whose `model` is one of these (the served "
                                                               "model's name or a LoRA adapter's) go here.",
                               "maxItems": 64, "items": {"type": "string", "maxLength": 253}},
                    "headers": _string_map("Header name -> exact value.", max_props=16),
                },
                rules=[("!has(self.minPromptTokens) || !has(self.maxPromptTokens) || self.minPromptTokens <= self.maxPromptTokens",
                        "minPromptTokens must be <= maxPromptTokens")],
            ),
            "isolation": _str("shared: served by the ModelService's pool; dedicated: its own Deployment and Service.",
                              default="shared", enum=["shared", "dedicated"]),
            "dedicated": _obj("The dedicated pool (isolation: dedicated only).", {
                "replicas": _int("Pods of the dedicated pool.", default=1, minimum=0, maximum=1000, fmt="int32"),
            }),
            "tuning": _obj("Per-lane tuning.", {
                "enabled": _bool("Let the tuner change this lane's budgets (when the ModelService tunes).", default=True),
                "bounds": _budget_bounds("Bounds of this lane's tuned budgets."),
            }, defaulted=True),
        },
        required=["modelServiceRef"],
        rules=[("!has(self.dedicated) || self.isolation == 'dedicated'", "dedicated needs isolation: dedicated")],
    )


def serving_lane_status() -> dict:
    return _obj("Observed state, written by the operator only.", {
        "observedGeneration": _int("The spec generation last reconciled.", minimum=0),
        "laneName": _str("Lane name in the runtime.", max_length=63),
        "modelService": _str("The ModelService serving this lane.", max_length=253),
        "endpoint": _str("In-cluster URL serving this lane.", max_length=512),
        "replicas": _int("Pods of the dedicated pool.", minimum=0, fmt="int32"),
        "readyReplicas": _int("Ready pods of the dedicated pool.", minimum=0, fmt="int32"),
        "conditions": _conditions(),
        "effectiveBudgets": _free_object("This lane's budgets in force (caps applied, after tuning)."),
        "budgets": _free_object("Each tuned knob in force: `<knob>: {value, source}`, source `spec`, "
                                "`tuner` (an override; the user's edit of the knob drops it) or "
                                "`fallback` (the rollout guard's fallback profile)."),
        "overriddenKnobs": _int("Tuned knobs whose value in force is not the spec's (tuner or fallback).",
                                minimum=0, fmt="int32"),
        "slo": _free_object("Observed p95s against the targets at the last SLOMet transition "
                            "(written by the tuner)."),
    })


# --------------------------------------------------------------------------- CRDs


def _crd(plural: str, kind: str, singular: str, short: list[str], spec: dict, status: dict,
         columns: list[dict], scale: bool, root_rules: Optional[list] = None) -> dict:
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                 "labelSelectorPath": ".status.selector"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "tokenlane", "app.kubernetes.io/part-of": "tokenlane"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": singular, "kind": kind, "listKind": f"{kind}List",
                      "shortNames": short, "categories": ["tokenlane"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": spec["description"],
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string", "description": "API version of the object."},
                        "kind": {"type": "string", "description": "Kind of the object."},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                    **({"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in root_rules]}
                       if root_rules else {}),
                }},
                "subresources": subresources,
                "additionalPrinterColumns": columns,
            }],
        },
    }


def _col(name: str, path: str, typ: str = "string", priority: int = 0, desc: str = "") -> dict:
    out = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        out["priority"] = priority
    if desc:
        out["description"] = desc
    return out


def model_service_crd() -> dict:
    spec = model_service_spec()
    # ModelService names prefix the objects it owns (Service names are DNS-1035 labels of <= 63).
    return _crd("modelservices", "ModelService", "modelservice", ["msvc"], spec, model_service_status(), [
        _col("Replicas", ".spec.replicas", "integer", desc="Desired pods of the shared pool"),
        _col("Ready", ".status.readyReplicas", "integer", desc="Ready pods of the shared pool"),
        _col("Lanes", ".status.lanes", "integer", desc="Lanes served"),
        _col("SLO Met", '.status.conditions[?(@.type=="SLOMet")].status', desc="All lanes within their SLO"),
        _col("Status", '.status.conditions[?(@.type=="Ready")].reason', priority=1),
        _col("Model", ".spec.model.path", priority=1),
        _col("Age", ".metadata.creationTimestamp", "date"),
    ], scale=True, root_rules=[
        ("size(self.metadata.name) <= 50",
         "metadata.name must be at most 50 characters (names of owned objects derive from it)"),
    ])


def serving_lane_crd() -> dict:
    return _crd("servinglanes", "ServingLane", "servinglane", ["lane"], serving_lane_spec(), serving_lane_status(), [
        _col("Model Service", ".spec.modelServiceRef.name"),
        _col("Class", ".spec.class"),
        _col("Isolation", ".spec.isolation"),
        _col("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        _col("SLO Met", '.status.conditions[?(@.type=="SLOMet")].status'),
        _col("Overrides", ".status.overriddenKnobs", "integer",
             desc="Tuned knobs not at their spec value (status.budgets says which, and why)"),
        _col("Priority", ".spec.priority", "integer", priority=1),
        _col("Age", ".metadata.creationTimestamp", "date"),
    ], scale=False, root_rules=[
        ("has(self.spec.laneName) || (size(self.metadata.name) <= 63 && !self.metadata.name.contains('.'))",
         "metadata.name is not a valid lane name (a DNS-1123 label); set spec.laneName"),
    ])


CRD_FILES = {
    "modelservices.tokenlane.dev.yaml": model_service_crd,
    "servinglanes.tokenlane.dev.yaml": serving_lane_crd,
}


def render_crd_files() -> dict[str, str]:
    header = "# Generated from operator/api/schema.py by `python -m tokenlane.operator.api.schema crds/`. Do not edit.\n"
    return {name: header + yaml.safe_dump(make(), sort_keys=False, width=120) for name, make in CRD_FILES.items()}


def crd_schema(kind: str) -> dict:
    """The openAPIV3Schema of a kind (ModelService or ServingLane)."""
    crd = {"ModelService": model_service_crd, "ServingLane": serving_lane_crd}[kind]()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# --------------------------------------------------------------------------- structural semantics


def apply_defaults(schema: dict, value: Any) -> Any:
    """Apply `default`s the way the API server does: for absent properties of present objects."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def to_jsonschema(schema: dict) -> dict:
    """Convert a structural schema to JSON Schema draft 4 (OpenAPI v3.0 keeps draft 4's boolean exclusiveMinimum)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "format"):
            continue
        if key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key == "anyOf":
            out[key] = [to_jsonschema(v) for v in value]
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        pattern = out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
    if out.get("type") == "object" and "properties" in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)  # the API server prunes unknown fields; we refuse them
    return out


def cel_rules(schema: dict, path: str = "") -> list[tuple[str, str, str]]:
    """Every (json path, rule, message) in a schema, for the tests' CEL evaluation."""
    out = [(path or ".", r["rule"], r.get("message", "")) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        out += cel_rules(sub, f"{path}.{key}")
    if "items" in schema:
        out += cel_rules(schema["items"], f"{path}[*]")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out_dir = Path(argv[0] if argv else "crds")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in render_crd_files().items():
        (out_dir / name).write_text(text)
        print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
