"""engine.kvCacheDtype fp8_e4m3 / fp8_e5m2: an fp8 paged cache with per-layer scales.

The checkpoint is the tiny Llama with its K and V rescaled (k_proj x K_GAIN with q_proj /
K_GAIN, v_proj x V_GAIN with o_proj / V_GAIN): the same model, but keys far above e4m3's
largest value (448) and values below both formats' smallest subnormal, so a scale of 1 would
saturate or flush them and the scales have real work to do. float32 and bf16 caches are unaffected
(floating point does not care about a common factor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenlane.kernels.reference import quantize_kv
from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor import model_executor
from tokenlane.runtime.executor.model_executor import ModelExecutor, select_kv_cache_dtype

K_GAIN = 300.0
V_GAIN = 1e-6
FP8 = ("fp8_e4m3", "fp8_e5m2")
# Unit roundoff of each format over bf16's (2^-8): 3 and 2 mantissa bits against 7. Errors this
# small are linear in the rounding, so an fp8 cache's logprob error is about this multiple of a
# bf16 cache's whatever the scales; what scales decide is whether anything worse (saturated
# keys, values flushed to zero) comes on top.
ROUNDOFF_OVER_BF16 = {"fp8_e4m3": 2.0**-4 / 2.0**-8, "fp8_e5m2": 2.0**-3 / 2.0**-8}


def rescaled_checkpoint(src: Path, dst: Path, scales: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the checkpoint at `src` with K x K_GAIN and V x V_GAIN (same outputs), plus
    the tensors `scales` (KV-scale weights by name)."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    for name in list(weights):
        for proj, gain in (("q_proj", 1 / K_GAIN), ("k_proj", K_GAIN), ("v_proj", V_GAIN),
                           ("o_proj", 1 / V_GAIN)):
            if name.endswith(f"self_attn.{proj}.weight"):
                weights[name] = (weights[name].double() * gain).float()
    weights.update(scales or {})
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled_model_dir(tiny_model_dir, tmp_path_factory):
    return rescaled_checkpoint(Path(tiny_model_dir), tmp_path_factory.mktemp("fp8") / "scaled")


def _config(model_dir, kv_cache_dtype, backend="torch", **engine_kw):
    engine_kw.setdefault("kv_cache_blocks", 96)
    return RuntimeConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        engine=EngineConfig(block_size=4, device="cpu", kv_cache_dtype=kv_cache_dtype,
                            attention_backend=backend, **engine_kw),
        scheduler=SchedulerConfig(prefill_chunk_size=16, max_batched_tokens=64, max_active_sequences=8),
    )


def _engine(model_dir, kv_cache_dtype, backend="torch", **engine_kw):
    config = _config(model_dir, kv_cache_dtype, backend, **engine_kw)
    return LLMEngine(config, ModelExecutor(config))


def _run(engine, requests):
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return requests


# ---------------------------------------------------------------------------- capacity


def test_the_same_bytes_hold_2x_the_blocks_of_bf16_and_4x_of_float32(scaled_model_dir):
    blocks = {}
    for dtype in ("float32", "bfloat16", *FP8):
        ex = ModelExecutor(_config(scaled_model_dir, dtype, kv_cache_blocks=None, cpu_kv_cache_gib=0.01))
        assert ex.kv_caches[0][0].element_size() == {"float32": 4, "bfloat16": 2}.get(dtype, 1)
        blocks[dtype] = ex.num_kv_blocks
    print("blocks in 0.01 GiB:", blocks)
    for dtype in FP8:
        assert blocks[dtype] >= 1.9 * blocks["bfloat16"]
        assert blocks[dtype] >= 3.8 * blocks["float32"]


def test_the_startup_log_names_the_pool_and_the_scales(scaled_model_dir, caplog):
    caplog.set_level("INFO", logger=model_executor.log.name)
    ex = ModelExecutor(_config(scaled_model_dir, "fp8_e4m3"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"{ex.num_kv_blocks} blocks of 4 tokens, fp8_e4m3" in line and "calibrated scales" in line


# ---------------------------------------------------------------------------- scales


def test_calibrated_scales_fit_the_activations_and_are_fixed(scaled_model_dir):
    first = ModelExecutor(_config(scaled_model_dir, "fp8_e4m3"))
    again = ModelExecutor(_config(scaled_model_dir, "fp8_e4m3"))
    assert first.kv_scales_source == "calibrated"
    assert first.kv_scales == again.kv_scales  # deterministic: the same on every start
    for layer, (k_scale, v_scale) in zip(first.model.layers, first.kv_scales):
        # Keys far above e4m3's 448 need scales > 1, values deep below 1 scales < 1.
        assert k_scale > 1 and v_scale < 1e-2
        assert (layer.self_attn.k_scale, layer.self_attn.v_scale) == (k_scale, v_scale)


@pytest.mark.parametrize("names", ["k_v", "modelopt", "kv"])
def test_checkpoint_scales_are_read_as_vllm_reads_them(scaled_model_dir, tmp_path, names):
    layers = 2
    scales = {}
    for i in range(layers):
        prefix = f"model.layers.{i}.self_attn"
        k, v = torch.tensor(2.0 + i), torch.tensor(0.25 + i)
        if names == "k_v":
            scales.update({f"{prefix}.k_scale": k, f"{prefix}.v_scale": v})
        elif names == "modelopt":
            scales.update({f"{prefix}.k_proj.k_scale": k.reshape(1), f"{prefix}.v_proj.v_scale": v.reshape(1)})
        else:  # the older single scale, for K and V both
            scales[f"{prefix}.kv_scale"] = k
    model_dir = _with_scales(scaled_model_dir, tmp_path, scales)
    ex = ModelExecutor(_config(model_dir, "fp8_e5m2"))
    assert ex.kv_scales_source == "checkpoint"
    expected = [(2.0 + i, (2.0 + i) if names == "kv" else 0.25 + i) for i in range(layers)]
    assert ex.kv_scales == expected
    # A non-fp8 cache ignores them (as vLLM does), and the weights load.
    assert ModelExecutor(_config(model_dir, "float32")).kv_scales is None


def _with_scales(model_dir: Path, tmp_path: Path, scales: dict[str, torch.Tensor]) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(model_dir, dst)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights.update(scales)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("scales,match", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     "model.layers.1.self_attn.k_scale"),
    ({f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(1.0) for i in range(2) for p in "kv"}
     | {"model.layers.0.self_attn.v_scale": torch.ones(2)}, r"model.layers.0.self_attn.v_scale.*shape \(2,\)"),
    ({f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(1.0) for i in range(2) for p in "kv"}
     | {"model.layers.1.self_attn.k_scale": torch.tensor(0.0)}, "model.layers.1.self_attn.k_scale.*positive"),
    ({f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(1.0) for i in range(3) for p in "kv"},
     "model.layers.2.self_attn.k_scale.*2 layers"),
], ids=["missing-layer", "wrong-shape", "non-positive", "extra-layer"])
def test_checkpoint_scales_that_do_not_match_the_layers_are_refused(scaled_model_dir, tmp_path, scales, match):
    model_dir = _with_scales(scaled_model_dir, tmp_path, scales)
    with pytest.raises(ValueError, match=match):
        ModelExecutor(_config(model_dir, "fp8_e4m3"))


# ---------------------------------------------------------------------------- devices


def test_an_fp8_dtype_the_device_cannot_store_is_refused(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match=r"kvCacheDtype 'fp8_e4m3' needs a GPU of compute capability 8.9.*fp8_e5m2"):
        select_kv_cache_dtype("fp8_e4m3", torch.bfloat16, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"kvCacheDtype 'fp8_e5m2' needs a GPU of compute capability 8.0"):
        select_kv_cache_dtype("fp8_e5m2", torch.bfloat16, cuda)
    # A torch build that cannot convert to the format on the device at all.
    real_to = torch.Tensor.to

    def no_fp8(self, *args, **kwargs):
        if any(a in (torch.float8_e4m3fn, torch.float8_e5m2) for a in args):
            raise RuntimeError("not implemented for 'Float8_e4m3fn'")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_fp8)
    with pytest.raises(ValueError, match="kvCacheDtype 'fp8_e4m3': this torch build cannot store"):
        select_kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu"))
    assert select_kv_cache_dtype("bfloat16", torch.float32, torch.device("cpu")) == torch.bfloat16


# ---------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("dtype", FP8)
def test_the_cache_holds_the_scaled_keys(scaled_model_dir, dtype):
    """Prompts of one fresh chunk each: both caches are written from the same float32 K/V."""
    engines = {d: _engine(scaled_model_dir, d) for d in ("float32", dtype)}
    prompts = [[5 + (7 * i + j) % 900 for j in range(3 + 2 * i)] for i in range(6)]
    for engine in engines.values():
        _run(engine, [Request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                      for i, p in enumerate(prompts)])
    full, narrow = (engines[d].executor.kv_caches for d in ("float32", dtype))
    for (k32, v32), (k8, v8), (ks, vs) in zip(full, narrow, engines[dtype].executor.kv_scales):
        assert torch.equal(k8.view(torch.uint8), quantize_kv(k32, k8.dtype, ks).view(torch.uint8))
        assert torch.equal(v8.view(torch.uint8), quantize_kv(v32, v8.dtype, vs).view(torch.uint8))


# ---------------------------------------------------------------------------- accuracy


def _prompt_logprobs(model_dir, kv_cache_dtype, prompts):
    """Per prompt token (after the first): its logprob and whether it is the argmax."""
    engine = _engine(model_dir, kv_cache_dtype, kv_cache_blocks=256)
    # Chunks of 16: later chunks attend to cached (quantized) context.
    requests = _run(engine, [Request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                                                 ignore_eos=True))
                             for i, p in enumerate(prompts)])
    logprobs, top = [], []
    for r in requests:
        for entry in r.prompt_logprobs[1:]:
            logprobs.append(entry.logprob)
            top.append(entry.top[0][0])
    assert engine.scheduler.kv.num_free_blocks == engine.executor.num_kv_blocks
    return torch.tensor(logprobs, dtype=torch.float64), torch.tensor(top)


def test_prompt_logprobs_against_float32_and_bf16_caches(scaled_model_dir, tmp_path):
    """Prompt logprobs (chunks of 16 over cached context) with each cache against a float32
    cache: mean |delta logprob| and the share of changed greedy tokens, printed. Bounded, per
    fp8 format, by its rounding: at most 1.25x its unit roundoff over bf16's times the bf16
    cache's error (measured here, so the bound tracks the model). Scales of 1 (a checkpoint
    that declares them) break that bound: the calibrated scales are what keep fp8 there."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (40, 63, 90, 120)]
    ref_lp, ref_top = _prompt_logprobs(scaled_model_dir, "float32", prompts)
    ones = {f"model.layers.{i}.self_attn.{p}_scale": torch.tensor(1.0) for i in range(2) for p in "kv"}
    unit_scales_dir = _with_scales(scaled_model_dir, tmp_path, ones)
    rows = {}
    for name, model_dir, dtype in [("bfloat16", scaled_model_dir, "bfloat16"),
                                   *[(d, scaled_model_dir, d) for d in FP8],
                                   *[(f"{d} scale 1", unit_scales_dir, d) for d in FP8]]:
        lp, top = _prompt_logprobs(model_dir, dtype, prompts)
        rows[name] = ((lp - ref_lp).abs().mean().item(), (top != ref_top).double().mean().item())
    bf16_delta, bf16_changed = rows["bfloat16"]
    print(f"\n{'kv cache':18} {'mean |dlogprob|':>16} {'x bf16':>7} {'greedy changed':>15}  "
          f"(vs a float32 cache, {len(ref_lp)} prompt tokens)")
    for name, (delta, changed) in rows.items():
        print(f"{name:18} {delta:16.3e} {delta / bf16_delta:7.1f} {changed:15.2%}")
    for dtype in FP8:
        bound = 1.25 * ROUNDOFF_OVER_BF16[dtype]
        delta, changed = rows[dtype]
        assert delta <= bound * bf16_delta, (dtype, rows)
        # A share of near-ties: floored at two tokens' worth, so one flip on another host's
        # float32 kernels does not decide it.
        assert changed <= bound * max(bf16_changed, 2 / len(ref_lp)), (dtype, rows)
        assert rows[f"{dtype} scale 1"][0] > bound * bf16_delta, (dtype, rows)


# ---------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_the_engine_generates_with_chunked_prefill_and_prefix_hits(scaled_model_dir, dtype, backend):
    from tokenlane.kernels import cpu_native

    if backend == "native" and not cpu_native.available():
        pytest.skip(f"no C compiler here: {cpu_native.load_error()}")
    engine = _engine(scaled_model_dir, dtype, backend, kv_cache_blocks=64)
    prefix = [5 + (11 * j) % 900 for j in range(32)]  # eight full blocks, shared
    first = _run(engine, [Request("first", prefix + [7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0,
                                                                               ignore_eos=True))])[0]
    # Prompts of 38-44 tokens: three chunks of 16 each, the prefix found in the cache.
    later = _run(engine, [Request(f"r{i}", prefix + [20 + i + j for j in range(6 + 3 * i)],
                                  SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
                          for i in range(4)])
    assert len(first.output_token_ids) == 8
    assert all(len(r.output_token_ids) == 10 for r in later)
    assert all(r.num_cached_tokens >= 32 for r in later), [r.num_cached_tokens for r in later]
    assert engine.scheduler.kv.num_free_blocks == engine.executor.num_kv_blocks  # nothing leaked
