"""kopf wiring: the reconcile handlers and the tuning and autoscaling timers, with the operator's
own metrics."""
