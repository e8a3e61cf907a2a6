"""Decode with graphs (CPU: compiled steps) against Kiln's eager path, side by side in one run, default model.

Figures: decode tok/s at batch 1, 8 and 32 and prefill tok/s of one 128- and one 512-token prompt for both
paths (the engines alternate, median of --reps), the weight-read roofline of decode (read bandwidth measured
just before each run / the weight and KV bytes a step reads; "graph / roofline" is the median over runs), and the capture time per shape of a first start (empty compile
cache) and a second start (warm cache), each in a fresh process.

On the CPU also the most a compiled step can gain over eager: eager and compiled steps call the same Kiln kernels
(the matmuls and decode attention), so a compiled step is never faster than the time the eager step spends inside
them, timed around every kernel call of the eager runs. "kernel bound" = eager step time / that kernel time.

    python benchmarks/bench_graphs.py [--bs 1 8 32] [--prefill 128 512] [--reps 3] [--json out.json]
        [--device cuda] [--model-path DIR]

On CUDA the graphs are CUDA graphs (decode) and breakable prefill graphs, and the bandwidth is the GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_core import prompts

PROMPT_LEN, NEW_TOKENS = 128, 64


def engine(path: str, sizes: list[int] | None, prefill: list[int], cache_dir: str, device: str = "cpu"):
    from kiln import Engine

    if sizes:
        opts = dict(
            cuda_graph_bs=tuple(sizes),
            cuda_graph_bs_prefill=tuple(prefill) or None,
            compile_cache_dir=cache_dir,
        )
    else:
        opts = dict(disable_cuda_graph=True)
    return Engine(model_path=path, device=device, max_total_tokens=32768, max_running_requests=64, **opts)


def capture_only(path: str, sizes: list[int], prefill: list[int], cache_dir: str, device: str) -> None:
    """One start: capture the shapes and print the graph runner's summary as JSON."""
    eng = engine(path, sizes, prefill, cache_dir, device)
    print("SUMMARY " + json.dumps(eng.scheduler.runner.graphs.summary()), flush=True)


def start(path: str, sizes: list[int], prefill: list[int], cache_dir: str, device: str) -> dict:
    cmd = [sys.executable, __file__, "--capture-only", "--cache-dir", cache_dir, "--bs", *map(str, sizes)]
    cmd += ["--prefill", *map(str, prefill), "--model-path", path, "--device", device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("SUMMARY "))
    return json.loads(line[len("SUMMARY ") :])


@contextlib.contextmanager
def kernel_clock():
    """Seconds spent inside Kiln's CPU matmul and decode-attention kernels by eager calls while open: [seconds]."""
    from kiln.layers import cpu_gemm

    spent = [0.0]
    originals = {name: getattr(cpu_gemm, name) for name in ("_blocked", "_decode_attention")}

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return call

    for name, fn in originals.items():
        setattr(cpu_gemm, name, timed(fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(cpu_gemm, name, fn)


def decode_tok_s(eng, bs: int, vocab: int, seed: int) -> tuple[float, list[list[int]], float]:
    """Decode tok/s of bs requests: (time for NEW_TOKENS + 1 tokens - time for 1) over bs x NEW_TOKENS; the output
    ids; and the same figure counting only the time inside Kiln's kernels (eager CPU engines; else 0)."""
    batch = prompts(bs, PROMPT_LEN, vocab, seed)
    sp = {"temperature": 0.0, "ignore_eos": True}
    runner = eng.scheduler.runner
    clocked = runner.graphs is None and torch.device(runner.device).type == "cpu"
    kernel_s: list[float] = []

    def run(new: int) -> tuple[float, list]:
        eng.scheduler.flush_cache()
        with kernel_clock() if clocked else contextlib.nullcontext([0.0]) as spent:
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=batch, sampling_params=[{**sp, "max_new_tokens": new}] * bs)
            elapsed = time.perf_counter() - t0
        kernel_s.append(spent[0])
        return elapsed, [o["output_ids"] for o in outs]

    t1, _ = run(1)
    graph_steps = 0
    inner = type(runner).forward.__get__(runner)

    def counted(fb):
        nonlocal graph_steps
        out = inner(fb)
        graph_steps += runner.last_forward_graph and fb.mode.value == "decode"
        return out

    runner.forward = counted
    tn, ids = run(NEW_TOKENS + 1)
    del runner.forward
    if runner.graphs is not None:
        assert graph_steps >= NEW_TOKENS, f"bs={bs}: only {graph_steps} decode steps ran compiled"
    kernels = kernel_s[1] - kernel_s[0]
    return bs * NEW_TOKENS / (tn - t1), ids, bs * NEW_TOKENS / kernels if kernels > 0 else 0.0


def prefill_tok_s(eng, tokens: int, vocab: int, seed: int) -> float:
    batch = prompts(1, tokens, vocab, seed)
    eng.scheduler.flush_cache()
    t0 = time.perf_counter()
    eng.generate(input_ids=batch, sampling_params=[{"temperature": 0.0, "max_new_tokens": 1}])
    return tokens / (time.perf_counter() - t0)


def read_bandwidth_gbs(
    device: str = "cpu", gib: float = 1.0, reps: int = 5, x: torch.Tensor | None = None
) -> float:
    """Best-of-reps read bandwidth of a sum over a buffer much larger than the caches (x: one to reuse)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, device=device) if x is None else x
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        float(x.sum())  # a host read: the device has finished
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes a decode step reads: every parameter but the embedding table (a step reads a few of its rows)."""
    params = dict(model.named_parameters())
    params.pop("model.embed_tokens.weight", None)
    if getattr(model.lm_head, "tied", False) and "lm_head.packed_weight" not in params:
        params["lm_head.weight"] = model.lm_head.weight  # tied and unpacked: the head reads the table
    return sum(p.nbytes for p in params.values())


def kv_bytes_per_token(pool) -> float:
    """KV bytes a decode step reads per token of a request's context, every layer (the pool's bytes per slot)."""
    return (pool.k_bytes + pool.v_bytes) / pool.k[0].shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-path", default=None, help="default: Kiln's default model")
    ap.add_argument("--capture-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from kiln.loader.default_model import default_model_path

    path, dev = args.model_path or default_model_path(), args.device
    if args.capture_only:
        return capture_only(path, args.bs, args.prefill, args.cache_dir, dev)
    cache_dir = tempfile.mkdtemp(prefix="kiln-compile-")
    first, second = (start(path, args.bs, args.prefill, cache_dir, dev) for _ in range(2))
    from kiln.runner import graph_runner

    graph_runner.MAX_SLOWDOWN = float(
        "inf"
    )  # measure every compiled shape, whatever the capture-time check said
    graph, eager = engine(path, args.bs, args.prefill, cache_dir, dev), engine(path, None, [], cache_dir, dev)
    vocab = graph.parts.model_config.vocab_size
    # the roofline of each graph run from the bandwidth measured just before it: the host is shared, and a
    # neighbour's load moves both figures together
    buffer = torch.ones((1 << 30) // 4, device=dev)
    wbytes = weight_bytes_per_step(graph.scheduler.runner.model)
    kv_token = kv_bytes_per_token(graph.scheduler.runner.kv_pool)
    bws, rows, differing = [], [], []
    for bs in args.bs:
        # a step reads the weights once and each request's KV: the mean context over the run
        step_bytes = wbytes + bs * (PROMPT_LEN + NEW_TOKENS / 2) * kv_token
        runs: dict[str, list[float]] = {"graph": [], "eager": [], "kernels": [], "of_roofline": []}
        for r in range(args.reps):
            bws.append(read_bandwidth_gbs(dev, reps=3, x=buffer))
            for name, eng in (("graph", graph), ("eager", eager)):
                tok_s, ids, kernel_tok_s = decode_tok_s(eng, bs, vocab, seed=100 * bs + r)
                runs[name].append(tok_s)
                if name == "eager":
                    runs["kernels"].append(kernel_tok_s / tok_s)
                if name == "graph":
                    graph_ids = ids
                    runs["of_roofline"].append(tok_s / (bs * bws[-1] * 1e9 / step_bytes))
            if ids != graph_ids:
                differing.append(bs)
        g, e = statistics.median(runs["graph"]), statistics.median(runs["eager"])
        roof = bs * statistics.median(bws[-args.reps :]) * 1e9 / step_bytes
        bound = statistics.median(runs["kernels"])
        of_roof = statistics.median(runs["of_roofline"])
        rows.append({"bs": bs, "graph": g, "eager": e, "ratio": g / e, "roofline": roof, "of_roofline": of_roof,
                     "of_roofline_runs": runs["of_roofline"], "kernel_bound": bound})  # fmt: skip
        print(
            f"bs={bs}: graph {g:.1f} tok/s, eager {e:.1f} tok/s ({g / e:.2f}x, kernel bound {bound:.2f}x), "
            f"roofline {roof:.1f}, graph / roofline per run "
            + ", ".join(f"{x * 100:.0f}%" for x in runs["of_roofline"]),
            flush=True,
        )
    bw = statistics.median(bws)
    pre_rows = []
    for tokens in args.prefill:
        pre = {"graph": [], "eager": []}
        for r in range(args.reps):
            for name, eng in (("graph", graph), ("eager", eager)):
                pre[name].append(prefill_tok_s(eng, tokens, vocab, seed=7 * tokens + r))
        g, e = statistics.median(pre["graph"]), statistics.median(pre["eager"])
        pre_rows.append({"tokens": tokens, "graph": g, "eager": e, "ratio": g / e})
        print(f"prefill {tokens}: graph {g:.1f} tok/s, eager {e:.1f} tok/s ({g / e:.2f}x)", flush=True)
    same = "identical" if not differing else f"different at bs {sorted(set(differing))}"
    print(f"\ngreedy outputs, graph vs eager: {same}")
    print(
        f"read bandwidth {bw:.1f} GB/s (median of the runs' {min(bws):.1f}-{max(bws):.1f}), weights read per step "
        f"{wbytes / 1e9:.3f} GB, KV {kv_token / 1e3:.1f} kB per token of context\n"
    )
    print(
        "| decode batch | graph tok/s | eager tok/s | graph / eager | kernel bound | roofline tok/s | "
        "graph / roofline (median of runs) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bound = f"{r['kernel_bound']:.2f}x" if r["kernel_bound"] else "-"
        print(
            f"| {r['bs']} | {r['graph']:.1f} | {r['eager']:.1f} | {r['ratio']:.2f}x | {bound} | "
            f"{r['roofline']:.1f} | {r['of_roofline'] * 100:.0f}% |"
        )
    print("\n| prefill tokens | graph tok/s | eager tok/s | graph / eager |")
    print("|---|---|---|---|")
    for r in pre_rows:
        print(f"| {r['tokens']} | {r['graph']:.1f} | {r['eager']:.1f} | {r['ratio']:.2f}x |")
    print("\n| shape | first start: compile s | second start: compile s | second / first | kept |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for phase, unit in (("prefill", "num_tokens"), ("decode", "bs")):
        for a, b in zip(first[phase]["shapes"], second[phase]["shapes"], strict=True):
            print(f"| {unit}={a['size']} | {a['seconds']:.1f} | {b['seconds']:.1f} | "
                  f"{b['seconds'] / a['seconds'] * 100:.0f}% | {a['kept']}/{b['kept']} |")  # fmt: skip
        totals[0] += first[phase]["capture_seconds"]
        totals[1] += second[phase]["capture_seconds"]
        mib = [f"{s['mem_bytes'] / 2**20:.1f}" for s in first[phase]["shapes"]]
        print(f"| {phase} memory, first start: {first[phase]['capture_bytes'] / 2**20:.1f} MiB "
              f"(per shape, MiB: {', '.join(mib)}) | | | | |")  # fmt: skip
    print(
        f"| all (capture phases, with the timing against eager) | {totals[0]:.1f} | {totals[1]:.1f} | {totals[1] / totals[0] * 100:.0f}% | |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode": rows, "prefill": pre_rows, "capture": {"first": first, "second": second},
                       "read_gbs": bw, "weight_bytes": wbytes}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
