"""Schemathesis, with its checks (`--checks all`), against the OpenAPI document the real server
publishes, over real HTTP: what the document declares (400 not 422, OpenAI's error body, the
content types, the response schemas, the required fields and bounds) is what the server does,
for generated valid and invalid requests. A bounded number of examples per operation keeps it
in the default run.

One check is left out, `positive_data_acceptance` (every schema-valid body gets a 2xx): some
rules are between fields or depend on the model, and a JSON Schema cannot state them (prompt
tokens + max_tokens within the context length, tool_choice only with tools, guided_json being
a valid JSON Schema, logit_bias keys in the vocabulary); such bodies get a 400. The rules it
can state are declared (runtime/entrypoints/app.py, `_declare_validation_rules`), and the reverse check,
`negative_data_rejection` (a body the document forbids gets a 400), runs.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

# Per operation; the seed makes a failure reproducible with the printed command.
MAX_EXAMPLES = 5
SEED = 20261130

# A short context bounds the cost of a generated request (max_tokens past it is a fast 400).
# Much of the run is token generation: a chat request without max_tokens fills the context
# (OpenAI's default). At 32 tokens every operation still gets 2xx cases (batched prompts
# included); with this seed one fuzzed batch (a 23-token prompt) gets the declared 400
# context_length_exceeded instead of a 200.
CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 32}}
engine: {{blockSize: 16, kvCacheBlocks: 256, device: cpu}}
scheduler: {{maxActiveSequences: 16, maxWaitingRequests: 64, maxBatchedTokens: 256, prefillChunkSize: 128}}
"""


@pytest.mark.timeout(600)  # ~90 s of schemathesis on 2 cores shared with other test runs
def test_schemathesis_finds_no_failures(serve, tmp_path):
    live = serve(CONFIG)
    live.state.options.dump_dir = tmp_path / "dumps"  # POST /debug/dump writes files
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{live.url}/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--phases", "coverage,fuzzing,stateful",
        # Generous: a CPU shared with other jobs; the point is the contract, not the latency.
        "--workers", "1", "--request-timeout", "60", "--max-response-time", "60", "--no-color",
    ]
    try:
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(f"schemathesis ran past 540 s:\n{partial}") from None
    output = run.stdout + run.stderr
    assert run.returncode == 0, " ".join(command) + "\n" + output[-12000:]
    # Every generated case passed every check (the summary reads "N generated, N passed").
    assert re.search(r"\b(\d+) generated, \1 passed\b", output), output[-4000:]
