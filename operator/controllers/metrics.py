"""The operator's own Prometheus metrics (served by `tokenlane operator --metrics-port`)."""

from __future__ import annotations

import re

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("tokenlane_operator_reconciles_total", "ModelService reconciles by result",
                     ["kind", "result"])
RECONCILE_SECONDS = Histogram("tokenlane_operator_reconcile_seconds", "Duration of a ModelService reconcile",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
ACTIONS = Counter("tokenlane_operator_actions_total", "Create/apply/delete actions carried out", ["verb", "kind"])
API_REQUESTS = Counter("tokenlane_operator_api_requests_total", "Kubernetes API requests by the executor",
                       ["method", "resource", "code"])

# The tuning timer's runs live here, not in status: a timestamp in status would be a write
# every interval while nothing changes (docs/tuning.md, "Quiet status").
TUNING_LAST_RUN = Gauge("tokenlane_operator_tuning_last_run_timestamp_seconds",
                        "Unix time of the last tuning run of a ModelService", ["namespace", "modelservice"])
TUNING_RUNS = Counter("tokenlane_operator_tuning_runs_total",
                      "Tuning runs by outcome (hold, adjust, probe, revert, off)",
                      ["namespace", "modelservice", "outcome"])
EVENTS_SUPPRESSED = Counter("tokenlane_operator_events_deduplicated_total",
                            "Events not posted because the same reason and message was the last one posted "
                            "about the object", ["reason"])

_RESOURCE = re.compile(r"^/apis?/(?:[^/]+/)?v[^/]+(?:/namespaces/[^/]+)?/([^/]+)")


def observe_api_request(method: str, path: str, status: int, seconds: float) -> None:
    match = _RESOURCE.match(path)
    API_REQUESTS.labels(method=method, resource=match.group(1) if match else "discovery", code=str(status)).inc()
