"""The engine's pure core: requests, lanes, admission, KV block accounting and quotas, the scheduler.

Plain Python: no torch, no threads, no I/O. It imports only tokenlane.runtime.config; the rest of
the runtime builds on it (contracts in pyproject.toml, checked by lint-imports)."""
