"""The state pool of hybrid linear-attention models in the memory ledger: how many state slots, and how many
running requests they and the KV pool hold together.

A running request holds one state slot (its working state, in its request-table row) and, with the radix cache
on, the prefix cache keeps checkpoint states in spare slots (SGLang keeps three slots per running request; Kiln
keeps the same: one working, CHECKPOINT_SLOTS_PER_REQUEST checkpoints). Three ways to size it, as SGLang's flags
ask:
- --max-mamba-cache-size: the slots are given; the KV pool gets what is left.
- --max-running-requests without --mamba-full-memory-ratio: Kiln's own sizing, both pools for that many requests
  at the full context (so neither runs out first), the request count clamped to what fits.
- otherwise SGLang's split: the pool memory divided states : KV = ratio : 1 (its default 0.9).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kiln.core.units import gib, human
from kiln.memory.ledger_types import Ledger, LedgerInputs
from kiln.models.spec import LinearState, WindowState

# Checkpoint slots the prefix cache gets per running request (SGLang's MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
# is 3 slots per request: the working one and two for cached prefixes).
CHECKPOINT_SLOTS_PER_REQUEST = 2
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's default


@dataclass(frozen=True)
class StatePlan:
    """The state pool the ledger sizes: its slots, the running requests they allow and how it was decided."""

    state: LinearState | WindowState
    slots: int  # 0 until a ratio split decides them
    running_cap: int  # running requests the slots hold
    per_request: int  # slots one running request accounts for (working + checkpoints)
    how: str  # the sizing rule in words, for the line
    ratio: float | None = (
        None  # SGLang's split of the pool memory; None: the slots are fixed before the KV pool
    )
    clamp: str = ""  # the one line saying why and by how much asked-for concurrency was lowered

    @property
    def fixed_bytes(self) -> int:
        """State bytes set aside before the KV pool is sized (none under a ratio split: it splits the pool)."""
        return self.slots * self.state.slot_bytes if self.ratio is None else 0

    def split(self, pool_bytes: int, cell_bytes: int, page: int) -> tuple[StatePlan, int]:
        """SGLang's split of the pool memory: states ratio / (1 + ratio) of it, KV the rest (whole pages, less
        the padding page); the plan with its slots, and the KV tokens."""
        assert self.ratio is not None
        slots = int(pool_bytes * self.ratio / (1 + self.ratio)) // self.state.slot_bytes
        tokens = max(0, ((pool_bytes - slots * self.state.slot_bytes) // cell_bytes - page) // page * page)
        return replace(self, slots=slots, running_cap=slots // self.per_request), tokens

    def checkpoint_slots(self, running_requests: int) -> int:
        return max(0, self.slots - running_requests)


def per_request_slots(inputs: LedgerInputs) -> int:
    return 1 if inputs.disable_radix_cache else 1 + CHECKPOINT_SLOTS_PER_REQUEST


def _slots_words(per_request: int) -> str:
    return "1 working" + (f" + {per_request - 1} checkpoints" if per_request > 1 else "")


def given_slots_plan(inputs: LedgerInputs, state: LinearState | WindowState) -> StatePlan:
    slots, per_request = int(inputs.max_mamba_cache_size or 0), per_request_slots(inputs)
    how = f"--max-mamba-cache-size {slots}"
    return clamped(inputs, StatePlan(state, slots, slots // per_request, per_request, how))


def ratio_plan(inputs: LedgerInputs, state: LinearState | WindowState, cell_bytes: int) -> StatePlan:
    if isinstance(state, WindowState):
        # SGLang's windowed : full pool tokens, as a memory ratio: ring bytes a token over full KV bytes a token
        tokens = inputs.swa_full_tokens_ratio
        ratio = tokens * state.slot_bytes / state.tokens / cell_bytes
        how = (
            f"--swa-full-tokens-ratio {tokens:g}: windowed-layer tokens {tokens:g} x the full-attention pool's, "
            f"{ratio:.3g} : 1 of the pool memory"
        )
    else:
        ratio = inputs.mamba_full_memory_ratio or DEFAULT_MAMBA_FULL_MEMORY_RATIO
        how = f"--mamba-full-memory-ratio {ratio:g}: states {ratio:g} / (1 + {ratio:g}) of the pool memory"
    return StatePlan(state, 0, 0, per_request_slots(inputs), how, ratio=ratio)


def clamped(inputs: LedgerInputs, plan: StatePlan) -> StatePlan:
    """The plan with its clamp line when its slots hold fewer running requests than --max-running-requests."""
    asked = inputs.max_running_requests
    if not asked or asked <= plan.running_cap:
        return plan
    line = (
        f"--max-running-requests {asked} clamped to {plan.running_cap} ({asked - plan.running_cap} fewer): the "
        f"state pool's {plan.slots} slots ({plan.how}) hold {plan.running_cap} requests x {plan.per_request} "
        f"slots ({_slots_words(plan.per_request)})"
    )
    return replace(plan, clamp=line)


def requests_plan(inputs: LedgerInputs, state: LinearState | WindowState, running: int) -> StatePlan:
    per_request = per_request_slots(inputs)
    how = f"{running} running requests x {per_request} slots ({_slots_words(per_request)})"
    return StatePlan(state, running * per_request, running, per_request, how)


Compute = Callable[[LedgerInputs, StatePlan], Ledger]


def size_for_requests(inputs: LedgerInputs, state: LinearState | WindowState, compute: Compute) -> Ledger:
    """Kiln's own sizing: KV for --max-running-requests at the full context and their state slots, both set aside;
    when that does not fit, the most requests that do, with one line saying why and by how much."""
    asked = int(inputs.max_running_requests or 1)
    context = inputs.context_length or inputs.model.context_len
    at = replace(inputs, context_length=context)

    def trial(running: int) -> Ledger:
        return compute(replace(at, max_running_requests=running), requests_plan(at, state, running))

    first = trial(asked)
    if first.fits or asked == 1 or not trial(1).fits:
        return first
    lo, hi = 1, asked - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if trial(mid).fits else (lo, mid - 1)
    fitted = trial(lo)
    per_request = per_request_slots(inputs)

    def need(running: int) -> str:
        kv = running * context * fitted.kv_bytes_per_token
        states = running * per_request * state.slot_bytes
        return f"{running} x ({context:,} tokens KV + {per_request} state slots) = {gib(kv + states)}"

    line = (
        f"--max-running-requests {asked} clamped to {lo} ({asked - lo} fewer): {need(asked)} does not fit "
        f"beside the weights and the reserve; {need(lo)} does ({human(state.slot_bytes)} a state slot, "
        f"{fitted.kv_bytes_per_token:,} B of KV a token)"
    )
    return replace(fitted, running_clamp=line)
