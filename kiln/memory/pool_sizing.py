"""How large the KV pool is: the memory ledger's sizing decision (kiln/memory/ledger.py), pure arithmetic like the
rest of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kiln.core.units import gib
from kiln.memory.graph_budget import sglang_reserve
from kiln.memory.ledger_types import LedgerInputs

# CPU defaults, chosen for a shared 2-core / 24 GiB machine:
# - the KV pool takes at most 25% of the available RAM (or what CPU_MAX_RUNNING_REQUESTS x context needs,
#   if smaller), so Kiln does not grab a machine it shares with the tokenizer, the client and other work;
# - 128 running requests: two cores saturate well below that, and the logits/request tables stay small.
CPU_POOL_RAM_FRACTION = 0.25
CPU_MAX_RUNNING_REQUESTS = 128

# Bytes the ledger reserves beside the weights and the KV pool when `running_requests` decode at once.
ReserveAt = Callable[[int], int]


def resolve_running_requests(inputs: LedgerInputs, tokens: int, context: int) -> int:
    if inputs.max_running_requests:
        want = inputs.max_running_requests
    elif inputs.device.startswith("cuda"):
        want = min(max(int(tokens / max(context, 1) * 512), 2048), 4096)
    else:
        want = CPU_MAX_RUNNING_REQUESTS
    return max(1, min(want, tokens // 2))


@dataclass(frozen=True)
class PoolTarget:
    """A pool size the flags require outright, and the flags in words."""

    tokens: int
    flags: str


@dataclass(frozen=True)
class PoolSizing:
    tokens: int
    mem_fraction_static: float
    reason: str  # how the fraction was chosen, for the table
    cause: str  # the flag or default that set the pool, for failure messages
    target: PoolTarget | None  # the size an absolute target requires, checked against the pool


@dataclass(frozen=True)
class PoolRequest:
    """What sizing the pool starts from: the fixed bytes, the bytes of one token's KV, and the context."""

    static_bytes: int  # weights and their copies, per rank
    cell_bytes: int  # KV bytes per token
    context: int
    reserve_at: ReserveAt
    sglang_chunk: int  # the prefill chunk SGLang's reserve formula is given

    def tokens_for(self, inputs: LedgerInputs, fraction: float) -> int:
        """Whole pages of KV that fit in `fraction` of the available memory after the weights, less the padding
        page."""
        page = inputs.page_size
        rest = inputs.available_memory_bytes * fraction - self.static_bytes
        return max(0, (int(rest // self.cell_bytes) - page) // page * page)

    def fraction_of(self, inputs: LedgerInputs, tokens: int) -> float:
        """The mem_fraction_static a pool of `tokens` (plus the padding page) and the weights amount to."""
        used = self.static_bytes + (tokens + inputs.page_size) * self.cell_bytes
        return round(used / inputs.available_memory_bytes, 3)


def absolute_target(inputs: LedgerInputs) -> PoolTarget | None:
    """The largest pool the flags require outright: context x requests, one context, or --max-total-tokens."""
    target = None
    if inputs.context_length and inputs.max_running_requests:
        target = PoolTarget(
            inputs.context_length * inputs.max_running_requests,
            f"--context-length {inputs.context_length} x --max-running-requests {inputs.max_running_requests}",
        )
    elif inputs.context_length:
        target = PoolTarget(inputs.context_length, f"--context-length {inputs.context_length}")
    if inputs.max_total_tokens and (target is None or inputs.max_total_tokens > target.tokens):
        target = PoolTarget(inputs.max_total_tokens, f"--max-total-tokens {inputs.max_total_tokens}")
    return target


def size_pool(inputs: LedgerInputs, request: PoolRequest) -> PoolSizing:
    """Decide the KV pool token count and the mem_fraction_static it corresponds to."""
    target = absolute_target(inputs)
    if inputs.mem_fraction_static is not None:
        return _by_given_fraction(inputs, request, target)
    if inputs.max_total_tokens:
        return _by_max_total_tokens(inputs, request)
    if inputs.device.startswith("cuda"):
        return _cuda_default(inputs, request, target)
    return _cpu_default(inputs, request, target)


def _by_given_fraction(inputs: LedgerInputs, request: PoolRequest, target: PoolTarget | None) -> PoolSizing:
    fraction = inputs.mem_fraction_static
    tokens = request.tokens_for(inputs, fraction)
    if inputs.max_total_tokens and inputs.max_total_tokens <= tokens:
        tokens = inputs.max_total_tokens // inputs.page_size * inputs.page_size
    flag = f"--mem-fraction-static {fraction:g}"
    return PoolSizing(tokens, fraction, f"{flag} given", flag, target)


def _by_max_total_tokens(inputs: LedgerInputs, request: PoolRequest) -> PoolSizing:
    tokens = inputs.max_total_tokens // inputs.page_size * inputs.page_size
    fraction = request.fraction_of(inputs, tokens)
    flag = f"--max-total-tokens {inputs.max_total_tokens}"
    reason = f"derived from {flag}: (weights + KV pool) / available = {fraction:.3f}"
    # a pool smaller than one full context is a valid setup: requests that cannot fit are refused one by one
    return PoolSizing(tokens, fraction, reason, flag, None)


def _most_tokens(inputs: LedgerInputs, request: PoolRequest) -> int:
    """KV tokens if everything after the weights went to the pool: sizes the running requests to reserve for."""
    return max(0, (inputs.available_memory_bytes - request.static_bytes) // request.cell_bytes)


def _cuda_default(inputs: LedgerInputs, request: PoolRequest, target: PoolTarget | None) -> PoolSizing:
    available = inputs.available_memory_bytes
    ledger_reserve = request.reserve_at(
        resolve_running_requests(inputs, _most_tokens(inputs, request), request.context)
    )
    # The ledger's own reserve, but never less than SGLang's empirical one (1.5 MiB per prefill token, ...):
    # allocator fragmentation and library workspaces are not in the ledger's lines.
    sglang_floor = sglang_reserve(inputs, request.sglang_chunk)
    reserve = max(ledger_reserve, sglang_floor)
    fraction = math.floor((available - reserve) / available * 1000) / 1000
    which = (
        "the ledger's runtime + capture + peak prefill + logits + request table"
        if ledger_reserve >= sglang_floor
        else f"SGLang's reserve formula (above the ledger's {gib(ledger_reserve)})"
    )
    reason = (
        f"chosen so the headroom covers {which} = {gib(reserve)} of {gib(available)} free: "
        f"floor((free - reserve) / free) = {fraction:.3f}"
    )
    cause = f"the default --mem-fraction-static {fraction:.3f}"
    return PoolSizing(request.tokens_for(inputs, fraction), fraction, reason, cause, target)


def _cpu_default(inputs: LedgerInputs, request: PoolRequest, target: PoolTarget | None) -> PoolSizing:
    """The smaller of a share of the RAM and what the running requests can use, capped by what leaves room for
    the reserve; an absolute target (context x requests) replaces the first two."""
    available, cell, page = inputs.available_memory_bytes, request.cell_bytes, inputs.page_size
    requests = inputs.max_running_requests or CPU_MAX_RUNNING_REQUESTS
    reserve = request.reserve_at(
        resolve_running_requests(inputs, _most_tokens(inputs, request), request.context)
    )
    room = max(0, (available - request.static_bytes - reserve) // cell - page)
    by_ram = int(CPU_POOL_RAM_FRACTION * available) // cell
    by_use = requests * request.context
    both = bool(inputs.context_length and inputs.max_running_requests)  # an absolute pool target
    want = target.tokens if both else max(min(by_ram, by_use), target.tokens if target else 0)
    tokens = max(0, min(want, room) // page * page)
    fraction = request.fraction_of(inputs, tokens)
    why = (
        f"target {target.flags} = {want:,} tokens"
        if both
        else f"min({CPU_POOL_RAM_FRACTION:.0%} of available RAM = {by_ram:,} tokens, "
        f"{requests} requests x {request.context} context = {by_use:,} tokens)"
    )
    reason = (
        f"cpu default: KV pool = {why}, capped by what leaves headroom for peak prefill "
        f"({room:,} tokens), so Kiln does not take over a shared machine; "
        f"(weights + pool) / available = {fraction:.3f}"
    )
    return PoolSizing(tokens, fraction, reason, "the default KV pool", target)
