"""CPU matmul kernels at the default model's decode shapes, side by side in one run: what a faster compiled
decode step could be built from, and what each costs (docs/benchmarks.md, "Graph capture: batch 8 and 32").

Kernels over the projections of --layers layers (qkv, o, gate_up, down) at each batch size:
  mkl                 F.linear on plain weights (transformers' path)
  onednn              oneDNN-prepacked weights (Kiln's path where its own kernel is unavailable)
  kiln                Kiln's blocked kernel (kiln/layers/csrc/blocked_gemm.cpp): Kiln's path on AVX2 CPUs
  kiln-q4_1           the same kernel on the weights quantized to GGML Q4_1 (gguf.quants), dequantized inside
                      the kernel (the default model's linear weights: 0.625 bytes a weight)
  kiln-q8_0           the same on GGML Q8_0 (the default model's tied embedding / lm head: 1.0625 bytes a weight)
  inductor-reduction  torch.compile of an explicit multiply-and-sum over plain weights (weights stay graph
                      inputs, so the on-disk compile caches apply)
  inductor-template   torch.compile with inductor's freezing and max-autotune's CPP GEMM template (weights are
                      frozen into the compiled code as constants, packed per compiled graph)
With --step, the whole decode step compiled with freezing and the CPP GEMM template, one static graph per batch
size (with --dynamic-batch, one graph for every batch size above 1), against Kiln's eager step, with the process
memory each compile adds and the compile caches' verdict. With --lm-head, the same kernels on the lm head's shape
(vocab, hidden) as well. Times are against oneDNN and, where it ran, Kiln's float32 kernel; GB/s counts the bytes
of each kernel's own weights.

    python benchmarks/bench_linear_kernels.py [--bs 1 8 32] [--layers 30] [--reps 20] [--kernels ...]
                                              [--lm-head] [--step [--dynamic-batch]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch
import torch.nn.functional as F

from kiln.layers import cpu_gemm

STEP_KV_LEN = 200  # the decode step's KV length per request
KERNELS = ("mkl", "onednn", "kiln", "kiln-q4_1", "kiln-q8_0", "inductor-reduction", "inductor-template")
# the GGML-quantized kernels: quantization, the kernel's pack and linear, bytes a weight
QUANTIZED = {
    "kiln-q4_1": (gguf.GGMLQuantizationType.Q4_1, "pack_q4_1", "linear_q4_1", 20 / 32),
    "kiln-q8_0": (gguf.GGMLQuantizationType.Q8_0, "pack_q8_0", "linear_q8_0", 34 / 32),
}


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cache_verdict() -> str:
    """The on-disk compile caches' hits, misses and bypasses since the counters were last cleared."""
    from torch._dynamo.utils import counters

    aot, ind = counters["aot_autograd"], counters["inductor"]
    return (
        f"aot cache hit/miss/bypass {aot['autograd_cache_hit']}/{aot['autograd_cache_miss']}/"
        f"{aot['autograd_cache_bypass']}, fx graph cache hit/miss/bypass {ind['fxgraph_cache_hit']}/"
        f"{ind['fxgraph_cache_miss']}/{ind['fxgraph_cache_bypass']}"
    )


class Projections(torch.nn.Module):
    """The layers' projections as plain nn.Linear modules, fed one input per input width."""

    def __init__(self, shapes: list[tuple[int, int]], layers: int):
        super().__init__()
        self.linears = torch.nn.ModuleList(
            torch.nn.Linear(k, n, bias=False) for _ in range(layers) for n, k in shapes
        )

    def forward(self, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [lin(xs[lin.in_features]) for lin in self.linears]


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def reduction_matmul(xs: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """x W^T as a multiply-and-sum laid out [N, M]: each weight row is read once for the whole batch."""
    return [(w[:, None, :] * xs[w.shape[1]][None]).sum(-1).t() for w in weights]


def kernels(mod: Projections, bs: int, names: list[str]) -> dict[str, tuple[float, object]]:
    """name -> (compile seconds, fn()) for one batch size, the kernels asked for."""
    xs = {k: torch.randn(bs, k) for k in {lin.in_features for lin in mod.linears}}
    plain = [lin.weight.detach() for lin in mod.linears]
    out: dict[str, tuple[float, object]] = {}
    if "mkl" in names:
        out["mkl"] = (0.0, lambda: [F.linear(xs[w.shape[1]], w) for w in plain])
    if "onednn" in names:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
        out["onednn"] = (0.0, lambda: [onednn(xs[p.shape[1]], p) for p in packed])
    kernel = cpu_gemm.blocked_kernel()
    if "kiln" in names and kernel is not None:
        blocked = [kernel.pack(w) for w in plain]
        out["kiln"] = (0.0, lambda: [kernel.linear(xs[b.shape[1]], b) for b in blocked])
    for name, (qtype, pack, linear, _) in QUANTIZED.items():
        if name in names and kernel is not None:
            raw = [torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype)) for w in plain]
            qpacked = [(w.shape[1], getattr(kernel, pack)(r)) for w, r in zip(plain, raw)]
            fn = getattr(kernel, linear)
            out[name] = (0.0, lambda qpacked=qpacked, fn=fn: [fn(xs[k], q) for k, q in qpacked])
    if "inductor-reduction" in names:
        torch._dynamo.reset()
        reduction = torch.compile(reduction_matmul, dynamic=False)
        t0 = time.perf_counter()
        reduction(xs, plain)
        out["inductor-reduction"] = (time.perf_counter() - t0, lambda: reduction(xs, plain))
    if "inductor-template" in names:
        torch._dynamo.reset()
        with torch._inductor.config.patch(
            freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"
        ):
            template = torch.compile(mod, dynamic=False)
            t0 = time.perf_counter()
            template(xs)
            out["inductor-template"] = (time.perf_counter() - t0, lambda: template(xs))
    return out


def bench_kernels(args, shapes: list[tuple[int, int]], layers: int, what: str = "projections") -> None:
    mod = Projections(shapes, layers).eval()
    weights = sum(n * k for n, k in shapes) * layers
    print(f"{layers} layers of {what} {shapes} (N, K), {weights * 4 / 1e6:.0f} MB of float32 weights")
    with torch.no_grad():
        for bs in args.bs:
            found = kernels(mod, bs, args.kernels)
            ms = {name: median_ms(fn, args.reps) for name, (_, fn) in found.items()}
            for name, t in ms.items():
                ratios = "  ".join(f"{ms[b] / t:5.2f}x {b}" for b in ("onednn", "kiln") if b in ms)
                mb = weights * (QUANTIZED[name][3] if name in QUANTIZED else 4) / 1e6
                print(
                    f"bs={bs:<3} {name:<19} {t:7.2f} ms  {ratios}  {mb / t:5.1f} GB/s  "
                    f"compile {found[name][0]:5.1f} s"
                )


def bench_step(args) -> None:
    """Kiln's eager decode step against the step compiled with freezing + the CPP GEMM template."""
    from kiln import Engine
    from kiln.platform import current_rss_bytes
    from kiln.runner.graph_backends import _decode_step, dummy_decode_inputs

    def model(prepack: bool):
        opts = dict(disable_cuda_graph=True, max_total_tokens=8192, max_running_requests=64)
        return Engine(disable_weight_prepack=not prepack, **opts).scheduler.runner.model

    def inputs(bs: int):
        ids, pos, loc, table, mask = dummy_decode_inputs(bs, STEP_KV_LEN, "cpu")
        mask[...] = True
        return ids, pos, loc, table, mask

    eager, plain = model(True), model(False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with (
        torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"),
        torch.inference_mode(),
    ):
        step = torch.compile(_decode_step, dynamic=False)
        for bs in args.bs:
            rss, t0 = current_rss_bytes(), time.perf_counter()
            x = inputs(bs)
            torch._dynamo.mark_dynamic(x[3], 1)
            torch._dynamo.mark_dynamic(x[4], 3)
            for t in x if args.dynamic_batch and bs > 1 else ():  # batch 1 is always specialised
                torch._dynamo.mark_dynamic(t, 0)
            step(plain, *x)
            seconds, added = time.perf_counter() - t0, (current_rss_bytes() - rss) / 1e6
            x = inputs(bs)
            e = median_ms(lambda x=x: _decode_step(eager, *x), args.reps)
            c = median_ms(lambda x=x: step(plain, *x), args.reps)
            same = bool((_decode_step(eager, *x).argmax(-1) == step(plain, *x).argmax(-1)).all())
            print(
                f"step bs={bs:<3} eager {e:6.1f} ms  template {c:6.1f} ms  {e / c:4.2f}x  "
                f"compile {seconds:5.1f} s  rss +{added:5.0f} MB  same argmax {same}"
            )
    print(f"step compile caches: {cache_verdict()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--lm-head", action="store_true", help="also the lm head's shape (vocab, hidden)")
    ap.add_argument("--step", action="store_true", help="also the whole decode step (loads the model twice)")
    ap.add_argument(
        "--dynamic-batch", action="store_true", help="--step: one graph for every batch size above 1"
    )
    args = ap.parse_args()
    from kiln.loader.default_model import default_model_path
    from kiln.loader.model_config import read_hf_config

    cfg = read_hf_config(default_model_path())
    hidden, ffn, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    qkv = (heads + 2 * cfg.get("num_key_value_heads", heads)) * head_dim
    torch.manual_seed(0)
    bench_kernels(
        args, [(qkv, hidden), (hidden, heads * head_dim), (2 * ffn, hidden), (hidden, ffn)], args.layers
    )
    if args.lm_head:
        bench_kernels(args, [(cfg["vocab_size"], hidden)], 1, "lm head")
    if args.step:
        bench_step(args)


if __name__ == "__main__":
    main()
