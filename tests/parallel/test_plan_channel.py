"""The plan's diffs and the workers' mirror requests (runtime/distributed/mirror.py), through the
channel's own pickling, under the real engine and scheduler.

Rank 0's executor and a "worker" executor are both strict FakeExecutors (each checks every
chunk's block table against a pretend KV cache of its own): the worker runs on the mirrors
rebuilt from the messages alone. A run with prefill chunks, prompt logprobs, a parallel-sampling
group (fork and copy on write), preemptions (a small pool) and cancellations must give the
same tokens and logprobs on both, and leave no mirror behind once every request ended
(finished requests reach the workers with the next plan, one without chunks if need be).
"""

from __future__ import annotations

from tokenlane.runtime.config import loads_config
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams, SequenceGroup
from tokenlane.runtime.distributed.channel import dumps, loads
from tokenlane.runtime.distributed.mirror import PlanEncoder, RequestMirrors
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.fake import FakeExecutor

CONFIG = """
model: {path: /unused, maxModelLen: 256}
engine: {blockSize: 4}
scheduler: {maxActiveSequences: 8, maxBatchedTokens: 24, prefillChunkSize: 8, kvCacheHighWatermark: 0.99,
            kvCacheRejectWatermark: 1.0}
"""


class LoopbackGroup:
    """Rank 0 and one worker in one process, the messages pickled as on the wire."""

    mirrors_requests = True
    supports_logprobs = True

    def __init__(self, blocks: int) -> None:
        self.rank0 = FakeExecutor(num_kv_blocks=blocks, block_size=4)
        self.worker = FakeExecutor(num_kv_blocks=blocks, block_size=4)
        self.encoder = PlanEncoder()
        self.mirrors = RequestMirrors()
        self.block_size, self.num_kv_blocks = 4, blocks
        self.vocab_size, self.eos_token_id, self.max_model_len = 1000, None, 4096
        self.bytes = 0
        self.chunkless_plans = 0

    def execute(self, plan):
        payload = dumps(self.encoder.encode(plan))
        self.bytes += len(payload)
        self.chunkless_plans += not plan.chunks
        mirrored = self.mirrors.apply(loads(payload))
        assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in mirrored.chunks] == [
            (c.request.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]
        for mine, theirs in zip(plan.chunks, mirrored.chunks):
            assert theirs.request.block_ids == mine.request.block_ids
            assert theirs.request.all_token_ids == mine.request.all_token_ids
        out = self.rank0.execute(plan)
        echo = self.worker.execute(mirrored)
        assert (echo.sampled, echo.logprobs, echo.prompt_logprobs) == (out.sampled, out.logprobs, out.prompt_logprobs)
        return out


def test_mirrors_follow_chunks_forks_preemptions_and_cancellations():
    group = LoopbackGroup(blocks=20)
    engine = LLMEngine(loads_config(CONFIG), group)
    for i in range(5):
        params = SamplingParams(max_tokens=14, temperature=0, logprobs=1 if i % 2 else None,
                                prompt_logprobs=1 if i == 1 else None)
        engine.add_request(Request(f"r{i}", [(11 * i + j) % 900 + 1 for j in range(19)], params))
    members = [Request(f"g{k}", list(range(1, 15)), SamplingParams(max_tokens=10, temperature=0)) for k in range(3)]
    SequenceGroup.of(members)
    engine.add_group(members)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort_request("r3")
            engine.abort_request("g2")
        assert steps < 500
    # The ends of the last requests go with the next plan; one request then cancelled while it
    # runs alone ends in a plan without chunks, which the workers get as well.
    engine.add_request(Request("last", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0)))
    engine.step()
    engine.abort_request("last")
    engine.step()
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    preempted = sum(len(p.preempted) for p in group.rank0.plans)
    copies = sum(len(p.block_copies) for p in group.rank0.plans)
    assert preempted > 0 and copies > 0, (preempted, copies)
    assert group.chunkless_plans > 0  # the last requests' ends reached the worker without a step
    assert len(group.mirrors) == 0 and not group.encoder.known
    assert group.worker.dropped == group.rank0.dropped


def test_decode_steps_send_only_the_new_token_and_block():
    """After the first chunk a decode's update carries one output token and at most one block id."""
    encoder, mirrors = PlanEncoder(), RequestMirrors()
    request = Request("a", list(range(1, 10)), SamplingParams(max_tokens=8, temperature=0))
    request.block_ids = [5, 6, 7]
    request.status = RequestStatus.RUNNING
    from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan

    first = encoder.encode(StepPlan(chunks=[ScheduledChunk(request, 0, 9, True)], num_batched_tokens=9))
    mirrors.apply(loads(dumps(first)))
    assert len(first.new_requests) == 1 and first.chunks[0].block_ids == (5, 6, 7)
    request.output_token_ids.append(42)
    request.num_computed_tokens = 9
    second = encoder.encode(StepPlan(chunks=[ScheduledChunk(request, 9, 1, True)], num_batched_tokens=1))
    assert second.new_requests == () and second.chunks[0].block_ids == () and second.chunks[0].new_output_tokens == (42,)
    plan = mirrors.apply(loads(dumps(second)))
    assert plan.chunks[0].request.all_token_ids == request.all_token_ids
    request.block_ids[2] = 8  # a copy on write replaced the last block: the whole table goes
    third = encoder.encode(StepPlan(chunks=[ScheduledChunk(request, 9, 1, True)], num_batched_tokens=1))
    assert third.chunks[0].replace_blocks and mirrors.apply(third).chunks[0].request.block_ids == [5, 6, 8]


def _channel_rank(rank: int, port: int, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    from tokenlane.runtime.core.step_plan import ExecutorOutput
    from tokenlane.runtime.distributed.channel import FRAME_BYTES, PlanChannel
    from tokenlane.runtime.distributed.messages import Stop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    channel = PlanChannel.create(rank, 2, output_rank=1)
    sizes = [0, 100, FRAME_BYTES - 200, FRAME_BYTES, 3 * FRAME_BYTES + 5]
    got = []
    for size in sizes:
        if rank == 0:
            channel.broadcast(Stop("x" * size))
        else:
            got.append(len(channel.receive().reason))
    if rank == 1:
        channel.send_output(ExecutorOutput(sampled={"a": 7}, errors={"b": "bad"}))
    else:
        reply = channel.receive_output()
        got = [reply.sampled, reply.errors]
    got.append(channel.gather(rank * 10))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"got": got, "sizes": sizes}, f)
    dist.destroy_process_group()


def test_channel_frames_short_and_long_messages_and_the_output_reply(tmp_path):
    """Two real ranks over gloo: messages shorter and longer than one frame arrive whole."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_channel_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert one["got"][:-1] == one["sizes"]
    assert zero["got"][:2] == [{"a": 7}, {"b": "bad"}]
    assert zero["got"][-1] == one["got"][-1] == [0, 10]
