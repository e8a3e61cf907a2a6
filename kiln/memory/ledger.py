"""The memory ledger: every per-rank allocation predicted from the model config and the arguments alone.

Nothing here touches a device; `compute_ledger` is pure arithmetic and is what `kiln plan` prints and
what `kiln serve` checks before allocating. Sizes are bytes; "GiB" in messages is 2^30, the hierarchical
cache's "GB" is 1e9 (it is given per rank, in GB, like SGLang's `--hicache-size`).

The arithmetic runs in steps (ledger_steps.py: static bytes, the KV cell, the step shapes, the reserve, the pool);
this module turns them into the lines, checks the host tier and finds the first moment of startup that would
fail.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

from kiln.config import check_counts, check_mem_fraction_static
from kiln.core import envs
from kiln.core.dtypes import dtype_bytes
from kiln.core.units import GIB, gb, gib, human
from kiln.memory.fix_search import find_fix
from kiln.memory.ledger_lora import lora_text
from kiln.memory.ledger_states import StatePlan, clamped, given_slots_plan, ratio_plan, size_for_requests
from kiln.memory.ledger_steps import (
    KvCell,
    PoolBudget,
    RequestReserve,
    StaticBytes,
    StepShapes,
    kv_cell,
    pool_budget,
    request_reserve,
    reserve_bytes,
    static_bytes,
    step_shapes,
    tier_staging_bytes,
)
from kiln.memory.ledger_types import Failure, Ledger, LedgerInputs, LedgerLine
from kiln.memory.pool_sizing import PoolRequest, PoolSizing, resolve_running_requests, size_pool
from kiln.models.spec import LinearState, ModelSpec, WindowState

__all__ = ["Ledger", "LedgerInputs", "compute_core", "compute_ledger"]


def compute_ledger(inputs: LedgerInputs) -> Ledger:
    """The ledger for these inputs; when it does not fit, the failure names the moment and a verified fix."""
    ledger = compute_core(inputs)
    if ledger.failure is None:
        return ledger
    fix, flags = find_fix(inputs, ledger, compute_core)
    return replace(ledger, failure=replace(ledger.failure, fix=fix, fix_flags=flags))


def compute_core(inputs: LedgerInputs) -> Ledger:
    """compute_ledger without the fix search."""
    _validate(inputs)
    state = request_state(inputs)
    if state is None:
        return _compute(inputs, None)
    if inputs.max_mamba_cache_size:
        return _compute(inputs, given_slots_plan(inputs, state))
    if inputs.max_running_requests and inputs.mamba_full_memory_ratio is None:
        return size_for_requests(inputs, state, _compute)
    return _compute(inputs, ratio_plan(inputs, state, kv_cell(inputs).total))


def request_state(inputs: LedgerInputs) -> LinearState | WindowState | None:
    """A running request's state outside the token pool: linear layers' states in the model's dtype, or the
    windowed layers' rings in the KV cache's."""
    linear = inputs.model.linear_state(inputs.tp_size, dtype_bytes(inputs.dtype))
    context = inputs.context_length or inputs.model.context_len
    return linear or inputs.model.window_state(inputs.tp_size, kv_cell(inputs).element_bytes, context)


def _compute(inputs: LedgerInputs, plan: StatePlan | None) -> Ledger:
    """The ledger, with a hybrid model's state pool as `plan` sizes it (None: no linear-attention layers)."""
    static, cell, shapes = static_bytes(inputs), kv_cell(inputs), step_shapes(inputs)
    request = PoolRequest(
        static_bytes=static.total + (plan.fixed_bytes if plan else 0),
        cell_bytes=cell.total,
        context=shapes.context,
        reserve_at=lambda running_requests: reserve_bytes(inputs, shapes, running_requests),
        sglang_chunk=shapes.graph_chunk,
    )
    sizing = size_pool(inputs, request)
    tokens = sizing.tokens
    if plan is not None and plan.ratio is not None:
        pool = (tokens + inputs.page_size) * cell.total if tokens > 0 else 0
        plan, tokens = plan.split(pool, cell.total, inputs.page_size)
        plan = clamped(inputs, plan)
    running_requests = (
        resolve_running_requests(inputs, tokens, shapes.context)
        if tokens > 0
        else (inputs.max_running_requests or 1)
    )
    if plan is not None:
        running_requests = max(1, min(running_requests, plan.running_cap))
    state_bytes = plan.slots * plan.state.slot_bytes if plan else 0
    reserve = request_reserve(inputs, shapes, running_requests)
    budget = pool_budget(inputs, static, cell, shapes, reserve, tokens, state_bytes)
    lines = (
        weight_lines(inputs, static)
        + kv_lines(inputs, cell, budget)
        + state_lines(inputs, plan, running_requests)
        + reserve_lines(inputs, shapes, reserve, budget)
    )
    host_lines, host_failure = host_check(
        inputs, budget.pool_bytes, inputs.available_memory_bytes - max(budget.headroom, 0)
    )
    failure = first_failure(inputs, sizing, static.total, shapes, reserve, budget, host_failure)
    too_small = host_tier_too_small(inputs, budget.pool_bytes, cell.total)
    if too_small and (failure is None or failure.moment == "host_memory"):
        raise ValueError(too_small)  # a flag no memory fixes: refused as the bad arguments it is
    if failure is None or failure.moment != "load_weights":  # the state pool is allocated after the weights
        failure = _state_failure(plan) or failure
    return Ledger(
        lines=tuple(lines + host_lines),
        kv_bytes_per_token=cell.total,
        weight_bytes=static.total,
        max_total_num_tokens=tokens,
        max_running_requests=running_requests,
        context_len=shapes.context,
        chunked_prefill_size=shapes.chunk,
        max_prefill_tokens=inputs.max_prefill_tokens,
        mem_fraction_static=min(1.0, sizing.mem_fraction_static),
        mem_fraction_reason=sizing.reason,
        graph_reserve_bytes=reserve.graph_bytes,
        graph_batch_sizes=reserve.graph_batch_sizes,
        graph_prefill_tokens=shapes.prefill_graphs,
        prefill_activation_bytes=shapes.prefill_bytes,
        logits_bytes=reserve.logits_bytes,
        headroom_bytes=budget.headroom,
        fits=failure is None,
        failure=failure,
        device=inputs.device,
        tp_size=inputs.tp_size,
        state_slots=plan.slots if plan else 0,
        state_slot_bytes=plan.state.slot_bytes if plan else 0,
        running_clamp=plan.clamp if plan else "",
    )


def state_lines(inputs: LedgerInputs, plan: StatePlan | None, running_requests: int) -> list[LedgerLine]:
    """A hybrid model's state pool: the running requests' working slots, and the prefix cache's checkpoints."""
    if plan is None:
        return []
    slot, running = plan.state.slot_bytes, min(running_requests, plan.slots)
    checkpoints = plan.checkpoint_slots(running)
    working = (
        f"{running} running requests x {slot:,} B a slot ({plan.state.text()}); "
        f"{plan.slots} slots by {plan.how}"
    )
    spare = (
        f"{checkpoints} slots x {slot:,} B: prefix-cache states every --mamba-track-interval "
        f"{inputs.mamba_track_interval} tokens"
        if not inputs.disable_radix_cache
        else f"{checkpoints} slots x {slot:,} B (radix cache off: no checkpoints are taken)"
    )
    return [
        LedgerLine("state pool", running * slot, working),
        LedgerLine("state checkpoints", checkpoints * slot, spare),
    ]


def _state_failure(plan: StatePlan | None) -> Failure | None:
    if plan is None or plan.running_cap >= 1:
        return None
    message = (
        f"the state pool's {plan.slots} slots ({plan.how}) hold no request: each needs {plan.per_request} slots "
        f"of {human(plan.state.slot_bytes)}"
    )
    return Failure("kv_allocation", message, "")


def context_length_refusal(model: ModelSpec, context_length: int | None, allow: bool) -> str | None:
    """SGLang's rule: a --context-length past the model's longest context is refused unless asked for (`allow`,
    SGLang's environment switch)."""
    overrun = model.context_overrun(context_length)
    if not overrun or allow:
        return None
    return (
        f"{overrun}; use --context-length {model.context_len} or less, or set "
        f"{envs.SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN}=1 to allow it"
    )


def _check_context_length(inputs: LedgerInputs) -> None:
    refusal = context_length_refusal(inputs.model, inputs.context_length, inputs.allow_longer_context)
    if refusal:
        raise ValueError(refusal)


def _validate(inputs: LedgerInputs) -> None:
    # ServerArgs checks the fraction already; inputs built directly get the same rule
    check_mem_fraction_static(inputs.mem_fraction_static)
    _check_context_length(inputs)
    checks = [
        (inputs.tp_size >= 1, "--tp-size must be >= 1"),
        (inputs.available_memory_bytes > 0, "available device memory must be > 0"),
        (inputs.page_size >= 1, "--page-size must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_counts(
        max_total_tokens=inputs.max_total_tokens,
        context_length=inputs.context_length,
        max_running_requests=inputs.max_running_requests,
        chunked_prefill_size=inputs.chunked_prefill_size,
        max_prefill_tokens=inputs.max_prefill_tokens,
        cuda_graph_max_bs=inputs.cuda_graph_max_bs,
        hicache_size=inputs.hicache_size_gb,
        hicache_ratio=inputs.hicache_ratio,
    )


# ---------------------------------------------------------------- the steps


def weight_lines(inputs: LedgerInputs, static: StaticBytes) -> list[LedgerLine]:
    cpu_ranks = (
        f" (RAM / tp {inputs.tp_size})" if not inputs.device.startswith("cuda") and inputs.tp_size > 1 else ""
    )
    blocks = static.blocks
    in_blocks = (
        f"; {' / '.join(blocks.types)} linears kept in their GGUF blocks ({gib(blocks.linear_bytes)}), multiplied "
        f"in {'integers' if inputs.integer_kernels else 'float32'}"
        if blocks
        else ""
    )
    if static.int8_linears:
        in_blocks += "; linears int8 (--quantization int8: 1 B + a float32 scale per row)"
    lines = [
        LedgerLine(
            "available",
            inputs.available_memory_bytes,
            f"free {inputs.device} memory per rank before loading{cpu_ranks}",
        ),
        LedgerLine(
            "weights",
            static.weights,
            inputs.model.weight_text(inputs.tp_size, inputs.dtype, inputs.fp8_weights_kept) + in_blocks,
        ),
    ]
    if static.packed_head:
        how = "in its GGUF blocks" if blocks and blocks.head_bytes else "vocab/tp x hidden x 4 B"
        text = f"CPU prepacked copy of the tied embedding: {how}"
        lines.append(LedgerLine("packed lm head", static.packed_head, text))
    if static.lora_slots:
        text = lora_text(inputs.lora_slots, inputs.lora_rank, inputs.lora_modules, inputs.model.num_layers)
        lines.append(LedgerLine("lora adapter slots", static.lora_slots, text))
    if inputs.draft:
        text = inputs.draft.weight_text(inputs.tp_size, inputs.dtype, inputs.fp8_weights_kept)
        lines.append(LedgerLine("draft weights", static.draft_weights, text))
    return lines


def kv_lines(inputs: LedgerInputs, cell: KvCell, budget: PoolBudget) -> list[LedgerLine]:
    _, value_width, widths = inputs.model.kv_dims(inputs.tp_size)
    cell_text = f"{widths} x {inputs.model.kv_layers} layers x {cell.element_bytes} B ({cell.dtype})"
    if cell.draft:
        cell_text += f" + draft {cell.draft} B"
    pool = budget.pool_bytes
    split = (
        f"K {gib(budget.key_bytes)} + V {gib(pool - budget.key_bytes)}" if value_width else f"KV {gib(pool)}"
    )
    pool_text = f"{budget.tokens:,} tokens + {inputs.page_size} padding x {cell.total} B: {split}"
    return [LedgerLine("kv bytes per token", cell.total, cell_text), LedgerLine("kv pool", pool, pool_text)]


def reserve_lines(
    inputs: LedgerInputs, shapes: StepShapes, reserve: RequestReserve, budget: PoolBudget
) -> list[LedgerLine]:
    requests, cuda = reserve.running_requests, inputs.device.startswith("cuda")
    runtime = "interpreter, tokenizer, allocator slack" + (
        f" + tp {inputs.tp_size}/8 GiB comm" if cuda else ""
    )
    if staging := tier_staging_bytes(inputs):
        runtime += f" + host tier staging {human(staging)}"
    return [
        LedgerLine(
            "request table",
            reserve.request_table_bytes,
            f"{requests} requests x {shapes.context} context x 8 B (int64)",
        ),
        *_guess_lines(inputs, reserve),
        LedgerLine("runtime overhead", shapes.overhead, runtime),
        LedgerLine("graph reserve", reserve.graph_bytes, reserve.graph_text),
        LedgerLine("prefill activations", shapes.prefill_bytes, shapes.prefill_text),
        LedgerLine(
            "logits buffer", reserve.logits_bytes, f"{requests} requests x vocab {shapes.vocab} x 4 B"
        ),
        LedgerLine("headroom", budget.headroom, "available - everything above (must stay >= 0)"),
    ]


def _guess_lines(inputs: LedgerInputs, reserve: RequestReserve) -> list[LedgerLine]:
    """A draft head's guess slots: its pool mirrors the pool's tokens (counted per token above) and holds each
    running request's guesses above them."""
    if not reserve.draft_guess_bytes:
        return []
    text = (
        f"{reserve.running_requests} requests x {inputs.draft_guess_tokens_per_req} guesses "
        f"(topk x (steps + 1)) x draft {kv_cell(inputs).draft} B"
    )
    return [LedgerLine("draft guess slots", reserve.draft_guess_bytes, text)]


def _storage_lines(inputs: LedgerInputs) -> list[LedgerLine]:
    """The file storage tier: no budget of its own (it is bounded by the disk), so the line shows the free disk
    where its files go, shared by every rank and replica using that directory."""
    if inputs.hicache_storage_dir is None:
        return []
    path = Path(inputs.hicache_storage_dir)
    while not path.exists() and path != path.parent:  # not created yet: the disk of its nearest parent
        path = path.parent
    free = shutil.disk_usage(path).free
    return [
        LedgerLine(
            "storage tier disk free", free, f"--hicache-storage-backend file in {inputs.hicache_storage_dir}"
        )
    ]


def _round_up(x: float) -> float:
    """x rounded up to one significant digit: a flag value that is enough, and reads short."""
    step = 10 ** math.floor(math.log10(x))
    return math.ceil(x / step) * step


def _host_tier(inputs: LedgerInputs, pool: int) -> tuple[int, str]:
    """The host tier's bytes per rank, and how the flags give them."""
    size = inputs.hicache_size_gb
    if size > 0:
        return int(size * 1e9), f"--hicache-size {size:g} GB (1e9 B) per rank"
    return int(inputs.hicache_ratio * pool), f"--hicache-ratio {inputs.hicache_ratio:g} x KV pool {gib(pool)}"


def host_tier_too_small(inputs: LedgerInputs, pool: int, token_bytes: int) -> str | None:
    """Why a host tier holds no page of KV, or None: it would hold nothing, and the tiers asked for (the storage
    tier too) would be off. Asked once the device's own moments fit (a pool of 0 is theirs to explain)."""
    per_rank, how = _host_tier(inputs, pool)
    page = inputs.page_size * token_bytes
    if not inputs.enable_hierarchical_cache or per_rank >= page:
        return None
    fix = (
        f"--hicache-size {_round_up(page / 1e9):g} or more (GB per rank)"
        if inputs.hicache_size_gb > 0
        else f"--hicache-ratio {_round_up(page / max(pool, 1)):g} or more"
    )
    return (
        f"the host tier holds no page of KV: {how} = {per_rank:,} B per rank, and one page of "
        f"{inputs.page_size} tokens x {token_bytes:,} B is {page:,} B; give {fix}"
    )


def host_check(inputs: LedgerInputs, pool: int, device_used: int) -> tuple[list[LedgerLine], str | None]:
    """Host tier lines (per rank, per node) and the host-memory failure message, if any."""
    if not inputs.enable_hierarchical_cache:
        return [], None
    per_rank, how = _host_tier(inputs, pool)
    if inputs.host_memory_bytes is not None:
        host = inputs.host_memory_bytes
    else:
        from kiln.platform import host_available_bytes

        host = host_available_bytes()
    reserve = min(10 * GIB, max(GIB, host // 10))
    # on the CPU the KV pools are RAM too
    shared = inputs.tp_size * device_used if not inputs.device.startswith("cuda") else 0
    budget = host - reserve - shared
    node = inputs.tp_size * per_rank
    minus = f" - cpu ranks' own use {gb(shared)}" if shared else ""
    lines = [
        LedgerLine("host tier per rank", per_rank, how),
        LedgerLine(
            "host tier node", node, f"{inputs.tp_size} ranks x {gb(per_rank)} = {gb(node)} of system RAM"
        ),
        LedgerLine("host budget", budget, f"available RAM {gb(host)} - reserve {gb(reserve)}{minus}"),
        *_storage_lines(inputs),
    ]
    if node <= budget:
        return lines, None
    message = (
        f"the hierarchical cache lives in system RAM, not accelerator memory: {how} = {gb(per_rank)} per rank "
        f"x {inputs.tp_size} ranks = {gb(node)} on this node, but only {gb(budget)} is usable "
        f"(available RAM {gb(host)} - reserve {gb(reserve)}{minus})"
    )
    return lines, message


# ---------------------------------------------------------------- the verdict


def first_failure(
    inputs: LedgerInputs,
    sizing: PoolSizing,
    static: int,
    shapes: StepShapes,
    reserve: RequestReserve,
    budget: PoolBudget,
    host_failure: str | None,
) -> Failure | None:
    """The earliest startup moment that would run out of memory, in the order startup reaches them."""
    available, cause = inputs.available_memory_bytes, sizing.cause
    if static + shapes.overhead > available:
        message = (
            f"weights need {gib(static)} per rank (tp {inputs.tp_size}) + runtime {gib(shapes.overhead)}, "
            f"but only {gib(available)} is free per rank"
        )
        return Failure("load_weights", message, "")
    kv_failure = _kv_failure(sizing, static, available, budget)
    if kv_failure is not None:
        return kv_failure
    if host_failure:
        return Failure("host_memory", host_failure, "")
    if budget.after_pool < reserve.graph_bytes:
        message = (
            f"{cause} leaves {gib(budget.after_pool)} after the KV pool; graph capture needs "
            f"{gib(reserve.graph_bytes)} ({reserve.graph_text})"
        )
        return Failure("graph_capture", message, "")
    after_capture = budget.after_pool - reserve.graph_bytes
    prefill, logits = shapes.prefill_bytes, reserve.logits_bytes
    if after_capture < prefill + logits:
        message = (
            f"{cause} leaves {gib(after_capture)} after capture; a full {shapes.prefill_tokens}-token prefill "
            f"needs {gib(prefill + logits)} (activations {gib(prefill)} + logits buffer {gib(logits)})"
        )
        return Failure("first_full_prefill", message, "")
    return None


def _kv_failure(sizing: PoolSizing, static: int, available: int, budget: PoolBudget) -> Failure | None:
    """The KV allocation fails: no pool at all, less than an absolute target, or more than the memory holds."""
    tokens, cell, cause = budget.tokens, budget.cell_bytes, sizing.cause
    if tokens <= 0:
        message = (
            f"{cause}: weights {gib(static)} leave no memory for the KV cache after the reserve for runtime, "
            f"capture and prefill ({gib(available)} free per rank)"
        )
    elif sizing.target and tokens < sizing.target.tokens:
        want = sizing.target.tokens
        message = (
            f"{sizing.target.flags} needs {want:,} tokens = {gib(want * cell)} of KV, but {cause} gives a pool "
            f"of {tokens:,} tokens ({gib(tokens * cell)})"
        )
    elif budget.after_pool < 0:
        message = (
            f"{cause}: weights {gib(static)} + KV pool {gib(tokens * cell)} + request table and runtime exceed "
            f"the {gib(available)} free per rank"
        )
    else:
        return None
    return Failure("kv_allocation", message, "")
