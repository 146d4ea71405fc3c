"""The API router layer: who is calling (tenant), which lane serves the request, and when
it must be done. Pure functions of the config in force and the request's headers, so the
decisions are testable without a server.

Decisions (the HTTP contract is in docs/architecture.md):
- Tenant. With API keys configured (any tenant has `apiKeySha256`) every request needs
  `Authorization: Bearer <key>`; the key's SHA-256 is compared with every tenant's digest in
  constant time; missing or unknown key -> 401. With no keys configured the server is open
  and takes the tenant from `X-Tenant`; a value that is not a configured tenant is served as
  tenant `default` (the header is a hint in open mode, and metric labels stay bounded to
  configured tenants) and the response's `X-Tenant` header says so.
- Lane. `X-Lane` header (an unknown lane -> 400; a lane the tenant may not use -> 403), else
  the tenant's `defaultLane`, else the first lane in config order whose `match` rules all hold
  (prompt length bounds, tenant list, exact header values) and that the tenant may use, else
  the default lane (or, when the tenant may not use it, the tenant's first allowed lane).
- Model. The request's `model` names the base (its served name) or a loaded LoRA adapter;
  anything else -> 404 `model_not_found`. An adapter the tenant may not use
  (`tenants[].adapters`) -> the same 404 (as vLLM, the server hides what a caller may not
  use). Lanes may match on the model name (`match.models`).
- Deadline. `X-Request-Deadline-Ms`: milliseconds from arrival within which the request must
  finish; a positive integer, else 400.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Mapping, Optional

from tokenlane.runtime.config import LaneConfig, RuntimeConfig, TenantConfig, hash_api_key
from tokenlane.runtime.entrypoints.protocol import APIError

DEFAULT_TENANT = "default"
MAX_DEADLINE_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class Caller:
    tenant: str  # configured tenant name, or "default"
    allowed_lanes: tuple[str, ...]  # empty = every lane
    default_lane: Optional[str]
    allowed_adapters: tuple[str, ...] = ()  # empty = every adapter

    def may_use(self, lane: str) -> bool:
        return not self.allowed_lanes or lane in self.allowed_lanes

    def may_use_adapter(self, adapter: str) -> bool:
        return not self.allowed_adapters or adapter in self.allowed_adapters


def _lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _caller_of(tenant: Optional[TenantConfig]) -> Caller:
    if tenant is None:
        return Caller(tenant=DEFAULT_TENANT, allowed_lanes=(), default_lane=None)
    return Caller(tenant=tenant.name, allowed_lanes=tuple(tenant.lanes), default_lane=tenant.default_lane,
                  allowed_adapters=tuple(tenant.adapters or ()))


class AdapterDenied(APIError):
    """The 404 of an adapter that exists but the tenant may not use (counted in metrics)."""

    def __init__(self, model: str, tenant: str, served: str) -> None:
        super().__init__(404, _not_found_message(model, served), type="not_found_error",
                         code="model_not_found", param="model")
        self.adapter = model
        self.tenant = tenant


def _not_found_message(model: str, served: str) -> str:
    return f"model {model!r} does not exist; this server serves {served!r} and its adapters (GET /v1/models)"


def resolve_model(model: Optional[str], base_name: str, adapters, caller: Caller) -> Optional[str]:
    """The adapter a request's `model` selects (None: the base model, also when `model` is
    omitted), or APIError 404 `model_not_found` (AdapterDenied when the tenant may not use it).
    `adapters` is the collection of adapter names being served."""
    if model is None or model == base_name:
        return None
    if model not in adapters:
        raise APIError(404, _not_found_message(model, base_name), type="not_found_error",
                       code="model_not_found", param="model")
    if not caller.may_use_adapter(model):
        raise AdapterDenied(model, caller.tenant, base_name)
    return model


def authenticate(config: RuntimeConfig, headers: Mapping[str, str]) -> Caller:
    """The calling tenant, or APIError 401."""
    headers = _lower_headers(headers)
    if not config.auth_enabled:
        name = headers.get("x-tenant", "").strip()
        tenant = next((t for t in config.tenants if t.name == name), None)
        return _caller_of(tenant)

    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="missing_api_key",
        )
    digest = hash_api_key(key).encode()
    found: Optional[TenantConfig] = None
    # Compare against every tenant (no early exit) so timing says nothing about which matched.
    for tenant in config.tenants:
        if tenant.api_key_sha256 and hmac.compare_digest(digest, tenant.api_key_sha256.encode()):
            found = tenant
    if found is None:
        raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
    return _caller_of(found)


def _rule_matches(lane: LaneConfig, caller: Caller, prompt_tokens: int, headers: dict[str, str],
                  model: Optional[str]) -> bool:
    rule = lane.match
    if rule.is_empty:
        return False
    if rule.models and model not in rule.models:
        return False
    if rule.min_prompt_tokens is not None and prompt_tokens < rule.min_prompt_tokens:
        return False
    if rule.max_prompt_tokens is not None and prompt_tokens > rule.max_prompt_tokens:
        return False
    if rule.tenants and caller.tenant not in rule.tenants:
        return False
    for name, value in rule.headers.items():
        if headers.get(name.lower()) != value:
            return False
    return True


def choose_lane(
    config: RuntimeConfig, caller: Caller, headers: Mapping[str, str], prompt_tokens: int,
    model: Optional[str] = None,
) -> str:
    """The lane that serves this request, or APIError 400 (unknown lane) / 403 (not allowed).
    `model` is the model name the request runs (the base's served name or an adapter's)."""
    headers = _lower_headers(headers)
    names = [lane.name for lane in config.lanes]
    asked = headers.get("x-lane", "").strip()
    if asked:
        if asked not in names:
            raise APIError(400, f"unknown lane {asked!r}; lanes: {names}", code="unknown_lane", param="X-Lane")
        if not caller.may_use(asked):
            raise APIError(
                403,
                f"tenant {caller.tenant!r} may not use lane {asked!r}; allowed: {list(caller.allowed_lanes)}",
                type="permission_error",
                code="lane_not_allowed",
                param="X-Lane",
            )
        return asked
    if caller.default_lane and caller.default_lane in names:
        return caller.default_lane
    for lane in config.lanes:
        if caller.may_use(lane.name) and _rule_matches(lane, caller, prompt_tokens, headers, model):
            return lane.name
    default = config.default_lane.name
    if caller.may_use(default):
        return default
    return next(name for name in names if caller.may_use(name))


def parse_deadline_ms(headers: Mapping[str, str]) -> Optional[float]:
    """`X-Request-Deadline-Ms` in milliseconds (relative to arrival), or None."""
    raw = _lower_headers(headers).get("x-request-deadline-ms")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value <= MAX_DEADLINE_MS):
        raise APIError(
            400,
            f"X-Request-Deadline-Ms must be a number of milliseconds in (0, {MAX_DEADLINE_MS}], got {raw!r}",
            code="invalid_deadline",
            param="X-Request-Deadline-Ms",
        )
    return value
