"""Prediction vs measurement: the ledger's figures next to what was really allocated."""

from __future__ import annotations

import resource

from kiln.core.units import GIB
from kiln.memory.ledger import Ledger


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_check(ledger: Ledger, measured: dict[str, int]) -> list[dict]:
    """One row per figure both sides know: predicted bytes, measured bytes, relative error."""
    predicted = {
        "weights": ledger.line("weights").bytes,
        "packed_lm_head": ledger.line("packed lm head").bytes if ledger.has_line("packed lm head") else 0,
        "kv_pool": ledger.line("kv pool").bytes,
        "req_table": ledger.line("request table").bytes,
        "lora_slots": ledger.line("lora adapter slots").bytes if ledger.has_line("lora adapter slots") else 0,
        "graph_capture": ledger.graph_reserve_bytes,
        "warmup_peak": ledger.prefill_activation_bytes + ledger.logits_bytes,
    }
    rows = []
    for name, pred in predicted.items():
        if name not in measured:
            continue
        meas = measured[name]
        err = (meas - pred) / pred if pred else float(meas > 0)  # allocated but not predicted: +100%
        rows.append({"name": name, "predicted": pred, "measured": meas, "error": round(err, 4)})
    return rows


def format_check(rows: list[dict]) -> str:
    return "; ".join(
        f"{r['name']} predicted {r['predicted'] / GIB:.3f} GB, measured {r['measured'] / GIB:.3f} GB "
        f"({r['error'] * 100:+.1f}%)"
        for r in rows
    )
