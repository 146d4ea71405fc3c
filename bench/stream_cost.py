"""The event loop's CPU time per streamed token, with the model taken out.

`tokenlane serve` runs with the simulated executor (no weights: each step sleeps its
cost-model time, so the step thread hardly competes for the GIL or a core) and N clients
stream long completions over raw sockets from this process (they only count events, so they
cost little next to the server). Over a window in the middle of the streams, the server's
main thread (uvicorn's event loop: the hand-over of each step's outputs, the SSE chunks, the
socket writes) is read from /proc/PID/task/PID/schedstat; the table gives its CPU time per
streamed token, the event loop's share of a core, and the tokens per second. A/B against
another tree: put it first on PYTHONPATH (the server is started with this environment).

    python -m tokenlane.bench.stream_cost --streams 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tokenlane.bench.serve_proc import ServerProcess


async def _stream(port: int, model: str, index: int, max_tokens: int, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": model, "prompt": [1 + index, 2, 3, 4], "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            counts[index] += data.count(b"data: {")
            if b"[DONE]" in data:
                return
    finally:
        writer.close()


def _loop_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


async def _measure(port: int, pid: int, model: str, streams: int, max_tokens: int, warmup_s: float,
                   window_s: float) -> dict[str, float]:
    counts = [0] * streams
    tasks = [asyncio.create_task(_stream(port, model, i, max_tokens, counts)) for i in range(streams)]
    try:
        await asyncio.sleep(warmup_s)
        tokens0, cpu0, t0 = sum(counts), _loop_cpu_ns(pid), time.perf_counter()
        await asyncio.sleep(window_s)
        tokens1, cpu1, t1 = sum(counts), _loop_cpu_ns(pid), time.perf_counter()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokens = tokens1 - tokens0
    if tokens <= 0 or any(task.done() and not task.cancelled() and task.exception() for task in tasks):
        raise RuntimeError("no tokens streamed in the window (are the streams long enough?)")
    return {"tokens_per_s": tokens / (t1 - t0), "loop_cpu_us_per_token": (cpu1 - cpu0) / 1e3 / tokens,
            "loop_cores": (cpu1 - cpu0) / 1e9 / (t1 - t0)}


def run(model_dir: Path, streams: int, rounds: int, warmup_s: float, window_s: float,
        workdir: Path) -> list[dict[str, Any]]:
    max_tokens = 16000  # the streams outlast the window: it measures steady streaming
    config = {
        "model": {"path": str(model_dir), "servedName": "sim", "maxModelLen": max_tokens + 64},
        "engine": {"executor": "simulated", "device": "cpu", "blockSize": 16,
                   "kvCacheBlocks": streams * (max_tokens // 16 + 8)},
        "scheduler": {"maxActiveSequences": streams, "maxWaitingRequests": 4096, "queueTimeoutMs": 3_600_000,
                      "streamIdleTimeoutMs": 600_000},
    }
    results = []
    for round_index in range(rounds):
        with ServerProcess(config, workdir, f"round-{round_index + 1}", ready_timeout_s=300) as server:
            result = asyncio.run(_measure(server.port, server.proc.pid, "sim", streams, max_tokens,
                                          warmup_s, window_s))
        result["round"] = round_index + 1
        results.append(result)
        print(f"round {round_index + 1}: {result['loop_cpu_us_per_token']:.2f} us of loop CPU per token, "
              f"{result['tokens_per_s']:,.0f} tokens/s", flush=True)
    return results


def format_table(results: list[dict[str, Any]], streams: int) -> str:
    rows = [f"{'streams':>8} {'round':>6} {'loop CPU / token':>17} {'loop cores':>11} {'tokens/s':>10}"]
    for r in results:
        rows.append(f"{streams:>8} {r['round']:>6} {r['loop_cpu_us_per_token']:>14.2f} us {r['loop_cores']:>11.3f} "
                    f"{r['tokens_per_s']:>10,.0f}")
    rows.append(f"{'median':>15} {statistics.median(r['loop_cpu_us_per_token'] for r in results):>14.2f} us")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenlane.bench.stream_cost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder for the tokenizer and shape (default: step_profile's 19M Llama)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="server runs, each measured once (default 3)")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before the window (default 1.5)")
    p.add_argument("--window", type=float, default=5.0, help="seconds measured (default 5)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.streams < 1 or args.rounds < 1 or args.window <= 0:
        p.error("--streams and --rounds must be >= 1, --window > 0")
    from tokenlane.bench.step_profile import ensure_model

    model_dir = ensure_model(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="tokenlane-stream-cost-"))
    results = run(model_dir, args.streams, args.rounds, args.warmup, args.window, workdir)
    print()
    print(format_table(results, args.streams))
    if args.json:
        Path(args.json).write_text(json.dumps({"streams": args.streams, "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
