"""engine.tensorParallelSize / pipelineParallelSize: validated, restart-to-change, and unset keeps
the restart hash of configs written before the keys existed."""

from __future__ import annotations

import pytest

from tokenlane.runtime.config import ConfigError, loads_config
from tokenlane.runtime.engine.llm_engine import restart_field_changes

BASE = "model: {path: /m}\nengine: {blockSize: 16}\n"


def test_unset_keeps_the_restart_hash_and_a_change_needs_a_restart():
    old = loads_config(BASE)
    assert (old.engine.tp_size, old.engine.pp_size) == (1, 1)
    assert loads_config("model: {path: /m}\nengine: {blockSize: 16, tensorParallelSize: null}\n").restart_hash() \
        == old.restart_hash()
    new = loads_config("model: {path: /m}\nengine: {blockSize: 16, tensorParallelSize: 2, pipelineParallelSize: 2}\n")
    assert restart_field_changes(old, new) == ["engine.pipelineParallelSize", "engine.tensorParallelSize"]
    assert new.engine.tp_size * new.engine.pp_size == 4


@pytest.mark.parametrize("engine, message", [
    ("{tensorParallelSize: 0}", "engine.tensorParallelSize: must be an integer in [1, 64], got 0"),
    ("{pipelineParallelSize: 65}", "engine.pipelineParallelSize: must be an integer in [1, 64], got 65"),
    ("{tensorParallelSize: 2, executor: simulated}", "engine.tensorParallelSize: needs engine.executor: model"),
])
def test_bad_values_name_the_key(engine, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        loads_config(f"model: {{path: /m}}\nengine: {engine}\n")
