"""What graph capture costs in memory, and which shapes it captures: the ledger's "graph reserve" line.

On CUDA SGLang's arithmetic (decode max_bs x 2 MiB + prefill sizes x 8 MiB); on the CPU the compiler's runtime
plus each compiled shape, measured. Pure arithmetic over the ledger's inputs, like the ledger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.memory.model_shapes import _is_mla, text_config
from kiln.memory.units import GIB, MIB
from kiln.runner.graph_shapes import (
    CPU_PREFILL_GRAPH_MAX_TOKENS,
    decode_graph_batch_sizes,
    prefill_graph_token_sizes,
)

if TYPE_CHECKING:
    from kiln.memory.ledger import LedgerInputs

# CPU compiled shapes: inductor's runtime once, then each shape's code and buffers. Measured (process RSS across
# the capture phase, default model): 4 decode steps 0.139 GB, 5 decode steps 0.156 GB, 3 prefill sizes 0.05 GB
CPU_COMPILER_BYTES = 64 * MIB
CPU_COMPILED_STEP_BYTES = 24 * MIB


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
    """CUDA: SGLang's reserve_for_graph, decode max_bs x 2 MiB + prefill sizes x 8 MiB (MLA: + 1536 MiB). CPU: the
    compiler's runtime plus each compiled shape's code and buffers."""
    if not sizes and not prefill:
        return 0, "graphs disabled"
    max_bs, n = max(sizes, default=0), len(prefill)
    if not inp.device.startswith("cuda"):
        shapes = len(sizes) + n
        return CPU_COMPILER_BYTES + shapes * CPU_COMPILED_STEP_BYTES, (
            f"compiler runtime {CPU_COMPILER_BYTES // MIB} MiB + ({len(sizes)} decode steps (bs <= {max_bs}) + "
            f"{n} prefill sizes) x {CPU_COMPILED_STEP_BYTES // MIB} MiB compiled"
        )
    if _is_mla(text_config(inp.hf_config)):
        return (max_bs * 2 + 1536) * MIB, f"decode bs <= {max_bs} x 2 MiB + MLA 1536 MiB"
    top = f" (<= {max(prefill)})" if prefill else ""
    return (max_bs * 2 + n * 8) * MIB, f"decode bs <= {max_bs} x 2 MiB + {n} prefill sizes{top} x 8 MiB"


def sglang_reserve(inp: LedgerInputs, chunk: int) -> int:
    """SGLang's default slack (MiB math of its mem_fraction_static heuristic), in bytes."""
    _, max_bs = cuda_defaults(inp.device_memory_bytes, inp.tp_size)
    max_bs = inp.cuda_graph_max_bs or max_bs
    graph, _ = graph_reserve(inp, graph_batch_sizes(inp, max_bs, max_bs), graph_prefill_tokens(inp, chunk))
    reserved = (512 + max(chunk, 2048) * 1.5 + inp.tp_size / 8 * 1024) * MIB + graph
    if inp.device_memory_bytes > 60 * GIB:
        reserved = max(reserved, 10240 * MIB)
    return int(reserved)
