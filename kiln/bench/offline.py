"""`kiln bench offline` and `kiln bench one-batch`: Kiln's in-process engine, no HTTP."""

from __future__ import annotations

import json
import random
import time
from typing import Any

VOCAB_LIMIT = 10000  # prompt token ids are drawn from [0, VOCAB_LIMIT), as in nano-vllm's bench.py


def engine_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """--engine-arg KEY=VALUE pairs; values parsed as JSON when they can be (numbers, booleans)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def _engine(args: Any):
    from kiln.engine import Engine

    path = args.model_path
    if path is None:
        from kiln.loader.default_model import default_model_path

        path = default_model_path()
    return Engine(model_path=path, **engine_overrides(args.engine_arg))


def _append_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def offline_requests(args: Any) -> tuple[list[list[int]], list[dict]]:
    """N random-token prompts and sampling params, lengths uniform in the given ranges (seeded)."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(VOCAB_LIMIT) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
        for _ in range(args.num_seqs)
    ]
    params = [
        {
            "max_new_tokens": rng.randint(args.min_output_len, args.max_output_len),
            "temperature": args.temperature,
            "ignore_eos": True,
        }
        for _ in range(args.num_seqs)
    ]
    return prompts, params


def run_offline(args: Any) -> dict:
    """Generate all sequences in one call; throughput = output tokens / wall time."""
    prompts, params = offline_requests(args)
    eng = _engine(args)
    try:
        eng.generate(input_ids=[[1, 2, 3, 4]], sampling_params=[{"max_new_tokens": 4, "ignore_eos": True}])
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
    finally:
        eng.shutdown()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    rec = {
        "bench": "offline",
        "num_seqs": args.num_seqs,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "duration": dt,
        "request_throughput": len(outs) / dt,
        "input_throughput": n_in / dt,
        "output_throughput": n_out / dt,
        "total_throughput": (n_in + n_out) / dt,
    }
    print(f"Total: {n_out}tok, Time: {dt:.2f}s, Throughput: {n_out / dt:.2f}tok/s")
    print("{s:{c}^{n}}".format(s=" Offline Throughput Benchmark Result ", n=50, c="="))
    for label, key in (
        ("Successful requests:", "num_seqs"),
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Input token throughput (tok/s):", "input_throughput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Total token throughput (tok/s):", "total_throughput"),
    ):
        value = rec[key]
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")
    print("=" * 50)
    _append_json(args.output_json, rec)
    return rec


def run_one_batch(args: Any) -> dict:
    """Prefill latency (a 1-token generate) and decode speed (a full generate minus that prefill).

    Each timed call uses fresh random prompts, so the prefix cache cannot serve them.
    """
    rng = random.Random(args.seed)
    bs, n_in, n_out = args.batch_size, args.input_len, args.output_len

    def batch(max_new: int) -> tuple[list[list[int]], list[dict]]:
        ids = [[rng.randrange(VOCAB_LIMIT) for _ in range(n_in)] for _ in range(bs)]
        sp = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
        return ids, [dict(sp) for _ in range(bs)]

    eng = _engine(args)
    try:
        ids, sp = batch(min(n_out, 4))
        eng.generate(input_ids=ids, sampling_params=sp)  # warm-up
        ids, sp = batch(1)
        t0 = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=sp)
        prefill = time.perf_counter() - t0
        ids, sp = batch(n_out)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=ids, sampling_params=sp)
        total = time.perf_counter() - t0
    finally:
        eng.shutdown()
    cached = sum(int(o["meta_info"].get("cached_tokens") or 0) for o in outs)
    steps = max(1, n_out - 1)
    decode = max(total - prefill, 1e-9) / steps
    rec = {
        "bench": "one-batch",
        "batch_size": bs,
        "input_len": n_in,
        "output_len": n_out,
        "prefill_latency": prefill,
        "prefill_throughput": bs * n_in / prefill,
        "decode_latency": decode,
        "decode_throughput": bs / decode,
        "total_latency": total,
        "overall_throughput": bs * (n_in + n_out) / total,
        "cached_tokens": cached,
    }
    print(f"Prefill. latency: {prefill:6.5f} s, throughput: {rec['prefill_throughput']:9.2f} token/s")
    print(f"Decode.  mean latency: {decode:6.5f} s, mean throughput: {bs / decode:9.2f} token/s")
    print(f"Total. latency: {total:6.3f} s, throughput: {rec['overall_throughput']:9.2f} token/s")
    if cached:
        print(
            f"Warning: {cached} prompt tokens were served from the prefix cache; the prefill figure is low."
        )
    _append_json(args.output_json, rec)
    return rec
