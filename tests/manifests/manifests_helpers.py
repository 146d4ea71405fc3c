"""Shared helpers of the manifests tests: kustomize renders (cached per session), paths."""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
# Every kustomization a user applies; each must render.
KUSTOMIZATIONS = [
    "manifests/overlays/namespaced",
    "manifests/overlays/cluster-wide",
    "manifests/base",
    "manifests/argocd",
    "manifests/monitoring",
]
OVERLAYS = ["manifests/overlays/namespaced", "manifests/overlays/cluster-wide"]
SAMPLE = MANIFESTS / "samples" / "tiny-cpu.yaml"  # the quickstart's CPU sample
OPERATOR_SA = ("tokenlane-system", "tokenlane-operator")
WORKLOAD_NAMESPACE = "tokenlane"


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed (it renders the kustomizations)")
    return path


@functools.lru_cache(maxsize=None)
def _render(rel: str) -> tuple:
    result = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / rel)], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {rel} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(rel: str) -> list[dict]:
    """The objects `kubectl kustomize <rel>` renders (a fresh copy each call)."""
    import copy

    return copy.deepcopy(list(_render(rel)))


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def samples_present() -> bool:
    return (MANIFESTS / "samples" / "kustomization.yaml").exists()


def operator_render(docs: list[dict], tmp_path: Path) -> list[dict]:
    """What the operator would create for these custom resources (`tokenlane render`)."""
    import sys

    path = tmp_path / f"sample-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run([sys.executable, "-m", "tokenlane.cli", "render", "-f", str(path)],
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


# ---- local processes the tests start (tokenlane serve, prometheus): loopback only

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_ready(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Poll `url` until it answers 200; fail with the process' output if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            out = proc.stdout or proc.stderr
            raise AssertionError(f"{what} exited:\n{out.read() if out else ''}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} not ready after {timeout_s:.0f}s"
        time.sleep(0.3)


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
