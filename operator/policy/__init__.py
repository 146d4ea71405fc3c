"""Pure decision functions: the SLO tuner, the rollout guard and the replica autoscaler."""
