"""LLMEngine: admission, outputs, stop strings, aborts, reloads, observers, static batching."""

from __future__ import annotations

import dataclasses

import pytest

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.llm_engine import LLMEngine, RestartRequired
from tokenlane.runtime.engine.output import OfflineFront
from tokenlane.runtime.core.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, make_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CharTokenizer:
    """Token i decodes to chr(i) (ASCII), enough to test text streaming and stop strings."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class Recorder:
    def __init__(self) -> None:
        self.steps = []
        self.finished = []
        self.configs = []

    def on_step(self, stats):
        self.steps.append(stats)

    def on_request_finished(self, request):
        self.finished.append((request.request_id, request.status, request.finish_detail))

    def on_config_applied(self, config, ok, message):
        self.configs.append((ok, message))


def make_engine(num_blocks=64, block_size=4, tokenizer=None, token_fn=None, eos=None, **kw):
    clock = Clock()
    config = make_config(block_size=block_size, max_model_len=kw.pop("max_model_len", 256), **kw)
    ex = FakeExecutor(num_blocks, block_size, eos_token_id=eos, token_fn=token_fn, max_model_len=None)
    engine = LLMEngine(config, ex, tokenizer=tokenizer, clock=clock)
    rec = Recorder()
    engine.add_observer(rec)
    return engine, ex, clock, rec


def req(rid, n=6, max_tokens=4, **kw):
    params = {k: kw.pop(k) for k in ("stop", "stop_token_ids", "ignore_eos") if k in kw}
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **params), **kw)


def drain(engine, clock=None, limit=1000):
    """Step an LLMEngine (token ids) or an OfflineFront (text too) until nothing runs."""
    outs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outs
        outs.extend(engine.step())
        getattr(engine, "engine", engine).scheduler.check_invariants()
        if clock is not None:
            clock.now += 0.01
    raise AssertionError("engine did not finish")


def test_outputs_stream_tokens_and_end_once():
    engine, ex, clock, rec = make_engine()
    engine.add_request(req("a", max_tokens=3))
    engine.add_request(req("b", n=9, max_tokens=2))
    outs = drain(engine, clock)
    for rid, n in (("a", 3), ("b", 2)):
        mine = [o for o in outs if o.request_id == rid]
        tokens = [t for o in mine for t in o.new_token_ids]
        assert len(tokens) == n
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason is FinishReason.LENGTH and mine[-1].finish_detail == "max_tokens"
        assert mine[-1].num_output_tokens == n
    assert {f[0] for f in rec.finished} == {"a", "b"}
    assert engine.scheduler.kv.num_free_blocks == 64
    assert rec.steps and rec.steps[0].num_prefill_tokens == 15


def test_each_output_field_comes_from_its_own_source():
    """The engine builds a step's outputs positionally (once per request and step): every
    field, by name, holds what it says, with values that differ from field to field."""
    engine, ex, clock, rec = make_engine()
    r = req("a", n=7, max_tokens=5, lane="default")
    engine.add_request(r)
    first = engine.step()  # the prompt: the first token
    clock.now += 0.5
    second = engine.step()
    (out,) = second
    assert out.request_id == "a" and out.lane == "default"
    assert out.new_token_ids == r.output_token_ids[-1:] and len(r.output_token_ids) == 2
    assert out.new_text == "" and out.finished is False and out.finish_reason is None and out.finish_detail == ""
    assert (out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens) == (7, 2, 0)
    assert out.new_logprobs is None and out.prompt_logprobs is None
    assert out.scheduled_at == r.first_scheduled_time == 100.0
    assert first[0].num_output_tokens == 1
    # With logprobs: the sampled token's on every output, the prompt's on the first only.
    scored = Request("s", [5, 6, 7, 8], SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=0))
    engine.add_request(scored)
    (first,) = [o for o in engine.step() if o.request_id == "s"]
    (second,) = [o for o in engine.step() if o.request_id == "s"]
    assert first.new_logprobs == scored.output_logprobs[:1] and len(first.prompt_logprobs) == 4
    assert second.new_logprobs == scored.output_logprobs[1:2] and second.prompt_logprobs is None


def test_timestamps_follow_the_clock():
    engine, ex, clock, rec = make_engine()
    r = req("a", max_tokens=3, arrival_time=clock.now)
    engine.add_request(r)
    drain(engine, clock)
    assert r.first_scheduled_time == 100.0
    assert r.first_token_time == 100.0
    assert r.token_times == pytest.approx([100.0, 100.01, 100.02])
    assert r.finish_time == pytest.approx(100.02)


def test_admission_too_long_and_invalid():
    engine, ex, clock, rec = make_engine(num_blocks=8, max_model_len=64)
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("long", n=60, max_tokens=10))
    assert (e.value.status, e.value.reason) == (400, "too_long")
    with pytest.raises(AdmissionError) as e:  # fits the model length, not the 32-token pool
        engine.add_request(req("big", n=30, max_tokens=10))
    assert (e.value.status, e.value.reason) == (400, "too_long")
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("lane", lane="nope"))
    assert (e.value.status, e.value.reason) == (400, "invalid")
    with pytest.raises(AdmissionError) as e:
        engine.add_request(Request("empty", [], SamplingParams()))
    assert e.value.reason == "invalid"
    engine.add_request(req("ok"))
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("ok"))
    assert e.value.reason == "invalid"
    # Observers count every rejection, with its reason.
    assert [(f[0], f[2]) for f in rec.finished] == [
        ("long", "too_long"), ("big", "too_long"), ("lane", "invalid"), ("empty", "invalid"),
        ("ok", "invalid"),
    ]


def test_admission_queue_full_global_and_per_lane():
    lanes = [{"name": "a", "default": True, "maxWaitingRequests": 2}, {"name": "b"}]
    engine, *_ = make_engine(lanes=lanes, max_waiting_requests=3)
    engine.add_request(req("a1", lane="a"))
    engine.add_request(req("a2", lane="a"))
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("a3", lane="a"))
    assert (e.value.status, e.value.reason) == (429, "queue_full") and e.value.retry_after_s
    engine.add_request(req("b1", lane="b"))
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("b2", lane="b"))
    assert (e.value.status, e.value.reason) == (429, "queue_full")
    engine.step()  # they start running: the queue has room again
    engine.add_request(req("b2", lane="b"))


def test_admission_kv_reject_watermark():
    engine, ex, clock, rec = make_engine(num_blocks=10, kv_cache_high_watermark=0.5,
                                         kv_cache_reject_watermark=0.6, prefill_chunk_size=32)
    engine.add_request(req("big", n=24, max_tokens=4))
    engine.step()
    assert engine.scheduler.kv.usage >= 0.6
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("more"))
    assert (e.value.status, e.value.reason) == (503, "kv_watermark")


def test_admission_deadline_from_measured_step_times():
    engine, ex, clock, rec = make_engine()
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("past", deadline=clock.now - 1))
    assert (e.value.status, e.value.reason) == (429, "deadline")
    # Before any step is measured only a past deadline is refused.
    engine.add_request(req("early", max_tokens=50, deadline=clock.now + 0.001))
    engine.add_request(req("warm", max_tokens=5))
    drain(engine, clock)
    assert [f[2] for f in rec.finished[-2:]] == ["deadline", "max_tokens"]
    assert engine.estimator.decode_step_s == pytest.approx(0.01)
    # Exactly 20 tokens (ignore_eos) at 10 ms per decode step cannot finish within 50 ms.
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("tight", max_tokens=20, ignore_eos=True, deadline=clock.now + 0.05))
    assert e.value.reason == "deadline" and "cannot be met" in e.value.message
    # The same request may stop early (EOS) and make it: admitted.
    engine.add_request(req("may-stop", max_tokens=20, deadline=clock.now + 0.05))
    engine.add_request(req("loose", max_tokens=20, ignore_eos=True, deadline=clock.now + 1.0))
    # Not even the first token fits.
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("hopeless", max_tokens=2, deadline=clock.now + 0.005))
    assert e.value.reason == "deadline"


def test_abort_frees_blocks_in_the_next_step():
    engine, ex, clock, rec = make_engine()
    engine.add_request(req("a", max_tokens=50))
    engine.add_request(req("w", max_tokens=50))
    engine.step()
    assert engine.scheduler.kv.num_used_blocks > 0
    engine.abort_request("a")
    engine.abort_request("w")
    engine.abort_request("unknown")  # harmless
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished} == {"a", "w"}
    assert all(o.finish_reason is FinishReason.CANCELLED for o in outs if o.finished)
    assert engine.scheduler.kv.num_free_blocks == 64
    assert not engine.has_unfinished_requests()
    # The executor is told to drop the aborted requests' state with the next plan.
    engine.add_request(req("c", max_tokens=2))
    engine.step()
    assert {"a", "w"} <= ex.dropped


def test_abort_of_a_request_staged_in_the_same_step():
    engine, ex, clock, rec = make_engine()
    engine.add_request(req("a"))
    engine.abort_request("a")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.new_token_ids) for o in outs] == [("a", True, [])]


def text_tokens(text):
    return lambda rid, pos: ord(text[pos - 6]) if pos - 6 < len(text) else ord("~")


def test_stop_string_truncates_and_never_leaks_its_prefix():
    engine, ex, clock, rec = make_engine(tokenizer=CharTokenizer(), token_fn=text_tokens("hello END there"))
    front = OfflineFront(engine)
    front.add_request(request := req("a", max_tokens=30, stop=["END"]))
    outs = drain(front, clock)
    text = "".join(o.new_text for o in outs)
    assert text == "hello "
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.STOP
    assert final.finish_detail == "stop_string"
    # "E" and "EN" were held back while they could start the stop string.
    assert [o.new_text for o in outs][5:8] == [" ", "", ""]
    # The front end's stop ended the request in the engine at the next step: no token past it.
    assert engine.scheduler.kv.num_free_blocks == 64
    assert rec.finished == [("a", RequestStatus.FINISHED_STOPPED, "stop_string")]
    assert request.num_output_tokens == len("hello END") and front.processor.num_tracked == 0


def test_held_back_text_is_released_when_not_a_stop():
    engine, ex, clock, rec = make_engine(tokenizer=CharTokenizer(), token_fn=text_tokens("abENx"))
    front = OfflineFront(engine)
    front.add_request(req("a", max_tokens=5, stop=["END"]))
    outs = drain(front, clock)
    assert "".join(o.new_text for o in outs) == "abENx"
    assert outs[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("text,stop", [
    ("abababcx", ["ababc"]),          # self-overlapping: "abab" held, then "ab" released
    ("aaaaaaaaab", ["aaab", "zz"]),
    ("xyxyxyxyq", ["xyxyz", "yxq"]),
    ("mississippi", ["issip", "ssi"]),
    ("a" * 60 + "b", ["a" * 40 + "c"]),  # a long stop string is as cheap per token as a short one
])
def test_hold_back_is_exactly_the_longest_partial_stop_string(text, stop):
    engine, ex, clock, rec = make_engine(tokenizer=CharTokenizer(), token_fn=text_tokens(text))
    front = OfflineFront(engine)
    front.add_request(req("a", max_tokens=len(text), stop=stop))
    outs = drain(front, clock)
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    assert "".join(o.new_text for o in outs) == text[:cut]
    sent = ""
    for i, o in enumerate(outs[:-1]):
        sent += o.new_text
        seen = text[: i + 1]
        hold = max((k for s in stop for k in range(len(s)) if seen.endswith(s[:k])), default=0)
        assert sent == seen[: len(seen) - hold], (i, sent)


def test_eos_stop_tokens_and_ignore_eos():
    engine, ex, clock, rec = make_engine(token_fn=lambda rid, pos: 2 if pos == 8 else 5, eos=2)
    engine.add_request(req("eos", max_tokens=10))
    engine.add_request(req("ignore", max_tokens=4, ignore_eos=True))
    engine.add_request(req("stoptok", max_tokens=10, stop_token_ids=[5]))
    drain(engine, clock)
    by = {f[0]: f for f in rec.finished}
    assert by["eos"][1:] == (RequestStatus.FINISHED_STOPPED, "eos")
    assert by["ignore"][1:] == (RequestStatus.FINISHED_LENGTH, "max_tokens")
    assert by["stoptok"][1:] == (RequestStatus.FINISHED_STOPPED, "stop_token")


def test_max_model_len_finishes_with_length():
    engine, ex, clock, rec = make_engine(max_model_len=10)
    r = req("a", n=6, max_tokens=4)
    engine.add_request(r)
    drain(engine, clock)
    assert r.num_tokens == 10 and r.status is RequestStatus.FINISHED_LENGTH


def test_reload_applies_at_step_boundary_and_refuses_restart_fields():
    engine, ex, clock, rec = make_engine(max_active_sequences=1)
    for i in range(3):
        engine.add_request(req(f"r{i}", max_tokens=20))
    engine.step()
    assert engine.scheduler.num_running == 1
    new = dataclasses.replace(
        engine.config, scheduler=dataclasses.replace(engine.config.scheduler, max_active_sequences=3)
    )
    engine.reload_config(new)
    assert engine.config.scheduler.max_active_sequences == 1  # not yet
    engine.step()
    assert engine.config is new and engine.scheduler.num_running == 3
    assert rec.configs == [(True, "applied at step boundary")]
    bad = dataclasses.replace(new, engine=dataclasses.replace(new.engine, block_size=8))
    with pytest.raises(RestartRequired, match="blockSize") as refused:
        engine.reload_config(bad)
    assert refused.value.changed == ["engine.blockSize"]
    assert str(refused.value).startswith("engine fields changed and need a restart")
    assert rec.configs[-1][0] is False
    drain(engine, clock)


def test_static_batching_engine():
    engine, ex, clock, rec = make_engine(continuous_batching=False, max_active_sequences=2)
    for i in range(4):
        engine.add_request(req(f"r{i}", max_tokens=3 if i % 2 else 1))
    drain(engine, clock)
    first_chunk = {}
    last_chunk = {}
    for n, plan in enumerate(ex.plans):
        for c in plan.chunks:
            first_chunk.setdefault(c.request.request_id, n)
            last_chunk[c.request.request_id] = n
    assert min(first_chunk["r2"], first_chunk["r3"]) > max(last_chunk["r0"], last_chunk["r1"])


def test_executor_failure_errors_the_step_not_the_engine():
    engine, ex, clock, rec = make_engine()
    engine.add_request(req("a", max_tokens=3))
    ex.fail_next = RuntimeError("device lost")
    outs = engine.step()
    assert outs[0].finish_reason is FinishReason.ERROR and "device lost" in outs[0].finish_detail
    engine.add_request(req("b", max_tokens=2))
    drain(engine, clock)
    assert engine.scheduler.kv.num_free_blocks == 64
    # A persistently failing executor raises (the async front marks itself unhealthy).
    for i in range(3):
        engine.add_request(req(f"x{i}"))
        ex.fail_next = RuntimeError("still broken")
        if i < 2:
            engine.step()
    with pytest.raises(RuntimeError):
        engine.step()


def test_a_request_that_breaks_the_executor_fails_alone_and_never_stops_the_engine():
    """The step is re-run in halves until the poisoned chunk stands alone: it ends as an
    error, the other requests of the same steps get exactly their usual tokens, and a
    stream of such requests (one new every step) never trips the broken-executor limit."""
    engine, ex, clock, rec = make_engine()
    execute = ex.execute

    def poisoned(plan):
        if any(c.request.request_id.startswith("bad") for c in plan.chunks):
            raise ValueError("poisoned input")
        return execute(plan)

    ex.execute = poisoned
    for i in range(4):
        engine.add_request(req(f"good{i}", n=5 + i, max_tokens=12))
    outs = []
    for step in range(8):
        engine.add_request(req(f"bad{step}", n=3))
        outs += engine.step()
        engine.scheduler.check_invariants()
        clock.now += 0.01
    outs += drain(engine, clock)
    final = {o.request_id: o for o in outs if o.finished}
    for i in range(4):
        o = final[f"good{i}"]
        assert o.finish_reason is FinishReason.LENGTH and o.num_output_tokens == 12
        tokens = [t for x in outs if x.request_id == f"good{i}" for t in x.new_token_ids]
        assert tokens == [ex.token_fn(f"good{i}", 5 + i + k) for k in range(12)]
    for step in range(8):
        o = final[f"bad{step}"]
        assert o.finish_reason is FinishReason.ERROR and "poisoned input" in o.finish_detail
    assert engine.scheduler.kv.num_free_blocks == 64
    # A transient failure of a whole batch is retried in halves: nobody fails.
    engine.add_request(req("c1"))
    engine.add_request(req("c2"))
    ex.fail_next = RuntimeError("transient")
    outs = drain(engine, clock)
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs if o.finished)


def test_prompt_token_ids_outside_the_vocabulary_are_refused_at_admission():
    engine, ex, clock, rec = make_engine()  # FakeExecutor vocabulary: [0, 1000)
    for prompt in ([5, 1000], [-1, 5]):
        with pytest.raises(AdmissionError) as e:
            engine.add_request(Request(f"bad{prompt[0]}", prompt, SamplingParams()))
        assert e.value.status == 400 and e.value.reason == "invalid" and "vocabulary" in e.value.message
    assert [f[1] for f in rec.finished] == [RequestStatus.FINISHED_REJECTED] * 2
    assert not engine.has_unfinished_requests()


def test_a_detokenizer_failure_ends_only_that_request():
    class Fragile(CharTokenizer):
        def decode(self, ids, **kw):
            if 126 in ids:  # "~": a token this tokenizer cannot decode
                raise ValueError("undecodable")
            return super().decode(ids, **kw)

    engine, ex, clock, rec = make_engine(tokenizer=Fragile(),
                                         token_fn=lambda rid, pos: 126 if rid == "bad" else 97)
    front = OfflineFront(engine)
    front.add_request(req("bad", max_tokens=5))
    front.add_request(req("good", max_tokens=5))
    outs = drain(front, clock)
    final = {o.request_id: o for o in outs if o.finished}
    assert final["bad"].finish_reason is FinishReason.ERROR and "undecodable" in final["bad"].finish_detail
    assert final["good"].finish_reason is FinishReason.LENGTH
    assert "".join(o.new_text for o in outs if o.request_id == "good") == "aaaaa"
    assert engine.scheduler.kv.num_free_blocks == 64


def test_snapshot_and_step_stats():
    lanes = [{"name": "a", "default": True}, {"name": "b"}]
    engine, ex, clock, rec = make_engine(lanes=lanes, max_active_sequences=1)
    engine.add_request(req("a1", lane="a", max_tokens=5))
    engine.add_request(req("b1", lane="b"))
    snap = engine.snapshot()
    assert snap.lanes["a"].waiting == 1 and snap.lanes["b"].waiting == 1
    engine.step()
    snap = engine.snapshot()
    assert snap.kv_blocks_total == 64 and snap.kv_blocks_free == 62
    assert snap.kv_usage == pytest.approx(2 / 64)
    assert (snap.lanes["a"].running, snap.lanes["b"].waiting) == (1, 1)
    stats = rec.steps[-1]
    assert stats.num_batched_tokens == 6 and stats.lanes["a"].scheduled_tokens == 6
    assert stats.prefix_cache_queries == 6 and stats.schedule_seconds > 0


def test_prefix_cache_hits_reported():
    engine, ex, clock, rec = make_engine()
    engine.add_request(req("a", n=12, max_tokens=1))
    drain(engine, clock)
    engine.add_request(req("b", n=12, max_tokens=1))
    outs = drain(engine, clock)
    assert outs[-1].num_cached_tokens == 8
    assert rec.steps[-1].prefix_cache_hits == 8


def test_from_config_model_streams_text_that_matches_the_tokens(tiny_model_dir):
    """The real model executor and tokenizer behind `from_config`: streamed text deltas add
    up to the decoded output, and a stop string cuts the text and frees the blocks."""
    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig

    config = RuntimeConfig(
        model=ModelConfig(path=str(tiny_model_dir), dtype="float32", max_model_len=256),
        engine=EngineConfig(kv_cache_blocks=64, block_size=4, device="cpu"),
        scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk_size=16, max_active_sequences=8),
    )
    engine = LLMEngine.from_config(config)
    front = OfflineFront(engine)
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox", add_special_tokens=True)
    front.add_request(Request("plain", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                               ignore_eos=True)))
    outs = drain(front)
    text = "".join(o.new_text for o in outs)
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == 12
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    assert full == tok.decode(prompt, skip_special_tokens=True) + text
    # Stop on a piece of what the model says anyway: cut there.
    assert len(text) >= 2
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    front.add_request(Request("stop", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                              ignore_eos=True, stop=[stop])))
    outs = drain(front)
    cut = "".join(o.new_text for o in outs)
    assert cut == text[: text.index(stop)]
    assert outs[-1].finish_detail == "stop_string"
    assert engine.scheduler.kv.num_free_blocks == 64


def test_from_config_simulated_executor():
    from tokenlane.runtime.executor.simulated import VirtualClock

    config = make_config(max_model_len=4096)
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, executor="simulated", kv_cache_blocks=256))
    clock = VirtualClock()
    engine = LLMEngine.from_config(config, clock=clock)
    assert engine.tokenizer is None
    engine.add_request(Request("a", list(range(3, 40)), SamplingParams(max_tokens=5), arrival_time=0.0))
    outs = drain(engine)
    assert outs[-1].finished and outs[-1].num_output_tokens == 5


def test_reload_of_scheduler_max_model_len_applies():
    engine, ex, clock, rec = make_engine(max_model_len=256)
    assert engine.max_model_len == 256
    new = dataclasses.replace(
        engine.config, scheduler=dataclasses.replace(engine.config.scheduler, max_model_len=32)
    )
    engine.reload_config(new)
    engine.step()
    assert engine.max_model_len == 32
    with pytest.raises(AdmissionError) as e:
        engine.add_request(req("long", n=30, max_tokens=10))
    assert e.value.reason == "too_long"
