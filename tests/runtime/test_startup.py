"""The start-up of `tokenlane serve`, phase by phase: the log lines, the summary line, the
gauge; and what loading the model does not do (copy weights it can map, import torch._dynamo)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig
from tokenlane.runtime.core.startup import PHASES, StartupPhase, parse_summary, summary_line


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_summary_line_reads_back():
    phases = [StartupPhase("import", 1.234), StartupPhase("tokenizer", 0.5, "x, 3 tokens"), StartupPhase("serve", 0.01)]
    line = summary_line(2.0, phases)
    assert line == "startup: ready in 2.00s: import 1.23s tokenizer 0.50s serve 0.01s"
    assert parse_summary("noise\n2026 INFO tokenlane.server: " + line + "\nmore") == (
        2.0, {"import": 1.23, "tokenizer": 0.5, "serve": 0.01})
    assert parse_summary("no summary here") is None
    assert phases[1].log_line() == "startup: tokenizer 0.50s (x, 3 tokens)"


def test_engine_start_states_its_phases(tiny_model_dir, caplog):
    from tokenlane.runtime.engine.llm_engine import LLMEngine

    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)),
                           engine=EngineConfig(kv_cache_blocks=64, device="cpu"))
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_config(config)
    assert [p.name for p in engine.startup_phases] == ["tokenizer", "load", "kv", "warmup"]
    assert all(p.seconds >= 0 for p in engine.startup_phases)
    details = {p.name: p.detail for p in engine.startup_phases}
    assert re.search(r"\d+\.\d MiB from 1 safetensors file, memory-mapped", details["load"])
    assert details["kv"].startswith("64 blocks of 16 tokens")
    assert details["warmup"].startswith("none")
    for phase in engine.startup_phases:
        assert phase.log_line() in caplog.text
    # Weights kept as stored (embedding, norms, an untied LM head) are views of the file's map.
    loaded = engine.executor.model.weights_loaded
    assert loaded.files == 1 and 0 < loaded.mapped_bytes < loaded.bytes


def test_loading_a_model_imports_no_compiler_stack(tiny_model_dir):
    """The meta-device build used to run Embedding's init through a Python decomposition that
    imports torch._dynamo (most of a second of every start)."""
    code = (
        "import sys, torch\n"
        "from tokenlane.runtime.executor.llama import CausalLM\n"
        f"CausalLM.from_pretrained({str(tiny_model_dir)!r})\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_logs_every_phase_and_exports_them(tiny_model_dir, tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(f"model: {{path: {tiny_model_dir}, servedName: tiny}}\n"
                      "engine: {kvCacheBlocks: 64, device: cpu, coreProcess: false}\n")
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config), "--host",
                                 "127.0.0.1", "--port", str(port), "--log-level", "info"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "not ready"
                time.sleep(0.1)
            metrics = httpx.get(url + "/metrics", timeout=10).text
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = log_path.read_text()
    expected = list(PHASES)
    for name in expected:
        assert re.search(rf"startup: {name} \d+\.\d\ds", text), name
    total, phases = parse_summary(text)
    assert list(phases) == expected
    # The phases account for the whole start (each is rounded to 10 ms in the line).
    assert sum(phases.values()) == pytest.approx(total, abs=0.01 * len(phases) + 0.01)
    # No compiler runs at start: the native library is the wheel's prebuilt one (or none).
    native = re.search(r"native CPU kernels (loaded|not loaded)[^\n]*", text)
    assert native, text
    if native[1] == "loaded" and not os.environ.get("TOKENLANE_NATIVE_JIT"):
        assert ", prebuilt, " in native[0]
    for name in [*expected, "total"]:
        assert re.search(rf'^tokenlane_startup_phase_seconds\{{model="tiny",phase="{name}"\}} \d', metrics, re.M), name


def test_an_engine_core_process_reports_its_phases_and_overlaps_the_tokenizer(tiny_model_dir, monkeypatch):
    """With the engine in a process of its own, this process loads its tokenizer while the
    core loads (before it waits for the core's Ready), and the core's phases come with Ready."""
    import asyncio

    from tokenlane.runtime.engine import core_client, tokenizer

    order: list[str] = []
    load_tokenizer, decode = tokenizer.load_tokenizer, core_client.wire.decode

    def recorded_load(path):
        order.append("tokenizer")
        return load_tokenizer(path)

    def recorded_decode(data):
        message = decode(data)
        order.append(type(message).__name__)
        return message

    monkeypatch.setattr(tokenizer, "load_tokenizer", recorded_load)
    monkeypatch.setattr(core_client.wire, "decode", recorded_decode)
    config = RuntimeConfig(model=ModelConfig(path=str(tiny_model_dir)),
                           engine=EngineConfig(kv_cache_blocks=64, device="cpu", core_process=True))
    client = core_client.CoreProcessClient.from_config(config)

    async def start_and_stop():
        await client.start()
        await client.shutdown(1.0)

    asyncio.run(start_and_stop())
    assert order[:2] == ["tokenizer", "Ready"]
    assert [p.name for p in client.startup_phases] == ["tokenizer", "load", "kv", "warmup"]
