"""Kiln's CPU decode attention kernel, read straight from the KV pool: it matches the gather + SDPA path for
grouped heads, padded rows and ragged lengths, and with a common prefix (`shared`) it gives bit-identical
results to the per-request walk over the same table while reading the prefix once per chunk of requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers.cpu_gemm import cpu_decode_attention, has_cpu_decode_attention
from kiln.memory.kv_pool import KVPool
from kiln.runner.attention import CpuKernelBackend, TorchSdpaBackend, common_prefix, make_attention_backend

pytestmark = pytest.mark.unit

HQ, HK, D = 9, 3, 64
POOL = KVPool(4096, 1, 1, HK, D, torch.float32)
if not has_cpu_decode_attention(POOL.k[0]):
    pytest.skip("Kiln's CPU kernels are not built on this host", allow_module_level=True)


def _table(prefix: int, tails: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] slots: a common prefix (scattered slots) then each request's own tail, padded with slot 0."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(POOL.k[0].shape[0] - 1, generator=g) + 1
    common, own = perm[:prefix], perm[prefix:]
    longest = prefix + max(tails)
    table = torch.zeros(len(tails), longest, dtype=torch.long)
    mask = torch.zeros(len(tails), longest, dtype=torch.bool)
    start = 0
    for b, n in enumerate(tails):
        table[b, :prefix] = common
        table[b, prefix : prefix + n] = own[start : start + n]
        mask[b, : prefix + n] = True
        start += n
    return table, mask


def _reference(q, table, mask, scale):
    k, v = POOL.gather(0, table)  # [B, L, Hk, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.view(len(q), 1, 1, -1), scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out.squeeze(2)


@pytest.fixture(autouse=True)
def _filled_pool():
    torch.manual_seed(0)
    POOL.k[0].normal_()
    POOL.v[0].normal_()


@pytest.mark.parametrize("prefix, tails", [(0, [5]), (0, [1, 17, 3]), (24, [1, 9, 30]), (13, [4] * 11)])
def test_kernel_matches_gather_and_sdpa(prefix, tails):
    table, mask = _table(prefix, tails)
    q = torch.randn(len(tails), HQ, D)
    got = cpu_decode_attention()(q, POOL.k[0], POOL.v[0], table, mask, 0.125)
    torch.testing.assert_close(got, _reference(q, table, mask, 0.125), rtol=1e-5, atol=1e-5)


def test_sinks_match_the_torch_path():
    """A sink logit per query head (GPT-OSS) joins every row's softmax and takes its share from the slots: the
    kernel gives the torch path's output (kiln.runner.attention.windowed.attend), and a large sink shrinks it."""
    from kiln.layers.cpu_gemm import cpu_decode_attention_sinks
    from kiln.runner.attention.windowed import attend

    table, mask = _table(0, [1, 17, 3, 40])
    q = torch.randn(len(table), HQ, D)
    sinks = torch.randn(HQ) * 2
    got = cpu_decode_attention_sinks(q, POOL.k[0], POOL.v[0], table, mask, 0.125, sinks)
    k, v = POOL.gather(0, table)
    want = attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], 0.125, None, sinks)
    torch.testing.assert_close(got, want.squeeze(2), rtol=1e-5, atol=1e-5)
    plain = cpu_decode_attention()(q, POOL.k[0], POOL.v[0], table, mask, 0.125)
    assert not torch.allclose(got, plain, atol=1e-3)
    muted = cpu_decode_attention_sinks(q, POOL.k[0], POOL.v[0], table, mask, 0.125, torch.full((HQ,), 60.0))
    assert muted.abs().max() < 1e-6 * plain.abs().max()


@pytest.mark.parametrize("batch", [2, 8, 9, 19])  # one chunk of 8 requests, exactly one, and ragged chunks
def test_shared_prefix_is_bit_identical_to_the_per_request_walk(batch):
    table, mask = _table(104, [1 + (7 * b) % 23 for b in range(batch)], seed=batch)
    q = torch.randn(batch, HQ, D)
    kernel = cpu_decode_attention()
    plain = kernel(q, POOL.k[0], POOL.v[0], table, mask, 0.125)
    shared = kernel(q, POOL.k[0], POOL.v[0], table, mask, 0.125, 104)
    assert torch.equal(shared, plain)
    torch.testing.assert_close(shared, _reference(q, table, mask, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 20])  # head sizes that are and are not a multiple of 8
def test_a_row_decodes_to_the_same_bits_whatever_the_batch(kv_dtype, d):
    """A request's row alone (13 slots: a partial last tile), in a batch whose longest row is 37 slots wide, and as
    one of the rows of a verify step sharing its prefix: bit-identical every time. Speculative decoding's greedy
    identity rests on it: a verify row must be computed as plain decoding computes that token."""
    pool = KVPool(512, 1, 1, HK, d, kv_dtype)
    torch.manual_seed(1)
    pool.k[0].copy_(torch.randn(pool.k[0].shape)), pool.v[0].copy_(torch.randn(pool.v[0].shape))
    slots = torch.randperm(511, generator=torch.Generator().manual_seed(2)) + 1
    q = torch.randn(3, HQ, d)
    kernel = cpu_decode_attention()
    alone = kernel(
        q[:1], pool.k[0], pool.v[0], slots[:13].view(1, 13), torch.empty(0, dtype=torch.bool), 0.125
    )
    wide = torch.zeros(3, 37, dtype=torch.long)
    wide[0, :13], wide[1, :37], wide[2, :5] = slots[:13], slots[13:50], slots[50:55]
    mask = torch.arange(37).unsqueeze(0) < torch.tensor([13, 37, 5]).unsqueeze(1)
    batched = kernel(q, pool.k[0], pool.v[0], wide, mask, 0.125)
    assert torch.equal(batched[:1], alone)
    # verify rows: the same request's prefix of 8 then 13, 14 and 15 slots, the first row the one above
    verify = torch.zeros(3, 15, dtype=torch.long)
    verify[:, :15] = torch.cat([slots[:13], slots[60:62]])
    rows_mask = torch.arange(15).unsqueeze(0) < torch.tensor([13, 14, 15]).unsqueeze(1)
    shared = kernel(q[[0, 0, 0]], pool.k[0], pool.v[0], verify, rows_mask, 0.125, 8)
    assert torch.equal(shared[:1], alone)


@pytest.mark.parametrize("hq, hk, d", [(8, 2, 48), (4, 4, 32), (10, 2, 64)])
def test_other_head_layouts_take_the_same_paths(hq, hk, d):
    """Groups of 4 and 5 query heads (three at a time, then one by one), one head per group, head sizes that are
    not a multiple of 32 (V rows one head at a time): against SDPA, and the shared walk bit-identical."""
    pool = KVPool(512, 1, 1, hk, d, torch.float32)
    pool.k[0].normal_(), pool.v[0].normal_()
    g = torch.Generator().manual_seed(hq)
    slots = torch.randperm(511, generator=g) + 1
    table = torch.cat([slots[:40].expand(10, 40), slots[40:140].view(10, 10)], 1)
    mask = torch.ones_like(table, dtype=torch.bool)
    mask[3, 45:] = False
    q = torch.randn(10, hq, d)
    plain = cpu_decode_attention()(q, pool.k[0], pool.v[0], table, mask, 0.2)
    assert torch.equal(cpu_decode_attention()(q, pool.k[0], pool.v[0], table, mask, 0.2, 40), plain)
    k, v = pool.gather(0, table)
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.view(10, 1, 1, -1), scale=0.2,
        enable_gqa=True,
    ).squeeze(2)  # fmt: skip
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-5)


def test_a_row_without_valid_slots_gives_zeros():
    """A padding row of a compiled batch: every slot masked, even inside a shared prefix's chunk."""
    table, mask = _table(16, [3, 5])
    mask[1] = False
    q = torch.randn(2, HQ, D)
    out = cpu_decode_attention()(q, POOL.k[0], POOL.v[0], table, mask, 0.125)
    assert torch.equal(out[1], torch.zeros(HQ, D))
    torch.testing.assert_close(out[0], _reference(q[:1], table[:1], mask[:1], 0.125)[0], rtol=1e-5, atol=1e-5)


def test_shared_must_be_whole_tiles():
    table, mask = _table(20, [3, 3])
    with pytest.raises(RuntimeError, match="shared % 8"):
        cpu_decode_attention()(torch.randn(2, HQ, D), POOL.k[0], POOL.v[0], table, mask, 0.125, 20)


def _decode_batch(table, mask, out_cache_loc: torch.Tensor) -> ForwardBatch:
    b, longest = table.shape
    zeros = torch.zeros(b, dtype=torch.long)
    return ForwardBatch(
        ForwardMode.DECODE, zeros, zeros, out_cache_loc, None, kv_table=table, kv_mask=mask.view(b, 1, 1, -1)
    )


@pytest.mark.parametrize(
    "prefix, tails, want",
    [(83, [2, 5, 1], 80), (83, [4], 0), (0, [3, 3], 0), (7, [3, 3], 0), (40, [0, 6], 40)],
)
def testcommon_prefix_counts_whole_tiles_of_shared_valid_slots(prefix, tails, want):
    table, mask = _table(prefix, tails)
    assert common_prefix(table, mask) == want


def test_the_kernel_backend_is_chosen_for_float32_on_the_cpu_and_declares_it():
    assert isinstance(make_attention_backend(POOL, HQ, torch.float32), CpuKernelBackend)
    assert type(make_attention_backend(POOL, HQ, torch.bfloat16)) is TorchSdpaBackend  # bfloat16 queries
    assert CpuKernelBackend.reads_shared_prefix_once and CpuKernelBackend.runs_short_extends
    assert not (TorchSdpaBackend.reads_shared_prefix_once or TorchSdpaBackend.runs_short_extends)


def test_backend_decodes_a_shared_prefix_batch_through_the_kernel():
    table, mask = _table(96, [3, 8, 1, 5])
    b = len(table)
    loc = torch.tensor([int(table[i, 96 + n - 1]) for i, n in enumerate([3, 8, 1, 5])])
    q, k, v = torch.randn(b, HQ, D), torch.randn(b, HK, D), torch.randn(b, HK, D)
    backend = CpuKernelBackend(POOL, HQ)
    fb = _decode_batch(table, mask, loc)
    fb = replace(fb, attn=backend.prepare_metadata(fb))
    got = backend.forward(0, q, k, v, fb, 0.125).view(b, HQ, D)
    assert fb.attn.shared_prefix == 96 and fb.attn.distinct is None  # the kernel, not the distinct-slot SDPA
    torch.testing.assert_close(got, _reference(q, table, mask, 0.125), rtol=1e-5, atol=1e-5)


def test_short_extends_on_a_cached_prefix_run_through_the_kernel_like_sdpa():
    """Questions after a shared system prompt (short extends on one cached prefix), beside a fresh prompt and a
    long extend: the short ones go through the kernel as one row per token, causal within the extend."""
    gen = torch.Generator().manual_seed(3)
    perm = (torch.randperm(POOL.k[0].shape[0] - 1, generator=gen) + 1).tolist()
    system, rest = perm[:90], perm[90:]
    specs = [(90, 5), (90, 1), (0, 12), (90, 70), (90, 9)]  # (cached prefix, extend)
    seq_slots, lens, prefixes = [], [], []
    for pre, ext in specs:
        own, rest = rest[:ext], rest[ext:]
        seq_slots.append(torch.tensor((system[:pre] if pre else []) + own))
        lens.append(ext)
        prefixes.append(pre)
    total = sum(lens)

    def batch() -> ForwardBatch:
        return ForwardBatch(
            ForwardMode.EXTEND, torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.long),
            torch.cat([s[p:] for s, p in zip(seq_slots, prefixes)]), None, extend_lens=lens, prefix_lens=prefixes,
            seq_slots=seq_slots,
        )  # fmt: skip

    q, k, v = torch.randn(total, HQ, D), torch.randn(total, HK, D), torch.randn(total, HK, D)
    with_kernel, plain = CpuKernelBackend(POOL, HQ), TorchSdpaBackend(POOL, HQ)
    fb = replace(batch(), attn=with_kernel.prepare_metadata(batch()))
    got = with_kernel.forward(0, q, k, v, fb, 0.125)
    short = fb.attn.short_extends
    assert short.picked == (0, 1, 4) and short.rows.numel() == 5 + 1 + 9 and short.shared_prefix == 88
    want = plain.forward(0, q, k, v, replace(batch(), attn=plain.prepare_metadata(batch())), 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
