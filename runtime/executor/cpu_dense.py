"""How the dense layers run on the CPU: the compute dtype, oneDNN-prepacked and panel linears.

Compute dtype. A CPU without native bf16/fp16 matrix instructions (AVX512-BF16 or AMX for
bf16, AMX-FP16 for fp16) converts every operand on the fly: on an AVX2 host a bf16 GEMM runs
at about a fifth of the float32 rate (docs/configuration.md, `engine.cpuComputeDtype`). There
the weights are kept and multiplied in float32, while the KV cache keeps the model dtype (half
the cache memory, and attention upcasts it anyway). Weights are first rounded to the model
dtype, so a bf16 model keeps bf16 weights, only the arithmetic is wider.

Prepacked linears. MKL's sgemm behind `F.linear` is slow for the short, wide products of a
decode step ([8..64 rows] x [hidden x out]); oneDNN with the weight reordered once at load
into its blocked layout runs them 1.2-3x faster (AVX2 host, 2 threads: the LM head
[32 x 512] x [512 x 32000] 30 -> 72 GF/s, a gate/up projection [32 x 512] x [512 x 2752]
44 -> 79 GF/s) and prefill-sized products no slower. The per-layer linears of at least 2^18
elements keep only the packed copy (no second copy of the weights in memory; a single row
measured within 10% of MKL for weights larger than the caches). Smaller float32 ones (from
2^16 elements: the projections of a model with a hidden size of a few hundred) keep both and
pick by batch: on two threads MKL multiplied 16-56 rows 1.3-3x slower than oneDNN (2-core Xeon,
[16 x 256] x [256 x 512]: 92 against 43 us; [16 x 688] x [688 x 256]: 127 against 47 us), but
1-12 rows 2-3x faster (a oneDNN call costs about 30 us there) and 64 rows or more 1.1-1.7x
faster, so only batches of `PACKED_ROWS` rows go to oneDNN. The LM head keeps its dense
weight too (for a tied head it is the embedding table, shared), but multiplies packed as well,
single rows included: on a 2-core Zen 4, MKL's matrix-vector product of one row with a
[32000 x 256] float32 head took 5.3 ms against 0.9 ms packed (1.3-2.7x for hidden sizes
512-4096), and a one-sequence decode step of the 19M model 10-12 ms against 5.3-6.1 ms.

Panels. A float32 weight of at most PANEL_MAX_IN_FEATURES input features (the hidden sizes of
the smallest models) also gets a copy packed into panels for the native kernel
(kernels/cpu_native.py's PanelLinear), and batches of `panel_rows()` rows (decode steps)
multiply it: 1-96 rows in an AVX-512 build and in an AVX2 one. It keeps a pass's sums in
registers and fetches a panel's weights while multiplying the one before, where oneDNN's first
pass over each block waits for memory: decode steps of the 19M test model ran 1.15-1.17x (16
sequences) and 1.06-1.08x (64) faster, of the 44M model of bench/engine_vs_hf (its down
projection, 1376 inputs, left on oneDNN) 1.06x and 1.11x (2-core Xeon, AVX-512, whole engine
steps with the two forms alternated in one engine). From 128 rows oneDNN is as fast, and from a
few hundred faster (no blocking for the caches). With wider inputs the gain goes: 896-1536 input
features, 0.9-1.2x of oneDNN's speed at 1-96 rows (weights cold), 4096 features 0.6-0.75x; so
only inputs of at most 768 features get panels, which also bounds the memory the copies cost. An
AVX2 build (three rows by four 8-float vectors a pass, oneDNN and MKL limited to AVX2 too, same
host) was 1.1-1.5x faster at 1-16 rows, 0.7-0.9x at 32-96 for the 44M model's layers, product by
product; served, a decode step of 17-96 sequences on panels is a pool step instead of one on
torch's OpenMP team, and that won over the loss (docs/benchmarks.md, "AVX2 panel rows"), so AVX2
builds take 1-96 rows too. Where the dense weight is held (the small weights, the LM head), the
other batches go to it (MKL) and there is no oneDNN copy, so the memory is as before; the larger
per-layer weights keep oneDNN's copy for prefill, so those are held twice (up to twice the
per-layer weight memory of these small models: for a hidden size of 768 and 12 layers, about 340
MB more in float32). Weights too small to prepack (below 2^16 elements: a 192-wide model's qkv
and o projections) get panels as well, beside their dense weight: a decode step is a pool step
(kernels/cpu_native.py) only when every linear of the model has panels, and a model with one
such projection otherwise ran every decode step on torch's OpenMP team, whose barrier waits for
a thread the server's own work preempted (docs/benchmarks.md, "Small weights on panels").

bfloat16 weights are prepacked too where the CPU multiplies bf16 natively (AVX512-BF16 or
AMX: where `cpuComputeDtype: auto` keeps bf16). `F.linear` in bf16 already goes to oneDNN
there, but reorders the weight on every call; the packed weight gives the same products
without it, single rows included (bitwise on a 2-core Zen 4 with AVX512-BF16; a CPU with AMX
may block them otherwise). There the 19M model's projections ran 1.1-1.8x and its LM head
[16 x 256] x [256 x 32000] 2.2x (64 rows: 1.3x) faster packed, so bf16 weights are packed
from 2^16 elements.

bf16 panels. Where the build has AVX512-BF16, bf16 weights of at most
PANEL_MAX_IN_FEATURES_BF16 inputs also get panels, holding pairs of k side by side so that one
instruction (vdpbf16ps) adds two products to 16 sums, and decode batches of `panel_rows()` rows
multiply them; the other batches keep oneDNN's packed copy. On a 2-core Zen 4 they ran 1.0-2.0x
oneDNN's packed bf16 at 1-96 rows for every projection and the head of the 19M model, and
0.96-1.7x for 44M-sized ones ([1376 x 512], [512 x 1376], [32000 x 512]; the most at 32 rows
and fewer), and a whole bf16 decode step of the 19M model 1.30x (1 sequence), 1.26x (4), 1.22x
(16) and 1.14x (64) faster, alternated in one process. Without AVX512-BF16 a bf16 panel is
widened to float32 as it is read, which lost to oneDNN from 16 rows: such builds give bf16
weights no panels (and there `cpuComputeDtype: auto` computes in float32 anyway). The per-layer
weights keep oneDNN's copy for prefill beside the panels, so those with panels are held twice;
the input limit bounds that (hidden size 1024, intermediate 2816, 24 layers: the projections
but the down one, about 0.4 GB more), and keeps the 44M model's down projection (1376 inputs,
1.0-1.7x) on oneDNN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenlane.kernels import cpu_native
from tokenlane.runtime.config import CPU_COMPUTE_DTYPES

# Weights with at least this many elements (1 MiB in float32) get a oneDNN-prepacked copy.
PREPACK_MIN_ELEMENTS = 1 << 18
# float32 weights from this many elements up to PREPACK_MIN_ELEMENTS get one too, next to their
# dense weight, which multiplies the batches whose row count is outside PACKED_ROWS (see above).
SMALL_PREPACK_MIN_ELEMENTS = 1 << 16
PACKED_ROWS = range(16, 64)
# bf16 weights from a quarter of that: F.linear reorders a bf16 weight on every call, so even
# a [256 x 256] projection ran 1.1-1.3x faster packed (AVX512-BF16 host, 1-256 rows).
PREPACK_MIN_ELEMENTS_BF16 = 1 << 16
# The row count oneDNN is told to expect when it picks the packed layout (a decode batch).
PREPACK_ROWS_HINT = 64
# float32 weights of at most this many input features also get a panel copy (see above), and
# batches of `panel_rows()` rows multiply it: by the build's panel width (AVX-512: 64; AVX2: 32).
PANEL_MAX_IN_FEATURES = 768
PANEL_ROWS_BY_WIDTH = {64: range(1, 97), 32: range(1, 97)}
# bf16 weights get panels where the build multiplies bf16 pairs natively (AVX512-BF16), up to
# this many input features (the copy's memory: see the docstring).
PANEL_MAX_IN_FEATURES_BF16 = 1024


@dataclass(frozen=True)
class CpuMatmulSupport:
    """Which low-precision matmuls this CPU runs natively (not by converting to float32)."""

    bfloat16: bool
    float16: bool


def _probe(check: Optional[Callable[[], bool]]) -> bool:
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def detect_cpu_matmul_support() -> CpuMatmulSupport:
    """torch's view of the host CPU: AVX512-BF16 or AMX tiles for bf16, AMX-FP16 for fp16."""
    cpu = torch.cpu
    amx = _probe(getattr(cpu, "_is_amx_tile_supported", None))
    avx512_bf16 = _probe(getattr(cpu, "_is_avx512_bf16_supported", None))
    amx_fp16 = _probe(getattr(cpu, "_is_amx_fp16_supported", None))
    return CpuMatmulSupport(bfloat16=amx or avx512_bf16, float16=amx_fp16)


def has_native_matmul(dtype: torch.dtype, support: CpuMatmulSupport) -> bool:
    if dtype == torch.bfloat16:
        return support.bfloat16
    if dtype == torch.float16:
        return support.float16
    return True  # float32 is every CPU's native matmul


def select_compute_dtype(
    policy: str,
    model_dtype: torch.dtype,
    device: torch.device,
    support: Optional[CpuMatmulSupport] = None,
) -> torch.dtype:
    """The dtype the dense layers compute in; the KV cache always keeps `model_dtype`.

    policy: `model` = the model dtype; `float32` = float32 on the CPU; `auto` = float32 on
    the CPU exactly when it lacks a native matmul for the model dtype. GPUs always compute in
    the model dtype. `support` is detected when not given (tests inject it).
    """
    if policy not in CPU_COMPUTE_DTYPES:
        raise ValueError(f"engine.cpuComputeDtype must be one of {CPU_COMPUTE_DTYPES}, got {policy!r}")
    if torch.device(device).type != "cpu" or policy == "model" or model_dtype == torch.float32:
        return model_dtype
    if policy == "float32":
        return torch.float32
    if support is None:
        support = detect_cpu_matmul_support()
    return model_dtype if has_native_matmul(model_dtype, support) else torch.float32


def prepack_dtypes(support: Optional[CpuMatmulSupport] = None) -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN prepacking applies to on this CPU: float32 always, bfloat16
    where the CPU multiplies it natively (elsewhere oneDNN would convert it on every call).
    `support` is detected when not given (tests inject it)."""
    if support is None:
        support = detect_cpu_matmul_support()
    return (torch.float32, torch.bfloat16) if support.bfloat16 else (torch.float32,)


def can_prepack(weight: torch.Tensor, support: Optional[CpuMatmulSupport] = None) -> bool:
    """oneDNN prepacking applies to CPU weights of a dtype in `prepack_dtypes` with at least
    SMALL_PREPACK_MIN_ELEMENTS (float32) or PREPACK_MIN_ELEMENTS_BF16 (bf16) elements, when
    torch has oneDNN."""
    minimum = PREPACK_MIN_ELEMENTS_BF16 if weight.dtype == torch.bfloat16 else SMALL_PREPACK_MIN_ELEMENTS
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() >= minimum
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and weight.dtype in prepack_dtypes(support)
    )


class PrepackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` with the weight prepared once, in up to three forms picked
    by the batch's row count: the panel copy (`panel_rows`, kernels/cpu_native.py's
    PanelLinear), else oneDNN's packed copy (`packed_rows`; all rows when None), else the dense
    weight (F.linear, MKL).

    `keep_dense`: hold the dense weight too (shared, not copied: for a tied LM head it is the
    embedding table). Without it (the per-layer linears) `weight` is None. oneDNN's copy is
    made unless there are panels and a dense weight for the other batches to go to.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, keep_dense: bool = True,
                 packed_rows: Optional[range] = None, panel_rows: Optional[range] = None):
        super().__init__()
        assert weight.dim() == 2 and weight.device.type == "cpu", "PrepackedLinear needs a 2-D CPU weight"
        assert keep_dense or packed_rows is None, "multiplying dense needs the dense weight"
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed_rows = packed_rows
        self.panel_rows = panel_rows
        # Opaque copies: plain attributes, not parameters (no state_dict entries).
        self.panels = None if panel_rows is None else cpu_native.PanelLinear(weight, bias)
        self.packed = None
        # bf16 keeps oneDNN's copy for the other batches even with a dense weight: F.linear in
        # bf16 would reorder the weight on every call.
        if self.panels is None or not keep_dense or weight.dtype == torch.bfloat16:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_ROWS_HINT)
        if keep_dense:
            self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.panels is not None and rows in self.panel_rows:
            return self.panels(x)
        if self.packed is None or (self.packed_rows is not None and rows not in self.packed_rows):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def argmax(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """`self(x).argmax(dim=-1)` (int64 [rows]) without the [rows, out_features] outputs,
        where the panel copy serves these rows: the same sums, so the same indices. None where
        it does not (other row counts or dtypes), and for a NaN among the sums."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if (self.panels is None or rows not in self.panel_rows or rows > cpu_native.ARGMAX_MAX_ROWS
                or x.dtype != self.panels.dtype):
            return None
        return self.panels.argmax(x)

    def extra_repr(self) -> str:
        def rows(r: Optional[range], default: str) -> str:
            return default if r is None else f"{r.start}-{r.stop - 1}"

        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dense_copy={self.weight is not None}, "
                f"panel_rows={rows(self.panel_rows, 'none')}, "
                f"packed_rows={'none' if self.packed is None else rows(self.packed_rows, 'all')}")


def panel_rows() -> Optional[range]:
    """The row counts that multiply panel copies in this build, or None (no native kernels,
    or a panel width without measurements)."""
    return PANEL_ROWS_BY_WIDTH.get(cpu_native.panel_width())


def can_use_panels(weight: torch.Tensor) -> bool:
    """Whether a decode batch multiplies `weight` through a panel copy, where the native
    kernels are built: a float32 weight of at most PANEL_MAX_IN_FEATURES input features, or a
    bf16 one of at most PANEL_MAX_IN_FEATURES_BF16 where the build multiplies bf16 natively."""
    if weight.dim() != 2 or panel_rows() is None:
        return False
    if weight.dtype == torch.float32:
        return weight.shape[1] <= PANEL_MAX_IN_FEATURES
    return (weight.dtype == torch.bfloat16 and weight.shape[1] <= PANEL_MAX_IN_FEATURES_BF16
            and cpu_native.panel_bf16_pairs())


def _can_hold_small_panels(weight: torch.Tensor, support: Optional[CpuMatmulSupport]) -> bool:
    """A weight below the prepacking sizes with panels multiplies its other batches dense
    (float32), or through oneDNN's copy (bf16, which F.linear would reorder on every call)."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return True
    return (weight.dtype in prepack_dtypes(support) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack_linear(
    linear: nn.Linear, *, keep_dense: bool = True, support: Optional[CpuMatmulSupport] = None
) -> nn.Module:
    """`linear` itself when neither prepacking nor panels apply, else its prepacked replacement.
    A float32 weight below PREPACK_MIN_ELEMENTS keeps its dense copy too (for batches outside
    PACKED_ROWS, or outside `panel_rows()` where it has panels). A weight too small to prepack
    still gets panels where it can: a model whose every linear has panels runs its decode steps
    as pool steps (see the docstring)."""
    bias = None if linear.bias is None else linear.bias.detach()
    rows = panel_rows() if can_use_panels(linear.weight) else None
    if not can_prepack(linear.weight, support):
        if rows is None or not _can_hold_small_panels(linear.weight, support):
            return linear
        return PrepackedLinear(linear.weight, bias, keep_dense=True, panel_rows=rows)
    if linear.weight.dtype == torch.float32 and linear.weight.numel() < PREPACK_MIN_ELEMENTS:
        return PrepackedLinear(linear.weight, bias, keep_dense=True,
                               packed_rows=None if rows else PACKED_ROWS, panel_rows=rows)
    return PrepackedLinear(linear.weight, bias, keep_dense=keep_dense, panel_rows=rows)


__all__ = [
    "CPU_COMPUTE_DTYPES",
    "CpuMatmulSupport",
    "PrepackedLinear",
    "can_prepack",
    "can_use_panels",
    "panel_rows",
    "detect_cpu_matmul_support",
    "has_native_matmul",
    "prepack_dtypes",
    "prepack_linear",
    "select_compute_dtype",
]
