"""The host tier of the KV cache (--enable-hierarchical-cache): a second pool in host memory with the device
pool's row layout, its own page allocator, and the copies between the two.

On CUDA its tensors are pinned; on the CPU it is a second pool with its own budget, so the behaviour is the same
and testable on any machine. The copies (kiln.memory.tier_copies) run beside the compute on CUDA: a store lands
in the host rows once its copy is done, a load is on the device before the next step reads it. It mirrors
whatever per-layer tensors the device pool holds (K and V rows, or MLA's one latent row), so one tier serves
every attention backend."""

from __future__ import annotations

from typing import Protocol

import torch

from kiln.memory.allocator import TokenAllocator
from kiln.memory.kv_pool import copyable
from kiln.memory.tier_copies import TierCopies


class DevicePool(Protocol):
    """What the host tier reads of a device KV pool (KVPool or LatentKVPool)."""

    page_size: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class HostKVPool:
    """Host rows for num_tokens tokens of every layer of `device_pool`, and their allocator."""

    def __init__(self, device_pool: DevicePool, num_tokens: int) -> None:
        self.device_pool = device_pool
        self.page_size = device_pool.page_size
        self.allocator = TokenAllocator(num_tokens, self.page_size, "cpu")
        rows = self.allocator.size + self.page_size  # plus the reserved padding page, as the device pool
        pin = any(t.is_cuda for t in device_pool.k)
        # byte views of fp8 pools: torch has no CPU index_copy_ for fp8
        self._device = [copyable(t) for t in (*device_pool.k, *device_pool.v)]
        # zeros: the memory is committed at startup as the ledger's host line says, not page by page
        self._host = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in self._device]
        self.copies = TierCopies(self._device, self._host)
        self.bytes_written = 0  # device -> host, since the start
        self.bytes_loaded = 0  # host -> device

    @property
    def size(self) -> int:
        return self.allocator.size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._host)

    def row_bytes(self) -> int:
        """Bytes one token occupies across every layer (the same on both tiers)."""
        return self.copies.row_bytes

    def store(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the KV of device_slots into host_slots, every layer; the rows land there by the next load of
        them (or `drain`)."""
        self.copies.store(device_slots, host_slots)
        self.bytes_written += int(host_slots.numel()) * self.row_bytes()

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the KV of host_slots back into device_slots, every layer, ahead of the next step."""
        self.copies.load(host_slots, device_slots)
        self.bytes_loaded += int(host_slots.numel()) * self.row_bytes()

    def poll(self) -> None:
        self.copies.poll()

    def drain(self) -> None:
        self.copies.drain()
