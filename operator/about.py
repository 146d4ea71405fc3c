"""tokenlane.operator: kopf operator for ModelService and ServingLane (no __init__.py on purpose)."""
