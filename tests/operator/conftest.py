"""Fixtures of the operator tests: the samples, and the kopf operator running against kmock
(the harness lives in operator_harness.py, shared with tests/tuner).

With TOKENLANE_REGEN_API_CALLS=1 the API calls the operator made in this session are written
to tests/operator/api_calls.json, the input of the least-privilege RBAC in manifests/
(otherwise test_api_calls_are_recorded checks the file still lists every call made). Run the
tuner's kmock tests in the same session so its calls are included:
    TOKENLANE_REGEN_API_CALLS=1 python -m pytest tests/operator tests/tuner -k kmock
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

# --import-mode=importlib does not put test folders on sys.path; the harness has a unique name.
sys.path.insert(0, str(Path(__file__).parent))

from operator_harness import (  # noqa: E402
    API_CALLS,
    API_CALLS_FILE,
    declare_resources,
    load_samples,
    running_cluster,
)


@pytest.fixture
def llama_samples() -> list[dict]:
    return load_samples("llama3-8b.yaml")


@pytest.fixture
def tiny_samples() -> list[dict]:
    return load_samples("tiny-cpu.yaml")


@pytest.fixture
async def cluster(kmock):
    async with running_cluster(kmock) as c:
        yield c


@pytest.fixture
def declared(kmock):
    declare_resources(kmock)
    return kmock


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TOKENLANE_REGEN_API_CALLS") and API_CALLS:
        rows = [dict(zip(("group", "version", "resource", "subresource", "verb"), c)) for c in sorted(API_CALLS)]
        API_CALLS_FILE.write_text(json.dumps({
            "comment": "Kubernetes API calls the operator made in its kmock tests (kopf, handlers, executor "
                       "and the tuner's timer), for least-privilege RBAC. Regenerate: "
                       "TOKENLANE_REGEN_API_CALLS=1 python -m pytest tests/operator tests/tuner -k kmock. "
                       "Peering (--peering) also needs list/watch/patch on kopf.dev kopfpeerings "
                       "(clusterkopfpeerings with --all-namespaces); ServiceMonitors need the same verbs as "
                       "services on monitoring.coreos.com servicemonitors, and discovery of that group. "
                       "Owner references with blockOwnerDeletion need update on tokenlane.dev "
                       "modelservices/finalizers where OwnerReferencesPermissionEnforcement is on (OpenShift).",
            "calls": rows,
        }, indent=1) + "\n")
