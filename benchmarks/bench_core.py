"""Kiln's in-process engine against transformers `generate()`, side by side in one run, default model.

Figures: batch-1 decode tok/s, 512-token prefill tok/s, and output tok/s of 64 requests with 128-token
prompts and 128 new tokens, in float32 and bfloat16. Each figure is the median of --reps runs, the engines
alternating, so machine drift hits them alike.

    python benchmarks/bench_core.py [--dtypes float32 bfloat16] [--reps 3] [--json out.json]
                                    [--cuda-graph-max-bs N]

`--cuda-graph-max-bs N` adds a third engine: Kiln with its decode steps compiled up to batch N (the CPU default
compiles nothing, the first engine); its compile happens before the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


class HFSide:
    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = (
            AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
            )
            .to(dtype)
            .eval()
        )

    def run(self, batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0


class KilnSide:
    def __init__(self, path: str, dtype: str, cuda_graph_max_bs: int | None):
        from kiln import Engine

        graphs = {"cuda_graph_max_bs": cuda_graph_max_bs} if cuda_graph_max_bs else {}
        self.engine = Engine(
            model_path=path,
            dtype=dtype,
            max_total_tokens=65536,
            max_running_requests=128,
            chunked_prefill_size=4096,
            disable_radix_cache=True,
            **graphs,
        )

    def run(self, batch: list[list[int]], new: int) -> float:
        sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        self.engine.generate(input_ids=batch, sampling_params=[sp] * len(batch))
        return time.perf_counter() - t0


def measure_once(side, vocab: int, seed: int) -> dict:
    """The three figures for one engine, one repetition; fresh prompts every run so nothing is cached."""
    p = prompts(1, 16, vocab, seed)
    t1, t129 = side.run(p, 1), side.run(p, 129)
    fig = {
        "decode_b1": 128 / (t129 - t1),
        "prefill_512": 512 / side.run(prompts(1, 512, vocab, seed + 100), 1),
        "throughput_64x128": 64 * 128 / side.run(prompts(64, 128, vocab, seed + 200), 128),
    }
    print(
        f"{getattr(side, 'name', type(side).__name__)}: "
        + ", ".join(f"{k} {v:.1f}" for k, v in fig.items())
        + " tok/s",
        flush=True,
    )
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="compile Kiln's decode up to this batch"
    )
    args = ap.parse_args()
    from kiln.loader.default_model import default_model_path

    path = default_model_path()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for dtype in args.dtypes:
        sides = {"kiln": KilnSide(path, dtype, None)}
        if args.cuda_graph_max_bs:
            sides["kiln_graphs"] = compiled = KilnSide(path, dtype, args.cuda_graph_max_bs)
            compiled.name = f"KilnSide(--cuda-graph-max-bs {args.cuda_graph_max_bs})"
            print(
                f"Kiln {dtype}: compiled decode batch sizes {compiled.engine.scheduler.runner.graphs.captured()}"
            )
        sides["transformers"] = HFSide(path, getattr(torch, dtype))
        vocab = sides["kiln"].engine.parts.model_config.vocab_size
        for side in sides.values():  # warm-up
            side.run(prompts(2, 32, vocab, 999), 4)
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for r in range(args.reps):  # the engines alternate, so drift of the shared host hits all alike
            for name, side in sides.items():
                runs[name].append(measure_once(side, vocab, r))
        for figure in runs["kiln"][0]:
            row = {"dtype": dtype, "figure": figure}
            row.update({name: statistics.median(f[figure] for f in runs[name]) for name in sides})
            rows.append(row)
        del sides
    compiled = ["kiln_graphs"] if args.cuda_graph_max_bs else []
    head = ["Kiln", *(["Kiln compiled decode"] if compiled else []), "transformers", "Kiln / transformers"]
    print("| dtype | figure | " + " | ".join(head) + (" | compiled / transformers |" if compiled else " |"))
    print("|---" * (len(head) + 2 + len(compiled)) + "|")
    for r in rows:
        cells = [f"{r[name]:.1f}" for name in ("kiln", *compiled, "transformers")]
        cells += [f"{r[name] / r['transformers']:.2f}x" for name in ("kiln", *compiled)]
        print(f"| {r['dtype']} | {r['figure']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
