"""Benchmark results: per-request records in, per-lane statistics, tables, JSON and a chart out.

Both the HTTP load generator (loadgen.py) and the in-process simulator (sim.py) produce a
`RunResult` (one per phase, e.g. "continuous" and "static"); `summarize` computes per lane:
TTFT / TPOT / E2E / queue delay at p50, p95 and p99, output and total tokens/s, goodput
(requests per second that finished and met every SLO target of their lane: TTFT, TPOT, E2E),
rejections by reason and cancellations. `compare` puts phases side by side with ratios.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

# Outcomes of one request, as the client saw it.
OK = "ok"  # finished by stop / length
CANCELLED = "cancelled"  # the client cancelled it (planned cancellation)
REJECTED = "rejected"  # refused before any token (400/429/503 or engine admission)
TIMEOUT = "timeout"  # timed out in the queue (504) or on the client
ERROR = "error"  # anything else (500, broken stream, engine error)
OUTCOMES = (OK, CANCELLED, REJECTED, TIMEOUT, ERROR)

PERCENTILES = (50, 95, 99)
TOKEN_BIN_S = 1.0  # width of the tokens/s-over-time bins (seconds)


@dataclass
class RequestRecord:
    index: int
    lane: str  # the lane that served it (X-Lane response header), else the one asked for
    tenant: str
    arrival_s: float  # offset from the start of the run
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    outcome: str = OK
    reason: str = ""  # rejection reason / finish detail / error text
    http_status: Optional[int] = None
    stream: bool = True
    ttft_s: Optional[float] = None  # arrival -> first token
    tpot_s: Optional[float] = None  # (last token - first token) / (output tokens - 1)
    e2e_s: Optional[float] = None  # arrival -> last byte
    queue_delay_s: Optional[float] = None  # arrival -> first scheduled (when reported)
    finish_reason: Optional[str] = None
    deadline_ms: Optional[float] = None


@dataclass
class LaneSLO:
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2e_ms: Optional[float] = None

    def met(self, r: RequestRecord) -> bool:
        if r.outcome != OK:
            return False
        # A non-streamed answer has no observable first token: only its E2E is checked.
        if self.ttft_ms is not None and r.stream and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot_s is not None and r.tpot_s * 1e3 > self.tpot_ms:
            return False
        if self.e2e_ms is not None and (r.e2e_s is None or r.e2e_s * 1e3 > self.e2e_ms):
            return False
        return True


def slos_from_config(config) -> dict[str, LaneSLO]:
    """Lane name -> SLO targets from a RuntimeConfig."""
    return {
        lane.name: LaneSLO(lane.slo.ttft_p95_ms, lane.slo.tpot_p95_ms, lane.slo.e2e_p95_ms)
        for lane in config.lanes
    }


@dataclass
class RunResult:
    """One phase of a benchmark."""

    name: str  # e.g. "continuous", "static"
    records: list[RequestRecord]
    duration_s: float  # first arrival -> last completion
    slos: dict[str, LaneSLO] = field(default_factory=dict)
    token_bins: dict[int, int] = field(default_factory=dict)  # bin index -> output tokens
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. KV waste, simulator totals
    description: str = ""


class TokenBins:
    """Output tokens per TOKEN_BIN_S bin, accumulated as tokens arrive."""

    def __init__(self) -> None:
        self.bins: Counter[int] = Counter()

    def add(self, t_s: float, n: int = 1) -> None:
        self.bins[int(max(t_s, 0.0) // TOKEN_BIN_S)] += n

    def add_many(self, times_s: Iterable[float]) -> None:
        for t in times_s:
            self.bins[int(max(t, 0.0) // TOKEN_BIN_S)] += 1


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default); None for no samples."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    return float(np.percentile(np.asarray(vals, dtype=float), q))


def _dist(values: Sequence[Optional[float]]) -> dict[str, Optional[float]]:
    vals = [v for v in values if v is not None]
    out: dict[str, Optional[float]] = {f"p{q}": percentile(vals, q) for q in PERCENTILES}
    out["mean"] = float(np.mean(vals)) if vals else None
    out["n"] = len(vals)
    return out


def lane_summary(records: list[RequestRecord], duration_s: float, slo: Optional[LaneSLO]) -> dict[str, Any]:
    done = [r for r in records if r.outcome == OK]
    out_tokens = sum(r.output_tokens for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records if r.outcome in (OK, CANCELLED))
    dur = max(duration_s, 1e-9)
    met = sum(1 for r in done if slo is None or slo.met(r))
    n_judged = sum(1 for r in records if r.outcome != CANCELLED)
    return {
        "requests": len(records),
        "outcomes": {o: sum(1 for r in records if r.outcome == o) for o in OUTCOMES},
        "rejections": dict(Counter(r.reason or "unknown" for r in records if r.outcome == REJECTED)),
        "timeouts": dict(Counter(r.reason or "unknown" for r in records if r.outcome == TIMEOUT)),
        "errors": dict(Counter(r.reason or "unknown" for r in records if r.outcome == ERROR)),
        "cancellations": sum(1 for r in records if r.outcome == CANCELLED),
        "ttft_s": _dist([r.ttft_s for r in done]),
        "tpot_s": _dist([r.tpot_s for r in done]),
        "e2e_s": _dist([r.e2e_s for r in done]),
        "queue_delay_s": _dist([r.queue_delay_s for r in records if r.outcome in (OK, CANCELLED)]),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / dur,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / dur,
        "throughput_rps": len(done) / dur,
        "slo": asdict(slo) if slo else None,
        "slo_met": met,
        # Share of requests that met the SLO, leaving out those the client itself cancelled.
        "slo_attainment": met / n_judged if n_judged else None,
        "goodput_rps": met / dur,
    }


def summarize(result: RunResult) -> dict[str, Any]:
    lanes = sorted({r.lane for r in result.records})
    per_lane = {
        lane: lane_summary([r for r in result.records if r.lane == lane], result.duration_s, result.slos.get(lane))
        for lane in lanes
    }
    overall = lane_summary(result.records, result.duration_s, None)
    # Overall goodput: each request against its own lane's SLO.
    met = sum(per_lane[lane]["slo_met"] for lane in lanes)
    overall["slo_met"] = met
    overall["goodput_rps"] = met / max(result.duration_s, 1e-9)
    judged = sum(1 for r in result.records if r.outcome != CANCELLED)
    overall["slo_attainment"] = met / judged if judged else None
    return {
        "name": result.name,
        "description": result.description,
        "duration_s": result.duration_s,
        "lanes": per_lane,
        "all": overall,
        "extra": result.extra,
    }


# --------------------------------------------------------------------------- output


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}" if v >= 0.1 else f"{v * 1e3:.1f}"


def _fmt_counts(d: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"


def format_table(summaries: list[dict[str, Any]]) -> str:
    """A plain-text table: one row per (phase, lane) plus an `all` row per phase."""
    header = (
        f"{'phase':<12} {'lane':<13} {'reqs':>5} {'ok':>5} {'TTFT p50/p95/p99 ms':>21} "
        f"{'TPOT p50/p95/p99 ms':>20} {'E2E p50/p95 s':>14} {'queue p95 ms':>12} "
        f"{'out tok/s':>9} {'goodput r/s':>11} {'SLO met':>7}  rejected / cancelled"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        rows = list(s["lanes"].items()) + [("all", s["all"])]
        for lane, d in rows:
            ttft, tpot, e2e, qd = d["ttft_s"], d["tpot_s"], d["e2e_s"], d["queue_delay_s"]
            e2e_text = "-" if e2e["p50"] is None else f"{e2e['p50']:.2f}/{e2e['p95']:.2f}"
            att = "-" if d["slo_attainment"] is None else f"{100 * d['slo_attainment']:.0f}%"
            lines.append(
                f"{s['name']:<12} {lane:<13} {d['requests']:>5} {d['outcomes'][OK]:>5} "
                f"{_ms(ttft['p50']) + '/' + _ms(ttft['p95']) + '/' + _ms(ttft['p99']):>21} "
                f"{_ms(tpot['p50']) + '/' + _ms(tpot['p95']) + '/' + _ms(tpot['p99']):>20} "
                f"{e2e_text:>14} {_ms(qd['p95']):>12} {d['output_tokens_per_s']:>9.1f} "
                f"{d['goodput_rps']:>11.2f} {att:>7}  "
                f"{_fmt_counts(d['rejections'])} / {d['cancellations']}"
                + (f" timeouts {_fmt_counts(d['timeouts'])}" if d["timeouts"] else "")
                + (f" errors {_fmt_counts(d['errors'])}" if d["errors"] else "")
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare(summaries: list[dict[str, Any]], baseline: Optional[str] = None) -> dict[str, Any]:
    """Ratios of every phase against the baseline phase (default: the last one), per lane."""
    if len(summaries) < 2:
        return {}
    base = next((s for s in summaries if s["name"] == baseline), summaries[-1])
    out: dict[str, Any] = {"baseline": base["name"], "phases": {}}
    for s in summaries:
        if s is base:
            continue
        per: dict[str, Any] = {}
        for lane in ["all"] + [lane for lane in s["lanes"] if lane in base["lanes"]]:
            a = s["all"] if lane == "all" else s["lanes"][lane]
            b = base["all"] if lane == "all" else base["lanes"][lane]
            per[lane] = {
                "goodput": ratio(a["goodput_rps"], b["goodput_rps"]),
                "output_tokens_per_s": ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
                "ttft_p95": ratio(a["ttft_s"]["p95"], b["ttft_s"]["p95"]),
                "tpot_p95": ratio(a["tpot_s"]["p95"], b["tpot_s"]["p95"]),
                "e2e_p95": ratio(a["e2e_s"]["p95"], b["e2e_s"]["p95"]),
            }
        out["phases"][s["name"]] = per
    return out


def format_ratios(cmp: dict[str, Any]) -> str:
    if not cmp:
        return ""

    def f(v: Optional[float]) -> str:
        return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.2f}x")

    lines = [f"ratios vs {cmp['baseline']!r} (goodput and tok/s: higher is better; latencies: lower is better)"]
    for name, per in cmp["phases"].items():
        for lane, r in per.items():
            lines.append(
                f"  {name:<12} {lane:<13} goodput {f(r['goodput']):>7}  out tok/s {f(r['output_tokens_per_s']):>7}  "
                f"TTFT p95 {f(r['ttft_p95']):>7}  TPOT p95 {f(r['tpot_p95']):>7}  E2E p95 {f(r['e2e_p95']):>7}"
            )
    return "\n".join(lines) + "\n"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return obj


def write_json(path: str | Path, results: list[RunResult], meta: Optional[dict[str, Any]] = None,
               include_records: bool = True) -> dict[str, Any]:
    summaries = [summarize(r) for r in results]
    doc = {
        "meta": meta or {},
        "phases": summaries,
        "comparison": compare(summaries),
        "token_bins_s": TOKEN_BIN_S,
        "tokens_over_time": {r.name: {str(k): v for k, v in sorted(r.token_bins.items())} for r in results},
    }
    if include_records:
        doc["records"] = {r.name: [asdict(x) for x in r.records] for r in results}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(doc), indent=1))
    return doc


def plot(path: str | Path, results: list[RunResult], title: str = "") -> Path:
    """PNG: TTFT and TPOT distributions (CDF) per lane and phase, and output tokens/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    styles = ["-", "--", ":", "-."]
    lanes = sorted({r.lane for res in results for r in res.records})
    # Two phases: colour = lane, line style = phase. More phases: colour = phase, style = lane.
    by_phase = len(results) > 2

    def look(pi: int, li: int) -> tuple[str, str]:
        if by_phase:
            return f"C{pi % 10}", styles[li % len(styles)]
        return f"C{li % 10}", styles[pi % len(styles)]

    colors = {lane: f"C{i}" for i, lane in enumerate(lanes)}
    for pi, res in enumerate(results):
        for li, lane in enumerate(lanes):
            done = [r for r in res.records if r.lane == lane and r.outcome == OK]
            color, style = look(pi, li)
            for ax, attr in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
                vals = np.sort([getattr(r, attr) * 1e3 for r in done if getattr(r, attr) is not None])
                if len(vals):
                    ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), style, color=color,
                            label=f"{res.name} / {lane}")
        if res.token_bins:
            last = max(res.token_bins)
            xs = np.arange(last + 1) * TOKEN_BIN_S
            ys = [res.token_bins.get(i, 0) / TOKEN_BIN_S for i in range(last + 1)]
            axes[2].plot(xs, ys, "-" if by_phase else styles[pi % len(styles)], color=f"C{pi % 10}",
                         label=res.name, lw=1)
    for ax, name in ((axes[0], "TTFT (ms)"), (axes[1], "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name.split()[0]} CDF per lane and phase")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for lane, slo in (results[0].slos.items() if results and not by_phase else []):
        if lane in colors and slo.ttft_ms:
            axes[0].axvline(slo.ttft_ms, color=colors[lane], alpha=0.3, lw=1)
        if lane in colors and slo.tpot_ms:
            axes[1].axvline(slo.tpot_ms, color=colors[lane], alpha=0.3, lw=1)
    axes[2].set_xlabel("time since start (s)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("output tokens/s over time")
    axes[2].grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    return _save(fig, plt, path, title)


def plot_steps(path: str | Path, steps: list[dict[str, Any]], title: str = "") -> Path:
    """PNG timeline of flight recorder steps (x: step id): tokens per lane (prefill solid,
    decode dashed), KV usage against its high and reject watermarks with preemptions and
    refusals marked, and running and waiting requests per lane."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not steps:
        raise ValueError("no steps to draw")
    xs = np.array([s["step"] for s in steps])
    lanes = sorted({name for s in steps for name in s["lanes"]})

    def lane_series(lane: str, key: str) -> np.ndarray:
        return np.array([s["lanes"].get(lane, {}).get(key, 0) for s in steps])

    fig, axes = plt.subplots(3, 1, figsize=(14, 10), sharex=True)
    for i, lane in enumerate(lanes):
        color = f"C{i % 10}"
        axes[0].plot(xs, lane_series(lane, "prefill_tokens"), "-", color=color, lw=1, label=f"{lane} prefill")
        axes[0].plot(xs, lane_series(lane, "decode_tokens"), "--", color=color, lw=1, label=f"{lane} decode")
        axes[2].plot(xs, lane_series(lane, "running"), "-", color=color, lw=1, label=f"{lane} running")
        axes[2].plot(xs, lane_series(lane, "waiting"), ":", color=color, lw=1.5, label=f"{lane} waiting")
    axes[0].set_ylabel("tokens in the step")
    axes[0].set_title("tokens per lane per step")

    usage = np.array([s["kv"]["usage"] for s in steps])
    axes[1].plot(xs, usage, "-", color="C0", lw=1, label="KV usage")
    for key, color in (("high_watermark", "C1"), ("reject_watermark", "C3")):
        marks = [s["kv"].get(key) for s in steps]
        if any(m is not None for m in marks):
            axes[1].step(xs, [np.nan if m is None else m for m in marks], where="post", color=color, lw=1,
                         label=key.replace("_", " "))
    preempted = [s["step"] for s in steps if s.get("preemptions")]
    refused = [s["step"] for s in steps if s.get("refusals")]
    if preempted:
        axes[1].plot(preempted, [1.02] * len(preempted), "v", color="C4", ms=4, ls="none", label="preemptions")
    if refused:
        axes[1].plot(refused, [1.06] * len(refused), "x", color="C3", ms=4, ls="none", label="refusals")
    axes[1].set_ylim(0, 1.1)
    axes[1].set_ylabel("used / total blocks")
    axes[1].set_title("KV cache usage and watermarks")
    axes[2].set_ylabel("requests")
    axes[2].set_title("queue depths per lane")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2)
    return _save(fig, plt, path, title)


def write_all(out_dir: str | Path, stem: str, results: list[RunResult], meta: Optional[dict[str, Any]] = None,
              title: str = "", include_records: bool = True) -> tuple[str, Path, Path]:
    """Table text (returned), JSON and PNG under out_dir."""
    out_dir = Path(out_dir)
    doc = write_json(out_dir / f"{stem}.json", results, meta, include_records)
    png = plot(out_dir / f"{stem}.png", results, title)
    text = format_table(doc["phases"]) + "\n" + format_ratios(doc["comparison"])
    return text, out_dir / f"{stem}.json", png


def _save(fig, plt, path, title: Optional[str]) -> Path:
    """Title, lay out, write the PNG (making its folder) and free the figure."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
