"""The torch reference (the CPU path) against float64 dense attention, and the dispatcher."""

from __future__ import annotations

import pytest
import torch

from tokenlane.kernels import api
from tokenlane.kernels.reference import paged_attention_ref, write_kv_cache_ref

CASES = {
    "decode": ([1, 15, 16, 17, 33], [1, 1, 1, 1, 1]),
    "prefill": ([1, 16, 37], [1, 16, 37]),
    "mixed": ([21, 1, 48, 9, 32], [5, 1, 1, 9, 16]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense(kcase, name, dtype, group):
    seq_lens, query_lens = CASES[name]
    case = kcase.build(seq_lens, query_lens, num_heads=2 * group, dtype=dtype, device="cpu")
    out = kcase.poisoned_out(case)
    paged_attention_ref(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.seq_lens, case.query_start_loc, case.scale, out)
    kcase.check(out, kcase.dense(case), kcase.REFERENCE_TOL[dtype], "reference vs dense")


def test_reference_write_then_read_roundtrip(kcase):
    """Writing a sequence's K/V by slot mapping, then attending, equals dense attention."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, head_dim, n = 16, 2, 64, 37
    k_cache = torch.zeros(8, block_size, heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([5, 0, 3], dtype=torch.int32)
    slots = blocks.long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    key = torch.randn(n, heads, head_dim, generator=gen)
    value = torch.randn(n, heads, head_dim, generator=gen)
    write_kv_cache_ref(key, value, k_cache, v_cache, slots)
    query = torch.randn(n, heads, head_dim, generator=gen)
    out = paged_attention_ref(query, k_cache, v_cache, blocks[None], torch.tensor([n]).int(),
                              torch.tensor([0, n]).int(), head_dim**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out, expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_backend_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TOKENLANE_ATTENTION_BACKEND", raising=False)
    # The C decode kernel where it builds (tests/kernels/test_cpu_native.py covers both).
    from tokenlane.kernels import cpu_native

    assert api.resolve_backend("auto", cpu) == ("native" if cpu_native.available() else "torch")
    assert api.resolve_backend("auto", cuda) == "triton"
    assert api.resolve_backend("torch", cuda) == "torch"
    monkeypatch.setenv("TOKENLANE_ATTENTION_BACKEND", "triton")
    assert api.resolve_backend("auto", cpu) == "triton"
    with pytest.raises(ValueError, match="attention backend"):
        api.resolve_backend("flash", cpu)
    monkeypatch.setenv("TOKENLANE_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TOKENLANE_ATTENTION_BACKEND"):
        api.resolve_backend("auto", cpu)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_entry_points_dispatch(kcase, backend):
    case = kcase.build([20, 3], [4, 1], device=kcase.DEVICE)
    out = api.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, case.query_start_loc, case.scale, backend=backend)
    kcase.check(out, kcase.dense(case), kcase.KERNEL_TOL[torch.float32], backend)
    key = torch.randn(2, 2, 64, device=kcase.DEVICE)
    slots = torch.tensor([0, 5], device=kcase.DEVICE)
    k_cache = torch.zeros(1, 16, 2, 64, device=kcase.DEVICE)
    v_cache = torch.zeros_like(k_cache)
    api.write_kv_cache(key, key, k_cache, v_cache, slots, backend=backend)
    assert torch.equal(k_cache[0, 5], key[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only set up without CUDA")
def test_env_forces_triton_on_cpu(kcase, monkeypatch):
    monkeypatch.setenv("TOKENLANE_ATTENTION_BACKEND", "triton")
    calls = []
    import tokenlane.kernels.triton_kernels as tk

    real = tk.paged_attention_triton
    monkeypatch.setattr(tk, "paged_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    case = kcase.build([5], [1], device="cpu")
    api.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.seq_lens, case.query_start_loc, case.scale)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_fast_path_matches_dense(kcase, name, dtype):
    """kernels/cpu_attention.py (what `backend="torch"` runs on the CPU) against float64."""
    from tokenlane.kernels.cpu_attention import paged_attention_cpu

    seq_lens, query_lens = CASES[name]
    case = kcase.build(seq_lens, query_lens, num_heads=8, dtype=dtype, device="cpu")
    out = kcase.poisoned_out(case)
    paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.block_tables,
                        case.seq_lens, case.query_start_loc, case.scale, out)
    kcase.check(out, kcase.dense(case), kcase.REFERENCE_TOL[dtype], "cpu path vs dense")
