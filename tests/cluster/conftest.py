"""Fixtures of the cluster tier: one real API server per session (cluster_harness.py says which)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# --import-mode=importlib does not put test folders on sys.path; the helper module has a
# unique name so it cannot shadow anything else.
sys.path.insert(0, str(Path(__file__).parent))

from cluster_harness import Cluster, Unavailable, condition, start_cluster, wait_for  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    try:
        started = start_cluster()
    except Unavailable as exc:
        pytest.skip(f"cluster tier: {exc}")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> Cluster:
    """Our CRDs installed as the quickstart does (`kubectl apply -k crds/`), and Established."""
    root = Path(__file__).resolve().parents[2]
    cluster.kubectl("apply", "-k", str(root / "crds"))
    # Polled, not `kubectl wait`: that fails on a CRD whose status has no conditions yet.
    for name in ("modelservices.tokenlane.dev", "servinglanes.tokenlane.dev", "kopfpeerings.kopf.dev",
                 "clusterkopfpeerings.kopf.dev"):
        wait_for(lambda: condition(cluster.get("crd", name), "Established") is not None
                 and condition(cluster.get("crd", name), "Established")["status"] == "True",
                 what=f"CRD {name} Established")
    return cluster
