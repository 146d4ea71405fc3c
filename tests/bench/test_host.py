"""The host line of the benchmarks' reports: the instruction-set class from the CPU's flags,
and a run under an instruction-set cap labelled as capped (table-driven, pure)."""

from __future__ import annotations

import pytest

from tokenlane.bench.host import host_info, host_line, isa_caps, isa_class

ZEN3 = "fpu sse2 avx fma avx2 bmi2 sha_ni"
ICELAKE = ZEN3 + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_vbmi2"
ZEN4 = ICELAKE + " avx512_bf16"
SPR = ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    "flags, machine, expected",
    [
        (ZEN3, "x86_64", "AVX2-only"),
        ("fpu sse2 sse4_2 avx", "x86_64", "pre-AVX2"),
        (ICELAKE, "x86_64", "AVX-512"),
        (ZEN4, "x86_64", "AVX-512 + BF16"),
        (SPR, "x86_64", "AVX-512 + BF16 + AMX"),
        ("fp asimd", "aarch64", "Arm NEON"),
        ("fp asimd sve bf16", "aarch64", "Arm NEON + SVE + BF16"),
        ("fp asimd sve sve2", "aarch64", "Arm NEON + SVE2"),
    ],
)
def test_isa_class(flags, machine, expected):
    assert isa_class(flags.split(), machine) == expected


def test_caps_are_read_and_a_capped_run_says_so():
    env = {"TOKENLANE_NATIVE_MAX_LEVEL": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": " ",
           "PATH": "/bin"}
    assert isa_caps(env) == {"TOKENLANE_NATIVE_MAX_LEVEL": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2"}
    info = {"cpus": 2, "cpu": "Some CPU", "isa_class": "AVX-512", "class_flags": ["avx2", "avx512f"],
            "isa_caps": isa_caps(env), "loadavg_1m": 0.5}
    line = host_line(info)
    assert line.startswith("host: 2 CPUs of Some CPU, AVX-512 (CAPPED: TOKENLANE_NATIVE_MAX_LEVEL=x86-64-v3 "
                           "ATEN_CPU_CAPABILITY=avx2; not a run on a narrower host); flags avx2 avx512f; load 0.50")
    assert "CAPPED" not in host_line({**info, "isa_caps": {}})


def test_this_host():
    info = host_info(env={}, native=False)
    assert info["cpus"] >= 1 and info["isa_caps"] == {} and "native_kernels" not in info
    assert info["isa_class"] == isa_class(info["class_flags"], info["machine"])
