"""What structured output adds to one decode step: grammar masks for a few constrained rows of
a full batch.

    python -m tokenlane.bench.grammar_cost [--running 64] [--constrained 4] [--vocab 32000]

A synthetic byte-level vocabulary (the 256 bytes, then random.Random(0) strings of 2-8
printable ASCII characters) stands in for a real tokenizer's. `--constrained` rows follow a
JSON schema (a small object with a bounded string, an integer, an enum array and a boolean);
each step every constrained matcher is advanced by one allowed token (drawn uniformly from
its mask, a fresh matcher when one completes), then the step's work is timed:

  masks     GrammarMatchers.masked on [running, vocab] float32 logits, in place (as a step
            without logprobs runs it): the bitmask fills of the constrained rows and one
            vectorized apply over them
  sampling  the Sampler on the same logits (temperature 1), for scale
  overhead  masks / sampling

Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def synthetic_vocab(size: int) -> list[bytes]:
    rng = random.Random(0)
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    while len(vocab) < size - 1:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab + [b"</s>"]  # the last id is EOS


def run(running: int, constrained: int, vocab_size: int, steps: int, device: str) -> dict:
    import torch
    import xgrammar

    from tokenlane.runtime.core.request import SamplingParams
    from tokenlane.runtime.executor.sampler import Sampler
    from tokenlane.runtime.executor.structured_output import GrammarMatchers, _BOUNDED_STRING_CHARS, _JSON_STRING_CHARS

    vocab = synthetic_vocab(vocab_size)
    eos = len(vocab) - 1
    info = xgrammar.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    grammar = compiler.compile_grammar(ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS))
    compile_s = time.perf_counter() - t0

    free = SamplingParams(max_tokens=10**6)
    requests = [SimpleNamespace(request_id=f"r{i}", output_token_ids=[],
                                sampling_params=SamplingParams(max_tokens=10**6, grammar=grammar) if i < constrained else free)
                for i in range(running)]
    matchers = GrammarMatchers()
    sampler = Sampler(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rng = random.Random(0)
    mask_s, sample_s = [], []
    restarts = 0
    for step in range(steps):
        logits = torch.randn(running, vocab_size, generator=gen, device=device)
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        masked = matchers.masked(logits, requests, copy=False)
        if device != "cpu":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        sampler(masked, [r.sampling_params for r in requests], [None] * running, requests)
        if device != "cpu":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step:  # the first step builds the matchers
            mask_s.append(t1 - t0)
            sample_s.append(t2 - t1)
        for i in range(constrained):
            allowed = torch.nonzero(masked[i] > float("-inf")).flatten().tolist()
            token = rng.choice(allowed)
            if token == eos:  # complete: the next document starts on a fresh matcher
                matchers.release(requests[i].request_id)
                requests[i].request_id += "+"
                requests[i].output_token_ids = []
                restarts += 1
            else:
                requests[i].output_token_ids.append(token)
    mask_ms = statistics.median(mask_s) * 1e3
    sample_ms = statistics.median(sample_s) * 1e3
    return {
        "running": running, "constrained": constrained, "vocab": vocab_size, "steps": steps, "device": device,
        "compile_ms": round(compile_s * 1e3, 2),
        "mask_ms_p50": round(mask_ms, 3),
        "mask_ms_p99": round(sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e3, 3),
        "sampling_ms_p50": round(sample_ms, 3),
        "overhead": round(mask_ms / sample_ms, 3),
        "documents_completed": restarts,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenlane.bench.grammar_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--constrained", type=int, default=4)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if not 0 < args.constrained <= args.running:
        parser.error("--constrained must be in [1, --running]")
    rows = [run(args.running, args.constrained, v, args.steps, args.device) for v in args.vocab]
    header = f"{'vocab':>7} {'running':>7} {'constr.':>7} {'masks p50 ms':>12} {'p99 ms':>8} " \
             f"{'sampling ms':>11} {'overhead':>8} {'compile ms':>10}"
    print(header)
    for r in rows:
        print(f"{r['vocab']:>7} {r['running']:>7} {r['constrained']:>7} {r['mask_ms_p50']:>12.3f} "
              f"{r['mask_ms_p99']:>8.3f} {r['sampling_ms_p50']:>11.3f} {r['overhead']:>8.2f} {r['compile_ms']:>10.1f}")
    doc = {"device": args.device, "threads": args.threads, "results": rows}
    print(json.dumps(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
