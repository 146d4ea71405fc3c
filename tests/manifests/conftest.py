"""Fixtures of the manifests tests; `manifests_helpers` and `manifests_schemas` hold the
plain helpers they share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# --import-mode=importlib does not put test folders on sys.path; the helper modules have
# unique names so they cannot shadow anything else.
sys.path.insert(0, str(Path(__file__).parent))

from manifests_helpers import (  # noqa: E402
    SAMPLE,
    free_port,
    load_yaml_docs,
    operator_render,
    stop_process,
    wait_http_ready,
)


# ---- a real runtime serving the CPU sample, as the quickstart does (docs and monitoring tests)

@pytest.fixture(scope="session")
def quickstart_server(tiny_model_dir, tmp_path_factory):
    """`tokenlane serve` with the runtime.yaml the operator renders for the CPU sample."""
    tmp = tmp_path_factory.mktemp("quickstart")
    (configmap,) = [o for o in operator_render(load_yaml_docs(SAMPLE), tmp) if o["kind"] == "ConfigMap"]
    config = yaml.safe_load(configmap["data"]["runtime.yaml"])
    config["model"]["path"] = str(tiny_model_dir)  # the pod's init container makes it at /models
    config_path = tmp / "runtime.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENLANE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
         "--port", str(port), "--config-poll-seconds", "0.2"],
        cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(f"{base}/ready", proc, 120, "tokenlane serve")
        yield base, config_path, tmp
    finally:
        stop_process(proc)


