"""Traffic for the benchmarks: the Azure conversation trace and synthetic distributions.

A `TrafficSpec` (a YAML/JSON-able dataclass) describes a run; `build_requests(spec)` turns it
into a list of `PlannedRequest` (arrival offset, lane, tenant, prompt/output lengths, streaming,
cancellation point, deadline), reproducible for a given seed. The load generator replays that
list against an HTTP endpoint; the simulator replays it against the engine on a virtual clock.

Trace replay keeps the trace's arrival pattern and length distribution and scales both to what
the target can take: time (a speed-up factor, or a target mean rate), lengths (a factor, then
clipped), and a window of the hour. `describe()` says exactly what was scaled and by how much.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

TRACE_NAME = "azure-llm-2023-conv"
# The packaged copy (offset_ms,context_tokens,generated_tokens), so the demo and the tests
# never depend on ../shared being present.
PACKAGED_TRACE = Path(__file__).with_name("azure_llm_2023_conv.csv.gz")
_SHARED_RELATIVE = Path("..") / "shared" / "traces" / f"{TRACE_NAME}.csv"

# Synthetic length classes: (median, log-normal sigma, min, max), in tokens.
PROMPT_CLASSES: dict[str, tuple[float, float, int, int]] = {
    "short": (120, 0.6, 8, 512),
    "medium": (1000, 0.5, 256, 4096),  # the conversation trace's p50 is 1020
    "long": (8000, 0.35, 4096, 16384),
}
OUTPUT_CLASSES: dict[str, tuple[float, float, int, int]] = {
    "short": (48, 0.6, 4, 256),
    "long": (400, 0.5, 64, 2048),
}


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # offset from the first request of the trace
    prompt_tokens: int
    output_tokens: int


def _repo_root() -> Path:
    # bench/trace.py -> repo root (symlinked install: resolve to the checkout).
    return Path(__file__).resolve().parents[1]


def find_trace(path: Optional[str | Path] = None) -> Path:
    """The trace file: `path`, else ../shared/traces next to the checkout, else the packaged copy."""
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"trace file {p} does not exist")
        return p
    for candidate in (_repo_root() / _SHARED_RELATIVE, Path.cwd() / _SHARED_RELATIVE):
        if candidate.exists():
            return candidate
    return PACKAGED_TRACE


def trace_name(path: Optional[str | Path] = None) -> str:
    """How a run's description names its trace: the Azure trace when no path is given (both
    the shared and the packaged copy are it), else the given file's own name."""
    if path is None:
        return TRACE_NAME
    name = Path(path).name
    for suffix in (".gz", ".csv", ".jsonl", ".json"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return name or str(path)


def load_trace(path: Optional[str | Path] = None) -> list[TraceRow]:
    """Rows of the Azure trace (either the original CSV with TIMESTAMP or the packaged form)."""
    p = find_trace(path)
    raw = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
    lines = [line for line in raw.splitlines() if line and not line.startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    rows: list[TraceRow] = []
    t0: Optional[float] = None
    for i, rec in enumerate(reader):
        try:
            if "offset_ms" in rec:
                t = float(rec["offset_ms"]) / 1000.0
                prompt, output = int(rec["context_tokens"]), int(rec["generated_tokens"])
            else:
                t = _parse_timestamp(rec["TIMESTAMP"])
                prompt, output = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{p}: row {i + 2} is not a trace row ({exc}): {rec}") from None
        t0 = t if t0 is None else t0
        rows.append(TraceRow(t - t0, max(1, prompt), max(1, output)))
    if not rows:
        raise ValueError(f"{p}: no rows")
    rows.sort(key=lambda r: r.arrival_s)
    return rows


def _parse_timestamp(text: str) -> float:
    import datetime

    day, _, frac = text.strip().partition(".")
    base = datetime.datetime.strptime(day, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


# --------------------------------------------------------------------------- the spec


@dataclass
class LaneMix:
    """One lane's share of the traffic and, for synthetic traffic, its length classes."""

    lane: Optional[str]  # sent as X-Lane; None lets the server's router pick
    share: float = 1.0
    prompt: str = "medium"  # PROMPT_CLASSES key (synthetic traffic only)
    output: str = "short"  # OUTPUT_CLASSES key (synthetic traffic only)
    tenant: Optional[str] = None  # None: drawn from the spec's tenants
    priority: int = 0


@dataclass
class Burst:
    """Extra Poisson arrivals at `rate_rps` during [start_s, start_s + duration_s)."""

    start_s: float
    duration_s: float
    rate_rps: float


@dataclass
class TrafficSpec:
    source: str = "synthetic"  # "trace" | "synthetic"
    seed: int = 0
    duration_s: float = 60.0  # arrivals in [0, duration_s)
    max_requests: Optional[int] = None  # cap on the number of requests
    # synthetic: Poisson arrivals at rate_rps, plus bursts
    rate_rps: float = 1.0
    bursts: list[Burst] = field(default_factory=list)
    # trace: replay the window [trace_start_s, trace_start_s + duration_s / time_scale) of the hour
    trace_path: Optional[str] = None
    trace_start_s: float = 0.0
    time_scale: Optional[float] = None  # speed-up: 2.0 replays twice as fast
    target_rate_rps: Optional[float] = None  # alternatively: choose time_scale for this mean rate
    length_scale: float = 1.0  # multiply prompt and output lengths
    output_length_scale: Optional[float] = None  # multiply output lengths instead (None: length_scale)
    # both: clip lengths (after scaling)
    min_prompt_tokens: int = 1
    max_prompt_tokens: Optional[int] = None
    max_output_tokens: Optional[int] = None
    # who sends what
    lanes: list[LaneMix] = field(default_factory=lambda: [LaneMix(lane=None)])
    tenants: list[str] = field(default_factory=lambda: ["default"])
    stream_share: float = 1.0  # share of streaming requests (TTFT needs streaming)
    cancel_share: float = 0.0  # share cancelled by the client mid-stream
    deadline_share: float = 0.0  # share sent with X-Request-Deadline-Ms
    deadline_ms: float = 10000.0
    # share sent without ignore_eos, so a real model may stop early at EOS (the others run to
    # max_tokens); the simulator's synthetic tokens never stop early, whatever this says.
    early_stop_share: float = 0.0

    def __post_init__(self) -> None:
        if self.source not in ("trace", "synthetic"):
            raise ValueError(f"traffic source must be 'trace' or 'synthetic', got {self.source!r}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for name in ("stream_share", "cancel_share", "deadline_share", "early_stop_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.time_scale is not None and self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.length_scale <= 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if self.output_length_scale is not None and self.output_length_scale <= 0:
            raise ValueError(f"output_length_scale must be > 0, got {self.output_length_scale}")
        self.lanes = [LaneMix(**m) if isinstance(m, dict) else m for m in self.lanes]
        self.bursts = [Burst(**b) if isinstance(b, dict) else b for b in self.bursts]
        if not self.lanes or sum(m.share for m in self.lanes) <= 0:
            raise ValueError("lanes: need at least one lane with a positive share")
        for m in self.lanes:
            if m.prompt not in PROMPT_CLASSES:
                raise ValueError(f"lane {m.lane}: prompt class {m.prompt!r} not in {list(PROMPT_CLASSES)}")
            if m.output not in OUTPUT_CLASSES:
                raise ValueError(f"lane {m.lane}: output class {m.output!r} not in {list(OUTPUT_CLASSES)}")
        if not self.tenants:
            raise ValueError("tenants: need at least one tenant")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrafficSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"traffic spec: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_spec(path: str | Path) -> TrafficSpec:
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a traffic spec must be a mapping")
    return TrafficSpec.from_dict(data)


@dataclass
class PlannedRequest:
    """One request to send: everything the load generator or the simulator needs."""

    index: int
    arrival_s: float  # offset from the start of the run
    lane: Optional[str]  # requested lane (X-Lane header); None = router decides
    tenant: str
    prompt_tokens: int
    max_tokens: int
    stream: bool = True
    cancel_after_tokens: Optional[int] = None  # client aborts after this many tokens
    deadline_ms: Optional[float] = None  # relative deadline (X-Request-Deadline-Ms)
    ignore_eos: bool = True
    priority: int = 0
    # Requests of one conversation (the simulator's multi-turn traffic): each prompt is the
    # same token sequence cut at its length, so a later turn's prompt extends an earlier one's.
    conversation: Optional[int] = None
    adapter: Optional[str] = None  # the LoRA adapter it asks for as its model (bench/lora_cost.py); None = base

    @property
    def request_id(self) -> str:
        return f"bench-{self.index}"


@dataclass
class Traffic:
    """A built run: the requests plus a human-readable account of the scaling applied."""

    requests: list[PlannedRequest]
    description: str
    spec: TrafficSpec

    def describe(self) -> str:
        return self.description


# --------------------------------------------------------------------------- building


def _lognormal(rng: np.random.Generator, cls: tuple[float, float, int, int], n: int) -> np.ndarray:
    median, sigma, lo, hi = cls
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def _poisson_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    if rate <= 0 or end <= start:
        return []
    n = rng.poisson(rate * (end - start))
    return sorted(rng.uniform(start, end, n).tolist())


def build_requests(spec: TrafficSpec) -> Traffic:
    """Deterministic for a given spec (numpy Generator seeded with spec.seed)."""
    rng = np.random.default_rng(spec.seed)
    notes: list[str] = []
    if spec.source == "trace":
        arrivals, prompts, outputs = _from_trace(spec, notes)
    else:
        arrivals = _poisson_arrivals(rng, spec.rate_rps, 0.0, spec.duration_s)
        for b in spec.bursts:
            arrivals += _poisson_arrivals(rng, b.rate_rps, b.start_s, min(b.start_s + b.duration_s, spec.duration_s))
        arrivals.sort()
        notes.append(f"synthetic: Poisson {spec.rate_rps:g} req/s over {spec.duration_s:g} s"
                     + "".join(f", burst {b.rate_rps:g} req/s at {b.start_s:g}-{b.start_s + b.duration_s:g} s"
                               for b in spec.bursts))
        prompts = outputs = None
    if spec.max_requests is not None:
        arrivals = arrivals[: spec.max_requests]
    n = len(arrivals)

    shares = np.array([m.share for m in spec.lanes], dtype=float)
    lane_idx = rng.choice(len(spec.lanes), size=n, p=shares / shares.sum())
    if prompts is None:
        prompts = np.zeros(n, dtype=int)
        outputs = np.zeros(n, dtype=int)
        for li, mix in enumerate(spec.lanes):
            sel = lane_idx == li
            k = int(sel.sum())
            prompts[sel] = _lognormal(rng, PROMPT_CLASSES[mix.prompt], k)
            outputs[sel] = _lognormal(rng, OUTPUT_CLASSES[mix.output], k)
        out_scale = spec.length_scale if spec.output_length_scale is None else spec.output_length_scale
        if spec.length_scale != 1.0 or out_scale != 1.0:
            prompts = np.maximum(1, np.round(prompts * spec.length_scale)).astype(int)
            outputs = np.maximum(1, np.round(outputs * out_scale)).astype(int)
            notes.append(f"prompt lengths x{spec.length_scale:g}, output lengths x{out_scale:g}")
    else:
        prompts, outputs = np.asarray(prompts[:n]), np.asarray(outputs[:n])
    prompts = np.maximum(prompts, spec.min_prompt_tokens)
    if spec.max_prompt_tokens is not None:
        clipped = int((prompts > spec.max_prompt_tokens).sum())
        prompts = np.minimum(prompts, spec.max_prompt_tokens)
        if clipped:
            notes.append(f"{clipped} prompt(s) clipped to {spec.max_prompt_tokens} tokens")
    if spec.max_output_tokens is not None:
        clipped = int((outputs > spec.max_output_tokens).sum())
        outputs = np.minimum(outputs, spec.max_output_tokens)
        if clipped:
            notes.append(f"{clipped} output(s) clipped to {spec.max_output_tokens} tokens")

    stream = rng.random(n) < spec.stream_share
    cancel = (rng.random(n) < spec.cancel_share) & stream  # only a stream can be cut mid-way
    cancel_frac = rng.uniform(0.1, 0.6, n)
    deadline = rng.random(n) < spec.deadline_share
    early = rng.random(n) < spec.early_stop_share
    tenant_idx = rng.integers(0, len(spec.tenants), n)

    requests = []
    for i in range(n):
        mix = spec.lanes[int(lane_idx[i])]
        max_tokens = int(outputs[i])
        cancel_after = max(1, int(max_tokens * cancel_frac[i])) if cancel[i] and max_tokens > 1 else None
        requests.append(
            PlannedRequest(
                index=i,
                arrival_s=float(arrivals[i]),
                lane=mix.lane,
                tenant=mix.tenant or spec.tenants[int(tenant_idx[i])],
                prompt_tokens=int(prompts[i]),
                max_tokens=max_tokens,
                stream=bool(stream[i]),
                cancel_after_tokens=cancel_after,
                deadline_ms=spec.deadline_ms if deadline[i] else None,
                ignore_eos=not bool(early[i]),
                priority=mix.priority,
            )
        )
    summary = summarize(requests)
    notes.append(summary)
    return Traffic(requests=requests, description="; ".join(notes), spec=spec)


def _from_trace(spec: TrafficSpec, notes: list[str]) -> tuple[list[float], np.ndarray, np.ndarray]:
    rows = load_trace(spec.trace_path)
    span = rows[-1].arrival_s
    src_rate = len(rows) / span if span > 0 else float(len(rows))
    if spec.target_rate_rps is not None and spec.time_scale is not None:
        raise ValueError("give either time_scale or target_rate_rps, not both")
    if spec.target_rate_rps is not None:
        # The trace's rate varies over the hour: pick the speed-up whose window of the trace
        # yields the target mean rate over duration_s.
        time_scale = _scale_for_rate(rows, spec.trace_start_s, spec.duration_s, spec.target_rate_rps)
    else:
        time_scale = spec.time_scale or 1.0
    window_end = spec.trace_start_s + spec.duration_s * time_scale
    chosen = [r for r in rows if spec.trace_start_s <= r.arrival_s < window_end]
    if not chosen:
        raise ValueError(
            f"trace window [{spec.trace_start_s:g}, {window_end:g}) s holds no request "
            f"(the trace spans {span:.0f} s)"
        )
    arrivals = [(r.arrival_s - spec.trace_start_s) / time_scale for r in chosen]
    prompts = np.array([r.prompt_tokens for r in chosen], dtype=float)
    outputs = np.array([r.output_tokens for r in chosen], dtype=float)
    p50_p, p50_o = float(np.median(prompts)), float(np.median(outputs))
    out_scale = spec.length_scale if spec.output_length_scale is None else spec.output_length_scale
    prompts = np.maximum(1, np.round(prompts * spec.length_scale)).astype(int)
    outputs = np.maximum(1, np.round(outputs * out_scale)).astype(int)
    rate_in = len(chosen) / max(window_end - spec.trace_start_s, 1e-9)
    notes.append(
        f"trace {trace_name(spec.trace_path)}: {len(chosen)} of {len(rows)} requests from "
        f"[{spec.trace_start_s:g}, {min(window_end, span):.0f}) s of {span:.0f} s; "
        f"time x{time_scale:.3g} ({rate_in:.2f} -> {rate_in * time_scale:.2f} req/s); "
        f"prompt lengths x{spec.length_scale:g} (p50 {p50_p:.0f} -> {np.median(prompts):.0f} tokens), "
        f"output lengths x{out_scale:g} (p50 {p50_o:.0f} -> {np.median(outputs):.0f} tokens)"
    )
    return arrivals, prompts, outputs


def _scale_for_rate(rows: list[TraceRow], start: float, duration_s: float, target_rps: float) -> float:
    """Smallest time scale s such that the window [start, start + duration_s * s) holds at
    least target_rps * duration_s requests (bisection: the count grows with s)."""
    times = np.array([r.arrival_s for r in rows])
    want = max(1, round(target_rps * duration_s))

    def count(scale: float) -> int:
        return int(np.searchsorted(times, start + duration_s * scale) - np.searchsorted(times, start))

    hi = max((times[-1] - start) / duration_s, 1e-6) * 1.0001
    if count(hi) < want:
        raise ValueError(
            f"the trace after {start:g} s holds {count(hi)} requests, fewer than the "
            f"{want} that {target_rps:g} req/s over {duration_s:g} s needs"
        )
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if count(mid) >= want:
            hi = mid
        else:
            lo = mid
    return hi


def summarize(requests: Iterable[PlannedRequest]) -> str:
    reqs = list(requests)
    if not reqs:
        return "0 requests"
    prompts = np.array([r.prompt_tokens for r in reqs])
    outputs = np.array([r.max_tokens for r in reqs])
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    lanes: dict[str, int] = {}
    for r in reqs:
        lanes[r.lane or "(router)"] = lanes.get(r.lane or "(router)", 0) + 1
    lane_text = ", ".join(f"{k} {v}" for k, v in lanes.items())
    return (
        f"{len(reqs)} requests over {span:.1f} s ({len(reqs) / max(span, 1e-9):.2f} req/s); "
        f"prompt p50/p99 {np.percentile(prompts, 50):.0f}/{np.percentile(prompts, 99):.0f}, "
        f"output p50/p99 {np.percentile(outputs, 50):.0f}/{np.percentile(outputs, 99):.0f} tokens; "
        f"lanes: {lane_text}; streaming {sum(r.stream for r in reqs)}, "
        f"cancel {sum(r.cancel_after_tokens is not None for r in reqs)}, "
        f"deadline {sum(r.deadline_ms is not None for r in reqs)}"
    )


def merge(*traffics: Traffic) -> Traffic:
    """Several streams in one run (e.g. interactive trace + a long-prompt flood), renumbered."""
    reqs = sorted((r for t in traffics for r in t.requests), key=lambda r: (r.arrival_s, r.index))
    out = [dataclasses.replace(r, index=i) for i, r in enumerate(reqs)]
    return Traffic(out, " | ".join(t.description for t in traffics), traffics[0].spec)
