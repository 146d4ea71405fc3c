"""The router's replicas from Kubernetes: the ready endpoints of a Service's EndpointSlices.

`tokenlane router --endpointslice-service NAME [--namespace NS]` lists and then watches the
discovery.k8s.io/v1 EndpointSlices labelled `kubernetes.io/service-name=NAME`, and after every
change hands the ready endpoints (`http://<address>:<the "http" port>`) to
`BackendSet.update()`; the scrapers follow within one scrape interval. A broken watch or an
expired resourceVersion (410) is followed by a fresh list, after a short back-off, and the last
known set stays in force meanwhile (the scrapes still mark dead replicas down). Failures in a
row back off, doubling up to 30 s.

It talks to the API server with plain httpx (the runtime image has no Kubernetes client):
in a pod, through the service account's token and CA (`ApiAccess.in_cluster`); the router's
RBAC needs get, list and watch on endpointslices in the namespace
(manifests/base/router-rbac.yaml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import httpx

from tokenlane.runtime.fleet.state import BackendSet

log = logging.getLogger("tokenlane.router.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"  # the runtime Service's port (operator/desired/builders.py)


@dataclass(frozen=True)
class ApiAccess:
    """Where the API server is and how to authenticate to it."""

    server: str  # https://host:port
    token_file: Optional[Path] = None  # re-read at each (re)connect: projected tokens rotate
    ca_file: Optional[Path] = None
    token: Optional[str] = None  # a fixed token (tests, local use) instead of token_file

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> "ApiAccess":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("--endpointslice-service needs to run in a Kubernetes pod "
                             "(KUBERNETES_SERVICE_HOST is not set)")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", token_file=sa_dir / "token", ca_file=sa_dir / "ca.crt")

    def headers(self) -> dict[str, str]:
        token = self.token
        if token is None and self.token_file is not None:
            token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def verify(self) -> Any:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else True


def in_cluster_namespace(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Optional[str]:
    """The pod's namespace, from its service account mount."""
    try:
        return (sa_dir / "namespace").read_text().strip() or None
    except OSError:
        return None


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


class ExpiredWatch(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class EndpointSliceWatcher:
    """Keeps `backends` equal to the ready endpoints of Service `namespace/service`."""

    def __init__(self, access: ApiAccess, namespace: str, service: str, backends: BackendSet, *,
                 backoff_s: float = 1.0, watch_timeout_s: int = 300) -> None:
        if not namespace or not service:
            raise ValueError("EndpointSlice discovery needs a namespace and a Service name")
        self.access, self.namespace, self.service, self.backends = access, namespace, service, backends
        self.backoff_s = backoff_s
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, dict] = {}
        self._task: Optional[asyncio.Task] = None
        self._client: Optional[httpx.AsyncClient] = None
        self.listed = asyncio.Event()  # set once the first list has been applied

    @property
    def path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    async def start(self, first_list_timeout_s: float = 10.0) -> None:
        """Start watching; returns after the first list (or its timeout: the router then starts
        with no replica and `/ready` answers 503 until one appears)."""
        self._client = httpx.AsyncClient(base_url=self.access.server, verify=self.access.verify(),
                                         timeout=httpx.Timeout(30.0, read=self.watch_timeout_s + 30.0),
                                         trust_env=False)
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
        if self._client is not None:
            await self._client.aclose()

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
            except ExpiredWatch:
                continue  # list again at once
            except Exception as exc:  # noqa: BLE001 - any failure: keep the last set, list again later
                log.warning("EndpointSlice watch of %s/%s: %s: %s", self.namespace, self.service,
                            type(exc).__name__, exc)
                # Doubling up to 30 s: a router without RBAC does not hammer the API server.
                await asyncio.sleep(min(30.0, self.backoff_s * 2 ** failures))
                failures += 1

    async def list_once(self) -> str:
        """List the slices, apply them; returns the list's resourceVersion."""
        assert self._client is not None, "start() first"
        response = await self._client.get(self.path, params={"labelSelector": self.selector},
                                          headers=self.access.headers())
        response.raise_for_status()
        body = response.json()
        self.slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self._apply()
        self.listed.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> str:
        """One watch request, until the server ends it; returns the last resourceVersion seen."""
        assert self._client is not None
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_timeout_s)}
        async with self._client.stream("GET", self.path, params=params, headers=self.access.headers()) as response:
            if response.status_code == 410:
                raise ExpiredWatch()
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise ExpiredWatch()
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
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
