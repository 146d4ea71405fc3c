"""How the native CPU kernels (kernels/csrc/*.c) are built, and which build a CPU may run.

No torch and nothing else of tokenlane: setup.py loads this file by path at wheel build time,
and kernels/cpu_native.py uses it to pick (and, as a developer override, to build) a library.

The wheel carries one shared library per instruction-set level (`LEVELS`), each built from all
of csrc/*.c with the same flags, in `_native/` next to this file, and a manifest
(`_native/build.json`: the compiler, each level's flags, which levels were built and why any
was not). At run time `choose_level` takes the highest built level whose CPU flags the host has
(from /proc/cpuinfo), so a library is never loaded on a CPU that lacks its instructions.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

SOURCE_DIR = Path(__file__).with_name("csrc")
NATIVE_DIR = Path(__file__).with_name("_native")  # where a build puts the libraries
MANIFEST = "build.json"
LIBRARY = "libtokenlane_cpu_{level}.so"

BASE_FLAGS = ("-O3", "-fPIC")
# Threads come from the caller's OpenMP team (torch's pool); a compiler without OpenMP (clang
# without libomp) gets the kernels' own pthreads and OpenMP's simd pragmas only.
OPENMP_FLAGS = ("-fopenmp",)
NO_OPENMP_FLAGS = ("-fopenmp-simd", "-pthread")
COMPILE_TIMEOUT_S = 600
CACHE_ENV = "TOKENLANE_CACHE_DIR"


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]  # the compiler's ISA flags
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list to run it


# The x86-64 micro-architecture levels (x86-64 psABI), as Linux names their CPU flags: LZCNT is
# "abm", SSE3 "pni". Lowest first.
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_LEVELS = (
    Level("x86-64-v3", ("-march=x86-64-v3",), _X86_64_V3),  # AVX2 + FMA: 8-lane kernels
    Level("x86-64-v4", ("-march=x86-64-v4",), _X86_64_V4),  # AVX-512: 16-lane kernels
    # AVX512-BF16: bf16 panels multiplied in pairs (vdpbf16ps)
    Level("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16"), _X86_64_V4 | {"avx512_bf16"}),
)
# Elsewhere one build for the architecture's baseline.
GENERIC = Level("generic", (), frozenset())


def is_x86_64(machine: Optional[str] = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def levels_for(machine: Optional[str] = None) -> tuple[Level, ...]:
    """The levels a build makes for this machine architecture, lowest first."""
    return X86_LEVELS if is_x86_64(machine) else (GENERIC,)


def choose_level(cpu_flags: Iterable[str], built: Iterable[str], machine: Optional[str] = None) -> Optional[str]:
    """The highest level of `built` whose CPU flags are all in `cpu_flags`, or None."""
    have, available = set(cpu_flags), set(built)
    best = None
    for level in levels_for(machine):
        if level.name in available and level.cpu_flags <= have:
            best = level.name
    return best


def missing_cpu_flags(level: str, cpu_flags: Iterable[str], machine: Optional[str] = None) -> list[str]:
    """The CPU flags `level` needs that `cpu_flags` lacks (all of its flags for an unknown level)."""
    for candidate in levels_for(machine):
        if candidate.name == level:
            return sorted(candidate.cpu_flags - set(cpu_flags))
    raise ValueError(f"unknown native level {level!r}: one of {[lv.name for lv in levels_for(machine)]}")


def cpu_flags_line() -> str:
    """The CPU's feature flags line of /proc/cpuinfo ('flags' on x86, 'Features' on Arm), or ''."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def host_cpu_flags() -> frozenset[str]:
    line = cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def sources() -> list[Path]:
    """The C files of the library, then its headers (what a build depends on)."""
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


def cache_dir() -> Path:
    """`$TOKENLANE_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenlane` or `~/.cache/tokenlane`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenlane"


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def compiler_version(cc: str) -> Optional[str]:
    """The first line of `cc --version`, or None when there is no such compiler."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return (result.stdout.splitlines() or [cc])[0].strip()


class BuildError(RuntimeError):
    pass


def _compile_and_link(cc: str, flags: tuple[str, ...], out: Path, pool: ThreadPoolExecutor) -> None:
    """Each C file to an object (in parallel on `pool`), then one shared library at `out`,
    written under a private name and renamed: a reader never sees half a library."""
    with tempfile.TemporaryDirectory(prefix="tokenlane-native-") as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in sorted(SOURCE_DIR.glob("*.c"))]
        commands = [[cc, *flags, "-I", str(SOURCE_DIR), "-c", "-o", str(obj), str(SOURCE_DIR / f"{obj.stem}.c")]
                    for obj in objects]
        for result in pool.map(lambda argv: subprocess.run(argv, capture_output=True, text=True,
                                                           timeout=COMPILE_TIMEOUT_S), commands):
            if result.returncode != 0:
                raise BuildError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        partial = Path(tmp) / out.name
        link = subprocess.run([cc, *flags, "-shared", "-o", str(partial), *map(str, objects), "-lm"],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if link.returncode != 0:
            raise BuildError(f"{cc} failed to link: {link.stderr.strip()[-2000:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-")
        os.close(fd)
        try:
            shutil.copyfile(partial, staged)
            os.replace(staged, out)
        finally:
            if os.path.exists(staged):
                os.unlink(staged)


def build_library(cc: str, isa_flags: tuple[str, ...], out: Path, pool: ThreadPoolExecutor) -> dict:
    """One library at `out` for `isa_flags`, with OpenMP, else (the compiler refuses it) with
    the kernels' own pthreads. Returns its flags and whether it has OpenMP; BuildError with the
    compiler's message when neither builds."""
    errors = []
    for threads, openmp in ((OPENMP_FLAGS, True), (NO_OPENMP_FLAGS, False)):
        flags = BASE_FLAGS + tuple(isa_flags) + threads
        try:
            _compile_and_link(cc, flags, out, pool)
            return {"flags": list(flags), "openmp": openmp}
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    raise BuildError("; ".join(errors))


def _cached_build(cc: str, version: str, level: Level, out: Path, pool: ThreadPoolExecutor) -> dict:
    """build_library for `level`, reusing an identical earlier build (same sources, compiler
    and flags) from `cache_dir() / "native-build"`: a second wheel build of the same tree (the
    packaging test's, after scripts/setup.sh's) compiles nothing. The cache is best effort."""
    key = hashlib.sha256(b"\0".join([
        *(source.name.encode() + b"\0" + source.read_bytes() for source in sources()),
        cc.encode(), version.encode(),
        " ".join(BASE_FLAGS + level.flags + OPENMP_FLAGS + NO_OPENMP_FLAGS).encode(),
    ])).hexdigest()[:16]
    cached = cache_dir() / "native-build" / f"{level.name}-{key}"
    try:
        built = json.loads(cached.with_suffix(".json").read_text())
        shutil.copyfile(cached.with_suffix(".so"), out)
        return {**built, "cached": True}
    except (OSError, ValueError):
        pass
    built = build_library(cc, level.flags, out, pool)
    staged = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}-")
        os.close(fd)
        shutil.copyfile(out, staged)
        os.replace(staged, cached.with_suffix(".so"))
        cached.with_suffix(".json").write_text(json.dumps(built))  # last: it marks the entry whole
    except OSError:
        pass
    finally:
        if staged and os.path.exists(staged):
            os.unlink(staged)
    return built


def build_all(out_dir: Path, machine: Optional[str] = None, jobs: Optional[int] = None) -> dict:
    """Every level of this machine's architecture into `out_dir` (emptied first), and the
    manifest; returns the manifest. Never raises for a missing or failing compiler: the
    manifest says why a level (or every level) was not built."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cc = compiler()
    version = compiler_version(cc)
    machine = machine or platform.machine()
    manifest: dict = {"machine": machine, "compiler": cc if version else None, "compiler_version": version,
                      "levels": {}, "failed": {}, "reason": None}
    if version is None:
        manifest["reason"] = f"no C compiler at build time ({cc!r} not found; set CC)"
    else:
        levels = levels_for(machine)
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool, \
                ThreadPoolExecutor(max_workers=len(levels)) as per_level:
            def one(level: Level):
                library = LIBRARY.format(level=level.name)
                try:
                    built = _cached_build(cc, version, level, out_dir / library, pool)
                except BuildError as exc:
                    return level, None, str(exc)
                return level, {"library": library, **built, "cpu_flags": sorted(level.cpu_flags)}, None

            for level, entry, error in per_level.map(one, levels):
                if entry is not None:
                    manifest["levels"][level.name] = entry
                else:
                    manifest["failed"][level.name] = error
        if not manifest["levels"]:
            manifest["reason"] = "every level failed to build (see failed)"
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(native_dir: Path = NATIVE_DIR) -> Optional[dict]:
    """The build's manifest, or None where there is none (a source checkout never built)."""
    try:
        return json.loads((Path(native_dir) / MANIFEST).read_text())
    except FileNotFoundError:
        return None


if __name__ == "__main__":  # python kernels/native_build.py [OUT_DIR]: a build by hand
    import sys

    print(json.dumps(build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else NATIVE_DIR), indent=2))
