"""The operator's Kubernetes client and the executor that carries out planner actions.

`KubeClient` is `tokenlane.kube.KubeApi` (the project's one Kubernetes client, shared with the
fleet router's discovery and `tokenlane check`) bound to whatever server kopf logged in to: it
takes the same `kopf.ConnectionInfo` (server, CA, client certificate, token), so the operator
needs exactly one login (main.py's, through `tokenlane.kube.load`; or the test's kmock URL).

Writes are server-side apply (`application/apply-patch+yaml`, field manager
"tokenlane-operator", force) so the operator owns exactly the fields it renders and leaves
other managers' fields alone; on a real API server an apply also creates a missing object.
Where apply answers 404 (the kmock emulator has no create-by-apply) the object is created
(POST) and then applied. 404 on delete and 409 on create are expected races and tolerated.
"""

from __future__ import annotations

import base64
import datetime
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from tokenlane.kube import ApiError, Credentials, KubeApi, Resource
from tokenlane.operator.desired.builders import FIELD_MANAGER, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from tokenlane.operator.desired.planner import Action, Key

log = logging.getLogger("tokenlane.operator.clients.kube")


# ApiError and Resource are tokenlane.kube's: the controllers use them as k8s.ApiError, k8s.Resource.

MODEL_SERVICES = Resource("tokenlane.dev", "v1alpha1", "modelservices", "ModelService")
SERVING_LANES = Resource("tokenlane.dev", "v1alpha1", "servinglanes", "ServingLane")
CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap")
SERVICES = Resource("", "v1", "services", "Service")
EVENTS = Resource("", "v1", "events", "Event")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
SERVICE_MONITORS = Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor")
INFERENCE_POOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
LEADER_WORKER_SETS = Resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
KOPF_PEERINGS = Resource("kopf.dev", "v1", "kopfpeerings", "KopfPeering")
CLUSTER_KOPF_PEERINGS = Resource("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                namespaced=False)

# Kinds the operator owns, in the order it observes them.
OWNED = (CONFIG_MAPS, DEPLOYMENTS, LEADER_WORKER_SETS, SERVICES, PDBS, SERVICE_MONITORS, INFERENCE_POOLS)
# The kinds that run a pool's pods: status.replicas / readyReplicas / updatedReplicas count pods
# of a Deployment, groups of a LeaderWorkerSet.
WORKLOADS = (DEPLOYMENTS, LEADER_WORKER_SETS)
_BY_KIND = {(r.api_version, r.kind): r for r in (*OWNED, MODEL_SERVICES, SERVING_LANES, EVENTS, CRDS)}


def resource_for(api_version: str, kind: str) -> Resource:
    try:
        return _BY_KIND[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no resource known for {api_version} {kind}") from None


ConnectionSource = Union[Any, Callable[[], Any]]  # a kopf.ConnectionInfo or Credentials, or a callable returning one


def _pem(value: Union[str, bytes, None]) -> Optional[bytes]:
    """kopf keeps certificates as PEM or as base64 of PEM (kubeconfig's -data fields)."""
    if not value:
        return None
    raw = value.encode() if isinstance(value, str) else value
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


def credentials_from_connection(info: Any) -> Credentials:
    """The `Credentials` of a kopf.ConnectionInfo (read by attribute: no kopf import here)."""
    if isinstance(info, Credentials):
        return info

    def path(value: Any) -> Optional[Path]:
        return Path(value.decode() if isinstance(value, bytes) else value) if value else None

    return Credentials(
        server=info.server, ca_file=path(info.ca_path), ca_data=_pem(info.ca_data), insecure=bool(info.insecure),
        cert_file=path(info.certificate_path), cert_data=_pem(info.certificate_data),
        key_file=path(info.private_key_path), key_data=_pem(info.private_key_data),
        token=info.token, username=info.username, password=info.password,
        namespace=info.default_namespace, source=f"kopf login to {info.server}")


class KubeClient(KubeApi):
    """The operator's client: `KubeApi` with the operator's field manager, following kopf's
    login (`connection`: a kopf.ConnectionInfo, or a callable returning the current one)."""

    def __init__(self, connection: ConnectionSource, *, timeout_s: float = 30.0,
                 on_request: Optional[Callable[[str, str, int, float], None]] = None,
                 user_agent: str = "tokenlane-operator"):
        self._connection = connection
        self._converted: tuple[Any, Optional[Credentials]] = (None, None)
        super().__init__(self._current_credentials, field_manager=FIELD_MANAGER, user_agent=user_agent,
                         timeout_s=timeout_s, on_request=on_request)

    def _current_credentials(self) -> Optional[Credentials]:
        info = self._connection() if callable(self._connection) else self._connection
        if info is None:
            return None
        seen, creds = self._converted
        if info is not seen:  # the same Credentials object for the same login keeps one connection pool
            creds = credentials_from_connection(info)
            self._converted = (info, creds)
        return creds


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

