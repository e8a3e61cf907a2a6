"""RadixCache and NoPrefixCache: unit tests plus a stateful model of how the scheduler drives them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kiln.memory.allocator import TokenAllocator
from kiln.memory.prefix_cache import NoPrefixCache
from kiln.memory.radix_cache import RadixCache

pytestmark = pytest.mark.unit


def _make(num_tokens: int = 64, ps: int = 1) -> tuple[TokenAllocator, RadixCache]:
    alloc = TokenAllocator(num_tokens, page_size=ps, debug=True)
    return alloc, RadixCache(alloc, page_size=ps)


def _fill(alloc: TokenAllocator, n: int) -> torch.Tensor:
    out = alloc.alloc_extend([0], [-1], [n])
    assert out is not None
    return out


# ---------------------------------------------------------------------- unit tests


def test_match_after_insert() -> None:
    alloc, cache = _make()
    slots = _fill(alloc, 5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    m = cache.acquire_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == slots[:3].tolist()
    assert cache.acquire_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == slots.tolist()
    assert cache.acquire_prefix([7]).indices.numel() == 0
    assert cache.acquire_prefix([]).node is cache.root_node
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (5, 5, 0)
    cache.debug_check()


def test_insert_returns_already_cached_length() -> None:
    alloc, cache = _make()
    a = _fill(alloc, 4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = _fill(alloc, 6)
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 4  # caller frees b[:4]
    alloc.free(b[:4])
    assert cache.acquire_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == a.tolist() + b[4:].tolist()
    assert cache.total_size() + alloc.available_size() == alloc.size
    cache.debug_check()


def test_split_at_boundary() -> None:
    alloc, cache = _make()
    slots = _fill(alloc, 6)
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    m = cache.acquire_prefix([1, 2, 3, 7])
    assert m.indices.tolist() == slots[:3].tolist()
    node = m.node
    assert node.key == [1, 2, 3] and list(node.children) == [(4,)]
    assert node.children[(4,)].key == [4, 5, 6]
    cache.lock(node)  # only the upper half is protected
    assert (cache.protected_size(), cache.evictable_size()) == (3, 3)
    cache.debug_check()
    assert cache.evict(100) == 3
    assert cache.acquire_prefix([1, 2, 3, 4]).indices.tolist() == slots[:3].tolist()
    cache.unlock(node)
    cache.debug_check()


def test_page_size_4_alignment() -> None:
    alloc, cache = _make(64, ps=4)
    slots = _fill(alloc, 10)
    key = list(range(100, 110))
    assert cache.insert(key, slots) == 0
    assert cache.total_size() == 8  # the partial page stays the caller's
    alloc.free(slots[8:])
    assert cache.acquire_prefix(key[:7]).indices.tolist() == slots[:4].tolist()
    assert cache.acquire_prefix(key[:3]).indices.numel() == 0
    # diverging inside the second page: the match stops at the page boundary and splits there
    m = cache.acquire_prefix(key[:6] + [0, 0])
    assert m.indices.tolist() == slots[:4].tolist() and len(m.node.key) == 4
    assert cache.insert(key[:5] + [0, 0, 0], torch.cat([slots[:4], _fill(alloc, 4)])) == 4
    cache.debug_check()
    # the first page came from the match, so there is no duplicate to free; the tree took the new page
    assert cache.total_size() == 12 and cache.total_size() + alloc.available_size() == alloc.size


def test_lru_eviction_order() -> None:
    alloc, cache = _make()
    for first in (1, 2, 3):
        cache.insert([first, 0], _fill(alloc, 2))
    cache.acquire_prefix([1, 0])  # refresh: now 2 is the oldest, then 3, then 1
    assert cache.evict(1) == 2
    assert cache.acquire_prefix([2, 0]).indices.numel() == 0
    assert cache.acquire_prefix([3, 0]).indices.numel() == 2  # refreshes 3
    assert cache.evict(2) == 2
    assert cache.acquire_prefix([1, 0]).indices.numel() == 0
    assert cache.acquire_prefix([3, 0]).indices.numel() == 2
    cache.debug_check()


def test_evicting_a_leaf_exposes_its_parent() -> None:
    alloc, cache = _make()
    cache.insert([1, 2, 3, 4], _fill(alloc, 4))
    cache.acquire_prefix([1, 2])  # split into [1,2] -> [3,4]
    assert cache.evict(1) == 2  # the leaf [3,4] goes first
    assert cache.evict(1) == 2  # then its parent, now a leaf
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    cache.debug_check()


def test_locked_nodes_never_evicted() -> None:
    alloc, cache = _make()
    a = _fill(alloc, 3)
    cache.insert([1, 2, 3], a)
    cache.insert([5, 6], _fill(alloc, 2))
    m = cache.acquire_prefix([1, 2, 3])
    cache.lock(m.node)
    cache.lock(m.node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.evict(100) == 0
    assert cache.acquire_prefix([1, 2, 3]).indices.tolist() == a.tolist()
    cache.unlock(m.node)
    assert cache.evict(100) == 0  # still locked once
    cache.unlock(m.node)
    with pytest.raises(AssertionError):
        cache.unlock(m.node)  # one unlock too many
    cache.debug_check()
    assert cache.evictable_size() == 3 and cache.evict(1) == 3
    assert alloc.available_size() == alloc.size


def test_reset_frees_everything_and_refuses_when_locked() -> None:
    alloc, cache = _make(32, ps=4)
    cache.insert(list(range(12)), _fill(alloc, 12))
    m = cache.acquire_prefix(list(range(8)))
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    cache.debug_check()


def test_insert_copies_the_slots() -> None:
    alloc, cache = _make()
    row = torch.zeros(8, dtype=torch.int64)
    row[:4] = _fill(alloc, 4)
    expect = row[:4].tolist()
    cache.insert([1, 2, 3, 4], row[:4])
    row[:] = 0  # the request table row is reused
    assert cache.acquire_prefix([1, 2, 3, 4]).indices.tolist() == expect


def test_page_size_must_match_allocator() -> None:
    with pytest.raises(ValueError):
        RadixCache(TokenAllocator(16, page_size=4), page_size=1)
    assert RadixCache(TokenAllocator(16, page_size=4)).page_size == 4


def test_no_prefix_cache() -> None:
    alloc = TokenAllocator(32, page_size=4)
    cache = NoPrefixCache(alloc)
    assert cache.page_size == 4
    slots = _fill(alloc, 10)
    m = cache.acquire_prefix(list(range(10)))
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
    cache.lock(m.node)
    assert cache.insert(list(range(10)), slots) == 8  # caller frees all of its slots
    cache.unlock(m.node)
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size(), cache.evict(10)) == (
        0,
        0,
        0,
        0,
    )
    assert NoPrefixCache(page_size=1).insert([1, 2, 3], torch.arange(3)) == 3
    cache.reset()


# ---------------------------------------------------------------------- stateful model


@dataclass
class Req:
    tokens: list[int]  # prompt + output it will reach
    slots: list[int]  # slots of tokens[:len(slots)]
    cached: int  # leading slots that came from the tree (page-aligned)
    node: object


class RadixMachine(RuleBasedStateMachine):
    """Requests start, grow, get chunked, finish or abort; the cache evicts and flushes in between."""

    PAGE_SIZE = 1
    POOL_PAGES = 24

    def __init__(self) -> None:
        super().__init__()
        ps = self.PAGE_SIZE
        self.alloc = TokenAllocator(self.POOL_PAGES * ps, page_size=ps, debug=True)
        self.cache = RadixCache(self.alloc, page_size=ps)
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.record: dict[int, tuple[int, int]] = {}  # slot -> (token id, position) written at alloc
        self.history: list[list[int]] = [[]]

    # helpers ----------------------------------------------------------

    def _check_match(self, key: list[int], indices: torch.Tensor) -> None:
        assert indices.numel() % self.PAGE_SIZE == 0
        self._check_slots(key, indices.tolist())

    def _check_slots(self, key: list[int], slots: list[int]) -> None:
        assert len(slots) <= len(key)
        for i, s in enumerate(slots):
            assert self.record[s] == (key[i], i), f"slot {s} holds {self.record[s]}, wanted {(key[i], i)}"

    def _grow(self, req: Req, n: int) -> bool:
        """Allocate slots for the next n tokens, evicting if short; False when the pool cannot."""
        n = min(n, len(req.tokens) - len(req.slots))
        if n <= 0:
            return True
        pre, last = len(req.slots), (req.slots[-1] if req.slots else -1)
        for attempt in range(2):
            if n == 1:
                out = self.alloc.alloc_decode([pre], [last])
            else:
                out = self.alloc.alloc_extend([pre], [last], [n])
            if out is not None:
                break
            if attempt == 0:
                event(
                    "alloc short: evicted"
                    if self.cache.evict(n + self.PAGE_SIZE)
                    else "alloc short: none evictable"
                )
        else:
            event("alloc failed after evict")
            return False
        for i, s in enumerate(out.tolist(), start=pre):
            self.record[s] = (req.tokens[i], i)
        req.slots.extend(out.tolist())
        return True

    def _insert(self, req: Req) -> int:
        """Insert what the request has so far and free its duplicate slots; returns the aligned length."""
        n = len(req.slots)
        aligned = n // self.PAGE_SIZE * self.PAGE_SIZE
        prefix = self.cache.insert(req.tokens[:n], torch.tensor(req.slots, dtype=torch.int64))
        assert req.cached <= prefix <= aligned
        event("insert: duplicates freed" if prefix > req.cached else "insert: no duplicates")
        self.alloc.free(torch.tensor(req.slots[req.cached : prefix], dtype=torch.int64))
        return aligned

    # rules ------------------------------------------------------------

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=14), initial=st.integers(0, 30))
    def start(self, data: st.DataObject, suffix: list[int], initial: int) -> None:
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)) | st.just(len(base)))
        tokens = base[:cut] + suffix
        if not tokens:
            return
        initial = min(initial, len(tokens))
        m = self.cache.acquire_prefix(tokens[:initial])
        self._check_match(tokens, m.indices)
        event("start: prefix hit" if m.indices.numel() else "start: miss")
        self.cache.lock(m.node)
        req = Req(tokens, m.indices.tolist(), m.indices.numel(), m.node)
        if not self._grow(req, initial - req.cached):
            self.cache.unlock(m.node)
            return
        self.reqs[self.next_rid] = req
        self.next_rid += 1
        self.history.append(tokens)

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def grow(self, data: st.DataObject, n: int) -> None:
        rid = self._pick(data)
        if not self._grow(self.reqs[rid], n):
            self.abort_request(rid)  # retraction: give back everything private

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.reqs.pop(self._pick(data))
        aligned = self._insert(req)
        self.alloc.free(torch.tensor(req.slots[aligned:], dtype=torch.int64))
        self.cache.unlock(req.node)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:
        req = self.reqs[self._pick(data)]
        aligned = self._insert(req)
        m = self.cache.acquire_prefix(req.tokens[: len(req.slots)])
        assert m.indices.numel() == aligned
        self._check_match(req.tokens, m.indices)
        self.cache.lock(m.node)
        self.cache.unlock(req.node)
        req.slots[:aligned] = m.indices.tolist()
        req.cached, req.node = aligned, m.node

    def abort_request(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        self.alloc.free(torch.tensor(req.slots[req.cached :], dtype=torch.int64))
        self.cache.unlock(req.node)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.abort_request(self._pick(data))

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        before_free, before_evictable = self.alloc.available_size(), self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, before_evictable)
        assert self.cache.evictable_size() == before_evictable - freed
        assert self.alloc.available_size() == before_free + freed

    @precondition(lambda self: not self.reqs)
    @rule()
    def flush(self) -> None:
        assert self.cache.protected_size() == 0
        self.cache.reset()
        assert self.cache.total_size() == 0 and self.alloc.available_size() == self.alloc.size

    # invariants -------------------------------------------------------

    @invariant()
    def conservation(self) -> None:
        ps = self.PAGE_SIZE
        self.cache.debug_check()
        private_pages: list[int] = []
        for req in self.reqs.values():
            pages = sorted({s // ps for s in req.slots[req.cached :]})
            assert len(pages) == -(-len(req.slots) // ps) - req.cached // ps
            private_pages.extend(pages)
            self._check_slots(req.tokens, req.slots)
        private = len(private_pages) * ps
        assert self.alloc.available_size() + self.cache.total_size() + private == self.alloc.size
        tree_pages = torch.unique(self.cache.cached_slots() // ps).tolist()
        owned = tree_pages + private_pages + self.alloc.free_page_ids().tolist()
        assert sorted(owned) == list(range(1, self.alloc.num_pages + 1)), "a page is owned twice or lost"
        locked_nodes: dict[int, int] = {}
        for req in self.reqs.values():
            node = req.node
            while node is not self.cache.root_node:
                locked_nodes[id(node)] = len(node.key)
                node = node.parent
        assert self.cache.protected_size() == sum(locked_nodes.values())


class RadixMachinePage4(RadixMachine):
    PAGE_SIZE = 4
    POOL_PAGES = 10


# 100 runs per page size (200 in all), each up to 40 steps: about 5 s per page size on this machine
_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None)
TestRadixStateful = RadixMachine.TestCase
TestRadixStateful.settings = _SETTINGS
TestRadixStatefulPage4 = RadixMachinePage4.TestCase
TestRadixStatefulPage4.settings = _SETTINGS
