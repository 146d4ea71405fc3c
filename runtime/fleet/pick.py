"""The fleet router's pick policy: which replica serves a request. Pure: a function of the
replicas' last scraped load, the request's lane and its prefix-affinity key, so it is tested
without HTTP and can be replayed by a simulator.

    pick(replicas, lane, affinity_key, policy, exclude) -> Pick | Refusal

Rules (docs/fleet.md):
- Eligible: healthy (last scrape succeeded and is fresh, /ready answered 200), not already
  tried for this request, and not saturated for the lane. Saturated means what the replica's
  own admission would refuse: the lane queue at its cap, all lanes' queues at the global cap,
  or KV usage at or above the reject watermark (runtime/core/admission.py, `check_load`).
- Load of an eligible replica for the lane: requests queued in that lane, plus the requests
  this router sent there since its last scrape (so a burst between two scrapes does not all
  land on one replica), plus its occupancy in [0, 1] (the larger of the lane's running
  fraction and KV usage) as the tie breaker among equal queues.
- Affinity: rendezvous (highest-random-weight) hashing of the key over the eligible replicas,
  so a given prefix goes to the same replica while the set is unchanged, and only the keys of
  a replica that leaves (about 1/N of them) move. The affine replica is kept unless its load
  exceeds the least loaded one's by more than `policy.affinity_slack` (in queued requests);
  then the least loaded replica wins (ties broken by the same hash).
- No eligible replica: a refusal, 503 when no replica is healthy or the healthy ones are over
  the KV reject watermark, else 429 (queues full); both with Retry-After.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

# Pick reasons (the router's `picks_total{reason}` label; the router adds "retry").
AFFINITY = "affinity"
LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class LaneLoad:
    """One lane of one replica, from its /metrics."""

    waiting: float = 0.0  # tokenlane_requests_waiting
    running: float = 0.0  # tokenlane_requests_running
    max_waiting: Optional[float] = None  # lane_budget{budget="maxWaitingRequests"}
    max_running: Optional[float] = None  # lane_budget{budget="maxActiveSequences"}


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica."""

    url: str
    healthy: bool
    lanes: Mapping[str, LaneLoad] = field(default_factory=dict)
    kv_usage: float = 0.0
    kv_reject_watermark: Optional[float] = None
    dispatched: Mapping[Optional[str], int] = field(default_factory=dict)  # lane -> sent since last scrape

    @property
    def max_waiting_total(self) -> Optional[float]:
        """The global queue cap: the largest lane cap (a lane without its own cap has the
        global one, and a lane's cap is never above it)."""
        caps = [lane.max_waiting for lane in self.lanes.values() if lane.max_waiting is not None]
        return max(caps) if caps else None


@dataclass(frozen=True)
class PickPolicy:
    # The affine replica is kept while its load is at most this many queued requests above the
    # least loaded eligible replica's.
    affinity_slack: float = 4.0

    def __post_init__(self) -> None:
        if not self.affinity_slack >= 0:
            raise ValueError(f"affinity_slack must be >= 0, got {self.affinity_slack!r}")


@dataclass(frozen=True)
class Pick:
    url: str
    reason: str  # AFFINITY | LEAST_LOADED


@dataclass(frozen=True)
class Refusal:
    status: int  # 429 | 503
    code: str  # no_healthy_replica | queue_full | kv_watermark
    message: str
    retry_after_s: float


NO_HEALTHY_RETRY_AFTER_S = 5.0
SATURATED_RETRY_AFTER_S = 1.0
# While no replica is ready the router holds requests (scale from zero): at most this many,
# each for at most this long (`tokenlane router --hold-queue-size/--hold-timeout-s`).
DEFAULT_HOLD_QUEUE_SIZE = 1000
DEFAULT_HOLD_TIMEOUT_S = 300.0


def _lane_load(replica: ReplicaView, lane: Optional[str]) -> LaneLoad:
    """The lane's load; without a lane (the router has no config) every lane's together."""
    if lane is not None:
        return replica.lanes.get(lane, LaneLoad())
    loads = list(replica.lanes.values())
    return LaneLoad(
        waiting=sum(l.waiting for l in loads),
        running=sum(l.running for l in loads),
        max_waiting=replica.max_waiting_total,
        max_running=sum(l.max_running for l in loads) if loads and all(l.max_running for l in loads) else None,
    )


def _dispatched(replica: ReplicaView, lane: Optional[str]) -> int:
    if lane is None:
        return sum(replica.dispatched.values())
    return replica.dispatched.get(lane, 0)


def saturation(replica: ReplicaView, lane: Optional[str]) -> Optional[str]:
    """Why the replica would refuse a new request in `lane` ("queue_full", "kv_watermark"),
    or None when it would take it. Only the scraped numbers count: requests sent since the
    last scrape may already be running, and a refusal by the router is final."""
    load = _lane_load(replica, lane)
    if load.max_waiting is not None and load.waiting >= load.max_waiting:
        return "queue_full"
    total_cap = replica.max_waiting_total
    scraped_total = sum(l.waiting for l in replica.lanes.values())
    if total_cap is not None and scraped_total >= total_cap:
        return "queue_full"
    if replica.kv_reject_watermark is not None and replica.kv_usage >= replica.kv_reject_watermark:
        return "kv_watermark"
    return None


def load_score(replica: ReplicaView, lane: Optional[str]) -> float:
    """Queued requests in the lane (scraped plus sent since), plus occupancy in [0, 1]."""
    load = _lane_load(replica, lane)
    running_fraction = min(1.0, load.running / load.max_running) if load.max_running else 0.0
    occupancy = max(running_fraction, min(1.0, max(0.0, replica.kv_usage)))
    return load.waiting + _dispatched(replica, lane) + occupancy


def affinity_weight(key: bytes, url: str) -> int:
    """Rendezvous hashing weight of (key, replica): the replica with the largest wins."""
    digest = hashlib.blake2b(url.encode() + b"\x00" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affine_replica(urls: Sequence[str], key: bytes) -> str:
    """The replica a key hashes to among `urls` (non-empty)."""
    assert urls, "affine_replica needs at least one replica"
    return max(urls, key=lambda url: (affinity_weight(key, url), url))


def pick(
    replicas: Sequence[ReplicaView],
    lane: Optional[str],
    affinity_key: bytes,
    policy: PickPolicy = PickPolicy(),
    exclude: frozenset[str] = frozenset(),
) -> Union[Pick, Refusal]:
    """The replica for one request (see the module docstring), or why there is none."""
    candidates = [r for r in replicas if r.healthy and r.url not in exclude]
    if not candidates:
        return Refusal(503, "no_healthy_replica", "no healthy replica is available", NO_HEALTHY_RETRY_AFTER_S)
    why = {r.url: saturation(r, lane) for r in candidates}
    eligible = [r for r in candidates if why[r.url] is None]
    if not eligible:
        lane_text = f"lane {lane!r}" if lane else "this request"
        if any(reason == "queue_full" for reason in why.values()):
            return Refusal(429, "queue_full", f"every replica's queue for {lane_text} is full",
                           SATURATED_RETRY_AFTER_S)
        return Refusal(503, "kv_watermark", f"every replica's KV cache is at its reject watermark for {lane_text}",
                       SATURATED_RETRY_AFTER_S)
    scores = {r.url: load_score(r, lane) for r in eligible}
    affine = affine_replica([r.url for r in eligible], affinity_key)
    least = min(scores.values())
    if scores[affine] <= least + policy.affinity_slack:
        return Pick(affine, AFFINITY)
    lightest = [url for url, score in scores.items() if score == least]
    return Pick(affine_replica(lightest, affinity_key), LEAST_LOADED)


# --------------------------------------------------------------------------- request facts

# Characters per token for the router's prompt-length estimate (no tokenizer in the router):
# about 4 for English text with Llama-like BPE vocabularies.
CHARS_PER_TOKEN = 4.0
CHAT_TOKENS_PER_MESSAGE = 4  # role and template markers around each message


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones count
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def estimate_prompt_tokens(body: object, chat: bool) -> int:
    """A cheap estimate of the prompt length for lane match rules: characters / 4 for text,
    the length of a token-id list, plus a few tokens per chat message. For a batch, the longest
    prompt (the runtime routes a batch by its longest prompt)."""
    if not isinstance(body, dict):
        return 0
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        chars = sum(len(_message_text(m)) for m in messages)
        return int(chars / CHARS_PER_TOKEN) + CHAT_TOKENS_PER_MESSAGE * len(messages)
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    longest = 0
    for p in prompts:
        if isinstance(p, str):
            longest = max(longest, int(len(p) / CHARS_PER_TOKEN))
        elif isinstance(p, list):
            longest = max(longest, len(p))
    return longest


def affinity_key(body: object, chat: bool, prefix_chars: int) -> bytes:
    """The prefix that decides affinity: the first `prefix_chars` characters of the prompt
    (chat: of the messages' roles and texts in order; token ids: their decimal text). Shared
    system prompts longer than that give the same key, so they land where their KV is cached."""
    if not isinstance(body, dict):
        return b""
    if chat:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        parts = []
        for m in messages:
            role = m.get("role", "") if isinstance(m, dict) else ""
            parts.append(f"{role}\x1f{_message_text(m)}\x1e")
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, list):
            text = ",".join(str(t) for t in prompt)
        else:
            text = prompt if isinstance(prompt, str) else ""
    return text[:prefix_chars].encode("utf-8", "surrogatepass")
