"""Serving one model on several ranks (engine.tensorParallelSize x engine.pipelineParallelSize):
launching and joining the ranks, the step plan's channel to them, the worker loop, and failing
the group fast when a rank dies. Sits between the engine (which builds its executor here) and
the executor (which each rank runs on its shard)."""
