"""Prometheus metrics, the flight recorder and GPU gauges: engine observers, no engine internals;
and `exit_now`, how a runtime process ends with its logs flushed."""
