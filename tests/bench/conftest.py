"""Fixtures for the benchmark tests: a real `tokenlane serve` on the tiny model (loopback)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    from tokenlane.bench.serve_proc import ServerProcess

    config = {
        "model": {"path": str(tiny_model_dir), "servedName": "tiny", "maxModelLen": 1024},
        "engine": {"kvCacheBlocks": 256, "blockSize": 16, "device": "cpu"},
        "scheduler": {"maxActiveSequences": 8, "maxBatchedTokens": 256, "prefillChunkSize": 128},
        "lanes": [
            {"name": "interactive", "default": True, "priority": 100, "slo": {"ttftP95Ms": 5000}},
            # One running + one waiting at most.
            {"name": "batch", "class": "batch", "priority": 10, "maxActiveSequences": 1, "maxWaitingRequests": 1},
        ],
        # A bucket of 10 tokens a minute: one 8-token prompt fits, the next waits 36 s for a
        # refill, so a burst of this tenant is refused (429 tenant_rate_limit, checked before
        # the batch lane's queue_full) whatever the machine's speed.
        "tenants": [{"name": "burst", "tokensPerMinute": 10}],
    }
    server = ServerProcess(config, tmp_path_factory.mktemp("bench-server"), "tiny", grace_s=2.0)
    server.start()
    yield server
    server.stop()
