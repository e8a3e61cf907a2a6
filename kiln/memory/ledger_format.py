"""Ledger presentation: the table, JSON, the verdict and the refusal `kiln serve` prints."""

from __future__ import annotations

import json

from kiln.core.units import human
from kiln.memory.ledger_types import Ledger

MOMENT_WORDS = {
    "load_weights": "weight loading",
    "kv_allocation": "KV cache allocation",
    "host_memory": "host memory (hierarchical cache)",
    "graph_capture": "graph capture",
    "first_full_prefill": "the first full prefill",
}


def format_table(ledger: Ledger, title: str = "") -> str:
    head = title or f"Kiln memory ledger: {ledger.device}, tp {ledger.tp_size}, per rank"
    width = max(len(x.name) for x in ledger.lines)
    rows = [head, f"  {'line':<{width}}  {'size':>11}  inputs"]
    rows += [f"  {x.name:<{width}}  {human(x.bytes):>11}  {x.inputs}" for x in ledger.lines]
    rows.append(
        f"  max_total_num_tokens={ledger.max_total_num_tokens}, chunked_prefill_size={ledger.chunked_prefill_size}, "
        f"max_prefill_tokens={ledger.max_prefill_tokens}, max_running_requests={ledger.max_running_requests}, "
        f"context_len={ledger.context_len}, mem_fraction_static={ledger.mem_fraction_static:.3f}"
    )
    rows.append(f"  mem_fraction_static: {ledger.mem_fraction_reason}")
    if ledger.state_slots:
        rows.append(
            f"  state pool: {ledger.state_slots} slots = {ledger.max_running_requests} running requests "
            f"+ {ledger.checkpoint_slots} prefix-cache checkpoints, {ledger.state_slot_bytes:,} B each"
        )
    if ledger.running_clamp:
        rows.append(f"  clamped: {ledger.running_clamp}")
    return "\n".join(rows)


def format_verdict(ledger: Ledger) -> str:
    if ledger.failure is None:
        verdict = f"verdict: fits ({ledger.max_total_num_tokens:,} KV tokens, headroom {human(ledger.headroom_bytes)} per rank)"
        if ledger.max_total_num_tokens < ledger.context_len:  # fits, yet caps every request below the context
            verdict += (
                f"\n  note: the pool holds fewer tokens than context_len {ledger.context_len:,}: no request can be "
                f"longer than {ledger.max_total_num_tokens:,} tokens (prompt + max_tokens)"
            )
        return verdict
    f = ledger.failure
    return f"verdict: does not fit: {MOMENT_WORDS.get(f.moment, f.moment)} fails: {f.message}\n  fix: {f.fix}"


def format_refusal(ledger: Ledger) -> str:
    """The message `kiln serve` prints when it refuses to start (same wording as `kiln plan`)."""
    f = ledger.failure
    if f is None:
        return ""
    return (
        f"Kiln will not start: memory would run out at {MOMENT_WORDS.get(f.moment, f.moment)} "
        f"({f.moment}).\n  {f.message}\n  fix: {f.fix}\n  (`kiln plan` with the same arguments prints the full ledger)"
    )


def ledger_json(ledger: Ledger, **extra: object) -> str:
    """The ledger as JSON with its verdict, and the `extra` keys (`kiln plan --json`'s platform)."""
    data = ledger.to_dict()
    data["verdict"] = "fits" if ledger.fits else "does_not_fit"
    return json.dumps({**data, **extra}, indent=2)
