"""Helpers of the fetch-model tests: the fixtures' names and `tokenlane fetch-model` as a child
process with an environment pointed at the loopback servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = "tiny-org/tiny-llama"
PRIVATE_REPO = "tiny-org/private-llama"
GATED_REPO = "tiny-org/gated-llama"
HF_TOKEN = "hf_test_token_0123456789"
BUCKET = "models"
PREFIX = "tiny/llama"


def fetch_env(tmp_path: Path, hub=None, s3=None, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONUNBUFFERED="1")
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    if s3 is not None:
        env.update(AWS_ENDPOINT_URL_S3=s3.url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1")
    env.update(extra)
    return env


def fetch_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from tokenlane.cli import main; sys.exit(main())",
            "fetch-model", *args, "--backoff", "0"]


def run_fetch(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(fetch_argv(*args), env=env, capture_output=True, text=True, timeout=240)


def start_fetch(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(fetch_argv(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, what: str, deadline_s: float = 120.0) -> None:
    """Poll a condition the test cannot be told about (files another process writes)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
