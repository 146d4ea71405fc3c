"""GPU utilization and memory as Prometheus gauges, read from NVML at scrape time.

Through `nvidia-ml-py` (the `pynvml` module), imported only when the metrics are built. With
no such module, no NVML library or no GPU, the series are absent (not zero): a dashboard
then shows "no data" rather than an idle GPU. See docs/metrics.md.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("tokenlane.metrics")

PREFIX = "tokenlane_"
UTILIZATION = PREFIX + "gpu_utilization_ratio"
MEMORY_USED = PREFIX + "gpu_memory_used_bytes"
MEMORY_TOTAL = PREFIX + "gpu_memory_total_bytes"
NAMES = (UTILIZATION, MEMORY_USED, MEMORY_TOTAL)
LABELS = ("model", "gpu")


def load_nvml(module_name: str = "pynvml") -> Optional[Any]:
    """The initialised NVML module, or None (not installed, no driver, no GPU)."""
    try:
        nvml = importlib.import_module(module_name)
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
        if nvml.nvmlDeviceGetCount() < 1:
            nvml.nvmlShutdown()
            return None
    except Exception as exc:  # NVMLError: no driver library, no device, ...
        log.info("GPU metrics off: NVML is not usable here (%s)", exc)
        return None
    return nvml


class GpuCollector(Collector):
    """tokenlane_gpu_utilization_ratio, tokenlane_gpu_memory_used_bytes and
    tokenlane_gpu_memory_total_bytes per visible GPU (label `gpu`: NVML's index)."""

    def __init__(self, model: str, nvml: Any) -> None:
        self.model = model
        self.nvml = nvml

    def describe(self) -> list:
        return []  # collect() talks to the driver: not at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = list(LABELS)
        utilization = GaugeMetricFamily(
            UTILIZATION, "Share of the last sample period in which a kernel ran on the GPU (0..1), from NVML.",
            labels=labels)
        used = GaugeMetricFamily(MEMORY_USED, "GPU memory in use (all processes), from NVML.", labels=labels)
        total = GaugeMetricFamily(MEMORY_TOTAL, "GPU memory installed, from NVML.", labels=labels)
        nvml = self.nvml
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpu = str(index)
                utilization.add_metric([self.model, gpu], rates.gpu / 100.0)
                used.add_metric([self.model, gpu], float(memory.used))
                total.add_metric([self.model, gpu], float(memory.total))
        except Exception as exc:  # a scrape must not fail because the driver hiccuped
            log.warning("reading GPU metrics from NVML failed: %s", exc)
            return
        yield utilization
        yield used
        yield total


def register_gpu_metrics(model: str, registry: CollectorRegistry, nvml: Any = None) -> Optional[GpuCollector]:
    """Register the GPU gauges when NVML is usable (`nvml`: an initialised NVML module; by
    default `load_nvml()`); None, registering nothing, otherwise."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    collector = GpuCollector(model, nvml)
    registry.register(collector)
    return collector
