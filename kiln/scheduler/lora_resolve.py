"""The LoRA flags resolved once, for `kiln plan`, `kiln serve` and `kiln.Engine` alike: the refusals, the slots'
rank and projections from --lora-paths' adapter configs where the flags leave them out, and the steps that run
eagerly under LoRA (prefill always; decode on CUDA)."""

from __future__ import annotations

from dataclasses import replace

from kiln.config import ServerArgs, lora_modules, lora_path_pairs
from kiln.layers.lora import TARGET_MODULES
from kiln.loader.lora_adapter import AdapterError, read_adapter_config
from kiln.models.spec import ModelSpec


def lora_refusal(args: ServerArgs, model: ModelSpec) -> str | None:
    """What Kiln cannot serve LoRA adapters with."""
    if not args.enable_lora:
        return None
    if model.lora_problem:
        return f"--enable-lora: {model.lora_problem}"
    if args.speculative_algorithm:
        return f"--enable-lora with --speculative-algorithm {args.speculative_algorithm}: the draft has no adapters"
    if args.hicache_storage_backend:
        return (
            f"--enable-lora with --hicache-storage-backend {args.hicache_storage_backend}: stored KV outlives the "
            "server, and an adapter's prefixes are keyed by its load, not its weights; serve LoRA without it"
        )
    if args.is_embedding:
        return "--enable-lora: an embedding server runs the base model only"
    return None


def delta_method(args: ServerArgs, device: str) -> str:
    """The LoRA delta's method (kiln.layers.lora): Triton's kernels on CUDA, torch's (dense or grouped, by the
    batch) on the CPU, or what --lora-backend asks for."""
    if args.lora_backend == "triton" or (args.lora_backend == "auto" and device.startswith("cuda")):
        return "triton"
    return "torch"


def resolve_lora(args: ServerArgs, device: str = "cpu") -> ServerArgs:
    """args with --max-lora-rank and --lora-target-modules filled from the startup adapters' configs (all
    projections when neither says), and the steps that run eagerly: prefill graphs are off under LoRA (its pieces'
    token counts are where the dense delta costs most; eager prefill picks dense or grouped per batch). On the CPU
    the compiled decode steps stay as asked (--cuda-graph-max-bs): they run the dense delta from the slot buffers,
    whatever the batch's adapters (kiln.layers.lora). On CUDA, or with Triton's kernels, every step runs eagerly:
    the kernels read each row's slot from a buffer of fixed address, so a captured CUDA graph could replay them,
    but that has not been run on a GPU yet, so it is not turned on. Raises ValueError naming the flag or the
    adapter."""
    if not args.enable_lora:
        return args
    configs = []
    for name, path in lora_path_pairs(args.lora_paths):
        try:
            configs.append(read_adapter_config(name, path))
        except AdapterError as e:
            raise ValueError(f"--lora-paths: {e}") from None
    rank = args.max_lora_rank or max((c.rank for c in configs), default=0)
    if not rank:
        raise ValueError("--enable-lora without --lora-paths needs --max-lora-rank: the slots' rank")
    for c in configs:
        if c.rank > rank:
            raise ValueError(f"--lora-paths {c.path}: rank {c.rank} is above --max-lora-rank {rank}")
    modules = lora_modules(args.lora_target_modules)
    if not modules:
        named = {m for c in configs for m in c.target_modules}
        modules = tuple(m for m in TARGET_MODULES if m in named) if named <= set(TARGET_MODULES) else ()
        modules = modules or TARGET_MODULES  # "all-linear", a pattern, or no adapter yet: every projection
    eager_decode = device.startswith("cuda") or delta_method(args, device) == "triton"
    return replace(
        args,
        max_lora_rank=rank,
        lora_target_modules=modules,
        disable_cuda_graph=args.disable_cuda_graph or eager_decode,
        disable_prefill_graph=True,
    )
