"""The C kernels for the CPU (kernels/csrc/*.c): load, launch.

The kernels are built with the wheel (setup.py, kernels/native_build.py): one shared library per
instruction-set level in `_native/` next to this file (x86-64: `x86-64-v3` AVX2+FMA,
`x86-64-v4` AVX-512, `x86-64-v4-bf16` AVX-512 with AVX512-BF16; elsewhere one `generic`
build), with the manifest `_native/build.json`. `load()` picks the highest level whose CPU
flags this host has (/proc/cpuinfo) and loads it with ctypes, which releases the GIL for each
call; no compiler is involved. Without a library for this host (a build without a compiler, a
CPU below every level, a checkout never built) `load()` returns None, logs why once, and the
engine keeps the torch path (kernels/cpu_attention.py). `describe()` says which library was
loaded, or why none (the runtime logs it at start-up).

Developer override: TOKENLANE_NATIVE_JIT=1 compiles the sources at first use with the system
compiler (`cc`, or `$CC`) for this host's own instruction set (-march=native) into a cache under
`$TOKENLANE_CACHE_DIR` (default `$XDG_CACHE_HOME/tokenlane` or `~/.cache/tokenlane`, else the
temp directory), named by a hash of the sources, the compiler's version, the flags and the
CPU's feature flags, instead of the prebuilt libraries.

`paged_decode_attention` is the decode-attention launcher: it checks shapes, strides and
dtypes, then runs every decode of a batch in one call. Results equal the torch reference up
to float32 summation order (tests/kernels/test_cpu_native.py). `PanelLinear` multiplies the
few rows of a decode step by a weight packed once into panels. `write_kv_cache` (the KV cache
write, bit-exact with the torch one), `try_rope_write_kv` (RoPE on a layer's queries and keys,
bitwise the torch ops', then that write), `argmax_rows` (greedy sampling) and `rms_norm`
(RMSNorm in float32 or bf16, equal to torch's up to summation order) are the others.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tokenlane.kernels import native_build

log = logging.getLogger("tokenlane.kernels")

CACHE_ENV = native_build.CACHE_ENV
JIT_ENV = "TOKENLANE_NATIVE_JIT"
# Load no level above this one (as oneDNN's ONEDNN_MAX_CPU_ISA caps its own kernels): to run a
# lower level's code paths on a newer CPU, e.g. an AVX2 build's panel rows on an AVX-512 host.
MAX_LEVEL_ENV = "TOKENLANE_NATIVE_MAX_LEVEL"
# The JIT build's instruction set: this host's own. Threads: in a pool step (`pool_step`)
# attention and the panel products share their items with the C helper pool (pthreads);
# otherwise they, and the large norms and argmaxes, run on the caller's OpenMP team, i.e.
# torch's own pool (one libgomp per process; a build without OpenMP, e.g. clang without
# libomp, runs them on the caller alone).
JIT_FLAGS = ("-march=native",)

# The C kernel's cache dtype codes: the KV write's, and the attention kernels' (also fp8: they
# read its bytes through a table; the scales are the caller's, kernels/cpu_attention.py).
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ATTENTION_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_ERRORS = {1: "unsupported cache dtype", 2: "out of memory", 3: "bad shape", 4: "a NaN sum"}
TL_NAN = 4
MAX_GROUP = 64  # query heads per KV head (TL_MAX_GROUP in the C source)


@dataclass(frozen=True)
class NativeLibrary:
    """The library `load()` loaded: its level ("native" for a JIT build) and path."""

    level: str
    path: Path
    jit: bool = False


_lock = threading.Lock()
_loaded: Optional[ctypes.CDLL] = None
_library: Optional[NativeLibrary] = None
_load_error: Optional[str] = None
_tried = False
# Per thread: the threads of the pool kernels during a `pool_step` (else torch's count).
_pool_step = threading.local()


def pool_threads() -> int:
    """Threads the C kernels of attention and `PanelLinear` use on this thread: those of the
    `pool_step` it is in, else torch's count."""
    return getattr(_pool_step, "threads", 0) or torch.get_num_threads()


def in_pool_step() -> bool:
    """Whether this thread is in a `pool_step` (the C kernels then take the helper pool)."""
    return bool(getattr(_pool_step, "threads", 0))


def pool_helper_items() -> int:
    """Items the helper pool's threads (not the callers) have run in this process."""
    lib = load()
    return 0 if lib is None else lib.tl_pool_helper_items()


def park_pool() -> None:
    """Sends the helper pool's threads to sleep now rather than after their spin: before a
    step that runs on torch's OpenMP threads (a prefill), which need the cores."""
    lib = _loaded if _loaded is not None else load()
    if lib is not None:
        lib.tl_pool_park()


class pool_step:
    """`with pool_step(n):` a step whose parallel work is all in the C kernels (attention and
    panel products: the decode steps of a model whose linears all have panels). Inside, those
    kernels share their items with n - 1 helper threads (kernels/csrc/pool.c, "the helper
    pool"), which never wait for a preempted thread as an OpenMP team's barrier does, and torch
    runs on one thread: its OpenMP workers, spinning a while after a parallel op, would take the
    cores the helpers need (2-core Zen 4, a 16-sequence bf16 decode step of the 19M model: 5.6-12
    ms with torch on two threads beside helpers spinning 0.2-100 ms, 3.9 ms with torch on one).
    Restores torch's count on the way out."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> "pool_step":
        self._torch_threads = torch.get_num_threads()
        _pool_step.threads = self.threads
        if self._torch_threads != 1:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        _pool_step.threads = 0
        if self._torch_threads != 1:
            torch.set_num_threads(self._torch_threads)


def cache_dir() -> Path:
    return native_build.cache_dir()


def jit_requested() -> bool:
    """Whether the developer override TOKENLANE_NATIVE_JIT asks for a build on this host."""
    return os.environ.get(JIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load() -> Optional[ctypes.CDLL]:
    """The library for this host, or None (the reason is in `load_error()` and logged once)."""
    global _loaded, _library, _load_error, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                library = _jit_library() if jit_requested() else prebuilt_library()
                _loaded = _bind(ctypes.CDLL(str(library.path)))
                _library = library
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _load_error = str(exc)
                log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return _loaded


def load_error() -> Optional[str]:
    return _load_error


def available() -> bool:
    return load() is not None


def loaded_library() -> Optional[NativeLibrary]:
    """Which library `load()` loaded (its level and path), or None."""
    load()
    return _library


def describe() -> str:
    """One line for the start-up log: the level and path of the library loaded, or why none."""
    library = loaded_library()
    if library is None:
        return f"native CPU kernels not loaded ({_load_error}); the torch path runs"
    how = "built here (TOKENLANE_NATIVE_JIT)" if library.jit else "prebuilt"
    if not library.jit and os.environ.get(MAX_LEVEL_ENV, "").strip():
        how += f", {MAX_LEVEL_ENV}={os.environ[MAX_LEVEL_ENV].strip()}"
    return f"native CPU kernels loaded: level {library.level}, {how}, {library.path}"


def prebuilt_library(native_dir: Optional[Path] = None) -> NativeLibrary:
    """The wheel's library for this host: the highest level built whose CPU flags it has.
    RuntimeError saying why when there is none."""
    native_dir = Path(native_dir or native_build.NATIVE_DIR)
    manifest = native_build.read_manifest(native_dir)
    if manifest is None:
        raise RuntimeError(f"no native kernels built ({native_dir / native_build.MANIFEST} is missing; in a "
                           f"checkout run `python setup.py build_native --inplace`, or set {JIT_ENV}=1)")
    built = manifest.get("levels") or {}
    if not built:
        raise RuntimeError(f"the native kernels were not built with this package: {manifest.get('reason')}")
    cap = os.environ.get(MAX_LEVEL_ENV, "").strip()
    if cap:
        names = [lv.name for lv in native_build.levels_for()]
        if cap not in names:
            raise RuntimeError(f"{MAX_LEVEL_ENV}={cap!r} is not a level of this machine: one of {names}")
        built = {name: entry for name, entry in built.items() if name in names[: names.index(cap) + 1]}
    flags = native_build.host_cpu_flags()
    level = native_build.choose_level(flags, built)
    if level is None:
        known = [lv for lv in native_build.levels_for() if lv.name in built]
        if not known:
            raise RuntimeError(f"no native library for this machine ({platform.machine()}): built "
                               f"{sorted(built)} on {manifest.get('machine')}")
        raise RuntimeError(f"no native library for this CPU: built {sorted(built)}; the lowest, {known[0].name}, "
                           f"needs CPU flags this host lacks: {' '.join(sorted(known[0].cpu_flags - flags))}")
    path = native_dir / built[level]["library"]
    if not path.exists():
        raise RuntimeError(f"the manifest lists {path}, which is missing")
    return NativeLibrary(level, path)


def _jit_library() -> NativeLibrary:
    return NativeLibrary("native", _build(), jit=True)


def _compiler() -> str:
    return native_build.compiler()


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code must not be reused on another CPU."""
    return native_build.cpu_flags_line() or platform.processor() or platform.machine()


def _build() -> Path:
    """The JIT build (TOKENLANE_NATIVE_JIT): the sources for -march=native, cached."""
    version = native_build.compiler_version(_compiler())
    if version is None:
        raise RuntimeError(f"no C compiler ({_compiler()!r} not found; set CC)")
    key = hashlib.sha256(b"\0".join([
        *(source.name.encode() + b"\0" + source.read_bytes() for source in native_build.sources()),
        version.encode(), " ".join(JIT_FLAGS + native_build.OPENMP_FLAGS + native_build.NO_OPENMP_FLAGS).encode(),
        _cpu_flags().encode(),
    ])).hexdigest()[:16]
    errors = []
    for directory in (cache_dir() / "native", Path(tempfile.gettempdir()) / "tokenlane-native"):
        library = directory / f"cpu_native-{key}.so"
        if library.exists():
            return library
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-")
            probe.close()
        except OSError as exc:
            errors.append(f"{directory}: {exc}")
            continue
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            built = native_build.build_library(_compiler(), JIT_FLAGS, library, pool)
        if not built["openmp"]:
            log.info("native CPU kernels: no OpenMP build (%s rejected it); built with pthreads", _compiler())
        log.info("built the native CPU kernels: %s", library)
        return library
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn = lib.tl_paged_decode_attention
    fn.restype = i32
    fn.argtypes = [
        ptr, i64, i64,  # q, its token and head strides
        ptr, ptr, i32,  # k cache, v cache, dtype code
        i64, i64, i64,  # cache block, token and head strides
        ptr, i64,  # block tables, row stride
        ptr, ptr, ptr, i32,  # rows, seqs, lens, n
        i32, i32, i32, i32, i32, ctypes.c_float,  # hq, hkv, d, block_size, max_len, scale
        ptr, i64, i64,  # out, its token and head strides
        i32, i32,  # threads, in the helper pool (else the OpenMP team)
        i64, i64, i64,  # rows of q / out, rows of block_tables, cache blocks (bounds)
    ]
    prefill = lib.tl_paged_prefill_attention
    prefill.restype = i32
    prefill.argtypes = [
        ptr, i64, i64,  # q, its token and head strides
        ptr, ptr, i32,  # k cache, v cache, dtype code
        i64, i64, i64,  # cache block, token and head strides
        ptr, i64,  # block tables, row stride
        ptr, ptr, ptr, ptr, i32,  # q_starts, q_lens, ctx_lens, seqs, n
        i32, i32, i32, i32, ctypes.c_float,  # hq, hkv, d, block_size, scale
        ptr, i64, i64,  # out, its token and head strides
        i32, i32,  # threads, in the helper pool (else the OpenMP team)
        i64, i64, i64,  # rows of q / out, rows of block_tables, cache blocks (bounds)
    ]
    lib.tl_prefill_supported.restype = i32
    lib.tl_prefill_supported.argtypes = [i32, i32]
    argmax = lib.tl_argmax_rows
    argmax.restype = i32
    argmax.argtypes = [ptr, i64, i64, i64, ptr, i32]  # x, rows, cols, row stride, out, threads
    write = lib.tl_write_kv
    write.restype = i32
    write.argtypes = [
        ptr, ptr, i32, i64, i64,  # k, v, their dtype code, token and head strides
        ptr, ptr, i32, i64, i64, i64,  # k cache, v cache, dtype code, block/token/head strides
        ptr, i64,  # slots, n
        i32, i32, i32, i64,  # hkv, d, block_size, num_slots
    ]
    rope = lib.tl_rope_write_kv
    rope.restype = i32
    rope.argtypes = [
        ptr, i64, i64,  # qkv, rows, row stride
        ptr, ptr, i64,  # cos, signed sin, their row stride
        i32, i32, i32,  # hq, hkv, d
        ptr, ptr, i32, i64, i64, i64,  # k cache, v cache, dtype code, block/token/head strides
        ptr, i32, i64,  # slots, block_size, num_slots
    ]
    norm = lib.tl_rms_norm
    norm.restype = i32
    norm.argtypes = [ptr, i64, i64, i64, ptr, i32, ctypes.c_float, ptr, i64, i32]  # x, rows, cols, stride, w, dtype, eps, out, stride, threads
    lib.tl_panel_width.restype = i32
    lib.tl_panel_width.argtypes = []
    lib.tl_panel_bf16_pairs.restype = i32
    lib.tl_panel_bf16_pairs.argtypes = []
    linear = lib.tl_linear_panels
    linear.restype = i32
    linear.argtypes = [
        ptr, i64, i64, i64,  # x, rows, in features, row stride
        ptr, i64, ptr,  # panels, out features, bias (or NULL)
        ptr, i64, i32, i32,  # out, its row stride, threads, in the helper pool (else OpenMP)
    ]
    argmax = lib.tl_linear_panels_argmax
    argmax.restype = i32
    argmax.argtypes = [
        ptr, i64, i64, i64,  # x, rows, in features, row stride
        ptr, i64, ptr,  # panels, out features, bias (or NULL)
        ptr, i32, i32,  # out (int64 per row), threads, in the helper pool (else OpenMP)
    ]
    linear_bf16 = lib.tl_linear_panels_bf16
    linear_bf16.restype = i32
    linear_bf16.argtypes = list(linear.argtypes)  # the same, with bf16 x, panels, bias and out
    argmax_bf16 = lib.tl_linear_panels_argmax_bf16
    argmax_bf16.restype = i32
    argmax_bf16.argtypes = list(argmax.argtypes)  # the same, with bf16 x, panels and bias
    lib.tl_pool_helper_items.restype = i64
    lib.tl_pool_helper_items.argtypes = []
    lib.tl_pool_park.restype = None
    lib.tl_pool_park.argtypes = []
    lib.tl_bind_threads.restype = i32
    lib.tl_bind_threads.argtypes = [ptr, i32]  # cpus (int32 per thread), n
    return lib


_NORM_DTYPES = {dtype: _DTYPES[dtype] for dtype in (torch.float32, torch.bfloat16)}  # what tl_rms_norm takes


def can_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these: a float32 or bfloat16 CPU matrix [rows, cols] with a
    contiguous last axis, and a contiguous weight [cols] of the same dtype."""
    # Cheap attributes only: this runs before every norm of a step (2L + 1 per step).
    return (
        x.dtype in _NORM_DTYPES and x.is_cpu and x.dim() == 2 and x.stride(-1) == 1
        and x.shape[1] > 0
        and weight.dtype == x.dtype and weight.is_cpu and weight.dim() == 1
        and weight.shape[0] == x.shape[1] and weight.is_contiguous()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """runtime/executor/llama.py's RMSNorm of each row in one C call (a new tensor): float32
    `(x * rsqrt(mean(x^2) + eps)) * weight`; bfloat16 as transformers' LlamaRMSNorm (float32
    statistics, `weight * normed.to(bf16)`). Equal to torch's up to the order of the sum of
    squares."""
    out = try_rms_norm(x, weight, eps)
    if out is None:
        if load() is None:
            raise RuntimeError(f"native CPU kernels are not available: {_load_error}")
        raise ValueError(f"rms_norm needs a float32 or bf16 CPU matrix with a contiguous last axis "
                         f"and a weight of its dtype and width, got x {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()} on {x.device}, weight {weight.dtype} {tuple(weight.shape)}")
    return out


def try_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """`rms_norm`, or None where it does not apply (no kernel here, or inputs it does not
    take): the per-norm entry point, with each check made once (a [16, 256] norm took 6.7 us
    on a 2-core Zen 4, mostly the call itself)."""
    lib = _loaded if _loaded is not None else load()
    if lib is None or not can_rms_norm(x, weight):
        return None
    out = torch.empty_like(x)
    code = lib.tl_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(),
                           _NORM_DTYPES[x.dtype], eps, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if code:
        raise RuntimeError(f"native RMSNorm failed: {_ERRORS.get(code, code)}")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a float32 CPU matrix [rows, cols] with a contiguous last axis:
    the same indices (first maximum; first NaN where a row has one), one pass less slow than
    torch's reduction on a [64, 32000] logits batch."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels are not available: {_load_error}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1:
        raise ValueError(f"argmax_rows needs a float32 CPU matrix with a contiguous last axis, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    if x.shape[1] == 0:
        raise ValueError("argmax_rows of an empty row")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    code = lib.tl_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                              torch.get_num_threads())
    if code:
        raise RuntimeError(f"native argmax failed: {_ERRORS.get(code, code)}")
    return out


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D] float32 or the cache dtype
    value: torch.Tensor,  # same shape, dtype and strides as key
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 | bfloat16 | float16
    value_cache: torch.Tensor,  # same shape, dtype and strides as key_cache
    slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset; < 0 = skip
) -> bool:
    """kernels/reference.py's `write_kv_cache_ref` in one C call: no mask, no gathered copy.
    False (nothing written) where this build has no float16 conversion. Raises ValueError for
    inputs it does not take (the caller checks `can_write_kv` first) and for a slot past the
    cache."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU kernels are not available: {_load_error}")
    if not can_write_kv(key, value, key_cache, value_cache, slot_mapping):
        raise ValueError(f"native KV write: unsupported inputs key {key.dtype} {tuple(key.shape)} "
                         f"{key.stride()}, value {value.dtype} {value.stride()}, cache {key_cache.dtype} "
                         f"{tuple(key_cache.shape)}, slots {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    num_blocks, block_size, hkv, d = key_cache.shape
    code = lib.tl_write_kv(
        key.data_ptr(), value.data_ptr(), _DTYPES[key.dtype], key.stride(0), key.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(), _DTYPES[key_cache.dtype],
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        slot_mapping.data_ptr(), slot_mapping.numel(), hkv, d, block_size, num_blocks * block_size,
    )
    if code == 1:
        return False
    if code == 3:
        raise ValueError(f"KV write: a slot is past the cache's {num_blocks * block_size} slots")
    if code:
        raise RuntimeError(f"native KV write failed: {_ERRORS.get(code, code)}")
    return True


def try_rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] float32: queries, keys, values of each token
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,  # [T, D] float32
    sin_signed: torch.Tensor,  # [T, D] float32, the first half negated (model.signed_sin)
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; < 0 = skip
) -> bool:
    """runtime/executor/llama.py's `apply_rope_` on the query and key heads of `qkv` in place (bitwise
    the torch ops' result), then `write_kv_cache` of its keys and values, in one C call. False,
    with nothing done, where it does not apply (no kernel here, other dtypes or layouts): the
    caller then takes the torch ops. The per-layer entry point: cheap checks only."""
    lib = _loaded if _loaded is not None else load()
    if lib is None:
        return False
    t, width = qkv.shape if qkv.dim() == 2 else (0, 0)
    num_blocks, block_size, hkv, d = key_cache.shape if key_cache.dim() == 4 else (0, 0, 0, 0)
    if not (
        qkv.dtype == torch.float32 and qkv.is_cpu and width == (num_heads + 2 * num_kv_heads) * d
        and qkv.stride(1) == 1 and hkv == num_kv_heads and d % 2 == 0 and d <= 1024
        and cos.dtype == torch.float32 and sin_signed.dtype == torch.float32
        and cos.shape == sin_signed.shape == (t, d) and cos.stride() == sin_signed.stride()
        and cos.stride(1) == 1 and cos.is_cpu and sin_signed.is_cpu
        and key_cache.dtype in _DTYPES and key_cache.is_cpu and key_cache.stride(-1) == 1
        and value_cache.dtype == key_cache.dtype and value_cache.shape == key_cache.shape
        and value_cache.stride() == key_cache.stride()
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_cpu and slot_mapping.dim() == 1
        and slot_mapping.numel() == t and slot_mapping.is_contiguous()
    ):
        return False
    code = lib.tl_rope_write_kv(
        qkv.data_ptr(), t, qkv.stride(0), cos.data_ptr(), sin_signed.data_ptr(), cos.stride(0),
        num_heads, hkv, d, key_cache.data_ptr(), value_cache.data_ptr(), _DTYPES[key_cache.dtype],
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        slot_mapping.data_ptr(), block_size, num_blocks * block_size,
    )
    if code == 1:  # a float16 cache in a build without float16
        return False
    if code == 3:
        raise ValueError(f"KV write: a slot is past the cache's {num_blocks * block_size} slots")
    if code:
        raise RuntimeError(f"native RoPE + KV write failed: {_ERRORS.get(code, code)}")
    return True


def can_write_kv(key, value, key_cache, value_cache, slot_mapping) -> bool:
    """Whether `write_kv_cache` takes these: CPU tensors, K/V alike (float32 or the cache
    dtype) with a contiguous last axis, caches alike, int64 slots."""
    cache_dtype = key_cache.dtype
    return (
        key.device.type == "cpu" and key_cache.device.type == "cpu"
        and key.dim() == 3 and key_cache.dim() == 4 and key.shape[1:] == key_cache.shape[2:]
        and value.shape == key.shape and value.dtype == key.dtype and value.stride() == key.stride()
        and key.dtype in (torch.float32, cache_dtype) and key.stride(-1) == 1
        and cache_dtype in _DTYPES and value_cache.dtype == cache_dtype
        and value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride()
        and key_cache.stride(-1) == 1
        and slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1
        and slot_mapping.is_contiguous() and slot_mapping.numel() == key.shape[0]
        and slot_mapping.device.type == "cpu"
    )


def _launchable(query, key_cache, value_cache, block_tables, out, index: dict[str, torch.Tensor]) -> ctypes.CDLL:
    """The library, once the checks both attention launchers share pass: float32 query and out
    of one shape, K and V caches alike in a cache dtype, the head size the cache's, CPU tensors
    with a contiguous last axis, int32 block tables and `index` vectors (contiguous, one
    length). ValueError (RuntimeError without the library) names what is wrong."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native CPU attention is not available: {_load_error}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"value cache {tuple(value_cache.shape)}/{value_cache.stride()} must match "
                         f"the key cache {tuple(key_cache.shape)}/{key_cache.stride()}")
    if key_cache.shape[-1] != query.shape[-1] or out.shape != query.shape:
        raise ValueError(f"head size / output shape mismatch: query {tuple(query.shape)}, "
                         f"cache {tuple(key_cache.shape)}, out {tuple(out.shape)}")
    if query.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(f"query and out must be float32, got {query.dtype} and {out.dtype}")
    if not reads_cache_dtype(key_cache.dtype) or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"cache dtype must be one this library reads ({list(_ATTENTION_DTYPES)}), "
                         f"got {key_cache.dtype} / {value_cache.dtype}")
    for name, tensor in (("query", query), ("out", out), ("key_cache", key_cache)):
        if tensor.device.type != "cpu" or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a CPU tensor with a contiguous last axis")
    vectors = index.values()
    if any(x.dtype != torch.int32 or x.dim() != 1 or not x.is_contiguous() for x in vectors) or \
            len({x.numel() for x in vectors}) != 1:
        raise ValueError(f"{', '.join(index)} must be contiguous int32 vectors of one length")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32 with a contiguous last axis")
    return lib


def reads_cache_dtype(dtype: torch.dtype) -> bool:
    """Whether the attention kernels of the loaded library read a KV cache of `dtype` (a
    library built before fp8 lacks `tl_attention_reads_dtype` and reads the write's dtypes)."""
    lib = load()
    if lib is None or dtype not in _ATTENTION_DTYPES:
        return False
    reads = getattr(lib, "tl_attention_reads_dtype", None)
    return dtype in _DTYPES if reads is None else bool(reads(_ATTENTION_DTYPES[dtype]))


@functools.lru_cache(maxsize=None)
def prefill_supported(head_dim: int, group: int) -> bool:
    """Whether `paged_prefill_attention` takes this head size and query heads per KV head
    (head sizes 32 and 64, up to MAX_GROUP query heads per KV head). Asked for every layer, so
    answered once per shape."""
    lib = load()
    return lib is not None and bool(lib.tl_prefill_supported(head_dim, group))


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 | bfloat16 | float16
    value_cache: torch.Tensor,  # same shape, dtype and strides as key_cache
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    q_starts: torch.Tensor,  # [n] int32: first query (= output) row of each chunk
    q_lens: torch.Tensor,  # [n] int32: query rows of each chunk
    ctx_lens: torch.Tensor,  # [n] int32: context length of each chunk, its own tokens included
    seqs: torch.Tensor,  # [n] int32: block-table row of each chunk
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] float32
    num_threads: int = 1,
    pool: bool = False,
) -> torch.Tensor:
    """Causal attention of prefill chunks over their paged context
    (kernels/csrc/attention_prefill.c): out rows [q_starts[i], q_starts[i] + q_lens[i]) for
    each chunk i, its query row r at position ctx_lens[i] - q_lens[i] + r. The other rows of
    `out` are left as they are. Every index is bound-checked in C before any is followed (ValueError, nothing
    written). The threads are the caller's OpenMP team, or with `pool` the caller and
    `num_threads` - 1 helpers of the C helper pool (`pool_step`)."""
    lib = _launchable(query, key_cache, value_cache, block_tables, out,
                      {"q_starts": q_starts, "q_lens": q_lens, "ctx_lens": ctx_lens, "seqs": seqs})
    t, hq, d = query.shape
    num_blocks, block_size, hkv, _ = key_cache.shape
    if hq % hkv or not lib.tl_prefill_supported(d, hq // hkv):
        raise ValueError(f"prefill attention takes head sizes 32 and 64 and a whole number of query heads "
                         f"per KV head (at most {MAX_GROUP}), got head size {d}, {hq} query heads, {hkv} KV heads")
    n = q_lens.numel()
    if n == 0:
        return out
    code = lib.tl_paged_prefill_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(), _ATTENTION_DTYPES[key_cache.dtype],
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0),
        q_starts.data_ptr(), q_lens.data_ptr(), ctx_lens.data_ptr(), seqs.data_ptr(), n,
        hq, hkv, d, block_size, float(scale),
        out.data_ptr(), out.stride(0), out.stride(1),
        max(1, int(num_threads)), int(pool),
        t, block_tables.shape[0], num_blocks,
    )
    if code == 3:
        raise ValueError("native CPU prefill attention: a row, sequence, length or block number is out "
                         f"of range (rows < {t}, sequences < {block_tables.shape[0]}, blocks < {num_blocks}, "
                         "1 <= query length <= context length)")
    if code:
        raise RuntimeError(f"native CPU prefill attention failed: {_ERRORS.get(code, code)}")
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [T, Hq, D] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 | bfloat16 | float16
    value_cache: torch.Tensor,  # same shape, dtype and strides as key_cache
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    rows: torch.Tensor,  # [n] int32: query (= output) row of each decode
    seqs: torch.Tensor,  # [n] int32: block-table row of each decode
    lens: torch.Tensor,  # [n] int32: context length of each decode, in [1, max_len]
    max_len: int,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] float32
    num_threads: int = 1,
    pool: bool = False,
) -> torch.Tensor:
    """out[rows[i]] = attention of query[rows[i]] over the first lens[i] cached tokens of
    block-table row seqs[i]. The other rows of `out` are left as they are. Every index is
    bound-checked in C before any is followed (ValueError, nothing written). The threads are the
    caller's OpenMP team, or with `pool` the caller and `num_threads` - 1 helpers of the C helper
    pool (`pool_step`)."""
    lib = _launchable(query, key_cache, value_cache, block_tables, out, {"rows": rows, "seqs": seqs, "lens": lens})
    t, hq, d = query.shape
    num_blocks, block_size, hkv, _ = key_cache.shape
    if hq % hkv or hq // hkv > MAX_GROUP:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}), "
                         f"at most {MAX_GROUP} per KV head")
    n = rows.numel()
    if n == 0:
        return out
    assert max_len >= 1 and -(-max_len // block_size) <= block_tables.shape[1], \
        (max_len, block_size, block_tables.shape)
    code = lib.tl_paged_decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(), _ATTENTION_DTYPES[key_cache.dtype],
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0),
        rows.data_ptr(), seqs.data_ptr(), lens.data_ptr(), n,
        hq, hkv, d, block_size, max_len, float(scale),
        out.data_ptr(), out.stride(0), out.stride(1),
        max(1, int(num_threads)), int(pool),
        t, block_tables.shape[0], num_blocks,
    )
    if code == 3:
        raise ValueError("native CPU attention: a row, sequence, context length or block number "
                         f"is out of range (rows < {t}, sequences < {block_tables.shape[0]}, lengths "
                         f"in [1, {max_len}], blocks < {num_blocks})")
    if code:
        raise RuntimeError(f"native CPU attention failed: {_ERRORS.get(code, code)}")
    return out


def bind_threads(cpus: list[int]) -> Optional[int]:
    """Set torch's thread count to len(cpus) and pin the calling thread's OpenMP team (torch's
    pool for this thread), thread i to cpus[i]. Returns the threads pinned, or None when the
    library is missing or was built without OpenMP (nothing pinned)."""
    if not cpus:
        return None
    torch.set_num_threads(len(cpus))
    lib = load()
    if lib is None:
        return None
    array = (ctypes.c_int32 * len(cpus))(*cpus)
    pinned = lib.tl_bind_threads(ctypes.cast(array, ctypes.c_void_p), len(cpus))
    return None if pinned < 0 else pinned


def panel_width() -> Optional[int]:
    """Output columns per panel of `PanelLinear` in this build (four of its widest float
    vectors: 64 with AVX-512, else 32), or None without the native kernels."""
    lib = load()
    return None if lib is None else lib.tl_panel_width()


def panel_bf16_pairs() -> bool:
    """Whether this build multiplies bf16 panels natively (AVX512-BF16: pairs of k per
    instruction); elsewhere bf16 panels are widened to float32 as they are read."""
    lib = load()
    return lib is not None and bool(lib.tl_panel_bf16_pairs())


# Most rows PanelLinear.argmax takes in one call (TL_LINEAR_CHUNK in the C source).
ARGMAX_MAX_ROWS = 96


class PanelLinear:
    """`F.linear(x, weight, bias)` for float32 or bfloat16 CPU inputs (the weight's dtype),
    through `tl_linear_panels` / `tl_linear_panels_bf16`: the weight [N, K] is packed once into
    panels of `panel_width()` output columns ([ceil(N / width), K, width], panel p the output
    columns [p * width, (p + 1) * width) transposed, zero past N: a copy; bf16 where the build
    has AVX512-BF16: [ceil(N / width), ceil(K / 2), width, 2], pairs of k). Each output is the
    float32 sum of x[k] * weight[n, k] in order of k, then the bias (in bf16, rounded once to
    bf16 at the end): equal to F.linear up to summation order. Built for the few rows of a
    decode step (runtime/executor/cpu_dense.py says when it is used)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"native CPU kernels are not available: {_load_error}")
        if (weight.dim() != 2 or weight.dtype not in self.DTYPES or weight.device.type != "cpu"
                or weight.numel() == 0):
            raise ValueError(f"PanelLinear needs a non-empty float32 or bfloat16 CPU weight [N, K], got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        if bias is not None and (bias.dtype != self.dtype or bias.device.type != "cpu"
                                 or bias.shape != (self.out_features,)):
            raise ValueError(f"bias must be a {self.dtype} CPU vector of {self.out_features}, got "
                             f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
        self.width = lib.tl_panel_width()
        # bf16 on a CPU with AVX512-BF16: pairs of k side by side, [panels, ceil(K / 2), width, 2].
        self.pairs = self.dtype == torch.bfloat16 and bool(lib.tl_panel_bf16_pairs())
        k = self.in_features + (self.in_features % 2 if self.pairs else 0)
        padded = torch.zeros(-(-self.out_features // self.width) * self.width, k, dtype=self.dtype)
        padded[: self.out_features, : self.in_features] = weight.detach()
        # [panels, K, width]: each panel one contiguous stream of memory.
        if self.pairs:
            self.panels = padded.view(-1, self.width, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            self.panels = padded.view(-1, self.width, k).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self._linear = lib.tl_linear_panels if self.dtype == torch.float32 else lib.tl_linear_panels_bf16
        self._argmax = (lib.tl_linear_panels_argmax if self.dtype == torch.float32
                        else lib.tl_linear_panels_argmax_bf16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if x.dtype != self.dtype or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"PanelLinear takes {self.dtype} CPU input [..., {k}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=self.dtype)
        code = self._linear(
            rows.data_ptr(), rows.shape[0], k, rows.stride(0), self.panels.data_ptr(), self.out_features,
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), out.stride(0),
            pool_threads(), in_pool_step())
        if code:
            raise RuntimeError(f"native linear failed: {_ERRORS.get(code, code)}")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """`self(x).argmax(dim=-1)` of a CPU matrix x [rows, in_features] of the weight's dtype,
        rows at most ARGMAX_MAX_ROWS, without making the [rows, out_features] outputs: int64
        [rows], the first column of each row's maximum (the same sums as `self(x)`, in bf16
        rounded as its outputs are, so the same indices). None when a sum is NaN (torch would
        pick the first NaN: compute the outputs instead)."""
        k = self.in_features
        if (x.dtype != self.dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k
                or x.shape[0] > ARGMAX_MAX_ROWS):
            raise ValueError(f"PanelLinear.argmax takes {self.dtype} CPU input [<= {ARGMAX_MAX_ROWS}, {k}], got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        code = self._argmax(
            rows.data_ptr(), rows.shape[0], k, rows.stride(0), self.panels.data_ptr(), self.out_features,
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), pool_threads(),
            in_pool_step())
        if code == TL_NAN:
            return None
        if code:
            raise RuntimeError(f"native linear argmax failed: {_ERRORS.get(code, code)}")
        return out
