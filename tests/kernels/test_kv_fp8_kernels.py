"""fp8 KV caches (float8_e4m3fn / float8_e5m2 with per-layer scales) in every kernel path.

The write quantizes (value / scale, saturated, nearest even) exactly as kernels/reference.py's
`quantize_kv`; attention dequantizes (stored * scale) inside the kernels. Triton runs in its
interpreter on the CPU (conftest.py); the CPU paths are the torch path and the C kernels (their
fp8 bytes read through a 256-entry table per format, the scales folded out of the loops)."""

from __future__ import annotations

import pytest
import torch

from tokenlane.kernels import api, cpu_native
from tokenlane.kernels.cpu_attention import paged_attention_cpu
from tokenlane.kernels.reference import dequantize_kv, paged_attention_ref, quantize_kv, write_kv_cache_ref
from tokenlane.kernels.triton_kernels import paged_attention_triton, write_kv_cache_triton

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
needs_native = pytest.mark.skipif(not cpu_native.available(),
                                  reason=f"no native library here: {cpu_native.load_error()}")
# The native tests run on every prebuilt level this CPU runs (tests/conftest.py, native_levels).
every_level = pytest.mark.usefixtures("native_level")
# Keys of magnitude ~K_MAG and values of ~V_MAG: e4m3 would saturate the keys (448) and flush
# the values without their scales.
K_MAG, V_MAG = 2000.0, 1e-4


def _scales(dtype):
    fmax = torch.finfo(dtype).max
    return 4 * K_MAG / fmax, 4 * V_MAG / fmax


def fp8_case(kcase, dtype, seq_lens, query_lens, **kw):
    """kcase.build's batch with K x K_MAG and V x V_MAG, quantized (unowned blocks stay NaN);
    the softmax scale / K_MAG keeps the scores those of the unscaled keys."""
    case = kcase.build(seq_lens, query_lens, **kw)
    case.scale /= K_MAG
    case.k_scale, case.v_scale = _scales(dtype)
    case.key_cache = quantize_kv(case.key_cache * K_MAG, dtype, case.k_scale)
    case.value_cache = quantize_kv(case.value_cache * V_MAG, dtype, case.v_scale)
    return case


def _reference(case):
    return paged_attention_ref(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               case.query_start_loc, case.scale, k_scale=case.k_scale, v_scale=case.v_scale)


def _check(out, ref, rel=1e-4):
    assert not torch.isnan(out).any(), "unwritten (NaN) output or a poisoned block read"
    torch.testing.assert_close(out.cpu().double(), ref.cpu().double(), rtol=rel, atol=rel * V_MAG)


# --------------------------------------------------------------------------- the write


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,block_size", [(2, 64, 16), (3, 96, 4)])
def test_triton_write_matches_the_reference_bitwise(kcase, dtype, src_dtype, heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 29
    key = (torch.randn(tokens, heads, head_dim, generator=gen) * K_MAG).to(src_dtype)
    value = (torch.randn(tokens, heads, head_dim, generator=gen) * V_MAG).to(src_dtype)
    # Saturation both ways, zero, values far below the smallest subnormal, ties.
    key[0, 0, :6] = torch.tensor([1e30, -1e30, 0.0, 1e-30, 3 * K_MAG, -7 * K_MAG])
    k_scale, v_scale = _scales(dtype)
    key[1, 0, :4] = torch.tensor([1.125, 1.375, 0.0185546875, 0.0029296875]) * k_scale  # fp8 ties
    num_blocks = 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[5] = -1
    caches = [torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype, device=kcase.DEVICE)
              for _ in range(4)]
    write_kv_cache_triton(key.to(kcase.DEVICE), value.to(kcase.DEVICE), caches[0], caches[1],
                          slots.to(kcase.DEVICE), k_scale, v_scale)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))
    stored = dequantize_kv(caches[2], k_scale).view(-1, heads, head_dim)
    fmax = torch.finfo(dtype).max
    assert stored[slots[0], 0, :2].tolist() == [fmax * k_scale, -fmax * k_scale]  # saturated, not inf
    assert torch.isfinite(dequantize_kv(caches[0].cpu(), k_scale)).all()


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_torch_write_matches_the_reference(dtype):
    check_cpu_write(dtype, "torch")


@needs_native
@every_level
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_native_write_matches_the_reference(dtype):
    check_cpu_write(dtype, "native")


def check_cpu_write(dtype, backend):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(11, 2, 32, generator=gen) * K_MAG
    value = torch.randn(11, 2, 32, generator=gen) * V_MAG
    slots = torch.arange(11) * 3
    k_scale, v_scale = _scales(dtype)
    got = [torch.zeros(4, 16, 2, 32, dtype=dtype) for _ in range(2)]
    want = [torch.zeros(4, 16, 2, 32, dtype=dtype) for _ in range(2)]
    api.write_kv_cache(key, value, *got, slots, backend=backend, k_scale=k_scale, v_scale=v_scale)
    write_kv_cache_ref(key, value, *want, slots, k_scale, v_scale)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    qkv = torch.randn(11, (4 + 4) * 32)
    cos = sin = torch.ones(11, 32)
    assert not api.rope_write_kv(qkv, 4, 2, cos, sin, *got, slots, backend=backend)  # the caller's torch path


# --------------------------------------------------------------------------- attention


SCENARIOS = {
    "decode": ([1, 15, 16, 17, 33], [1, 1, 1, 1, 1]),
    "mixed": ([21, 1, 48, 9, 32], [5, 1, 1, 9, 16]),
}


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_attention_matches_the_reference(kcase, dtype, block_size, group):
    seq_lens, query_lens = SCENARIOS["mixed"]
    case = fp8_case(kcase, dtype, seq_lens, query_lens, num_heads=2 * group, num_kv_heads=2,
                    block_size=block_size, seed=block_size + group)
    out = kcase.poisoned_out(case)
    paged_attention_triton(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                           case.query_start_loc, case.scale, out, k_scale=case.k_scale, v_scale=case.v_scale)
    _check(out, _reference(case))


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_low_precision_queries_and_splits(kcase, dtype, query_dtype, num_splits):
    seq_lens, query_lens = SCENARIOS["decode"]
    case = fp8_case(kcase, dtype, seq_lens, query_lens, seed=num_splits)
    case.query = case.query.to(query_dtype)
    out = kcase.poisoned_out(case)
    paged_attention_triton(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                           case.query_start_loc, case.scale, out, num_splits=num_splits,
                           k_scale=case.k_scale, v_scale=case.v_scale)
    assert out.dtype == query_dtype
    _check(out, _reference(case), rel=2e-2)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("path", ["grouped", "per-sequence"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [32, 40])
def test_cpu_attention_matches_the_reference(kcase, dtype, path, group, head_dim):
    check_cpu_attention(kcase, dtype, path, group, head_dim)


@every_level
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [32, 40])  # 40: the C kernels' generic decode, torch prefill
def test_native_attention_matches_the_reference(kcase, dtype, group, head_dim):
    if not cpu_native.reads_cache_dtype(dtype):
        pytest.skip(f"the native kernels do not read {dtype} caches here: {cpu_native.load_error()}")
    check_cpu_attention(kcase, dtype, "native", group, head_dim)


def check_cpu_attention(kcase, dtype, path, group, head_dim):
    seq_lens, query_lens = SCENARIOS["mixed"]
    case = fp8_case(kcase, dtype, seq_lens + [7, 30], query_lens + [1, 1], num_heads=2 * group,
                    num_kv_heads=2, head_dim=head_dim, block_size=16, seed=group, device=torch.device("cpu"))
    out = kcase.poisoned_out(case)
    paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        case.query_start_loc, case.scale, out, batch_decodes=path != "per-sequence",
                        native=path == "native", k_scale=case.k_scale, v_scale=case.v_scale)
    _check(out, _reference(case))


def test_fp8_attention_stays_close_to_unquantized_attention(kcase):
    """The scales put both tensors well inside e4m3's range: the result is the float32 one up to
    e4m3's rounding (relative 2^-4 per element, averaged down by the softmax)."""
    case = kcase.build(*SCENARIOS["mixed"], device=torch.device("cpu"), seed=3)
    exact = paged_attention_ref(case.query, case.key_cache * K_MAG, case.value_cache * V_MAG, case.block_tables,
                                case.seq_lens, case.query_start_loc, case.scale / K_MAG)
    quant = fp8_case(kcase, torch.float8_e4m3fn, *SCENARIOS["mixed"], device=torch.device("cpu"), seed=3)
    got = _reference(quant)
    error = (got - exact).abs() / V_MAG
    assert error.max() < 0.25 and error.mean() < 0.02, (error.max(), error.mean())


# --------------------------------------------------------------------------- bad input


def test_bad_scales_and_dtypes_are_refused(kcase):
    case = fp8_case(kcase, torch.float8_e4m3fn, [5], [1], seed=9)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.query_start_loc,
            case.scale)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
            paged_attention_triton(*args, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
            paged_attention_ref(*args, v_scale=bad)
    with pytest.raises(ValueError, match="query dtype must be one of"):
        paged_attention_triton(case.query.to(torch.float8_e4m3fn), *args[1:])
    with pytest.raises(ValueError, match="KV cache dtype must be one of .* the same for K and V"):
        paged_attention_triton(case.query, case.key_cache, case.value_cache.view(torch.float8_e5m2), *args[3:])
    plain = kcase.build([5], [1], seed=9)
    with pytest.raises(ValueError, match="k_scale applies to fp8 caches only"):
        paged_attention_triton(plain.query, plain.key_cache, plain.value_cache, plain.block_tables,
                               plain.seq_lens, plain.query_start_loc, plain.scale, k_scale=2.0)
    with pytest.raises(ValueError, match="v_scale applies to fp8 caches only"):
        api.write_kv_cache(plain.query[:, :2].cpu(), plain.query[:, :2].cpu(), plain.key_cache.cpu(),
                           plain.value_cache.cpu(), torch.zeros(1, dtype=torch.int64), backend="torch", v_scale=0.5)


@every_level
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("head_dim", [32, 40])  # the vector path (in registers) and the generic one (a table)
def test_native_decode_widens_every_fp8_byte_exactly(dtype, head_dim):
    """Decodes of one token each: the softmax weight is 1, so the output is the V row itself.
    The V rows hold all 256 byte values (NaN and inf included) once."""
    if not cpu_native.reads_cache_dtype(dtype):
        pytest.skip(f"the native kernels do not read {dtype} caches here: {cpu_native.load_error()}")
    n = -(-256 // head_dim)
    values = torch.arange(n * head_dim) % 256
    value_cache = values.to(torch.uint8).view(n, 1, 1, head_dim).view(dtype)
    key_cache = torch.zeros_like(value_cache)
    out = torch.full((n, 1, head_dim), float("nan"))
    paged_attention_cpu(torch.ones(n, 1, head_dim), key_cache, value_cache,
                        torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32),
                        torch.arange(n + 1, dtype=torch.int32), 1.0, out, native=True)
    expected = value_cache.float().view(n, 1, head_dim)
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])


def test_a_native_library_without_fp8_falls_back_to_the_torch_path(kcase, monkeypatch, caplog):
    from tokenlane.kernels import cpu_attention

    monkeypatch.setattr(cpu_native, "reads_cache_dtype", lambda dtype: False)
    monkeypatch.setattr(cpu_attention, "_fp8_fallback_logged", False)
    caplog.set_level("INFO", logger="tokenlane.kernels")
    case = fp8_case(kcase, torch.float8_e5m2, *SCENARIOS["mixed"], device=torch.device("cpu"), seed=4)
    out = kcase.poisoned_out(case)
    paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                        case.query_start_loc, case.scale, out, native=True, k_scale=case.k_scale,
                        v_scale=case.v_scale)
    _check(out, _reference(case))
    assert any("torch path" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- the engine


# e5m2 through the engine in the slow run: both formats' kernels are checked against the
# reference above, and one engine run through the interpreter costs about 15 s.
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_the_engine_generates_through_the_triton_kernels(tiny_model_dir, kv_cache_dtype, monkeypatch):
    """Chunked prefills over cached fp8 context and decodes, through the Triton kernels (the
    interpreter on the CPU): every request completes and no block leaks; the calibrated scales
    of layer 0 (its K/V come from the embeddings alone) equal the torch path's."""
    import tokenlane.kernels.triton_kernels as tk
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
    from tokenlane.runtime.core.request import Request, SamplingParams
    from tokenlane.runtime.engine.llm_engine import LLMEngine

    calls = []
    real_attention = tk.paged_attention_triton

    def counted(*args, **kwargs):
        calls.append(kwargs.get("k_scale"))
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(tk, "paged_attention_triton", counted)
    scales = {}
    for backend in ("triton", "torch"):
        config = RuntimeConfig(
            model=ModelConfig(path=str(tiny_model_dir), dtype="float32", max_model_len=256),
            engine=EngineConfig(kv_cache_blocks=32, block_size=16, device=str(kcase_device()),
                                attention_backend=backend, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_batched_tokens=16, prefill_chunk_size=8, max_active_sequences=4),
        )
        engine = LLMEngine.from_config(config)
        requests = [Request(f"r{i}", [5 + (13 * i + 7 * j) % 900 for j in range(n)],
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                    for i, n in enumerate((19, 3, 33))]
        for request in requests:
            engine.add_request(request)
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert all(len(r.output_token_ids) == 4 for r in requests)
        assert engine.scheduler.kv.num_free_blocks == engine.executor.num_kv_blocks
        scales[backend] = engine.executor.kv_scales
        if backend == "triton":  # after the calibration pass (scale 1), the fp8 scales reach the kernel
            layers = len(engine.executor.kv_caches)
            assert len(calls) > layers and all(k not in (None, 1.0) for k in calls[layers:])
    assert scales["triton"][0] == scales["torch"][0]


def kcase_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
