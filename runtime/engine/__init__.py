"""The step loop and its fronts: LLMEngine (schedule, execute, update), the asyncio engine,
the engine core's own process, config hot reload and detokenization.

May use threads and processes; reaches the model only through the Executor protocol
(tokenlane.runtime.core.step_plan) and the executors in tokenlane.runtime.executor."""
