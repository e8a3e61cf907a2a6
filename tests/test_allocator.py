"""TokenAllocator and ReqToTokenPool: round trips, page filling, page 0 reserved, no double hand-out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.memory.allocator import TokenAllocator
from kiln.memory.req_to_token import ReqToTokenPool

pytestmark = pytest.mark.unit


def _check_layout(slots: list[int], page_size: int) -> None:
    """Token i sits at offset i % page_size of its page, and tokens of one page share it."""
    for i, s in enumerate(slots):
        assert s // page_size >= 1, "dummy page handed out"
        assert s % page_size == i % page_size
        if i % page_size:
            assert s == slots[i - 1] + 1


def test_sizes_round_down_to_pages() -> None:
    a = TokenAllocator(70, page_size=16)
    assert (a.size, a.page_size, a.available_size()) == (64, 16, 64)
    assert TokenAllocator(3, page_size=4).size == 0


def test_alloc_free_round_trip_page1() -> None:
    a = TokenAllocator(10, debug=True)
    x = a.alloc(4)
    assert x is not None and x.dtype == torch.int64 and x.numel() == 4
    assert 0 not in x.tolist()
    y = a.alloc(6)
    assert y is not None and a.available_size() == 0
    assert sorted(x.tolist() + y.tolist()) == list(range(1, 11))
    assert a.alloc(1) is None
    a.free(x)
    assert a.available_size() == 4
    z = a.alloc(4)
    assert z is not None and sorted(z.tolist()) == sorted(x.tolist())
    a.free(y)
    a.free(z)
    assert a.available_size() == 10
    assert sorted(a.free_page_ids().tolist()) == list(range(1, 11))


def test_alloc_asserts_page1() -> None:
    with pytest.raises(AssertionError):
        TokenAllocator(16, page_size=4).alloc(2)


def test_none_leaves_state_unchanged() -> None:
    for ps in (1, 4, 16):
        a = TokenAllocator(4 * ps, page_size=ps, debug=True)
        first = a.alloc_extend([0], [-1], [3 * ps])
        assert first is not None
        before = (a.available_size(), sorted(a.free_page_ids().tolist()))
        assert a.alloc_extend([0, 0], [-1, -1], [ps, 1]) is None
        assert a.alloc_decode([0, 0], [-1, -1]) is None
        if ps == 1:
            assert a.alloc(2) is None
        assert (a.available_size(), sorted(a.free_page_ids().tolist())) == before
        # exactly one page left: usable
        assert a.alloc_extend([0], [-1], [ps]) is not None and a.available_size() == 0


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_alloc_extend_fills_partial_pages_first(ps: int) -> None:
    a = TokenAllocator(64 * ps, page_size=ps, debug=True)
    seqs: list[list[int]] = [[], [], []]
    plans = [[1, 2 * ps + 1, ps - 1], [ps + 3, 1, 2], [0, ps, 5]]
    for step in range(3):
        ext = [plans[j][step] for j in range(3)]
        pre = [len(s) for s in seqs]
        last = [s[-1] if s else -1 for s in seqs]
        pages_before = a.available_size() // ps
        out = a.alloc_extend(pre, last, ext)
        assert out is not None and out.dtype == torch.int64 and out.numel() == sum(ext)
        expect_pages = sum(-(-(p + e) // ps) - (-(-p // ps)) for p, e in zip(pre, ext))
        assert pages_before - a.available_size() // ps == expect_pages
        parts = out.split(ext)
        for s, part in zip(seqs, parts):
            s.extend(part.tolist())
    for s in seqs:
        _check_layout(s, ps)
    all_slots = [x for s in seqs for x in s]
    assert len(set(all_slots)) == len(all_slots)
    pages_per_seq = [{x // ps for x in s} for s in seqs]
    assert not (pages_per_seq[0] & pages_per_seq[1]) and not (pages_per_seq[1] & pages_per_seq[2])


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_alloc_decode_grows_sequences(ps: int) -> None:
    a = TokenAllocator(40 * ps, page_size=ps, debug=True)
    seqs: list[list[int]] = [[], [7], []]
    first = a.alloc_extend([0, 0], [-1, -1], [3, 1])
    assert first is not None
    seqs = [first[:3].tolist(), first[3:].tolist(), []]
    for _ in range(2 * ps + 3):
        out = a.alloc_decode([len(s) for s in seqs], [s[-1] if s else -1 for s in seqs])
        assert out is not None and out.numel() == 3
        for s, x in zip(seqs, out.tolist()):
            s.append(x)
    for s in seqs:
        _check_layout(s, ps)
    used_pages = sum(-(-len(s) // ps) for s in seqs)
    assert a.available_size() == a.size - used_pages * ps
    all_slots = [x for s in seqs for x in s]
    assert len(set(all_slots)) == len(all_slots)
    for s in seqs:
        a.free(torch.tensor(s))
    assert a.available_size() == a.size


def test_free_unique_pages_and_double_free_detected() -> None:
    a = TokenAllocator(32, page_size=4, debug=True)
    out = a.alloc_extend([0], [-1], [6])
    assert out is not None and a.available_size() == 24
    a.free(out)  # two pages, one of them partial
    assert a.available_size() == 32
    with pytest.raises(AssertionError):
        a.free(out)


def test_free_does_not_alias_caller_tensor() -> None:
    a = TokenAllocator(8)
    row = torch.zeros(8, dtype=torch.int64)
    got = a.alloc(3)
    assert got is not None
    row[:3] = got
    a.free(row[:3])
    row[:3] = 0  # caller reuses its table row
    assert 0 not in a.free_page_ids().tolist()
    assert sorted(a.free_page_ids().tolist()) == list(range(1, 9))


def test_reset() -> None:
    a = TokenAllocator(16, page_size=4)
    assert a.alloc_extend([0], [-1], [9]) is not None
    a.reset()
    assert a.available_size() == 16


@settings(max_examples=150, deadline=None, database=None)
@given(
    ps=st.sampled_from([1, 4, 16]),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 20)), max_size=40),
)
def test_random_ops_never_hand_out_a_slot_twice(ps: int, ops: list[tuple[int, int, int]]) -> None:
    a = TokenAllocator(12 * ps, page_size=ps, debug=True)
    seqs: list[list[int]] = [[] for _ in range(4)]
    for j, kind, n in ops:
        s = seqs[j]
        if kind == 0:
            out = a.alloc_extend([len(s)], [s[-1] if s else -1], [n])
        elif kind == 1:
            out = a.alloc_decode([len(s)], [s[-1] if s else -1])
        else:
            a.free(torch.tensor(s, dtype=torch.int64))
            seqs[j] = []
            out = None
        if out is not None:
            s.extend(out.tolist())
        held = [x for q in seqs for x in q]
        assert len(set(held)) == len(held)
        pages_held = {x // ps for x in held}
        free = a.free_page_ids().tolist()
        assert len(set(free)) == len(free) and not (set(free) & pages_held)
        assert len(free) + len(pages_held) == a.num_pages == a.size // ps
        assert a.available_size() == len(free) * ps
        for q in seqs:
            _check_layout(q, ps)


def test_req_to_token_pool() -> None:
    p = ReqToTokenPool(3, 16)
    assert p.req_to_token.shape == (3, 16) and p.req_to_token.dtype == torch.int64
    got = [p.alloc(), p.alloc(), p.alloc()]
    assert sorted(got) == [0, 1, 2] and p.alloc() is None and p.available_size() == 0
    p.free(1)
    assert p.available_size() == 1 and p.alloc() == 1
    with pytest.raises(ValueError):
        p.free(5)
    p.free(0)
    with pytest.raises(ValueError):
        p.free(0)
    p.reset()
    assert p.available_size() == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ps", [1, 16])
def test_allocator_and_radix_cache_on_cuda(ps: int) -> None:
    from kiln.memory.radix_cache import RadixCache

    a = TokenAllocator(64 * ps, page_size=ps, device="cuda", debug=True)
    cache = RadixCache(a)
    out = a.alloc_extend([0, 0], [-1, -1], [ps + 3, 2])
    assert out is not None and out.device.type == "cuda" and out.dtype == torch.int64
    first, second = out.split([ps + 3, 2])
    _check_layout(first.tolist(), ps)
    dec = a.alloc_decode([ps + 3, 2], [int(first[-1]), int(second[-1])])
    assert dec is not None and dec.device.type == "cuda"
    seq = torch.cat([first, dec[:1]])
    _check_layout(seq.tolist(), ps)
    key = list(range(seq.numel()))
    assert cache.insert(key, seq) == 0
    aligned = len(key) // ps * ps
    a.free(seq[aligned:])
    m = cache.acquire_prefix(key)
    assert m.indices.device.type == "cuda" and m.indices.tolist() == seq[:aligned].tolist()
    a.free(torch.cat([second, dec[1:]]))
    cache.debug_check()
    assert cache.evict(10**6) == aligned and a.available_size() == a.size
