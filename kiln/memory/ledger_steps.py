"""The memory ledger's arithmetic steps: what is resident before the pool (static bytes), what one token of KV
costs (the cell), the shapes a step runs at, what grows with the running requests (the reserve) and the pool
sized between them. Pure arithmetic over LedgerInputs; kiln/memory/ledger.py turns the steps into lines and a
verdict."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.dtypes import dtype_bytes, kv_cache_dtype_name
from kiln.core.graph_shapes import CPU_GRAPH_MAX_BS
from kiln.core.units import GIB, MIB
from kiln.memory.graph_budget import cuda_defaults, graph_batch_sizes, graph_prefill_tokens, graph_reserve
from kiln.memory.ledger_lora import lora_slot_bytes
from kiln.memory.ledger_types import LedgerInputs
from kiln.memory.tier_staging import STAGING_BYTES
from kiln.models.spec import GgufBlocks

# CPU default prefill chunk: at CPU prefill speed a chunk this long already holds running decodes back for
# seconds; longer chunks stall them for longer without making prefill faster, and its activations are small.
CPU_CHUNKED_PREFILL_SIZE = 2048
# Interpreter, tokenizer, allocator slack; on CUDA SGLang's 512 MiB + tp/8 GiB of communication buffers.
RUNTIME_OVERHEAD_BYTES = 512 * MIB


@dataclass(frozen=True)
class StaticBytes:
    """What is resident before the KV pool, per rank: the weights as served and the copies made of them."""

    weights: int  # the model's weights (GGUF matrices kept in their blocks counted as stored)
    packed_head: int  # the CPU prepacked copy of a tied lm head
    draft_weights: int  # the speculative draft model's weights
    blocks: GgufBlocks | None  # the GGUF matrices kept in their blocks, if any
    int8_linears: bool = False  # --quantization int8 counted: the linears held in int8
    lora_slots: int = 0  # the LoRA adapter slots on the projections (kiln.memory.ledger_lora)

    @property
    def total(self) -> int:
        return self.weights + self.packed_head + self.draft_weights + self.lora_slots


def static_bytes(inputs: LedgerInputs) -> StaticBytes:
    element_bytes = dtype_bytes(inputs.dtype)
    model, tp = inputs.model, inputs.tp_size
    weights = model.weight_bytes(tp, element_bytes, inputs.fp8_weights_kept)
    prepacked = not inputs.device.startswith("cuda") and inputs.dtype == "float32" and inputs.weight_prepack
    packed_head = model.packed_lm_head_bytes(tp) if prepacked else 0
    blocks = model.gguf_blocks(tp, inputs.gguf_block_types) if prepacked else None
    if (
        prepacked and inputs.int8_linears
    ):  # --quantization int8: 1 byte per weight and a float32 scale per row
        weights -= model.int8_saved_bytes(tp, element_bytes, inputs.gguf_block_types)
    if blocks is not None:  # GGUF matrices kept in their blocks instead of float32
        weights += blocks.linear_bytes - blocks.linear_params * element_bytes
        packed_head = blocks.head_bytes or packed_head
    draft = inputs.draft
    draft_weights = draft.weight_bytes(tp, element_bytes, inputs.fp8_weights_kept) if draft else 0
    lora = lora_slot_bytes(model, inputs.lora_slots, inputs.lora_rank, inputs.lora_modules, inputs.dtype, tp)
    return StaticBytes(weights, packed_head, draft_weights, blocks, prepacked and inputs.int8_linears, lora)


@dataclass(frozen=True)
class KvCell:
    """KV bytes one token takes on one rank, the draft model's included."""

    dtype: str
    element_bytes: int
    model: int
    draft: int

    @property
    def total(self) -> int:
        return self.model + self.draft


def kv_cell(inputs: LedgerInputs) -> KvCell:
    dtype = kv_cache_dtype_name(inputs.kv_cache_dtype, inputs.dtype)
    element_bytes = dtype_bytes(dtype)
    model = inputs.model.kv_bytes_per_token(inputs.tp_size, element_bytes)
    if inputs.draft:
        draft = inputs.draft.kv_bytes_per_token(inputs.tp_size, element_bytes)
    else:  # NEXTN's head: layers of the target's own shape
        k, v, _ = inputs.model.kv_dims(inputs.tp_size)
        draft = (k + v) * inputs.draft_head_kv_layers * element_bytes
    return KvCell(dtype, element_bytes, model, draft)


@dataclass(frozen=True)
class StepShapes:
    """The shapes a step runs at, fixed by the flags and the device before the pool is sized."""

    context: int
    chunk: int  # chunked_prefill_size; -1 = no chunking
    prefill_tokens: int  # tokens of the largest prefill forward
    decode_graph_max_bs: int  # the largest decode batch captured unless the running requests cap it
    prefill_graphs: tuple[int, ...]  # prefill token counts captured
    prefill_bytes: int  # peak activations of the largest prefill
    prefill_text: str
    overhead: int  # runtime overhead
    vocab: int

    @property
    def graph_chunk(self) -> int:
        """The token count prefill graphs and SGLang's reserve are sized for: the chunk, or the whole prefill."""
        return self.chunk if self.chunk > 0 else self.prefill_tokens


def tier_staging_bytes(inputs: LedgerInputs) -> int:
    """The device ring the host tier's copies go through on CUDA (kiln.memory.tier_copies)."""
    return STAGING_BYTES if inputs.device.startswith("cuda") and inputs.enable_hierarchical_cache else 0


def step_shapes(inputs: LedgerInputs) -> StepShapes:
    cuda = inputs.device.startswith("cuda")
    context = inputs.context_length or inputs.model.context_len
    default_chunk, default_max_bs = (
        cuda_defaults(inputs.device_memory_bytes, inputs.tp_size)
        if cuda
        else (CPU_CHUNKED_PREFILL_SIZE, CPU_GRAPH_MAX_BS)
    )
    chunk = inputs.chunked_prefill_size or default_chunk
    prefill_tokens = (
        min(chunk, inputs.max_prefill_tokens) if chunk > 0 else max(inputs.max_prefill_tokens, context)
    )
    graph_chunk = chunk if chunk > 0 else prefill_tokens
    prefill_bytes, prefill_text = inputs.model.prefill_activation(
        prefill_tokens, inputs.tp_size, dtype_bytes(inputs.dtype), inputs.device
    )
    return StepShapes(
        context=context,
        chunk=chunk,
        prefill_tokens=prefill_tokens,
        decode_graph_max_bs=inputs.cuda_graph_max_bs or default_max_bs,
        prefill_graphs=graph_prefill_tokens(inputs, graph_chunk),
        prefill_bytes=prefill_bytes,
        prefill_text=prefill_text,
        overhead=RUNTIME_OVERHEAD_BYTES
        + (inputs.tp_size * GIB // 8 if cuda else 0)
        + tier_staging_bytes(inputs),
        vocab=inputs.model.vocab_size,
    )


@dataclass(frozen=True)
class RequestReserve:
    """What grows with the running requests: the decode graphs captured for them, their logits buffer and their
    rows of the request table."""

    running_requests: int
    graph_batch_sizes: tuple[int, ...]
    graph_bytes: int  # decode and prefill graphs together
    graph_text: str
    logits_bytes: int
    request_table_bytes: int
    draft_guess_bytes: int = 0  # a draft head's guess slots (their KV), above the pool's tokens


def request_reserve(inputs: LedgerInputs, shapes: StepShapes, running_requests: int) -> RequestReserve:
    sizes = graph_batch_sizes(inputs, shapes.decode_graph_max_bs, running_requests)
    graph_bytes, graph_text = graph_reserve(inputs, sizes, shapes.prefill_graphs)
    return RequestReserve(
        running_requests=running_requests,
        graph_batch_sizes=sizes,
        graph_bytes=graph_bytes,
        graph_text=graph_text,
        logits_bytes=running_requests * shapes.vocab * 4,
        request_table_bytes=running_requests * shapes.context * 8,
        draft_guess_bytes=running_requests * inputs.draft_guess_tokens_per_req * kv_cell(inputs).draft,
    )


def reserve_bytes(inputs: LedgerInputs, shapes: StepShapes, running_requests: int) -> int:
    """Everything kept beside the weights and the pool: runtime, graphs, peak prefill, logits, request table."""
    reserve = request_reserve(inputs, shapes, running_requests)
    return (
        shapes.overhead
        + reserve.graph_bytes
        + shapes.prefill_bytes
        + reserve.logits_bytes
        + reserve.request_table_bytes
        + reserve.draft_guess_bytes
    )


@dataclass(frozen=True)
class PoolBudget:
    """The pool as sized, and what the available memory keeps after it."""

    tokens: int
    cell_bytes: int  # KV bytes per token
    pool_bytes: int  # tokens and the padding page
    key_bytes: int  # the K half of the pool (all of it for MLA)
    after_pool: int  # available - weights - pool - state pool - request table - runtime
    headroom: int  # after_pool - graphs - peak prefill - logits: must stay >= 0
    state_bytes: int = 0  # the state pool of a hybrid linear-attention model (working slots and checkpoints)


def pool_budget(
    inputs: LedgerInputs,
    static: StaticBytes,
    cell: KvCell,
    shapes: StepShapes,
    reserve: RequestReserve,
    tokens: int,
    state_bytes: int = 0,
) -> PoolBudget:
    page = inputs.page_size
    pool = (tokens + page) * cell.total if tokens > 0 else 0
    key_width, _, _ = inputs.model.kv_dims(inputs.tp_size)
    layers = inputs.model.kv_layers
    key_bytes = (tokens + page) * key_width * layers * cell.element_bytes if tokens > 0 else 0
    after_pool = (
        inputs.available_memory_bytes
        - static.total
        - pool
        - state_bytes
        - reserve.request_table_bytes
        - reserve.draft_guess_bytes
        - shapes.overhead
    )
    headroom = after_pool - reserve.graph_bytes - shapes.prefill_bytes - reserve.logits_bytes
    return PoolBudget(tokens, cell.total, pool, key_bytes, after_pool, headroom, state_bytes)


# ---------------------------------------------------------------- the lines
