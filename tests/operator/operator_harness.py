"""The kopf operator running against the kmock emulator: one harness shared by tests/operator
and tests/tuner (both conftests import it; the unique module name keeps --import-mode=importlib
from confusing it with another area's helpers).

The kmock emulator (PyPI `kmock`, by kopf's author) serves the Kubernetes API over real HTTP
on loopback; the operator logs in to it like to any cluster. Known limits: it
serves only declared resources, PATCH is a plain dict merge, no validation, no garbage
collection, no uid/generation bookkeeping (tests set them).

Every API call the operator makes (kopf's, the handlers', the tuner's) is collected over the
session in API_CALLS; tests/operator/conftest.py writes them to api_calls.json (the input of the
least-privilege RBAC in manifests/) when TOKENLANE_REGEN_API_CALLS=1:
    TOKENLANE_REGEN_API_CALLS=1 python -m pytest tests/operator tests/tuner -k kmock
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from pathlib import Path
from typing import Any, Callable, Optional

import kopf
import yaml

from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.api import schema
from tokenlane.operator.controllers.handlers import Operator, register

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SAMPLES = ROOT / "manifests" / "samples"
API_CALLS_FILE = HERE / "api_calls.json"

RESOURCES = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
    "v1/namespaces": ("Namespace", False, ()),
    "v1/events": ("Event", True, ()),
    "tokenlane.dev/v1alpha1/modelservices": ("ModelService", True, ("status", "scale")),
    "tokenlane.dev/v1alpha1/servinglanes": ("ServingLane", True, ("status",)),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "v1/services": ("Service", True, ("status",)),
    "v1/configmaps": ("ConfigMap", True, ()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "v1/pods": ("Pod", True, ("status",)),  # read for the fetch-model init containers (ModelAvailable)
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
NS = "tokenlane-demo"
TEST_USER_AGENT = "tokenlane-tests"


def load_samples(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if d]


API_CALLS: set[tuple[str, str, str, str, str]] = set()  # (group, version, plural, subresource, verb)


def _verb(request: Any) -> str:
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())


def record_calls(kmock: Any) -> None:
    for request in list(kmock):
        res = request.resource
        if res is None or not res.plural or request.headers.get("User-Agent") == TEST_USER_AGENT:
            continue  # discovery (allowed to everyone) and the tests' own calls are not RBAC input
        API_CALLS.add((res.group or "", res.version or "", res.plural or "", request.subresource or "", _verb(request)))


def unlisted_calls() -> list[tuple[str, str, str, str, str]]:
    """Calls recorded so far that api_calls.json (the RBAC input) does not list."""
    import json

    listed = {(c["group"], c["version"], c["resource"], c["subresource"], c["verb"])
              for c in json.loads(API_CALLS_FILE.read_text())["calls"]}
    return sorted(API_CALLS - listed)


def spec_writes(kmock: Any) -> list[tuple[str, str, Any]]:
    """Writes of the operator (kopf's, the handlers', the tuner's) to our kinds that touch spec:
    spec belongs to the user (GitOps), so this must stay empty."""
    found = []
    for r in list(kmock):
        if r.headers.get("User-Agent") == TEST_USER_AGENT or r.resource is None or r.resource.group != "tokenlane.dev":
            continue
        if str(getattr(r.method, "value", r.method)).upper() not in ("PATCH", "PUT", "POST"):
            continue
        body = r.data if isinstance(r.data, dict) else {}
        ops = r.data if isinstance(r.data, list) else []  # kopf's JSON patches
        if "spec" in body or any(str(op.get("path", "")).startswith("/spec") for op in ops):
            found.append((str(getattr(r.method, "value", r.method)), str(r.url), r.data))
    return found


def operator_write_calls(kmock: Any) -> list[tuple[str, str, str, str]]:
    """Every write of the operator (kopf's, the handlers', the tuner's) to any kind, Events
    included: (verb, plural, subresource, name). Quiet-status tests count these."""
    return [(_verb(r), r.resource.plural or "", r.subresource or "", r.name or "") for r in list(kmock)
            if r.headers.get("User-Agent") != TEST_USER_AGENT and r.resource is not None
            and str(getattr(r.method, "value", r.method)).upper() in ("PATCH", "PUT", "POST", "DELETE")]


def operator_writes(kmock: Any) -> int:
    """How many writes the operator made to our kinds (a sanity check for spec_writes)."""
    return sum(1 for r in list(kmock) if r.headers.get("User-Agent") != TEST_USER_AGENT and r.resource is not None
               and r.resource.group == "tokenlane.dev"
               and str(getattr(r.method, "value", r.method)).upper() in ("PATCH", "PUT", "POST"))


class Cluster:
    """The kmock emulator with the operator running against it, plus helpers for tests."""

    def __init__(self, kmock: Any, op: Operator):
        self.kmock = kmock
        self.op = op
        info = kopf.ConnectionInfo(server=str(kmock.url), insecure=True)
        self.client = k8s.KubeClient(info, user_agent=TEST_USER_AGENT)
        self.api_calls = API_CALLS
        self.api_calls_file = API_CALLS_FILE
        self.record_calls = lambda: record_calls(kmock)
        self.unlisted_calls = unlisted_calls

    def obj(self, plural: str, name: str, ns: str = NS) -> dict | None:
        key = {"modelservices": "tokenlane.dev/v1alpha1/modelservices",
               "servinglanes": "tokenlane.dev/v1alpha1/servinglanes",
               "deployments": "apps/v1/deployments", "services": "v1/services", "configmaps": "v1/configmaps",
               "poddisruptionbudgets": "policy/v1/poddisruptionbudgets", "events": "v1/events",
               "pods": "v1/pods"}[plural]
        for (res, ns_, name_), obj in self.kmock.objects.items():
            if f"{res.group + '/' if res.group else ''}{res.version}/{res.plural}" == key and ns_ == ns \
                    and name_ == name and not obj.deleted:
                return copy.deepcopy(obj.raw)
        return None

    def names(self, plural: str, ns: str = NS) -> set[str]:
        out = set()
        for (res, ns_, name_), obj in self.kmock.objects.items():
            if res.plural == plural and ns_ == ns and not obj.deleted:
                out.add(name_)
        return out

    def events(self, ns: str = NS) -> list[dict]:
        """The Events the emulator stored (a POST it refused, e.g. a name clash, is not here)."""
        return [copy.deepcopy(obj.raw) for (res, ns_, _), obj in list(self.kmock.objects.items())
                if res.plural == "events" and ns_ == ns and not obj.deleted]

    def events_about(self, kind: str, name: str, reason: str, ns: str = NS) -> list[dict]:
        return [e for e in self.events(ns) if e.get("reason") == reason
                and (e.get("involvedObject") or {}).get("kind") == kind
                and (e.get("involvedObject") or {}).get("name") == name]

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
        # A cap, not an expectation: the reconcile usually lands in well under a second.
        deadline = time.monotonic() + timeout
        last_exc = None
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except (KeyError, TypeError, AttributeError, IndexError) as exc:
                last_exc = exc
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what or predicate} (last error: {last_exc!r})")

    async def create(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", NS)
        meta.setdefault("uid", f"uid-{obj['kind'].lower()}-{meta['name']}")
        meta.setdefault("generation", 1)
        meta.setdefault("resourceVersion", "1")  # kopf's JSON patches test it; kmock keeps no versions
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:%02dZ" % (len(self.kmock.objects) % 60))
        res = k8s.resource_for(obj["apiVersion"], obj["kind"])
        return await self.client.create(res, obj)

    async def patch_spec(self, plural: str, name: str, spec_patch: dict, ns: str = NS) -> dict:
        res = {"modelservices": k8s.MODEL_SERVICES, "servinglanes": k8s.SERVING_LANES}[plural]
        current = self.obj(plural, name, ns)
        generation = int(current["metadata"].get("generation") or 1) + 1  # kmock does not bump it
        return await self.client.merge_patch(res, ns, name, {"metadata": {"generation": generation},
                                                             "spec": spec_patch})

    async def delete(self, plural: str, name: str, ns: str = NS) -> None:
        res = {"modelservices": k8s.MODEL_SERVICES, "servinglanes": k8s.SERVING_LANES}[plural]
        await self.client.delete(res, ns, name)

    def condition(self, plural: str, name: str, type_: str) -> dict | None:
        obj = self.obj(plural, name) or {}
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c.get("type") == type_:
                return c
        return None


def declare_resources(kmock) -> None:
    for key, (kind, namespaced, subresources) in RESOURCES.items():
        kmock.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                  subresources=set(subresources))
    for make in (schema.model_service_crd, schema.serving_lane_crd):
        crd = make()
        kmock.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]] = crd
    kmock.objects["v1/namespaces", None, NS] = {"metadata": {"name": NS}}


@contextlib.asynccontextmanager
async def running_cluster(kmock, setup: Optional[Callable[[kopf.OperatorRegistry, Operator], Any]] = None):
    """kopf with the operator's handlers against `kmock`; `setup(registry, op)` registers more
    (the tuner's timer) and its result is kept as `cluster.extra`."""
    declare_resources(kmock)

    op = Operator(timer_interval_s=3600)
    registry = register(kopf.OperatorRegistry(), op,
                        login=lambda **_: kopf.ConnectionInfo(server=str(kmock.url), insecure=True))
    extra = setup(registry, op) if setup is not None else None

    @kopf.on.startup(registry=registry)
    def fast(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.reconnect_backoff = 0.1
        settings.posting.enabled = True
        settings.persistence.consistency_timeout = 0.5
        settings.networking.error_backoffs = [0.1, 0.2, 0.5]
        settings.background.instant_exit_timeout = 0.1

    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, clusterwide=True, standalone=True,
                                             stop_flag=stop))
    c = Cluster(kmock, op)
    c.extra = extra
    try:
        yield c
    finally:
        record_calls(kmock)
        # Cancelling (not the stop flag) skips kopf's 5 s wait for "hung" tasks, which here
        # would include the emulator's own never-ending watch streams.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, timeout=10)
        await c.client.close()
