"""Joining the group: the rendezvous, torch.distributed's process groups, the plan channel, and
this rank's model executor. The same steps, in the same order, on every rank."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.distributed.channel import PlanChannel
from tokenlane.runtime.distributed.launch import LocalRanks, Rendezvous, rank_config, rendezvous_store
from tokenlane.runtime.executor.parallel_state import ParallelLayout, ParallelState, init_parallel_state

log = logging.getLogger(__name__)


@dataclass
class GroupMember:
    layout: ParallelLayout
    state: ParallelState
    store: object  # torch.distributed.TCPStore: the leader's (rank 0 hosts it)
    channel: PlanChannel
    rendezvous: Rendezvous


def rank_device(device_type: str, local_index: int):
    """This rank's device: its node's GPU `local_index` (made current), or the CPU."""
    import torch

    if device_type == "cuda":
        torch.cuda.set_device(local_index)
        return torch.device("cuda", local_index)
    return torch.device("cpu")


def join_group(config: RuntimeConfig, rendezvous: Rendezvous, rank: int, local_index: int,
               device_type: str, local: Optional[LocalRanks] = None) -> GroupMember:
    """Rendezvous (GroupStartError after rendezvous.timeout_s, naming the address and the
    ranks joined), then the process groups and the control channel."""
    tp, pp = config.engine.tp_size, config.engine.pp_size
    layout = ParallelLayout(tp, pp, rank)
    started = time.perf_counter()
    store = rendezvous_store(rendezvous, rank, layout.world_size, local)
    device = rank_device(device_type, local_index)
    state = init_parallel_state(layout, rendezvous.master_addr, rendezvous.master_port, device,
                                rendezvous.timeout_s, store=store)
    channel = PlanChannel.create(rank, layout.world_size, layout.output_rank)
    log.info("parallel: rank %d of %d (tensor rank %d of stage %d) joined at %s in %.2f s, %s",
             rank, layout.world_size, layout.tp_rank, layout.pp_rank, rendezvous.address,
             time.perf_counter() - started, device)
    return GroupMember(layout, state, store, channel, rendezvous)


def build_rank_executor(config: RuntimeConfig, member: GroupMember, device_type: str, local_world: int):
    """This rank's ModelExecutor over its shard (every rank builds one, at the same time: the
    executors agree on the KV pool size through a collective)."""
    from tokenlane.runtime.executor.model_executor import ModelExecutor

    return ModelExecutor(rank_config(config, device_type, local_world), parallel=member.state)
