"""How large the KV pool is: the memory ledger's sizing decision (kiln/memory/ledger.py), pure arithmetic like the
rest of it."""

from __future__ import annotations

import math
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


def resolve_running_requests(inp: LedgerInputs, tokens: int, ctx: int) -> int:
    if inp.max_running_requests:
        want = inp.max_running_requests
    elif inp.device.startswith("cuda"):
        want = min(max(int(tokens / max(ctx, 1) * 512), 2048), 4096)
    else:
        want = CPU_MAX_RUNNING_REQUESTS
    return max(1, min(want, tokens // 2))


@dataclass
class PoolSizing:
    tokens: int
    mfs: float
    reason: str
    cause: str
    target: tuple[int, str] | None  # (tokens required by an absolute target, its description)


def size_pool(
    inp: LedgerInputs, static: int, cell: int, ctx: int, need_at, static_chunk: int = 0
) -> PoolSizing:
    """Decide the KV pool token count and the mem_fraction_static it corresponds to."""
    pre, page = inp.available_memory_bytes, inp.page_size
    target = None
    if inp.context_length and inp.max_running_requests:
        n = inp.context_length * inp.max_running_requests
        target = (
            n,
            f"--context-length {inp.context_length} x --max-running-requests {inp.max_running_requests}",
        )
    elif inp.context_length:
        target = (inp.context_length, f"--context-length {inp.context_length}")
    if inp.max_total_tokens and (target is None or inp.max_total_tokens > target[0]):
        target = (inp.max_total_tokens, f"--max-total-tokens {inp.max_total_tokens}")

    def tokens_for(mfs: float) -> int:
        return max(0, (int((pre * mfs - static) // cell) - page) // page * page)

    if inp.mem_fraction_static is not None:
        mfs = inp.mem_fraction_static
        tokens = tokens_for(mfs)
        if inp.max_total_tokens and inp.max_total_tokens <= tokens:
            tokens = inp.max_total_tokens // page * page
        return PoolSizing(
            tokens, mfs, f"--mem-fraction-static {mfs:g} given", f"--mem-fraction-static {mfs:g}", target
        )
    if inp.max_total_tokens:
        tokens = inp.max_total_tokens // page * page
        mfs = round((static + (tokens + page) * cell) / pre, 3)
        reason = f"derived from --max-total-tokens {inp.max_total_tokens}: (weights + KV pool) / available = {mfs:.3f}"
        # a pool smaller than one full context is a valid setup: requests that cannot fit are refused one by one
        return PoolSizing(tokens, mfs, reason, f"--max-total-tokens {inp.max_total_tokens}", None)
    upper = max(0, (pre - static) // cell)
    need = need_at(resolve_running_requests(inp, upper, ctx))
    if inp.device.startswith("cuda"):
        # The ledger's own reserve, but never less than SGLang's empirical one (1.5 MiB per prefill token, ...):
        # allocator fragmentation and library workspaces are not in the ledger's lines.
        floor_ = sglang_reserve(inp, static_chunk)
        reserve = max(need, floor_)
        mfs = math.floor((pre - reserve) / pre * 1000) / 1000
        which = (
            "the ledger's runtime + capture + peak prefill + logits + request table"
            if need >= floor_
            else (f"SGLang's reserve formula (above the ledger's {gib(need)})")
        )
        reason = (
            f"chosen so the headroom covers {which} = {gib(reserve)} of {gib(pre)} free: "
            f"floor((free - reserve) / free) = {mfs:.3f}"
        )
        return PoolSizing(
            tokens_for(mfs), mfs, reason, f"the default --mem-fraction-static {mfs:.3f}", target
        )
    room = max(0, (pre - static - need) // cell - page)
    by_ram = int(CPU_POOL_RAM_FRACTION * pre) // cell
    by_use = (inp.max_running_requests or CPU_MAX_RUNNING_REQUESTS) * ctx
    both = bool(inp.context_length and inp.max_running_requests)  # an absolute pool target
    want = target[0] if both else max(min(by_ram, by_use), target[0] if target else 0)
    tokens = max(0, min(want, room) // page * page)
    mfs = round((static + (tokens + page) * cell) / pre, 3)
    why = (
        f"target {target[1]} = {want:,} tokens"
        if both
        else f"min({CPU_POOL_RAM_FRACTION:.0%} of available RAM = {by_ram:,} tokens, "
        f"{inp.max_running_requests or CPU_MAX_RUNNING_REQUESTS} requests x {ctx} context = {by_use:,} tokens)"
    )
    reason = (
        f"cpu default: KV pool = {why}, capped by what leaves headroom for peak prefill "
        f"({room:,} tokens), so Kiln does not take over a shared machine; "
        f"(weights + pool) / available = {mfs:.3f}"
    )
    return PoolSizing(tokens, mfs, reason, "the default KV pool", target)
