"""When the ledger does not fit: the smallest change of flags that does, each candidate verified by recomputing
the ledger with it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

from kiln.core.units import gib
from kiln.memory.ledger_types import Ledger, LedgerInputs
from kiln.memory.model_shapes import dtype_bytes, param_counts, weight_bytes

Core = Callable[[LedgerInputs], Ledger]
Candidate = tuple[dict, LedgerInputs, str]


def _fits(core: Core, inp: LedgerInputs) -> bool:
    try:
        return core(inp).fits
    except ValueError:
        return False


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest n in [lo, hi] with ok(n), assuming ok holds below some threshold."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _mfs_scan(inp: LedgerInputs, core: Core, step: int) -> int | None:
    """The passing mem_fraction_static (in thousandths) closest to the current one in one direction."""
    cur = round(inp.mem_fraction_static * 1000)
    ok = lambda m: 0 < m <= 1000 and _fits(core, replace(inp, mem_fraction_static=m / 1000))  # noqa: E731
    coarse = next(
        (m for m in range(cur + 10 * step, cur + 1000 * step, 10 * step) if 0 < m <= 1000 and ok(m)), None
    )
    if coarse is None:
        return None
    return next(m for m in range(coarse - 9 * step, coarse + step, step) if m == coarse or ok(m))


def _mfs_candidate(inp: LedgerInputs, core: Core) -> Candidate | None:
    cur = round(inp.mem_fraction_static * 1000)
    found = [m for m in (_mfs_scan(inp, core, -1), _mfs_scan(inp, core, 1)) if m is not None]
    if not found:
        return None
    best = min(found, key=lambda m: abs(m - cur))
    value = f"{best / 1000:g}"
    text = f"--mem-fraction-static <= {value}"
    if (
        best > cur
    ):  # raising it: also say how far it can go while the headroom still covers capture and prefill
        top = _largest(best, 1000, lambda m: _fits(core, replace(inp, mem_fraction_static=m / 1000)))
        text = f"--mem-fraction-static >= {value} (up to {top / 1000:g} still fits)"
    return {"--mem-fraction-static": value}, replace(inp, mem_fraction_static=best / 1000), text


def _device_candidates(inp: LedgerInputs, ledger: Ledger, core: Core) -> Iterator[Candidate]:
    moment, cuda = ledger.failure.moment, inp.device.startswith("cuda")
    if inp.mem_fraction_static is not None and moment != "load_weights":
        found = _mfs_candidate(inp, core)
        if found:
            yield found
    if inp.max_total_tokens and moment != "load_weights":
        n = _largest(1, inp.max_total_tokens - 1, lambda n: _fits(core, replace(inp, max_total_tokens=n)))
        if n:
            yield (
                {"--max-total-tokens": str(n)},
                replace(inp, max_total_tokens=n),
                f"--max-total-tokens <= {n}",
            )
    if inp.max_running_requests and moment in ("kv_allocation", "first_full_prefill"):
        n = _largest(
            1, inp.max_running_requests - 1, lambda n: _fits(core, replace(inp, max_running_requests=n))
        )
        if n:
            yield (
                {"--max-running-requests": str(n)},
                replace(inp, max_running_requests=n),
                f"--max-running-requests {n}",
            )
    if inp.context_length and moment == "kv_allocation":
        n = _largest(1, inp.context_length - 1, lambda n: _fits(core, replace(inp, context_length=n)))
        if n:
            yield {"--context-length": str(n)}, replace(inp, context_length=n), f"--context-length {n}"
    if moment != "load_weights":
        chunk = ledger.chunked_prefill_size if ledger.chunked_prefill_size > 0 else ledger.max_prefill_tokens
        size = 1 << max(0, math.ceil(math.log2(chunk)) - 1)
        while size >= 128:
            trial = replace(inp, chunked_prefill_size=size)
            if _fits(core, trial):
                yield {"--chunked-prefill-size": str(size)}, trial, f"--chunked-prefill-size {size}"
                break
            size //= 2
    if cuda and not inp.disable_cuda_graph and moment in ("graph_capture", "kv_allocation"):
        trial = replace(inp, disable_cuda_graph=True)
        if _fits(core, trial):
            yield {"--disable-cuda-graph": ""}, trial, "--disable-cuda-graph"
    if cuda and inp.kv_cache_dtype in (None, "auto") and moment == "kv_allocation":
        trial = replace(inp, kv_cache_dtype="fp8_e4m3")
        if _fits(core, trial):
            yield {"--kv-cache-dtype": "fp8_e4m3"}, trial, "--kv-cache-dtype fp8_e4m3 (half the KV bytes)"
    if dtype_bytes(inp.dtype) > 2:
        trial = replace(inp, dtype="bfloat16")
        if _fits(core, trial):
            w = weight_bytes(inp.hf_config, inp.tp_size, 2)
            yield {"--dtype": "bfloat16"}, trial, f"--dtype bfloat16 (weights {gib(w)} per rank)"
    if cuda:
        for tp in (2, 4, 8, 16):
            trial = replace(inp, tp_size=tp)
            if tp > inp.tp_size and _fits(core, trial):
                w = weight_bytes(inp.hf_config, tp, dtype_bytes(inp.dtype))
                yield {"--tp-size": str(tp)}, trial, f"--tp-size {tp} (weights {gib(w)} per rank)"
                break


def _host_candidates(inp: LedgerInputs, ledger: Ledger, core: Core) -> Iterator[Candidate]:
    budget = ledger.line("host budget").bytes
    pool = ledger.line("kv pool").bytes
    if budget <= 0:
        return
    per_rank = budget / inp.tp_size
    size = math.floor(per_rank / 1e8) / 10
    usable = f"{budget / 1e9:.1f} GB usable / {inp.tp_size} ranks"
    trial = replace(inp, hicache_size_gb=size)
    if size > 0 and _fits(core, trial):
        yield {"--hicache-size": f"{size:g}"}, trial, f"--hicache-size <= {size:g} (GB per rank: {usable})"
    ratio = math.floor(per_rank / pool * 100) / 100 if pool else 0
    trial = replace(inp, hicache_size_gb=0.0, hicache_ratio=ratio)
    if ratio > 0 and _fits(core, trial):
        yield (
            {"--hicache-ratio": f"{ratio:g}", "--hicache-size": "0"},
            trial,
            f"--hicache-ratio <= {ratio:g} (x KV pool {gib(pool)} per rank)",
        )


def find_fix(inp: LedgerInputs, ledger: Ledger, core: Core) -> tuple[str, dict]:
    """The smallest change (verified by recomputing the ledger) and up to one alternative."""
    gen = _host_candidates if ledger.failure.moment == "host_memory" else _device_candidates
    found: list[Candidate] = []
    for cand in gen(inp, ledger, core):
        found.append(cand)
        if len(found) == 2:
            break
    if found:
        return "use " + ", or ".join(c[2] for c in found), found[0][0]
    if ledger.failure.moment == "host_memory":
        return "free system RAM, or run without --enable-hierarchical-cache", {}
    need = ledger.weight_bytes + ledger.line("runtime overhead").bytes
    where = (
        "a GPU with more memory or more GPUs" if inp.device.startswith("cuda") else "a machine with more RAM"
    )
    linear, other = param_counts(inp.hf_config, inp.tp_size)
    q4 = (linear + other) * 0.5625  # ~4.5 bits per parameter with scales
    return (
        f"no flag fixes this here: the weights alone need {gib(need)} per rank with the runtime and "
        f"{gib(inp.available_memory_bytes)} is free; use {where}, or a smaller model "
        f"(a 4-bit quantization of this one is about {gib(q4)} per rank)",
        {},
    )
