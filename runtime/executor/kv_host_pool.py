"""The host-memory tier's pool (`engine.kvOffload`): a second KV pool in host memory.

It has the device pool's layout and dtype (one K and one V tensor per layer, indexed by slot
instead of block), pinned on CUDA so copies run asynchronously; the scheduler's index of it is
runtime/core/kv_host_tier.py. `transfer` performs a plan's kv_offloads, then its kv_restores,
before the forward pass:

- CPU: plain copies (index_select / index_copy_), offloads then restores.
- CUDA: the offloaded blocks are first gathered on the compute stream into a device staging
  buffer (a device-to-device copy, fast, ordered before anything this step writes into the
  reused blocks); the staging buffer goes to pinned host memory on a side copy stream, which
  overlaps with the forward pass; its scatter into the host slots runs after the step's final
  synchronisation (`finish`). Restores are gathered from the host slots into a pinned staging
  buffer, copied to the device on the side stream (after the offloads' gather) and scattered
  into their blocks there; the compute stream waits for them with an event just before the
  forward pass, so they overlap with the host's preparation of the step's batch inputs.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from tokenlane.runtime.config import ConfigError, KVOffloadConfig

log = logging.getLogger(__name__)

HOST_BYTES_KEY = "engine.kvOffload.hostBytes"


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor as [blocks, words] of the widest integer dtype its block's bytes divide
    into: copies of any dtype, fp8 included, without the indexing kernels having to support
    it, and word-sized rather than byte by byte (much faster on the CPU)."""
    rows = t.reshape(t.shape[0], -1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % torch.empty(0, dtype=word).element_size() == 0:
            return rows.view(word)
    return rows


def host_available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """MemAvailable of the host in bytes (None where /proc/meminfo does not say)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_pool_slots(host_bytes: int, bytes_per_block: int, available: Optional[int]) -> int:
    """Slots `host_bytes` hold, or ConfigError naming the key: more than the host's available
    memory (the tier would push the server into swap or the OOM killer), or less than one block."""
    if available is not None and host_bytes > available:
        raise ConfigError(
            f"{HOST_BYTES_KEY}: {host_bytes} bytes ({host_bytes / 2**30:.2f} GiB) is more than the host's "
            f"available memory ({available / 2**30:.2f} GiB, MemAvailable in /proc/meminfo)"
        )
    if host_bytes < bytes_per_block:
        raise ConfigError(
            f"{HOST_BYTES_KEY}: {host_bytes} bytes hold no KV block (one block takes {bytes_per_block} bytes)"
        )
    return host_bytes // bytes_per_block


class HostKVPool:
    """Host slots for the blocks of `kv_caches` (a list of (key, value) tensors per layer,
    shaped [num_blocks, ...])."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.cuda = device.type == "cuda"
        self.caches = [
            tuple(
                raw_bytes(torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda))
                for t in layer
            )
            for layer in kv_caches
        ]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # CUDA: offloads in flight (host slots, pinned staging), scattered by `finish`.
        self._pending: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None
        self._restore_events: Optional[tuple[torch.cuda.Event, torch.cuda.Event]] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.caches for t in layer)

    def transfer(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        offloads: list[tuple[int, int]],
        restores: list[tuple[int, int]],
    ) -> Optional[float]:
        """Perform the offloads, then the restores. On the CPU returns the restores' seconds;
        on CUDA None (their time is read after the step: `finish`)."""
        self._pending = self._restore_events = None  # (left over only by a failed step)
        kv_caches = [tuple(raw_bytes(t) for t in layer) for layer in kv_caches]
        if self.cuda:
            self._transfer_cuda(kv_caches, offloads, restores)
            return None
        if offloads:
            blocks = torch.tensor([b for b, _ in offloads], dtype=torch.long)
            slots = torch.tensor([s for _, s in offloads], dtype=torch.long)
            for device_layer, host_layer in zip(kv_caches, self.caches):
                for device_t, host_t in zip(device_layer, host_layer):
                    host_t.index_copy_(0, slots, device_t.index_select(0, blocks))
        if not restores:
            return None
        t0 = time.perf_counter()
        slots = torch.tensor([s for s, _ in restores], dtype=torch.long)
        blocks = torch.tensor([b for _, b in restores], dtype=torch.long)
        for device_layer, host_layer in zip(kv_caches, self.caches):
            for device_t, host_t in zip(device_layer, host_layer):
                device_t.index_copy_(0, blocks, host_t.index_select(0, slots))
        return time.perf_counter() - t0

    def _transfer_cuda(self, kv_caches, offloads, restores) -> None:
        compute = torch.cuda.current_stream(self.device)
        stream = self.stream
        if offloads:
            blocks = torch.tensor([b for b, _ in offloads], dtype=torch.long, device=self.device)
            # Gathered on the compute stream: ordered before this step's writes into the blocks.
            staged = [t.index_select(0, blocks) for layer in kv_caches for t in layer]
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in staged]
                for h, t in zip(host, staged):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(stream)
            self._pending = (torch.tensor([s for _, s in offloads], dtype=torch.long), host)
        if not restores:
            return
        slots = torch.tensor([s for s, _ in restores], dtype=torch.long)
        staged_host = [torch.index_select(t, 0, slots).pin_memory() for layer in self.caches for t in layer]
        blocks = torch.tensor([b for _, b in restores], dtype=torch.long, device=self.device)
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(compute)  # after the offloads' gather: a restore may reuse an offloaded block
        with torch.cuda.stream(stream):
            start.record(stream)
            targets = [t for layer in kv_caches for t in layer]
            for target, h in zip(targets, staged_host):
                target.index_copy_(0, blocks, h.to(self.device, non_blocking=True))
            done.record(stream)
        compute.wait_event(done)
        self._restore_events = (start, done)

    def finish(self) -> Optional[float]:
        """After the step synchronised the device (CUDA): scatter the offloads into their host
        slots; returns the restores' seconds (None: no restores)."""
        if self._pending is not None:
            slots, host = self._pending
            self._pending = None
            flat = [t for layer in self.caches for t in layer]
            for host_t, staged in zip(flat, host):
                host_t.index_copy_(0, slots, staged)
        if self._restore_events is None:
            return None
        start, done = self._restore_events
        self._restore_events = None
        return start.elapsed_time(done) / 1000.0


def make_host_pool(
    offload: Optional[KVOffloadConfig],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    bytes_per_block: int,
    device: torch.device,
) -> Optional[HostKVPool]:
    """The host pool engine.kvOffload asks for (None when unset); refused naming the key if the
    host cannot hold it."""
    if offload is None:
        return None
    slots = host_pool_slots(offload.host_bytes, bytes_per_block, host_available_bytes())
    pool = HostKVPool(kv_caches, slots, device)
    log.info("KV host tier: %d blocks (%.2f GiB%s)", slots, pool.nbytes / 2**30, ", pinned" if pool.cuda else "")
    return pool
