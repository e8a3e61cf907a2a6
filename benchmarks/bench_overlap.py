"""The overlap scheduler against the plain one, side by side in one process, on the default model (or --model-path):
for each batch size, the same greedy requests through an engine with --enable-overlap-schedule and one without,
alternating, each figure the median of --reps runs. Prints tok/s of each, their ratio, and whether the outputs are
identical.

    .venv/bin/python benchmarks/bench_overlap.py [--bs 1 8 32] [--max-new-tokens 64] [--reps 3]
        [--device cuda] [--model-path PATH] [--cuda-graph-bs 1 8 32]  # compiled steps (the CPU's default is eager)
"""

from __future__ import annotations

import argparse
import statistics
import time

import kiln

TOPICS = "a lighthouse, the sea, a fox, winter, a city at night, a robot, bread, the moon".split(", ")


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def timed(engine: kiln.Engine, texts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    out = engine.generate(texts, params)
    return time.perf_counter() - t0, [o["output_ids"] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cuda-graph-bs", type=int, nargs="*", default=None)
    args = ap.parse_args()
    common = dict(max_total_tokens=16384, max_running_requests=max(args.bs))
    if args.model_path:
        common["model_path"] = args.model_path
    if args.device:
        common["device"] = args.device
    if args.cuda_graph_bs:
        common["cuda_graph_bs"] = tuple(args.cuda_graph_bs)
    engines = {
        "plain": kiln.Engine(disable_overlap_schedule=True, **common),
        "overlap": kiln.Engine(enable_overlap_schedule=True, **common),
    }
    print(f"{'batch':>5} {'plain tok/s':>12} {'overlap tok/s':>14} {'ratio':>6} identical")
    differ = []
    for bs in args.bs:
        texts = prompts(bs)
        times: dict[str, list[float]] = {name: [] for name in engines}
        outs: dict[str, list[list[int]]] = {}
        for engine in engines.values():  # warm-up: first shapes, caches
            timed(engine, texts, 4)
        for _ in range(args.reps):
            for name, engine in engines.items():
                seconds, outs[name] = timed(engine, texts, args.max_new_tokens)
                times[name].append(seconds)
        tokens = bs * args.max_new_tokens
        rate = {name: tokens / statistics.median(t) for name, t in times.items()}
        same = outs["plain"] == outs["overlap"]
        print(
            f"{bs:>5} {rate['plain']:>12.1f} {rate['overlap']:>14.1f} {rate['overlap'] / rate['plain']:>6.2f} {same}"
        )
        if not same:
            differ.append(bs)
    for engine in engines.values():
        engine.shutdown()
    if differ:
        raise SystemExit(f"the overlap schedule's outputs differ from the plain one's at batch {differ}")


if __name__ == "__main__":
    main()
