"""The router's replicas from Kubernetes: the ready endpoints of a Service's EndpointSlices.

`tokenlane router --endpointslice-service NAME [--namespace NS]` lists and then watches the
discovery.k8s.io/v1 EndpointSlices labelled `kubernetes.io/service-name=NAME`, and after every
change hands the ready endpoints (`http://<address>:<the "http" port>`) to
`BackendSet.update()`; the scrapers follow within one scrape interval. A broken watch or an
expired resourceVersion (410) is followed by a fresh list, after a short back-off, and the last
known set stays in force meanwhile (the scrapes still mark dead replicas down). Failures in a
row back off, doubling up to 30 s.

It talks to the API server through `tokenlane.kube` (the project's one Kubernetes client):
in a pod, with the service account's token (re-read as it rotates) and CA
(`tokenlane.kube.in_cluster`); the router's RBAC needs get, list and watch on endpointslices
in the namespace (manifests/base/router-rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Mapping, Optional

from tokenlane.kube import ApiError, Credentials, KubeApi, Resource
from tokenlane.runtime.fleet.state import BackendSet

log = logging.getLogger("tokenlane.router.discovery")

ENDPOINT_SLICES = Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"  # the runtime Service's port (operator/desired/builders.py)


def _port_of(slice_: Mapping[str, Any]) -> Optional[int]:
    ports = [p for p in slice_.get("ports") or [] if p.get("port")]
    named = [p for p in ports if p.get("name") == PORT_NAME]
    chosen = named or (ports if len(ports) == 1 else [])
    return int(chosen[0]["port"]) if chosen else None


def ready_backends(slices: Iterable[Mapping[str, Any]], scheme: str = "http") -> list[str]:
    """Base URLs of the ready endpoints of `slices`, sorted (pure). An endpoint without a
    `ready` condition counts as ready, as the EndpointSlice API says."""
    urls = set()
    for slice_ in slices:
        port = _port_of(slice_)
        if port is None:
            continue
        for endpoint in slice_.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            if slice_.get("addressType") == "IPv6":
                host = f"[{host}]"
            urls.add(f"{scheme}://{host}:{port}")
    return sorted(urls)


class EndpointSliceWatcher:
    """Keeps `backends` equal to the ready endpoints of Service `namespace/service`."""

    def __init__(self, credentials: Credentials, namespace: str, service: str, backends: BackendSet, *,
                 backoff_s: float = 1.0, watch_timeout_s: int = 300) -> None:
        if not namespace or not service:
            raise ValueError("EndpointSlice discovery needs a namespace and a Service name")
        self.credentials, self.namespace, self.service, self.backends = credentials, namespace, service, backends
        self.backoff_s = backoff_s
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, dict] = {}
        self._task: Optional[asyncio.Task] = None
        self._api: Optional[KubeApi] = None
        self.listed = asyncio.Event()  # set once the first list has been applied

    @property
    def labels(self) -> dict[str, str]:
        return {SERVICE_NAME_LABEL: self.service}

    async def start(self, first_list_timeout_s: float = 10.0) -> None:
        """Start watching; returns after the first list (or its timeout: the router then starts
        with no replica and `/ready` answers 503 until one appears)."""
        self._api = KubeApi(self.credentials, user_agent="tokenlane-router")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="endpointslice-watch")
        try:
            await asyncio.wait_for(self.listed.wait(), first_list_timeout_s)
        except asyncio.TimeoutError:
            log.warning("no EndpointSlice list of %s/%s within %.0fs; starting without replicas",
                        self.namespace, self.service, first_list_timeout_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._api is not None:
            await self._api.close()

    def _apply(self) -> None:
        urls = ready_backends(self.slices.values())
        if tuple(urls) != self.backends.urls:
            log.info("replicas of %s/%s: %s", self.namespace, self.service, ", ".join(urls) or "none")
        self.backends.update(urls)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                version = await self.list_once()
                failures = 0
                while True:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: keep the last set, list again later
                if isinstance(exc, ApiError) and exc.status == 410:
                    continue  # the resourceVersion expired: list again at once
                log.warning("EndpointSlice watch of %s/%s: %s: %s", self.namespace, self.service,
                            type(exc).__name__, exc)
                # Doubling up to 30 s: a router without RBAC does not hammer the API server.
                await asyncio.sleep(min(30.0, self.backoff_s * 2 ** failures))
                failures += 1

    async def list_once(self) -> str:
        """List the slices, apply them; returns the list's resourceVersion."""
        assert self._api is not None, "start() first"
        items, version = await self._api.list_with_version(ENDPOINT_SLICES, self.namespace, self.labels)
        self.slices = {item["metadata"]["name"]: item for item in items}
        self._apply()
        self.listed.set()
        return version

    async def _watch(self, version: str) -> str:
        """One watch request, until the server ends it; returns the last resourceVersion seen."""
        assert self._api is not None
        async for event in self._api.watch(ENDPOINT_SLICES, self.namespace, resource_version=version,
                                           labels=self.labels, timeout_s=self.watch_timeout_s):
            kind, obj = event.get("type"), event.get("object") or {}
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            name = (obj.get("metadata") or {}).get("name")
            if kind == "DELETED":
                self.slices.pop(name, None)
            elif kind in ("ADDED", "MODIFIED"):
                self.slices[name] = obj
            self._apply()
        return version
