"""An async JSON client for the Kubernetes API calls tokenlane makes (httpx).

`KubeApi` takes `Credentials` (or a callable returning the current ones: a controller whose
login is renewed) and offers get, list, watch, create, server-side apply, JSON merge patch
(the `status` and `scale` subresources included), delete and API discovery. Every failure is
an `ApiError` with the HTTP status and the server's `reason`: the API's own errors, a watch's
ERROR event, an unreachable server (503 `ConnectionError`) and credentials that cannot be had
(401 `CredentialsError`). A 401 from the server makes a rotating credential (token file, exec
plugin) refresh and the request run once more.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Union

import httpx

from tokenlane.kube.credentials import Authenticator, Credentials, CredentialsError

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Resource:
    """An API resource: its group ("" for the core API), version, plural and kind."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_path(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    def path(self, namespace: Optional[str] = None, name: Optional[str] = None,
             subresource: Optional[str] = None) -> str:
        base = self.group_path
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


class ApiError(Exception):
    """A Kubernetes API call failed: `status` (HTTP), `reason` (the Status object's, e.g.
    NotFound, Conflict, Expired; or ConnectionError, CredentialsError) and `message`."""

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


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _api_error(status: int, text: str, method: str, path: str) -> ApiError:
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        return ApiError(status, payload.get("reason", ""), payload.get("message", ""), method, path)
    return ApiError(status, "", text[:500], method, path)


CredentialSource = Union[Credentials, Callable[[], Optional[Credentials]]]


class KubeApi:
    """One API server, one identity, one HTTP connection pool."""

    def __init__(self, credentials: CredentialSource, *, field_manager: str = "tokenlane",
                 user_agent: str = "tokenlane", timeout_s: float = 30.0,
                 on_request: Optional[Callable[[str, str, int, float], None]] = None):
        self._source = credentials
        self.field_manager = field_manager
        self._user_agent = user_agent
        self._timeout = httpx.Timeout(timeout_s)
        self._on_request = on_request  # a metrics hook: (method, path, status, seconds)
        self._creds: Optional[Credentials] = None
        self._auth: Optional[Authenticator] = None
        self._http: Optional[httpx.AsyncClient] = None
        self._http_cert: Optional[tuple[bytes, bytes]] = None

    def credentials(self) -> Credentials:
        creds = self._source() if callable(self._source) else self._source
        if creds is None:
            raise ApiError(503, "NotLoggedIn", "no credentials yet (login pending)")
        return creds

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _client(self, creds: Credentials) -> tuple[httpx.AsyncClient, Authenticator, Optional[str]]:
        if creds is not self._creds or self._auth is None:
            await self.close()  # new credentials (a renewed login): new TLS identity, new pool
            self._creds, self._auth = creds, Authenticator(creds)
        auth = self._auth
        # An exec plugin's client certificate is known once it ran: authorization() first.
        authorization = await auth.authorization()
        if self._http is None or self._http.is_closed or self._http_cert != auth.exec_certificate:
            await self.close()
            context = creds.ssl_context(auth.exec_certificate)
            self._http = httpx.AsyncClient(verify=context if context is not None else True,
                                           timeout=self._timeout, trust_env=False)
            self._http_cert = auth.exec_certificate
        return self._http, auth, authorization

    async def _send(self, method: str, path: str, *, params: Optional[Mapping[str, str]] = None, body: Any = None,
                    content_type: str = "application/json", stream: bool = False,
                    timeout: Optional[httpx.Timeout] = None) -> httpx.Response:
        """The response of one call (status unchecked; `stream`: the body is not read yet)."""
        creds = self.credentials()
        data = json.dumps(body).encode() if body is not None else None  # JSON is YAML too: fine for apply
        for attempt in range(2):
            try:
                client, auth, authorization = await self._client(creds)
            except CredentialsError as exc:
                raise ApiError(401, "CredentialsError", str(exc), method, path) from None
            headers = {"Accept": "application/json", "User-Agent": self._user_agent}
            if authorization:
                headers["Authorization"] = authorization
            if data is not None:
                headers["Content-Type"] = content_type
            extensions = {"sni_hostname": creds.tls_server_name} if creds.tls_server_name else None
            request = client.build_request(method, creds.server.rstrip("/") + path, params=params, content=data,
                                           headers=headers, extensions=extensions,
                                           timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            started, status = time.monotonic(), 0
            try:
                response = await client.send(request, stream=stream)
                status = response.status_code
            except httpx.HTTPError as exc:
                raise ApiError(503, "ConnectionError", str(exc) or type(exc).__name__, method, path) from None
            finally:
                if self._on_request:
                    self._on_request(method, path, status, time.monotonic() - started)
            rotating = creds.token_file is not None or creds.exec_plugin is not None
            if status == 401 and attempt == 0 and rotating:
                await response.aclose()
                auth.invalidate()  # a rotated token or an expired exec credential: fetch anew, once
                continue
            return response
        raise AssertionError("unreachable")

    async def request(self, method: str, path: str, *, params: Optional[Mapping[str, str]] = None,
                      body: Any = None, content_type: str = "application/json") -> Any:
        """One call; returns the decoded JSON body (or the text, or None when empty)."""
        response = await self._send(method, path, params=params, body=body, content_type=content_type)
        text = response.text
        if response.status_code >= 400:
            raise _api_error(response.status_code, text, method, path)
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    # ---- reads

    async def get(self, res: Resource, namespace: Optional[str], name: str,
                  subresource: Optional[str] = None) -> Optional[dict]:
        """The object (or its subresource), or None when it does not exist."""
        try:
            return await self.request("GET", res.path(namespace, name, subresource))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list_with_version(self, res: Resource, namespace: Optional[str] = None,
                                labels: Optional[Mapping[str, str]] = None) -> tuple[list[dict], str]:
        """The objects (apiVersion and kind set, which list items omit) and the list's
        resourceVersion, to watch from."""
        params = {"labelSelector": label_selector(labels)} if labels else None
        payload = await self.request("GET", res.path(namespace), params=params) or {}
        items = list(payload.get("items") or [])
        for item in items:
            item.setdefault("apiVersion", res.api_version)
            item.setdefault("kind", res.kind)
        if labels:  # servers that ignore labelSelector (the kmock emulator) still give the right answer
            items = [i for i in items
                     if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]
        if namespace and res.namespaced:
            items = [i for i in items if (i.get("metadata") or {}).get("namespace") in (None, namespace)]
        return items, str((payload.get("metadata") or {}).get("resourceVersion") or "")

    async def list(self, res: Resource, namespace: Optional[str] = None,
                   labels: Optional[Mapping[str, str]] = None) -> list[dict]:
        return (await self.list_with_version(res, namespace, labels))[0]

    async def watch(self, res: Resource, namespace: Optional[str] = None, *, resource_version: str = "",
                    labels: Optional[Mapping[str, str]] = None, timeout_s: int = 300) -> AsyncIterator[dict]:
        """The watch events ({"type", "object"}, bookmarks included) until the server ends the
        watch after `timeout_s`. An expired resourceVersion raises ApiError 410 (list again)."""
        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        if resource_version:
            params["resourceVersion"] = resource_version
        if labels:
            params["labelSelector"] = label_selector(labels)
        path = res.path(namespace)
        response = await self._send("GET", path, params=params, stream=True,
                                    timeout=httpx.Timeout(self._timeout.connect or 30.0, read=timeout_s + 30.0))
        try:
            if response.status_code >= 400:
                await response.aread()
                raise _api_error(response.status_code, response.text, "WATCH", path)
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(int(status.get("code") or 500), status.get("reason", ""),
                                   status.get("message", ""), "WATCH", path)
                yield event
        except httpx.HTTPError as exc:
            raise ApiError(503, "ConnectionError", str(exc) or type(exc).__name__, "WATCH", path) from None
        finally:
            await response.aclose()

    async def has_resource(self, res: Resource) -> bool:
        """Whether the server serves `res` (e.g. the Prometheus Operator's ServiceMonitor)."""
        try:
            payload = await self.request("GET", res.group_path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in (payload or {}).get("resources") or [])

    # ---- writes

    async def create(self, res: Resource, obj: dict) -> dict:
        ns = (obj.get("metadata") or {}).get("namespace")
        return await self.request("POST", res.path(ns), body=obj, params={"fieldManager": self.field_manager})

    async def apply(self, res: Resource, obj: dict, *, subresource: Optional[str] = None, force: bool = True) -> dict:
        """Server-side apply of `obj` under this client's field manager (it also creates a
        missing object); `force` takes over fields another manager owns."""
        meta = obj["metadata"]
        params = {"fieldManager": self.field_manager, **({"force": "true"} if force else {})}
        return await self.request("PATCH", res.path(meta.get("namespace"), meta["name"], subresource), body=obj,
                                  content_type=APPLY_PATCH, params=params)

    async def merge_patch(self, res: Resource, namespace: Optional[str], name: str, patch: dict,
                          subresource: Optional[str] = None) -> dict:
        return await self.request("PATCH", res.path(namespace, name, subresource), body=patch,
                                  content_type=MERGE_PATCH)

    async def scale(self, res: Resource, namespace: Optional[str], name: str, replicas: int) -> dict:
        """Set the replicas through the scale subresource; returns the Scale object."""
        return await self.merge_patch(res, namespace, name, {"spec": {"replicas": int(replicas)}}, subresource="scale")

    async def delete(self, res: Resource, namespace: Optional[str], name: str) -> bool:
        """True if deleted now, False if it was already gone."""
        try:
            await self.request("DELETE", res.path(namespace, name), body={"propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
