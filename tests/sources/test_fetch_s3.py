"""`tokenlane fetch-model s3://...` against moto's S3 server on loopback (AWS_ENDPOINT_URL_S3)."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

from hub_server import Gate
from sources_harness import BUCKET, PREFIX, fetch_env, run_fetch, start_fetch, wait_for

from tokenlane.runtime.sources.cache import MARKER

SOURCE = f"s3://{BUCKET}/{PREFIX}"
WEIGHTS = f"/{BUCKET}/{PREFIX}/model.safetensors"


def test_fetch_verifies_every_file_and_a_second_fetch_is_a_cache_hit(s3, tmp_path, tiny_model_dir):
    env, cache = fetch_env(tmp_path, s3=s3), tmp_path / "cache"
    first = run_fetch(env, SOURCE, str(tmp_path / "a" / "model"), "--cache-dir", str(cache))
    assert first.returncode == 0, first.stderr
    dest = tmp_path / "a" / "model"
    assert dest.is_symlink() and dest.resolve().parent == (cache / "s3" / "models%2Ftiny%2Fllama").resolve()
    marker = json.loads((dest / MARKER).read_text())
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(tiny_model_dir).iterdir()}
    assert {f["path"]: f["sha256"] for f in marker["files"]} == expected
    assert sorted(p.name for p in dest.iterdir()) == sorted([*expected, MARKER])  # no .part left over
    assert len(s3.gets(bucket=BUCKET)) == len(expected)

    seen = len(s3.requests)
    second = run_fetch(env, SOURCE, str(tmp_path / "b" / "model"), "--cache-dir", str(cache))
    assert second.returncode == 0, second.stderr
    assert "cache hit" in second.stdout
    assert s3.gets(seen) == []  # one listing, no object downloaded
    assert [r.method for r in s3.requests[seen:]] == ["GET"]


def test_allow_patterns_fetch_only_the_matching_objects(s3, tmp_path):
    done = run_fetch(fetch_env(tmp_path, s3=s3), SOURCE, str(tmp_path / "model"),
                     "--allow-patterns", "*.json", "*.safetensors")
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (tmp_path / "model").iterdir() if p.name != MARKER)
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]


def test_a_download_killed_midway_resumes_with_a_range_request(s3, tmp_path):
    env, cache, dest = fetch_env(tmp_path, s3=s3), tmp_path / "cache", tmp_path / "model"
    s3.gate = Gate(WEIGHTS, after_bytes=300_000)
    proc = start_fetch(env, SOURCE, str(dest), "--cache-dir", str(cache))
    try:
        assert s3.gate.reached.wait(timeout=120), "the download never reached the gate"
        # the bytes before the gate are on the wire: wait until the client has written them
        parts = lambda: list((cache / "s3").rglob("model.safetensors.part"))  # noqa: E731
        wait_for(lambda: parts() and parts()[0].stat().st_size >= 4 * 65536, "the first chunks on disk")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not dest.exists() and not dest.is_symlink()
    entries = [p for p in (cache / "s3" / "models%2Ftiny%2Fllama").iterdir() if not p.name.startswith(".")]
    assert entries == []  # only the hidden staging folder and lock file: nothing usable

    s3.gate.release.set()
    seen = len(s3.requests)
    again = run_fetch(env, SOURCE, str(dest), "--cache-dir", str(cache))
    assert again.returncode == 0, again.stderr
    weights = [r for r in s3.gets(seen) if r.path == WEIGHTS]
    assert len(weights) == 1 and weights[0].range is not None and weights[0].range.startswith("bytes=")
    resumed_at = int(weights[0].range[len("bytes="):].rstrip("-"))
    size = (dest / "model.safetensors").stat().st_size
    assert 0 < resumed_at < size and weights[0].bytes_sent == size - resumed_at
    assert "resuming at byte" in again.stderr
    marker = json.loads((dest / MARKER).read_text())
    weights_row = next(f for f in marker["files"] if f["path"] == "model.safetensors")
    assert weights_row["sha256"] == hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest()


def test_a_wrong_bucket_exits_1_with_s3s_message_in_stderr_and_the_termination_log(s3, tmp_path):
    log = tmp_path / "termination-log"
    done = run_fetch(fetch_env(tmp_path, s3=s3), f"s3://no-such-bucket/{PREFIX}", str(tmp_path / "model"),
                     "--cache-dir", str(tmp_path / "cache"), "--termination-log", str(log))
    assert done.returncode == 1
    for text in (done.stderr, log.read_text()):
        assert "NoSuchBucket" in text and "The specified bucket does not exist" in text
    assert len(s3.requests) == 1  # a 404 is never retried


def test_an_empty_prefix_is_a_source_error(s3, tmp_path):
    done = run_fetch(fetch_env(tmp_path, s3=s3), f"s3://{BUCKET}/nothing/here", str(tmp_path / "model"))
    assert done.returncode == 1
    assert "no objects under s3://models/nothing/here/" in done.stderr


def test_a_truncated_object_is_refused_after_bounded_retries(s3, tmp_path):
    s3.truncate[WEIGHTS] = 1000
    log = tmp_path / "termination-log"
    done = run_fetch(fetch_env(tmp_path, s3=s3), SOURCE, str(tmp_path / "model"), "--cache-dir",
                     str(tmp_path / "cache"), "--max-attempts", "3", "--termination-log", str(log))
    assert done.returncode == 1
    assert "model.safetensors" in log.read_text() or "checksum" in log.read_text().lower()
    assert "try 2/3; retrying" in done.stderr
    assert not (tmp_path / "model").exists()
    assert not any(p.name[0] != "." for p in (tmp_path / "cache" / "s3" / "models%2Ftiny%2Fllama").iterdir())
