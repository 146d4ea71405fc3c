"""Credentials for the Kubernetes API: where the server is and how to prove who we are.

Two sources, as kubectl and client-go read them:
- a kubeconfig (`KUBECONFIG`, a list of files merged the way kubectl merges them: the first
  file that names a cluster, user or context wins; else `~/.kube/config`): the server, its CA
  (file or `-data`), `insecure-skip-tls-verify`, `tls-server-name`, client certificates (file
  or `-data`), bearer tokens (`token`, `tokenFile`), basic auth, and `exec` credential plugins
  (`client.authentication.k8s.io` ExecCredential: a token or a client certificate, cached until
  its `expirationTimestamp`). Paths are relative to the file that names them. The legacy
  `auth-provider` plugins are refused with a message that names the replacement;
- a pod's service account (`in_cluster`): `KUBERNETES_SERVICE_HOST`/`_PORT`, the mounted
  token, CA and namespace. Projected tokens rotate: `Authenticator` re-reads the token file
  every minute (as client-go does) and after a 401.

`Credentials` is immutable and plain; `Authenticator` holds what changes while a client runs
(the token read from a file, an exec plugin's answer).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")
TOKEN_FILE_REFRESH_S = 60.0  # client-go re-reads a token file this often
EXEC_EXPIRY_MARGIN_S = 10.0  # run an exec plugin again this long before its credential expires
EXEC_TIMEOUT_S = 60.0
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


class CredentialsError(ValueError):
    """The credentials cannot be loaded; the message names the file, context or key."""


class NoCredentials(CredentialsError):
    """This source is absent (no kubeconfig file, not in a pod): another source may serve."""


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's `exec` section: a command that prints an ExecCredential."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    api_version: str = EXEC_API_VERSIONS[0]
    cluster: Optional[Mapping[str, Any]] = None  # passed on when provideClusterInfo is set


@dataclass(frozen=True)
class Credentials:
    """One API server and one identity. Certificates and keys are PEM bytes or file paths."""

    server: str
    ca_file: Optional[Path] = None
    ca_data: Optional[bytes] = None
    insecure: bool = False
    tls_server_name: Optional[str] = None
    cert_file: Optional[Path] = None
    cert_data: Optional[bytes] = None
    key_file: Optional[Path] = None
    key_data: Optional[bytes] = field(default=None, repr=False)  # secrets stay out of logs
    token: Optional[str] = field(default=None, repr=False)
    token_file: Optional[Path] = None  # re-read while running: projected tokens rotate
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    exec_plugin: Optional[ExecPlugin] = None
    namespace: Optional[str] = None  # the context's (or the pod's) namespace
    source: str = ""  # where these came from, for messages

    def __post_init__(self) -> None:
        where = self.source or "credentials"
        if not self.server.startswith(("https://", "http://")):
            raise CredentialsError(f"{where}: server {self.server!r} is not an http(s) URL")
        for what, path, data in (("certificate-authority", self.ca_file, self.ca_data),
                                 ("client-certificate", self.cert_file, self.cert_data),
                                 ("client-key", self.key_file, self.key_data)):
            if path is not None and data is not None:
                raise CredentialsError(f"{where}: both {what} and {what}-data are set; give one")

    def ssl_context(self, client_cert: Optional[tuple[bytes, bytes]] = None) -> Optional[ssl.SSLContext]:
        """The TLS context for this server (None for plain http). `client_cert`: an exec
        plugin's certificate and key, used instead of the configured ones."""
        if not self.server.startswith("https://"):
            return None
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None,
                                             cadata=self.ca_data.decode() if self.ca_data else None)
        except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
            raise CredentialsError(f"{self.source}: cannot load the cluster's CA: {exc}") from None
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        cert, key = client_cert or (self.cert_data, self.key_data)
        cert_file, key_file = (None, None) if client_cert else (self.cert_file, self.key_file)
        if (cert or cert_file) and not (key or key_file):
            raise CredentialsError(f"{self.source}: a client certificate without its key")
        if cert or cert_file:
            try:
                _load_cert_chain(ctx, cert_file, cert, key_file, key)
            except (OSError, ssl.SSLError) as exc:
                raise CredentialsError(f"{self.source}: cannot load the client certificate: {exc}") from None
        return ctx


def _load_cert_chain(ctx: ssl.SSLContext, cert_file: Optional[Path], cert: Optional[bytes],
                     key_file: Optional[Path], key: Optional[bytes]) -> None:
    # ssl loads certificates only from files: PEM data goes through private temporary files
    # that are removed as soon as the context holds them.
    with contextlib.ExitStack() as stack:
        paths = []
        for path, data in ((cert_file, cert), (key_file, key)):
            if path is None:
                handle = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".pem"))
                handle.write(data or b"")
                handle.flush()
                path = Path(handle.name)
            paths.append(str(path))
        ctx.load_cert_chain(paths[0], paths[1])


# --------------------------------------------------------------------------- in a pod


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Credentials:
    """The pod's service account: the API server from the environment, the mounted token, CA
    and namespace."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise NoCredentials("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set")
    token = sa_dir / "token"
    if not token.is_file():
        raise NoCredentials(f"not in a Kubernetes pod: no service account token at {token}")
    if ":" in host:
        host = f"[{host}]"
    ca = sa_dir / "ca.crt"
    return Credentials(f"https://{host}:{port}", ca_file=ca if ca.is_file() else None, token_file=token,
                       namespace=in_cluster_namespace(sa_dir), source=f"service account ({sa_dir})")


def in_cluster_namespace(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Optional[str]:
    """The pod's namespace, from its service account mount (None outside a pod)."""
    try:
        return (sa_dir / "namespace").read_text().strip() or None
    except OSError:
        return None


# --------------------------------------------------------------------------- kubeconfig


def kubeconfig_paths(value: Optional[str] = None) -> list[Path]:
    """The kubeconfig files kubectl reads: `value` or $KUBECONFIG (a list), else ~/.kube/config."""
    value = value if value is not None else os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in value.split(os.pathsep) if p]
    return paths or [DEFAULT_KUBECONFIG.expanduser()]


def load_kubeconfig(paths: Optional[list[Path]] = None, context: Optional[str] = None) -> Credentials:
    """The credentials of `context` (default: the current context) of the merged kubeconfig."""
    paths = kubeconfig_paths() if paths is None else paths
    named: dict[str, dict[str, tuple[Path, dict]]] = {"clusters": {}, "users": {}, "contexts": {}}
    current = None
    existing = [p for p in paths if p.is_file()]
    if not existing:
        raise NoCredentials(f"no kubeconfig: {os.pathsep.join(map(str, paths))} not found")
    for path in existing:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise CredentialsError(f"kubeconfig {path}: cannot read it: {exc}") from None
        if not isinstance(doc, dict):
            raise CredentialsError(f"kubeconfig {path}: not a mapping")
        current = current or doc.get("current-context")
        for section, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(section) or []:
                if isinstance(entry, dict) and entry.get("name") is not None:
                    named[section].setdefault(str(entry["name"]), (path, entry.get(key) or {}))
    name = context or current
    where = os.pathsep.join(str(p) for p in existing)
    if not name:
        raise CredentialsError(f"kubeconfig {where}: no current-context (pick one with --context)")
    if name not in named["contexts"]:
        raise CredentialsError(f"kubeconfig {where}: no context named {name!r}")
    _, ctx = named["contexts"][name]
    source = f"kubeconfig {where}, context {name!r}"
    if ctx.get("cluster") not in named["clusters"]:
        raise CredentialsError(f"{source}: no cluster named {ctx.get('cluster')!r}")
    cluster_path, cluster = named["clusters"][ctx["cluster"]]
    user_path, user = named["users"].get(ctx.get("user"), (cluster_path, {})) if ctx.get("user") else (cluster_path, {})
    if ctx.get("user") and ctx["user"] not in named["users"]:
        raise CredentialsError(f"{source}: no user named {ctx['user']!r}")
    if not cluster.get("server"):
        raise CredentialsError(f"{source}: cluster {ctx['cluster']!r} has no server")
    if user.get("auth-provider"):
        provider = (user["auth-provider"] or {}).get("name", "?")
        raise CredentialsError(f"{source}: the auth-provider {provider!r} plugin is not supported; use an exec "
                               "credential plugin instead (e.g. kubelogin, gke-gcloud-auth-plugin)")

    def path_of(entry: Mapping[str, Any], key: str, base: Path) -> Optional[Path]:
        value = entry.get(key)
        return (base.parent / Path(value).expanduser()) if value else None

    def data_of(entry: Mapping[str, Any], key: str) -> Optional[bytes]:
        value = entry.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise CredentialsError(f"{source}: {key} is not base64") from None

    exec_plugin = None
    if user.get("exec"):
        spec = user["exec"]
        if not spec.get("command"):
            raise CredentialsError(f"{source}: user {ctx.get('user')!r}: exec has no command")
        api_version = spec.get("apiVersion") or EXEC_API_VERSIONS[0]
        if api_version not in EXEC_API_VERSIONS:
            raise CredentialsError(f"{source}: exec apiVersion {api_version!r} is not one of {', '.join(EXEC_API_VERSIONS)}")
        command = str(spec["command"])
        if os.sep in command and not os.path.isabs(command):  # as client-go: relative to the kubeconfig
            command = str(user_path.parent / command)
        exec_plugin = ExecPlugin(
            command, tuple(str(a) for a in spec.get("args") or ()),
            tuple((str(e["name"]), str(e["value"])) for e in spec.get("env") or ()), api_version,
            cluster={"server": cluster["server"], "certificate-authority-data": cluster.get("certificate-authority-data"),
                     "insecure-skip-tls-verify": bool(cluster.get("insecure-skip-tls-verify"))}
            if spec.get("provideClusterInfo") else None)
    return Credentials(
        server=str(cluster["server"]),
        ca_file=path_of(cluster, "certificate-authority", cluster_path),
        ca_data=data_of(cluster, "certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        tls_server_name=cluster.get("tls-server-name"),
        cert_file=path_of(user, "client-certificate", user_path),
        cert_data=data_of(user, "client-certificate-data"),
        key_file=path_of(user, "client-key", user_path),
        key_data=data_of(user, "client-key-data"),
        token=user.get("token") or None,
        token_file=path_of(user, "tokenFile", user_path),
        username=user.get("username"), password=user.get("password"),
        exec_plugin=exec_plugin,
        namespace=ctx.get("namespace"),
        source=source,
    )


def load(context: Optional[str] = None, *, prefer_in_cluster: bool = False,
         sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Credentials:
    """Credentials as kubectl finds them (the kubeconfig, `context` in it), else the pod's
    service account; `prefer_in_cluster`: the service account first (a controller in its pod).
    A named `context` must exist."""
    if context:
        return load_kubeconfig(context=context)
    order: list[Callable[[], Credentials]] = [load_kubeconfig, lambda: in_cluster(sa_dir)]
    if prefer_in_cluster:
        order.reverse()
    reasons = []
    for loader in order:
        try:
            return loader()
        except NoCredentials as exc:  # a kubeconfig or mount that exists but is broken is not skipped
            reasons.append(str(exc))
    raise NoCredentials("no Kubernetes credentials: " + "; ".join(reasons))


# --------------------------------------------------------------------------- what changes while running


@dataclass
class Authenticator:
    """The `Authorization` header of `credentials`, kept current: a token file is re-read
    every minute, an exec plugin runs again shortly before its credential expires, and both
    after `invalidate()` (a 401)."""

    credentials: Credentials
    clock: Callable[[], float] = time.time
    exec_certificate: Optional[tuple[bytes, bytes]] = field(default=None, init=False)  # an exec plugin's, if any
    _token: Optional[str] = field(default=None, init=False, repr=False)
    _stale: bool = field(default=True, init=False)
    _read_at: float = field(default=0.0, init=False)
    _expires_at: float = field(default=float("inf"), init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)  # one exec run at a time

    def invalidate(self) -> None:
        self._stale = True

    @property
    def token(self) -> Optional[str]:
        """The bearer token of the last `authorization()` (None: no token auth)."""
        return self.credentials.token or self._token

    @property
    def expires_at(self) -> Optional[float]:
        """When the current credential expires (epoch seconds; None: not known to)."""
        return None if self._expires_at == float("inf") else self._expires_at

    async def authorization(self) -> Optional[str]:
        creds = self.credentials
        now = self.clock()
        if creds.exec_plugin is not None:
            async with self._lock:
                if self._stale or now >= self._expires_at - EXEC_EXPIRY_MARGIN_S:
                    await self._run_exec(creds.exec_plugin)
                    self._stale = False
        elif creds.token_file is not None and not creds.token:
            if self._stale or now - self._read_at >= TOKEN_FILE_REFRESH_S:
                try:
                    self._token = creds.token_file.read_text().strip()
                except OSError as exc:
                    raise CredentialsError(f"{creds.source}: cannot read the token file: {exc}") from None
                self._read_at, self._stale = now, False
        token = self.token
        if token:
            return f"Bearer {token}"
        if creds.username is not None and creds.password is not None:
            return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        return None

    async def _run_exec(self, plugin: ExecPlugin) -> None:
        info = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        if plugin.cluster is not None:
            info["spec"]["cluster"] = {k: v for k, v in plugin.cluster.items() if v is not None}
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
        where = f"{self.credentials.source}: exec plugin {plugin.command!r}"
        try:
            proc = await asyncio.create_subprocess_exec(plugin.command, *plugin.args, env=env,
                                                        stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), EXEC_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            raise CredentialsError(f"{where}: no answer within {EXEC_TIMEOUT_S:.0f}s") from None
        except OSError as exc:
            raise CredentialsError(f"{where}: cannot run it: {exc}") from None
        if proc.returncode != 0:
            raise CredentialsError(f"{where}: exit status {proc.returncode}: {err.decode(errors='replace')[-500:]}")
        try:
            answer = json.loads(out)
            status = answer["status"]
        except (ValueError, KeyError, TypeError):
            raise CredentialsError(f"{where}: did not print an ExecCredential with a status") from None
        if answer.get("kind") != "ExecCredential":
            raise CredentialsError(f"{where}: printed kind {answer.get('kind')!r}, not ExecCredential")
        self._token = status.get("token") or None
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        self.exec_certificate = (cert.encode(), key.encode()) if cert and key else None
        if not self._token and not self.exec_certificate:
            raise CredentialsError(f"{where}: the ExecCredential has neither a token nor a client certificate")
        expiry = status.get("expirationTimestamp")
        self._expires_at = _parse_time(expiry, where) if expiry else float("inf")


def _parse_time(value: str, where: str) -> float:
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise CredentialsError(f"{where}: expirationTimestamp {value!r} is not RFC 3339") from None
