"""The CPU's dense path (runtime/executor/cpu_dense.py): the compute-dtype policy and the prepared
linears (oneDNN's packed copy, the native panel copy), each against its plain-torch
counterpart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenlane.kernels import cpu_native
from tokenlane.runtime.executor import cpu_dense
from tokenlane.runtime.config import ConfigError, EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.executor.cpu_dense import (
    CpuMatmulSupport,
    PrepackedLinear,
    can_prepack,
    prepack_linear,
    select_compute_dtype,
)
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.executor.llama import AttentionMetadata, CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from test_model_vs_hf import assert_matches_hf, engine_requests, run_engine  # noqa: E402

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)

# The tests of the native panels run on every prebuilt level this CPU runs (tests/conftest.py,
# native_levels): an AVX-512 host also runs the AVX2 build's 32-column panels.
every_level = pytest.mark.usefixtures("native_level")

AVX2 = CpuMatmulSupport(bfloat16=False, float16=False)
AVX512_BF16 = CpuMatmulSupport(bfloat16=True, float16=False)
AMX_FP16 = CpuMatmulSupport(bfloat16=True, float16=True)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ------------------------------------------------------------------ compute dtype policy


@pytest.mark.parametrize(
    "policy, model_dtype, device, support, expected",
    [
        # auto: float32 exactly when the CPU has no native matmul for the model dtype
        ("auto", BF16, "cpu", AVX2, FP32),
        ("auto", FP16, "cpu", AVX2, FP32),
        ("auto", BF16, "cpu", AVX512_BF16, BF16),
        ("auto", FP16, "cpu", AVX512_BF16, FP32),
        ("auto", FP16, "cpu", AMX_FP16, FP16),
        ("auto", FP32, "cpu", AVX2, FP32),
        # explicit policies
        ("model", BF16, "cpu", AVX2, BF16),
        ("model", FP16, "cpu", AVX2, FP16),
        ("float32", BF16, "cpu", AVX512_BF16, FP32),
        ("float32", FP32, "cpu", AVX2, FP32),
        # GPUs always compute in the model dtype
        ("auto", BF16, "cuda", AVX2, BF16),
        ("float32", FP16, "cuda", AVX2, FP16),
    ],
)
def test_select_compute_dtype(policy, model_dtype, device, support, expected):
    assert select_compute_dtype(policy, model_dtype, torch.device(device), support) == expected


def test_select_compute_dtype_rejects_unknown_policy():
    with pytest.raises(ValueError, match="cpuComputeDtype must be one of .*'bf16'"):
        select_compute_dtype("bf16", BF16, torch.device("cpu"), AVX2)


def test_engine_config_validates_cpu_compute_dtype():
    assert EngineConfig().cpu_compute_dtype == "auto"
    with pytest.raises(ConfigError, match="cpuComputeDtype: must be one of"):
        EngineConfig(cpu_compute_dtype="half")


@pytest.mark.parametrize("policy", ["float32", "model"])
def test_executor_keeps_the_cache_in_the_model_dtype(tiny_model_dir, policy):
    config = RuntimeConfig(
        model=ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"),
        engine=EngineConfig(kv_cache_blocks=16, block_size=4, device="cpu", cpu_compute_dtype=policy),
    )
    ex = ModelExecutor(config)
    expected = FP32 if policy == "float32" else BF16
    assert ex.compute_dtype == expected
    assert all(p.dtype == expected for p in ex.model.parameters())
    assert ex.kv_caches[0][0].dtype == BF16 and ex.kv_caches[0][1].dtype == BF16
    # float32 compute keeps the bf16 model's weights: every one is a bf16 value.
    for param in ex.model.parameters():
        assert torch.equal(param, param.to(BF16).to(param.dtype))


def test_float32_compute_over_a_bf16_cache_runs_the_engine(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cpu_dense, "detect_cpu_matmul_support", lambda: AVX2)  # auto -> float32
    reqs = engine_requests(4, 1024, seed=16, max_new=(5, 8))
    engine = run_engine(tiny_model_dir, reqs, dtype="bfloat16")
    assert engine.executor.compute_dtype == FP32
    assert engine.executor.kv_caches[0][0].dtype == BF16
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)


# ------------------------------------------------------------------ the prepacked LM head


needs_native_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and cpu_dense.detect_cpu_matmul_support().bfloat16),
    reason="this CPU has no native bf16 matmul (AVX512-BF16 or AMX), where bf16 weights are not prepacked",
)


@needs_native_bf16
def test_a_large_bf16_weight_is_prepacked_where_the_cpu_multiplies_bf16():
    large_bf16 = nn.Linear(512, 4096, bias=False, dtype=BF16)
    assert isinstance(prepack_linear(large_bf16, support=cpu_dense.detect_cpu_matmul_support()), PrepackedLinear)


def _head_weight(out_features=4096, in_features=512):
    torch.manual_seed(0)
    return torch.randn(out_features, in_features) * 0.05


@needs_onednn
@pytest.mark.parametrize("shape", [(0, 512), (1, 512), (2, 512), (16, 512), (64, 512), (3, 5, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("keep_dense", [True, False])
def test_prepacked_linear_matches_f_linear(shape, with_bias, keep_dense):
    weight = _head_weight()
    bias = torch.randn(weight.shape[0]) if with_bias else None
    layer = PrepackedLinear(weight, bias, keep_dense=keep_dense)
    assert (layer.weight is None) != keep_dense  # the dense copy is held only when asked for
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, weight, bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prepack_applies_to_large_weights_of_natively_multiplied_dtypes(monkeypatch):
    assert can_prepack(_head_weight()) == torch.backends.mkldnn.is_available()
    small = nn.Linear(64, 128, bias=False)
    assert not can_prepack(small.weight)
    monkeypatch.setattr(cpu_dense, "PANEL_MAX_IN_FEATURES", 0)  # panels: the next tests
    assert prepack_linear(small) is small
    large_bf16 = nn.Linear(512, 4096, bias=False, dtype=BF16)
    large_fp16 = nn.Linear(512, 4096, bias=False, dtype=FP16)
    # bf16 only where the CPU multiplies it natively (else oneDNN converts it every call).
    assert prepack_linear(large_bf16, support=AVX2) is large_bf16
    assert prepack_linear(large_fp16, support=AMX_FP16) is large_fp16
    assert cpu_dense.prepack_dtypes(AVX2) == (FP32,)
    assert cpu_dense.prepack_dtypes(AVX512_BF16) == (FP32, BF16)
    if torch.backends.mkldnn.is_available():
        # The decision only: packing a bf16 weight for real needs a CPU that multiplies bf16
        # natively (oneDNN refuses on an AVX2-only host); that is the next test.
        assert can_prepack(large_bf16.weight, AVX512_BF16)
        # bf16 from 2^16 elements (F.linear reorders a bf16 weight on every call).
        projection = nn.Linear(256, 256, bias=False, dtype=BF16)
        assert can_prepack(projection.weight, AVX512_BF16)
        assert not can_prepack(nn.Linear(256, 128, dtype=BF16).weight, AVX512_BF16)
        assert not can_prepack(nn.Linear(256, 128).weight, AVX2)


@needs_onednn
def test_float32_linears_without_panels_keep_the_oneDNN_policy(monkeypatch):
    """Where no weight gets panels (no native kernels, or inputs wider than
    PANEL_MAX_IN_FEATURES): float32 from 2^16 elements keeps the dense weight for batches
    outside PACKED_ROWS; from 2^18 the per-layer linears keep only the packed copy."""
    monkeypatch.setattr(cpu_dense, "PANEL_MAX_IN_FEATURES", 0)
    small = prepack_linear(nn.Linear(256, 256, bias=False), keep_dense=False, support=AVX2)
    assert isinstance(small, PrepackedLinear) and small.weight is not None and small.panels is None
    assert small.packed_rows == cpu_dense.PACKED_ROWS
    large = prepack_linear(nn.Linear(512, 512, bias=False), keep_dense=False, support=AVX2)
    assert isinstance(large, PrepackedLinear) and large.weight is None and large.packed_rows is None
    head = prepack_linear(nn.Linear(64, 8192, bias=False), support=AVX2)
    assert head.weight is not None and head.packed is not None and head.panels is None


needs_panels = pytest.mark.skipif(not cpu_native.available(), reason="no native CPU kernels (no C compiler)")


@every_level
@needs_onednn
@needs_panels
def test_float32_linears_get_panels_for_decode_batches():
    """Inputs of at most PANEL_MAX_IN_FEATURES: a panel copy for `panel_rows()`. Where a dense
    weight is held (small weights, the LM head) the other batches go to it and there is no
    oneDNN copy; the large per-layer weights keep oneDNN's copy instead of a dense one."""
    small = prepack_linear(nn.Linear(256, 256, bias=False), keep_dense=False, support=AVX2)
    assert small.panel_rows == cpu_dense.panel_rows() and small.weight is not None and small.packed is None
    large = prepack_linear(nn.Linear(512, 512, bias=False), keep_dense=False, support=AVX2)
    assert large.panel_rows == cpu_dense.panel_rows() and large.weight is None and large.packed is not None
    head = prepack_linear(nn.Linear(512, 8192, bias=False), support=AVX2)
    assert head.panel_rows == cpu_dense.panel_rows() and head.weight is not None and head.packed is None
    wide = prepack_linear(nn.Linear(cpu_dense.PANEL_MAX_IN_FEATURES + 1, 512, bias=False), keep_dense=False,
                          support=AVX2)
    assert wide.panels is None and wide.packed is not None
    # Too small to prepack (qkv of a 192-wide model): panels beside the dense weight, no oneDNN
    # copy, so that every linear of such a model has panels (its decode steps are pool steps).
    tiny = prepack_linear(nn.Linear(192, 320), keep_dense=False, support=AVX2)
    assert not can_prepack(tiny.weight, AVX2)
    assert tiny.panel_rows == cpu_dense.panel_rows() and tiny.weight is not None and tiny.packed is None
    x = torch.randn(3, 192)
    with torch.inference_mode():
        torch.testing.assert_close(tiny(x), F.linear(x, tiny.weight, tiny.bias), rtol=1e-5, atol=1e-5)
    # A tiny bf16 weight keeps itself where bf16 is not multiplied natively.
    tiny_bf16 = nn.Linear(192, 320, dtype=BF16)
    assert prepack_linear(tiny_bf16, support=AVX2) is tiny_bf16
    # bf16 only where the build multiplies bf16 pairs natively (AVX512-BF16)
    assert cpu_dense.can_use_panels(torch.zeros(512, 512, dtype=BF16)) == cpu_native.panel_bf16_pairs()
    assert not cpu_dense.can_use_panels(torch.zeros(512, 512, dtype=FP16))


@needs_onednn
@needs_panels
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 63, 64, 96, 97, 300])
@pytest.mark.parametrize("kind", ["small", "large", "head"])
def test_each_batch_goes_to_the_copy_its_row_count_picks(rows, kind, monkeypatch):
    """`panel_rows()` rows: the panels (equal to F.linear up to summation order); other counts:
    oneDNN for a large per-layer weight, else F.linear on the dense weight (MKL's, bitwise)."""
    torch.manual_seed(rows)
    linear = {"small": nn.Linear(256, 512, bias=True), "large": nn.Linear(512, 1024, bias=True),
              "head": nn.Linear(512, 8192, bias=False)}[kind]
    layer = prepack_linear(linear, keep_dense=kind == "head")
    used = []
    panels_call, onednn = cpu_native.PanelLinear.__call__, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_native.PanelLinear, "__call__", lambda self, x: used.append("panels") or panels_call(self, x))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: used.append("onednn") or onednn(*a))
    x = torch.randn(rows, linear.in_features)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, linear.weight, linear.bias)
    if rows in cpu_dense.panel_rows():
        assert used == ["panels"]
    elif kind == "large":
        assert used == ["onednn"]
    else:
        assert used == [] and torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 63, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_prepacked_linear_multiplies_packed_only_the_rows_it_is_faster_for(rows, with_bias, monkeypatch):
    """A small float32 weight without panels: a batch of PACKED_ROWS rows goes through the
    packed copy (equal to F.linear up to summation order), any other is F.linear itself (MKL's
    products, bitwise)."""
    monkeypatch.setattr(cpu_dense, "PANEL_MAX_IN_FEATURES", 0)
    torch.manual_seed(rows)
    linear = nn.Linear(256, 512, bias=with_bias)
    layer = prepack_linear(linear, keep_dense=False)
    packed = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: packed.append(1) or onednn(*a))
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, linear.weight, linear.bias)
    assert bool(packed) == (rows in cpu_dense.PACKED_ROWS)
    if not packed:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)




@needs_native_bf16
@pytest.mark.parametrize("shape", [(1, 512), (2, 512), (16, 512), (64, 512), (300, 512), (3, 5, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("keep_dense", [True, False])
def test_prepacked_bf16_linear_matches_f_linear(shape, with_bias, keep_dense):
    """The oneDNN bf16 kernel F.linear uses, without its per-call weight reorder. On an
    AVX512-BF16 Zen 4 the products are bitwise equal; another CPU (AMX) may block the packed
    weight differently, so the test asks for float32-accumulation agreement at bf16 output
    precision and, for most elements, the same bits."""
    weight = _head_weight().to(BF16)
    bias = torch.randn(weight.shape[0]).to(BF16) if with_bias else None
    layer = PrepackedLinear(weight, bias, keep_dense=keep_dense)
    x = torch.randn(*shape).to(BF16)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, weight, bias)
    assert got.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    assert (got == want).float().mean() >= 0.99


@needs_native_bf16
@needs_panels
@pytest.mark.parametrize("rows", [1, 16, 96, 97, 300])
@pytest.mark.parametrize("keep_dense", [True, False])
def test_bf16_decode_batches_take_the_bf16_panels_where_the_build_has_pairs(rows, keep_dense, monkeypatch):
    """With AVX512-BF16 pairs in the build, a bf16 weight of at most
    PANEL_MAX_IN_FEATURES_BF16 inputs multiplies `panel_rows()` batches through its panels and
    the others through oneDNN's packed copy (kept even beside a dense weight: F.linear would
    reorder a bf16 weight every call); both within bf16 rounding of F.linear. The fused
    argmax serves the panel rows only."""
    if not cpu_native.panel_bf16_pairs():
        pytest.skip("this build has no native bf16 pairs (no AVX512-BF16): bf16 weights get no panels")
    torch.manual_seed(rows)
    linear = nn.Linear(cpu_dense.PANEL_MAX_IN_FEATURES_BF16, 512, bias=True).to(BF16)
    layer = prepack_linear(linear, keep_dense=keep_dense)
    assert layer.panel_rows == cpu_dense.panel_rows() and layer.packed is not None
    assert prepack_linear(nn.Linear(cpu_dense.PANEL_MAX_IN_FEATURES_BF16 + 2, 512).to(BF16)).panels is None
    used = []
    panels_call, onednn = cpu_native.PanelLinear.__call__, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_native.PanelLinear, "__call__", lambda self, x: used.append("panels") or panels_call(self, x))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: used.append("onednn") or onednn(*a))
    x = torch.randn(rows, cpu_dense.PANEL_MAX_IN_FEATURES_BF16).to(BF16)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert used == ["panels" if rows in cpu_dense.panel_rows() else "onednn"]
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)
    # a greedy head's fused argmax: the argmax of these very outputs, where the panels serve
    tokens = layer.argmax(x)
    if rows in cpu_dense.panel_rows():
        assert torch.equal(tokens, got.float().argmax(dim=-1))
    else:
        assert tokens is None


@needs_native_bf16
def test_bf16_model_prepacks_its_linears_and_matches_unpacked(tiny_model_dir, monkeypatch):
    """A bf16 model on a CPU with native bf16: every linear is packed, and the logits are the
    unpacked model's (bit for bit on a Zen 4; within bf16 rounding elsewhere)."""
    monkeypatch.setattr(cpu_dense, "PREPACK_MIN_ELEMENTS_BF16", 1)
    packed = CausalLM.from_pretrained(tiny_model_dir, dtype=BF16)
    plain = CausalLM.from_pretrained(tiny_model_dir, dtype=BF16, prepack=False)
    assert isinstance(packed.lm_head, PrepackedLinear)
    assert all(isinstance(layer.mlp.down_proj, PrepackedLinear) for layer in packed.layers)
    torch.manual_seed(5)
    ids = torch.randint(0, packed.args.vocab_size, (20,))
    L = ids.numel()
    shape = (2, 16, packed.args.num_kv_heads, packed.args.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(L), block_tables=torch.zeros((0, 1), dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32), query_start_loc=torch.zeros(1, dtype=torch.int32),
        num_paged_tokens=0, max_query_len=0, max_seq_len=0, fresh_query_lens=[L],
        all_seq_lens=[L], all_query_lens=[L], backend="torch",
    )
    logits = [
        model(ids, torch.arange(L), [(torch.zeros(shape, dtype=BF16), torch.zeros(shape, dtype=BF16))
                                     for _ in model.layers], meta, torch.arange(L))
        for model in (packed, plain)
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=2 ** -6, atol=5e-2)


def _save_checkpoint(path: Path, tie: bool) -> Path:
    """A 1-layer Llama whose LM head (vocab 32768 x hidden 64) is large enough to prepack."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         max_position_embeddings=64, tie_word_embeddings=tie)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


@every_level
@needs_onednn
@pytest.mark.parametrize("tie", [False, True])
def test_prepacked_head_logits_match_transformers(tmp_path, tie, one_torch_thread):
    from transformers import AutoModelForCausalLM

    path = _save_checkpoint(tmp_path, tie)
    model = CausalLM.from_pretrained(path)
    assert isinstance(model.lm_head, PrepackedLinear)
    if tie:  # the embedding table is the head's dense weight, not a copy
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    torch.manual_seed(4)
    ids = torch.randint(0, 32768, (24,))
    L = ids.numel()
    shape = (2, 16, model.args.num_kv_heads, model.args.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape))]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(L), block_tables=torch.zeros((0, 1), dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32), query_start_loc=torch.zeros(1, dtype=torch.int32),
        num_paged_tokens=0, max_query_len=0, max_seq_len=0, fresh_query_lens=[L],
        all_seq_lens=[L], all_query_lens=[L], backend="torch",
    )
    logits = model(ids, torch.arange(L), caches, meta, torch.arange(L))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@every_level
@needs_onednn
@pytest.mark.parametrize("panels", [True, False])
@pytest.mark.parametrize("packed_only", [True, False])
def test_greedy_tokens_match_transformers_through_prepacked_linears(tiny_model_dir, monkeypatch, packed_only, panels):
    # Every linear of the tiny model qualifies: large (packed only), or small (the dense weight
    # kept for batches outside PACKED_ROWS, so both paths run here); with panels, decode batches
    # and short chunks go to them.
    if panels and not cpu_native.available():
        pytest.skip("no native CPU kernels (no C compiler)")
    monkeypatch.setattr(cpu_dense, "SMALL_PREPACK_MIN_ELEMENTS", 1)
    if not panels:
        monkeypatch.setattr(cpu_dense, "PANEL_MAX_IN_FEATURES", 0)
    if packed_only:
        monkeypatch.setattr(cpu_dense, "PREPACK_MIN_ELEMENTS", 1)
    fused = []  # steps whose greedy tokens the LM head's panels picked without logits
    argmax = PrepackedLinear.argmax
    monkeypatch.setattr(PrepackedLinear, "argmax", lambda self, x: fused.append(argmax(self, x)) or fused[-1])
    reqs = engine_requests(8, 1024, seed=21, max_len=40, max_new=(4, 12))
    engine = run_engine(tiny_model_dir, reqs, chunk=7, max_batched_tokens=40)
    assert any(t is not None for t in fused) == panels
    model = engine.executor.model
    assert isinstance(model.lm_head, PrepackedLinear) and model.lm_head.weight is not None
    for layer in model.layers:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        assert all(isinstance(m, PrepackedLinear) for m in linears)
        # Packed only: the dense per-layer weights are not held a second time.
        assert all((m.weight is None) == packed_only for m in linears)
        assert all((m.panels is not None) == panels for m in linears)
    assert_matches_hf(tiny_model_dir, reqs)


@every_level
@needs_panels
def test_the_fused_greedy_head_runs_only_where_nothing_reads_the_logits(tiny_model_dir, monkeypatch):
    """A step with a row that wants logprobs computes logits (the head's argmax is not asked);
    where the head declines (a NaN sum, say: None) the step falls back to the logits and the
    sampler. Greedy tokens equal transformers' either way."""
    asked = []
    monkeypatch.setattr(PrepackedLinear, "argmax", lambda self, x: asked.append(x.shape[0]))  # always declines
    reqs = engine_requests(4, 1024, seed=23, max_len=30, max_new=(4, 8))
    run_engine(tiny_model_dir, reqs, chunk=7, max_batched_tokens=40)
    assert asked  # every step asked, and each fell back
    assert_matches_hf(tiny_model_dir, reqs)

    asked.clear()
    reqs = engine_requests(4, 1024, seed=24, max_len=30, max_new=(4, 8))
    reqs[0].sampling_params.logprobs = 1  # in every step of the batch while it runs
    reqs[0].sampling_params.max_tokens = max(r.sampling_params.max_tokens for r in reqs)
    run_engine(tiny_model_dir, reqs, chunk=64, max_batched_tokens=256)
    assert not asked
    assert len(reqs[0].output_logprobs) == reqs[0].num_output_tokens
    assert_matches_hf(tiny_model_dir, reqs)


def test_panel_rows_follow_the_builds_panel_width(monkeypatch):
    """Measured per instruction set: both builds take decode batches of 1-96 rows (an AVX2
    build's panels lose to oneDNN product by product from 32 rows, but its pool steps win the
    served step); an unknown width gets none."""
    for width, rows in [(64, range(1, 97)), (32, range(1, 97)), (48, None), (None, None)]:
        monkeypatch.setattr(cpu_native, "panel_width", lambda width=width: width)
        assert cpu_dense.panel_rows() == rows
        assert cpu_dense.can_use_panels(torch.zeros(64, 256)) == (rows is not None)


@every_level
@needs_onednn
@needs_panels
def test_panel_sized_steps_run_as_pool_steps_with_transformers_tokens(tiny_model_dir, monkeypatch):
    """With two compute threads, a step whose every product is a panel product (decode steps
    and short chunks) is a pool step: torch on one thread, the C kernels on the helper pool
    (kernels/cpu_native.py); the other steps are not. Greedy tokens equal transformers', and
    torch's thread count is back after every step."""
    pool_steps, other_steps = [], []  # the tiny model's linears all have panels at the defaults
    real_pool_step, real_run = cpu_native.pool_step, ModelExecutor._run

    class CountedPoolStep(real_pool_step):
        def __enter__(self):
            pool_steps.append(self.threads)
            return super().__enter__()

    def run(self, chunks, output, adapter_slots=None):
        tokens = sum(c.num_tokens for c in chunks)
        before = len(pool_steps)
        real_run(self, chunks, output, adapter_slots)
        if len(pool_steps) == before:
            other_steps.append(tokens)
        assert torch.get_num_threads() == 2

    monkeypatch.setattr(cpu_native, "pool_step", CountedPoolStep)
    monkeypatch.setattr(ModelExecutor, "_run", run)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        reqs = engine_requests(4, 1024, seed=31, max_len=160, max_new=(6, 12), min_len=110)
        engine = run_engine(tiny_model_dir, reqs, chunk=128, max_batched_tokens=256)
    finally:
        torch.set_num_threads(threads)
    assert engine.executor.pool_step_rows == cpu_dense.panel_rows()
    assert pool_steps and set(pool_steps) == {2}
    assert other_steps and all(t not in cpu_dense.panel_rows() for t in other_steps)
    assert_matches_hf(tiny_model_dir, reqs)


def test_only_a_model_whose_every_linear_has_panels_has_pool_steps(tiny_model_dir, monkeypatch):
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)),
                           engine=EngineConfig(device="cpu", attention_backend="torch"))
    assert ModelExecutor(config).pool_step_rows is None  # the torch backend: no C kernels
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)), engine=EngineConfig(device="cpu"))
    if cpu_native.available() and cpu_dense.panel_rows() is not None:
        # Every linear of the tiny model is too small to prepack, and has panels all the same.
        assert ModelExecutor(config).pool_step_rows == cpu_dense.panel_rows()
    monkeypatch.setattr(cpu_dense, "PANEL_MAX_IN_FEATURES", 0)
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)), engine=EngineConfig(device="cpu"))
    assert ModelExecutor(config).pool_step_rows is None  # no panels
