"""The torch attention backend: fresh prompts batched into one padded causal SDPA call give the same rows as
one call per prompt, with a cached-prefix request mixed in between."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kiln.core.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from kiln.memory.kv_pool import KVPool
from kiln.runner.attention import TorchSdpaBackend, torch_sdpa
from kiln.runner.graph_backends import CUDA_SHARED_GATHER_LIMIT, CompiledDecode, CudaGraphDecode
from kiln.runner.graph_runner import shared_kv_runs_eagerly

pytestmark = pytest.mark.unit

HQ, HK, D = 6, 2, 16


def _prepared(backend: TorchSdpaBackend, fb: ForwardBatch) -> ForwardBatch:
    """The batch as the model runner hands it to the model: with its attention metadata."""
    return replace(fb, attn=backend.prepare_metadata(fb))


def _batch(pool: KVPool, lens: list[int], prefixes: list[int]) -> ForwardBatch:
    slots, loc, next_slot = [], [], 1
    for ext, pre in zip(lens, prefixes):
        s = torch.arange(next_slot, next_slot + pre + ext)
        next_slot += pre + ext
        slots.append(s)
        loc.append(s[pre:])
    total = sum(lens)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(total, dtype=torch.long),
        positions=torch.zeros(total, dtype=torch.long),
        out_cache_loc=torch.cat(loc),
        logits_index=torch.zeros(len(lens), dtype=torch.long),
        extend_lens=lens,
        prefix_lens=prefixes,
        seq_slots=slots,
    )


def test_fresh_prompts_batched_match_one_call_each(monkeypatch):
    torch.manual_seed(0)
    pool = KVPool(256, 1, 1, HK, D, torch.float32)
    pool.k[0].normal_()
    pool.v[0].normal_()
    lens, prefixes = [5, 6, 3, 6, 7], [0, 0, 9, 0, 0]  # fresh: 24 tokens, padded 4 x 7 = 28 (<= 1.25x)
    fb = _batch(pool, lens, prefixes)
    q, k, v = torch.randn(sum(lens), HQ, D), torch.randn(sum(lens), HK, D), torch.randn(sum(lens), HK, D)
    backend = TorchSdpaBackend(pool, HQ)
    calls = []
    real = TorchSdpaBackend._fresh_together
    monkeypatch.setattr(
        TorchSdpaBackend, "_fresh_together", staticmethod(lambda *a: calls.append(a) or real(*a))
    )
    got = backend.forward(0, q, k, v, _prepared(backend, fb), D**-0.5)
    assert len(calls) == 1, "the four fresh prompts were not batched"
    start, want = 0, []
    for ext, pre, slots in zip(lens, prefixes, fb.seq_slots):
        s = slice(start, start + ext)
        want.append(backend._one(0, q[s], k[s], v[s], pre, slots, D**-0.5))
        start += ext
    torch.testing.assert_close(got, torch.cat(want).reshape(sum(lens), -1), rtol=1e-5, atol=1e-6)


def test_padding_beyond_the_cap_runs_one_call_each(monkeypatch):
    pool = KVPool(64, 1, 1, HK, D, torch.float32)
    lens = [1, 20]  # padded 2 x 20 = 40 > 1.25 x 21
    fb = _batch(pool, lens, [0, 0])
    n = sum(lens)
    called = []
    monkeypatch.setattr(TorchSdpaBackend, "_fresh_together", staticmethod(lambda *a: called.append(a)))
    backend = TorchSdpaBackend(pool, HQ)
    backend.forward(
        0, torch.randn(n, HQ, D), torch.randn(n, HK, D), torch.randn(n, HK, D), _prepared(backend, fb), 1.0
    )
    assert not called and torch_sdpa.MAX_PAD_FACTOR == 1.25


def _decode_batch(tables: list[list[int]]) -> ForwardBatch:
    b, longest = len(tables), max(map(len, tables))
    kv_table = torch.zeros(b, longest, dtype=torch.long)
    for i, t in enumerate(tables):
        kv_table[i, : len(t)] = torch.tensor(t)
    lens = torch.tensor([len(t) for t in tables])
    valid = torch.arange(longest).unsqueeze(0) < lens.unsqueeze(1)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(b, dtype=torch.long),
        positions=lens - 1,
        out_cache_loc=torch.tensor([t[-1] for t in tables]),
        logits_index=torch.arange(b),
        kv_table=kv_table,
        kv_mask=None if bool(valid.all()) else valid.view(b, 1, 1, longest),
    )


def _decode_both_ways(tables: list[list[int]]):
    torch.manual_seed(1)
    pool = KVPool(512, 1, 1, HK, D, torch.float32)
    pool.k[0].normal_()
    pool.v[0].normal_()
    b = len(tables)
    q, k, v = torch.randn(b, HQ, D), torch.randn(b, HK, D), torch.randn(b, HK, D)
    backend = TorchSdpaBackend(
        pool, HQ
    )  # the SDPA paths every device has (the CPU kernel: test_cpu_attention.py)
    fb = _prepared(backend, _decode_batch(tables))
    got = backend.forward(0, q, k, v, fb, D**-0.5)
    plain = replace(
        _decode_batch(tables), attn=AttentionMetadata()
    )  # no distinct slots: the per-request gather
    want = backend.forward(0, q, k, v, plain, D**-0.5)
    return fb, got, want


def test_decode_over_a_shared_prefix_reads_it_once_and_matches_the_gather():
    prefix = list(range(10, 90))
    tails = [list(range(200 + 10 * i, 200 + 10 * i + n)) for i, n in enumerate([1, 4, 9, 2, 7])]
    fb, got, want = _decode_both_ways([prefix + t for t in tails])
    slots, mask = fb.attn.distinct.slots, fb.attn.distinct.mask
    assert slots.numel() == 80 + 23 + 1  # the prefix once, every tail, and the padding slot
    assert mask.shape == (1, 1, 5 * (HQ // HK), slots.numel())
    assert fb.attn.mostly_shared  # a captured step that gathers each request's rows would lose to this
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_mostly_shared_batch_replays_on_cuda_until_the_rows_it_gathers_again_pass_the_limit():
    """The CPU's compiled steps leave every mostly shared batch to the eager distinct-slot call; a CUDA graph
    replays it (a draft's catch-up rows share their request's context) until its repeated gather is dear."""
    prefix = list(range(10, 90))
    tails = [list(range(200 + 10 * i, 200 + 10 * i + n)) for i, n in enumerate([1, 4, 9, 2, 7])]
    fb, _, _ = _decode_both_ways([prefix + t for t in tails])
    assert fb.attn.repeated_entries == 5 * 80 + 23 - (80 + 23 + 1)  # entries less the distinct slots
    token = 2 * 32 * 8 * 128 * 2  # an 8B-class model's KV a token (128 KiB): 319 tokens again = 40 MiB
    compiled, cuda = (
        SimpleNamespace(reads_shared_prefix_once=False, shared_gather_limit=backend.shared_gather_limit)
        for backend in (CompiledDecode, CudaGraphDecode)
    )
    assert shared_kv_runs_eagerly(fb, compiled, token)
    assert not shared_kv_runs_eagerly(fb, cuda, token)
    dear = replace(fb, attn=replace(fb.attn, repeated_entries=CUDA_SHARED_GATHER_LIMIT // token + 1))
    assert shared_kv_runs_eagerly(dear, cuda, token)
    reads_once = SimpleNamespace(
        reads_shared_prefix_once=True, shared_gather_limit=0
    )  # the CPU kernel's steps
    assert not shared_kv_runs_eagerly(dear, reads_once, token)
    unshared = replace(dear, attn=replace(dear.attn, mostly_shared=False))
    assert not shared_kv_runs_eagerly(unshared, compiled, token)


def test_decode_without_sharing_keeps_the_gather():
    fb, got, want = _decode_both_ways([list(range(1 + 50 * i, 1 + 50 * i + 40)) for i in range(6)])
    assert fb.attn.distinct is None and not fb.attn.mostly_shared  # 240 distinct slots > 4 x 40
    torch.testing.assert_close(got, want)
