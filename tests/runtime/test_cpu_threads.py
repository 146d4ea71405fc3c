"""engine.cpuThreads: parsed and checked like every engine key, applied by the executor on
the CPU only."""

from __future__ import annotations

import pytest
import torch

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.executor.model_executor import place_cpu_threads


def config_with(**engine) -> RuntimeConfig:
    return RuntimeConfig.from_dict({"model": {"path": "/models/x"}, "engine": engine})


def test_cpu_threads_is_unset_by_default_and_takes_a_count():
    assert config_with().engine.cpu_threads is None
    assert config_with(cpuThreads=3).engine.cpu_threads == 3
    assert config_with(cpuThreads=3).restart_fields()["engine"]["cpuThreads"] == 3


@pytest.mark.parametrize("value, message", [
    (0, "cpuThreads: must be in [1, 1024], got 0"),
    (2000, "cpuThreads: must be in [1, 1024], got 2000"),
    ("auto", "cpuThreads: expected an integer, got 'auto'"),
])
def test_bad_cpu_threads_name_the_key(value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_with(cpuThreads=value)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_placed_on_the_cpu_only_and_unset_leaves_torch_alone(restore_threads):
    other = 1 if restore_threads != 1 else 2
    assert place_cpu_threads(None, torch.device("cpu")) == restore_threads
    assert place_cpu_threads(other, torch.device("cuda")) == restore_threads  # a GPU engine: untouched
    assert torch.get_num_threads() == restore_threads
    assert place_cpu_threads(other, torch.device("cpu")) == other
    assert torch.get_num_threads() == other
