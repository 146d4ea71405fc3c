"""Flight recorder dumps at a rollback: each runtime pod of the rolled-back ModelService is
asked to write one (`POST /debug/dump`, docs/operations.md), and the rollback Event names the
files, so the steps that led to the rollback survive the pods' replacement.

The pods are found through Prometheus, which the rollout guard already reads (a rollback on
metrics needs `spec.tuning.prometheusUrl`): the `instance` label of each pod's
`tokenlane_config_info` series is the address its metrics are scraped from, the runtime's one
HTTP port. That needs no extra RBAC (the operator may not list pods). Best effort: a short
timeout, every pod at once, and a failure is named in the Event, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

import httpx

from tokenlane.operator.prometheus import PrometheusClient, PrometheusError

log = logging.getLogger("tokenlane.operator.dumps")

DUMP_TIMEOUT_S = 5.0  # per pod; the dump is a few MB of JSON written to local disk
MAX_PODS = 8  # Event messages are cut at 1024 characters: about this many paths fit


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


async def request_dump(client: httpx.AsyncClient, pod: str, address: str, reason: str) -> PodDump:
    try:
        response = await client.post(f"http://{address}/debug/dump", params={"reason": reason})
    except httpx.HTTPError as exc:
        return PodDump(pod, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code == 200 and isinstance(body.get("path"), str):
        return PodDump(pod, path=body["path"])
    code = ((body.get("error") or {}).get("code") if isinstance(body, dict) else None) or "no path"
    return PodDump(pod, error=f"HTTP {response.status_code} {code}")


async def dump_runtimes(prometheus_url: Optional[str], namespace: str, model: str, reason: str, *,
                        timeout_s: float = DUMP_TIMEOUT_S) -> str:
    """Ask every runtime pod of the model for a dump; one sentence for the rollback Event
    naming the files (or why there are none)."""
    if not prometheus_url:
        return "No flight recorder dump: spec.tuning.prometheusUrl is not set (the pods are found through it)."
    try:
        pods = await runtime_pods(prometheus_url, namespace, model, timeout_s=timeout_s)
    except (PrometheusError, ValueError) as exc:
        return f"No flight recorder dump: the runtime pods could not be listed ({exc})."
    if not pods:
        return f"No flight recorder dump: Prometheus scrapes no runtime pod of {model} in {namespace}."
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(request_dump(client, pod, address, reason)
                                         for pod, address in pods[:MAX_PODS]))
    for result in results:
        if result.error:
            log.warning("flight recorder dump of %s/%s (%s) failed: %s", namespace, result.pod, reason, result.error)
    more = f" (and {len(pods) - MAX_PODS} more pods not asked)" if len(pods) > MAX_PODS else ""
    return "Flight recorder dumps: " + ", ".join(r.describe() for r in results) + more + "."
