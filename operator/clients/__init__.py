"""I/O: the Kubernetes client and action executor, the Prometheus reader, and the reads and
stores built on them."""
