"""`DistributedExecutor`: the Executor protocol (runtime/core/step_plan.py) over a group of ranks.

It lives in rank 0, the process that runs the engine (the server, or its engine core
process). Per step: one broadcast of the plan's diffs to every rank, rank 0's own shard run by
its ModelExecutor, and, when the output rank (tensor rank 0 of the last stage) is another
rank, that rank's ExecutorOutput received back. Pipeline stages run one after the other within
a step (no micro-batching): a step is one forward pass through every stage.

Any failure of a step (a rank died, a collective failed) fails the group
(`ExecutorGroupFailed`, watchdog.py): the ranks of a step depend on each other, so no
request could run on without it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Optional

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.step_plan import ExecutorGroupFailed, ExecutorOutput, StepPlan
from tokenlane.runtime.distributed.group import GroupMember, build_rank_executor, join_group
from tokenlane.runtime.distributed.launch import LocalRanks, Rendezvous, check_group
from tokenlane.runtime.distributed.messages import AdapterCommand, Stop
from tokenlane.runtime.distributed.mirror import PlanEncoder
from tokenlane.runtime.distributed.watchdog import GroupWatchdog

log = logging.getLogger(__name__)

# How long a clean shutdown waits for the worker ranks to exit after Stop.
STOP_TIMEOUT_S = 10.0


def device_type_of(config: RuntimeConfig) -> tuple[str, int]:
    """(engine.device resolved to cpu or cuda, the GPUs visible)."""
    import torch

    cuda = torch.cuda.is_available()
    kind = {"auto": "cuda" if cuda else "cpu"}.get(config.engine.device, config.engine.device)
    return kind, torch.cuda.device_count() if cuda else 0


class DistributedExecutor:
    """Rank 0's executor of a tensor/pipeline-parallel group."""

    supports_logprobs = True
    # The engine hands it plans without chunks when requests finished, so the workers drop
    # their mirrors of them (llm_engine.LLMEngine._execute).
    mirrors_requests = True

    def __init__(self, member: GroupMember, local_executor, local_ranks: LocalRanks,
                 watchdog: GroupWatchdog) -> None:
        self.member = member
        self.layout = member.layout
        self.channel = member.channel
        self.local = local_executor
        self.local_ranks = local_ranks
        self.watchdog = watchdog
        self.encoder = PlanEncoder()
        self._lock = threading.Lock()  # steps and adapter commands take turns on the channel
        self._stopped = False
        # The executor's numbers: equal on every rank (the KV pool's size agreed among them).
        self.block_size = local_executor.block_size
        self.num_kv_blocks = local_executor.num_kv_blocks
        self.num_host_kv_blocks = getattr(local_executor, "num_host_kv_blocks", 0)
        self.max_model_len = local_executor.max_model_len
        self.vocab_size = local_executor.vocab_size
        self.eos_token_id = local_executor.eos_token_id
        self.kv_bytes_per_block = getattr(local_executor, "kv_bytes_per_block", 0)
        self.startup_phases = getattr(local_executor, "startup_phases", ())
        # Time of the last step's broadcast and of waiting for the output rank's reply (bench).
        self.last_broadcast_seconds = 0.0
        self.last_reply_seconds = 0.0

    @classmethod
    def launch(cls, config: RuntimeConfig, rendezvous: Optional[Rendezvous] = None,
               exit_on_failure: bool = True) -> "DistributedExecutor":
        """Check the sizes (ConfigError naming the key), spawn this node's other ranks, join the
        group (GroupStartError after the rendezvous timeout) and build rank 0's shard."""
        rendezvous = rendezvous or Rendezvous.from_env()
        if rendezvous.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; this is node {rendezvous.node_rank}")
        device_type, gpus = device_type_of(config)
        check_group(config, rendezvous, device_type, gpus)
        ranks = rendezvous.node_ranks(config.engine.tp_size, config.engine.pp_size)
        log.info("parallel: tensorParallelSize %d x pipelineParallelSize %d over %d node%s; this node runs ranks "
                 "%s; rendezvous at %s", config.engine.tp_size, config.engine.pp_size, rendezvous.nnodes,
                 "s" if rendezvous.nnodes > 1 else "", ranks, rendezvous.address)
        local_ranks = LocalRanks.spawn(config, rendezvous, device_type, ranks)
        watchdog = None
        try:
            member = join_group(config, rendezvous, 0, 0, device_type, local_ranks)
            watchdog = GroupWatchdog(member.store, local_ranks, member.layout.world_size,
                                     exit_on_failure=exit_on_failure).start()
            local_executor = build_rank_executor(config, member, device_type, len(ranks))
        except BaseException:
            if watchdog is not None:  # the start failed here: its own error is the one to report
                watchdog.stop()
            local_ranks.kill()
            raise
        executor = cls(member, local_executor, local_ranks, watchdog)
        atexit.register(executor.shutdown)
        return executor

    # ---- the Executor protocol

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        with self._lock:
            return self._step(plan)

    def _step(self, plan: StepPlan) -> ExecutorOutput:
        watchdog = self.watchdog
        if watchdog.failed is not None:
            raise ExecutorGroupFailed(f"parallel group down: {watchdog.failed}")
        t0 = time.perf_counter()
        watchdog.step_idle.clear()
        try:
            self.channel.broadcast(self.encoder.encode(plan))
            t1 = time.perf_counter()
            output = self.local.execute(plan)
            t2 = time.perf_counter()
            if self.layout.output_rank != 0:
                reply = self.channel.receive_output()
                reply.errors.update(output.errors)
                reply.kv_restore_seconds = output.kv_restore_seconds
                output = reply
            t3 = time.perf_counter()
        except Exception as exc:
            reason = watchdog.diagnose(exc)
            watchdog.fail(reason)
            raise ExecutorGroupFailed(f"parallel group down: {reason}") from None  # the cause is logged once, by fail()
        finally:
            watchdog.step_idle.set()
        self.last_broadcast_seconds = t1 - t0
        self.last_reply_seconds = t3 - t2
        # A plan without chunks only tells the workers of finished requests: no model step.
        output.step_seconds = t3 - t0 if plan.chunks else 0.0
        return output

    def pin_step_thread(self) -> None:
        self.local.pin_step_thread()

    # ---- LoRA adapters: every rank holds the same ones

    def add_adapter(self, name: str, folder: str):
        with self._lock:
            info, error = self._everywhere(AdapterCommand("add", name, folder))
            if error is not None:
                self._everywhere(AdapterCommand("discard", name))
                raise error
            return info

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            _, error = self._everywhere(AdapterCommand("remove", name))
            if error is not None:
                raise error

    def adapter_names(self) -> list[str]:
        return self.local.adapter_names()

    def _everywhere(self, command: AdapterCommand):
        """Run an adapter command on every rank: (rank 0's result, the first error or None)."""
        if self.watchdog.failed is not None:
            raise ExecutorGroupFailed(f"parallel group down: {self.watchdog.failed}")
        self.watchdog.step_idle.clear()
        try:
            self.channel.broadcast(command)
            result, local_error = None, None
            try:
                result = run_adapter_command(self.local, command)
            except (ValueError, OSError) as exc:
                local_error = exc
            answers = self.channel.gather(None if local_error is None else str(local_error))
        except Exception as exc:
            reason = self.watchdog.diagnose(exc)
            self.watchdog.fail(reason)
            raise ExecutorGroupFailed(f"parallel group down: {reason}") from None  # the cause is logged once, by fail()
        finally:
            self.watchdog.step_idle.set()
        if local_error is not None:
            return result, local_error
        for rank, answer in enumerate(answers):
            if answer is not None:
                return result, ValueError(f"adapter {command.name!r} on rank {rank}: {answer}")
        return result, None

    # ---- shutdown

    def shutdown(self) -> None:
        """Stop the workers (they exit 0) and reap this node's; idempotent, best effort."""
        if self._stopped:
            return
        self._stopped = True
        self.watchdog.stop()
        # A step stuck in a collective holds the lock: then the workers are killed, not told.
        if self.watchdog.failed is None and self._lock.acquire(timeout=STOP_TIMEOUT_S):
            try:
                self.channel.broadcast(Stop("shutdown"))
            except Exception as exc:
                log.warning("parallel: stopping the workers failed: %s", exc)
            finally:
                self._lock.release()
        if not self.local_ranks.join(STOP_TIMEOUT_S):
            log.warning("parallel: worker ranks did not stop within %.0f s; killing them", STOP_TIMEOUT_S)
        self.local_ranks.kill()


def run_adapter_command(executor, command: AdapterCommand):
    if command.op == "add":
        return executor.add_adapter(command.name, command.folder)
    if command.op == "remove":
        return executor.remove_adapter(command.name)
    if command.op == "discard":
        if command.name in executor.adapter_names():
            executor.remove_adapter(command.name)
        return None
    raise ValueError(f"unknown adapter command {command.op!r}")
