"""The radix cache over two tiers (SGLang's HiRadixCache): evicting from the device pool moves a prefix to the
host pool instead of dropping it, and a hit on a host-resident prefix loads it back before the extend.

A node's `value` holds its device slots, or None while it lives on the host only; `host_value` holds the slots
of its host copy, if any. The device-resident nodes always form a subtree containing the root (a prefix is on
the device only if its parent is), because eviction takes device leaves first and a hit loads a path back from
the top. So locked nodes, which are all on the device, never sit below a host-only one.

Write policies (--hicache-write-policy, SGLang's names): write_back copies a node to the host when it is evicted;
write_through copies it when it is inserted, so eviction frees device slots without a copy; write_through_selective
copies a node once it has been hit twice, and evicts the rest without keeping them.

The copies are the host pool's (kiln.memory.tier_copies): a store is in flight until its rows land in the host
pool, which a load of those rows waits for; on CUDA they run on streams of their own beside the step in flight,
and the extend that reads a loaded prefix waits for it on the GPU."""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator

import torch

import kiln.distributed as distributed
from kiln.memory.allocator import TokenAllocator
from kiln.memory.host_pool import HostKVPool
from kiln.memory.radix_cache import RadixCache, TreeNode
from kiln.memory.storage_tier import FileStorageTier

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SELECTIVE_HITS = 2  # write_through_selective backs a node up on its second hit, as SGLang's threshold


class HiRadixCache(RadixCache):
    def __init__(
        self,
        allocator: TokenAllocator,
        host: HostKVPool,
        write_policy: str = "write_through",
        storage: FileStorageTier | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--hicache-write-policy {write_policy!r}: choose one of {', '.join(WRITE_POLICIES)}"
            )
        if host.page_size != allocator.page_size:
            raise ValueError(f"host page size {host.page_size} != device page size {allocator.page_size}")
        self.host = host
        self.write_policy = write_policy
        self.storage = storage
        self.host_hit_tokens = 0  # tokens loaded back from the host tier, since the start
        self.load_back_seconds = 0.0
        self._pinned: set[int] = (
            set()
        )  # ids of nodes whose host copy must survive the host eviction under way
        super().__init__(allocator, allocator.page_size)

    # ------------------------------------------------------------------ tree shape

    def _drop_host_subtree(self, node: TreeNode) -> None:
        """Remove a host-only node and its descendants (all host-only), freeing their host slots."""
        assert node.value is None and node.parent is not None
        del node.parent.children[self._page_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_value is not None:
                self.host.allocator.free(n.host_value)
            n.alive, n.host_value = False, None
            self._num_nodes -= 1

    # ------------------------------------------------------------------ interface

    # a match's walk: a host-only node comes back to the device; past the tree, the storage tier's blocks follow

    def _reach(self, node: TreeNode) -> bool:
        if node.value is None and not self._load_back(node):
            return False  # no device room for it: the match stops above it
        node.hit_count += 1
        if self.write_policy == "write_through_selective" and node.hit_count >= SELECTIVE_HITS:
            self._backup(node)
        return True

    def _beyond_tree(self, key: list[int], node: TreeNode, pos: int, values: list) -> tuple[TreeNode, int]:
        if self.storage is None or pos >= len(key):
            return node, pos
        return self._prefetch(key, node, pos, values)

    def _prefetch(self, key: list[int], node: TreeNode, pos: int, values: list) -> tuple[TreeNode, int]:
        """Extend a match that the tree ends at `pos` with the stored blocks that follow it: device slots for
        their tokens, the rows copied in, and a node for them in the tree (so the host tier backs it up too)."""
        assert self.storage is not None
        block = self.storage.block_tokens
        first = pos // block
        names = self.storage.block_names(key)[first:]
        blocks = self.storage.load(names) if names and self.storage.contains(names[0]) else []
        # every rank reads its own files, and one rank may miss a block another has (a write still under way,
        # a bad file): the ranks take the blocks all of them have, so their trees stay the same
        blocks = blocks[: distributed.min_across_ranks([len(blocks)])[0]]
        end = (first + len(blocks)) * block
        if end <= pos:
            return node, pos
        self.lock(node)
        try:
            if self.allocator.available_size() < end - pos:
                self.evict(end - pos - self.allocator.available_size())
            slots = self.allocator.alloc_pages(end - pos)
        finally:
            self.unlock(node)
        if slots is None:
            return node, pos
        self.storage.copy_into(blocks, pos - first * block, slots)
        prefix = torch.cat([*values, slots])
        self.insert(key[:end], prefix)
        values.append(slots)
        leaf = node.children[self._page_key(key, pos)]
        assert leaf.value is not None and torch.equal(leaf.value, slots)
        return leaf, end

    def _load_back(self, node: TreeNode) -> bool:
        """Give a host-only node device slots again and copy its KV into them; False when the device has no room
        even after evicting (the match then stops above it)."""
        assert node.host_value is not None and node.parent is not None
        n = len(node.key)
        self.lock(node.parent)  # its path must stay on the device while room is made for it
        self._pinned.add(id(node))  # and its host copy on the host, should making room write others back
        try:
            if self.allocator.available_size() < n:
                self.evict(n - self.allocator.available_size())
            slots = self.allocator.alloc_pages(n)
        finally:
            self.unlock(node.parent)
            self._pinned.discard(id(node))
        if slots is None:
            return False
        t0 = time.perf_counter()
        self.host.load(node.host_value, slots)
        self.load_back_seconds += time.perf_counter() - t0
        self.host_hit_tokens += n
        node.value = slots
        self._evictable += n
        return True

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """As RadixCache.insert, then the sequence's whole blocks to the storage tier."""
        already = super().insert(key, indices)
        if self.storage is not None:
            end = len(key) // self.page_size * self.page_size
            self.storage.write(key[:end], indices[:end])
        return already

    def _insert_into(self, node: TreeNode, key: list[int], pos: int) -> TreeNode | None:
        child = super()._insert_into(node, key, pos)
        if child is not None and child.value is None:  # the caller's fresh KV replaces the host copy
            self._drop_host_subtree(child)
            return None
        return child

    def _inserted(self, leaf: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup(leaf)

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device-resident node to the host tier unless it is there already; False when the host has no
        room for it even after evicting host copies."""
        if node.host_value is not None:
            return True
        assert node.value is not None
        n = len(node.key)
        if self.host.allocator.available_size() < n:
            self._evict_host(n - self.host.allocator.available_size())
        slots = self.host.allocator.alloc_pages(n)
        if slots is None:
            return False
        self.host.store(node.value, slots)
        node.host_value = slots
        return True

    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves, least recently used first: each moves to the host tier
        (write_back copies it now) or, where it cannot be kept there, leaves the tree."""
        heap = [(n.last_access_time, i, n) for i, n in enumerate(self._device_leaves())]
        heapq.heapify(heap)
        freed, order = 0, len(heap)
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.lock_ref or not node.alive or node.value is None:
                continue
            keep = self.write_policy == "write_back" and self._backup(node)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            node.value = None
            if not (keep or node.host_value is not None):
                self._drop_host_subtree(node)
            parent = node.parent
            if parent is not None and parent is not self.root_node and self._is_device_leaf(parent):
                order += 1
                heapq.heappush(heap, (parent.last_access_time, order, parent))
        if freed:
            self.host.copies.fence()  # the freed slots are written again only after the stores reading them
        return freed

    def poll(self) -> None:
        self.host.poll()

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (
            node.value is not None
            and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def _device_leaves(self) -> Iterator[TreeNode]:
        return (n for n in self._iter_nodes() if self._is_device_leaf(n))

    def _evict_host(self, num_tokens: int) -> int:
        """Free host slots, least recently used first: host-only leaves leave the tree; then device-resident
        nodes give up their host copies (they stay cached on the device)."""
        only_host = [n for n in self._iter_nodes() if n.value is None and not n.children]
        backups = [n for n in self._iter_nodes() if n.value is not None and n.host_value is not None]
        freed = 0
        for node in sorted(only_host, key=lambda n: n.last_access_time) + sorted(
            backups, key=lambda n: n.last_access_time
        ):
            if freed >= num_tokens:
                break
            if id(node) in self._pinned or not node.alive or node.host_value is None:
                continue
            freed += len(node.key)
            if node.value is None:
                self._drop_host_subtree(node)
            else:
                self.host.allocator.free(node.host_value)
                node.host_value = None
        return freed

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"cannot reset the prefix cache: {self._protected} tokens are locked")
        self.host.drain()
        for node in list(self._iter_nodes()):
            if node.value is not None:
                self.allocator.free(node.value)
            if node.host_value is not None:
                self.host.allocator.free(node.host_value)
            node.alive = False
        self._init_tree()

    # ------------------------------------------------------------------ inspection

    def tier_stats(self) -> dict:
        """Sizes and traffic of the host and storage tiers, by SchedulerStats field (O(1): no tree walk)."""
        stats = {
            "host_tier_tokens": self.host.size,
            "host_used_tokens": self.host.size - self.host.allocator.available_size(),
            "host_hit_tokens": self.host_hit_tokens,
            "host_load_back_seconds": self.load_back_seconds,
            "host_bytes_written": self.host.bytes_written,
        }
        if self.storage is not None:
            stats.update(
                storage_hit_tokens=self.storage.hit_tokens,
                storage_bytes_written=self.storage.bytes_written,
                storage_load_seconds=self.storage.load_seconds,
                storage_skipped_files=self.storage.skipped_files,
            )
        return stats

    def host_integrity(self) -> dict:
        """The host tier's invariant: slots held by nodes + free slots == its size (each held once); `in_flight`:
        the slots whose rows are still being copied in."""
        held, free = self._host_slots(), self.host.allocator.available_size()
        unique = held.unique().numel() == held.numel()
        return {"held": held.numel(), "free": free, "total": self.host.size,
                "in_flight": self.host.copies.in_flight_tokens,
                "ok": unique and held.numel() + free == self.host.size}  # fmt: skip

    def host_cached_tokens(self) -> int:
        return sum(len(n.key) for n in self._iter_nodes() if n.host_value is not None)

    def cached_slots(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes() if n.value is not None]
        return torch.cat(values) if values else self._empty

    def debug_check(self) -> None:
        """Device nodes form a subtree holding every lock; device sizes as kept; each host slot held once and
        the host allocator's free count the rest."""
        evictable = protected = count = 0
        for node in self._iter_nodes():
            count += 1
            assert node.alive and node.parent is not None and len(node.key) % self.page_size == 0
            if node.value is None:
                assert node.lock_ref == 0, "a locked node lives on the host only"
                assert node.host_value is not None, "a node on neither tier"
                continue
            assert node.parent is self.root_node or node.parent.value is not None, (
                "device node below a host one"
            )
            assert node.value.numel() == len(node.key)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: walked {(evictable, protected)}, kept {(self._evictable, self._protected)}"
        )
        assert count == self._num_nodes, f"node count drifted: {count} != {self._num_nodes}"
        for slots, what in ((self.cached_slots(), "device"), (self._host_slots(), "host")):
            assert slots.unique().numel() == slots.numel(), f"{what} tier holds a slot twice"
        held = self._host_slots().numel()
        assert held + self.host.allocator.available_size() == self.host.size, (
            f"host tier: {held} held + {self.host.allocator.available_size()} free != {self.host.size}"
        )

    def _host_slots(self) -> torch.Tensor:
        values = [n.host_value for n in self._iter_nodes() if n.host_value is not None]
        return torch.cat(values) if values else self._empty
