"""Kiln's integer CPU matmuls per instruction set against the float32-arithmetic kernels, on SmolLM2's shapes.

For each matrix (N x K) and number of rows M: ms per call of the integer kernel on each instruction-set path
(kiln/layers/int_gemm.py), of today's Q4_1 kernel that multiplies GGUF blocks in float32 (blocked_gemm.cpp's
linear_q4_1) and of the float32 kernel (blocked_gemm.cpp's linear); at M = 1, the GB/s of weight bytes each reads,
beside the streaming read bandwidth measured in the same run (the decode roofline).

    .venv/bin/python benchmarks/bench_int_gemm.py [--rows 1,8,32,512] [--qtypes Q4_0,Q4_1,Q8_0] [--isas ...] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch

from kiln.layers import cpu_gemm, int_gemm

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def per_call_ms(fn, x: torch.Tensor, budget_s: float) -> float:
    """Median ms of fn(x) over repeats filling about budget_s (at least 3)."""
    fn(x)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def read_bandwidth_gbs(budget_s: float, megabytes: int = 512) -> float:
    """GB/s of the float32 kernel at one row over a weight far larger than the caches (one FMA per 4 bytes read:
    bound by memory): the streaming read bandwidth a decode matmul, which reads each weight once, can reach with
    these threads. A torch.sum over the same buffer where the kernel is not built (its reduction is slower)."""
    k = 1024
    weight = torch.ones(megabytes * (1 << 20) // 4 // k, k)
    blocked = cpu_gemm.blocked_kernel()
    if blocked is None:
        return weight.numel() * 4 / per_call_ms(torch.sum, weight, budget_s) / 1e6
    packed = blocked.pack(weight)
    del weight
    return (
        packed.numel()
        * 4
        / per_call_ms(lambda x: blocked.linear(x, packed), torch.ones(1, k), budget_s)
        / 1e6
    )


def gguf_rows(qtype: str, weight: torch.Tensor) -> torch.Tensor:
    if qtype == "I8":
        return int_gemm.quantize_int8_rows(weight)
    import gguf

    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[qtype]))


def _int_linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    return int_gemm.linear(x, packed, qtype, n, k)


def cell(ms: float, weight_bytes: int, m: int) -> str:
    return f"{ms:8.3f}" + (f" ({weight_bytes / ms / 1e6:5.1f} GB/s)" if m == 1 else "")


def bench_shape(name: str, n: int, k: int, args) -> None:
    weight = torch.randn(n, k) * 0.05
    blocked = cpu_gemm.blocked_kernel()
    kernels: dict[str, tuple] = {}  # label -> (instruction-set path or None, call(x), weight bytes)
    for qtype in args.qtypes:
        rows = gguf_rows(qtype, weight)
        packed = int_gemm.pack(qtype, rows)
        for isa in args.isas:
            call = functools.partial(_int_linear, packed=packed, qtype=qtype, n=n, k=k)
            kernels[f"int {qtype} {isa}"] = (isa, call, packed.numel())
    if blocked is not None:
        q4_1 = blocked.pack_q4_1(gguf_rows("Q4_1", weight))
        kernels["f32-arith Q4_1"] = (None, lambda x, w=q4_1: blocked.linear_q4_1(x, w), q4_1.numel())
        f32 = blocked.pack(weight)
        kernels["float32"] = (None, lambda x, w=f32: blocked.linear(x, w), f32.numel() * 4)
    for m in args.rows:
        x = torch.randn(m, k)
        for label, (isa, call, weight_bytes) in kernels.items():
            if m * n * k > args.max_scalar_macs and label.endswith("scalar"):
                continue
            int_gemm.set_isa(isa)
            ms = per_call_ms(call, x, args.budget)
            print(f"{name:8s} {n:6d}x{k:<5d} M={m:<4d} {label:24s} {cell(ms, weight_bytes, m)}", flush=True)
    int_gemm.set_isa(None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,32,512", help="numbers of rows of x, comma-separated")
    parser.add_argument("--qtypes", default="Q4_0,Q4_1,Q8_0", help="integer kernels' formats")
    parser.add_argument("--isas", default=",".join(int_gemm.available_isas()), help="instruction-set paths")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of repeats per measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-scalar-macs", type=float, default=2e8, help="skip the scalar path above this")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.rows = [int(m) for m in args.rows.split(",")]
    args.qtypes, args.isas = args.qtypes.split(","), args.isas.split(",")
    print(f"threads {torch.get_num_threads()}, paths this CPU runs: {', '.join(int_gemm.available_isas())}")
    print(
        f"streaming read bandwidth (float32 kernel, 512 MB weight): {read_bandwidth_gbs(args.budget):.1f} GB/s"
    )
    for name in args.shapes.split(","):
        bench_shape(name, *SHAPES[name], args)


if __name__ == "__main__":
    main()
