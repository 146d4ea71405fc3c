"""Prometheus metrics, the flight recorder and GPU gauges: engine observers, no engine internals."""
