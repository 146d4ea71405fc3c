"""Multi-LoRA in the config, the core and the engine (docs/lora.md), with the strict fake
executor: the adapter keys and their errors, KV never shared across adapters, the
"at most engine.maxLoras adapters per step" rule with no starvation (a property test),
lanes matching on the model name, adapters loaded at start, hot reload add/remove, and an
unload that waits for the adapter's requests."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlane.runtime.config import ConfigError, RuntimeConfig, loads_config
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.entrypoints.routing import Caller, choose_lane
from tokenlane.runtime.executor.fake import FakeExecutor, make_config


def write_adapter(folder: Path, rank: int = 8, modules=("q_proj", "v_proj")) -> str:
    """A PEFT folder as far as the fake executor reads it: the config and a weights file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return str(folder)


def with_adapters(config: RuntimeConfig, adapters: dict[str, str], max_loras: int | None = None) -> RuntimeConfig:
    data = config.to_dict()
    data["model"]["adapters"] = [{"name": n, "path": p} for n, p in adapters.items()]
    if max_loras is not None:
        data["engine"]["maxLoras"] = max_loras
    return RuntimeConfig.from_dict(data)


def req(rid: str, prompt, adapter=None, max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   adapter=adapter)


def run_to_end(engine: LLMEngine, max_steps: int = 2000) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < max_steps, "requests did not finish"
    return steps


# ---------------------------------------------------------------- config


BASE = "model: {path: /m/base}\n"


def test_adapter_keys_parse_and_keep_older_restart_hashes():
    older = loads_config(BASE)
    assert "adapters" not in older.to_dict()["model"]
    assert "maxLoras" not in older.to_dict()["engine"]
    assert older.engine.lora_slots == 8 and older.engine.lora_max_rank == 64
    new = loads_config(BASE.replace("}", ", adapters: [{name: sql-lora, path: /a/sql}]}"))
    # Adding an adapter is a hot reload: the restart hash (the operator's pod-template hash) stays.
    assert new.restart_hash() == older.restart_hash()
    assert older.reloadable_changes_only(new)
    assert new.model.adapter_names == ["sql-lora"]
    bigger = loads_config(BASE + "engine: {maxLoras: 4, maxLoraRank: 16}\n")
    assert bigger.restart_hash() != older.restart_hash()  # slots are sized at start: restart
    assert (bigger.engine.lora_slots, bigger.engine.lora_max_rank) == (4, 16)


@pytest.mark.parametrize("text, key", [
    ("model: {path: /m/base, adapters: [{name: Bad_Name, path: /a}]}", "model.adapters[0].name"),
    ("model: {path: /m/base, adapters: [{name: a, path: /a}, {name: a, path: /b}]}", "duplicate adapter name"),
    ("model: {path: /m/base, servedName: tiny, adapters: [{name: tiny, path: /a}]}", "served model's own name"),
    ("model: {path: /m/base, adapters: [{name: a, path: ''}]}", "model.adapters[0].path"),
    ("model: {path: /m/base}\nengine: {maxLoras: 0}", "engine.maxLoras"),
    ("model: {path: /m/base}\nengine: {maxLoraRank: 100000}", "engine.maxLoraRank"),
    ("model: {path: /m/base}\ntenants: [{name: t, adapters: [BAD]}]", "tenants[0].adapters"),
    ("model: {path: /m/base}\nlanes: [{name: l, match: {models: x}}]", "lanes[0].match.models"),
])
def test_bad_adapter_keys_name_the_key(text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        loads_config(text)


# ---------------------------------------------------------------- core: the prefix cache


def test_prefix_cache_never_shares_kv_across_adapters():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))  # three full blocks and a bit
    first = req("a", prompt, adapter="sql")
    kv.allocate(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(first)
    assert kv.find_cached_prefix(req("same", prompt, adapter="sql")) == first.block_ids[:3]
    assert kv.find_cached_prefix(req("other", prompt, adapter="chat")) == []
    assert kv.find_cached_prefix(req("base", prompt)) == []


def test_engine_with_mixed_adapters_shares_prefixes_only_within_one(tmp_path):
    executor = FakeExecutor(num_kv_blocks=64, block_size=4)
    config = with_adapters(make_config(block_size=4), {
        "sql": write_adapter(tmp_path / "sql"), "chat": write_adapter(tmp_path / "chat", rank=16)})
    engine = LLMEngine(config, executor)
    prompt = list(range(100, 120))
    engine.add_request(req("first", prompt, "sql"))
    run_to_end(engine)
    for rid, adapter in (("again", "sql"), ("other", "chat"), ("base", None)):
        engine.add_request(req(rid, prompt, adapter))
    run_to_end(engine)  # the fake fails loudly on KV written under another adapter
    cached = {r.request_id: r.num_cached_tokens for r in executor.plans[-1].finished} or None
    finished = {c.request.request_id: c.request.num_cached_tokens for p in executor.plans for c in p.chunks}
    assert finished["again"] == 16 and finished["other"] == 0 and finished["base"] == 0, (finished, cached)
    assert engine.scheduler.kv.num_used_blocks == 0


# ---------------------------------------------------------------- core: adapter slots per step


@st.composite
def slot_scenarios(draw):
    max_loras = draw(st.integers(1, 3))
    num_adapters = draw(st.integers(max_loras, max_loras + 3))
    arrivals = draw(st.lists(
        st.tuples(st.integers(0, 30),  # arrival step
                  st.sampled_from([None] + [f"a{i}" for i in range(num_adapters)]),
                  st.integers(1, 12),  # prompt tokens
                  st.integers(1, 8),  # output tokens
                  st.integers(0, 1)),  # lane
        min_size=1, max_size=30))
    num_blocks = draw(st.integers(12, 40))
    return max_loras, num_adapters, arrivals, num_blocks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(scenario=slot_scenarios())
def test_at_most_max_loras_adapters_per_step_and_nobody_starves(tmp_path, scenario):
    """Random arrivals over more adapters than slots: every step runs at most maxLoras
    distinct adapters (the fake executor asserts it), every request finishes within a bound,
    requests of one adapter in one lane start in arrival order, and no block leaks."""
    max_loras, num_adapters, arrivals, num_blocks = scenario
    folders = {f"a{i}": write_adapter(tmp_path / f"a{i}") for i in range(num_adapters)}
    config = make_config(block_size=4, lanes=[{"name": "l0", "default": True}, {"name": "l1"}])
    config = with_adapters(config, folders, max_loras=max_loras)
    executor = FakeExecutor(num_kv_blocks=num_blocks, block_size=4, max_loras=max_loras)
    engine = LLMEngine(config, executor)
    by_step: dict[int, list] = {}
    for i, (at, adapter, prompt_len, out_len, lane) in enumerate(arrivals):
        by_step.setdefault(at, []).append((f"r{i}", adapter, prompt_len, out_len, f"l{lane}"))
    admitted: list[Request] = []
    step = 0
    while step <= 30 or engine.has_unfinished_requests():
        for rid, adapter, prompt_len, out_len, lane in by_step.get(step, []):
            request = req(rid, range(1, prompt_len + 1), adapter, out_len)
            request.lane = lane
            try:
                engine.add_request(request)
            except AdmissionError:
                continue
            admitted.append(request)
        engine.step()
        engine.scheduler.check_invariants()
        step += 1
        assert step < 31 + 40 * len(arrivals) + 100, "a request starved"
    assert executor.max_adapters_in_a_step <= max_loras
    assert all(r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) for r in admitted)
    for lane in ("l0", "l1"):  # FIFO within a lane
        firsts = [r.first_scheduled_time for r in admitted if r.lane == lane and r.num_preemptions == 0]
        assert firsts == sorted(firsts)
    assert engine.scheduler.kv.num_used_blocks == 0


def test_a_new_adapter_gets_the_next_slot_although_others_keep_coming(tmp_path):
    """maxLoras 1: adapter b's request (lane l1) waits while a runs; a's later arrivals in
    lane l0 keep coming every step, but none of them starts before b (a drains), so b does
    not starve."""
    config = make_config(block_size=4, lanes=[{"name": "l0", "default": True}, {"name": "l1"}])
    config = with_adapters(config, {"a": write_adapter(tmp_path / "a"), "b": write_adapter(tmp_path / "b")},
                           max_loras=1)
    executor = FakeExecutor(num_kv_blocks=64, block_size=4, max_loras=1)
    engine = LLMEngine(config, executor)
    engine.add_request(req("a0", range(1, 5), "a", max_tokens=6))
    engine.step()
    b = req("b", range(1, 5), "b", max_tokens=2)
    b.lane = "l1"
    engine.add_request(b)
    later = []
    for i in range(12):
        later.append(req(f"a{i + 1}", range(1, 5), "a", max_tokens=6))
        engine.add_request(later[-1])
        engine.step()
    run_to_end(engine)
    assert executor.max_adapters_in_a_step == 1
    first_step = {}
    for index, plan in enumerate(executor.plans):
        for chunk in plan.chunks:
            first_step.setdefault(chunk.request.request_id, index)
    assert all(first_step[r.request_id] > first_step["b"] for r in later), first_step


# ---------------------------------------------------------------- lanes match the model name


def test_lane_matches_model_name():
    config = loads_config(BASE + "lanes:\n  - {name: main, default: true}\n"
                                 "  - {name: sql, match: {models: [sql-lora]}}\n")
    who = Caller("default", (), None)
    assert choose_lane(config, who, {}, 10, model="sql-lora") == "sql"
    assert choose_lane(config, who, {}, 10, model="base") == "main"
    assert choose_lane(config, who, {}, 10) == "main"


# ---------------------------------------------------------------- the engine: load, reload, unload


def test_bad_adapter_at_start_is_a_config_error_naming_it(tmp_path):
    config = with_adapters(make_config(block_size=4), {"ok": write_adapter(tmp_path / "ok"),
                                                       "big": write_adapter(tmp_path / "big", rank=128)})
    with pytest.raises(ConfigError, match=r"model.adapters\[1\] \(big\).*rank 128 exceeds engine.maxLoraRank \(64\)"):
        LLMEngine(config, FakeExecutor(num_kv_blocks=16, block_size=4))
    missing = with_adapters(make_config(block_size=4), {"gone": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"\(gone\).*not a folder"):
        LLMEngine(missing, FakeExecutor(num_kv_blocks=16, block_size=4))


def test_reload_adds_and_removes_adapters_and_refuses_a_bad_one_whole(tmp_path):
    base = make_config(block_size=4)
    executor = FakeExecutor(num_kv_blocks=32, block_size=4)
    engine = LLMEngine(with_adapters(base, {"one": write_adapter(tmp_path / "one")}), executor)
    assert engine.adapter_names() == ["one"]
    engine.reload_config(with_adapters(base, {"one": str(tmp_path / "one"), "two": write_adapter(tmp_path / "two")}))
    engine.step()
    assert engine.adapter_names() == ["one", "two"] and sorted(executor.adapters) == ["one", "two"]
    # A bad adapter refuses the whole reload: the good one it also adds is not kept, the
    # scheduler change does not apply, and what was served stays served.
    bad = with_adapters(dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, max_batched_tokens=31)),
                        {"one": str(tmp_path / "one"), "two": str(tmp_path / "two"),
                         "three": write_adapter(tmp_path / "three"), "broken": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=r"broken"):
        engine.reload_config(bad)
    engine.step()
    assert engine.adapter_names() == ["one", "two"] and sorted(executor.adapters) == ["one", "two"]
    assert engine.config.scheduler.max_batched_tokens == 32
    engine.reload_config(with_adapters(base, {"two": str(tmp_path / "two")}))
    engine.step()
    assert engine.adapter_names() == ["two"] and sorted(executor.adapters) == ["two"]


def test_api_loaded_adapters_survive_reloads_and_unload_waits_for_requests(tmp_path):
    base = make_config(block_size=4)
    executor = FakeExecutor(num_kv_blocks=32, block_size=4)
    engine = LLMEngine(base, executor)
    engine.load_adapter("live", write_adapter(tmp_path / "live"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("live", str(tmp_path / "live"))
    engine.reload_config(dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, max_batched_tokens=30)))
    engine.step()
    assert engine.adapter_names() == ["live"]
    engine.add_request(req("r1", range(1, 9), "live", max_tokens=5))
    engine.step()
    engine.unload_adapter("live")
    assert engine.adapter_names() == []
    with pytest.raises(AdmissionError) as refused:
        engine.add_request(req("r2", range(1, 9), "live"))
    assert refused.value.status == 404 and refused.value.reason == "model_not_found"
    assert "live" in executor.adapters  # r1 still runs with it
    run_to_end(engine)
    assert "live" not in executor.adapters and not executor.unloaded_adapter_used
    assert engine.scheduler.requests == {} and engine.scheduler.kv.num_used_blocks == 0
    with pytest.raises(KeyError):
        engine.unload_adapter("live")


def test_snapshot_counts_requests_per_adapter(tmp_path):
    config = with_adapters(make_config(block_size=4), {"a": write_adapter(tmp_path / "a")}, max_loras=2)
    engine = LLMEngine(config, FakeExecutor(num_kv_blocks=32, block_size=4))
    engine.add_request(req("r1", range(1, 5), "a"))
    engine.add_request(req("r2", range(1, 5)))
    assert engine.snapshot().adapters == {"a": (0, 1)}
    engine.step()
    stats = engine.snapshot()
    assert stats.adapters == {"a": (1, 0)} and stats.max_loras == 2 and stats.block_size == 4


# ---------------------------------------------------------------- adapters from a source URI


def test_adapter_from_s3_is_fetched_into_the_adapter_cache(tmp_path, monkeypatch):
    """`path: s3://BUCKET/PREFIX` goes through tokenlane.runtime.sources (moto's S3 server on
    loopback): fetched into model.adapterCacheDir at load time; a prefix with nothing there
    is a config error naming the adapter."""
    import boto3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sources"))
    from s3_server import S3Server

    server = S3Server()
    server.start()
    try:
        for key, value in {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
        s3.create_bucket(Bucket="adapters")
        folder = Path(write_adapter(tmp_path / "local", rank=8))
        for path in folder.iterdir():
            s3.put_object(Bucket="adapters", Key=f"sql/{path.name}", Body=path.read_bytes())
        cache = tmp_path / "cache"
        config = with_adapters(make_config(block_size=4), {"sql": "s3://adapters/sql"})
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, adapter_cache_dir=str(cache)))
        executor = FakeExecutor(num_kv_blocks=16, block_size=4)
        engine = LLMEngine(config, executor)
        assert engine.adapter_names() == ["sql"] and executor.adapters["sql"].rank == 8
        assert [a.source for a in engine.served_adapters()] == ["s3://adapters/sql"]
        assert any(p.name == "adapter_config.json" for p in cache.rglob("*"))
        missing = with_adapters(make_config(block_size=4), {"gone": "s3://adapters/nothing-here"})
        missing = dataclasses.replace(missing, model=dataclasses.replace(missing.model, adapter_cache_dir=str(cache)))
        with pytest.raises(ConfigError, match=r"model.adapters\[0\] \(gone\).*cannot fetch s3://adapters/nothing-here"):
            LLMEngine(missing, FakeExecutor(num_kv_blocks=16, block_size=4))
    finally:
        server.stop()


# ---------------------------------------------------------------- metrics


def test_adapter_gauges_follow_the_served_adapters_and_lora_info_is_one_series():
    from tokenlane.runtime.core.stats import StepStats
    from tokenlane.runtime.observability.metrics import PrometheusMetrics

    metrics = PrometheusMetrics("base")
    metrics.set_occupancy(StepStats(kv_blocks_total=64, block_size=16, max_loras=4,
                                    adapters={"a": (2, 1), "b": (0, 3)}))
    metrics.set_occupancy(StepStats(kv_blocks_total=64, block_size=16, max_loras=4, adapters={"a": (1, 0)}))
    text = metrics.render().decode()
    assert 'tokenlane_adapter_requests_running{adapter="a",model="base"} 1.0' in text
    assert 'adapter="b"' not in text  # unloaded: its series are gone
    info = [line for line in text.splitlines() if line.startswith("tokenlane_lora_requests_info{")]
    assert len(info) == 1
    assert 'running_lora_adapters="a"' in info[0] and 'waiting_lora_adapters=""' in info[0]
    assert 'max_lora="4"' in info[0]
