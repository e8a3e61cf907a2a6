"""The cost of a speculative verify step against a plain decode step, default model.

A verify step is one extend of 1 + k tokens per request (the last token and k drafts) on top of the request's
KV; a decode step computes one token per request. With random draft weights (STANDALONE, EAGLE tests) the
accept length says nothing, so what speculation costs is this ratio: a verify of 1 + k tokens pays off when the
accept length exceeds (verify time + draft time) / decode time.

Both steps run on the serving model runner (Engine start, the server's attention backend and weights), each
request holding --context tokens of KV, alternating step by step, median of --reps.

    python benchmarks/bench_verify_cost.py [--bs 1 8] [--drafts 3 5 7] [--context 512] [--reps 20]
        [--model-path PATH] [--device cpu|cuda] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.core.forward_batch import ForwardBatch, ForwardMode


def _extend(runner, rows: list[int], start: int, count: int) -> ForwardBatch:
    """`count` new tokens per request at positions start.. on top of `start` tokens of KV (slots in the table)."""
    table = runner.table.req_to_token
    ids = torch.randint(100, 1000, (len(rows) * count,), dtype=torch.int64)
    seqs = [table[r, : start + count] for r in rows]
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids,
        positions=torch.arange(start, start + count).repeat(len(rows)),
        out_cache_loc=torch.cat([s[start:] for s in seqs]),
        logits_index=torch.arange(len(rows) * count),  # a verify wants logits at every row
        extend_lens=[count] * len(rows),
        prefix_lens=[start] * len(rows),
        seq_slots=seqs,
    )


def _decode(runner, rows: list[int], start: int) -> ForwardBatch:
    table = runner.table.req_to_token
    idx = torch.tensor(rows, dtype=torch.int64)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.randint(100, 1000, (len(rows),), dtype=torch.int64),
        positions=torch.full((len(rows),), start, dtype=torch.int64),
        out_cache_loc=table[idx, start],
        logits_index=torch.arange(len(rows)),
        kv_table=table[idx, : start + 1],
        kv_mask=None,
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(runner, bs: int, drafts: list[int], context: int, reps: int) -> dict:
    """Median ms of a decode step and of a verify step of 1 + k tokens for each k, bs requests of context KV."""
    most = 1 + max(drafts)
    rows = [runner.table.alloc() for _ in range(bs)]
    slots = runner.allocator.alloc_extend([0] * bs, [-1] * bs, [context + most] * bs)
    for i, r in enumerate(rows):
        runner.table.req_to_token[r, : context + most] = slots[
            i * (context + most) : (i + 1) * (context + most)
        ]
    runner.forward(_extend(runner, rows, 0, context))  # the requests' KV
    steps = {"decode": _decode(runner, rows, context)} | {
        k: _extend(runner, rows, context, 1 + k) for k in drafts
    }
    times: dict = {name: [] for name in steps}
    for _ in range(reps + 2):
        for name, fb in steps.items():
            sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(fb)
            sync(runner.device)
            times[name].append(time.perf_counter() - t0)
    runner.allocator.free(slots)
    for r in rows:
        runner.table.free(r)
    decode_ms = statistics.median(times.pop("decode")[2:]) * 1e3
    verify = {k: statistics.median(t[2:]) * 1e3 for k, t in times.items()}
    return {"bs": bs, "context": context, "decode_ms": round(decode_ms, 3),
            "verify_ms": {k: round(v, 3) for k, v in verify.items()},
            "ratio": {k: round(v / decode_ms, 2) for k, v in verify.items()}}  # fmt: skip


def step_arguments(doc: str) -> argparse.ArgumentParser:
    """The flags of a benchmark that times steps on a served model: batch sizes, context, repetitions, model,
    device, threads and a JSON file."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--json", default=None)
    return ap


def save_results(json_path: str | None, model: str, device: str, results: list[dict]) -> None:
    """The figures as JSON at json_path (--json), if given."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "device": device, "results": results}, f, indent=1)


def main() -> None:
    ap = step_arguments(__doc__)
    ap.add_argument("--drafts", type=int, nargs="+", default=[3, 5, 7])
    args = ap.parse_args()
    from kiln import Engine
    from kiln.loader.default_model import default_model_path

    path = args.model_path or default_model_path()
    eng = Engine(model_path=path, device=args.device, max_total_tokens=32768, disable_cuda_graph=True,
                 max_running_requests=max(args.bs), num_threads=args.threads)  # fmt: skip
    runner = eng.scheduler.runner
    results = [measure(runner, bs, args.drafts, args.context, args.reps) for bs in args.bs]
    print(
        f"model={path} device={runner.device} dtype={runner.dtype} context={args.context} (median of {args.reps})"
    )
    print(f"{'bs':>4} {'decode ms':>10}  " + "  ".join(f"verify 1+{k} ms (x decode)" for k in args.drafts))
    for r in results:
        cells = "  ".join(f"{r['verify_ms'][k]:>10.2f} ({r['ratio'][k]:.2f}x)     " for k in args.drafts)
        print(f"{r['bs']:>4} {r['decode_ms']:>10.2f}  {cells}")
    save_results(args.json, path, runner.device, results)
    eng.shutdown()


if __name__ == "__main__":
    main()
