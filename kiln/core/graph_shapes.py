"""Which shapes are captured as graphs: SGLang's decode batch-size and prefill token-count lists, and the
bucket a batch pads up to."""

from __future__ import annotations

from bisect import bisect_left

# a prefill that would pad by more than this factor to reach its bucket runs eagerly
MAX_PREFILL_PADDING_FACTOR = 2.0
# the CPU default for the largest captured decode batch: none. Every captured shape is a compile at the first
# start (loaded from the cache after), which is most of a small model's startup, while compiled steps gain little
# over eager with Kiln's kernels (docs/benchmarks.md has the figures): --cuda-graph-max-bs 1 (what
# benchmarks/compare.py runs) or 8 turns them on
CPU_GRAPH_MAX_BS = 0
# the CPU default for prefill shapes: none. Each token count is a compile at startup, SGLang's list up to the CPU
# chunk (2048) has 41 of them, and only long prefills gain (docs/benchmarks.md); --cuda-graph-max-bs-prefill or
# --cuda-graph-bs-prefill turn them on
CPU_PREFILL_GRAPH_MAX_TOKENS = 0
# CUDA decode graphs gather every request's KV over a static table width; longer sequences run eagerly. The
# gathered K and V take bs x width x kv heads x head dim x 2 x dtype bytes per layer inside the graph pool.
CUDA_GRAPH_KV_WIDTH = 2048
# rows of logits prompt logprobs compute at a time (kiln.runner.prompt_logprobs), which the ledger reserves for:
# 512 x 150k float32 is 300 MiB, and the GEMM stays efficient
PROMPT_LOGPROB_ROWS = 512


def decode_graph_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's decode list, truncated to max_bs, with max_bs itself appended when missing."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, 4097, 32)]
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs >= 1 and (not sizes or sizes[-1] != max_bs):
        sizes.append(max_bs)
    return sizes


def prefill_graph_token_sizes(max_tokens: int) -> list[int]:
    """SGLang's prefill token buckets up to max_tokens (the chunked-prefill size)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64)]
    sizes += [*range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    return [s for s in sizes if s <= max_tokens]


def bucket_for(sizes: list[int], n: int) -> int | None:
    """The smallest size in (sorted) `sizes` that holds n, or None when n is above them all."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def prefill_bucket_for(sizes: list[int], n: int) -> int | None:
    """The prefill bucket for n tokens, or None when there is none or it would pad more than 2x."""
    b = bucket_for(sizes, n)
    return b if b is not None and b <= MAX_PREFILL_PADDING_FACTOR * n else None


def verify_rows(batch_sizes: list[int], tokens_per_req: int, most: int | None = None) -> list[int]:
    """The verify shapes in rows: each batch size x tokens_per_req (SGLang's target verify graphs), at most
    `most` rows (None: no limit), but those the decode sizes already hold, ascending; none without speculative
    decoding."""
    if tokens_per_req <= 1:
        return []
    rows = {bs * tokens_per_req for bs in batch_sizes} - set(batch_sizes)
    return sorted(r for r in rows if most is None or r <= most)


def catch_up_rows(batch_sizes: list[int], tokens_per_req: int, most: int | None = None) -> list[int]:
    """A draft head's catch-up shapes in rows, ascending: each batch size x tokens_per_req (1 + the most drafts a
    verify accepts, as SGLang's draft extend graph takes num_steps + 1 tokens per request), at most `most` rows
    (None: no limit). They are captured on a backend of their own, so decode sizes are not left out."""
    return sorted({bs * tokens_per_req for bs in batch_sizes if most is None or bs * tokens_per_req <= most})


def draft_extend_tokens(prefill_tokens: list[int], batch_sizes: list[int], tokens_per_req: int) -> list[int]:
    """The prefill token counts a draft model's catch-up extends are captured at: up to the one that holds what a
    full batch catches up on at once (the largest batch x num_draft_tokens, as SGLang's draft extend graph)."""
    tokens = sorted(prefill_tokens)
    if not batch_sizes or not tokens:
        return []
    most = bucket_for(tokens, max(batch_sizes) * tokens_per_req) or tokens[-1]
    return [t for t in tokens if t <= most]


def head_guess_tokens(num_steps: int, topk: int) -> int:
    """KV slots one request's EAGLE / EAGLE-3 / NEXTN head writes its guesses to above the target's slots, which
    its pool mirrors: `topk` branches a step for a tree (one for a chain), num_steps + 1 steps."""
    return max(topk, 1) * (num_steps + 1)
