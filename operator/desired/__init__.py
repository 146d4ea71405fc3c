"""Desired state, pure: builders ((ModelService, lanes, values in force) -> objects), the planner
(desired vs observed -> actions), which value of a tuned knob is in force, and status. No I/O."""
