"""The flight recorder on a real LLMEngine with the fake executor: what each step entry
holds (exact per-lane token counts), the ring's bound, `since`, refusals, reloads, dumps."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.observability.flight_recorder import (FlightRecorder, config_hash, dump_document_json, parse_since,
                                               write_dump)
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock

LANES = [
    {"name": "interactive", "default": True, "priority": 100, "weight": 4},
    {"name": "batch", "priority": 10, "weight": 1},
]


def make_engine(capacity=4096, num_blocks=64, wall=None, **scheduler):
    config = make_config(lanes=LANES, max_model_len=256, **scheduler)
    engine = LLMEngine(config, FakeExecutor(num_blocks, 4, max_model_len=None), clock=Clock(100.0))
    recorder = FlightRecorder(capacity, config, wall_clock=wall or Clock(1_764_000_000.0))
    engine.add_observer(recorder)
    return engine, recorder


def req(rid, prompt_len, max_tokens, lane):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lane=lane)


def run_until_idle(engine, limit=100):
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


def test_each_step_records_per_lane_tokens_queues_and_kv():
    # 32 tokens a step, prefill chunks of at most 16.
    engine, recorder = make_engine()
    engine.add_request(req("a", 20, 3, "interactive"))
    engine.add_request(req("b", 6, 2, "batch"))
    run_until_idle(engine)
    steps = recorder.entries()
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    lanes = [{name: (lane["prefill_tokens"], lane["decode_tokens"]) for name, lane in s["lanes"].items()}
             for s in steps]
    assert lanes == [
        {"interactive": (16, 0), "batch": (6, 0)},  # a's first chunk; all of b's prompt (b samples)
        {"interactive": (4, 0), "batch": (0, 1)},  # a's last chunk (a samples); b's 2nd token: done
        {"interactive": (0, 1), "batch": (0, 0)},
        {"interactive": (0, 1), "batch": (0, 0)},  # a's 3rd token: done
    ]
    first, second, last = steps[0], steps[1], steps[-1]
    assert first["lanes"]["interactive"] == {"prefill_tokens": 16, "decode_tokens": 0, "running": 1, "waiting": 0,
                                             "queued": 1, "started": 1, "preempted": 0}
    assert first["lanes"]["batch"]["queued"] == first["lanes"]["batch"]["started"] == 1
    assert (first["batched_tokens"], first["prefill_tokens"], first["decode_tokens"]) == (22, 22, 0)
    # Blocks of 4 tokens: a holds 4 (16 tokens), b 2 (6 tokens) after step 1.
    assert first["kv"]["blocks_used"] == 6 and first["kv"]["blocks_free"] == 58
    assert first["kv"]["blocks_total"] == 64 and first["kv"]["usage"] == pytest.approx(6 / 64)
    assert first["kv"]["high_watermark"] == engine.config.scheduler.kv_cache_high_watermark
    assert second["finished"] == {"batch": {"max_tokens": 1}} and second["lanes"]["batch"]["running"] == 0
    assert last["finished"] == {"interactive": {"max_tokens": 1}} and last["kv"]["blocks_used"] == 0
    assert all(s["refusals"] == {} and s["preemptions"] == 0 for s in steps)
    assert {s["config_hash"] for s in steps} == {config_hash(engine.config)}
    assert {s["restart_hash"] for s in steps} == {engine.config.restart_hash()}
    assert all(s["duration_s"] == pytest.approx(s["execute_s"] + s["schedule_s"]) for s in steps)


def test_the_ring_keeps_only_the_last_steps():
    engine, recorder = make_engine(capacity=3)
    engine.add_request(req("a", 4, 10, "interactive"))
    run_until_idle(engine)  # 10 steps: one prefill that samples, then 9 decodes
    assert len(recorder) == 3 and recorder.last_step == 10
    assert [s["step"] for s in recorder.entries()] == [8, 9, 10]


def test_since_takes_a_step_id_or_a_unix_time():
    wall = Clock(1_764_000_000.0)
    engine, recorder = make_engine(wall=wall)
    engine.add_request(req("a", 4, 5, "interactive"))
    for _ in range(5):
        engine.step()
        wall.now += 1.0  # steps recorded at ...000, ...001, ..., ...004
    assert [s["step"] for s in recorder.entries(since=3)] == [4, 5]
    assert [s["step"] for s in recorder.entries(since=0)] == [1, 2, 3, 4, 5]
    assert [s["step"] for s in recorder.entries(since=1_764_000_002.5)] == [4, 5]
    assert recorder.entries(since=5) == []
    lines = recorder.jsonl(since=3).splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 5]
    assert parse_since(None) is None and parse_since("12") == 12.0
    for bad in ("abc", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="since"):
            parse_since(bad)


def test_refusals_are_counted_with_their_reason_in_the_next_step():
    engine, recorder = make_engine(max_waiting_requests=1)
    engine.add_request(req("a", 4, 2, "interactive"))
    for rid in ("b", "c"):
        with pytest.raises(AdmissionError):
            engine.add_request(req(rid, 4, 2, "batch"))  # the server's queue holds one
    engine.step()
    entry = recorder.entries()[-1]
    assert entry["refusals"] == {"batch": {"queue_full": 2}}
    engine.step()
    assert recorder.entries()[-1]["refusals"] == {}  # counted once, in the step after


def test_preemptions_are_recorded_per_lane():
    # 12 blocks of 4 tokens: three requests growing to 20 tokens each cannot all stay.
    engine, recorder = make_engine(num_blocks=12, kv_cache_high_watermark=0.99, kv_cache_reject_watermark=1.0)
    for rid, lane in (("a", "interactive"), ("b", "batch"), ("c", "batch")):
        engine.add_request(req(rid, 8, 12, lane))
    run_until_idle(engine, limit=200)
    steps = recorder.entries()
    total = sum(s["preemptions"] for s in steps)
    assert total == engine.scheduler.num_preemptions_total > 0
    assert all(s["preemptions"] == sum(lane["preempted"] for lane in s["lanes"].values()) for s in steps)
    assert sum(s["lanes"]["interactive"]["preempted"] for s in steps) == 0  # the high-priority lane keeps its blocks


def test_a_reload_changes_the_recorded_config_hash():
    engine, recorder = make_engine()
    engine.add_request(req("a", 4, 4, "interactive"))
    engine.step()
    before = recorder.entries()[-1]
    new = dataclasses.replace(engine.config, scheduler=dataclasses.replace(engine.config.scheduler,
                                                                           kv_cache_high_watermark=0.5))
    engine.reload_config(new)
    engine.step()
    after = recorder.entries()[-1]
    assert after["config_hash"] == config_hash(new) != before["config_hash"]
    assert after["restart_hash"] == before["restart_hash"]  # a hot change
    assert after["kv"]["high_watermark"] == 0.5


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        FlightRecorder(0)


def test_write_dump_writes_one_json_file(tmp_path):
    path = write_dump(tmp_path / "dumps", steps=[{"step": 1}], metrics_text="m 1\n", config_text="model: {}\n",
                      reason="test")
    document = json.loads(path.read_text())
    assert path.parent == tmp_path / "dumps" and path.name.startswith("tokenlane-dump-")
    assert document["steps"] == [{"step": 1}] and document["metrics"] == "m 1\n"
    assert document["config"] == "model: {}\n" and document["reason"] == "test"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError):
        write_dump(blocker, steps=[], metrics_text="", config_text="", reason="test")


def test_dump_text_is_json_dumps_of_the_document_encoded_step_by_step():
    steps = [{"step": i, "lanes": {"a": [i, 0.5], "b\u00e9": None}, "x": float(i) / 3} for i in range(5)]
    fields = dict(reason='rollback "r1"', time=1764553200.123, pid=42, steps=steps, metrics="m 1\n",
                  config="model: {}\n")
    assert dump_document_json(**fields) == json.dumps(fields, separators=(",", ":"))
    assert dump_document_json(**{**fields, "steps": iter([])}) == json.dumps({**fields, "steps": []},
                                                                            separators=(",", ":"))


def test_bench_report_draws_a_timeline_of_recorded_steps(tmp_path, capsys):
    from tokenlane.bench import cli
    from tokenlane.runtime.observability.flight_recorder import read_steps

    engine, recorder = make_engine(num_blocks=12, kv_cache_high_watermark=0.99, kv_cache_reject_watermark=1.0)
    for rid, lane in (("a", "interactive"), ("b", "batch"), ("c", "batch")):
        engine.add_request(req(rid, 8, 12, lane))
    run_until_idle(engine, limit=200)
    jsonl = tmp_path / "steps.jsonl"
    jsonl.write_text(recorder.jsonl())
    dump = write_dump(tmp_path, steps=recorder.entries(), metrics_text="", config_text="", reason="test")
    assert read_steps(jsonl) == read_steps(dump) == recorder.entries()

    assert cli.main(["report", "--steps", str(jsonl), "--out", str(tmp_path / "out")]) == 0
    png = tmp_path / "out" / "steps-timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert f"{len(recorder)} steps (1..{recorder.last_step})" in printed
    assert f"{engine.scheduler.num_preemptions_total} preemptions" in printed and str(png) in printed

    not_steps = tmp_path / "other.json"
    not_steps.write_text('{"results": []}')
    assert cli.main(["report", "--steps", str(not_steps), "--out", str(tmp_path / "out")]) == 2
    assert "not flight recorder steps" in capsys.readouterr().err
