"""RadixAttention prefix cache: a radix tree over token ids whose nodes own KV slots.

Nodes hold a page-aligned ``key`` (token ids) and ``value`` (their slots). Children are keyed by the
first page of their key. ``lock_ref`` counts the running requests using a node (a lock covers the node
and all its ancestors); unlocked leaves are evicted least recently used first through a lazy heap whose
stale entries are skipped when popped.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from kiln.memory.allocator import TokenAllocator
from kiln.memory.prefix_cache import MatchResult, PrefixCache


class TreeNode:
    """One edge of the radix tree: a run of tokens and the slots holding their KV."""

    __slots__ = (
        "key", "value", "host_value", "parent", "children", "lock_ref", "last_access_time", "alive", "hit_count",
        "checkpoint",
    )  # fmt: skip

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None) -> None:
        self.key = key
        self.value = value  # device slots; None while the node lives on the host tier only
        self.host_value: torch.Tensor | None = None  # host-tier slots of its backup (HiRadixCache)
        self.hit_count = 0
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = 0
        self.alive = True
        # hybrid models: the state-pool slot holding the linear layers' state after this node's last token
        # (HybridRadixCache); a split keeps it on the lower part, which still ends at that token
        self.checkpoint: int | None = None

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class RadixCache(PrefixCache):
    """Prefix cache over a ``TokenAllocator``; sizes are kept incrementally so queries are O(1)."""

    def __init__(self, allocator: TokenAllocator, page_size: int | None = None) -> None:
        page_size = allocator.page_size if page_size is None else page_size
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode([], self._empty, None)
        self.root_node.lock_ref = 1  # the root is never evicted and never counted
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []

    # ------------------------------------------------------------------ helpers

    def _page_key(self, key: list[int], pos: int = 0) -> tuple[int, ...]:
        return tuple(key[pos : pos + self.page_size])

    def _common_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        """Page-aligned length of the common prefix of ``node_key`` and ``key[pos:]``."""
        n = min(len(node_key), len(key) - pos)
        if key[pos : pos + n] == node_key[:n]:
            return n
        i = 0
        while node_key[i] == key[pos + i]:
            i += 1
        return i // self.page_size * self.page_size

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access_time = now
        self._maybe_push(node)

    def _maybe_push(self, node: TreeNode) -> None:
        if node.lock_ref == 0 and not node.children and node is not self.root_node:
            heapq.heappush(self._heap, (node.last_access_time, next(self._seq), node))
            if len(self._heap) > 4 * self._num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [
            (n.last_access_time, next(self._seq), n)
            for n in self._iter_nodes()
            if n.lock_ref == 0 and not n.children
        ]
        heapq.heapify(self._heap)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens (page-aligned); returns the new upper node. Either tier's slots (a
        host-only node has no device value, a one-tier tree no host value) are cut alike."""
        value, host_value = child.value, child.host_value
        upper = TreeNode(child.key[:at], None if value is None else value[:at], child.parent)
        upper.host_value = None if host_value is None else host_value[:at]
        upper.lock_ref, upper.last_access_time, upper.hit_count = (
            child.lock_ref, child.last_access_time, child.hit_count
        )  # fmt: skip
        child.key = child.key[at:]
        child.value = None if value is None else value[at:]
        child.host_value = None if host_value is None else host_value[at:]
        upper.children[self._page_key(child.key)] = child
        assert child.parent is not None
        child.parent.children[self._page_key(upper.key)] = upper
        child.parent = upper
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ interface

    def acquire_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix, taken for a request being admitted: splits the last node at the
        boundary, refreshes LRU times (a tiered cache brings host and stored rows back here)."""
        end = len(key) // self.page_size * self.page_size
        key = key[:end] if end < len(key) else key
        now = next(self._clock)
        node, pos, values = self.root_node, 0, []
        while pos < end:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                break
            m = self._common_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            if not self._reach(child):
                break
            values.append(child.value)
            pos += m
            node = child
            self._touch(node, now)
        node, pos = self._beyond_tree(key, node, pos, values)
        indices = torch.cat(values) if values else self._empty
        return MatchResult(indices=indices, node=node)

    def match_prefix(self, key: list[int]) -> int:
        """How many leading tokens of `key` are cached, changing nothing: no node split, no LRU refresh, no load
        from another tier (a node the host tier holds counts: admission's acquire_prefix loads it back), no storage
        read, no collective. Orders the queue and budgets admission; acquire_prefix at admission is where KV
        moves."""
        end = len(key) // self.page_size * self.page_size
        node, pos, path = self.root_node, 0, []
        while pos < end:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                break
            m = self._common_len(child.key, key[:end], pos)
            pos += m
            path.append((child, pos, m == len(child.key)))
            if m < len(child.key):
                break
            node = child
        return self._match_end(path)

    def _match_end(self, path: list[tuple[TreeNode, int, bool]]) -> int:
        """Where a lookup's walk ends, from the nodes it went through ((node, tokens to its end, whole))."""
        return path[-1][1] if path else 0

    def _reach(self, node: TreeNode) -> bool:
        """A match walking into `node`: may it use it? (The two-tier cache loads a host-only node back here.)"""
        return True

    def _beyond_tree(self, key: list[int], node: TreeNode, pos: int, values: list) -> tuple[TreeNode, int]:
        """Where the tree's match of `key` ends (at `node`, `pos` tokens in): the two-tier cache continues it from
        its storage tier, appending slots to `values`; here it ends."""
        return node, pos

    def lock(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root_node:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._maybe_push(node)
            node = node.parent  # type: ignore[assignment]

    def insert(self, key: list[int], indices: torch.Tensor) -> int:
        """Insert the page-aligned prefix of ``key``; returns how many leading tokens were already cached."""
        end = len(key) // self.page_size * self.page_size
        assert indices.numel() >= end, "fewer slots than tokens to insert"
        key = key[:end] if end < len(key) else key
        now = next(self._clock)
        node, pos = self.root_node, 0
        while pos < end:
            child = self._insert_into(node, key, pos)
            if child is None:
                leaf = TreeNode(list(key[pos:]), indices[pos:end].to(self.device, torch.int64).clone(), node)
                node.children[self._page_key(leaf.key)] = leaf
                self._num_nodes += 1
                self._evictable += end - pos
                self._touch(leaf, now)
                self._inserted(leaf)
                return pos
            m = self._common_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            pos += m
            node = child
            self._touch(node, now)
        return pos

    def _insert_into(self, node: TreeNode, key: list[int], pos: int) -> TreeNode | None:
        """The child of `node` an insert of key[pos:] continues in; None: a new leaf goes there. (The two-tier
        cache drops a host-only child here: the caller holds the same KV freshly computed.)"""
        return node.children.get(self._page_key(key, pos))

    def _inserted(self, leaf: TreeNode) -> None:
        """A new leaf has been cached (the two-tier cache backs it up under write_through)."""

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` are freed or none is left."""
        freed, victims = 0, []
        while freed < num_tokens and self._heap:
            t, _, node = heapq.heappop(self._heap)
            if not node.alive or node.children or node.lock_ref or node.last_access_time != t:
                continue  # stale entry
            victims.append(node.value)
            freed += len(node.key)
            self._remove_leaf(node)
        if victims:
            self.allocator.free(torch.cat(victims))
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._page_key(node.key)]
        node.alive = False
        self._num_nodes -= 1
        self._evictable -= len(node.key)
        self._maybe_push(parent)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        """Free every cached slot to the allocator and start an empty tree (nothing may be locked)."""
        if self._protected:
            raise RuntimeError(f"cannot reset the prefix cache: {self._protected} tokens are locked")
        values = [n.value for n in self._iter_nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        for n in self._iter_nodes():
            n.alive = False
        self._init_tree()

    # ------------------------------------------------------------------ inspection

    def _iter_nodes(self):
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for integrity checks)."""
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty

    def debug_check(self) -> None:
        """Walk the tree; assert shapes, keys, lock refs, sizes and heap coverage are consistent."""
        ps, evictable, protected, count = self.page_size, 0, 0, 0
        live_heap = {id(n) for t, _, n in self._heap if n.alive and n.last_access_time == t}
        for node in self._iter_nodes():
            count += 1
            assert node.alive and node.parent is not None
            assert len(node.key) > 0 and len(node.key) % ps == 0, f"bad key length {len(node.key)}"
            assert node.value.numel() == len(node.key) and node.value.dtype == torch.int64
            assert node.parent.children.get(self._page_key(node.key)) is node, "child keyed wrongly"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "lock_ref below the sum of the children's"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    assert id(node) in live_heap, "evictable leaf missing from the eviction heap"
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: walked {(evictable, protected)}, kept {(self._evictable, self._protected)}"
        )
        assert count == self._num_nodes, f"node count drifted: {count} != {self._num_nodes}"
        slots = self.cached_slots()
        if slots.numel():
            pages = slots.div(ps, rounding_mode="floor")
            assert int(pages.min()) >= 1, "tree holds a slot of the dummy page"
            assert slots.unique().numel() == slots.numel(), "tree holds a slot twice"
