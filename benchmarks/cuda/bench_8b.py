"""An 8B-class model against the GPU's own limits, in one run of a few minutes (issue: an attention backend that
reads the paged pool, and an 8B-class model close to the hardware's limits).

Builds a Llama-3-8B-shaped model with random bfloat16 weights on the GPU (`--load-format dummy`: only a
config.json and a tokenizer on disk, nothing downloaded), measures the machine's HBM bandwidth and bfloat16 matmul
peak, then runs batch-1 decode, batch-64 decode and a 4k-token prefill, and compares the graph capture's memory
with the ledger's reserve. Prints one JSON document (and writes it to --json).

    python benchmarks/cuda/bench_8b.py --tokenizer .devcarry/tiny-llama [--attention-backend triton]
        [--json $OUT/bench_8b.json]
    python benchmarks/cuda/bench_8b.py --tokenizer DIR --tiny --device cpu   # the script's own smoke test

Figures: batch-1 decode's bytes read per token (weights + the KV of its context) over its time, as a share of the
measured bandwidth (target >= 80%); the 4k prefill's FLOPs (2 x parameters per token + causal attention) over its
time, as a share of the matmul peak (target >= 50%); batch-64 decode in tok/s and as a share of the compute limit;
capture memory against the ledger's graph reserve (target within 10%).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

LLAMA_3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
TINY = dict(LLAMA_3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152)  # fmt: skip


def model_dir(shape: dict, tokenizer: str) -> str:
    """A directory with the model's config.json and the tokenizer's files, no weights."""
    out = Path(tempfile.mkdtemp(prefix="kiln-8b-"))
    for f in Path(tokenizer).iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                  tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2)  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """The median seconds of `reps` calls after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bandwidth(device: str, gib: float) -> float:
    """Bytes per second a copy moves (read + write) over a buffer far larger than any cache."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), device, 5)


def matmul_peak(device: str, size: int) -> float:
    """bfloat16 FLOP/s of one large square matmul."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    return 2 * size**3 / timed(lambda: a @ b, device, 5)


def decode_rate(engine, batch: int, context: int, new: int) -> float:
    """Decode tok/s at `batch` requests of `context` prompt tokens each (prefill not counted: one token's run is
    timed first and taken off)."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(context)] for i in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": n, "ignore_eos": True, "temperature": 0}
        )
        return time.perf_counter() - t0

    engine.scheduler.flush_cache()
    first = run(1)
    engine.scheduler.flush_cache()
    return batch * (new - 1) / (run(new) - first)


GEMM_MARKERS = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "sm90_", "cublas")


def decode_profile(engine, context: int, steps: int, top: int = 14) -> dict:
    """Where a batch-1 decode step's time goes on the GPU: torch's profiler over `steps` decode steps of a prompt
    already in the radix cache (its prefill is not in the window), kernels grouped by name. Kernel time per step
    against wall time per step says whether the GPU or the host sets the pace; GEMM kernels against the rest says
    how much of the GPU's time reads weights."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompt = [[(13 * j) % 1000 + 10 for j in range(context)]]
    params = {"max_new_tokens": steps + 1, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=prompt, sampling_params=params)  # cached now: the profiled run is decode steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=params)
        sync("cuda" if torch.cuda.is_available() else "cpu")
        wall = time.perf_counter() - t0
    kernels = [
        e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    total = sum(e.self_device_time_total for e in kernels)  # microseconds
    gemm = sum(e.self_device_time_total for e in kernels if any(m in e.key.lower() for m in GEMM_MARKERS))
    per_step = steps + 1
    rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {
        "steps": per_step,
        "wall_us_per_step": wall * 1e6 / per_step,
        "kernel_us_per_step": total / per_step,
        "gemm_us_per_step": gemm / per_step,
        "kernels_per_step": sum(e.count for e in kernels) / per_step,
        "top": [
            {
                "kernel": e.key[:90],
                "calls_per_step": e.count / per_step,
                "us_per_step": e.self_device_time_total / per_step,
            }
            for e in rows
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokenizer", required=True, help="a directory holding a tokenizer (e.g. the tiny test model)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default=None, choices=["triton", "torch_native"])
    ap.add_argument(
        "--tiny", action="store_true", help="a 2-layer model of the same kind: the script's smoke test"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile", action="store_true", help="also profile batch-1 decode steps' kernels (CUDA)"
    )
    args = ap.parse_args()
    import kiln

    shape = TINY if args.tiny else LLAMA_3_8B
    figures: dict = {"shape": shape, "device": args.device}
    figures["bandwidth_gbs"] = bandwidth(args.device, 0.25 if args.tiny else 4) / 1e9
    figures["matmul_tflops"] = matmul_peak(args.device, 512 if args.tiny else 8192) / 1e12
    t0 = time.perf_counter()
    engine = kiln.Engine(
        model_path=model_dir(shape, args.tokenizer), load_format="dummy", device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16", attention_backend=args.attention_backend,
        cuda_graph_max_bs=64, max_running_requests=64, context_length=8192,
    )  # fmt: skip
    figures["startup_s"] = time.perf_counter() - t0
    runner, ledger = engine.scheduler.runner, engine.parts.ledger
    weights = runner.measured["weights"]
    params = sum(p.numel() for p in runner.model.parameters())
    kv_per_token = runner.measured["kv_pool"] / (runner.kv_pool.num_tokens + runner.kv_pool.page_size)
    if runner.graphs is not None:
        graphs = runner.graphs.summary()
        captured = sum(phase["capture_bytes"] for phase in graphs.values())
        figures["capture"] = {
            "seconds": sum(phase["capture_seconds"] for phase in graphs.values()),
            "bytes": captured,
            "bytes_by_phase": {name: phase["capture_bytes"] for name, phase in graphs.items()},
            "ledger_reserve_bytes": ledger.graph_reserve_bytes,
            "over_ledger": captured / max(1, ledger.graph_reserve_bytes),
        }
    context, new = 512, 8 if args.tiny else 128
    one = decode_rate(engine, 1, context, new)
    bytes_per_token = weights + kv_per_token * (context + new / 2)
    figures["decode_bs1"] = {
        "tok_s": one,
        "bytes_per_token": bytes_per_token,
        "share_of_bandwidth": one * bytes_per_token / (figures["bandwidth_gbs"] * 1e9),
    }
    if args.profile:
        figures["profile_bs1"] = decode_profile(engine, context, 32 if not args.tiny else 4)
    many = decode_rate(engine, 64 if not args.tiny else 8, context, new)
    figures["decode_bs64"] = {
        "tok_s": many,
        "share_of_compute": many * 2 * params / (figures["matmul_tflops"] * 1e12),
    }
    prompt = 256 if args.tiny else 4096
    ids = [(11 * j) % 1000 + 10 for j in range(prompt)]
    cfg = runner.model_config

    def prefill() -> None:
        engine.scheduler.flush_cache()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})

    seconds = timed(prefill, args.device, 3)
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt * prompt  # QK and PV, causal half
    flops = 2 * params * prompt + attention
    figures["prefill"] = {
        "tokens": prompt,
        "seconds": seconds,
        "share_of_compute": flops / seconds / (figures["matmul_tflops"] * 1e12),
    }
    engine.shutdown()
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
