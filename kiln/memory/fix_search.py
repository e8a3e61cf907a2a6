"""When the ledger does not fit: the smallest change of flags that does, each candidate verified by recomputing
the ledger with it, and offered only when `kiln serve` accepts its flags today."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from kiln.config import ServerArgs
from kiln.core.dtypes import dtype_bytes, kv_cache_dtype_name
from kiln.core.units import gib
from kiln.memory.ledger_states import per_request_slots
from kiln.memory.ledger_types import Ledger, LedgerInputs

Core = Callable[[LedgerInputs], Ledger]


@dataclass(frozen=True)
class Candidate:
    flags: dict[str, str]  # serve flags; "" for a flag without a value
    inputs: LedgerInputs  # the ledger's inputs with the change, verified to fit
    text: str  # the change in words, with the numbers verified


def flags_argv(flags: dict[str, str]) -> list[str]:
    """Serve flags as command-line words: {"--disable-cuda-graph": "", "--tp-size": "2"} -> [flag, flag, "2"]."""
    argv: list[str] = []
    for flag, value in flags.items():
        argv += [flag] if value == "" else [flag, value]
    return argv


class _RefusingParser(argparse.ArgumentParser):
    """Reports a flag it refuses as a ValueError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message)


@functools.cache
def _serve_parser() -> argparse.ArgumentParser:
    parser = _RefusingParser(prog="kiln serve", add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def serve_accepts(flags: dict[str, str]) -> bool:
    """Whether `kiln serve` takes these flags today: its parser and ServerArgs' checks accept them. A fix serve
    would refuse is searched for but not offered, so the search offers it by itself once serve accepts it."""
    try:
        ServerArgs.from_cli(_serve_parser().parse_args(flags_argv(flags)))
    except (ValueError, argparse.ArgumentError):
        return False
    return True


def _fits(core: Core, inputs: LedgerInputs) -> bool:
    try:
        return core(inputs).fits
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


# mem_fraction_static in thousandths; the fraction must stay in (0, 1)
_PER_MILLE = 1000


def _fraction_fits(inputs: LedgerInputs, core: Core, per_mille: int) -> bool:
    fraction = replace(inputs, mem_fraction_static=per_mille / _PER_MILLE)
    return 0 < per_mille < _PER_MILLE and _fits(core, fraction)


def _fraction_scan(inputs: LedgerInputs, core: Core, step: int) -> int | None:
    """The passing mem_fraction_static (in thousandths) closest to the current one in one direction."""
    current = round(inputs.mem_fraction_static * _PER_MILLE)
    coarse_steps = range(current + 10 * step, current + _PER_MILLE * step, 10 * step)
    coarse = next((m for m in coarse_steps if _fraction_fits(inputs, core, m)), None)
    if coarse is None:
        return None
    return next(
        m
        for m in range(coarse - 9 * step, coarse + step, step)
        if m == coarse or _fraction_fits(inputs, core, m)
    )


def _fraction_candidate(inputs: LedgerInputs, core: Core) -> Candidate | None:
    current = round(inputs.mem_fraction_static * _PER_MILLE)
    found = [m for m in (_fraction_scan(inputs, core, -1), _fraction_scan(inputs, core, 1)) if m is not None]
    if not found:
        return None
    best = min(found, key=lambda m: abs(m - current))
    value = f"{best / _PER_MILLE:g}"
    text = f"--mem-fraction-static <= {value}"
    if (
        best > current
    ):  # raising it: also say how far it can go while the headroom still covers capture and prefill
        top = _largest(best, _PER_MILLE - 1, lambda m: _fraction_fits(inputs, core, m))
        text = f"--mem-fraction-static >= {value} (up to {top / _PER_MILLE:g} still fits)"
    return Candidate(
        {"--mem-fraction-static": value}, replace(inputs, mem_fraction_static=best / _PER_MILLE), text
    )


def _limit_candidates(inputs: LedgerInputs, moment: str, core: Core) -> Iterator[Candidate]:
    """Lower --max-total-tokens, --max-running-requests or --context-length, when given, as far as needed."""
    limits = (
        ("max_total_tokens", "--max-total-tokens", moment != "load_weights", "--max-total-tokens <= {}"),
        (
            "max_running_requests",
            "--max-running-requests",
            moment in ("kv_allocation", "first_full_prefill"),
            "--max-running-requests {}",
        ),
        ("context_length", "--context-length", moment == "kv_allocation", "--context-length {}"),
    )
    for field, flag, applies, words in limits:
        given = getattr(inputs, field)
        if not given or not applies:
            continue
        largest = _largest(1, given - 1, lambda n, field=field: _fits(core, replace(inputs, **{field: n})))
        if largest:
            yield Candidate({flag: str(largest)}, replace(inputs, **{field: largest}), words.format(largest))


def _chunk_candidate(inputs: LedgerInputs, ledger: Ledger, core: Core) -> Iterator[Candidate]:
    """The largest power-of-two prefill chunk below the current one that fits (not below 128 tokens)."""
    chunk = ledger.chunked_prefill_size if ledger.chunked_prefill_size > 0 else ledger.max_prefill_tokens
    size = 1 << max(0, math.ceil(math.log2(chunk)) - 1)
    while size >= 128:
        trial = replace(inputs, chunked_prefill_size=size)
        if _fits(core, trial):
            yield Candidate({"--chunked-prefill-size": str(size)}, trial, f"--chunked-prefill-size {size}")
            return
        size //= 2


def _cuda_candidates(inputs: LedgerInputs, moment: str, core: Core) -> Iterator[Candidate]:
    """No graphs, an fp8 KV cache, more ranks: what a CUDA deployment can trade for memory."""
    if not inputs.disable_cuda_graph and moment in ("graph_capture", "kv_allocation"):
        trial = replace(inputs, disable_cuda_graph=True)
        if _fits(core, trial):
            yield Candidate({"--disable-cuda-graph": ""}, trial, "--disable-cuda-graph")
    kv_dtype = kv_cache_dtype_name(inputs.kv_cache_dtype, inputs.dtype)
    if dtype_bytes(kv_dtype) > 1 and moment == "kv_allocation":
        trial = replace(inputs, kv_cache_dtype="fp8_e4m3")
        if _fits(core, trial):
            share = "half" if dtype_bytes(kv_dtype) == 2 else "a quarter of"
            text = f"--kv-cache-dtype fp8_e4m3 ({share} the KV bytes)"
            yield Candidate({"--kv-cache-dtype": "fp8_e4m3"}, trial, text)


def _dtype_candidate(inputs: LedgerInputs, core: Core) -> Iterator[Candidate]:
    if dtype_bytes(inputs.dtype) > 2:
        trial = replace(inputs, dtype="bfloat16")
        if _fits(core, trial):
            weights = inputs.model.weight_bytes(inputs.tp_size, 2, inputs.fp8_weights_kept)
            yield Candidate(
                {"--dtype": "bfloat16"}, trial, f"--dtype bfloat16 (weights {gib(weights)} per rank)"
            )


def _tp_candidate(inputs: LedgerInputs, core: Core) -> Iterator[Candidate]:
    """The fewest tensor-parallel ranks (a power of two above the current count, one that splits the model's
    heads and dimensions) the model fits on."""
    for tp in (2, 4, 8, 16):
        trial = replace(inputs, tp_size=tp)
        block = inputs.model.fp8_block if inputs.fp8_weights_kept else None
        if tp > inputs.tp_size and not inputs.model.tp_problems(tp, fp8_block=block) and _fits(core, trial):
            weights = inputs.model.weight_bytes(tp, dtype_bytes(inputs.dtype), inputs.fp8_weights_kept)
            yield Candidate(
                {"--tp-size": str(tp)}, trial, f"--tp-size {tp} (weights {gib(weights)} per rank)"
            )
            return


def _state_slots_candidate(inputs: LedgerInputs, moment: str, core: Core) -> Iterator[Candidate]:
    """A --max-mamba-cache-size that holds no request: the slots the asked-for running requests need (as many of
    them as fit)."""
    given, per_request = inputs.max_mamba_cache_size, per_request_slots(inputs)
    if not given or given >= per_request or moment != "kv_allocation":
        return
    wanted = inputs.max_running_requests or 1
    requests = _largest(
        1, wanted, lambda r: _fits(core, replace(inputs, max_mamba_cache_size=r * per_request))
    )
    if requests:
        slots = requests * per_request
        text = (
            f"--max-mamba-cache-size {slots} ({requests} request{'s' * (requests > 1)} x {per_request} slots)"
        )
        yield Candidate(
            {"--max-mamba-cache-size": str(slots)}, replace(inputs, max_mamba_cache_size=slots), text
        )


def _device_candidates(inputs: LedgerInputs, ledger: Ledger, core: Core) -> Iterator[Candidate]:
    moment, cuda = ledger.failure.moment, inputs.device.startswith("cuda")
    yield from _state_slots_candidate(inputs, moment, core)
    if inputs.mem_fraction_static is not None and moment != "load_weights":
        found = _fraction_candidate(inputs, core)
        if found:
            yield found
    yield from _limit_candidates(inputs, moment, core)
    if moment != "load_weights":
        yield from _chunk_candidate(inputs, ledger, core)
    if cuda:
        yield from _cuda_candidates(inputs, moment, core)
    yield from _dtype_candidate(inputs, core)
    if cuda:
        yield from _tp_candidate(inputs, core)


def _host_candidates(inputs: LedgerInputs, ledger: Ledger, core: Core) -> Iterator[Candidate]:
    budget = ledger.line("host budget").bytes
    pool = ledger.line("kv pool").bytes
    if budget <= 0:
        return
    per_rank = budget / inputs.tp_size
    size = math.floor(per_rank / 1e8) / 10
    usable = f"{budget / 1e9:.1f} GB usable / {inputs.tp_size} ranks"
    trial = replace(inputs, hicache_size_gb=size)
    if size > 0 and _fits(core, trial):
        yield Candidate(
            {"--hicache-size": f"{size:g}"}, trial, f"--hicache-size <= {size:g} (GB per rank: {usable})"
        )
    ratio = math.floor(per_rank / pool * 100) / 100 if pool else 0
    trial = replace(inputs, hicache_size_gb=0.0, hicache_ratio=ratio)
    if ratio > 0 and _fits(core, trial):
        yield Candidate(
            {"--hicache-ratio": f"{ratio:g}", "--hicache-size": "0"},
            trial,
            f"--hicache-ratio <= {ratio:g} (x KV pool {gib(pool)} per rank)",
        )


def offered_fixes(inputs: LedgerInputs, ledger: Ledger, core: Core) -> list[Candidate]:
    """The smallest change `kiln serve` accepts (verified by recomputing the ledger) and up to one alternative."""
    search = _host_candidates if ledger.failure.moment == "host_memory" else _device_candidates
    found: list[Candidate] = []
    for candidate in search(inputs, ledger, core):
        if serve_accepts(candidate.flags):
            found.append(candidate)
        if len(found) == 2:
            break
    return found


def find_fix(inputs: LedgerInputs, ledger: Ledger, core: Core) -> tuple[str, dict]:
    """The fix in words and the first offered one as serve flags (none when no flag fixes it)."""
    found = offered_fixes(inputs, ledger, core)
    if found:
        return "use " + ", or ".join(c.text for c in found), found[0].flags
    if ledger.failure.moment == "host_memory":
        return "free system RAM, or run without --enable-hierarchical-cache", {}
    return _no_fix(inputs, ledger), {}


def _no_fix(inputs: LedgerInputs, ledger: Ledger) -> str:
    need = ledger.weight_bytes + ledger.line("runtime overhead").bytes
    splits = any(not inputs.model.tp_problems(tp) for tp in (2, 4, 8))
    gpus = "a GPU with more memory" + (" or more GPUs" if splits else "")
    where = gpus if inputs.device.startswith("cuda") else "a machine with more RAM"
    linear, other = inputs.model.param_counts(inputs.tp_size)
    q4 = (linear + other) * 0.5625  # ~4.5 bits per parameter with scales
    return (
        f"no flag fixes this here: the weights alone need {gib(need)} per rank with the runtime and "
        f"{gib(inputs.available_memory_bytes)} is free; use {where}, or a smaller model "
        f"(a 4-bit quantization of this one is about {gib(q4)} per rank)"
    )
