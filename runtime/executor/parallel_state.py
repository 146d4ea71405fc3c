"""Where this process sits in a tensor- and pipeline-parallel group, and its collectives.

engine.tensorParallelSize (tp) x engine.pipelineParallelSize (pp) ranks serve one model. Global
rank r is tensor rank r % tp of pipeline stage r // tp, so the tp ranks of one stage are
adjacent (one pod, one node's GPUs) and stage s is ranks [s * tp, (s + 1) * tp). Rank 0 runs
the scheduler and the API; the output rank (tensor rank 0 of the last stage) samples.

Two process groups: the model's tensors go over the device group (NCCL on CUDA, gloo on the
CPU); the engine's control messages (the step plan, the output, heartbeats) go over a gloo
group of their own, so a control message never waits behind a tensor of another thread.
With tp == pp == 1 nothing here touches torch.distributed (`single_process`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch


@dataclass(frozen=True)
class ParallelLayout:
    """The numbers only: no process group (pure, testable)."""

    tp: int = 1
    pp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tensor and pipeline parallel sizes must be >= 1, got {self.tp} and {self.pp}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def output_rank(self) -> int:
        """The rank that samples and returns the step's output: tensor rank 0 of the last stage."""
        return (self.pp - 1) * self.tp

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.output_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's decoder layers: contiguous, sizes differing by at most
        one, the earlier stages taking the extra layers."""
        if self.pp > num_layers:
            raise ValueError(f"engine.pipelineParallelSize {self.pp} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (1 if self.pp_rank < extra else 0)


@dataclass
class ParallelState:
    """This process's layout plus its process groups (None when tp == pp == 1)."""

    layout: ParallelLayout
    device: torch.device
    tp_group: Optional[object] = None  # torch.distributed ProcessGroup of this stage's tp ranks
    device_group: Optional[object] = None  # the world, for stage-to-stage send/recv
    control_group: Optional[object] = None  # gloo world group for the engine's messages

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    # ---- tensor parallel

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's tensor ranks, in place; the identity at tp == 1."""
        if self.layout.tp > 1:
            torch.distributed.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each tensor rank's `tensor` along the last dimension, in rank order."""
        if self.layout.tp == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.layout.tp)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def max_over_tensor_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over this stage's tensor ranks, in place; the identity at tp == 1."""
        if self.layout.tp > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (over the control group: a CPU tensor); `value`
        itself in a lone process. Start-up sizes (KV blocks) agree this way on every rank."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())

    # ---- pipeline parallel

    def send_to_next_stage(self, tensor: torch.Tensor) -> None:
        """The same tensor rank of the next stage receives it (each tp rank holds the full
        hidden state after the row-parallel all-reduce, so each sends its own copy)."""
        dst = self.layout.rank + self.layout.tp
        torch.distributed.send(tensor.contiguous(), dst=dst, group=self.device_group)

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        torch.distributed.recv(out, src=self.layout.rank - self.layout.tp, group=self.device_group)
        return out


def single_process(device: torch.device) -> ParallelState:
    return ParallelState(ParallelLayout(), torch.device(device))


def init_parallel_state(
    layout: ParallelLayout,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float,
    store: Optional[object] = None,
) -> ParallelState:
    """Join the group (TCP rendezvous at master_addr:master_port) and make its process groups.

    Every rank calls this with its own layout; it returns once all world_size ranks joined, or
    raises (RuntimeError / DistStoreError) after `timeout_s` with the rendezvous address in the
    message. The groups are created in the same order on every rank, as torch.distributed needs.
    With `store` (a torch.distributed Store every rank already reaches, such as the TCPStore
    rank 0 hosts at master_addr:master_port) the group meets there under a key prefix of its
    own: one port for the whole group.
    """
    import torch.distributed as dist

    device = torch.device(device)
    if layout.world_size == 1:
        return single_process(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    rendezvous = (dict(store=dist.PrefixStore("torch.distributed/", store)) if store is not None
                  else dict(init_method=f"tcp://{master_addr}:{master_port}"))
    try:
        dist.init_process_group(
            backend=backend,
            world_size=layout.world_size,
            rank=layout.rank,
            timeout=timeout,
            **rendezvous,
        )
    except Exception as exc:  # the store's own message says little about which address
        raise RuntimeError(
            f"rank {layout.rank}: the rendezvous at {master_addr}:{master_port} of {layout.world_size} "
            f"ranks did not complete within {timeout_s:g} s: {exc}"
        ) from exc
    tp_group = None
    for stage in range(layout.pp):
        group = dist.new_group(layout.stage_ranks(stage), backend=backend, timeout=timeout)
        if stage == layout.pp_rank:
            tp_group = group
    control = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=timeout)
    return ParallelState(layout, device, tp_group=tp_group, device_group=dist.group.WORLD,
                         control_group=control)
