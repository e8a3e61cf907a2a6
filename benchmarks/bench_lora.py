"""Multi-LoRA throughput: a batch of 32 requests whose adapters are 1, 4 or 16 distinct LoRA adapters, against the
same batch on the base model, on a server without LoRA and on the LoRA server itself (its base rows add nothing),
each with every step eager and with the decode step compiled at the batch's size (--cuda-graph-bs 32: under LoRA
the compiled step runs the dense delta over every slot, kiln.layers.lora).

The adapters are random rank-16 LoRAs on all seven projections of the default model (SmolLM2-135M), written in
PEFT's layout. Both engines run in this process, the workloads alternating repetition by repetition (A/B, order
swapped each repetition); each figure is the minimum over the repetitions of the batch's wall time, reported as
output tokens per second, with the host's CPU model beside it.

    .venv/bin/python benchmarks/bench_lora.py [--reps 3] [--threads 1] [--graphs both|off|on]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import kiln
from kiln.loader.default_model import default_model_path
from kiln.loader.model_config import read_model_spec

BATCH, RANK = 32, 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_adapter(out: Path, model_path: str, seed: int) -> str:
    """A random LoRA of the model in PEFT's layout (lora_B non-zero, as a trained adapter's is)."""
    spec, gen = read_model_spec(model_path), torch.Generator().manual_seed(seed)
    shapes, tensors = spec.projection_shapes(), {}
    for layer in range(spec.num_layers):
        for module in MODULES:
            kind = "self_attn" if module in MODULES[:4] else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{stem}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(MODULES)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def run(engine: kiln.Engine, prompts: list[list[int]], loras: list[str | None] | None, new: int) -> float:
    """Output tokens per second of one batch."""
    params = [{"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True} for _ in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    elapsed = time.perf_counter() - t0
    engine.parts.scheduler.flush_cache()  # every repetition computes its prompts
    return sum(len(o["output_ids"]) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--graphs", choices=["both", "off", "on"], default="both", help="compiled decode steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="kiln-lora-bench-"))
    paths = [f"a{i}={write_adapter(work / f'a{i}', model, i)}" for i in range(16)]
    common = dict(
        model_path=model, num_threads=args.threads, max_running_requests=BATCH, max_total_tokens=8192
    )
    modes = {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}[args.graphs]
    lora = dict(lora_paths=tuple(paths), max_loras_per_batch=16, max_lora_rank=RANK)
    engines = {}
    for mode in modes:
        graphs = dict(cuda_graph_bs=(BATCH,)) if mode == "compiled" else {}
        engines[f"no LoRA, {mode}"] = kiln.Engine(**common, **graphs)
        engines[f"LoRA server, {mode}"] = kiln.Engine(**common, **lora, **graphs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.input_len,), generator=gen).tolist() for _ in range(BATCH)]
    workloads = {}
    for mode in modes:
        workloads[f"base, server without LoRA, {mode}"] = (f"no LoRA, {mode}", None)
        workloads[f"base, LoRA server, {mode}"] = (f"LoRA server, {mode}", [None] * BATCH)
        workloads[f"1 adapter, {mode}"] = (f"LoRA server, {mode}", ["a0"] * BATCH)
        workloads[f"4 adapters, {mode}"] = (f"LoRA server, {mode}", [f"a{i % 4}" for i in range(BATCH)])
        workloads[f"16 adapters, {mode}"] = (f"LoRA server, {mode}", [f"a{i % 16}" for i in range(BATCH)])
    # the capture's verdict: a compiled shape that did not pay runs eagerly
    for name, engine in engines.items():
        graphs = engine.scheduler.runner.graphs
        for shape in graphs.summary()["decode"]["shapes"] if graphs is not None else ():
            print(f"{name}: decode bs={shape['size']} compiled {shape['graph_ms']:.1f} ms vs eager "
                  f"{shape['eager_ms']:.1f} ms at capture, kept={shape['kept']}")  # fmt: skip
    for engine, loras in workloads.values():  # warm-up: first-touch of the slots, allocator growth
        run(engines[engine], prompts[:4], loras[:4] if loras else None, 2)
    best: dict[str, float] = {}
    order = list(workloads)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            engine, loras = workloads[name]
            tps = run(engines[engine], prompts, loras, args.output_len)
            best[name] = max(best.get(name, 0.0), tps)
            print(f"rep {rep}: {name}: {tps:.1f} tok/s", flush=True)
    base = best[f"base, server without LoRA, {modes[0]}"]
    print(f"\n{cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), batch {BATCH} x ({args.input_len} in, "
          f"{args.output_len} out), rank {RANK} on all 7 projections, best of {args.reps}")  # fmt: skip
    print(f"| workload | output tok/s | vs base without LoRA, {modes[0]} |\n|---|---|---|")
    for name in order:
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f}x |")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
