"""The serving metrics the go-live checklist names, on a real server (uvicorn, the official
openai client): the `endpoint` label of the request counter, prefill and decode tokens per
lane, an out-of-memory step (its request gets a 500, the server goes on, a counter); and the
NVML GPU gauges, parsed from a fake NVML module and absent without one."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.observability import gpu_metrics
from tokenlane.runtime.observability.metrics import ENDPOINT_OF_ID_PREFIX, ENDPOINTS, PrometheusMetrics

torch = pytest.importorskip("torch")


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_requests_are_counted_per_endpoint(shared_server):
    live = shared_server
    before = {e: live.metric("tokenlane_requests_total", endpoint=e, outcome="finished") for e in ENDPOINTS}
    assert live.metric("tokenlane_prefill_tokens_total", lane="batch") == 0  # present (at zero) from the start
    prefill0 = live.metric("tokenlane_prefill_tokens_total", lane="interactive")
    decode0 = live.metric("tokenlane_decode_tokens_total", lane="interactive")
    c = client(live)
    c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, extra_body={"ignore_eos": True})
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    after = {e: live.metric("tokenlane_requests_total", endpoint=e, outcome="finished") for e in ENDPOINTS}
    assert after["/v1/completions"] - before["/v1/completions"] == 1
    assert after["/v1/chat/completions"] - before["/v1/chat/completions"] == 2
    # Every prompt token prefilled once (no prefix-cache hits on distinct prompts this short).
    assert live.metric("tokenlane_prefill_tokens_total", lane="interactive") - prefill0 >= 4
    assert live.metric("tokenlane_decode_tokens_total", lane="interactive") - decode0 == (3 - 1) + 2 * (2 - 1)


def test_invalid_requests_are_counted_per_endpoint_with_a_bounded_label():
    from tokenlane.runtime.config import loads_config

    m = PrometheusMetrics("tiny")
    m.set_config(loads_config("model: {path: /models/tiny, servedName: tiny}"))
    m.record_invalid("default", "default", "empty_prompt", endpoint="/v1/chat/completions")
    m.record_invalid("default", "default", "empty_prompt", endpoint="/v1/whatever/the/client/sent")

    def invalid(endpoint):
        return sum(s.value for family in text_string_to_metric_families(m.render().decode())
                   for s in family.samples if s.name == "tokenlane_requests_total"
                   and s.labels["endpoint"] == endpoint and s.labels["outcome"] == "invalid")

    assert (invalid("/v1/chat/completions"), invalid("/v1/completions"), invalid("other")) == (1, 0, 1)


def test_the_endpoint_labels_are_the_servers_routes():
    from tokenlane.runtime.entrypoints.http_errors import GENERATION_PATHS

    assert {prefix: path for path, prefix in GENERATION_PATHS.items()} == ENDPOINT_OF_ID_PREFIX


def test_an_out_of_memory_step_is_a_500_for_its_request_and_the_server_goes_on(shared_server):
    live = shared_server
    executor = live.engine.executor
    real_execute = executor.execute
    raised = []

    def out_of_memory_once(plan):
        if not raised:
            raised.append(len(plan.chunks))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_execute(plan)

    oom0 = live.metric("tokenlane_oom_events_total")
    failed0 = live.metric("tokenlane_requests_total", endpoint="/v1/chat/completions", outcome="error", reason="oom")
    executor.execute = out_of_memory_once
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client(live).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    finally:
        executor.execute = real_execute
    assert raised == [1]
    assert caught.value.status_code == 500 and caught.value.body["type"] == "server_error"
    assert "oom" in caught.value.body["message"]
    assert live.metric("tokenlane_oom_events_total") == oom0 + 1
    assert live.metric("tokenlane_requests_total", endpoint="/v1/chat/completions", outcome="error",
                       reason="oom") == failed0 + 1
    assert live.engine.scheduler.kv.num_used_blocks == 0
    done = client(live).completions.create(model="tiny", prompt=[9, 10], max_tokens=2, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 2
    assert httpx.get(live.url + "/health", timeout=5).status_code == 200


# ---- NVML


class FakeNvml(types.ModuleType):
    """The parts of nvidia-ml-py's `pynvml` the collector calls, for two GPUs."""

    def __init__(self, devices=2, fail_init=False):
        super().__init__("pynvml")
        self.devices, self.fail_init, self.fail_reads = devices, fail_init, False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.fail_reads:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=[37, 100][handle], memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=150_000_000_000, used=[60_000_000_000, 1024][handle], free=0)


def gpu_samples(metrics: PrometheusMetrics) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["gpu"]): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if s.name.startswith("tokenlane_gpu_")}


def test_gpu_gauges_come_from_nvml(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    metrics = PrometheusMetrics("tiny")
    assert gpu_samples(metrics) == {
        ("tokenlane_gpu_utilization_ratio", "0"): 0.37, ("tokenlane_gpu_utilization_ratio", "1"): 1.0,
        ("tokenlane_gpu_memory_used_bytes", "0"): 60e9, ("tokenlane_gpu_memory_used_bytes", "1"): 1024.0,
        ("tokenlane_gpu_memory_total_bytes", "0"): 150e9, ("tokenlane_gpu_memory_total_bytes", "1"): 150e9,
    }
    fake.fail_reads = True  # a driver error at scrape time: no GPU series, the scrape still works
    assert gpu_samples(metrics) == {} and b"tokenlane_requests_total" in metrics.render()


@pytest.mark.parametrize("nvml", [None, FakeNvml(fail_init=True), FakeNvml(devices=0)],
                         ids=["not-installed", "no-driver", "no-gpu"])
def test_gpu_gauges_are_absent_without_nvml(monkeypatch, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # None: `import pynvml` raises ImportError
    metrics = PrometheusMetrics("tiny")
    assert metrics.gpu is None and gpu_samples(metrics) == {}
    assert gpu_metrics.load_nvml() is None


def test_the_gpu_gauges_are_documented():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    section = text[text.index("### GPU metrics"):]
    assert "labels `model` and `gpu`" in section and gpu_metrics.LABELS == ("model", "gpu")
    for name in gpu_metrics.NAMES:
        assert f"- `{name}` (gauge):" in section, name
