"""A small random Qwen3-Next (gated DeltaNet linear attention, full attention every fourth layer, MoE with a
gated shared expert) on the CPU: Kiln's in-process engine against transformers `generate()`, side by side in one
run, and where Kiln's decode step goes (the linear-attention layers' state update, full attention, the MoE).

The model: random weights saved with transformers into a temporary directory; hidden 512 and 8 layers by
default (6 linear, 2 full attention), 8 experts top 2.

Figures: decode tok/s at batch 1 and at batch 32 (the time of n + 1 new tokens less that of 1, so prefill is not
counted), the median of --reps runs with the engines alternating (and which goes first alternating), so drift of
a shared host hits both alike. Then one profiled Kiln decode at each batch size: the share of the step spent in
the linear-attention layers' token mixing (conv and delta rule, with their state reads and writes), in their
delta rule alone, and in the MoE blocks.

    python benchmarks/bench_hybrid.py [--hidden 512] [--layers 8] [--reps 3] [--new-tokens 32] [--threads N]
                                      [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_moe import HFSide, KilnSide, decode_rate, prompts


def build_model(out_dir: Path, args: argparse.Namespace) -> int:
    """Saves the random model; returns its parameter count."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    heads = args.hidden // 64
    cfg = Qwen3NextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, full_attention_interval=4, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=64, linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=args.hidden, shared_expert_intermediate_size=args.hidden,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


class DecodeProfile:
    """Wall time of Kiln's decode forwards and, inside them, of the linear layers' token mixing, their delta
    rule and the MoE blocks (the CPU ops are synchronous, so wall time is the ops' time)."""

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
        import kiln.models.qwen3_next as qwen3_next
        from kiln.layers.moe import SparseMoeBlock

        self._wrap(qwen3_next.GatedDeltaNet, "_decode", "linear_mixing")
        self._wrap(qwen3_next, "delta_rule_step", "delta_rule")
        self._wrap(SparseMoeBlock, "forward", "moe")
        self.inner_forward = self.runner.forward
        self.runner.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.forward  # back to the class's method
        for owner, method, inner in reversed(self.undo):
            setattr(owner, method, inner)


def step_shares(kiln: KilnSide, batch: int, new: int, vocab: int) -> dict:
    with DecodeProfile(kiln.engine.scheduler.runner) as prof:
        kiln.run(prompts(batch, 32, vocab, 4242), new + 1)
    s = prof.seconds
    return {
        "step_ms": 1000 * s["step"] / max(1, prof.steps),
        "linear_mixing": s["linear_mixing"] / s["step"],
        "delta_rule": s["delta_rule"] / s["step"],
        "moe": s["moe"] / s["step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
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
        total = build_model(path, args)
        print(f"model: {total / 1e6:.0f}M parameters, {torch.get_num_threads()} threads")
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
    print("| batch | Kiln decode tok/s | transformers tok/s | Kiln / transformers | Kiln step ms | linear mixing | "
          "of it delta rule | MoE |")  # fmt: skip
    print("|---" * 8 + "|")
    for batch in args.batches:
        kiln, hf = (statistics.median(rates[name, batch]) for name in ("kiln", "transformers"))
        s = shares[batch]
        rows.append({"batch": batch, "kiln": kiln, "transformers": hf, **s})
        print(
            f"| {batch} | {kiln:.1f} | {hf:.1f} | {kiln / hf:.2f}x | {s['step_ms']:.1f} | "
            f"{s['linear_mixing']:.1%} | {s['delta_rule']:.1%} | {s['moe']:.1%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": total, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
