"""SOURCE parsing, the cache's verification and completion rules, DEST handling, local folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sources_harness import fetch_env, run_fetch

from tokenlane.runtime.sources import cache
from tokenlane.runtime.sources.errors import Backoff, SourceError
from tokenlane.runtime.sources.fetch import FetchOptions, fetch_model, main
from tokenlane.runtime.sources.uri import ModelSource, parse_source


@pytest.mark.parametrize("text, expected", [
    ("hf://org/name", ModelSource("hf", "org/name")),
    ("hf://org/name@v1.2", ModelSource("hf", "org/name", revision="v1.2")),
    ("hf://gpt2", ModelSource("hf", "gpt2")),
    ("s3://bucket/some/prefix/", ModelSource("s3", "bucket/some/prefix", bucket="bucket", prefix="some/prefix")),
    ("s3://bucket", ModelSource("s3", "bucket", bucket="bucket", prefix="")),
])
def test_sources_parse(text, expected):
    assert parse_source(text) == expected


def test_a_relative_folder_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_source("weights") == ModelSource("local", str(tmp_path / "weights"))


@pytest.mark.parametrize("text, revision, message", [
    ("", None, "SOURCE is empty"),
    ("hf://", None, "ORG/NAME"),
    ("hf://org/na me", None, "ORG/NAME"),
    ("hf://org/name@", None, "nothing after '@'"),
    ("hf://org/name@v1", "v2", "but --revision is 'v2'"),
    ("s3://Bad_Bucket/x", None, "not a valid S3 bucket name"),
    ("s3://bucket/x", "main", "--revision applies to hf:// sources only"),
    ("gs://bucket/x", None, "unknown scheme 'gs'"),
])
def test_malformed_sources_raise_value_errors_naming_the_problem(text, revision, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
        parse_source(text, revision=revision)


@pytest.mark.parametrize("argv", [
    ["gs://bucket/x", "/tmp/dest"],
    ["hf://org/name", "/tmp/dest", "--max-attempts", "0"],
    ["hf://org/name", "/tmp/dest", "--endpoint-url", "localhost:9000"],
    ["hf://org/name"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_backoff_retries_transient_errors_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise SourceError("503 Service Unavailable", transient=True)
        return "ok"

    assert Backoff(attempts=3, base_s=0).run("try", flaky, lambda e: SourceError(str(e))) == "ok"
    assert len(calls) == 3
    calls.clear()

    def missing():
        calls.append(1)
        raise SourceError("404 Not Found")

    with pytest.raises(SourceError, match="404"):
        Backoff(attempts=5, base_s=0).run("try", missing, lambda e: SourceError(str(e)))
    assert len(calls) == 1


def _folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "weights.bin").write_bytes(os.urandom(5000))
    return src


def test_a_short_file_is_refused_and_deleted_so_the_next_try_fetches_it_again(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "w.bin").write_bytes(b"x" * 90)
    listing = cache.Listing(key="k", files=(cache.RemoteFile("w.bin", 100),))
    with pytest.raises(SourceError, match="size mismatch: got 90 bytes, the source lists 100") as raised:
        cache.verify(staging, listing)
    assert raised.value.transient and not (staging / "w.bin").exists()


def test_a_hash_mismatch_is_refused(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "w.bin").write_bytes(b"y" * 100)
    listing = cache.Listing(key="k", files=(cache.RemoteFile("w.bin", 100, sha256="0" * 64),))
    with pytest.raises(SourceError, match="sha256 mismatch"):
        cache.verify(staging, listing)


def test_unsafe_names_from_a_source_are_refused():
    with pytest.raises(SourceError, match="unsafe file name"):
        cache.RemoteFile("../../etc/passwd", 1)


def test_a_half_written_entry_is_never_used_and_the_next_run_completes_it(tmp_path):
    src, cache_dir = _folder(tmp_path), tmp_path / "cache"
    source = parse_source(str(src))
    first = fetch_model(source, tmp_path / "dest", FetchOptions(cache_dir=str(cache_dir)))
    entry = first.path
    # Simulate a crash before completion: the entry back to a staging folder without its marker.
    staging = entry.parent / f".{first.key}.partial"
    (entry / cache.MARKER).unlink()
    (staging.parent).mkdir(exist_ok=True)
    os.replace(entry, staging)
    (staging / cache.STAGING_STAMP).write_text(json.dumps({"key": first.key}))
    (staging / "sub" / "weights.bin").unlink()
    (tmp_path / "dest").unlink()
    assert not cache.is_complete(entry, first.key)

    again = fetch_model(source, tmp_path / "dest", FetchOptions(cache_dir=str(cache_dir)))
    assert not again.cache_hit and again.received_bytes == 5000  # only the missing file was copied
    assert cache.is_complete(entry, first.key) and not staging.exists()
    assert (tmp_path / "dest" / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()


def test_without_a_cache_dest_is_a_folder_renamed_into_place_and_replaced_when_the_source_changes(tmp_path):
    src, dest = _folder(tmp_path), tmp_path / "dest"
    env = fetch_env(tmp_path)
    done = run_fetch(env, str(src), str(dest))
    assert done.returncode == 0, done.stderr
    assert dest.is_dir() and not dest.is_symlink() and done.stdout.strip().splitlines()[-1] == str(dest)
    assert "cache hit" in run_fetch(env, str(src), str(dest)).stdout
    (src / "config.json").write_text('{"a": 2, "b": 3}')
    changed = run_fetch(env, str(src), str(dest))
    assert changed.returncode == 0 and "fetched" in changed.stdout
    assert (dest / "config.json").read_text() == '{"a": 2, "b": 3}'
    assert {p.name for p in tmp_path.iterdir()} == {".dest.lock", "dest", "src"}  # no staging or old copy left


def test_a_dest_folder_that_fetch_model_did_not_write_is_never_replaced(tmp_path):
    src, dest = _folder(tmp_path), tmp_path / "dest"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    done = run_fetch(fetch_env(tmp_path), str(src), str(dest), "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 2 and "refusing to replace it" in done.stderr
    assert (dest / "precious.txt").read_text() == "keep me"


def test_fetch_model_runs_without_torch(tmp_path):
    """The init container's image need not ship torch: the whole room imports and fetches without it."""
    import subprocess
    import sys

    src = _folder(tmp_path)
    code = (
        "import sys\n"
        "for blocked in ('torch', 'triton', 'transformers', 'fastapi'):\n"
        "    sys.modules[blocked] = None\n"
        "import tokenlane.runtime.sources.hub, tokenlane.runtime.sources.s3, tokenlane.runtime.sources.local\n"
        "from tokenlane.cli import main\n"
        f"sys.exit(main(['fetch-model', {str(src)!r}, {str(tmp_path / 'dest')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dest" / "sub" / "weights.bin").is_file()


def test_a_model_larger_than_the_free_space_is_refused_up_front(tmp_path, monkeypatch):
    src, cache_dir = _folder(tmp_path), tmp_path / "cache"
    monkeypatch.setattr(cache, "free_bytes", lambda folder: 1000)
    with pytest.raises(SourceError, match=r"needs 5008 more bytes but .* has only 1000 free"):
        fetch_model(parse_source(str(src)), tmp_path / "dest", FetchOptions(cache_dir=str(cache_dir)))
    assert not (tmp_path / "dest").exists()


def test_a_local_failure_exits_1_and_still_fills_the_termination_log(tmp_path, capsys):
    src = _folder(tmp_path)
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    log = tmp_path / "termination-log"
    argv = [str(src), str(tmp_path / "dest"), "--cache-dir", str(tmp_path / "cache"), "--termination-log", str(log)]
    assert main(argv) == 1
    assert "NotADirectoryError" in log.read_text() or "FileExistsError" in log.read_text()
