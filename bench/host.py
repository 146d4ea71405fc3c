"""The host a benchmark ran on, as its report states it: the CPU, its instruction-set class,
the instruction-set caps in force, the native kernels loaded and the load average.

Speed ratios move with the host class (an AVX2-only CPU, AVX-512, AVX-512 with bf16 or AMX)
and with what else runs, so `vs_vllm` and `step_profile` print this line first and keep the
dict in their JSON. A run with a cap in its environment (the AVX2 code on an AVX-512 CPU) is
labelled capped: it is not a run on that host class.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

# Environment variables that hold a process's kernels to a narrower instruction set than the
# CPU has: tokenlane's native library, oneDNN, MKL and ATen.
ISA_CAP_ENV = ("TOKENLANE_NATIVE_MAX_LEVEL", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")

# `--isa-cap avx2` of the benchmarks: those variables' values that run the AVX2 code of each.
ISA_CAPS = {"avx2": {"TOKENLANE_NATIVE_MAX_LEVEL": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def isa_cap_refusal(cap: str) -> Optional[str]:
    """Why --isa-cap `cap` cannot run on this host (None: it can)."""
    machine = os.uname().machine
    return None if machine in ("x86_64", "AMD64") else f"--isa-cap {cap}: an x86-64 cap, and this host is {machine}"


# The flags that set the class, in the order the report lists them.
CLASS_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
               "asimd", "sve", "sve2", "bf16")


def isa_class(flags: Iterable[str], machine: str = "x86_64") -> str:
    """The instruction-set class of a CPU from its /proc/cpuinfo flags."""
    flags = set(flags)
    if machine in ("aarch64", "arm64"):
        vector = "SVE2" if "sve2" in flags else "SVE" if "sve" in flags else None  # SVE2 implies SVE
        extra = [name for name in (vector, "BF16" if "bf16" in flags else None) if name]
        return "Arm NEON" + "".join(f" + {e}" for e in extra)
    if "avx512f" not in flags:
        return "AVX2-only" if "avx2" in flags else "pre-AVX2"
    label = "AVX-512"
    if "avx512_bf16" in flags:
        label += " + BF16"
    if "amx_tile" in flags:
        label += " + AMX"
    return label


def isa_caps(env: Mapping[str, str]) -> dict[str, str]:
    """The caps set in `env` (empty values are unset)."""
    return {name: env[name].strip() for name in ISA_CAP_ENV if env.get(name, "").strip()}


def host_info(env: Optional[Mapping[str, str]] = None, native: bool = True) -> dict[str, Any]:
    """This host now. `native`: also load the native kernels to say which level they run."""
    from tokenlane.kernels.native_build import host_cpu_flags

    env = os.environ if env is None else env
    machine = os.uname().machine
    flags = host_cpu_flags()
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "machine": machine,
        "cpus": len(os.sched_getaffinity(0)),
        "isa_class": isa_class(flags, machine),
        "class_flags": [f for f in CLASS_FLAGS if f in flags],
        "isa_caps": isa_caps(env),
        "loadavg_1m": load_1m(),
    }
    if native:
        try:
            from tokenlane.kernels import cpu_native

            info["native_kernels"] = cpu_native.describe()
        except Exception as exc:  # a report line, not a reason to fail the benchmark
            info["native_kernels"] = f"unknown ({exc})"
    return info


def host_line(info: Mapping[str, Any]) -> str:
    """One line for the top of a report."""
    caps = info.get("isa_caps") or {}
    cls = info["isa_class"]
    if caps:
        cls += " (CAPPED: " + " ".join(f"{k}={v}" for k, v in caps.items()) + "; not a run on a narrower host)"
    line = f"host: {info['cpus']} CPUs of {info['cpu']}, {cls}; flags {' '.join(info['class_flags']) or '-'}"
    if info.get("loadavg_1m") is not None:
        line += f"; load {info['loadavg_1m']:.2f}"
    if info.get("native_kernels"):
        line += f"\n      {info['native_kernels']}"
    return line


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model name", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def load_1m() -> Optional[float]:
    """The one-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
