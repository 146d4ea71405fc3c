"""`tokenlane fetch-model hf://...` against a Hub-compatible endpoint on loopback (HF_ENDPOINT)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from hub_server import Gate
from sources_harness import GATED_REPO, HF_TOKEN, PRIVATE_REPO, REPO, fetch_env, run_fetch, start_fetch, wait_for

from tokenlane.runtime.sources.cache import MARKER


def _entry(cache: Path, commit: str) -> Path:
    return cache / "hf" / "tiny-org%2Ftiny-llama" / commit


def test_fetched_checkpoint_serves_greedy_tokens_equal_to_transformers(hub, tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
    from tokenlane.runtime.core.request import Request, SamplingParams
    from tokenlane.runtime.engine.llm_engine import LLMEngine
    from tokenlane.runtime.engine.tokenizer import load_tokenizer
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    dest, cache = tmp_path / "model", tmp_path / "cache"
    done = run_fetch(fetch_env(tmp_path, hub), f"hf://{REPO}", str(dest), "--cache-dir", str(cache))
    assert done.returncode == 0, done.stderr
    commit = hub.repos[REPO].commit
    assert dest.is_symlink() and dest.resolve() == _entry(cache, commit).resolve()
    assert done.stdout.strip().splitlines()[-1] == str(_entry(cache, commit))
    marker = json.loads((dest / MARKER).read_text())
    assert marker["commit"] == commit and marker["source"] == f"hf://{REPO}"
    assert {f["path"]: f["size"] for f in marker["files"]} == {
        p.name: p.stat().st_size for p in Path(tiny_model_dir).iterdir()}
    assert not (dest / ".cache").exists()  # huggingface_hub's resume metadata is not part of the entry

    config = RuntimeConfig(model=ModelConfig(path=str(dest), dtype="float32"),
                           engine=EngineConfig(kv_cache_blocks=64, block_size=4, device="cpu"))
    engine = LLMEngine(config, ModelExecutor(config), tokenizer=load_tokenizer(str(dest)))
    prompt = [5, 17, 99, 260, 31, 8, 402]
    request = Request("r0", list(prompt), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # compare the full length, as ignore_eos does
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)
    assert request.output_token_ids == out[0, len(prompt):].tolist()


def test_a_second_fetch_into_another_dest_is_a_cache_hit_that_downloads_nothing(hub, tmp_path):
    env, cache = fetch_env(tmp_path, hub), tmp_path / "cache"
    first = run_fetch(env, f"hf://{REPO}", str(tmp_path / "pod-a" / "model"), "--cache-dir", str(cache))
    assert first.returncode == 0, first.stderr
    assert len(hub.file_gets()) == 6
    seen = len(hub.requests)
    second = run_fetch(env, f"hf://{REPO}", str(tmp_path / "pod-b" / "model"), "--cache-dir", str(cache))
    assert second.returncode == 0, second.stderr
    assert "cache hit" in second.stdout and "downloaded nothing" in second.stdout
    assert hub.file_gets(seen) == []  # only the revision and the listing were asked for
    assert all("/api/models/" in r.path for r in hub.requests[seen:])
    assert (tmp_path / "pod-b" / "model").resolve() == (tmp_path / "pod-a" / "model").resolve()
    # DEST already pointing at the complete entry: a hit before any lock or download.
    third = run_fetch(env, f"hf://{REPO}", str(tmp_path / "pod-b" / "model"), "--cache-dir", str(cache))
    assert third.returncode == 0 and "already points at" in third.stderr
    assert hub.file_gets(seen) == []


def test_a_download_killed_midway_leaves_no_dest_and_resumes_on_the_next_run(hub, tmp_path):
    env, cache, dest = fetch_env(tmp_path, hub), tmp_path / "cache", tmp_path / "model"
    commit = hub.repos[REPO].commit
    staging = cache / "hf" / "tiny-org%2Ftiny-llama" / f".{commit}.partial"
    hub.gate = Gate("model.safetensors", after_bytes=100_000)
    proc = start_fetch(env, f"hf://{REPO}", str(dest), "--cache-dir", str(cache))
    try:
        assert hub.gate.reached.wait(timeout=120), "the download never reached the gate"
        others = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json"]
        # the other files are not held: wait until huggingface_hub has recorded them as complete
        meta = staging / ".cache" / "huggingface" / "download"
        wait_for(lambda: all((meta / f"{name}.metadata").exists() for name in others), "the ungated files")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not dest.exists() and not dest.is_symlink()  # no usable DEST
    assert not _entry(cache, commit).exists()  # and no entry under its final name

    hub.gate.release.set()
    seen = len(hub.requests)
    again = run_fetch(env, f"hf://{REPO}", str(dest), "--cache-dir", str(cache))
    assert again.returncode == 0, again.stderr
    refetched = [Path(r.path).name for r in hub.file_gets(seen)]
    # The killed file is fetched again; the files complete before the kill are kept (a file whose
    # metadata landed just as the process died may be fetched again too: huggingface_hub's own order).
    assert "model.safetensors" in refetched and len(refetched) < len(others) + 1, refetched
    total = sum(f.stat().st_size for f in dest.iterdir() if f.is_file() and f.name != MARKER)
    assert sum(r.bytes_sent for r in hub.file_gets(seen)) < total
    assert json.loads((dest / MARKER).read_text())["commit"] == commit


def test_two_concurrent_fetches_into_one_cache_download_once(hub, tmp_path):
    env, cache = fetch_env(tmp_path, hub), tmp_path / "cache"
    hub.gate = Gate("model.safetensors", after_bytes=1000)
    first = start_fetch(env, f"hf://{REPO}", str(tmp_path / "a" / "model"), "--cache-dir", str(cache))
    second = None
    try:
        assert hub.gate.reached.wait(timeout=120)  # the first holds the entry's lock, mid-download
        second = start_fetch(env, f"hf://{REPO}", str(tmp_path / "b" / "model"), "--cache-dir", str(cache))
        waiting = ""
        for line in second.stderr:  # blocks until the second reports that it waits for the lock
            waiting = line
            if line.startswith("waiting for the lock"):
                break
        assert waiting.startswith("waiting for the lock") and f"pid {first.pid}" in waiting
        hub.gate.release.set()
        out_first, err_first = first.communicate(timeout=120)
        out_second, err_second = second.communicate(timeout=120)
    finally:
        hub.gate.release.set()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert first.returncode == 0, err_first
    assert second.returncode == 0, err_second
    assert "fetched" in out_first and "cache hit" in out_second
    names = sorted(Path(r.path).name for r in hub.file_gets())
    assert names == sorted(set(names)) and len(names) == 6  # every file downloaded exactly once
    assert (tmp_path / "a" / "model").resolve() == (tmp_path / "b" / "model").resolve()


@pytest.mark.parametrize(
    "source, token, expected",
    [
        (f"hf://{REPO}@no-such-branch", None, "Invalid rev id: no-such-branch"),
        (f"hf://{PRIVATE_REPO}", None, "Repository Not Found"),
        (f"hf://{PRIVATE_REPO}", "hf_wrong", "Invalid credentials in Authorization header"),
        ("hf://tiny-org/no-such-model", None, "Repository Not Found"),
        (f"hf://{GATED_REPO}", None, "Cannot access gated repo"),
    ],
    ids=["wrong-revision", "missing-token", "bad-token", "missing-repo", "gated-without-token"],
)
def test_source_errors_exit_1_with_the_hubs_message_in_stderr_and_the_termination_log(
        hub, tmp_path, source, token, expected):
    env = fetch_env(tmp_path, hub, **({"HF_TOKEN": token} if token else {}))
    log = tmp_path / "termination-log"
    done = run_fetch(env, source, str(tmp_path / "model"), "--cache-dir", str(tmp_path / "cache"),
                     "--termination-log", str(log), "--max-attempts", "4")
    assert done.returncode == 1
    assert expected in done.stderr
    assert expected in log.read_text()
    assert len(hub.requests) == 1  # 401/404 are never retried
    assert not (tmp_path / "model").exists()


def test_the_token_from_HF_TOKEN_opens_a_private_repo(hub, tmp_path):
    done = run_fetch(fetch_env(tmp_path, hub, HF_TOKEN=HF_TOKEN), f"hf://{PRIVATE_REPO}", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model" / "model.safetensors").is_file() and not (tmp_path / "model").is_symlink()


def test_allow_patterns_and_a_tag_pick_the_files_and_the_commit(hub, tmp_path):
    done = run_fetch(fetch_env(tmp_path, hub), f"hf://{REPO}@v1", str(tmp_path / "model"), "--cache-dir",
                     str(tmp_path / "cache"), "--allow-patterns", "*.safetensors", "config.json")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [MARKER, "config.json", "model.safetensors"]
    assert sorted(Path(r.path).name for r in hub.file_gets()) == ["config.json", "model.safetensors"]
    marker = json.loads((tmp_path / "model" / MARKER).read_text())
    assert marker["revision"] == "v1" and marker["commit"] == hub.repos[REPO].commit


def test_transient_server_errors_are_retried_with_backoff(hub, tmp_path):
    hub.fail_next = [503, 502]
    done = run_fetch(fetch_env(tmp_path, hub), f"hf://{REPO}", str(tmp_path / "model"), "--max-attempts", "3")
    assert done.returncode == 0, done.stderr
    assert "try 1/3; retrying" in done.stderr and "try 2/3; retrying" in done.stderr
    assert [r.status for r in hub.requests[:2]] == [503, 502]


def test_persistent_server_errors_fail_after_the_bounded_attempts(hub, tmp_path):
    hub.fail_next = [503] * 10
    log = tmp_path / "termination-log"
    done = run_fetch(fetch_env(tmp_path, hub), f"hf://{REPO}", str(tmp_path / "model"), "--max-attempts", "3",
                     "--termination-log", str(log))
    assert done.returncode == 1
    assert "503" in log.read_text()
    assert "try 2/3; retrying" in done.stderr and "try 3/3" not in done.stderr
    assert hub.fail_next  # bounded: the remaining injected errors were never asked for
