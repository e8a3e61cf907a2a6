"""Attention for the layers that SDPA and Kiln's kernels cannot run as they are: a sliding window over the keys (a
query at position p sees the keys at positions p - window + 1 .. p, transformers' sliding mask) and tanh
softcapping of the scores (Gemma 2's attn_logit_softcapping) and attention sinks (GPT-OSS's learned per-head logit,
a column every query row sees whose probability is dropped after the softmax, so a row may attend to nothing),
which SDPA has no place for. The scores are worked out as transformers' eager attention does (q k^T x scale,
cap x tanh(scores / cap), masked, the sink's column, softmax in float32, @ v); an extend runs in blocks of query rows over only the keys each block can see, so a windowed layer's prefill
costs its window rather than its whole sequence.

A key's position is its index in its request's sequence (the slots of an extend, the valid columns of a decode
row, the last of which is the row's own token), so nothing beyond the batch's own tensors is read, and a captured
decode step runs through it as it runs through SDPA."""

from __future__ import annotations

from itertools import accumulate

import torch

from kiln.core.forward_batch import ForwardBatch
from kiln.memory.kv_pool import KVPool
from kiln.memory.window_pool import WindowPool

# query rows per block of an extend: a block holds rows x (its keys) x heads float32 scores, twice (the softmax's)
QUERY_BLOCK = 256


def visible(q_index: torch.Tensor, k_index: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Tq, L]: which keys each query sees, causally and within the window."""
    q, k = q_index.unsqueeze(-1), k_index.unsqueeze(0)
    seen = k <= q
    return seen & (k > q - window) if window is not None else seen


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, T, D], k and v [N, Hk, L, D], mask [N, T, L] (True: attended), sinks [Hq] or None ->
    [N, Hq, T, D]. Each KV head is read once for its group of query heads."""
    n, hq, t, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    group = hq // hk
    scores = torch.matmul(q.reshape(n, hk, group * t, d), k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(n, hk, group, t, length).masked_fill_(~mask[:, None, None], float("-inf"))
    if sinks is not None:  # query head h = kv head h // group, as the view above
        sink = sinks.to(scores.dtype).view(1, hk, group, 1, 1).expand(n, hk, group, t, 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :length].contiguous()
    return torch.matmul(probs.view(n, hk, group * t, length), v).view(n, hq, t, d)


def decode_mask(fb: ForwardBatch, window: int | None) -> torch.Tensor:
    """[B, L]: the keys of each decode row, its valid columns (a prefix of its table row, ending with its own
    token) and of those, with a window, the last `window`."""
    (b, length), device = fb.kv_table.shape, fb.kv_table.device
    valid = fb.kv_mask.view(b, length) if fb.kv_mask is not None else None
    if window is None:
        return valid if valid is not None else torch.ones(b, length, dtype=torch.bool, device=device)
    cols = torch.arange(length, device=device)
    if valid is None:
        return (cols >= length - window).expand(b, length)
    return valid & (cols >= valid.sum(-1, keepdim=True) - window)


def decode(
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Hq, D] -> [B, Hq, D] over each row's KV table row."""
    k, v = pool.gather_as(layer, fb.kv_table, q.dtype)  # [B, L, Hk, D]
    mask = decode_mask(fb, window).unsqueeze(1)
    return attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, softcap, sinks).squeeze(
        2
    )


def extend(
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each request's new tokens over the keys they see of its cached prefix and themselves: [T, Hq, D] ->
    [T, Hq, D]. A fresh prompt attends to its own K and V as computed, a cached prefix's are read from the pool
    (from the first its first new token sees)."""
    out = q.new_empty(q.shape)
    starts = list(accumulate(fb.extend_lens, initial=0))
    for i, (prefix, slots) in enumerate(zip(fb.prefix_lens, fb.seq_slots)):
        rows = slice(starts[i], starts[i + 1])
        if prefix == 0:
            first, keys, values = 0, k[rows], v[rows]
        else:
            first = max(0, prefix - window + 1) if window is not None else 0
            keys, values = pool.gather_as(layer, slots[first : prefix + starts[i + 1] - starts[i]], q.dtype)
        out[rows] = _span(q[rows], keys, values, prefix, first, scale, window, softcap, sinks)
    return out


def _span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_first: int,
    k_first: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One request's queries [T, Hq, D] at positions q_first .. over its keys and values [L, Hk, D] at positions
    k_first .. q_first + T - 1, a block of query rows at a time over the keys that block sees."""
    out = q.new_empty(q.shape)
    for r0 in range(0, q.shape[0], QUERY_BLOCK):
        r1 = min(q.shape[0], r0 + QUERY_BLOCK)
        lo = max(k_first, q_first + r0 - window + 1) if window is not None else k_first
        hi = q_first + r1  # past the block's last query: later keys are all masked
        q_index = torch.arange(q_first + r0, q_first + r1, device=q.device)
        mask = visible(q_index, torch.arange(lo, hi, device=q.device), window)

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [n, H, D] -> [1, H, n, D]
            return x.transpose(0, 1).unsqueeze(0)

        keys, values = k[lo - k_first : hi - k_first], v[lo - k_first : hi - k_first]
        o = attend(
            heads_first(q[r0:r1]), heads_first(keys), heads_first(values), mask[None], scale, softcap, sinks
        )
        out[r0:r1] = o[0].transpose(0, 1)
    return out


def ring_extend(
    rings: WindowPool,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    window: int,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """extend's attention for a layer whose KV lives in rings (kiln.memory.window_pool): each request's new
    tokens over the window of its prefix (read from its ring before anything is written) and themselves; then the
    last ring-length of the new tokens' K and V go into its ring."""
    out = q.new_empty(q.shape)
    starts = list(accumulate(fb.extend_lens, initial=0))
    for i, (prefix, slot) in enumerate(zip(fb.prefix_lens, fb.state_slots.tolist())):
        rows = slice(starts[i], starts[i + 1])
        first = max(0, prefix - window + 1)
        keys, values = k[rows], v[rows]
        if prefix > first:
            old_k, old_v = rings.read(layer, slot, first, prefix, q.dtype)
            keys, values = torch.cat((old_k, keys)), torch.cat((old_v, values))
        out[rows] = _span(q[rows], keys, values, prefix, first, scale, window, softcap, sinks)
        end = prefix + starts[i + 1] - starts[i]
        kept = min(end - prefix, rings.tokens)
        rings.write(layer, slot, end - kept, k[rows][-kept:], v[rows][-kept:])
    return out


def ring_decode(
    rings: WindowPool,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One new token per request over its ring, the token's own K and V written into it first: [B, Hq, D] ->
    [B, Hq, D]. A ring holds exactly the window's positions once the sequence is that long; before, only its
    first positions are valid. The order of the keys is immaterial (their positions are in their rotation)."""
    slots, positions = fb.state_slots.to(q.device), fb.positions
    at = positions % rings.tokens
    rings.k[layer, slots, at] = k.to(rings.k.dtype)
    rings.v[layer, slots, at] = v.to(rings.v.dtype)
    keys, values = rings.k[layer, slots].to(q.dtype), rings.v[layer, slots].to(q.dtype)  # [B, R, Hk, D]
    mask = torch.arange(rings.tokens, device=q.device).unsqueeze(0) <= positions.unsqueeze(1)
    out = attend(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask.unsqueeze(1), scale, softcap, sinks
    )
    return out.squeeze(2)
