"""The engine as on an AVX2-only host: every library held to AVX2 by the caps
docs/operations.md ("Testing on other CPUs") names, on whatever x86-64 host runs the suite.

The caps are read when the libraries load (oneDNN and ATen on torch's import, ours on the
first kernel call), so the run is a subprocess. It checks that each cap took effect (ATen's
capability, our library's level) and that greedy tokens of both tiny models through the engine
(native attention, AVX2 panels, pool steps on two threads) equal transformers' in the same
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenlane.bench.host import ISA_CAPS
from tokenlane.kernels import native_build

_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_model_vs_hf import assert_matches_hf, engine_requests, run_engine
from tokenlane.kernels import cpu_native

torch.set_num_threads(2)
for seed, path in enumerate(sys.argv[2:]):
    reqs = engine_requests(12, 1024, seed=40 + seed, max_len=64, max_new=(4, 16))
    run_engine(path, reqs, chunk=7, max_batched_tokens=40)
    assert_matches_hf(path, reqs)
library = cpu_native.loaded_library()
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(),
                  "native": None if library is None else library.level,
                  "native_error": cpu_native.load_error()}))
"""


def _v3_flags_missing() -> list[str]:
    if not native_build.is_x86_64():
        return ["x86-64"]
    return native_build.missing_cpu_flags("x86-64-v3", native_build.host_cpu_flags())


@pytest.mark.skipif(bool(_v3_flags_missing()),
                    reason=f"this host does not run AVX2 code: lacks {' '.join(_v3_flags_missing())}")
def test_the_engine_under_the_avx2_caps_matches_transformers(tiny_model_dir, tiny_qwen2_dir):
    env = {**os.environ, **ISA_CAPS["avx2"]}  # the caps of the benchmarks' --isa-cap avx2
    env.pop("TOKENLANE_NATIVE_JIT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(Path(__file__).parent), str(tiny_model_dir), str(tiny_qwen2_dir)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["aten"] == "AVX2"
    manifest = native_build.read_manifest() or {}
    if "x86-64-v3" in (manifest.get("levels") or {}):
        assert seen["native"] == "x86-64-v3", seen
    else:  # a package built without a compiler: the torch path ran, for the reason given
        assert seen["native"] is None and seen["native_error"], seen
