"""Per-tenant token-rate limits: the token bucket (a fake clock, never a sleep) and the engine's
admission with it (429 `tenant_rate_limit`, prompt charged at admission, output as produced)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.config import RuntimeConfig, TenantConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.tenant_limits import TenantRateLimiter, TokenBucket
from tokenlane.runtime.executor.fake import FakeExecutor, make_config
from tokenlane.runtime.executor.simulated import VirtualClock as Clock


# (tokens per minute, charges before as (time, tokens), ask at (time, tokens), expected wait s)
BUCKET_CASES = [
    (600, [], (0.0, 600), 0.0),  # starts full
    (600, [], (0.0, 601), 0.0),  # more than a minute's worth waits for a full bucket only
    (600, [(0.0, 600)], (0.0, 10), 1.0),  # empty: 10 tokens at 10/s
    (600, [(0.0, 600)], (0.5, 10), 0.5),  # refilled 5 since
    (600, [(0.0, 600)], (1.0, 10), 0.0),  # exactly enough
    (600, [(0.0, 900)], (0.0, 100), 40.0),  # 300 in debt (output beyond the budget) + 100
    (600, [(0.0, 100)], (1000.0, 600), 0.0),  # refill stops at the bucket's size
    (600, [(0.0, 100), (1000.0, 600)], (1000.0, 1), 0.1),  # ... so it cannot bank more
    (60, [(0.0, 60)], (0.0, 1000), 60.0),  # a prompt over the whole budget: a full minute
]


@pytest.mark.parametrize("rate,charges,ask,wait", BUCKET_CASES)
def test_token_bucket(rate, charges, ask, wait):
    bucket = TokenBucket(rate, now=0.0)
    for when, tokens in charges:
        bucket.charge(tokens, when)
    assert bucket.seconds_until(ask[1], ask[0]) == pytest.approx(wait)


def test_token_bucket_rejects_a_non_positive_rate():
    with pytest.raises(ValueError, match="tokensPerMinute"):
        TokenBucket(0, now=0.0)


def test_limiter_reload_keeps_levels_and_drops_removed_limits():
    limiter = TenantRateLimiter([TenantConfig(name="a", tokens_per_minute=600)], now=0.0)
    limiter.charge("a", 600, now=0.0)
    assert limiter.retry_after("a", 10, now=0.0) == pytest.approx(1.0)
    # Halving the rate keeps the (empty) level: 10 tokens now take 2 s.
    limiter.configure([TenantConfig(name="a", tokens_per_minute=300)], now=0.0)
    assert limiter.retry_after("a", 10, now=0.0) == pytest.approx(2.0)
    limiter.configure([TenantConfig(name="a")], now=0.0)
    assert limiter.retry_after("a", 10, now=0.0) is None
    assert limiter.retry_after("unlimited", 10**9, now=0.0) is None


def test_config_checks_weight_and_rate():
    with pytest.raises(ValueError, match="weight"):
        TenantConfig(name="a", weight=0)
    with pytest.raises(ValueError, match="tokensPerMinute"):
        TenantConfig(name="a", tokens_per_minute=0)
    config = RuntimeConfig.from_dict({
        "model": {"path": "/m", "maxModelLen": 64},
        "tenants": [{"name": "a", "weight": 2, "tokensPerMinute": 1200}],
    })
    assert config.tenants[0].weight == 2 and config.tenants[0].tokens_per_minute == 1200


# ---- through the engine


def _engine(tenants, **lane):
    config = dataclasses.replace(make_config(lanes=[{"name": "shared", "default": True, **lane}]), tenants=tenants)
    clock = Clock()
    return LLMEngine(config, FakeExecutor(64, 4, max_model_len=None), clock=clock), clock


def _request(rid, tenant, prompt_len, max_tokens, now):
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), tenant=tenant, arrival_time=now)


def test_engine_refuses_a_tenant_over_its_rate_and_serves_the_others():
    engine, clock = _engine([TenantConfig(name="capped", tokens_per_minute=60), TenantConfig(name="free")])
    first = _request("c1", "capped", 40, 10, clock.now)
    engine.add_request(first)  # 40 of 60 taken at admission
    while engine.has_unfinished_requests():
        engine.step()  # 10 output tokens charged as produced (no time passes)
    assert first.num_output_tokens == 10
    second = _request("c2", "capped", 20, 1, clock.now)
    with pytest.raises(AdmissionError) as refused:
        engine.add_request(second)
    assert refused.value.status == 429 and refused.value.reason == "tenant_rate_limit"
    assert refused.value.retry_after_s == pytest.approx(10.0)  # 10 left, 20 needed, 1 token/s
    assert second.status is RequestStatus.FINISHED_REJECTED and second.finish_detail == "tenant_rate_limit"
    engine.add_request(_request("f1", "free", 40, 10, clock.now))  # same lane, another tenant
    clock.now += 10.0
    engine.add_request(_request("c3", "capped", 20, 1, clock.now))  # the budget came back


def test_a_refused_request_is_not_charged():
    engine, clock = _engine([TenantConfig(name="capped", tokens_per_minute=60)])
    engine.add_request(_request("c1", "capped", 50, 1, clock.now))
    for i in range(3):
        with pytest.raises(AdmissionError):
            engine.add_request(_request(f"x{i}", "capped", 20, 1, clock.now))
    clock.now += 10.0  # 10 + 10 refilled: the refusals took nothing
    engine.add_request(_request("c2", "capped", 20, 1, clock.now))


def test_a_tenant_over_its_rate_is_told_so_even_when_the_queue_is_full_too():
    # The lane holds one waiting request; the capped tenant's first request takes that slot and
    # 50 of its 60 tokens. Its next request is refused for its rate (the wait its bucket needs),
    # not for the queue: a freed queue slot alone would not let it in.
    engine, clock = _engine([TenantConfig(name="capped", tokens_per_minute=60)], maxWaitingRequests=1)
    engine.add_request(_request("c1", "capped", 50, 1, clock.now))
    with pytest.raises(AdmissionError) as refused:
        engine.add_request(_request("c2", "capped", 20, 1, clock.now))
    assert refused.value.reason == "tenant_rate_limit" and refused.value.retry_after_s == pytest.approx(10.0)
    with pytest.raises(AdmissionError) as full:  # another tenant: the queue is full indeed
        engine.add_request(_request("f1", "free", 20, 1, clock.now))
    assert full.value.reason == "queue_full"
