"""Flight recorder dumps at a rollback: each runtime pod of the rolled-back ModelService is
asked to write one (`POST /debug/dump`, docs/operations.md), and the rollback Event names the
files, so the steps that led to the rollback survive the pods' replacement.

The pods are found through Prometheus, which the rollout guard already reads (a rollback on
metrics needs `spec.tuning.prometheusUrl`): the `instance` label of each pod's
`tokenlane_config_info` series is the address its metrics are scraped from, the runtime's one
HTTP port. That needs no extra RBAC (the operator may not list pods). Best effort: a short
timeout, every pod at once, and a failure is named in the Event, never raised.

With API keys on (a tenant of the ModelService has `apiKeySha256`) the pods answer only a
tenant's key, and the ModelService holds digests, never keys. The operator authenticates as
a tenant whose key it is given: the files of a directory (`TOKENLANE_OPERATOR_API_KEYS_DIR`,
default /etc/tokenlane/api-keys: a Secret mounted into the operator's pod, read by the
kubelet, so no RBAC on Secrets) hold keys, one a line; a key counts for a ModelService when
its SHA-256 is one of its tenants' digests. The directory is read at each dump, so a rotated
Secret is picked up.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import httpx

from tokenlane.operator.clients.prometheus import PrometheusClient, PrometheusError
from tokenlane.runtime.config import hash_api_key

log = logging.getLogger("tokenlane.operator.clients.dumps")

DUMP_TIMEOUT_S = 5.0  # per pod; the dump is a few MB of JSON written to local disk
MAX_PODS = 8  # Event messages are cut at 1024 characters: about this many paths fit
API_KEYS_DIR_ENV = "TOKENLANE_OPERATOR_API_KEYS_DIR"
DEFAULT_API_KEYS_DIR = Path("/etc/tokenlane/api-keys")


@dataclass(frozen=True)
class PodDump:
    pod: str  # the pod's name, or its address when Prometheus did not label it
    path: Optional[str] = None  # the file on the pod, when written
    error: str = ""  # why not

    def describe(self) -> str:
        return f"{self.pod}:{self.path}" if self.path else f"{self.pod} failed ({self.error})"


def config_info_query(namespace: str, model: str) -> str:
    for value in (namespace, model):
        if '"' in value or "\\" in value or "\n" in value:
            raise ValueError(f"not a label value PromQL can quote simply: {value!r}")
    return f'tokenlane_config_info{{namespace="{namespace}",model="{model}"}}'


async def runtime_pods(prometheus_url: str, namespace: str, model: str, *,
                       timeout_s: float = DUMP_TIMEOUT_S) -> list[tuple[str, str]]:
    """(pod, host:port) of each runtime pod serving `model` in `namespace` that Prometheus
    scrapes now. PrometheusError if it cannot answer."""
    series = await PrometheusClient(prometheus_url, timeout_s=timeout_s).query(config_info_query(namespace, model))
    pods: dict[str, str] = {}
    for s in series:
        address = s.labels.get("instance")
        if address:
            pods.setdefault(address, s.labels.get("pod") or address)
    return sorted((pod, address) for address, pod in pods.items())


def api_keys_dir() -> Path:
    return Path(os.environ.get(API_KEYS_DIR_ENV) or DEFAULT_API_KEYS_DIR)


def held_api_keys(directory: Path) -> list[str]:
    """The keys in `directory`: each non-empty line of each file, files in name order. Names
    starting with "." are skipped (a Secret volume's own `..data` entries); no directory, no
    keys."""
    try:
        files = sorted(f for f in directory.iterdir() if not f.name.startswith(".") and f.is_file())
    except OSError:
        return []
    keys = []
    for file in files:
        try:
            keys += [line.strip() for line in file.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("API key file %s cannot be read: %s", file, exc)
    return keys


def keys_for(tenant_key_digests: Iterable[str], keys: Iterable[str]) -> list[str]:
    """The keys whose digest (as the runtime computes it) is one of the tenants' digests."""
    wanted = set(tenant_key_digests)
    return [key for key in dict.fromkeys(keys) if hash_api_key(key) in wanted]


async def request_dump(client: httpx.AsyncClient, pod: str, address: str, reason: str,
                       api_keys: Iterable[str] = ()) -> PodDump:
    """Ask one pod; with API keys, each in turn until one is not refused with 401 (a pool's
    config holds only the tenants allowed one of its lanes)."""
    for key in list(api_keys) or [None]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            response = await client.post(f"http://{address}/debug/dump", params={"reason": reason}, headers=headers)
        except httpx.HTTPError as exc:
            return PodDump(pod, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if response.status_code != 401:
            break
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code == 200 and isinstance(body.get("path"), str):
        return PodDump(pod, path=body["path"])
    code = ((body.get("error") or {}).get("code") if isinstance(body, dict) else None) or "no path"
    return PodDump(pod, error=f"HTTP {response.status_code} {code}")


async def dump_runtimes(prometheus_url: Optional[str], namespace: str, model: str, reason: str, *,
                        tenant_key_digests: Iterable[str] = (), keys_dir: Optional[Path] = None,
                        timeout_s: float = DUMP_TIMEOUT_S) -> str:
    """Ask every runtime pod of the model for a dump; one sentence for the rollback Event
    naming the files (or why there are none). `tenant_key_digests`: the ModelService's
    tenants' `apiKeySha256` (none: the pods take no key); `keys_dir`: where the operator's
    keys are (default `api_keys_dir()`)."""
    if not prometheus_url:
        return "No flight recorder dump: spec.tuning.prometheusUrl is not set (the pods are found through it)."
    digests = [d for d in tenant_key_digests if d]
    keys: list[str] = []
    if digests:
        keys_dir = keys_dir or api_keys_dir()
        keys = keys_for(digests, held_api_keys(keys_dir))
        if not keys:
            return ("No flight recorder dump: the runtime pods take API keys, and the operator holds the key of "
                    f"none of the tenants (keys are read from {keys_dir}, see docs/operations.md).")
    try:
        pods = await runtime_pods(prometheus_url, namespace, model, timeout_s=timeout_s)
    except (PrometheusError, ValueError) as exc:
        return f"No flight recorder dump: the runtime pods could not be listed ({exc})."
    if not pods:
        return f"No flight recorder dump: Prometheus scrapes no runtime pod of {model} in {namespace}."
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(request_dump(client, pod, address, reason, keys)
                                         for pod, address in pods[:MAX_PODS]))
    for result in results:
        if result.error:
            log.warning("flight recorder dump of %s/%s (%s) failed: %s", namespace, result.pod, reason, result.error)
    more = f" (and {len(pods) - MAX_PODS} more pods not asked)" if len(pods) > MAX_PODS else ""
    return "Flight recorder dumps: " + ", ".join(r.describe() for r in results) + more + "."
