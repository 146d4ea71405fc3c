"""`tokenlane render`: golden renders of the samples, and its error handling.

Regenerate the goldens after an intended change:
    TOKENLANE_REGEN_GOLDEN=1 python -m pytest tests/operator/test_render.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tokenlane.operator.tools import render

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "samples"
GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.mark.parametrize("sample", ["llama3-8b.yaml", "tiny-cpu.yaml", "llama3-8b-lora.yaml"])
def test_golden_render(sample, capsys):
    assert render.main(["-n", "tokenlane", "-f", str(SAMPLES / sample), "--service-monitor"]) == 0
    out = capsys.readouterr().out
    golden = GOLDEN / sample
    if os.environ.get("TOKENLANE_REGEN_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(out)
    assert out == golden.read_text(), f"render of {sample} changed; TOKENLANE_REGEN_GOLDEN=1 to accept"
    docs = list(yaml.safe_load_all(out))
    assert all(d["metadata"]["namespace"] == "tokenlane" for d in docs)


def test_samples_leave_the_namespace_to_kubectl_and_kustomize():
    """`kubectl apply -n NS -f` and the samples kustomization decide the namespace: a namespace
    written in a sample would make `-n` fail and disagree with the overlay's."""
    for sample in SAMPLES.glob("*.yaml"):
        for doc in yaml.safe_load_all(sample.read_text()):
            if doc and doc.get("kind") in ("ModelService", "ServingLane"):
                assert "namespace" not in doc["metadata"], f"{sample.name}: {doc['metadata']}"
    assert yaml.safe_load((SAMPLES / "kustomization.yaml").read_text())["namespace"] == "tokenlane"


def test_render_without_namespace_uses_default(capsys):
    assert render.main(["-f", str(SAMPLES / "tiny-cpu.yaml")]) == 0
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(capsys.readouterr().out)} == {"default"}


def test_render_folder_ignores_other_kinds(capsys):
    # The samples folder also holds a kustomization.yaml; it is not a ModelService.
    assert render.main(["-f", str(SAMPLES)]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds.count("Deployment") == 5 and kinds.count("ConfigMap") == 5  # hf-source, llama3-8b-lora: 1 pool each
    assert kinds.count("InferencePool") == 1  # llama3-8b-lora.yaml


def test_render_reports_problems(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("""
apiVersion: tokenlane.dev/v1alpha1
kind: ModelService
metadata: {name: m}
spec: {model: {path: /m}, scheduler: {kvCacheHighWatermark: 0.97}}
---
apiVersion: tokenlane.dev/v1alpha1
kind: ServingLane
metadata: {name: orphan}
spec: {modelServiceRef: {name: nowhere}}
""")
    assert render.main(["-f", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "kvCacheHighWatermark" in err and "ModelService 'nowhere' not found" in err
    (tmp_path / "bad.yaml").write_text("a: [")
    assert render.main(["-f", str(tmp_path / "bad.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert render.main(["-f", str(tmp_path / "missing.yaml")]) == 2


def test_render_cli_entry_point_without_torch():
    """`tokenlane render` runs in a fresh interpreter and never imports torch (operator image)."""
    import subprocess
    import sys

    code = ("import sys; from tokenlane.cli import main; rc = main(['render', '-f', %r]);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)") % str(SAMPLES / "tiny-cpu.yaml")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout


@pytest.mark.parametrize("k8s_version", ["1.28.0", "1.31.0"])
def test_rendered_objects_and_crds_validate_against_kubernetes_schemas(k8s_version, capsys):
    """Every built-in object we render (and the CRDs themselves) passes the Kubernetes OpenAPI
    schema in strict mode (no unknown fields), for the oldest and a recent supported version."""
    import kubernetes_validate

    from tokenlane.operator.api import schema

    assert render.main(["-f", str(SAMPLES)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    docs += [yaml.safe_load(text) for text in schema.render_crd_files().values()]
    docs += [d for d in yaml.safe_load_all((ROOT / "crds" / "kopfpeerings.kopf.dev.yaml").read_text()) if d]
    for doc in docs:
        if doc["kind"] == "InferencePool":
            continue  # not a built-in kind: tests/operator/test_inference_pool.py checks it against its CRD
        kubernetes_validate.validate(doc, k8s_version, strict=True)
