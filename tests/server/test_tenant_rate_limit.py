"""A tenant over its tokensPerMinute gets 429 + Retry-After with reason `tenant_rate_limit`
over real HTTP, while another tenant's request in the same lane is served; the refusal shows
in `tokenlane_requests_total` and `tokenlane_tenant_throttled_total`."""

from __future__ import annotations

RATE_LIMITED = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 4, maxWaitingRequests: 64, maxBatchedTokens: 256, prefillChunkSize: 128}}
lanes:
  - {{name: interactive, default: true}}
tenants:
  - {{name: capped, tokensPerMinute: 60}}
  - {{name: roomy, weight: 2}}
"""


def _complete(client, tenant, prompt_len, max_tokens):
    return client.post("/v1/completions", headers={"X-Tenant": tenant},
                       json={"prompt": [11] * prompt_len, "max_tokens": max_tokens, "ignore_eos": True})


def test_a_tenant_over_its_rate_gets_429_and_the_other_tenant_is_served(serve):
    live = serve(RATE_LIMITED)
    assert live.metric("tokenlane_tenant_throttled_total", tenant="capped") == 0  # present from start-up
    assert live.metric("tokenlane_tenant_throttled_total", tenant="roomy") == 0
    with live.client() as client:
        # 50 prompt tokens + 10 output tokens: the whole minute's budget (60 tokens/min = 1/s).
        first = _complete(client, "capped", 50, 10)
        assert first.status_code == 200, first.text
        refused = _complete(client, "capped", 50, 10)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "tenant_rate_limit" and error["type"] == "rate_limit_error"
        # About 50 s until 50 tokens are back (less the seconds this test has run).
        assert 30 <= int(refused.headers["retry-after"]) <= 50
        served = _complete(client, "roomy", 50, 10)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 10
    assert live.metric("tokenlane_requests_total", tenant="capped", outcome="rejected",
                       reason="tenant_rate_limit") == 1
    assert live.metric("tokenlane_tenant_throttled_total", tenant="capped") == 1
    assert live.metric("tokenlane_tenant_throttled_total", tenant="roomy") == 0
