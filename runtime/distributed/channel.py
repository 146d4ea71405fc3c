"""The plan channel: rank 0's messages to every rank, and the output rank's reply.

One gloo broadcast per message on a control group of its own (so a control message never
waits behind a tensor collective): a fixed frame of FRAME_BYTES with the message's length and
its first bytes, which holds a whole step's message up to a few hundred sequences, and a
second broadcast of the rest only for a longer one (torch's broadcast_object_list takes two,
sizes then data). The output's way back is a point-to-point send. A message is pickled once by
rank 0; a compiled grammar (structured output; xgrammar's objects do not
pickle) travels serialized and each rank loads it against its own tokenizer
(`set_grammar_loader`).
"""

from __future__ import annotations

import io
import pickle
import sys
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tokenlane.runtime.core.step_plan import ExecutorOutput
from tokenlane.runtime.distributed.messages import WIRE_VERSION

# The control group's collective timeout. A worker waits on it for rank 0's next message for as
# long as the server is idle; liveness comes from the heartbeats (watchdog.py), not from here.
CONTROL_TIMEOUT = timedelta(days=3650)

_grammar_loader: Optional[Callable[[str], Any]] = None


def set_grammar_loader(loader: Callable[[str], Any]) -> None:
    """How this rank turns a serialized grammar back into a compiled one."""
    global _grammar_loader
    _grammar_loader = loader


def _load_grammar(serialized: str) -> Any:
    if _grammar_loader is None:
        raise ValueError("a structured-output request reached a rank without a grammar loader")
    return _grammar_loader(serialized)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        xgrammar = sys.modules.get("xgrammar")
        if xgrammar is not None and isinstance(obj, xgrammar.CompiledGrammar):
            return (_load_grammar, (obj.serialize_json(),))
        return NotImplemented


def dumps(message: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


class WireVersionError(Exception):
    pass


def loads(payload: bytes) -> Any:
    message = pickle.loads(payload)
    version = getattr(message, "version", None)
    if version != WIRE_VERSION:
        raise WireVersionError(f"rank 0 sent a message of wire version {version}; this rank speaks "
                               f"{WIRE_VERSION} (every rank of a group must run the same build)")
    return message


# Bytes of the first broadcast of every message: the length (8 bytes), then the payload's start.
FRAME_BYTES = 16 * 1024
_LENGTH = 8


class PlanChannel:
    """Rank 0 -> all ranks, and output rank -> rank 0, over `group` (gloo, the whole world)."""

    def __init__(self, group, rank: int, world_size: int, output_rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.output_rank = output_rank
        self.bytes_sent = 0  # rank 0: payload bytes broadcast so far
        self._frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)

    @classmethod
    def create(cls, rank: int, world_size: int, output_rank: int) -> "PlanChannel":
        """Make the control group (a collective: every rank calls it, in the same order)."""
        group = dist.new_group(list(range(world_size)), backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(group, rank, world_size, output_rank)

    def broadcast(self, message: Any) -> None:
        payload = bytearray(dumps(message))
        size = len(payload)
        self.bytes_sent += size
        data = torch.frombuffer(payload, dtype=torch.uint8)
        first = min(size, FRAME_BYTES - _LENGTH)
        frame = self._frame
        frame[:_LENGTH] = torch.frombuffer(bytearray(size.to_bytes(_LENGTH, "little")), dtype=torch.uint8)
        frame[_LENGTH:_LENGTH + first] = data[:first]
        dist.broadcast(frame, src=0, group=self.group)
        if size > first:
            dist.broadcast(data[first:], src=0, group=self.group)

    def receive(self) -> Any:
        frame = self._frame
        dist.broadcast(frame, src=0, group=self.group)
        size = int.from_bytes(frame[:_LENGTH].numpy().tobytes(), "little")
        first = min(size, FRAME_BYTES - _LENGTH)
        payload = frame[_LENGTH:_LENGTH + first].numpy().tobytes()
        if size > first:
            rest = torch.empty(size - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        return loads(payload)

    def send_output(self, output: ExecutorOutput) -> None:
        dist.send_object_list([output], dst=0, group=self.group)

    def receive_output(self) -> ExecutorOutput:
        box: list = [None]
        dist.recv_object_list(box, src=self.output_rank, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out
