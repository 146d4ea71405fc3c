"""A multi-rank `tokenlane serve` fails fast and cleanly (real processes on loopback, gloo).

- a worker rank killed (SIGKILL) mid-stream: the stream ends with an error, the server exits
  with status 1, one log line names the rank, its pid and the signal, and no rank process is
  left;
- a two-node group (two `tokenlane serve` processes, as a LeaderWorkerSet runs them): node 1
  answers /health 200 once joined; killed, the leader notices the silent rank by its
  heartbeats and exits with status 1;
- a hung rank (SIGSTOP, so hung by construction) with an engine core process: /health goes 503,
  the stream ends with an error, the stopped rank is killed (slow);
- a rendezvous that never completes (nnodes 2, no second node) fails at start with the address,
  the ranks joined and the timeout, status 1;
- sizes the model or the host cannot take exit 2 naming the key, before any rank starts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tokenlane.runtime.config import ConfigError, loads_config
from tokenlane.runtime.distributed.launch import Rendezvous, check_group

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
from serve_process import free_port, start_serve  # noqa: E402

CONFIG = """
model: {{path: "{model}", servedName: tiny, maxModelLen: 512, dtype: float32}}
engine: {{blockSize: 16, kvCacheBlocks: 64, device: cpu, tensorParallelSize: {tp}, pipelineParallelSize: {pp},
         coreProcess: {core}}}
scheduler: {{maxActiveSequences: 8, maxBatchedTokens: 64, prefillChunkSize: 32}}
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tokenlane.runtime.executor.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-faults"), arch="llama", num_kv_heads=1, num_layers=3)


@pytest.fixture(autouse=True)
def restore_environment():
    """`tokenlane serve` exports its rendezvous (TOKENLANE_DIST_*) for the processes it starts."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def write_config(folder: Path, model: Path, tp: int, pp: int, core: bool = False) -> Path:
    path = folder / f"runtime-{tp}x{pp}.yaml"
    path.write_text(CONFIG.format(model=model, tp=tp, pp=pp, core=str(core).lower()))
    return path


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_gone(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            assert p.status() == psutil.STATUS_ZOMBIE or not p.is_running(), f"orphan rank process {p.pid}"
        except psutil.NoSuchProcess:
            pass


def stream_until_error(client: openai.OpenAI, on_first_tokens) -> list:
    """Stream a long greedy completion; call on_first_tokens() after 3 chunks; the stream must
    then end with an error, not hang and not finish."""
    stream = client.completions.create(model="tiny", prompt="hello " * 20, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for chunk in stream:
            chunks.append(chunk)
            assert chunk.choices[0].finish_reason is None, "the stream finished instead of failing"
            if len(chunks) == 3:
                on_first_tokens()
    return chunks


def test_worker_rank_killed_mid_stream(model, tmp_path):
    proc, url = start_serve(write_config(tmp_path, model, 2, 1), "--master-port", str(free_port()),
                            "--no-core-process")
    try:
        ranks = descendants(proc.pid)
        assert len(ranks) == 1
        worker = ranks[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream_until_error(client, lambda: worker.send_signal(signal.SIGKILL))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert code == 1, log[-3000:]
    failures = [line for line in log.splitlines() if "parallel group failed" in line]
    assert len(failures) == 1, "\n".join(failures)
    assert f"rank 1 (pid {worker.pid}) was killed by signal SIGKILL" in failures[0]
    assert_gone(ranks)


def test_two_node_group_health_and_a_lost_node(model, tmp_path):
    """Node 0 serves the API and runs stage 0, node 1 runs stage 1 and answers /health."""
    config = write_config(tmp_path, model, 1, 2)
    master = str(free_port())
    worker_port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
         "--port", str(worker_port), "--nnodes", "2", "--node-rank", "1", "--master-port", master],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The leader's flags come from LeaderWorkerSet's environment here, as in a pod.
        proc, url = start_serve(
            config, "--master-port", master, "--no-core-process", timeout_s=180,
            env={"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "127.0.0.1"})
    except BaseException:
        worker.kill()
        raise
    try:
        health = httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=10)
        assert health.status_code == 200 and health.json()["role"] == "worker"
        assert httpx.get(f"http://127.0.0.1:{worker_port}/v1/models", timeout=10).status_code == 404
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt="hello there", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        worker.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        for p in (proc, worker):
            if p.poll() is None:
                p.kill()
    log = proc.stdout.read()
    assert code == 1, log[-3000:]
    failures = [line for line in log.splitlines() if "parallel group failed" in line]
    assert len(failures) == 1 and "rank 1" in failures[0], failures


@pytest.mark.slow
def test_hung_rank_with_an_engine_core_process(model, tmp_path):
    proc, url = start_serve(write_config(tmp_path, model, 2, 1, core=True), "--master-port", str(free_port()))
    try:
        ranks = descendants(proc.pid)
        workers = [p for p in ranks if "tokenlane.runtime.distributed.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream_until_error(client, lambda: workers[0].send_signal(signal.SIGSTOP))
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        assert_gone(workers)
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    failures = [line for line in log.splitlines() if "parallel group failed" in line]
    assert len(failures) == 1 and "rank 1 sent no heartbeat" in failures[0], failures


def test_rendezvous_that_never_completes(model, tmp_path, capsys):
    from tokenlane.runtime.entrypoints.server import main

    port = free_port()
    code = main(["--config", str(write_config(tmp_path, model, 1, 2)), "--no-core-process", "--nnodes", "2",
                 "--master-port", str(port), "--rendezvous-timeout", "2"], exit_when_served=False)
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert f"rendezvous at 127.0.0.1:{port} timed out after 2 s: 1 of 2 ranks joined (missing ranks 1" in err, err


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "3"], "engine.tensorParallelSize 3 must divide the model's 4 attention heads"),
    (["--pipeline-parallel-size", "40"], "engine.pipelineParallelSize 40 exceeds the model's 3 layers"),
    (["--pipeline-parallel-size", "2", "--nnodes", "3"], "--nnodes (or LWS_GROUP_SIZE) 3 must be 1 or "
                                                        "engine.pipelineParallelSize (2)"),
    (["--tensor-parallel-size", "0"], "engine.tensorParallelSize: must be an integer in [1, 64], got 0"),
])
def test_bad_sizes_exit_2_naming_the_key_before_any_rank_starts(model, tmp_path, capsys, flags, message):
    from tokenlane.runtime.entrypoints.server import main

    before = psutil.Process().children(recursive=True)
    code = main(["--config", str(write_config(tmp_path, model, 1, 1)), "--no-core-process", "--master-port",
                 str(free_port()), *flags], exit_when_served=False)
    assert code == 2
    assert message in capsys.readouterr().err
    assert psutil.Process().children(recursive=True) == before


def test_more_ranks_than_gpus_is_refused(model):
    config = loads_config(CONFIG.format(model=model, tp=2, pp=2, core="false"))
    with pytest.raises(ConfigError, match="more ranks than GPUs: this node runs 4 ranks .* but 2 GPUs are visible"):
        check_group(config, Rendezvous(), "cuda", visible_gpus=2)
    check_group(config, Rendezvous(nnodes=2, node_rank=1), "cuda", visible_gpus=2)  # 2 per node fit


def test_rendezvous_from_leaderworkerset_environment_and_flags():
    found = Rendezvous.from_env({"LWS_LEADER_ADDRESS": "grp-0.svc", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"})
    assert (found.master_addr, found.nnodes, found.node_rank, found.master_port) == ("grp-0.svc", 4, 2, 29500)
    assert found.node_ranks(tp=2, pp=4) == [4, 5]
    env: dict[str, str] = {}
    Rendezvous(2, 1, "10.0.0.1", 31000, 5.0).export(env)
    assert Rendezvous.from_env({**env, "LWS_GROUP_SIZE": "9"}) == Rendezvous(2, 1, "10.0.0.1", 31000, 5.0)
    with pytest.raises(ValueError, match="--node-rank must be in"):
        Rendezvous(nnodes=2, node_rank=2)
