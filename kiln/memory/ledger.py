"""The memory ledger: every per-rank allocation predicted from the model config and the arguments alone.

Nothing here touches a device; `compute_ledger` is pure arithmetic and is what `kiln plan` prints and
what `kiln serve` checks before allocating. Sizes are bytes; "GiB" in messages is 2^30, the hierarchical
cache's "GB" is 1e9 (it is given per rank, in GB, like SGLang's `--hicache-size`).
"""

from __future__ import annotations

from dataclasses import replace

from kiln.core.graph_shapes import CPU_GRAPH_MAX_BS
from kiln.core.units import GIB, MIB, gb, gib
from kiln.memory.fix_search import find_fix
from kiln.memory.graph_budget import (
    cuda_defaults,
    graph_batch_sizes,
    graph_prefill_tokens,
    graph_reserve,
)
from kiln.memory.ledger_types import Failure, Ledger, LedgerInputs, LedgerLine
from kiln.memory.model_shapes import (  # noqa: F401 - re-exported: the ledger's public arithmetic
    _attn_params,
    _experts,
    _is_mla,
    _linear_bytes_per_param,
    _mlp_params,
    _moe_layer,
    _req,
    context_len_of,
    dtype_bytes,
    gguf_block_bytes,
    head_dim,
    kv_bytes_per_token,
    kv_dims,
    kv_heads_per_rank,
    kv_layers,
    packed_lm_head_bytes,
    param_counts,
    prefill_activation,
    resolve_dtype,
    text_config,
    weight_bytes,
    weight_inputs,
)
from kiln.memory.pool_sizing import resolve_running_requests, size_pool

# CPU default prefill chunk: at ~800 tok/s a 2048-token chunk takes ~2.5 s; longer chunks stall running decodes
# for longer without making prefill faster, and the activations of a 2048-token chunk are small.
CPU_CHUNKED_PREFILL_SIZE = 2048
# Interpreter, tokenizer, allocator slack; on CUDA SGLang's 512 MiB + tp/8 GiB of communication buffers.
RUNTIME_OVERHEAD_BYTES = 512 * MIB


# ---------------------------------------------------------------- sizing


def compute_ledger(inp: LedgerInputs) -> Ledger:
    """The ledger for these inputs; when it does not fit, the failure names the moment and a verified fix."""
    ledger = compute_core(inp)
    if ledger.failure is None:
        return ledger
    fix, flags = find_fix(inp, ledger, compute_core)
    return replace(ledger, failure=replace(ledger.failure, fix=fix, fix_flags=flags))


def _validate(inp: LedgerInputs) -> None:
    checks = [
        (inp.tp_size >= 1, "--tp-size must be >= 1"),
        (inp.available_memory_bytes > 0, "available device memory must be > 0"),
        (
            inp.mem_fraction_static is None or 0 < inp.mem_fraction_static <= 1,
            "--mem-fraction-static must be in (0, 1]",
        ),
        (inp.page_size >= 1, "--page-size must be >= 1"),
        (inp.max_total_tokens is None or inp.max_total_tokens >= 1, "--max-total-tokens must be >= 1"),
        (inp.context_length is None or inp.context_length >= 1, "--context-length must be >= 1"),
        (
            inp.max_running_requests is None or inp.max_running_requests >= 1,
            "--max-running-requests must be >= 1",
        ),
        (
            inp.chunked_prefill_size in (None, -1) or inp.chunked_prefill_size >= 1,
            "--chunked-prefill-size must be >= 1 or -1",
        ),
        (inp.max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1"),
        (inp.cuda_graph_max_bs is None or inp.cuda_graph_max_bs >= 1, "--cuda-graph-max-bs must be >= 1"),
        (
            inp.hicache_size_gb >= 0 and inp.hicache_ratio > 0,
            "--hicache-size must be >= 0 and --hicache-ratio > 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _host_check(inp: LedgerInputs, pool: int, device_used: int) -> tuple[list[LedgerLine], str | None]:
    """Host tier lines (per rank, per node) and the host-memory failure message, if any."""
    if not inp.enable_hierarchical_cache:
        return [], None
    if inp.hicache_size_gb > 0:
        per_rank, how = (
            int(inp.hicache_size_gb * 1e9),
            f"--hicache-size {inp.hicache_size_gb:g} GB (1e9 B) per rank",
        )
    else:
        per_rank, how = (
            int(inp.hicache_ratio * pool),
            f"--hicache-ratio {inp.hicache_ratio:g} x KV pool {gib(pool)}",
        )
    if inp.host_memory_bytes is not None:
        host = inp.host_memory_bytes
    else:
        from kiln.platform import host_available_bytes

        host = host_available_bytes()
    reserve = min(10 * GIB, max(GIB, host // 10))
    shared = (
        inp.tp_size * device_used if not inp.device.startswith("cuda") else 0
    )  # on CPU the KV pools are RAM too
    budget = host - reserve - shared
    node = inp.tp_size * per_rank
    minus = f" - cpu ranks' own use {gb(shared)}" if shared else ""
    lines = [
        LedgerLine("host tier per rank", per_rank, how),
        LedgerLine(
            "host tier node", node, f"{inp.tp_size} ranks x {gb(per_rank)} = {gb(node)} of system RAM"
        ),
        LedgerLine("host budget", budget, f"available RAM {gb(host)} - reserve {gb(reserve)}{minus}"),
    ]
    if node <= budget:
        return lines, None
    message = (
        f"the hierarchical cache lives in system RAM, not accelerator memory: {how} = {gb(per_rank)} per rank "
        f"x {inp.tp_size} ranks = {gb(node)} on this node, but only {gb(budget)} is usable "
        f"(available RAM {gb(host)} - reserve {gb(reserve)}{minus})"
    )
    return lines, message


def compute_core(inp: LedgerInputs) -> Ledger:
    """compute_ledger without the fix search."""
    _validate(inp)
    hf, cfg, tp, pre, page = (
        inp.hf_config,
        text_config(inp.hf_config),
        inp.tp_size,
        inp.available_memory_bytes,
        inp.page_size,
    )
    cuda = inp.device.startswith("cuda")
    wb = dtype_bytes(inp.dtype)
    kv_dtype = inp.kv_cache_dtype if inp.kv_cache_dtype not in (None, "auto") else inp.dtype
    kvb = dtype_bytes(kv_dtype)
    cell = kv_bytes_per_token(hf, tp, kvb)
    draft = inp.draft_hf_config
    draft_cell = kv_bytes_per_token(draft, tp, kvb) if draft else 0
    weights = weight_bytes(hf, tp, wb)
    draft_w = weight_bytes(draft, tp, wb) if draft else 0
    prepacks = not cuda and inp.dtype == "float32" and inp.weight_prepack
    head_copy = packed_lm_head_bytes(hf, tp) if prepacks else 0
    blocks = gguf_block_bytes(hf, tp) if prepacks and inp.gguf_blocks else None
    if blocks is not None:  # GGUF matrices kept in their blocks instead of float32
        linear_params, linear_bytes, head_blocks = blocks
        weights += linear_bytes - linear_params * wb
        head_copy = head_blocks or head_copy
    static, full_cell = weights + draft_w + head_copy, cell + draft_cell
    ctx = inp.context_length or context_len_of(hf)
    default_chunk, default_bs = (
        cuda_defaults(inp.device_memory_bytes, tp) if cuda else (CPU_CHUNKED_PREFILL_SIZE, CPU_GRAPH_MAX_BS)
    )
    chunk = inp.chunked_prefill_size or default_chunk
    prefill_tokens = min(chunk, inp.max_prefill_tokens) if chunk > 0 else max(inp.max_prefill_tokens, ctx)
    prefill, prefill_text = prefill_activation(hf, prefill_tokens, tp, wb, inp.device)
    overhead = RUNTIME_OVERHEAD_BYTES + (tp * GIB // 8 if cuda else 0)
    vocab = _req(cfg, "vocab_size")

    prefill_graphs = graph_prefill_tokens(inp, chunk if chunk > 0 else prefill_tokens)

    def decode_graphs(mrr: int) -> tuple[int, ...]:
        return graph_batch_sizes(inp, inp.cuda_graph_max_bs or default_bs, mrr)

    def parts(mrr: int) -> tuple[int, str, int, int]:
        graph, graph_text = graph_reserve(inp, decode_graphs(mrr), prefill_graphs)
        return graph, graph_text, mrr * vocab * 4, mrr * ctx * 8

    def need_at(mrr: int) -> int:
        graph, _, logits, table = parts(mrr)
        return overhead + graph + prefill + logits + table

    sizing = size_pool(inp, static, full_cell, ctx, need_at, chunk if chunk > 0 else prefill_tokens)
    tokens = sizing.tokens
    mrr = resolve_running_requests(inp, tokens, ctx) if tokens > 0 else (inp.max_running_requests or 1)
    graph, graph_text, logits, table = parts(mrr)
    pool = (tokens + page) * full_cell if tokens > 0 else 0
    after_pool = pre - static - pool - table - overhead
    headroom = after_pool - graph - prefill - logits

    k_w, v_w, kv_text = kv_dims(cfg, tp)
    layers = kv_layers(cfg)
    k_bytes = (tokens + page) * k_w * layers * kvb if tokens > 0 else 0
    kv_split = f"K {gib(k_bytes)} + V {gib(pool - k_bytes)}" if v_w else f"KV {gib(pool)}"
    ram = f" (RAM / tp {tp})" if not cuda and tp > 1 else ""
    lines = [
        LedgerLine("available", pre, f"free {inp.device} memory per rank before loading{ram}"),
        LedgerLine("weights", weights, weight_inputs(hf, tp, inp.dtype) + (
            f"; Q4_1 / Q8_0 linears kept in their GGUF blocks ({gib(blocks[1])})" if blocks else "")),
    ]  # fmt: skip
    if head_copy:
        how = "in its GGUF blocks" if blocks and blocks[2] else "vocab/tp x hidden x 4 B"
        lines.append(
            LedgerLine("packed lm head", head_copy, f"CPU prepacked copy of the tied embedding: {how}")
        )
    if draft:
        lines.append(LedgerLine("draft weights", draft_w, weight_inputs(draft, tp, inp.dtype)))
    kv_line = f"{kv_text} x {layers} layers x {kvb} B ({kv_dtype})"
    if draft:
        kv_line += f" + draft {draft_cell} B"
    lines += [
        LedgerLine("kv bytes per token", full_cell, kv_line),
        LedgerLine("kv pool", pool, f"{tokens:,} tokens + {page} padding x {full_cell} B: {kv_split}"),
        LedgerLine("request table", table, f"{mrr} requests x {ctx} context x 8 B (int64)"),
        LedgerLine(
            "runtime overhead",
            overhead,
            "interpreter, tokenizer, allocator slack" + (f" + tp {tp}/8 GiB comm" if cuda else ""),
        ),
        LedgerLine("graph reserve", graph, graph_text),
        LedgerLine("prefill activations", prefill, prefill_text),
        LedgerLine("logits buffer", logits, f"{mrr} requests x vocab {vocab} x 4 B"),
        LedgerLine("headroom", headroom, "available - everything above (must stay >= 0)"),
    ]
    host_lines, host_fail = _host_check(inp, pool, pre - max(headroom, 0))
    lines += host_lines

    failure = _first_failure(inp, sizing, static, pre, overhead, tokens, full_cell, after_pool, graph, graph_text,
                             prefill, prefill_tokens, logits, host_fail)  # fmt: skip
    return Ledger(
        lines=tuple(lines), kv_bytes_per_token=full_cell, weight_bytes=static, max_total_num_tokens=tokens,
        max_running_requests=mrr, context_len=ctx, chunked_prefill_size=chunk, max_prefill_tokens=inp.max_prefill_tokens,
        mem_fraction_static=min(1.0, sizing.mfs), mem_fraction_reason=sizing.reason, graph_reserve_bytes=graph,
        graph_batch_sizes=decode_graphs(mrr),
        graph_prefill_tokens=prefill_graphs,
        prefill_activation_bytes=prefill, logits_bytes=logits, headroom_bytes=headroom,
        fits=failure is None, failure=failure, device=inp.device, tp_size=tp,
    )  # fmt: skip


def _first_failure(inp, sizing, static, pre, overhead, tokens, cell, after_pool, graph, graph_text,
                   prefill, prefill_tokens, logits, host_fail) -> Failure | None:  # fmt: skip
    """The earliest startup moment that would run out of memory, in the order startup reaches them."""
    if static + overhead > pre:
        return Failure("load_weights", f"weights need {gib(static)} per rank (tp {inp.tp_size}) + runtime "
                       f"{gib(overhead)}, but only {gib(pre)} is free per rank", "")  # fmt: skip
    if tokens <= 0:
        return Failure("kv_allocation", f"{sizing.cause}: weights {gib(static)} leave no memory for the KV cache "
                       f"after the reserve for runtime, capture and prefill ({gib(pre)} free per rank)", "")  # fmt: skip
    if sizing.target and tokens < sizing.target[0]:
        want, what = sizing.target
        return Failure("kv_allocation", f"{what} needs {want:,} tokens = {gib(want * cell)} of KV, but "
                       f"{sizing.cause} gives a pool of {tokens:,} tokens ({gib(tokens * cell)})", "")  # fmt: skip
    if after_pool < 0:
        return Failure("kv_allocation", f"{sizing.cause}: weights {gib(static)} + KV pool {gib(tokens * cell)} + "
                       f"request table and runtime exceed the {gib(pre)} free per rank", "")  # fmt: skip
    if host_fail:
        return Failure("host_memory", host_fail, "")
    if after_pool < graph:
        return Failure("graph_capture", f"{sizing.cause} leaves {gib(after_pool)} after the KV pool; graph capture "
                       f"needs {gib(graph)} ({graph_text})", "")  # fmt: skip
    if after_pool - graph < prefill + logits:
        return Failure("first_full_prefill", f"{sizing.cause} leaves {gib(after_pool - graph)} after capture; a full "
                       f"{prefill_tokens}-token prefill needs {gib(prefill + logits)} (activations {gib(prefill)} "
                       f"+ logits buffer {gib(logits)})", "")  # fmt: skip
    return None
