"""FP8 block weights multiplied as stored (kiln/layers/triton_fp8.py) against the same weights in bfloat16 (torch's
matmul), side by side in one run, on DeepSeek-V3's per-rank shapes at tp 8.

For each shape and row count: both products' median time, their ratio, the FP8 kernel's weight bytes over its time
as a share of the measured copy bandwidth (decode rows: a weight-bound product, where FP8's half the bytes should
show as up to 2x), and the largest difference from the bfloat16 product relative to its largest value. The routed
experts run as a decode step's top-8 of 256 experts (the grouped kernel) against a loop of torch matmuls over the
same 8 experts. Prints one JSON document (and writes it to --json).

    python benchmarks/cuda/bench_fp8.py [--json $OUT/bench_fp8.json]
    python benchmarks/cuda/bench_fp8.py --tiny --device cpu   # the script's own smoke test (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_8b import bandwidth, timed  # noqa: E402

from kiln.layers.fp8_linear import dequantize_blocks  # noqa: E402
from kiln.layers.triton_fp8 import fp8_block_linear, fp8_grouped_linear, group_rows  # noqa: E402

# DeepSeek-V3 at tp 8: (name, output features, input features) of one rank's weights
SHAPES = [("q_b_proj", 128 * 192 // 8, 1536), ("o_proj", 7168, 128 * 128 // 8),
          ("dense gate_up", 2 * 18432 // 8, 7168), ("dense down", 7168, 18432 // 8)]  # fmt: skip
EXPERTS, TOP_K, EXPERT_N, EXPERT_K = 256, 8, 2 * 2048 // 8, 7168  # routed experts' gate_up per rank
TINY_SHAPES = [("tiny", 256, 384)]


def fp8_weight(n: int, k: int, device: str, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(*lead, n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(*lead, -(-n // 128), -(-k // 128), device=device) * 1e-3 + 1e-4
    return w, scale


def compare(name: str, n: int, k: int, rows: int, device: str, reps: int, copy_bw: float) -> dict:
    w, scale = fp8_weight(n, k, device)
    dense = dequantize_blocks(w, scale, (128, 128)).to(torch.bfloat16)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    fp8_s = timed(lambda: fp8_block_linear(x, w, scale, (128, 128)), device, reps)
    bf16_s = timed(lambda: x @ dense.T, device, reps)
    want = (x @ dense.T).float()
    diff = (fp8_block_linear(x, w, scale, (128, 128)).float() - want).abs().max() / want.abs().max()
    weight_bytes = w.nbytes + scale.nbytes
    return {
        "shape": name, "n": n, "k": k, "rows": rows, "fp8_us": fp8_s * 1e6, "bf16_us": bf16_s * 1e6,
        "bf16_over_fp8": bf16_s / fp8_s, "fp8_bandwidth_share": weight_bytes / fp8_s / copy_bw,
        "max_rel_diff": diff.item(),
    }  # fmt: skip


def compare_experts(device: str, reps: int, copy_bw: float, experts: int, n: int, k: int) -> dict:
    """One decode token's top-k experts: the grouped kernel over the rows sorted by expert, against torch matmuls
    of the same experts in bfloat16."""
    top = min(TOP_K, experts)
    w, scale = fp8_weight(n, k, device, (experts,))
    chosen = torch.randperm(experts, device=device)[:top].sort().values
    dense = torch.stack([dequantize_blocks(w[e], scale[e], (128, 128)) for e in chosen.tolist()]).bfloat16()
    x = torch.randn(top, k, device=device, dtype=torch.bfloat16)
    groups = group_rows(
        chosen, experts, x
    )  # timed below with the products: the MoE layer lays them out each step
    fp8_s = timed(
        lambda: fp8_grouped_linear(x, w, scale, (128, 128), group_rows(chosen, experts, x)), device, reps
    )
    bf16_s = timed(lambda: torch.stack([x[i] @ dense[i].T for i in range(top)]), device, reps)
    want = torch.stack([x[i] @ dense[i].T for i in range(top)]).float()
    diff = (fp8_grouped_linear(x, w, scale, (128, 128), groups).float() - want).abs().max() / want.abs().max()
    weight_bytes = top * (w[0].nbytes + scale[0].nbytes)
    return {
        "shape": f"routed experts gate_up, top {top} of {experts}", "n": n, "k": k, "rows": top,
        "fp8_us": fp8_s * 1e6, "bf16_us": bf16_s * 1e6, "bf16_over_fp8": bf16_s / fp8_s,
        "fp8_bandwidth_share": weight_bytes / fp8_s / copy_bw, "max_rel_diff": diff.item(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for the CPU smoke test")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = bandwidth(args.device, 0.01 if args.tiny else 4)
    shapes, row_counts = (TINY_SHAPES, (1, 20)) if args.tiny else (SHAPES, (1, 8, 64, 4096))
    rows = [
        compare(name, n, k, m, args.device, args.reps, copy_bw) for name, n, k in shapes for m in row_counts
    ]
    experts = (4, 256, 384) if args.tiny else (EXPERTS, EXPERT_N, EXPERT_K)
    rows.append(compare_experts(args.device, args.reps, copy_bw, *experts))
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {"device": device, "copy_bandwidth_GBps": copy_bw / 1e9, "results": rows}
    for r in rows:
        print(f"{r['shape']:>44} rows {r['rows']:>5}: fp8 {r['fp8_us']:9.1f} us, bf16 {r['bf16_us']:9.1f} us, "
              f"bf16/fp8 {r['bf16_over_fp8']:.2f}x, fp8 at {r['fp8_bandwidth_share']:.0%} of copy bandwidth, "
              f"max rel diff {r['max_rel_diff']:.1e}")  # fmt: skip
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
