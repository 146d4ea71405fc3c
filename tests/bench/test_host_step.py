"""The host-only step benchmark (bench/host_step.py): a peer tree loads under its own name and
both engines' steps are measured alternately; the import renaming leaves non-imports alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tokenlane
from tokenlane.bench import host_step


def test_the_peer_copy_renames_its_imports_only(tmp_path):
    source = tmp_path / "tree" / "tokenlane"
    (source / "runtime").mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "runtime" / "m.py").write_text(
        "from tokenlane.runtime import x\nimport tokenlane.kernels.api as api\nfrom tokenlane import bench\n"
        "import tokenlane\nPREFIX = 'tokenlane_'\nNAME = 'tokenlane-step'\n")
    package = host_step.load_peer(str(tmp_path / "tree"), tmp_path / "work")
    text = (tmp_path / "work" / package / "runtime" / "m.py").read_text()
    assert text == (f"from {package}.runtime import x\nimport {package}.kernels.api as api\nfrom {package} import bench\n"
                    f"import {package}\nPREFIX = 'tokenlane_'\nNAME = 'tokenlane-step'\n")
    with pytest.raises(ValueError, match="holds no tokenlane package"):
        host_step.load_peer(str(tmp_path), tmp_path / "work2")


def test_both_trees_are_measured_alternately(tiny_model_dir, tmp_path):
    """This tree against itself loaded as the peer (a process of its own: the peer's modules
    stay out of the test process), each engine running its own package's code."""
    out = tmp_path / "host.json"
    installed = Path(tokenlane.__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "tokenlane.bench.host_step", "--model", str(tiny_model_dir), "--running", "4",
         "--peer", str(installed), "--blocks", "2", "--block-steps", "3", "--sweep-mib", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "this / peer" in done.stdout
    assert "| warm |" in done.stdout and "| cold |" in done.stdout and "| whole |" in done.stdout
    (result,) = json.loads(out.read_text())["results"]
    for case in ("warm", "cold", "whole"):
        row = result[case]
        assert len(row["this"]["blocks_us"]) == len(row["peer"]["blocks_us"]) == 2
        assert all(v > 0 for v in row["this"]["blocks_us"] + row["peer"]["blocks_us"])
        assert row["ratio_range"][0] <= row["ratio_median"] <= row["ratio_range"][1]
