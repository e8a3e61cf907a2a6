"""A small random Qwen3-MoE on the CPU: Kiln's in-process engine against transformers `generate()`, side by side
in one run, and where Kiln's decode step goes (routing, expert dispatch, expert GEMMs).

The model: 8 experts, top 2, a dense first layer, random weights saved with transformers into a temporary
directory; the default sizes give about 120M active parameters (per token) of about 270M in all.

Figures: decode tok/s at batch 1 and at batch 32 (the time of n + 1 new tokens less that of 1, so prefill is not
counted), the median of --reps runs with the engines alternating (and which goes first alternating), so drift of
a shared host hits both alike.
Then one profiled Kiln decode at each batch size: the share of the step spent in the routers (gate GEMM, scores,
top-k), in expert dispatch (sorting token-expert pairs, gathering their rows, the weighted scatter back) and in
the expert GEMMs (with the loop over experts that runs them).

    python benchmarks/bench_moe.py [--hidden 768] [--layers 8] [--expert-intermediate 1536] [--reps 3]
                                   [--new-tokens 32] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch


def build_model(out_dir: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Saves the random model; returns (active parameters per token, all parameters)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return active, total


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


class HFSide:
    name = "transformers"

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(self, batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - t0


class KilnSide:
    name = "kiln"

    def __init__(self, path: Path):
        from kiln import Engine

        self.engine = Engine(
            model_path=str(path), max_total_tokens=16384, max_running_requests=64, disable_radix_cache=True,
            disable_cuda_graph=True, num_threads=torch.get_num_threads(),
        )  # fmt: skip

    def run(self, batch: list[list[int]], new: int) -> float:
        sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        self.engine.generate(input_ids=batch, sampling_params=[sp] * len(batch))
        return time.perf_counter() - t0


def decode_rate(side, batch: int, new: int, vocab: int, seed: int) -> float:
    """Decode tok/s: `new` more tokens per request, prefill excluded by timing 1 new token too."""
    p = prompts(batch, 32, vocab, seed)
    one = side.run(p, 1)
    return batch * new / (side.run(p, new + 1) - one)


class DecodeProfile:
    """Wall time of Kiln's decode forwards and, inside them, of the routers, the experts' forward and their GEMM
    loop (the CPU ops are synchronous, so wall time is the ops' time). Prefill forwards are not counted."""

    def __init__(self, runner):
        self.runner = runner
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.decoding = False
        self.undo: list = []

    def _wrap(self, owner, method: str, key: str) -> None:
        inner = getattr(owner, method)

        def timed(*a, **kw):
            if not self.decoding:
                return inner(*a, **kw)
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        setattr(owner, method, timed)
        self.undo.append((owner, method, inner))

    def _forward(self, fb):
        from kiln.core.forward_batch import ForwardMode

        self.decoding = fb.mode == ForwardMode.DECODE
        self.steps += self.decoding
        t0 = time.perf_counter()
        try:
            return self.inner_forward(fb)
        finally:
            self.seconds["step"] += (time.perf_counter() - t0) if self.decoding else 0.0
            self.decoding = False

    def __enter__(self) -> DecodeProfile:
        from kiln.layers.moe import FusedMoE, TopKRouter

        self._wrap(TopKRouter, "forward", "routing")
        self._wrap(FusedMoE, "forward", "experts_all")
        self._wrap(FusedMoE, "_per_expert", "expert_gemms")
        self.inner_forward = self.runner.forward
        self.runner.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.forward  # back to the class's method
        for owner, method, inner in reversed(self.undo):
            setattr(owner, method, inner)


def step_shares(kiln: KilnSide, batch: int, new: int, vocab: int) -> dict:
    """Shares of Kiln's decode step time at `batch` requests."""
    with DecodeProfile(kiln.engine.scheduler.runner) as prof:
        kiln.run(prompts(batch, 32, vocab, 4242), new + 1)
    s = prof.seconds
    return {
        "step_ms": 1000 * s["step"] / max(1, prof.steps),
        "routing": s["routing"] / s["step"],
        "dispatch": (s["experts_all"] - s["expert_gemms"]) / s["step"],
        "expert_gemms": s["expert_gemms"] / s["step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--expert-intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        active, total = build_model(path, args)
        print(
            f"model: {active / 1e6:.0f}M active of {total / 1e6:.0f}M parameters, {torch.get_num_threads()} threads"
        )
        sides = [KilnSide(path), HFSide(path)]
        for side in sides:  # warm-up
            side.run(prompts(2, 16, args.vocab, 999), 3)
        rates: dict[tuple[str, int], list[float]] = defaultdict(list)
        for rep in range(args.reps):
            for batch in args.batches:
                for side in sides if rep % 2 == 0 else sides[::-1]:  # who goes first alternates too
                    rate = decode_rate(side, batch, args.new_tokens, args.vocab, 100 * rep + batch)
                    rates[side.name, batch].append(rate)
                    print(f"rep {rep} batch {batch} {side.name}: {rate:.1f} tok/s", flush=True)
        shares = {batch: step_shares(sides[0], batch, args.new_tokens, args.vocab) for batch in args.batches}
    rows = []
    print("| batch | Kiln decode tok/s | transformers tok/s | Kiln / transformers | Kiln step ms | routing | "
          "dispatch | expert GEMMs |")  # fmt: skip
    print("|---" * 8 + "|")
    for batch in args.batches:
        kiln, hf = (statistics.median(rates[name, batch]) for name in ("kiln", "transformers"))
        s = shares[batch]
        rows.append({"batch": batch, "kiln": kiln, "transformers": hf, **s})
        print(
            f"| {batch} | {kiln:.1f} | {hf:.1f} | {kiln / hf:.2f}x | {s['step_ms']:.1f} | {s['routing']:.1%} | "
            f"{s['dispatch']:.1%} | {s['expert_gemms']:.1%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"active": active, "total": total, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
