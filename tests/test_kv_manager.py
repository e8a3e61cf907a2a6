"""KVManager: a request's KV slots from admission to release, with page size 1 and 4, radix cache on and off.

A `Sim` stands in for the scheduler and the model: it writes each computed token's id into a fake KV
"content" array at the slot the table gives it, so every check can verify that the slots a request (or the
prefix cache) holds carry exactly the tokens they claim, and that every page is owned exactly once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.memory.allocator import TokenAllocator
from kiln.memory.prefix_cache import NoPrefixCache
from kiln.memory.radix_cache import RadixCache
from kiln.memory.req_to_token import ReqToTokenPool
from kiln.sampling_params import SamplingParams
from kiln.scheduler.kv import KVManager
from kiln.scheduler.req import Req

pytestmark = pytest.mark.unit

CONFIGS = [(1, True), (1, False), (4, True), (4, False)]
IDS = [f"ps{ps}-{'radix' if radix else 'noradix'}" for ps, radix in CONFIGS]


def aligned(n: int, ps: int) -> int:
    return n // ps * ps


def pages(n: int, ps: int) -> int:
    return -(-n // ps) * ps


class Sim:
    """Drives a KVManager the way the scheduler does and checks ownership and contents after each call."""

    def __init__(self, pool: int = 128, ps: int = 1, radix: bool = True, rows: int = 8, ctx: int = 256):
        self.alloc = TokenAllocator(pool, page_size=ps, debug=True)
        self.table = ReqToTokenPool(rows, ctx)
        cache = RadixCache(self.alloc, ps) if radix else NoPrefixCache(self.alloc, ps)
        self.kv = KVManager(self.alloc, self.table, cache, radix_enabled=radix)
        self.ps, self.radix = ps, radix
        self.content = torch.full(((self.alloc.num_pages + 1) * ps,), -1, dtype=torch.int64)
        self.live: list[Req] = []
        self._n = 0

    def new(self, prompt: list[int], max_new: int = 16) -> Req:
        self._n += 1
        return Req(f"r{self._n}", list(prompt), SamplingParams(max_new_tokens=max_new), None, None)

    def prefill(self, r: Req, n: int | None = None) -> bool:
        """Admit r for its next n tokens (all remaining by default), 'compute' them, cache an unfinished chunk."""
        if not self.start(r, n):
            self.check()
            return False
        self.complete(r)
        return True

    def start(self, r: Req, n: int | None = None) -> bool:
        """Admission and the forward's KV writes (the scheduler checks integrity only after `complete`)."""
        begin = r.kv_len if r.table_idx is not None else self.kv.match(r)
        n = r.seq_len - begin if n is None else n
        if not self.kv.admit(r, n):
            return False
        if r not in self.live:
            self.live.append(r)
        self._write(r, r.kv_len, r.kv_len + r.extend_len)
        return True

    def complete(self, r: Req, check: bool = True) -> None:
        r.kv_len += r.extend_len
        if r.prefill_done:
            r.output_ids.append(1000 + r.seq_len)  # the sampled token
        else:
            self.kv.cache_unfinished(r)
        if check:
            self.check()

    def decode(self, r: Req) -> bool:
        if self.kv.alloc_decode([r]) is None:
            self.check()
            return False
        self._write(r, r.kv_len, r.kv_len + 1)
        r.kv_len += 1
        r.output_ids.append(1000 + r.seq_len)
        self.check()
        return True

    def finish(self, r: Req) -> None:
        self.kv.cache_finished(r)
        self.live.remove(r)
        self.check()

    def release(self, r: Req) -> None:
        self.kv.release(r)
        self.live.remove(r)
        self.check()

    def _write(self, r: Req, a: int, b: int) -> None:
        self.content[self.table.req_to_token[r.table_idx, a:b]] = torch.tensor(r.fill_ids[a:b])

    # ---- checks
    def row(self, r: Req, a: int, b: int) -> torch.Tensor:
        return self.table.req_to_token[r.table_idx, a:b]

    def check(self) -> None:
        rep = self.kv.integrity(self.live)
        assert rep["ok"], rep
        assert rep["free"] + rep["cached"] + rep["in_use"] == rep["total"] == self.alloc.size
        ps = self.ps
        owners: list[torch.Tensor] = [self.alloc.free_page_ids()]
        if isinstance(self.kv.cache, RadixCache):
            self.kv.cache.debug_check()
            for node in self.kv.cache._iter_nodes():
                assert self.content[node.value].tolist() == node.key, "cached slots hold other tokens"
            owners.append(self.kv.cache.cached_slots().div(ps, rounding_mode="floor").unique())
        for r in self.live:
            assert r.table_idx is not None and r.cached_len % ps == 0 and r.cached_len <= r.kv_len
            assert self.content[self.row(r, 0, r.kv_len)].tolist() == r.fill_ids[: r.kv_len], r
            owners.append(self.row(r, r.cached_len, r.kv_len).div(ps, rounding_mode="floor").unique())
        every = torch.cat(owners)
        assert every.numel() == every.unique().numel(), "a page is owned twice"
        assert sorted(every.tolist()) == list(range(1, self.alloc.num_pages + 1)), "a page leaked"
        assert self.table.available_size() == self.table.size - len(self.live)


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_admit_allocates_pages_and_a_row(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    r = s.new(list(range(10)))
    assert s.kv.match(r) == 0
    assert s.prefill(r)
    assert r.table_idx is not None and r.kv_len == 10 and r.cached_len == 0
    assert s.kv.free_tokens() == s.alloc.size - pages(10, ps)
    assert s.kv.integrity(s.live)["in_use"] == pages(10, ps)


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_finished_sequence_is_cached_and_matched(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    a = s.new(list(range(10)))
    s.prefill(a)
    for _ in range(3):
        s.decode(a)
    seq = a.fill_ids[: a.kv_len]  # 13 tokens computed (the last sampled token has no KV yet)
    s.finish(a)
    rep = s.kv.integrity([])
    assert rep["in_use"] == 0 and rep["cached"] == (aligned(13, ps) if radix else 0)
    b = s.new(seq + [77, 78])
    expect = aligned(13, ps) if radix else 0
    assert s.kv.match(b) == expect
    assert s.prefill(b)
    assert b.cached_len == expect and b.kv_len == b.seq_len - 1
    assert s.kv.cache.protected_size() == expect  # locked while b runs
    s.release(b)
    assert s.kv.cache.protected_size() == 0 and s.kv.cache.evictable_size() == expect


@pytest.mark.parametrize("ps", [1, 4])
def test_match_always_leaves_the_last_token_to_compute(ps: int) -> None:
    s = Sim(ps=ps)
    a = s.new(list(range(16)))
    s.prefill(a)
    s.decode(a)
    s.finish(a)  # caches 17 tokens: the prompt and one output
    same = s.new(list(range(16)))
    assert s.kv.match(same) == aligned(15, ps)
    assert s.prefill(same)
    assert same.extend_len == 16 - aligned(15, ps) >= 1
    s.release(same)


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_admit_refused_when_the_pool_is_short_takes_nothing(ps: int, radix: bool) -> None:
    s = Sim(pool=32, ps=ps, radix=radix)
    a = s.new(list(range(20)))
    assert s.prefill(a)
    before = (s.kv.free_tokens(), s.table.available_size())
    b = s.new(list(range(100, 120)))
    assert not s.prefill(b)
    assert b.table_idx is None and b.node is None and b.kv_len == 0
    assert (s.kv.free_tokens(), s.table.available_size()) == before


def test_admit_refused_releases_a_locked_prefix() -> None:
    s = Sim(pool=32, ps=1)
    a = s.new(list(range(12)))
    s.prefill(a)
    s.finish(a)  # 12 cached
    hog = s.new(list(range(100, 116)))
    assert s.prefill(hog)  # 16 private, 4 free
    b = s.new(list(range(12)) + list(range(200, 210)))  # matches 12, needs 10 more
    assert not s.prefill(b)
    assert s.kv.cache.protected_size() == 0 and b.node is None


# ---------------------------------------------------------------- chunks, duplicates, eviction


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_chunked_prefill_publishes_each_chunk(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    prompt = list(range(50))
    r = s.new(prompt)
    for done in (16, 32, 48):
        assert s.prefill(r, 16)
        assert r.kv_len == done and not r.prefill_done
        assert r.cached_len == (done if radix else 0)
        other = s.new(prompt)
        assert s.kv.match(other) == (done if radix else 0)
    assert s.prefill(r)  # the last 2 tokens
    assert r.kv_len == 50 and len(r.output_ids) == 1
    s.finish(r)


@pytest.mark.parametrize("ps", [1, 4])
def test_same_prefix_computed_twice_keeps_one_copy(ps: int) -> None:
    s = Sim(ps=ps)
    prompt = list(range(40))
    a, b = s.new(prompt), s.new(prompt)
    assert s.start(a, 16) and s.start(b, 16)  # one batch computes the same chunk twice
    s.complete(a, check=False)  # b's extend is not counted until it completes too
    s.complete(b)
    assert s.kv.cache.total_size() == 16  # b's duplicate slots went back to the allocator
    assert b.cached_len == 16 and s.kv.free_tokens() == s.alloc.size - 16
    assert s.row(a, 0, 16).tolist() == s.row(b, 0, 16).tolist()
    assert s.prefill(a) and s.prefill(b)
    s.decode(a)
    s.finish(a)
    s.finish(b)  # b's copy of the shared 40 + 1 tokens is freed, its own tail kept only if not duplicate
    assert s.kv.cache.total_size() == aligned(41, ps)


def three_cached(ps: int) -> tuple[Sim, list[list[int]]]:
    """A 64-token pool whose cache holds three 16-token sequences, the first the least recently used."""
    s = Sim(pool=64, ps=ps)
    seqs = [[k * 100 + i for i in range(16)] for k in range(3)]
    for seq in seqs:
        r = s.new(seq)
        s.prefill(r)
        s.finish(r)
    assert s.kv.cache.total_size() == aligned(16, ps) * 3
    return s, seqs


@pytest.mark.parametrize("ps", [1, 4])
def test_admission_evicts_least_recently_used(ps: int) -> None:
    s, seqs = three_cached(ps)
    assert s.kv.match(s.new(seqs[0] + [5])) == aligned(16, ps)  # a lookup: it refreshes nothing
    touch = s.new(seqs[0] + [5])  # admitting a request refreshes sequence 0
    s.prefill(touch)
    s.finish(touch)
    big = s.new(list(range(900, 930)))
    assert s.prefill(big)  # needs evictions
    assert s.kv.match(s.new(seqs[0] + [5])) == aligned(16, ps), "the most recently used entry was evicted"
    assert s.kv.match(s.new(seqs[1] + [5])) == 0


@pytest.mark.parametrize("ps", [1, 4])
def test_a_lookup_neither_refreshes_nor_splits(ps: int) -> None:
    """Sorting the queue looks prefixes up (KVManager.match): the oldest entry stays the first evicted, and a
    lookup that ends inside a node leaves it whole."""
    s, seqs = three_cached(ps)
    nodes = len(list(s.kv.cache._iter_nodes()))
    assert s.kv.match(s.new(seqs[0] + [5])) == aligned(16, ps)
    assert s.kv.match(s.new(seqs[0][:8] + [1] * 8)) == 8 and len(list(s.kv.cache._iter_nodes())) == nodes
    assert s.prefill(s.new(list(range(900, 930))))  # needs evictions: the least recently used goes first
    assert s.kv.match(s.new(seqs[0] + [5])) == 0 and s.kv.match(s.new(seqs[2] + [5])) == aligned(16, ps)


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_decode_allocates_a_page_only_at_a_boundary(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    r = s.new(list(range(5)))
    s.prefill(r)
    free = []
    for _ in range(8):
        free.append(s.kv.free_tokens())
        assert s.decode(r)
    taken = [a - b for a, b in zip(free, free[1:] + [s.kv.free_tokens()])]
    assert taken == [ps if (5 + k) % ps == 0 else 0 for k in range(8)]
    assert s.kv.decode_fits(1)
    s.release(r)


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_release_frees_private_slots_and_keeps_the_cache(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    a = s.new(list(range(20)))
    s.prefill(a)
    s.finish(a)
    b = s.new(list(range(20)) + list(range(50, 60)))
    s.prefill(b)
    s.decode(b)
    cached = s.kv.cache.total_size()
    s.release(b)  # retraction or abort: nothing of b is cached
    assert s.kv.cache.total_size() == cached
    assert s.kv.free_tokens() + cached == s.alloc.size
    s.kv.release(b)  # a second release is a no-op
    s.check()


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
def test_flush_returns_everything(ps: int, radix: bool) -> None:
    s = Sim(ps=ps, radix=radix)
    for k in range(4):
        r = s.new([k] * 9 + list(range(10)))
        s.prefill(r)
        s.decode(r)
        s.finish(r)
    s.kv.flush()
    assert s.kv.free_tokens() == s.alloc.size
    s.check()


# ---------------------------------------------------------------- random sequences


OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "chunk", "prefill", "decode", "finish", "release"]), st.integers(0, 99)
    ),
    min_size=1,
    max_size=60,
)


@pytest.mark.parametrize("ps,radix", CONFIGS, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_random_lifecycles_keep_ownership_exact(ps: int, radix: bool, ops: list[tuple[str, int]]) -> None:
    """Random admit/chunk/decode/finish/release interleavings over prompts that share prefixes."""
    s = Sim(pool=96, ps=ps, radix=radix, rows=4)
    waiting: list[Req] = []
    for op, x in ops:
        if op == "new":
            base = [7, 7, 3, 9, 1, 4, 4, 8][: x % 9]  # shared prefixes of different lengths
            waiting.append(s.new(base + [x % 5] * (1 + x % 13)))
        elif op in ("chunk", "prefill") and (waiting or s.live):
            cands = [r for r in s.live if not r.prefill_done] + waiting
            r = cands[x % len(cands)]
            n = None if op == "prefill" else 1 + x % 8
            if n is not None:
                left = r.seq_len - (r.kv_len if r.table_idx is not None else s.kv.match(r))
                n = min(max(1, n // ps) * ps, left)  # the scheduler cuts chunks at page boundaries
            if s.prefill(r, n) and r in waiting:
                waiting.remove(r)
        elif op == "decode":
            running = [r for r in s.live if r.prefill_done]
            if running:
                s.decode(running[x % len(running)])
        elif s.live:
            r = s.live[x % len(s.live)]
            if op == "finish" and r.prefill_done:
                s.finish(r)
            elif op == "release":
                s.release(r)
                waiting.append(r)
    for r in list(s.live):
        s.release(r)
    assert s.kv.integrity([])["in_use"] == 0
    assert s.kv.free_tokens() + s.kv.cache.total_size() == s.alloc.size
