"""Kiln's CPU kernels for a decode step's per-token work against the ATen ops they replace, in one process, and
the default model's eager decode with its GGUF blocks against float32 weights.

- decode attention: one call reading each request's slots in the KV pool (csrc/cpu_ops.cpp) vs two index_select
  gathers + SDPA (the path compiled steps and other devices take), default model's heads (9 query, 3 KV, dim 64)
- decode attention over a shared prefix (32 requests, a 1,296-slot common prefix + up to 64 slots each): the
  kernel reading the prefix once per chunk of 8 requests (`shared`) vs walking each request's slots vs one SDPA
  call over the batch's distinct slots (TorchSdpaBackend's own way of reading a common prefix once)
- RMSNorm: one call vs F.rms_norm, hidden 576
- decode tok/s of the default model, eager, at batch 1 / 8 / 32: Q4_1 / Q8_0 blocks (--cpu-gemm auto, the
  default) vs --cpu-gemm f32 (float32 weights), engines alternating
- `--against REV`: instead, decode attention as this tree's kernel vs the kernel built from git revision REV's
  sources (a kernel change against the code before it), alternating call batches, outputs compared bit for bit

    python benchmarks/bench_cpu_ops.py [--bs 1 8 32] [--reps 2] [--no-engine]
    python benchmarks/bench_cpu_ops.py --against HEAD
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576


def _time_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def attention_row(kernel, k_pool: torch.Tensor, v_pool: torch.Tensor, bs: int, context: int) -> None:
    q = torch.randn(bs, HEADS, HEAD_DIM)
    table = torch.randint(0, k_pool.shape[0] - context, (bs, 1)) + torch.arange(
        context
    )  # a run of slots each
    flat, mask = table.reshape(-1), torch.empty(0, dtype=torch.bool)

    def aten():
        k, v = (
            p.index_select(0, flat).view(bs, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
            for p in (k_pool, v_pool)
        )
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=0.125, enable_gqa=True).squeeze(2)

    def kiln():
        return kernel.decode_attention(q, k_pool, v_pool, table, mask, 0.125)

    assert torch.allclose(aten(), kiln(), atol=1e-5)
    a, k = _time_us(aten), _time_us(kiln)
    print(f"| decode attention, batch {bs}, {context} slots | {a:.0f} us | {k:.0f} us | {a / k:.2f}x |")


def attention_rows(batch_sizes: list[int], context: int = 330) -> None:
    from kiln.layers.cpu_gemm import blocked_kernel

    kernel = blocked_kernel()
    k_pool, v_pool = (torch.randn(40_000, KV_HEADS, HEAD_DIM) for _ in range(2))
    for bs in batch_sizes:
        attention_row(kernel, k_pool, v_pool, bs, context)
    x, w = torch.randn(1, HIDDEN), torch.randn(HIDDEN)
    a = _time_us(lambda: F.rms_norm(x, (HIDDEN,), w, 1e-5), 2000)
    k = _time_us(lambda: kernel.rms_norm(x, w, 1e-5), 2000)
    print(f"| RMSNorm, 1 x {HIDDEN} | {a:.1f} us | {k:.1f} us | {a / k:.2f}x |")


def _allocator_table(bs: int, prefix: int, own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs, prefix + own] slots and mask laid out as the allocator lays them: a common prompt of `prefix` slots (a
    run), then up to `own` slots per request, one per decode step (bs apart)."""
    lens = torch.randint(max(1, own // 4), own + 1, (bs,), generator=torch.Generator().manual_seed(0))
    table = torch.zeros(bs, prefix + own, dtype=torch.long)
    mask = torch.zeros(bs, prefix + own, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        table[b, :prefix] = torch.arange(1, 1 + prefix)
        table[b, prefix : prefix + n] = 1 + prefix + b + bs * torch.arange(n)
        mask[b, : prefix + n] = True
    return table, mask


def shared_prefix_row(bs: int = 32, prefix: int = 1296, own: int = 64) -> None:
    from kiln.core.forward_batch import ForwardBatch, ForwardMode
    from kiln.layers.cpu_gemm import blocked_kernel
    from kiln.memory.kv_pool import KVPool
    from kiln.runner.attention import TorchSdpaBackend

    kernel = blocked_kernel()
    pool = KVPool(65_536, 1, 1, KV_HEADS, HEAD_DIM, torch.float32)
    pool.k[0].normal_(), pool.v[0].normal_()
    table, mask = _allocator_table(bs, prefix, own)
    q = torch.randn(bs, HEADS, HEAD_DIM)
    fb = ForwardBatch(ForwardMode.DECODE, q, q, q, None, kv_table=table, kv_mask=mask.view(bs, 1, 1, -1))
    backend = TorchSdpaBackend(pool, HEADS)

    def distinct():
        return backend._decode_over_distinct(0, q, backend.prepare_metadata(fb).distinct, 0.125)

    def walk(shared: int):
        return kernel.decode_attention(q, pool.k[0], pool.v[0], table, mask, 0.125, shared)

    assert torch.equal(walk(0), walk(prefix)) and torch.allclose(distinct(), walk(prefix), atol=1e-5)
    d, w, sh = _time_us(distinct, 50), _time_us(lambda: walk(0), 50), _time_us(lambda: walk(prefix), 50)
    print(
        f"\n| decode attention, batch {bs}, {prefix}-slot shared prefix + <= {own} own slots | time | vs SDPA |"
    )
    print("|---|---|---|")
    print(f"| SDPA over the batch's distinct slots (with finding them) | {d:.0f} us | 1.00x |")
    print(f"| Kiln's kernel, each request's slots | {w:.0f} us | {d / w:.2f}x |")
    print(f"| Kiln's kernel, the prefix once per 8 requests (bit-identical) | {sh:.0f} us | {d / sh:.2f}x |")


def decode_tok_s(eng, bs: int, seed: int) -> float:
    """bs requests of 200 tokens: (time for 65 tokens - time for 1) over bs x 64."""
    ids = [[(i * 7919 + j * 31 + seed) % 40000 + 100 for j in range(200)] for i in range(bs)]

    def run(new: int) -> float:
        eng.scheduler.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=[{"max_new_tokens": new, "temperature": 0.0,
                                                      "ignore_eos": True}] * bs)  # fmt: skip
        return time.perf_counter() - t0

    return bs * 64 / (run(65) - run(1))


def engine_rows(batch_sizes: list[int], reps: int) -> None:
    import kiln
    from kiln.loader.default_model import default_model_path

    engines = {
        mode: kiln.Engine(
            model_path=default_model_path(), max_total_tokens=16384, max_running_requests=64, cpu_gemm=mode
        )
        for mode in ("auto", "f32")  # the mode decides how the weights are packed, at load
    }
    for bs in batch_sizes:
        runs: dict[str, list[float]] = {m: [] for m in engines}
        for r in range(reps):
            for mode, eng in engines.items():
                runs[mode].append(decode_tok_s(eng, bs, seed=r))
        q, f = statistics.median(runs["auto"]), statistics.median(runs["f32"])
        print(f"| decode batch {bs} | {q:.1f} tok/s | {f:.1f} tok/s | {q / f:.2f}x |", flush=True)


def kernel_at(rev: str):
    """Kiln's CPU kernels built from git revision `rev`'s sources, under a name of their own."""
    from kiln.layers import cpu_gemm

    root = Path(__file__).resolve().parents[1]
    out = Path(tempfile.mkdtemp(prefix="kiln-kernel-"))
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=root, capture_output=True, text=True, check=True
    )
    srcs = []
    for src in cpu_gemm._SOURCES:
        rel = Path(src).relative_to(root).as_posix()
        text = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, text=True, check=True
        )
        srcs.append(out / Path(src).name)
        srcs[-1].write_text(text.stdout)
    return cpu_gemm.load_extension(f"kiln_kernel_{sha.stdout.strip()}", [str(s) for s in srcs], str(out))


def against_rows(rev: str, rounds: int = 7, calls: int = 20) -> None:
    """Decode attention shapes, this tree's kernel vs `rev`'s: the median over rounds of alternating batches."""
    from kiln.layers.cpu_gemm import blocked_kernel
    from kiln.memory.kv_pool import KVPool

    kernels = {"this tree": blocked_kernel(), rev: kernel_at(rev)}
    pool = KVPool(65_536, 1, 1, KV_HEADS, HEAD_DIM, torch.float32)
    pool.k[0].normal_(), pool.v[0].normal_()
    print(f"| decode attention | {rev} | this tree | speed-up | bit-identical |\n|---|---|---|---|---|")
    cases = [(bs, 0, 330, False) for bs in (1, 8, 32)] + [(32, 1296, 64, True), (32, 1296, 64, False)]
    for bs, prefix, own, shared in cases:
        table, mask = _allocator_table(bs, prefix, own)
        q = torch.randn(bs, HEADS, HEAD_DIM)
        width = prefix if shared else 0
        args = (q, pool.k[0], pool.v[0], table, mask, 0.125, width)
        calls_of = {name: functools.partial(k.decode_attention, *args) for name, k in kernels.items()}
        same = torch.equal(*(f() for f in calls_of.values()))
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(rounds):
            for name, f in calls_of.items():
                times[name].append(_time_us(f, calls))
        old, new = (statistics.median(times[n]) for n in (rev, "this tree"))
        what = f"batch {bs}, " + (f"{prefix}-slot common prefix + " if prefix else "") + f"<= {own} own slots"
        what += ", prefix read once per 8 requests" if shared else (", walked per request" if prefix else "")
        print(f"| {what} | {old:.0f} us | {new:.0f} us | {old / new:.2f}x | {same} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true", help="kernels only")
    ap.add_argument(
        "--against", metavar="REV", help="decode attention: this tree's kernel vs git revision REV's"
    )
    args = ap.parse_args()
    if args.against:
        against_rows(args.against)
        return
    print("| op | ATen | Kiln's kernel | speed-up |\n|---|---|---|---|")
    attention_rows(args.bs)
    shared_prefix_row()
    if not args.no_engine:
        print(
            "\n| default model, eager | GGUF blocks | float32 weights | blocks / float32 |\n|---|---|---|---|"
        )
        engine_rows(args.bs, args.reps)


if __name__ == "__main__":
    main()
