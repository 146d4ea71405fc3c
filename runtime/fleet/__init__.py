"""`tokenlane router`: a separate process in front of several replicas (replica set,
discovery, pick policy, forwarding). No torch, no engine."""
