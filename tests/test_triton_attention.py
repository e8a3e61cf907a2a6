"""Kiln's Triton attention kernels (kiln.layers.triton_attention) against torch's attention on the same pool: decode
split-K over KV tables with padding, GQA and every split count, extend over cached prefixes and fresh prompts in
one launch, and a model served with --attention-backend triton giving transformers' greedy tokens. Without a GPU
the kernels run in Triton's interpreter; on CUDA the same tests run them compiled."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.engine

triton_attention = pytest.importorskip("kiln.layers.triton_attention")
extend_plan = triton_attention.extend_plan
if not triton_attention.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_decode(q, k_cache, v_cache, table, mask, scale):
    """Each row's attention over its valid slots, with torch's SDPA."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        slots = table[b][mask[b]] if mask is not None else table[b]
        k = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        v = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=scale)
        out[b] = o.squeeze(1).to(q.dtype)
    return out


def pool(slots: int, heads: int, dim: int, dtype=torch.float32):
    torch.manual_seed(1)
    k = torch.randn(slots, heads, dim, device=DEVICE).to(dtype)
    v = torch.randn(slots, heads, dim, device=DEVICE).to(dtype)
    return k, v


@pytest.mark.parametrize("ends", [False, True], ids=["chunks-of-the-width", "chunks-of-the-row"])
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 16), (8, 2, 64), (6, 2, 20)])
@pytest.mark.unit
def test_decode_matches_torch_attention(splits, hq, hk, dim, ends):
    """Rows of 1 to 90 slots in a table 40 columns wider than the longest (a captured step's table is as wide as
    its graph), cut into chunks of the table's width or, given the rows' ends, of each row's own slots."""
    k_cache, v_cache = pool(300, hk, dim)
    lens = [1, 37, 90, 5]
    width = max(lens) + 40
    gen = torch.Generator().manual_seed(0)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    mask = torch.zeros(len(lens), width, dtype=torch.bool)
    for b, n in enumerate(lens):
        table[b, :n] = torch.randperm(299, generator=gen)[:n] + 1  # slot 0 is padding's
        mask[b, :n] = True
    table, mask = table.to(DEVICE), mask.to(DEVICE)
    q = torch.randn(len(lens), hq, dim, device=DEVICE)
    scale = dim**-0.5
    row_ends = triton_attention.row_ends(mask) if ends else None
    if ends:
        assert row_ends.tolist() == lens
    got = triton_attention.decode_attention(q, k_cache, v_cache, table, mask, scale, splits, ends=row_ends)
    torch.testing.assert_close(
        got, reference_decode(q, k_cache, v_cache, table, mask, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.unit
def test_decode_mask_holes_and_no_mask():
    """A mask that is not a prefix (a verify row's table skips a sibling's slots; another row's last columns
    unused), with and without the rows' ends, and a table without a mask."""
    k_cache, v_cache = pool(64, 2, 16)
    table = torch.arange(1, 41, device=DEVICE).view(2, 20)
    mask = torch.ones(2, 20, dtype=torch.bool, device=DEVICE)
    mask[0, 5:9] = False
    mask[1, 13:] = False
    q = torch.randn(2, 4, 16, device=DEVICE)
    assert triton_attention.row_ends(mask).tolist() == [20, 13]
    for m, ends in ((mask, None), (mask, triton_attention.row_ends(mask)), (None, None)):
        got = triton_attention.decode_attention(q, k_cache, v_cache, table, m, 0.25, 2, ends=ends)
        torch.testing.assert_close(
            got, reference_decode(q, k_cache, v_cache, table, m, 0.25), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.unit
def test_decode_with_a_window_and_sinks_matches_the_torch_path(splits):
    """A sliding window (each row's last 7 valid slots, the mask narrowed as kiln.runner.attention.windowed
    does) and a sink logit per query head joined in the merge of the splits: the torch path's output
    (windowed.attend), and all zeros where a row has no slot but its sink."""
    from kiln.runner.attention.windowed import attend

    k_cache, v_cache = pool(200, 2, 16)
    lens, window = [1, 37, 90, 0], 7
    table = torch.zeros(len(lens), 100, dtype=torch.int64)
    mask = torch.zeros(len(lens), 100, dtype=torch.bool)
    for b, n in enumerate(lens):
        table[b, :n] = torch.arange(1, n + 1) + b
        mask[b, max(0, n - window) : n] = True
    table, mask = table.to(DEVICE), mask.to(DEVICE)
    q, sinks = torch.randn(len(lens), 6, 16, device=DEVICE), torch.randn(6, device=DEVICE) * 2
    ends = triton_attention.row_ends(mask)
    got = triton_attention.decode_attention(
        q, k_cache, v_cache, table, mask, 0.25, splits, ends=ends, sinks=sinks
    )
    k, v = k_cache[table].transpose(1, 2), v_cache[table].transpose(1, 2)  # [B, Hk, L, D]
    want = attend(q.unsqueeze(2), k, v, mask[:, None], 0.25, None, sinks).squeeze(2)
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    plain = triton_attention.decode_attention(q, k_cache, v_cache, table, mask, 0.25, splits, ends=ends)
    assert not torch.allclose(got[:3], plain[:3], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk", [(8, 2), (34, 2)], ids=["group-4", "group-17"])
@pytest.mark.unit
def test_decode_in_half_precision_within_its_rounding(dtype, hq, hk):
    """Half-precision decode: each KV head's query heads as tiles of a dot (17 of them take two 16-row tiles),
    the softmax weights rounded to v's dtype as flash attention rounds them, sums in float32; within the dtype's
    rounding of float32 attention over the same values."""
    k_cache, v_cache = pool(300, hk, 64, dtype)
    table = (torch.randperm(299, generator=torch.Generator().manual_seed(3))[:180] + 1).view(3, 60).to(DEVICE)
    mask = torch.ones(3, 60, dtype=torch.bool, device=DEVICE)
    mask[1, 40:] = False
    q = torch.randn(3, hq, 64, device=DEVICE).to(dtype)
    got = triton_attention.decode_attention(q, k_cache, v_cache, table, mask, 0.125, 4)
    assert got.dtype == dtype
    want = reference_decode(q.float(), k_cache.float(), v_cache.float(), table, mask, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.unit
def test_decode_reads_a_bfloat16_pool_in_float32():
    k_cache, v_cache = pool(50, 2, 32, torch.bfloat16)
    table = torch.arange(1, 41, device=DEVICE).view(2, 20)
    q = torch.randn(2, 4, 32, device=DEVICE)
    got = triton_attention.decode_attention(q, k_cache, v_cache, table, None, 0.2, 4)
    torch.testing.assert_close(
        got, reference_decode(q, k_cache, v_cache, table, None, 0.2), rtol=1e-5, atol=1e-5
    )


def reference_extend(q, k, v, k_cache, v_cache, prefixes, ext_lens, scale, window=None, sinks=None):
    """Each request's rows over its prefix and its own tokens, causally (and within `window`), in float32: a
    softmax whose every row has one more logit, its head's sink, where `sinks` are given."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // k.shape[1]
    for slots, n in zip(prefixes, ext_lens):
        kk = torch.cat([k_cache[slots], k[row : row + n]]).repeat_interleave(group, 1).transpose(0, 1)
        vv = torch.cat([v_cache[slots], v[row : row + n]]).repeat_interleave(group, 1).transpose(0, 1)
        p = len(slots)
        keys, queries = (
            torch.arange(p + n, device=q.device)[None, :],
            torch.arange(n, device=q.device)[:, None] + p,
        )
        allowed = (keys <= queries) & (keys > queries - window if window else True)
        scores = (q[row : row + n].transpose(0, 1) @ kk.transpose(1, 2) * scale).masked_fill(
            ~allowed, -torch.inf
        )
        if sinks is not None:
            sink = sinks.view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[row : row + n] = (probs @ vv).transpose(0, 1)
        row += n
    return out


def run_extend(
    hq, hk, dim, prefix_lens, ext_lens, dtype=torch.float32, pool_dtype=None, gpu_tiles=False, window=None,
    sinks=None,
):  # fmt: skip
    """Requests with cached prefixes of prefix_lens slots (random slots of a pool) and ext_lens new tokens each,
    in one launch -> (the kernel's output, torch's in float32 over the same values). gpu_tiles: the tiles a GPU
    launches half precision with, whatever the dtype and the device."""
    k_cache, v_cache = pool(200, hk, dim, pool_dtype or dtype)
    gen = torch.Generator().manual_seed(2)
    prefixes = [(torch.randperm(199, generator=gen)[:n] + 1).to(DEVICE) for n in prefix_lens]
    t = sum(ext_lens)
    q, k, v = (torch.randn(t, h, dim, device=DEVICE).to(dtype) for h in (hq, hk, hk))

    def ints(xs):
        return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

    plan = extend_plan(dtype, dim, torch.cuda.get_device_capability() if DEVICE == "cuda" else None)
    if gpu_tiles:
        plan = replace(plan, block_m=128, block_n=64, warps=8)
    got = triton_attention.extend_attention(
        q, k, v, k_cache, v_cache, torch.cat(prefixes), ints(list(accumulate(prefix_lens, initial=0))[:-1]),
        ints(prefix_lens), ints(list(accumulate(ext_lens, initial=0))[:-1]), ints(ext_lens), max(ext_lens), 0.3,
        plan=plan, window=window, sinks=sinks,
    )  # fmt: skip
    f32 = [x.float() for x in (q, k, v, k_cache, v_cache)]
    return got, reference_extend(*f32, prefixes, ext_lens, 0.3, window, sinks)


@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["own-tiles", "gpu-half-tiles"])
@pytest.mark.parametrize("hq,hk,dim", [(4, 2, 16), (3, 3, 24)])
@pytest.mark.unit
def test_extend_over_cached_prefixes_and_fresh_prompts(hq, hk, dim, gpu_tiles):
    """Three requests in one launch: a fresh prompt over more than one block of rows, one on a 50-slot prefix,
    one token on a 3-slot prefix; float32 is exact to float32's rounding, with either tile shape."""
    got, want = run_extend(hq, hk, dim, [0, 50, 3], [140, 7, 1], gpu_tiles=gpu_tiles)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, with_sinks", [(9, False), (None, True), (40, True)])
@pytest.mark.unit
def test_extend_with_a_window_and_sinks(window, with_sinks):
    """A sliding window that reaches into the cached prefix (or not past the new tokens) and a sink logit per
    query head: float32 is exact to float32's rounding against the masked softmax with its extra logit."""
    sinks = torch.randn(4, device=DEVICE) * 2 if with_sinks else None
    got, want = run_extend(4, 2, 16, [0, 50, 3], [140, 7, 1], window=window, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain, _ = run_extend(4, 2, 16, [0, 50, 3], [140, 7, 1])
    assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["own-tiles", "gpu-half-tiles"])
@pytest.mark.unit
def test_extend_in_half_precision_within_its_rounding(dtype, gpu_tiles):
    """Half precision: q and k, then the softmax weights and v, meet in half-precision dots (a GPU's tensor cores)
    that sum in float32, as flash attention does; the output is within the dtype's rounding of float32 attention
    over the same values. (Triton's interpreter takes bfloat16 dots in float32, float16's as they are.)"""
    got, want = run_extend(4, 2, 32, [0, 50, 3], [70, 7, 1], dtype=dtype, gpu_tiles=gpu_tiles)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.unit
def test_extend_reads_a_bfloat16_pool_in_float32():
    """A bfloat16 pool under a float32 model: the prefix rows are widened to float32, and the dots stay exact."""
    got, want = run_extend(4, 2, 32, [20, 9], [5, 12], dtype=torch.float32, pool_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.unit
def test_store_kv_writes_k_and_v_as_indexing_does(dtype):
    """K and V read out of one q/k/v row as the layer leaves them (k a slice of the rotated q and k, v of the
    projection), written to scattered slots in one launch: the pool as torch's indexing leaves it; a K of another
    dtype than the pool's is refused with nothing written."""
    hq, hk, dim, tokens = 6, 2, 20, 5
    k_cache, v_cache = pool(40, hk, dim, dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qk = torch.randn(tokens, hq + hk, dim, device=DEVICE).to(dtype)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device=DEVICE).to(dtype)
    k, v = qk[:, hq:], qkv[:, (hq + hk) * dim :].view(tokens, hk, dim)
    slots = torch.tensor([7, 31, 2, 39, 11], device=DEVICE)
    want_k[slots], want_v[slots] = k, v
    assert triton_attention.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    assert not triton_attention.store_kv(k_cache, v_cache, slots, k.double(), v)
    assert not triton_attention.store_kv(
        k_cache, v_cache, slots, k, qk[:, : hk + 1]
    )  # V of another head count
    assert not triton_attention.store_kv(k_cache, v_cache, slots[:4], k, v)  # fewer slots than rows
    assert torch.equal(k_cache, before)


@pytest.mark.unit
def test_a_steps_row_ends_are_computed_once_and_anew_for_an_edited_mask():
    """The backend computes the row ends at a step's first layer and hands the same tensor to the rest; a mask
    written in place since (a later step reusing it) gets its ends computed anew, another mask its own."""
    from kiln.memory.kv_pool import KVPool
    from kiln.runner.attention.triton_backend import TritonBackend

    backend = TritonBackend(KVPool(16, 1, 1, 1, 8, torch.float32, DEVICE), 1)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool, device=DEVICE)
    mask[0, ..., :3], mask[1, ..., :5] = True, True
    first = backend._row_ends(mask, mask.view(2, 6))
    assert first.tolist() == [3, 5] and backend._row_ends(mask, mask.view(2, 6)) is first
    mask[0, ..., 3] = True
    assert backend._row_ends(mask, mask.view(2, 6)).tolist() == [4, 5]
    other = mask.clone()
    other[1, ..., 4] = False
    assert backend._row_ends(other, other.view(2, 6)).tolist() == [4, 4]


def test_a_model_served_with_the_triton_backend_gives_transformers_tokens(tiny_llama):
    """--attention-backend triton end to end (eager steps) on a random tiny Llama: prompts alone, batched (one
    extend launch for several requests, decode rows of different lengths), a radix hit (an extend on a cached
    prefix) and chunked prefill, token for token as transformers' float32 greedy decoding."""
    from test_correctness import hf_greedy, load_hf

    import kiln
    from kiln.runner.attention.triton_backend import TritonBackend

    hf = load_hf(tiny_llama)
    common = [
        5,
        9,
        14,
        3,
        7,
        11,
        2,
        8,
        30,
        31,
        40,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
        48,
        49,
    ] * 2  # 40 shared tokens
    prompts = [common + [60, 61], common + [70], [1, 2, 3], list(range(100, 170))]
    want = [hf_greedy(hf, p, 6, set())[0] for p in prompts]
    engine = kiln.Engine(
        model_path=tiny_llama, attention_backend="triton", disable_cuda_graph=True, device=DEVICE,
        max_total_tokens=2048, chunked_prefill_size=32, num_threads=1,
    )  # fmt: skip
    try:
        assert isinstance(engine.scheduler.runner.attn_backend, TritonBackend)
        greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        assert [engine.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts] == want
        assert [
            out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=greedy)
        ] == want
        assert engine.check_integrity()["ok"]
    finally:
        engine.shutdown()
