"""The contract around the API: the OpenAPI document matches the server (400 not 422, the
OpenAI error schema, /metrics as text/plain), requests refused before admission are counted
(outcome="invalid") and every refused or failed request has one structured log line."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tokenlane.runtime.config import loads_config
from tokenlane.runtime.observability.metrics import INVALID_REASONS, PrometheusMetrics
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.entrypoints.http_errors import RequestLog

POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def test_openapi_document_matches_the_server(shared_server):
    doc = shared_server.app.openapi()
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    schemas = doc["components"]["schemas"]
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    for path in POSTS:
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) >= {"200", "400", "401", "404"}, path
        for status, response in responses.items():
            if status != "200":
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), (path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    # The declared content type is the one served.
    assert httpx.get(shared_server.url + "/metrics").headers["content-type"].startswith("text/plain")
    # Token ids are declared with JSON Schema's bounds: from 0 to the vocabulary's last id.
    vocab = shared_server.app.state.tokenlane.vocab_size
    prompt_ids = [v for v in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
                  if v["type"] == "array" and v["items"].get("type") != "string"]
    for items in [v["items"] for v in prompt_ids] + [schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]]:
        items = items.get("items", items)  # a batch: an array of token-id arrays
        assert (items["type"], items["minimum"], items["maximum"]) == ("integer", 0, vocab - 1), items
    # A declared 400 really is what a bad body gets, in the declared shape.
    r = httpx.post(shared_server.url + "/tokenize", json={"prompt": 1})
    assert r.status_code == 400 and set(r.json()["error"]) == set(schemas["ErrorDetail"]["properties"])


def _lines(caplog) -> list[dict]:
    out = []
    for record in caplog.records:
        if record.name == "tokenlane.requests":
            out.append(json.loads(record.getMessage()))
            assert record.tokenlane == out[-1]
    return out


@pytest.mark.parametrize(
    "path, body, headers, reason",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, {}, "invalid_parameter"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, {"X-Lane": "batch"}, "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 600}, {}, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [5, 99999]}, {"X-Tenant": "nobody"}, "invalid_token_id"),
        ("/v1/completions", {"prompt": "x"}, {"X-Lane": "nope"}, "unknown_lane"),
    ],
)
def test_refused_400s_are_counted_and_logged(shared_server, caplog, path, body, headers, reason):
    lane = headers.get("X-Lane") if headers.get("X-Lane") in ("interactive", "batch") else "interactive"
    labels = dict(outcome="invalid", reason=reason, lane=lane, tenant="default")
    before = shared_server.metric("tokenlane_requests_total", **labels)
    with caplog.at_level(logging.INFO, logger="tokenlane.requests"):
        r = httpx.post(shared_server.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert shared_server.metric("tokenlane_requests_total", **labels) == before + 1
    (line,) = [x for x in _lines(caplog) if x["request_id"] == r.headers["X-Request-Id"]]
    assert line == {"event": "request_refused", "request_id": r.headers["X-Request-Id"], "lane": lane,
                    "tenant": "default", "status": 400, "reason": reason, "message": r.json()["error"]["message"]}


def test_engine_refusals_and_failures_are_logged_once(caplog):
    log = RequestLog()
    cases = [
        (RequestStatus.FINISHED_REJECTED, "kv_watermark", 503),
        (RequestStatus.FINISHED_REJECTED, "queue_full", 429),
        (RequestStatus.FINISHED_TIMEOUT, "queue_timeout", 504),
        (RequestStatus.FINISHED_ERROR, "executor error: boom", 500),  # reason: bounded, as in metrics
        (RequestStatus.FINISHED_CANCELLED, "shutdown", 503),
        (RequestStatus.FINISHED_CANCELLED, "client_disconnect", None),  # the client left: no line
        (RequestStatus.FINISHED_STOPPED, "eos", None),
    ]
    with caplog.at_level(logging.INFO, logger="tokenlane.requests"):
        for i, (status, detail, _) in enumerate(cases):
            r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2), lane="batch", tenant="team-a")
            r.finish(status, detail, now=1.0)
            log.on_request_finished(r)
    lines = _lines(caplog)
    expected = [(f"r{i}", code, detail if " " not in detail else "other")
                for i, (_, detail, code) in enumerate(cases) if code is not None]
    assert [(x["request_id"], x["status"], x["reason"]) for x in lines] == expected
    assert all(x["lane"] == "batch" and x["tenant"] == "team-a" for x in lines)
    assert [x["event"] for x in lines] == ["request_refused"] * 2 + ["request_failed"] * 3


def test_invalid_series_are_bounded_and_exist_at_zero():
    m = PrometheusMetrics("tiny")
    m.set_config(loads_config("""
model: {path: /models/tiny, servedName: tiny}
lanes: [{name: a, default: true}, {name: b}]
tenants: [{name: team-a}]
"""))
    text = m.render().decode()
    for lane in ("a", "b"):
        for tenant in ("default", "team-a"):
            for endpoint in ("/v1/completions", "/v1/chat/completions"):
                assert (f'tokenlane_requests_total{{endpoint="{endpoint}",lane="{lane}",model="tiny",'
                        f'outcome="invalid",reason="invalid_parameter",tenant="{tenant}"}} 0.0') in text
    m.record_invalid("a", "team-a", "context_length_exceeded")
    m.record_invalid("made-up", "someone", "whatever the client sent")
    text = m.render().decode()
    assert 'lane="a",model="tiny",outcome="invalid",reason="context_length_exceeded",tenant="team-a"} 1.0' in text
    assert 'lane="unknown",model="tiny",outcome="invalid",reason="other",tenant="unknown"} 1.0' in text
    assert "invalid_parameter" in INVALID_REASONS


@pytest.mark.parametrize(
    "path, content, param",
    [
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
        ("/v1/completions", b'{"prompt": ', None),  # not JSON
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}', "tool_choice"),
    ],
)
def test_malformed_bodies_and_tool_choice_without_tools(shared_server, path, content, param):
    r = httpx.post(shared_server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == param, error
