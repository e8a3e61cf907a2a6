"""The two-tier radix cache (HiRadixCache over a HostKVPool): evicted prefixes move to the host tier and come back
with the same KV; under random programs of inserts, matches, locks and evictions, for each write policy and page
size, every match returns slots whose KV is what was computed for that prefix, and the tiers' accounting holds
(device: free + cached + in use == total; host: held + free == total; device nodes a subtree holding every lock)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.memory.allocator import TokenAllocator
from kiln.memory.hiradix_cache import WRITE_POLICIES, HiRadixCache
from kiln.memory.host_pool import HostKVPool
from kiln.memory.kv_pool import KVPool


def row_of(prefix: tuple[int, ...]) -> float:
    """The KV a model would compute for the last token of this prefix: depends on the whole prefix."""
    return float(hash(prefix) % 100_003)


class Harness:
    def __init__(self, policy: str, page: int = 1, device_tokens: int = 24, host_tokens: int = 48):
        self.pool = KVPool(device_tokens, page, num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
        self.allocator = TokenAllocator(device_tokens, page)
        self.host = HostKVPool(self.pool, host_tokens)
        self.cache = HiRadixCache(self.allocator, self.host, policy)
        self.page = page

    def compute(self, key: list[int]) -> torch.Tensor | None:
        """A request's prefill: match, allocate the rest, write its KV, insert; returns the slots or None."""
        match = self.cache.match_prefix(key)
        self.check_rows(key, match.indices)
        self.cache.lock(match.node)
        cached = match.indices.numel()
        n = len(key) - cached
        pages = -(-n // self.page) * self.page
        if self.allocator.available_size() < pages:
            self.cache.evict(pages - self.allocator.available_size())
        last = int(match.indices[-1]) if cached else -1
        fresh = self.allocator.alloc_extend([cached], [last], [n]) if n else torch.empty(0, dtype=torch.int64)
        self.cache.unlock(match.node)
        if fresh is None:
            return None
        slots = torch.cat([match.indices, fresh])
        for pos in range(match.indices.numel(), len(key)):
            for layer in range(2):
                self.pool.k[layer][slots[pos]] = row_of(tuple(key[: pos + 1]))
                self.pool.v[layer][slots[pos]] = -row_of(tuple(key[: pos + 1]))
        already = self.cache.insert(key, slots)
        end = len(key) // self.page * self.page
        if already > match.indices.numel():
            self.allocator.free(slots[match.indices.numel() : already])
        if len(key) > end:
            self.allocator.free(slots[end:])
        return slots

    def check_rows(self, key: list[int], slots: torch.Tensor) -> None:
        for pos, slot in enumerate(slots.tolist()):
            want = row_of(tuple(key[: pos + 1]))
            for layer in range(2):
                assert self.pool.k[layer][slot, 0, 0].item() == want, f"k of token {pos} of {key}"
                assert self.pool.v[layer][slot, 0, 0].item() == -want

    def check_accounting(self) -> None:
        self.cache.debug_check()
        held = self.cache.total_size()
        assert self.allocator.available_size() + held == self.allocator.size


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_an_evicted_prefix_comes_back_from_the_host_with_its_kv(policy: str) -> None:
    h = Harness(policy)
    key = list(range(100, 116))
    h.compute(key)
    if policy == "write_through_selective":  # backed up on its second hit only
        h.cache.match_prefix(key)
        h.cache.match_prefix(key)
    assert h.cache.evict(16) == 16
    assert h.cache.total_size() == 0 and h.cache.host_cached_tokens() == 16
    h.check_accounting()
    match = h.cache.match_prefix(key)
    assert match.indices.numel() == 16 and h.cache.host_hit_tokens == 16
    h.check_rows(key, match.indices)
    h.check_accounting()


def test_without_a_host_copy_selective_eviction_drops_the_prefix() -> None:
    h = Harness("write_through_selective")
    key = list(range(16))
    h.compute(key)
    h.cache.evict(16)
    assert h.cache.match_prefix(key).indices.numel() == 0 and h.cache.host_hit_tokens == 0
    h.check_accounting()


def test_a_full_host_tier_keeps_the_most_recent_prefixes() -> None:
    h = Harness("write_back", device_tokens=16, host_tokens=16)
    old, new = list(range(0, 12)), list(range(50, 62))
    h.compute(old)
    h.compute(new)  # evicts `old` to the host
    h.cache.evict(16)  # `new` to the host: the host drops `old`, the least recently used
    h.check_accounting()
    assert h.cache.match_prefix(old).indices.numel() == 0
    match = h.cache.match_prefix(new)
    assert match.indices.numel() == 12
    h.check_rows(new, match.indices)


def test_a_locked_prefix_never_leaves_the_device() -> None:
    h = Harness("write_back", device_tokens=16)
    key = list(range(12))
    h.compute(key)
    match = h.cache.match_prefix(key)
    h.cache.lock(match.node)
    assert h.cache.evict(16) == 0
    assert h.compute(list(range(40, 52))) is None  # no room: the locked prefix stays
    h.cache.unlock(match.node)
    h.check_accounting()


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(WRITE_POLICIES),
    page=st.sampled_from([1, 2]),
    program=st.lists(
        st.tuples(st.sampled_from(["compute", "evict", "flush_host"]), st.integers(0, 5), st.integers(1, 12)),
        min_size=1,
        max_size=25,
    ),
)
def test_random_programs_keep_kv_and_accounting(policy: str, page: int, program) -> None:
    """Prompts share prefixes (a few stems, various lengths), so splits, partial hits on either tier, host
    eviction and dropping host subtrees on insert all happen."""
    h = Harness(policy, page=page)
    stems = [[7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [7, 7, 8, 9, 30, 31, 32, 33, 34, 35, 36, 37]]
    for op, which, length in program:
        if op == "compute":
            stem = stems[which % 2]
            h.compute(stem[:length] + [200 + which] * (which % 3))
        elif op == "evict":
            h.cache.evict(length)
        else:
            h.cache._evict_host(length)
        h.check_accounting()
