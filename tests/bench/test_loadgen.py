"""The load generator against a real `tokenlane serve` (tiny model, uvicorn on 127.0.0.1)."""

from __future__ import annotations

import pytest

from tokenlane.bench import report
from tokenlane.bench.loadgen import Target, check_loopback, run_load
from tokenlane.bench.trace import PlannedRequest, Traffic, TrafficSpec


def test_only_loopback_targets():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("http://10.1.2.3:8000")
    with pytest.raises(ValueError, match="http"):
        check_loopback("127.0.0.1:8000")


def _traffic(requests):
    return Traffic(requests, "test", TrafficSpec())


async def test_records_latencies_lanes_cancellations_and_rejections(tiny_server):
    reqs = [
        PlannedRequest(0, 0.0, "interactive", "default", prompt_tokens=20, max_tokens=12),
        PlannedRequest(1, 0.05, None, "default", prompt_tokens=30, max_tokens=8, stream=False),
        PlannedRequest(2, 0.1, "interactive", "default", prompt_tokens=10, max_tokens=40, cancel_after_tokens=3),
        PlannedRequest(3, 0.1, "interactive", "default", prompt_tokens=10, max_tokens=6, deadline_ms=60000),
        PlannedRequest(4, 0.15, "no-such-lane", "default", prompt_tokens=10, max_tokens=4),
        PlannedRequest(5, 0.2, "interactive", "default", prompt_tokens=2000, max_tokens=4),  # > maxModelLen
    ]
    # A burst on the batch lane from a tenant whose token bucket holds one prompt (conftest).
    reqs += [PlannedRequest(6 + i, 0.3, "batch", "burst", prompt_tokens=8, max_tokens=30, stream=False)
             for i in range(6)]
    res = await run_load(Target(tiny_server.url), _traffic(reqs), "t", progress=False,
                         slos={"interactive": report.LaneSLO(ttft_ms=5000)}, time_limit_s=60)
    by = {r.index: r for r in res.records}
    assert len(by) == len(reqs)
    ok = by[0]
    assert ok.outcome == report.OK and ok.lane == "interactive" and ok.http_status == 200
    assert ok.output_tokens == 12 and ok.prompt_tokens == 20
    assert 0 < ok.ttft_s <= ok.e2e_s and ok.tpot_s > 0
    assert by[1].outcome == report.OK and by[1].lane == "interactive"  # routed by the server
    assert by[1].output_tokens == 8 and by[1].ttft_s is None and by[1].e2e_s > 0
    assert by[2].outcome == report.CANCELLED and by[2].output_tokens < 40
    assert by[3].outcome == report.OK
    assert by[4].outcome == report.REJECTED and by[4].http_status == 400 and by[4].reason == "unknown_lane"
    assert by[5].outcome == report.REJECTED and by[5].http_status == 400
    batch = [by[i] for i in range(6, 12)]
    # One is admitted; the bucket refuses the other five (it refills in 36 s, not within the burst).
    assert sum(r.outcome == report.OK for r in batch) == 1
    refused = [r for r in batch if r.outcome == report.REJECTED]
    assert len(refused) == 5
    assert all(r.http_status == 429 and r.reason == "tenant_rate_limit" for r in refused)
    assert all(r.lane == "batch" for r in batch)
    s = report.summarize(res)
    assert s["lanes"]["batch"]["rejections"]["tenant_rate_limit"] == 5
    assert s["lanes"]["interactive"]["cancellations"] == 1
    assert sum(res.token_bins.values()) >= 12 + 8 + 6
    # Queue delay comes from the server's X-Queue-Delay-Ms header when it sends one.
    if ok.queue_delay_s is not None:
        assert 0 <= ok.queue_delay_s <= ok.ttft_s


async def test_time_limit_bounds_the_run(tiny_server):
    reqs = [PlannedRequest(0, 0.0, None, "default", 5, 4), PlannedRequest(1, 30.0, None, "default", 5, 4)]
    res = await run_load(Target(tiny_server.url), _traffic(reqs), "t", progress=False, time_limit_s=3)
    assert [r.index for r in res.records] == [0]
    assert res.extra["unfinished_at_time_limit"] == 1


def test_bench_run_cli_writes_json_and_png(tiny_server, tmp_path, capsys):
    import json

    from tokenlane.bench.cli import main

    code = main(["run", "--url", tiny_server.url, "--out", str(tmp_path), "--duration", "2", "--rate", "3",
                 "--lane", "interactive:1:short:short", "--max-output-tokens", "8", "--no-progress", "--seed", "1"])
    assert code == 0
    doc = json.loads((tmp_path / "bench-run.json").read_text())
    assert doc["phases"][0]["lanes"]["interactive"]["outcomes"]["ok"] >= 1
    assert (tmp_path / "bench-run.png").exists()
    assert "interactive" in capsys.readouterr().out
