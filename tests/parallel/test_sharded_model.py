"""The sharded model (runtime/executor/sharding.py, llama.py, model_executor.py) against one process.

Ranks are real processes (torch.multiprocessing, spawn) in a gloo group on loopback. Every
rank builds a ModelExecutor over its share of the same tiny checkpoint and runs the same
hand-built step plans (prefill chunks over two steps, a prefix hit, decodes, a preemption and
its recompute, prompt logprobs, a fork's copy-on-write block copy, host-tier offloads and
restores); the output rank's tokens and logprobs must equal a TP=1 executor's in this
process, and the other ranks return no tokens. One spawn of four processes covers every
layout (TP=2, PP=2, TP=2 x PP=2) of both models: a Llama with one KV head (the head
replicated over the tensor ranks), attention and MLP biases (a row-parallel projection's bias
added once) and the native CPU kernels (where built); and a Qwen2 with qkv bias, tied embeddings, three
layers (uneven stages), a vocabulary that is not a multiple of the tensor ranks (padding) and
the torch attention path; and the Llama again with a PEFT LoRA adapter (every projection
targeted) on request b and its fork.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest
import torch

from tokenlane.runtime.config import EngineConfig, KVOffloadConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.executor.llama import ModelArgs
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.executor.parallel_state import ParallelLayout, ParallelState
from tokenlane.runtime.executor.sharding import check_parallel_fits, shard_plan

LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)
WORLD = 4
BLOCK_SIZE = 4
LOGPROB_TOLERANCE = 1e-4
KV_GIB = 2.0e-4  # the pool from engine.cpuKvCacheGib: its block count differs per stage
HOST_KV_BYTES = 1 << 16  # engine.kvOffload's host tier: its slot count differs per stage too


# ---------------------------------------------------------------- the script every rank runs


def _config(path: str, tp: int = 1, pp: int = 1, **engine) -> RuntimeConfig:
    engine = EngineConfig(device="cpu", block_size=BLOCK_SIZE, cpu_kv_cache_gib=KV_GIB,
                          kv_offload=KVOffloadConfig(host_bytes=HOST_KV_BYTES),
                          tensor_parallel_size=tp if tp > 1 else None,
                          pipeline_parallel_size=pp if pp > 1 else None, **engine)
    return RuntimeConfig(model=ModelConfig(path=path), engine=engine)


def _requests(vocab: int, adapter: str | None = None) -> dict[str, Request]:
    rng = random.Random(7)
    draw = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    a_prompt = draw(13)
    greedy = dict(temperature=0.0, max_tokens=8)
    return {
        "a": Request("a", a_prompt, SamplingParams(**greedy)),
        "b": Request("b", draw(6), SamplingParams(**greedy, logprobs=3, prompt_logprobs=2), adapter=adapter),
        # The first two blocks are a's: a prefix hit once a wrote them.
        "c": Request("c", a_prompt[:8] + draw(3), SamplingParams(**greedy)),
        # a's first two blocks again, through the host tier.
        "d": Request("d", a_prompt[:8] + draw(2), SamplingParams(**greedy)),
        # A fork of b (parallel sampling): its outputs and blocks are b's until it diverges.
        "e": Request("e", [], SamplingParams(**greedy, logprobs=1), adapter=adapter),
    }


def _plans(reqs: dict[str, Request]):
    """Yield each step's plan; the caller appends that step's tokens before the next."""
    a, b, c, d, e = (reqs[rid] for rid in "abcde")
    a.block_ids, b.block_ids, c.block_ids = [0, 1, 2, 3, 4], [5, 6, 7], [0, 1, 8, 9]
    # Step 1: a's first prefill chunk (no token), b's whole prompt with prompt logprobs.
    yield StepPlan(chunks=[ScheduledChunk(a, 0, 8, False), ScheduledChunk(b, 0, 6, True)])
    # Step 2: b decodes; a's second chunk; c reuses a's two blocks (8 cached tokens).
    c.num_cached_tokens = 8
    yield StepPlan(chunks=[ScheduledChunk(b, 6, 1, True), ScheduledChunk(a, 8, 5, True),
                           ScheduledChunk(c, 8, 3, True)])
    # Step 3: three decodes.
    yield StepPlan(chunks=[ScheduledChunk(b, 7, 1, True), ScheduledChunk(a, 13, 1, True),
                           ScheduledChunk(c, 11, 1, True)])
    # Step 4: c preempted (its blocks freed); a's greedy decode alone (the argmax-only LM head).
    preempted = StepPlan(chunks=[ScheduledChunk(a, 14, 1, True)], preempted=[c])
    yield preempted
    # Step 5: c recomputed in fresh blocks, prompt and output.
    c.block_ids = [10, 11, 12, 13]
    yield StepPlan(chunks=[ScheduledChunk(c, 0, c.num_tokens, True), ScheduledChunk(b, 8, 1, True)])
    # Step 6: e forks b (b's last block copied for it, both decode); a's first two blocks go to
    # the host tier and come back as fresh blocks, d's cached prefix.
    e.prompt_token_ids, e.output_token_ids = list(b.prompt_token_ids), list(b.output_token_ids)
    e.num_computed_tokens, e.block_ids = b.num_computed_tokens, [5, 6, 14]
    d.block_ids, d.num_cached_tokens = [15, 16, 17], 8
    yield StepPlan(chunks=[ScheduledChunk(b, 9, 1, True), ScheduledChunk(e, 9, 1, True),
                           ScheduledChunk(d, 8, 2, True)],
                   block_copies=[(7, 14)], kv_offloads=[(0, 0), (1, 1)], kv_restores=[(0, 15), (1, 16)])


def _encode(output) -> dict:
    def entry(e):
        return None if e is None else [e.token_id, e.logprob, e.rank, [list(t) for t in e.top]]

    return {
        "sampled": dict(output.sampled),
        "logprobs": {rid: entry(e) for rid, e in output.logprobs.items()},
        "prompt_logprobs": {rid: [first, [entry(e) for e in entries]]
                            for rid, (first, entries) in output.prompt_logprobs.items()},
        "errors": dict(output.errors),
    }


def make_executor(path: str, adapter_dir: str | None, backend: str, tp: int = 1, pp: int = 1,
                  parallel: ParallelState | None = None) -> ModelExecutor:
    extra = {"max_loras": 2} if adapter_dir else {}
    executor = ModelExecutor(_config(path, tp, pp, attention_backend=backend, **extra), parallel=parallel)
    if adapter_dir:
        executor.add_adapter("tuned", adapter_dir)
    return executor


def run_script(executor: ModelExecutor, tokens: list[dict] | None = None) -> list[dict]:
    """Run the plans; `tokens` (the reference's sampled tokens per step) advance the requests
    on ranks that do not sample; without it the executor's own tokens do."""
    reqs = _requests(executor.vocab_size, "tuned" if executor.adapters else None)
    steps = []
    for i, plan in enumerate(_plans(reqs)):
        output = executor.execute(plan)
        steps.append(_encode(output))
        sampled = tokens[i] if tokens is not None else output.sampled
        for chunk in plan.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.sample:
                request.output_token_ids.append(sampled[request.request_id])
    return steps


# ---------------------------------------------------------------- the ranks


def _sub_state(layout: ParallelLayout) -> ParallelState | None:
    """This process's state in `layout` over world ranks [0, layout.world_size). Every process
    of the world creates every group, in the same order (torch.distributed's rule)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_group = None
    for stage in range(layout.pp):
        group = dist.new_group(list(range(stage * layout.tp, (stage + 1) * layout.tp)), backend="gloo")
        if stage * layout.tp <= rank < (stage + 1) * layout.tp:
            tp_group = group
    control = dist.new_group(list(range(layout.world_size)), backend="gloo")
    if rank >= layout.world_size:
        return None
    return ParallelState(ParallelLayout(layout.tp, layout.pp, rank), torch.device("cpu"), tp_group=tp_group,
                         device_group=dist.group.WORLD, control_group=control)


def _rank_main(rank: int, port: int, jobs: list[tuple[str, str, str | None, str]], out_dir: str) -> None:
    import torch.distributed as dist

    from tokenlane.runtime.executor.parallel_state import init_parallel_state

    torch.set_num_threads(1)
    # The world is the largest layout, joined through the real rendezvous; the smaller layouts
    # use groups over its first ranks.
    world = init_parallel_state(ParallelLayout(2, 2, rank), "127.0.0.1", port, torch.device("cpu"), timeout_s=120)
    for model_name, path, adapter_dir, backend in jobs:
        reference = json.loads((Path(out_dir) / f"{model_name}-reference.json").read_text())
        tokens = [step["sampled"] for step in reference]
        for tp, pp in LAYOUTS:
            state = world if (tp, pp) == (2, 2) else _sub_state(ParallelLayout(tp, pp, 0))
            if state is None:
                continue
            executor = make_executor(path, adapter_dir, backend, tp, pp, state)
            record = {
                "steps": run_script(executor, tokens),
                "weight_bytes": executor.model.weights_loaded.bytes,
                "load_detail": next(p.detail for p in executor.startup_phases if p.name == "load"),
                "num_kv_blocks": executor.num_kv_blocks,
                "kv_shape": list(executor.kv_caches[0][0].shape),
                "kv_layers": len(executor.kv_caches),
                "own_pool_blocks": executor._pool_size(),
                "num_host_kv_blocks": executor.num_host_kv_blocks,
                "own_host_blocks": HOST_KV_BYTES // executor.kv_bytes_per_block,
            }
            name = f"{model_name}-tp{tp}-pp{pp}-rank{rank}.json"
            (Path(out_dir) / name).write_text(json.dumps(record))
    # Calibrated fp8 KV scales: each rank's, for its stage's layers over all their KV heads.
    executor = ModelExecutor(_config(jobs[0][1], 2, 2, kv_cache_dtype="fp8_e4m3"), parallel=world)
    record = {"kv_scales": executor.kv_scales, "source": executor.kv_scales_source}
    (Path(out_dir) / f"fp8-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier(group=world.control_group)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_mqa_with_biases(out_dir: Path) -> Path:
    """A Llama checkpoint (transformers' own save_pretrained) with one KV head and random
    attention and MLP biases (transformers initializes biases to zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                         max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint folder, LoRA adapter folder or None, engine.attentionBackend)."""
    from lora_helpers import make_peft_adapter  # tests/lora_helpers.py
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    llama = llama_mqa_with_biases(tmp_path_factory.mktemp("llama-mqa"))
    qwen2 = make_tiny_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", num_layers=3, vocab_size=1029)
    adapter = make_peft_adapter(llama, tmp_path_factory.mktemp("llama-lora"), r=4, seed=3, b_std=0.2)
    # auto: the native CPU kernels where the host has them.
    return {"llama-mqa": (llama, None, "auto"), "qwen2": (qwen2, None, "torch"),
            "llama-mqa-lora": (llama, adapter, "auto")}


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got["errors"] == {} and want["errors"] == {}, where
    assert got["sampled"] == want["sampled"], where
    assert got["logprobs"].keys() == want["logprobs"].keys(), where
    pairs = [(got["logprobs"][r], want["logprobs"][r]) for r in want["logprobs"]]
    assert got["prompt_logprobs"].keys() == want["prompt_logprobs"].keys(), where
    for rid, (first, entries) in want["prompt_logprobs"].items():
        assert got["prompt_logprobs"][rid][0] == first, where
        pairs += list(zip(got["prompt_logprobs"][rid][1], entries, strict=True))
    for g, w in pairs:
        if w is None:
            assert g is None, where
            continue
        assert g[0] == w[0] and g[2] == w[2], f"{where}: {g} != {w}"
        assert abs(g[1] - w[1]) <= LOGPROB_TOLERANCE, f"{where}: logprob {g[1]} vs {w[1]}"
        assert [t for t, _ in g[3]] == [t for t, _ in w[3]], f"{where}: top {g[3]} vs {w[3]}"
        for (_, gl), (_, wl) in zip(g[3], w[3]):
            assert abs(gl - wl) <= LOGPROB_TOLERANCE, f"{where}: top logprob {gl} vs {wl}"


def test_sharded_ranks_match_one_process(checkpoints, tmp_path):
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {}
        for name, (path, adapter, backend) in checkpoints.items():
            executor = make_executor(str(path), adapter and str(adapter), backend)
            steps = run_script(executor)
            references[name] = (steps, executor)
            (tmp_path / f"{name}-reference.json").write_text(json.dumps(steps))
        fp8_scales = ModelExecutor(_config(str(checkpoints["llama-mqa"][0]), kv_cache_dtype="fp8_e4m3")).kv_scales
    finally:
        torch.set_num_threads(threads)
    jobs = [(name, str(path), adapter and str(adapter), backend)
            for name, (path, adapter, backend) in checkpoints.items()]
    mp.spawn(_rank_main, args=(_free_port(), jobs, str(tmp_path)), nprocs=WORLD, join=True)

    for name, (want_steps, reference) in references.items():
        assert all(step["sampled"] for step in want_steps), "the script samples every step"
        assert want_steps[5]["sampled"]["e"] == want_steps[5]["sampled"]["b"]  # the fork reads b's K/V
        if name.endswith("-lora"):  # the adapter changes what its requests sample
            base_steps = references[name.removesuffix("-lora")][0]
            for rid in ("a", "c"):
                assert [s["sampled"].get(rid) for s in want_steps] == [s["sampled"].get(rid) for s in base_steps]
            assert [s["sampled"].get("b") for s in want_steps] != [s["sampled"].get("b") for s in base_steps]
        assert want_steps[0]["prompt_logprobs"]["b"] and want_steps[1]["logprobs"]["b"]
        ref_bytes = reference.model.weights_loaded.bytes
        args = reference.args
        for tp, pp in LAYOUTS:
            layout = ParallelLayout(tp, pp)
            records = [json.loads((tmp_path / f"{name}-tp{tp}-pp{pp}-rank{r}.json").read_text())
                       for r in range(tp * pp)]
            for rank, record in enumerate(records):
                where = f"{name} tp={tp} pp={pp} rank {rank}"
                plan = shard_plan(args, ParallelLayout(tp, pp, rank))
                if rank == layout.output_rank:
                    for i, (got, want) in enumerate(zip(record["steps"], want_steps, strict=True)):
                        _assert_same(got, want, f"{where} step {i + 1}")
                else:
                    for step in record["steps"]:
                        assert step == {"sampled": {}, "logprobs": {}, "prompt_logprobs": {}, "errors": {}}, where
                # The KV pool: this rank's KV heads (one, replicated, for MQA) of its stage's layers,
                # with the smallest block count of all ranks.
                assert f"rank {rank} of {tp * pp}" in record["load_detail"], where
                assert f"{record['weight_bytes']} bytes read by this rank" in record["load_detail"], where
                assert record["kv_shape"][2] == plan.num_kv_heads, where
                assert record["kv_layers"] == plan.num_layers, where
                assert record["num_kv_blocks"] == min(r["own_pool_blocks"] for r in records), where
                assert record["num_host_kv_blocks"] == min(r["own_host_blocks"] for r in records), where
            if tp == 2 and pp == 1:
                for rank, record in enumerate(records):
                    assert record["weight_bytes"] <= 0.55 * ref_bytes, (
                        f"{name} tp=2 rank {rank} read {record['weight_bytes']} of {ref_bytes} bytes")
    # Uneven stages (3 layers over 2): the stages' own pool sizes differ, and both use the smaller.
    qwen_pp = [json.loads((tmp_path / f"qwen2-tp1-pp2-rank{r}.json").read_text()) for r in range(2)]
    assert qwen_pp[0]["own_pool_blocks"] < qwen_pp[1]["own_pool_blocks"]
    assert qwen_pp[0]["own_host_blocks"] < qwen_pp[1]["own_host_blocks"]
    # fp8 KV scales: every rank's are the single process's of its stage's layers.
    args = references["llama-mqa"][1].args
    for rank in range(WORLD):
        record = json.loads((tmp_path / f"fp8-rank{rank}.json").read_text())
        plan = shard_plan(args, ParallelLayout(2, 2, rank))
        assert record["source"] == "calibrated"
        want = fp8_scales[plan.layer_start: plan.layer_end]
        flat = [scale for pair in record["kv_scales"] for scale in pair]
        assert flat == pytest.approx([scale for pair in want for scale in pair], rel=1e-5), f"rank {rank}"


# ---------------------------------------------------------------- check_parallel_fits


def _args(heads=32, kv_heads=8, layers=32, inter=11008, vocab=32000) -> ModelArgs:
    return ModelArgs(
        model_type="llama", vocab_size=vocab, hidden_size=heads * 128, intermediate_size=inter, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, mlp_bias=False, max_position_embeddings=4096, sliding_window=None,
        bos_token_id=1, eos_token_id=2,
    )


@pytest.mark.parametrize("args, tp, pp, message", [
    (_args(), 1, 1, None),
    (_args(), 8, 4, None),
    (_args(kv_heads=1), 4, 1, None),  # MQA: the one KV head on every rank
    (_args(kv_heads=2), 8, 1, None),  # GQA, tp a multiple of the KV heads
    (_args(vocab=32001), 2, 1, None),  # the vocabulary is padded to a multiple of tp
    (_args(layers=3), 1, 3, None),
    (_args(), 3, 1, "engine.tensorParallelSize 3 must divide the model's 32 attention heads"),
    (_args(heads=12, kv_heads=4), 6, 1, "engine.tensorParallelSize 6 must divide the model's 4 key/value heads"),
    (_args(inter=11000), 16, 1, "engine.tensorParallelSize 16 must divide the model's intermediate_size 11000"),
    (_args(), 1, 40, "engine.pipelineParallelSize 40 exceeds the model's 32 layers"),
    (_args(), 0, 1, "engine.tensorParallelSize must be >= 1"),
    (_args(), 1, 0, "engine.pipelineParallelSize must be >= 1"),
])
def test_check_parallel_fits(args, tp, pp, message):
    if message is None:
        check_parallel_fits(args, tp, pp)
    else:
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            check_parallel_fits(args, tp, pp)


def test_shard_plan_replicates_kv_heads_and_pads_the_vocabulary():
    args = _args(heads=8, kv_heads=2, vocab=1029)
    plans = [shard_plan(args, ParallelLayout(4, 1, r)) for r in range(4)]
    assert [(p.head_start, p.num_heads) for p in plans] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # Rank t's query heads 2t, 2t + 1 read KV head (2t) // 4.
    assert [(p.kv_head_start, p.num_kv_heads) for p in plans] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [p.vocab_start for p in plans] == [0, 258, 516, 774]
    assert [p.vocab_rows for p in plans] == [258, 258, 258, 255]  # 1032 padded rows, 3 of them padding
    stages = [shard_plan(_args(layers=5), ParallelLayout(1, 2, r)) for r in range(2)]
    assert [(s.layer_start, s.layer_end, s.first_stage, s.last_stage) for s in stages] == [
        (0, 3, True, False), (3, 5, False, True)]


