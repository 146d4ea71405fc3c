"""Shared helpers of the manifests tests: kustomize renders (cached per session), paths."""

from __future__ import annotations

import functools
import shutil
import subprocess
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
