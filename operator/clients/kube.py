"""A thin async Kubernetes client (aiohttp) and the executor that carries out planner actions.

The client talks to whatever server kopf logged in to: it takes the same
`kopf.ConnectionInfo` (server, CA, client certificate, token), so the operator needs exactly
one login (kubeconfig, in-cluster service account, or the test's kmock URL).

Writes are server-side apply (`application/apply-patch+yaml`, field manager
"tokenlane-operator", force) so the operator owns exactly the fields it renders and leaves
other managers' fields alone; on a real API server an apply also creates a missing object.
Where apply answers 404 (the kmock emulator has no create-by-apply) the object is created
(POST) and then applied. 404 on delete and 409 on create are expected races and tolerated.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import aiohttp

from tokenlane.operator.desired.builders import FIELD_MANAGER, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from tokenlane.operator.desired.planner import Action, Key

log = logging.getLogger("tokenlane.operator.clients.kube")


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: Optional[str] = None, name: Optional[str] = None,
             subresource: Optional[str] = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


MODEL_SERVICES = Resource("tokenlane.dev", "v1alpha1", "modelservices", "ModelService")
SERVING_LANES = Resource("tokenlane.dev", "v1alpha1", "servinglanes", "ServingLane")
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap")
SERVICES = Resource("", "v1", "services", "Service")
EVENTS = Resource("", "v1", "events", "Event")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
SERVICE_MONITORS = Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor")
INFERENCE_POOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
KOPF_PEERINGS = Resource("kopf.dev", "v1", "kopfpeerings", "KopfPeering")
CLUSTER_KOPF_PEERINGS = Resource("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                namespaced=False)

# Kinds the operator owns, in the order it observes them.
OWNED = (CONFIG_MAPS, DEPLOYMENTS, SERVICES, PDBS, SERVICE_MONITORS, INFERENCE_POOLS)
_BY_KIND = {(r.api_version, r.kind): r for r in (*OWNED, MODEL_SERVICES, SERVING_LANES, EVENTS, CRDS)}


def resource_for(api_version: str, kind: str) -> Resource:
    try:
        return _BY_KIND[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no resource known for {api_version} {kind}") from None


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = ""):
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def namespace_terminating(self) -> bool:
        """The namespace is being deleted: the server refuses new objects in it (403)."""
        return self.status == 403 and "because it is being terminated" in self.message

    @property
    def transient(self) -> bool:
        """Worth retrying later: conflicts, throttling, server trouble."""
        return self.status in (409, 429) or self.status >= 500


ConnectionSource = Union[Any, Callable[[], Any]]  # a kopf.ConnectionInfo or a callable returning one


class KubeClient:
    """Minimal JSON-over-HTTP client for the few calls the operator makes."""

    def __init__(self, connection: ConnectionSource, *, timeout_s: float = 30.0,
                 on_request: Optional[Callable[[str, str, int, float], None]] = None,
                 user_agent: str = "tokenlane-operator"):
        self._connection = connection
        self._user_agent = user_agent
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: Optional[aiohttp.ClientSession] = None
        self._ssl_cache: dict[int, Any] = {}
        self._on_request = on_request  # metrics hook: (method, path, status, seconds)

    def _info(self) -> Any:
        info = self._connection() if callable(self._connection) else self._connection
        if info is None:
            raise ApiError(503, "NotLoggedIn", "no connection info yet (login pending)")
        return info

    def _ssl(self, info: Any) -> Any:
        if not info.server.startswith("https"):
            return None
        key = id(info)
        if key not in self._ssl_cache:
            self._ssl_cache = {key: info.as_ssl_context()}
        return self._ssl_cache[key]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, params: Optional[Mapping[str, str]] = None,
                      body: Any = None, content_type: str = "application/json") -> Any:
        info = self._info()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Accept": "application/json", "User-Agent": self._user_agent, **info.as_http_headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)  # JSON is YAML too: fine for application/apply-patch+yaml
        url = info.server.rstrip("/") + path
        started = time.monotonic()
        status = 0
        try:
            async with self._session.request(method, url, params=params, data=data, headers=headers,
                                              ssl=self._ssl(info)) as resp:
                status = resp.status
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApiError(503, "ConnectionError", str(exc) or type(exc).__name__, method, path) from None
        finally:
            if self._on_request:
                self._on_request(method, path, status, time.monotonic() - started)
        payload: Any = None
        if text:
            try:
                payload = json.loads(text)
            except ValueError:
                payload = text
        if status >= 400:
            reason = payload.get("reason", "") if isinstance(payload, dict) else ""
            message = payload.get("message", "") if isinstance(payload, dict) else str(payload)[:500]
            raise ApiError(status, reason, message, method, path)
        return payload

    # ---- typed helpers

    async def get(self, res: Resource, namespace: Optional[str], name: str) -> Optional[dict]:
        try:
            return await self.request("GET", res.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, res: Resource, namespace: Optional[str] = None,
                   labels: Optional[Mapping[str, str]] = None) -> list[dict]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        payload = await self.request("GET", res.path(namespace), params=params)
        items = list((payload or {}).get("items") or [])
        for item in items:  # list items omit these; the planner keys on them
            item.setdefault("apiVersion", res.api_version)
            item.setdefault("kind", res.kind)
        if labels:  # servers that ignore labelSelector (the kmock emulator) still give the right answer
            items = [i for i in items
                     if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]
        if namespace:
            items = [i for i in items if (i.get("metadata") or {}).get("namespace") in (None, namespace)]
        return items

    async def create(self, res: Resource, obj: dict) -> dict:
        ns = (obj.get("metadata") or {}).get("namespace")
        return await self.request("POST", res.path(ns), body=obj, params={"fieldManager": FIELD_MANAGER})

    async def apply(self, res: Resource, obj: dict) -> dict:
        meta = obj["metadata"]
        return await self.request("PATCH", res.path(meta.get("namespace"), meta["name"]), body=obj,
                                  content_type="application/apply-patch+yaml",
                                  params={"fieldManager": FIELD_MANAGER, "force": "true"})

    async def merge_patch(self, res: Resource, namespace: Optional[str], name: str, patch: dict,
                          subresource: Optional[str] = None) -> dict:
        return await self.request("PATCH", res.path(namespace, name, subresource), body=patch,
                                  content_type="application/merge-patch+json")

    async def delete(self, res: Resource, namespace: Optional[str], name: str) -> bool:
        """True if deleted now, False if it was already gone."""
        try:
            await self.request("DELETE", res.path(namespace, name), body={"propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def has_resource(self, res: Resource) -> bool:
        """Whether the server serves `res` (e.g. the Prometheus Operator's ServiceMonitor)."""
        base = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
        try:
            payload = await self.request("GET", base)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in (payload or {}).get("resources") or [])


def timestamp(now: Optional[float] = None) -> str:
    """An RFC 3339 UTC time in whole seconds, as Kubernetes writes them (`now`: epoch seconds;
    default the current time): conditions, Events, the tuner's decisions."""
    when = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.timezone.utc)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def event_for(body: Mapping[str, Any], type_: str, reason: str, message: str, *,
              now: Optional[float] = None, component: str = FIELD_MANAGER) -> dict:
    """A core/v1 Event about `body`, named like kubectl's (`<object>.<unique hex>`): unique
    names instead of generateName, which some servers (the kmock emulator) do not honour."""
    meta = body.get("metadata") or {}
    stamp = timestamp(now)
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "name": meta["name"],
                           "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": component}, "reportingComponent": component,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


async def post_event(client: KubeClient, body: Mapping[str, Any], type_: str, reason: str, message: str, *,
                     now: Optional[float] = None) -> bool:
    """The operator's one Event helper (handlers and the tuning timer): post an Event about
    `body`, best effort (an Event never fails a reconcile or a decision). Works in and outside
    kopf handlers (timers, direct calls), unlike kopf.event()."""
    event = event_for(body, type_, reason, message, now=now)
    try:
        await client.create(EVENTS, event)
        return True
    except ApiError as exc:
        meta = body.get("metadata") or {}
        # In a namespace being deleted no Event can be created: expected, not worth a warning.
        log.log(logging.DEBUG if exc.namespace_terminating else logging.WARNING, "could not post Event %s for %s/%s: %s",
                reason, meta.get("namespace"), meta.get("name"), exc)
        return False


class Executor:
    """Observes the objects a ModelService owns and carries out planner actions."""

    def __init__(self, client: KubeClient):
        self.client = client

    async def observe(self, namespace: str, owner_name: str, kinds: tuple[Resource, ...] = OWNED) -> list[dict]:
        labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_INSTANCE: owner_name}
        observed: list[dict] = []
        for res in kinds:
            try:
                observed += await self.client.list(res, namespace, labels)
            except ApiError as exc:
                if exc.status != 404:  # a kind the server does not serve (no Prometheus Operator)
                    raise
        return observed

    async def execute(self, actions: list[Action]) -> dict[Key, dict]:
        """Run actions in order; returns the server's copy of every created/applied object."""
        results: dict[Key, dict] = {}
        for action in actions:
            api_version, kind, namespace, name = action.key
            res = resource_for(api_version, kind)
            if action.verb == "delete":
                await self.client.delete(res, namespace, name)
                log.info("deleted %s %s/%s (%s)", kind, namespace, name, action.reason)
                continue
            assert action.obj is not None
            results[action.key] = await self._upsert(res, action)
            log.info("%s %s %s/%s (%s)", "created" if action.verb == "create" else "applied", kind, namespace,
                     name, action.reason)
        return results

    async def _upsert(self, res: Resource, action: Action) -> dict:
        """Server-side apply, which also creates a missing object on a real API server (one
        write). Servers without create-by-apply (the kmock emulator) answer 404: create, then
        apply, so the applied fields are recorded the same way."""
        obj = action.obj
        assert obj is not None
        try:
            return await self.client.apply(res, obj)
        except ApiError as exc:
            if exc.status != 404:
                raise
        try:
            await self.client.create(res, obj)
        except ApiError as exc:
            if exc.status != 409:  # created meanwhile (an earlier attempt): apply below
                raise
        return await self.client.apply(res, obj)

