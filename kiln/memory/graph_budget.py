"""What graph capture costs in memory, and which shapes it captures: the ledger's "graph reserve" line.

On CUDA the graphs' runtime, their static buffers and largest activations, and a cost per graph, calibrated on
an H200; on the CPU the compiler's runtime plus each compiled shape, measured. SGLang's own arithmetic (decode
max_bs x 2 MiB + prefill sizes x 8 MiB) stays for the SGLang mem_fraction_static heuristic. Pure arithmetic over
the ledger's inputs, like the ledger.
"""

from __future__ import annotations

import math

from kiln.core.dtypes import dtype_bytes, kv_cache_dtype_name
from kiln.core.graph_shapes import (
    CPU_PREFILL_GRAPH_MAX_TOKENS,
    CUDA_GRAPH_KV_WIDTH,
    catch_up_rows,
    decode_graph_batch_sizes,
    draft_extend_tokens,
    prefill_graph_token_sizes,
    verify_rows,
)
from kiln.core.units import GIB, MIB
from kiln.memory.ledger_types import LedgerInputs
from kiln.models.spec import ModelSpec

# CPU compiled shapes: inductor's runtime once, then each shape's code and buffers, sized from the process RSS
# across the capture phase with the default model (docs/benchmarks.md, Graph capture on the CPU).
CPU_COMPILER_BYTES = 64 * MIB
CPU_COMPILED_STEP_BYTES = 24 * MIB
# CUDA graphs, calibrated on an H200 (docs/benchmarks.md): the first capture of a process pays a fixed runtime
# whatever the model (GEMM workspaces of the capture streams, kernels loaded on first use, graph instantiation),
# then each graph a small cost of its own, which follows the kernels in it: a piece of fused step kernels
# (kiln.platform.fused_step_kernels) holds about a third of the torch code's. The runtime is rounded up from the
# largest capture seen and the fused graphs' cost from an 8B-class model's capture (0.153 MiB), so the reserve
# covers what was measured.
CUDA_GRAPH_RUNTIME_BYTES = 320 * MIB
CUDA_BYTES_PER_GRAPH = MIB // 4
CUDA_BYTES_PER_FUSED_GRAPH = int(0.16 * MIB)


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


def graph_batch_sizes(inputs: LedgerInputs, max_bs: int, running_requests: int) -> tuple[int, ...]:
    """The decode batch sizes startup captures: --cuda-graph-bs or SGLang's list up to max_bs, capped at the
    running-request limit (which is appended when it cuts the list short); none for a model that runs eagerly, nor
    on an embedding server, whose requests never decode."""
    if inputs.disable_cuda_graph or inputs.model.eager_only or inputs.is_embedding:
        return ()
    sizes = sorted(set(inputs.cuda_graph_bs)) if inputs.cuda_graph_bs else decode_graph_batch_sizes(max_bs)
    capped = [b for b in sizes if b <= running_requests]
    if len(capped) < len(sizes) and running_requests not in capped:
        capped.append(running_requests)
    return tuple(capped)


def graph_prefill_tokens(inputs: LedgerInputs, chunk: int) -> tuple[int, ...]:
    """The prefill token counts startup captures: --cuda-graph-bs-prefill, or SGLang's buckets up to
    --cuda-graph-max-bs-prefill (default: the chunk size on CUDA; none on the CPU, see CPU_PREFILL_GRAPH_MAX_TOKENS)."""
    if inputs.disable_cuda_graph or inputs.disable_prefill_graph or inputs.model.eager_only:
        return ()
    if inputs.cuda_graph_bs_prefill:
        return tuple(sorted(set(inputs.cuda_graph_bs_prefill)))
    default = chunk if inputs.device.startswith("cuda") else CPU_PREFILL_GRAPH_MAX_TOKENS
    limit = inputs.cuda_graph_max_bs_prefill if inputs.cuda_graph_max_bs_prefill is not None else default
    return tuple(prefill_graph_token_sizes(limit))


def graph_reserve(inputs: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]) -> tuple[int, str]:
    """CUDA: see cuda_graph_reserve. CPU: the compiler's runtime plus each compiled shape's code and buffers."""
    if not sizes and not prefill:
        return 0, "graphs disabled"
    if inputs.device.startswith("cuda"):
        return cuda_graph_reserve(inputs, sizes, prefill)
    max_bs, n = max(sizes, default=0), len(prefill)
    verify, draft = speculative_graphs(inputs, sizes)
    draft += len(_draft_extends(inputs, sizes, prefill))  # each a compiled shape of the draft
    shapes = len(sizes) + n + verify + draft
    return CPU_COMPILER_BYTES + shapes * CPU_COMPILED_STEP_BYTES, (
        f"compiler runtime {CPU_COMPILER_BYTES // MIB} MiB + ({len(sizes)} decode steps (bs <= {max_bs}) + "
        f"{n} prefill sizes{_speculative_text(verify, draft)}) x {CPU_COMPILED_STEP_BYTES // MIB} MiB compiled"
    )


def speculative_graphs(inputs: LedgerInputs, sizes: tuple[int, ...]) -> tuple[int, int]:
    """How many verify shapes the target captures beside its decode sizes (each size x num_draft_tokens rows;
    on CUDA only those within the largest decode graph's rows, whose buffers are counted), and how many steps
    a draft model or head captures: a decode step per size, and a head's catch-ups (each size x num_steps + 1
    rows, on CUDA within the same rows)."""
    most = max(sizes, default=0) if inputs.device.startswith("cuda") else None
    verify = len(verify_rows(list(sizes), inputs.verify_tokens_per_req, most))
    draft = len(sizes) if inputs.draft_rows_per_req else 0
    if inputs.draft_catch_up_tokens_per_req:
        draft += len(catch_up_rows(list(sizes), inputs.draft_catch_up_tokens_per_req, most))
    return verify, draft


def _speculative_text(verify: int, draft: int) -> str:
    verify_text = f" + {verify} verify shapes" if verify else ""
    return verify_text + (f" + {draft} draft steps" if draft else "")


def _draft_extends(inputs: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]) -> list[int]:
    """The token counts a draft model's catch-up extends are captured at (none for a head)."""
    if not inputs.draft_extend_layers:
        return []
    return draft_extend_tokens(list(prefill), list(sizes), inputs.verify_tokens_per_req)


def cuda_graph_reserve(
    inputs: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]
) -> tuple[int, str]:
    """The graphs' runtime; decode: the static logits and the largest graph's logits and gathered K and V of one
    layer (and the draft's decode and catch-up graphs' the same); prefill: at the largest token count, the static
    buffers (two hidden states, attention output, q/k/v, cos/sin) and one piece's activations (gate_up, its
    product, float32 norms unless fused); and a cost per graph (less where the step's kernels are fused)."""
    decode_bytes = _decode_graph_bytes(inputs, max(sizes)) if sizes else 0
    draft_bytes = _draft_graph_bytes(inputs, sizes)
    prefill_bytes = _prefill_graph_bytes(inputs, max(prefill)) if prefill else 0
    verify, draft = speculative_graphs(inputs, sizes)
    # a draft model's extends on prefill pieces: two graphs per layer per token count, as the target's prefill
    draft += len(_draft_extends(inputs, sizes, prefill)) * inputs.draft_extend_layers * 2
    graphs = len(sizes) + verify + draft + len(prefill) * inputs.model.num_layers * 2
    per_graph = CUDA_BYTES_PER_FUSED_GRAPH if inputs.fused_step_kernels else CUDA_BYTES_PER_GRAPH
    total = CUDA_GRAPH_RUNTIME_BYTES + decode_bytes + draft_bytes + prefill_bytes + graphs * per_graph
    if inputs.model.is_mla:
        total += 1536 * MIB  # SGLang's MLA allowance
    text = (
        f"runtime {CUDA_GRAPH_RUNTIME_BYTES // MIB} MiB + decode bs <= {max(sizes, default=0)} "
        f"{decode_bytes / MIB:.0f} MiB + "
        + (f"draft steps {draft_bytes / MIB:.0f} MiB + " if draft_bytes else "")
        + f"prefill <= {max(prefill, default=0)} tokens {prefill_bytes / MIB:.0f} MiB + "
        f"{graphs} graphs x {per_graph / MIB:.2f} MiB"
    )
    return total, text


def _draft_graph_bytes(inputs: LedgerInputs, sizes: tuple[int, ...]) -> int:
    """The draft's graphs, as the target's decode graphs in the draft's dimensions (NEXTN's head: the target's):
    its decode steps' largest graph (the largest batch x topk rows), and a head's catch-ups on a backend of their
    own (their largest graph, logits at one row per request)."""
    if not sizes or not inputs.draft_rows_per_req:
        return 0
    model = inputs.draft or inputs.model
    total = _decode_graph_bytes(inputs, max(sizes) * inputs.draft_rows_per_req, model=model)
    tokens = inputs.draft_catch_up_tokens_per_req
    rows = catch_up_rows(list(sizes), tokens, max(sizes)) if tokens else []
    if rows:
        total += _decode_graph_bytes(inputs, max(rows), max(rows) // tokens, model=model)
    return total


def _decode_graph_bytes(
    inputs: LedgerInputs, batch: int, logits_rows: int | None = None, model: ModelSpec | None = None
) -> int:
    """The largest decode graph: static and graph logits (of every row, or `logits_rows`), and one layer's K and V
    gathered to the graphs' width where attention gathers them; of the target, or of `model` (a draft's, whose logits are over its own vocabulary: EAGLE-3's draft_vocab_size)."""
    model = model or inputs.model
    kv_element_bytes = dtype_bytes(kv_cache_dtype_name(inputs.kv_cache_dtype, inputs.dtype))
    key_width, value_width, _ = model.kv_dims(inputs.tp_size)
    width = min(inputs.context_length or inputs.model.context_len, CUDA_GRAPH_KV_WIDTH)
    vocab = model.draft_vocab_size or model.vocab_size
    gathered = batch * width * (key_width + value_width) * kv_element_bytes if inputs.attention_gathers else 0
    return 2 * (batch if logits_rows is None else logits_rows) * vocab * 4 + gathered


def _prefill_graph_bytes(inputs: LedgerInputs, tokens: int) -> int:
    """The largest prefill graph: its static buffers and one piece's activations, at `tokens` tokens."""
    model, tp = inputs.model, inputs.tp_size
    activation_bytes = dtype_bytes(inputs.dtype)
    hidden = model.hidden_size
    key_width, value_width, _ = model.kv_dims(tp)
    query_width = math.ceil(model.num_heads / tp) * model.head_dim
    intermediate = math.ceil((model.intermediate_size or hidden) / tp)
    static_buffers = 3 * hidden + query_width + key_width + value_width + 2 * model.head_dim
    norms = 0 if inputs.fused_step_kernels else 2 * hidden * 4  # the torch code's float32 copies
    return tokens * activation_bytes * static_buffers + tokens * (3 * intermediate * activation_bytes + norms)


def sglang_graph_reserve(inputs: LedgerInputs, sizes: tuple[int, ...], prefill: tuple[int, ...]) -> int:
    """SGLang's reserve_for_graph: decode max_bs x 2 MiB + prefill sizes x 8 MiB (MLA: + 1536 MiB)."""
    mla = 1536 if inputs.model.is_mla else 0
    return (max(sizes, default=0) * 2 + len(prefill) * 8 + mla) * MIB


def sglang_reserve(inputs: LedgerInputs, chunk: int) -> int:
    """SGLang's default slack (MiB math of its mem_fraction_static heuristic), in bytes."""
    _, max_bs = cuda_defaults(inputs.device_memory_bytes, inputs.tp_size)
    max_bs = inputs.cuda_graph_max_bs or max_bs
    graph = sglang_graph_reserve(
        inputs, graph_batch_sizes(inputs, max_bs, max_bs), graph_prefill_tokens(inputs, chunk)
    )
    reserved = (512 + max(chunk, 2048) * 1.5 + inputs.tp_size / 8 * 1024) * MIB + graph
    if inputs.device_memory_bytes > 60 * GIB:
        reserved = max(reserved, 10240 * MIB)
    return int(reserved)
