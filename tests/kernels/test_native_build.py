"""The native kernels as a build artifact (setup.py, kernels/native_build.py): the libraries the
wheel was built with, one per instruction-set level, and which one a CPU loads.

`test_the_library_for_this_cpu_was_built_and_loads` FAILS where a library should exist and does
not load: an installed package without its manifest, a build that had a compiler and built
nothing, a level built for this CPU that does not load. It skips only where the build had no
compiler (or, in a source checkout, was never run). No test runs a library above this CPU's
level: every level this CPU supports is loaded and checked; the others only by the pure choice.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import pytest
import torch

from tokenlane.kernels import cpu_native, native_build

V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "sse", "sse2"}
AVX2 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
ALL_X86 = ["x86-64-v3", "x86-64-v4", "x86-64-v4-bf16"]


@pytest.mark.parametrize("cpu, built, want", [
    (AVX2, ALL_X86, "x86-64-v3"),  # AVX2-only host
    (AVX512, ALL_X86, "x86-64-v4"),  # AVX-512 without bf16
    (AVX512_BF16, ALL_X86, "x86-64-v4-bf16"),
    (AVX512_BF16, ["x86-64-v3", "x86-64-v4"], "x86-64-v4"),  # the bf16 build failed: the next one
    (AVX512_BF16, ["x86-64-v3"], "x86-64-v3"),
    (AVX2, ["x86-64-v4", "x86-64-v4-bf16"], None),  # only levels above the host's
    (V2, ALL_X86, None),  # no AVX2: nothing runs here
    (AVX2 - {"fma"}, ALL_X86, None),  # one flag of a level missing is enough to refuse it
    (AVX512 - {"avx512vl"}, ALL_X86, "x86-64-v3"),
    ({"avx512_bf16"}, ALL_X86, None),  # a flag of a level without the ones below it
    (AVX512_BF16, [], None),
], ids=["avx2", "avx512", "avx512-bf16", "bf16-not-built", "only-v3-built", "only-above", "no-avx2",
        "no-fma", "no-avx512vl", "bf16-alone", "none-built"])
def test_level_choice_on_x86(cpu, built, want):
    assert native_build.choose_level(cpu, built, machine="x86_64") == want


def test_level_choice_elsewhere_is_the_generic_build():
    assert native_build.choose_level({"fp", "asimd"}, ["generic"], machine="aarch64") == "generic"
    assert native_build.choose_level({"fp", "asimd"}, ALL_X86, machine="aarch64") is None
    assert native_build.choose_level(AVX512_BF16, ["generic"], machine="x86_64") is None
    assert [lv.name for lv in native_build.levels_for("aarch64")] == ["generic"]
    assert [lv.name for lv in native_build.levels_for("AMD64")] == ALL_X86


def test_each_level_needs_what_the_one_below_needs():
    levels = native_build.levels_for("x86_64")
    for lower, higher in zip(levels, levels[1:]):
        assert lower.cpu_flags < higher.cpu_flags, (lower.name, higher.name)
    assert native_build.missing_cpu_flags("x86-64-v4-bf16", AVX512, machine="x86_64") == ["avx512_bf16"]
    with pytest.raises(ValueError, match="unknown native level"):
        native_build.missing_cpu_flags("x86-64-v9", AVX512, machine="x86_64")


def _source_checkout() -> bool:
    """Whether the kernels are imported from a checkout (its own setup.py beside them), not
    from an installed wheel."""
    return (Path(native_build.__file__).resolve().parent.parent / "setup.py").exists()


def _manifest_or_skip() -> dict:
    manifest = native_build.read_manifest()
    if manifest is None:
        if _source_checkout():
            pytest.skip("a source checkout whose native kernels were never built "
                        "(python setup.py build_native --inplace)")
        pytest.fail(f"an installed package without {native_build.NATIVE_DIR / native_build.MANIFEST}: "
                    "the wheel was built without setup.py's build_native step")
    if manifest["compiler"] is None:
        pytest.skip(f"the package was built without a C compiler: {manifest['reason']}")
    return manifest


def test_the_library_for_this_cpu_was_built_and_loads(monkeypatch):
    # This CPU's own level, whatever cap the run has (the cap has its own test below).
    capped = bool(os.environ.get(cpu_native.MAX_LEVEL_ENV, "").strip())
    monkeypatch.delenv(cpu_native.MAX_LEVEL_ENV, raising=False)
    manifest = _manifest_or_skip()
    assert manifest["levels"], (f"{manifest['compiler_version']} was there at build time and built nothing: "
                                f"{json.dumps(manifest['failed'], indent=1)[:3000]}")
    level = native_build.choose_level(native_build.host_cpu_flags(), manifest["levels"])
    if level is None:
        pytest.skip(f"this CPU runs none of the levels built ({sorted(manifest['levels'])})")
    library = cpu_native.prebuilt_library()
    assert library.level == level and library.path.is_file()
    ctypes.CDLL(str(library.path))  # OSError (the test fails) when it does not load
    if not cpu_native.jit_requested() and not capped:
        assert cpu_native.available(), cpu_native.load_error()
        assert cpu_native.loaded_library() == library
        assert f"level {level}" in cpu_native.describe() and str(library.path) in cpu_native.describe()


def _levels_this_cpu_runs() -> list[str]:
    manifest = native_build.read_manifest() or {"levels": {}}
    flags = native_build.host_cpu_flags()
    return [lv.name for lv in native_build.levels_for() if lv.name in manifest["levels"] and lv.cpu_flags <= flags]


@pytest.mark.parametrize("level", _levels_this_cpu_runs() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no prebuilt level this CPU runs"))])
def test_every_level_this_cpu_runs_gives_the_same_results(monkeypatch, kcase, level):
    """Each prebuilt library this CPU can run (the levels below its own too: the AVX2 build on
    an AVX-512 host), swapped in as the loaded one: decode attention, float32 and bf16 panel
    products and the fused argmax against torch."""
    entry = native_build.read_manifest()["levels"][level]
    path = native_build.NATIVE_DIR / entry["library"]
    lib = cpu_native._bind(ctypes.CDLL(str(path)))
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_loaded", lib)
    monkeypatch.setattr(cpu_native, "_library", cpu_native.NativeLibrary(level, path))
    assert cpu_native.panel_width() == (64 if level.startswith("x86-64-v4") else 32)  # AVX-512: 16 lanes
    assert cpu_native.panel_bf16_pairs() == level.endswith("-bf16")

    case = kcase.build([37, 1, 120, 64, 9], [1] * 5, num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=torch.bfloat16)
    rows = torch.arange(5, dtype=torch.int32)
    out = torch.full_like(case.query.float(), float("nan"))
    cpu_native.paged_decode_attention(case.query.float(), case.key_cache, case.value_cache, case.block_tables,
                                      rows, rows, case.seq_lens, max(case.seq_lens_list), case.scale, out)
    kcase.check(out, kcase.dense(case), dict(atol=2e-5, rtol=2e-5), what=level)

    gen = torch.Generator().manual_seed(3)
    x, weight, bias = torch.randn(7, 97, generator=gen), torch.randn(70, 97, generator=gen), torch.randn(70, generator=gen)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(cpu_native.PanelLinear(weight, bias)(x).double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu_native.PanelLinear(weight, bias).argmax(x), want.argmax(dim=-1))
    small = torch.randint(-4, 5, (7, 97), generator=gen).bfloat16()  # exact in every order
    w16 = torch.randint(-4, 5, (70, 97), generator=gen).bfloat16()
    assert torch.equal(cpu_native.PanelLinear(w16)(small),
                       torch.nn.functional.linear(small.float(), w16.float()).bfloat16())


def _fake_install(tmp_path: Path, manifest: dict) -> Path:
    native = tmp_path / "_native"
    native.mkdir()
    (native / native_build.MANIFEST).write_text(json.dumps(manifest))
    return native


def test_a_build_without_a_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    manifest = native_build.build_all(tmp_path / "_native")
    assert manifest["compiler"] is None and not manifest["levels"]
    assert "no C compiler at build time" in manifest["reason"]
    assert json.loads((tmp_path / "_native" / native_build.MANIFEST).read_text()) == manifest
    assert [p.name for p in (tmp_path / "_native").iterdir()] == [native_build.MANIFEST]
    with pytest.raises(RuntimeError, match="not built with this package: no C compiler at build time"):
        cpu_native.prebuilt_library(tmp_path / "_native")


FAKE_CC = """#!/bin/sh
# A stand-in compiler: logs its arguments, fails on $FAKE_CC_FAIL_ON, else writes its -o file.
echo "$*" >> "$FAKE_CC_LOG"
case " $* " in *" --version "*) echo "fakecc 1.0"; exit 0 ;; esac
if [ -n "$FAKE_CC_FAIL_ON" ]; then
  case " $* " in *" $FAKE_CC_FAIL_ON "*) echo "fakecc: unsupported $FAKE_CC_FAIL_ON" >&2; exit 1 ;; esac
fi
out=""; prev=""
for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
echo "built by fakecc" > "$out"
"""


@pytest.fixture
def fake_cc(monkeypatch, tmp_path):
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    log = tmp_path / "fakecc.log"
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("FAKE_CC_LOG", str(log))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    return log


def test_the_build_makes_every_level_and_reuses_an_identical_build(fake_cc, tmp_path):
    manifest = native_build.build_all(tmp_path / "one", machine="x86_64")
    assert manifest["compiler_version"] == "fakecc 1.0" and not manifest["failed"] and manifest["reason"] is None
    assert list(manifest["levels"]) == ALL_X86
    for level, entry in manifest["levels"].items():
        assert (tmp_path / "one" / entry["library"]).is_file() and entry["openmp"] and "cached" not in entry
        assert entry["library"] == f"libtokenlane_cpu_{level}.so" and "-fopenmp" in entry["flags"]
    assert manifest["levels"]["x86-64-v4-bf16"]["flags"] == ["-O3", "-fPIC", "-march=x86-64-v4", "-mavx512bf16",
                                                              "-fopenmp"]
    compiles = [line for line in fake_cc.read_text().splitlines() if " -c " in line]
    assert len(compiles) == 3 * len(list(native_build.SOURCE_DIR.glob("*.c")))
    fake_cc.write_text("")
    again = native_build.build_all(tmp_path / "two", machine="x86_64")
    assert all(entry["cached"] for entry in again["levels"].values())
    assert "-c" not in fake_cc.read_text().split(), "an identical build compiled again"
    assert (tmp_path / "two" / "libtokenlane_cpu_x86-64-v3.so").read_text() == "built by fakecc\n"


def test_a_compiler_without_openmp_or_a_level_builds_the_rest(fake_cc, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CC_FAIL_ON", "-fopenmp")
    manifest = native_build.build_all(tmp_path / "no-openmp", machine="x86_64")
    assert list(manifest["levels"]) == ALL_X86
    assert all(not e["openmp"] and "-pthread" in e["flags"] for e in manifest["levels"].values())
    # Each its own cache: a real compiler's verdict on the same flags does not change.
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache-no-bf16"))
    monkeypatch.setenv("FAKE_CC_FAIL_ON", "-mavx512bf16")
    manifest = native_build.build_all(tmp_path / "no-bf16", machine="x86_64")
    assert list(manifest["levels"]) == ["x86-64-v3", "x86-64-v4"] and manifest["reason"] is None
    assert "unsupported -mavx512bf16" in manifest["failed"]["x86-64-v4-bf16"]
    assert not (tmp_path / "no-bf16" / "libtokenlane_cpu_x86-64-v4-bf16.so").exists()
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache-nothing"))
    monkeypatch.setenv("FAKE_CC_FAIL_ON", "-O3")
    manifest = native_build.build_all(tmp_path / "nothing", machine="aarch64")
    assert not manifest["levels"] and list(manifest["failed"]) == ["generic"]
    assert manifest["compiler"] and manifest["reason"] == "every level failed to build (see failed)"


def test_the_reasons_there_is_no_library_for_this_host(monkeypatch, tmp_path):
    monkeypatch.delenv(cpu_native.MAX_LEVEL_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"build.json is missing.*build_native --inplace"):
        cpu_native.prebuilt_library(tmp_path / "nothing-here")
    x86 = {"machine": "x86_64", "compiler": "cc", "reason": None, "failed": {},
           "levels": {"x86-64-v4": {"library": "libtokenlane_cpu_x86-64-v4.so"}}}
    native = _fake_install(tmp_path, x86)
    monkeypatch.setattr(native_build, "host_cpu_flags", lambda: frozenset(AVX2))
    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    with pytest.raises(RuntimeError, match=r"no native library for this CPU.*x86-64-v4, needs CPU flags "
                                           r"this host lacks: avx512bw avx512cd avx512dq avx512f avx512vl"):
        cpu_native.prebuilt_library(native)
    monkeypatch.setattr(native_build, "host_cpu_flags", lambda: frozenset(AVX512))
    with pytest.raises(RuntimeError, match="libtokenlane_cpu_x86-64-v4.so, which is missing"):
        cpu_native.prebuilt_library(native)


def test_a_level_cap_loads_the_highest_level_at_or_under_it(monkeypatch, tmp_path):
    levels = {name: {"library": f"libtokenlane_cpu_{name}.so"} for name in ALL_X86}
    native = _fake_install(tmp_path, {"machine": "x86_64", "compiler": "cc", "reason": None, "failed": {},
                                      "levels": levels})
    for name in ALL_X86:
        (native / f"libtokenlane_cpu_{name}.so").write_text("")
    monkeypatch.setattr(native_build, "host_cpu_flags", lambda: frozenset(AVX512) | {"avx512_bf16"})
    monkeypatch.setattr(native_build.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu_native.MAX_LEVEL_ENV, raising=False)
    assert cpu_native.prebuilt_library(native).level == "x86-64-v4-bf16"
    for cap in ALL_X86:
        monkeypatch.setenv(cpu_native.MAX_LEVEL_ENV, cap)
        assert cpu_native.prebuilt_library(native).level == cap
    monkeypatch.setenv(cpu_native.MAX_LEVEL_ENV, "x86-64-v2")
    with pytest.raises(RuntimeError, match=r"TOKENLANE_NATIVE_MAX_LEVEL='x86-64-v2' is not a level of this "
                                           r"machine: one of \['x86-64-v3'"):
        cpu_native.prebuilt_library(native)


def test_without_a_library_the_start_up_line_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "NATIVE_DIR", tmp_path / "_native")
    monkeypatch.delenv(cpu_native.JIT_ENV, raising=False)
    for name, value in (("_tried", False), ("_loaded", None), ("_library", None), ("_load_error", None)):
        monkeypatch.setattr(cpu_native, name, value)
    assert not cpu_native.available()
    line = cpu_native.describe()
    assert line.startswith("native CPU kernels not loaded (no native kernels built") and "torch path" in line


def test_the_engine_logs_which_native_library_it_loaded(tiny_model_dir, caplog):
    """One start-up line (what the CPU image's smoke test looks for): the level and path, or why
    there is none."""
    import logging

    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    with caplog.at_level(logging.INFO, logger="tokenlane.runtime.executor.model_executor"):
        ModelExecutor(RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)),
                                    engine=EngineConfig(device="cpu", kv_cache_blocks=16, block_size=4)))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native CPU kernels")]
    assert lines == [cpu_native.describe()]
    if cpu_native.available():
        assert f"level {cpu_native.loaded_library().level}" in lines[0]
