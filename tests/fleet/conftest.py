"""Fixtures of the fleet tests: three real `tokenlane serve` processes per kind (the plain
helpers are in fleet_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put test folders on sys.path; the helpers module has a
# unique name so it cannot clash with another area's.
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from fleet_helpers import simulated_config, start_replicas, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny_replicas(tiny_model_dir, tmp_path_factory):
    procs = start_replicas(tiny_config(tiny_model_dir), tmp_path_factory.mktemp("tiny-fleet"), 3)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def sim_replicas(tmp_path_factory):
    procs = start_replicas(simulated_config(), tmp_path_factory.mktemp("sim-fleet"), 3)
    yield procs
    for p in procs:
        p.stop()
