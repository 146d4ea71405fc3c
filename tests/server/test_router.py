"""Tenant, lane and deadline decisions of the API router (pure functions of config + headers)."""

from __future__ import annotations

import pytest

from tokenlane.runtime.config import hash_api_key, loads_config
from tokenlane.runtime.entrypoints.protocol import APIError
from tokenlane.runtime.entrypoints.routing import authenticate, choose_lane, parse_deadline_ms

LANES = """
model: {path: /m}
lanes:
  - {name: interactive, default: true}
  - {name: long-context, class: long-context, match: {minPromptTokens: 100}}
  - {name: batch, class: batch, match: {headers: {x-workload: offline}}}
  - {name: vip, match: {tenants: [gold]}}
"""


def config(tenants: str = "") -> object:
    return loads_config(LANES + tenants)


OPEN_TENANTS = """
tenants:
  - {name: gold}
  - {name: search, defaultLane: long-context, lanes: [interactive, long-context]}
  - {name: offline, lanes: [batch]}
"""

KEYED_TENANTS = f"""
tenants:
  - {{name: gold, apiKeySha256: "{hash_api_key('gold-key')}"}}
  - {{name: search, apiKeySha256: "{hash_api_key('search-key')}", lanes: [interactive]}}
"""


def test_open_server_takes_tenant_from_header_and_maps_unknown_to_default():
    cfg = config(OPEN_TENANTS)
    assert authenticate(cfg, {"X-Tenant": "gold"}).tenant == "gold"
    assert authenticate(cfg, {"x-tenant": "search"}).allowed_lanes == ("interactive", "long-context")
    assert authenticate(cfg, {"X-Tenant": "who-knows"}).tenant == "default"
    assert authenticate(cfg, {}).tenant == "default"


def test_api_keys_authenticate_or_401():
    cfg = config(KEYED_TENANTS)
    assert cfg.auth_enabled
    assert authenticate(cfg, {"Authorization": "Bearer gold-key"}).tenant == "gold"
    assert authenticate(cfg, {"authorization": "bearer search-key"}).tenant == "search"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "gold-key"},
                    {"Authorization": "Basic gold-key"}, {"X-Tenant": "gold"}):
        with pytest.raises(APIError) as err:
            authenticate(cfg, headers)
        assert err.value.status == 401


def test_lane_precedence_header_then_tenant_default_then_rules_then_default():
    cfg = config(OPEN_TENANTS)
    anyone = authenticate(cfg, {})
    assert choose_lane(cfg, anyone, {}, 10) == "interactive"
    assert choose_lane(cfg, anyone, {}, 100) == "long-context"  # minPromptTokens rule
    assert choose_lane(cfg, anyone, {"X-Workload": "offline"}, 10) == "batch"  # header rule
    assert choose_lane(cfg, anyone, {"X-Lane": "batch"}, 1000) == "batch"  # header wins
    gold = authenticate(cfg, {"X-Tenant": "gold"})
    assert choose_lane(cfg, gold, {}, 10) == "vip"  # tenant rule
    search = authenticate(cfg, {"X-Tenant": "search"})
    assert choose_lane(cfg, search, {}, 10) == "long-context"  # tenant's defaultLane
    offline = authenticate(cfg, {"X-Tenant": "offline"})
    # The default lane is not allowed for this tenant: its first allowed lane serves it.
    assert choose_lane(cfg, offline, {}, 10) == "batch"


def test_unknown_lane_is_400_and_forbidden_lane_is_403():
    cfg = config(OPEN_TENANTS)
    search = authenticate(cfg, {"X-Tenant": "search"})
    with pytest.raises(APIError) as err:
        choose_lane(cfg, search, {"X-Lane": "nope"}, 10)
    assert err.value.status == 400 and err.value.code == "unknown_lane"
    with pytest.raises(APIError) as err:
        choose_lane(cfg, search, {"X-Lane": "batch"}, 10)
    assert err.value.status == 403 and err.value.code == "lane_not_allowed"


def test_rules_skip_lanes_the_tenant_may_not_use():
    cfg = config(OPEN_TENANTS)
    offline = authenticate(cfg, {"X-Tenant": "offline"})
    assert choose_lane(cfg, offline, {}, 500) == "batch"  # long-context matches but is not allowed


def test_deadline_header():
    assert parse_deadline_ms({}) is None
    assert parse_deadline_ms({"X-Request-Deadline-Ms": "1500"}) == 1500.0
    for bad in ("0", "-5", "soon", "nan", "inf", "1e12"):
        with pytest.raises(APIError) as err:
            parse_deadline_ms({"x-request-deadline-ms": bad})
        assert err.value.status == 400
