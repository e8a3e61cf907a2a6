"""Kiln's in-process engine against transformers `generate()`, side by side in one run, default model.

Figures: batch-1 decode tok/s, 512-token prefill tok/s, and output tok/s of 64 requests with 128-token
prompts and 128 new tokens, in float32 and bfloat16. Each figure is the median of --reps runs, the two
engines alternating, so machine drift hits both alike.

    python benchmarks/bench_core.py [--dtypes float32 bfloat16] [--reps 3] [--json out.json]
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
    def __init__(self, path: str, dtype: str):
        from kiln import Engine

        self.engine = Engine(
            model_path=path,
            dtype=dtype,
            max_total_tokens=65536,
            max_running_requests=128,
            chunked_prefill_size=4096,
            disable_radix_cache=True,
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
        f"{type(side).__name__}: " + ", ".join(f"{k} {v:.1f}" for k, v in fig.items()) + " tok/s", flush=True
    )
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kiln.loader.default_model import default_model_path

    path = default_model_path()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for dtype in args.dtypes:
        kiln = KilnSide(path, dtype)
        hf = HFSide(path, getattr(torch, dtype))
        vocab = kiln.engine.parts.model_config.vocab_size
        for side in (kiln, hf):  # warm-up
            side.run(prompts(2, 32, vocab, 999), 4)
        runs: dict[str, list[dict]] = {"kiln": [], "hf": []}
        for r in range(args.reps):  # the engines alternate, so drift of the shared host hits both alike
            runs["kiln"].append(measure_once(kiln, vocab, r))
            runs["hf"].append(measure_once(hf, vocab, r))
        for name in runs["kiln"][0]:
            k = statistics.median(f[name] for f in runs["kiln"])
            h = statistics.median(f[name] for f in runs["hf"])
            rows.append({"dtype": dtype, "figure": name, "kiln": k, "transformers": h, "ratio": k / h})
        del kiln, hf
    print("| dtype | figure | Kiln tok/s | transformers tok/s | Kiln / transformers |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['figure']} | {r['kiln']:.1f} | {r['transformers']:.1f} | {r['ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
