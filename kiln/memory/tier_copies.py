"""The copies between the device KV pool and the host tier (kiln.memory.host_pool), kept off the scheduler's
critical path.

A store reads a prefix's rows after the step that wrote them and moves them to staging in host memory; they land
in the host pool at a later poll, once the move is done. A load gathers host rows into staging, moves them to the
device and scatters them into the pool on the compute stream, ahead of the extend that reads them.

On CUDA the staging is pinned, and each direction has its own stream and ring of device buffers. A store's gather
and copy run on the store stream after the compute stream's work so far, so neither the scheduler nor the next
step waits for them (the synchronous `.cpu()` this replaces made the scheduler wait for the step in flight, under
the overlap schedule); the one ordering it needs, that no step writes a slot before the gathers reading it are
done, is kept by `fence`, which the cache calls before it frees device slots. A load's copies run on the load
stream, never behind a store, beside the step in flight for the first two chunks (the ring; the scatter of a
chunk frees its buffer), the rest after it. On the CPU the moves are done when issued, but a store still lands at
the next poll, so the in-flight state every CUDA store passes through is exercised by every test.

What waits on the host: a load of host slots that a store in flight still has to write (that store lands first),
and copies in flight past HOST_STAGING_BYTES of pinned staging in either direction (the oldest first). Staging
blocks are whole chunks, so the pinned memory torch's host allocator keeps for them stays about that size."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.memory.kv_pool import token_bytes
from kiln.memory.tier_staging import HOST_STAGING_BYTES, RING, STAGING_CHUNK_BYTES


class Completion(Protocol):
    """When a move is done: a torch.cuda.Event, or _Done for a move done when issued."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class _Store:
    host_slots: torch.Tensor  # where the rows land, on the host
    rows: list[torch.Tensor]  # the staged rows, one tensor per pool tensor
    done: Completion

    @property
    def nbytes(self) -> int:
        return sum(r.untyped_storage().nbytes() for r in self.rows)  # whole staging blocks on CUDA


class TierCopies:
    """Stores and loads between `device` (the pool's tensors, byte views for fp8) and `host` (the host tier's)."""

    def __init__(
        self,
        device: list[torch.Tensor],
        host: list[torch.Tensor],
        chunk_bytes: int = STAGING_CHUNK_BYTES,
        host_staging_bytes: int = HOST_STAGING_BYTES,
    ) -> None:
        self.device, self.host = device, host
        self.row_bytes = token_bytes(host)
        self.chunk_tokens = max(1, chunk_bytes // self.row_bytes)
        self.host_staging_bytes = host_staging_bytes
        self._stores: deque[_Store] = deque()
        self._staged = 0  # bytes of host staging held by the stores in flight
        # the loads' copies from pinned staging in flight, and their bytes
        self._loads: deque[tuple[Completion, int]] = deque()
        self._loading = 0
        self.on_cuda = device[0].is_cuda
        if self.on_cuda:
            # a stream and a ring of device buffers each way, so that a load never queues behind a store's wait
            # for the compute stream
            self.store_stream, self.load_stream = (torch.cuda.Stream(device[0].device) for _ in range(2))
            self._store_ring, self._load_ring = self._ring(), self._ring()
            # a load buffer's reader on the compute stream (the scatter), done; a store buffer's readers are all
            # on the store stream, in its order
            self._load_free: list[torch.cuda.Event | None] = [None] * RING
            self._store_turn = self._load_turn = 0
        self._gathered: torch.cuda.Event | None = None  # the last store's gathers, done

    def _ring(self) -> list[list[torch.Tensor]]:
        shape = (self.chunk_tokens,)
        return [[torch.empty(shape + t.shape[1:], dtype=t.dtype, device=t.device) for t in self.device]
                for _ in range(RING)]  # fmt: skip

    @property
    def in_flight_tokens(self) -> int:
        return sum(int(s.host_slots.numel()) for s in self._stores)

    # ------------------------------------------------------------------ stores

    def store(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Start copying the rows of device_slots (every pool tensor) to host_slots; they land at a poll."""
        self.poll()
        src, dst = device_slots.to(self.device[0].device), host_slots.cpu()
        for a in range(0, int(dst.numel()), self.chunk_tokens):
            s, d = src[a : a + self.chunk_tokens], dst[a : a + self.chunk_tokens]
            if self.on_cuda:
                self._push(_Store(d, *self._to_host(s)))
            else:
                self._push(_Store(d, [t.index_select(0, s) for t in self.device], self._done_on_cpu()))

    def _done_on_cpu(self) -> Completion:
        """A CPU move's completion: done when issued (the tests hold it back to play a slow copy)."""
        return _Done()

    def _to_host(self, src: torch.Tensor) -> tuple[list[torch.Tensor], Completion]:
        n = int(src.numel())
        buf = [b[:n] for b in self._store_ring[self._store_turn]]
        self._store_turn = (self._store_turn + 1) % RING
        staged = self._pinned(n)
        # after the compute stream's work so far: the rows are written
        self.store_stream.wait_stream(torch.cuda.current_stream(self.device[0].device))
        with torch.cuda.stream(self.store_stream):
            for t, b in zip(self.device, buf, strict=True):
                torch.index_select(t, 0, src, out=b)
            self._gathered = self.store_stream.record_event()
            for st, b in zip(staged, buf, strict=True):
                st.copy_(b, non_blocking=True)
            done = self.store_stream.record_event()
        src.record_stream(self.store_stream)
        return staged, done

    def fence(self) -> None:
        """Before device slots are freed: the compute stream's next writes wait for the gathers issued so far
        (on the GPU; the host goes on)."""
        if self.on_cuda and self._gathered is not None:
            torch.cuda.current_stream(self.device[0].device).wait_event(self._gathered)
            self._gathered = None

    def _pinned(self, n: int) -> list[torch.Tensor]:
        """Host staging for n <= chunk_tokens rows of every pool tensor: whole-chunk blocks (one size each, so
        torch's pinned block cache reuses them), viewed to n rows."""
        return [
            torch.empty((self.chunk_tokens, *h.shape[1:]), dtype=h.dtype, pin_memory=True)[:n]
            for h in self.host
        ]

    def _push(self, store: _Store) -> None:
        while self._stores and self._staged + store.nbytes > self.host_staging_bytes:
            self._land_oldest()
        self._stores.append(store)
        self._staged += store.nbytes

    def _land_oldest(self) -> None:
        """Wait for the oldest store in flight and write its rows into the host pool. Stores land in the order
        they were issued, so a slot freed and stored again holds the later rows."""
        store = self._stores.popleft()
        store.done.synchronize()
        for h, r in zip(self.host, store.rows, strict=True):
            h.index_copy_(0, store.host_slots, r)
        self._staged -= store.nbytes

    def poll(self) -> None:
        """Land the stores whose moves are done, oldest first."""
        while self._stores and self._stores[0].done.query():
            self._land_oldest()

    def drain(self) -> None:
        """Land every store in flight (waiting for them)."""
        while self._stores:
            self._land_oldest()

    # ------------------------------------------------------------------ loads

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the rows of host_slots into device_slots, every pool tensor, ahead of whatever the compute
        stream runs next."""
        src, dst = host_slots.cpu(), device_slots.to(self.device[0].device)
        self._land_stores_into(src)
        if not self.on_cuda:
            for t, h in zip(self.device, self.host, strict=True):
                t.index_copy_(0, dst, h.index_select(0, src))
            return
        for a in range(0, int(src.numel()), self.chunk_tokens):
            self._to_device(src[a : a + self.chunk_tokens], dst[a : a + self.chunk_tokens])

    def _land_stores_into(self, host_slots: torch.Tensor) -> None:
        """Land every store in flight up to the last one writing any of host_slots."""
        self.poll()
        last = -1
        for i, store in enumerate(self._stores):
            if torch.isin(store.host_slots, host_slots).any():
                last = i
        for _ in range(last + 1):
            self._land_oldest()

    def _to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        nbytes = self.chunk_tokens * self.row_bytes  # whole staging blocks
        while self._loads and (self._loads[0][0].query() or self._loading + nbytes > self.host_staging_bytes):
            done, held = self._loads.popleft()
            done.synchronize()  # its pinned staging is free again (torch's host allocator waits for the copy)
            self._loading -= held
        staged = self._pinned(int(src.numel()))
        for h, st in zip(self.host, staged, strict=True):
            torch.index_select(h, 0, src, out=st)
        j = self._load_turn
        self._load_turn = (j + 1) % RING
        buf = [b[: src.numel()] for b in self._load_ring[j]]
        if self._load_free[j] is not None:  # the scatter of the chunk before last still reads this buffer
            self.load_stream.wait_event(self._load_free[j])
        with torch.cuda.stream(self.load_stream):
            for b, st in zip(buf, staged, strict=True):
                b.copy_(st, non_blocking=True)  # the pinned block is kept until this copy is done (torch's)
            arrived = self.load_stream.record_event()
        self._loads.append((arrived, nbytes))
        self._loading += nbytes
        compute = torch.cuda.current_stream(self.device[0].device)
        compute.wait_event(arrived)
        for t, b in zip(self.device, buf, strict=True):
            t.index_copy_(0, dst, b)
        self._load_free[j] = compute.record_event()
