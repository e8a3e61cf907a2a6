"""What graph capture costs in memory, and which shapes it captures: the ledger's "graph reserve" line.

On CUDA the graphs' runtime, their static buffers and largest activations, and a cost per graph, calibrated on
an H200; on the CPU the compiler's runtime plus each compiled shape, measured. SGLang's own arithmetic (decode
max_bs x 2 MiB + prefill sizes x 8 MiB) stays for the SGLang mem_fraction_static heuristic. Pure arithmetic over
the ledger's inputs, like the ledger.
"""

from __future__ import annotations

import math

from kiln.core.graph_shapes import (
    CPU_PREFILL_GRAPH_MAX_TOKENS,
    CUDA_GRAPH_KV_WIDTH,
    decode_graph_batch_sizes,
    prefill_graph_token_sizes,
)
from kiln.core.units import GIB, MIB
from kiln.memory.ledger_types import LedgerInputs
from kiln.memory.model_shapes import (
    _is_mla,
    _req,
    context_len_of,
    dtype_bytes,
    head_dim,
    kv_dims,
    text_config,
)

# CPU compiled shapes: inductor's runtime once, then each shape's code and buffers. Measured (process RSS across
# the capture phase, default model): 4 decode steps 0.139 GB, 5 decode steps 0.156 GB, 3 prefill sizes 0.05 GB
CPU_COMPILER_BYTES = 64 * MIB
CPU_COMPILED_STEP_BYTES = 24 * MIB
# CUDA graphs, measured on an H200 (docs/benchmarks.md): the first capture of a process costs 240-280 MiB
# whatever the model (GEMM workspaces of the capture streams, kernels loaded on first use, graph instantiation),
# and each graph about 0.2 MiB (the default model's shape: 58 prefill sizes x 30 layers x 2 pieces = 3480 graphs
# took 1.08 GB, of which ~0.2 GB buffers and activations)
CUDA_GRAPH_RUNTIME_BYTES = 320 * MIB
CUDA_BYTES_PER_GRAPH = MIB // 4


def cuda_defaults(device_memory_bytes: int, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode graph max bs) by device memory, as SGLang picks them."""
    gib = device_memory_bytes / GIB
    for limit, chunk, small, large in (
        (20, 2048, 8, 8),
        (35, 2048, 24, 80),
        (60, 4096, 32, 160),
        (160, 8192, 256, 512),
    ):
        if gib < limit:
            return chunk, small if tp < 4 else large
    return 16384, 512


def graph_batch_sizes(inp: LedgerInputs, max_bs: int, mrr: int) -> tuple[int, ...]:
    """The decode batch sizes startup captures: --cuda-graph-bs or SGLang's list up to max_bs, capped at the
    running-request limit (which is appended when it cuts the list short)."""
    if inp.disable_cuda_graph:
        return ()
    sizes = sorted(set(inp.cuda_graph_bs)) if inp.cuda_graph_bs else decode_graph_batch_sizes(max_bs)
    capped = [b for b in sizes if b <= mrr]
    if len(capped) < len(sizes) and mrr not in capped:
        capped.append(mrr)
    return tuple(capped)


def graph_prefill_tokens(inp: LedgerInputs, chunk: int) -> tuple[int, ...]:
    """The prefill token counts startup captures: --cuda-graph-bs-prefill, or SGLang's buckets up to
    --cuda-graph-max-bs-prefill (default: the chunk size on CUDA; none on the CPU, see CPU_PREFILL_GRAPH_MAX_TOKENS)."""
    if inp.disable_cuda_graph or inp.disable_prefill_graph:
        return ()
    if inp.cuda_graph_bs_prefill:
        return tuple(sorted(set(inp.cuda_graph_bs_prefill)))
    default = chunk if inp.device.startswith("cuda") else CPU_PREFILL_GRAPH_MAX_TOKENS
    limit = inp.cuda_graph_max_bs_prefill if inp.cuda_graph_max_bs_prefill is not None else default
    return tuple(prefill_graph_token_sizes(limit))


def graph_reserve(inp: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]) -> tuple[int, str]:
    """CUDA: see cuda_graph_reserve. CPU: the compiler's runtime plus each compiled shape's code and buffers."""
    if not sizes and not prefill:
        return 0, "graphs disabled"
    if inp.device.startswith("cuda"):
        return cuda_graph_reserve(inp, sizes, prefill)
    max_bs, n = max(sizes, default=0), len(prefill)
    shapes = len(sizes) + n
    return CPU_COMPILER_BYTES + shapes * CPU_COMPILED_STEP_BYTES, (
        f"compiler runtime {CPU_COMPILER_BYTES // MIB} MiB + ({len(sizes)} decode steps (bs <= {max_bs}) + "
        f"{n} prefill sizes) x {CPU_COMPILED_STEP_BYTES // MIB} MiB compiled"
    )


def cuda_graph_reserve(
    inp: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]
) -> tuple[int, str]:
    """The graphs' runtime; decode: the static logits and the largest graph's logits and gathered K and V of one
    layer; prefill: at the largest token count, the static buffers (two hidden states, attention output, q/k/v,
    cos/sin) and one piece's activations (gate_up, its product, float32 norms); and a cost per graph."""
    cfg, tp = text_config(inp.hf_config), inp.tp_size
    ab = dtype_bytes(inp.dtype)
    kvb = dtype_bytes(inp.kv_cache_dtype if inp.kv_cache_dtype not in (None, "auto") else inp.dtype)
    hidden, vocab, layers = _req(cfg, "hidden_size"), _req(cfg, "vocab_size"), _req(cfg, "num_hidden_layers")
    k_w, v_w, _ = kv_dims(cfg, tp)
    q_w = math.ceil(_req(cfg, "num_attention_heads") / tp) * head_dim(cfg)
    inter = math.ceil(int(cfg.get("intermediate_size") or hidden) / tp)
    decode = pre = 0
    if sizes:
        bs, width = max(sizes), min(inp.context_length or context_len_of(inp.hf_config), CUDA_GRAPH_KV_WIDTH)
        decode = 2 * bs * vocab * 4 + bs * width * (k_w + v_w) * kvb
    if prefill:
        t = max(prefill)
        pre = t * ab * (3 * hidden + q_w + k_w + v_w + 2 * head_dim(cfg)) + t * (
            3 * inter * ab + 2 * hidden * 4
        )
    graphs = len(sizes) + len(prefill) * layers * 2
    total = CUDA_GRAPH_RUNTIME_BYTES + decode + pre + graphs * CUDA_BYTES_PER_GRAPH
    if _is_mla(cfg):
        total += 1536 * MIB  # SGLang's MLA allowance
    text = (
        f"runtime {CUDA_GRAPH_RUNTIME_BYTES // MIB} MiB + decode bs <= {max(sizes, default=0)} "
        f"{decode / MIB:.0f} MiB + prefill <= {max(prefill, default=0)} tokens {pre / MIB:.0f} MiB + "
        f"{graphs} graphs x {CUDA_BYTES_PER_GRAPH / MIB:.2f} MiB"
    )
    return total, text


def sglang_graph_reserve(inp: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]) -> int:
    """SGLang's reserve_for_graph: decode max_bs x 2 MiB + prefill sizes x 8 MiB (MLA: + 1536 MiB)."""
    mla = 1536 if _is_mla(text_config(inp.hf_config)) else 0
    return (max(sizes, default=0) * 2 + len(prefill) * 8 + mla) * MIB


def sglang_reserve(inp: LedgerInputs, chunk: int) -> int:
    """SGLang's default slack (MiB math of its mem_fraction_static heuristic), in bytes."""
    _, max_bs = cuda_defaults(inp.device_memory_bytes, inp.tp_size)
    max_bs = inp.cuda_graph_max_bs or max_bs
    graph = sglang_graph_reserve(
        inp, graph_batch_sizes(inp, max_bs, max_bs), graph_prefill_tokens(inp, chunk)
    )
    reserved = (512 + max(chunk, 2048) * 1.5 + inp.tp_size / 8 * 1024) * MIB + graph
    if inp.device_memory_bytes > 60 * GIB:
        reserved = max(reserved, 10240 * MIB)
    return int(reserved)
