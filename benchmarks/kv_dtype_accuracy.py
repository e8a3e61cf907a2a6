"""Accuracy of each KV cache dtype (--kv-cache-dtype): KL divergence and top-1 agreement of the logits against a
float32 KV cache, on the same weights and the same tokens.

A KV cache dtype changes only what later steps read back from the pool, so each window is run as a server runs it:
its first half as one prefill (which attends to its own K and V as computed, whatever the pool stores), then its
second half teacher-forced one decode step at a time, every step reading the whole sequence's K and V from the pool
in the chosen dtype (Kiln's CPU decode kernel where it serves the pool, converting in registers). The second
half's logits are scored against the float32-KV run's: per token KL(float32 KV || dtype KV) of the softmaxed
logits and whether the argmax agrees.

The weights are the model's, multiplied under --cpu-gemm f32 (dequantized, float32 arithmetic) so that the KV
dtype is the only difference; the text is the one benchmarks/kl_divergence.py reads (the output says which).

python benchmarks/kv_dtype_accuracy.py                      # the default model, 2 windows of 512 tokens
python benchmarks/kv_dtype_accuracy.py --windows 4 --dtypes bfloat16 fp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kl_divergence import english_text, summarize, token_divergence  # noqa: E402

DTYPES = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")  # each compared with float32
WINDOW = 512


def load_runner(model_path: str, kv_dtype: str, window: int):
    """Kiln's model runner on the model (float32 compute, weights dequantized) with a pool for one window of
    `window` tokens stored in `kv_dtype`."""
    from kiln.core.dtypes import kv_torch_dtype
    from kiln.layers.cpu_gemm import set_cpu_gemm
    from kiln.loader.model_config import load_model_config
    from kiln.runner.model_runner import ModelRunner, PoolSizes

    set_cpu_gemm("f32")
    runner = ModelRunner(load_model_config(model_path), torch.float32, kv_torch_dtype(kv_dtype), "cpu")
    runner.load(window + 8, prepack=True)
    runner.init_memory_pool(PoolSizes(window + 16, 1, window + 8, 1))
    return runner


def decode_logits(runner, ids: list[int], prefill: int) -> torch.Tensor:
    """The float32 logits [len(ids) - prefill, vocab] of `ids` run as a prefill of its first `prefill` tokens and
    then one decode step per token, teacher-forced: the logits after each token from the prefill's last on (the
    prediction of each of the decoded tokens, and of the one after the last)."""
    from kiln.core.forward_batch import ForwardBatch, ForwardMode

    slots = torch.arange(1, len(ids) + 1)  # slot 0 is the pool's padding slot
    first = ForwardBatch(
        ForwardMode.EXTEND, torch.tensor(ids[:prefill]), torch.arange(prefill), slots[:prefill],
        torch.tensor([prefill - 1]), extend_lens=[prefill], prefix_lens=[0], seq_slots=[slots[:prefill]],
    )  # fmt: skip
    rows = [runner.forward(first).float()]
    for t in range(prefill, len(ids) - 1):
        step = ForwardBatch(
            ForwardMode.DECODE, torch.tensor([ids[t]]), torch.tensor([t]), slots[t : t + 1], None,
            kv_table=slots[: t + 1].unsqueeze(0),
        )  # fmt: skip
        rows.append(runner.forward(step).float())
    return torch.cat(rows)


def divergence_by_dtype(
    model_path: str, windows: list[list[int]], dtypes: tuple[str, ...]
) -> dict[str, dict]:
    """Each KV dtype's divergence from a float32 KV cache over the decoded half of every window."""
    runners = {dtype: load_runner(model_path, dtype, WINDOW) for dtype in ("float32", *dtypes)}
    kls: dict[str, list[torch.Tensor]] = {d: [] for d in dtypes}
    same: dict[str, list[torch.Tensor]] = {d: [] for d in dtypes}
    for ids in windows:
        base = decode_logits(runners["float32"], ids, WINDOW // 2)
        for dtype in dtypes:
            kl, agree = token_divergence(base, decode_logits(runners[dtype], ids, WINDOW // 2))
            kls[dtype].append(kl)
            same[dtype].append(agree)
    backend = type(runners["float32"].attn_backend).__name__
    return {
        d: {**asdict(summarize(torch.cat(kls[d]), torch.cat(same[d]))), "attention": backend} for d in dtypes
    }


def main() -> None:
    from kiln.loader.default_model import default_model_path
    from kiln.text.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled default model")
    parser.add_argument("--windows", type=int, default=2, help=f"windows of {WINDOW} tokens")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    model_path = ns.model_path or default_model_path()
    text, source = english_text()
    ids = load_tokenizer(model_path).encode(text[2000:])
    windows = [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(ns.windows)]
    t0 = time.perf_counter()
    results = divergence_by_dtype(model_path, windows, tuple(ns.dtypes))
    print(f"model: {Path(model_path).name}; text: {source}")
    print(
        f"{ns.windows} windows of {WINDOW} tokens: prefill {WINDOW // 2}, then {WINDOW // 2} decode steps scored"
    )
    print("| KV dtype | bytes/elem | KL mean | KL p99 | KL max | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for dtype, d in results.items():
        size = 1 if dtype.startswith("fp8") else 2
        print(
            f"| {dtype} | {size} | {d['kl_mean']:.6f} | {d['kl_p99']:.6f} | {d['kl_max']:.6f} "
            f"| {100 * d['top1_agreement']:.2f} % |"
        )
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "results": results}))


if __name__ == "__main__":
    main()
