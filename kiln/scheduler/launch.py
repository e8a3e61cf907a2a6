"""Build a ready scheduler from ServerArgs: model config -> ledger -> weights -> pools -> graphs -> scheduler.
Shared by the in-process Engine and the engine process behind the HTTP server."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import kiln.core.sharding as sharding
import kiln.distributed as distributed
import kiln.memory.storage_tier as storage_tier
from kiln.config import ServerArgs
from kiln.core.dtypes import torch_dtype
from kiln.layers.cpu_gemm import set_cpu_gemm
from kiln.loader.model_config import read_hf_config, resolve_model_path
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_format import format_refusal, format_table
from kiln.memory.ledger_types import Ledger, LedgerInputs
from kiln.memory.storage_tier import FileStorageTier
from kiln.models.config import ModelConfig
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.scheduler.scheduler import Scheduler
from kiln.text.tokenizer import load_tokenizer

logger = logging.getLogger("kiln")

OnPhase = Callable[[str, dict], None]


class StartupRefused(RuntimeError):
    """The configuration does not fit, or serve cannot run it yet; raised before anything large is allocated."""


@dataclass
class EngineParts:
    scheduler: Scheduler
    tokenizer: object
    model_config: ModelConfig
    ledger: Ledger
    args: ServerArgs
    device: str


@dataclass(frozen=True)
class MemoryPlan:
    """What serve decides before it loads anything: the ledger, and the inputs it was computed from (the device
    and the dtypes resolved, memory probed), which the load then follows."""

    inputs: LedgerInputs
    ledger: Ledger


def plan_ledger(args: ServerArgs, hf_config: dict | None = None) -> MemoryPlan:
    """Serve's memory plan for these arguments (`kiln plan` computes the same ledger). Raises ValueError."""
    config = hf_config if hf_config is not None else read_hf_config(args.model_path)
    inputs = _agreed(LedgerInputs.from_args(args, config))
    return MemoryPlan(inputs, compute_ledger(inputs))


def _agreed(inputs: LedgerInputs) -> LedgerInputs:
    """With several ranks, the memory every rank can hold (a MIN all-reduce of what each probed), so that every
    rank computes the same ledger and allocates the same pool before anything is allocated. The host RAM the
    hierarchical cache's node budget is checked against is agreed the same way: no rank allocates a host tier
    that another rank's view of the node would refuse."""
    host = inputs.host_memory_bytes
    total, available, agreed_host = distributed.min_across_ranks(
        [inputs.device_memory_bytes, inputs.available_memory_bytes, -1 if host is None else host]
    )
    return replace(
        inputs,
        device_memory_bytes=total,
        available_memory_bytes=available,
        host_memory_bytes=None if agreed_host < 0 else agreed_host,
    )


def tp_refusal(args: ServerArgs, hf_config: dict) -> str | None:
    """Why --tp-size cannot split this model (a dimension it does not divide), naming the sizes that can."""
    problems = sharding.tp_size_problems(hf_config, args.tp_size, args.ep_size)
    if not problems:
        return None
    sizes = ", ".join(str(tp) for tp in sharding.valid_tp_sizes(hf_config))
    flags = f"--tp-size {args.tp_size}" + (f" --ep-size {args.ep_size}" if args.ep_size > 1 else "")
    return f"{flags} does not divide this model's {', '.join(problems)}; tensor-parallel sizes that work: {sizes}"


def capture_graphs(runner: ModelRunner, ledger: Ledger, args: ServerArgs, on_progress) -> None:
    from kiln.runner.compiler import compile_cache_dir
    from kiln.runner.graph_runner import GraphRunner

    graphs = GraphRunner(
        runner.model,
        runner.device,
        list(ledger.graph_batch_sizes),
        list(ledger.graph_prefill_tokens),
        kv_width=ledger.context_len,
        cache_dir=compile_cache_dir(args.compile_cache_dir),
        attn_backend=runner.attn_backend,
    )
    graphs.capture(on_progress)
    runner.graphs = graphs
    runner.measured["graph_capture"] = graphs.capture_bytes


def _checked_plan(args: ServerArgs, hf_config: dict) -> MemoryPlan:
    """The plan, logged; StartupRefused when the arguments do not fit."""
    plan = plan_ledger(args, hf_config)
    ledger = plan.ledger
    logger.info("Memory ledger (per rank):\n" + format_table(ledger))
    if not ledger.fits:
        raise StartupRefused(format_refusal(ledger))
    logger.info(f"mem_fraction_static={ledger.mem_fraction_static:.3f} ({ledger.mem_fraction_reason})")
    return plan


def _load_runner(
    args: ServerArgs, plan: MemoryPlan, model_config: ModelConfig, phase: OnPhase
) -> ModelRunner:
    """Weights loaded in the planned dtype, then the KV pool and the request table at the planned sizes."""
    inputs, ledger = plan.inputs, plan.ledger
    set_cpu_gemm(args.cpu_gemm)  # this load's weights are packed for the --cpu-gemm kernel
    runner = ModelRunner(
        model_config, torch_dtype(inputs.dtype), torch_dtype(inputs.kv_cache_dtype), inputs.device
    )
    runner.load(
        max(ledger.context_len, model_config.max_position_embeddings) + 8,
        on_progress=lambda info: phase("progress", info),
        prepack=not args.disable_weight_prepack,
    )
    phase("allocating_kv", {})
    sizes = PoolSizes(
        ledger.max_total_num_tokens, ledger.max_running_requests, ledger.context_len, args.page_size
    )
    runner.init_memory_pool(sizes)
    return runner


def _start_graphs(runner: ModelRunner, ledger: Ledger, args: ServerArgs, phase: OnPhase) -> None:
    if runner.device == "cpu" and not ledger.graph_batch_sizes and not args.disable_cuda_graph:
        logger.info(
            "Decode graphs are off on the CPU by default: each batch size compiles at the first start (the "
            "compile cache makes later starts quick) and their payoff over eager decode depends on the batch "
            "(docs/benchmarks.md). --cuda-graph-max-bs 1 compiles batch 1, 8 up to 8."
        )
    if ledger.graph_batch_sizes or ledger.graph_prefill_tokens:
        phase("capturing", {})
        capture_graphs(runner, ledger, args, lambda info: phase("progress", info))


def _scheduler(runner: ModelRunner, tokenizer, ledger: Ledger, args: ServerArgs) -> Scheduler:
    return Scheduler(
        runner,
        tokenizer,
        max_total_num_tokens=ledger.max_total_num_tokens,
        max_running_requests=ledger.max_running_requests,
        context_len=ledger.context_len,
        chunked_prefill_size=ledger.chunked_prefill_size,
        max_prefill_tokens=ledger.max_prefill_tokens,
        page_size=args.page_size,
        disable_radix_cache=args.disable_radix_cache,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        random_seed=args.random_seed,
        stream_interval=args.stream_interval,
        decode_log_interval=args.decode_log_interval,
        grammar_backend=args.grammar_backend,
        host_tier_tokens=host_tier_tokens(ledger),
        hicache_write_policy=args.hicache_write_policy,
        kv_storage=kv_storage(args, runner),
    )


def kv_storage(args: ServerArgs, runner: ModelRunner) -> FileStorageTier | None:
    """The file storage tier, its files named for this model, dtype, rank and pool layout."""
    if args.hicache_storage_backend != "file":
        return None
    identity = {
        "model": storage_tier.checkpoint_identity(args.model_path),
        "dtype": str(runner.dtype),
        "kv_dtype": str(runner.kv_dtype),
        "tp": [distributed.tp_rank(), distributed.tp_size()],
        "page_size": args.page_size,
    }
    tensors = [*runner.kv_pool.k, *runner.kv_pool.v]
    block = math.lcm(storage_tier.DEFAULT_BLOCK_TOKENS, args.page_size)
    root = args.hicache_storage_dir or storage_tier.default_storage_dir()
    return FileStorageTier(root, storage_tier.model_fingerprint(identity), tensors, block)


def host_tier_tokens(ledger: Ledger) -> int:
    """Tokens the host tier holds: the ledger's per-rank bytes over the bytes of one token's KV."""
    if not ledger.has_line("host tier per rank") or not ledger.kv_bytes_per_token:
        return 0
    return ledger.line("host tier per rank").bytes // ledger.kv_bytes_per_token


def build_engine(args: ServerArgs, on_phase: OnPhase | None = None) -> EngineParts:
    phase = on_phase or (lambda name, info: None)
    args = args.with_defaults()
    refusal = args.serve_refusal()
    if refusal:
        raise StartupRefused(refusal)
    if args.tp_size != distributed.tp_size():  # the layers shard by the group this process joined
        raise StartupRefused(
            f"--tp-size {args.tp_size} runs one process per rank (`kiln serve --tp-size {args.tp_size}`); this "
            f"process is one of {distributed.tp_size()}"
        )
    hf_config = read_hf_config(args.model_path)
    refusal = tp_refusal(args, hf_config)
    if refusal:
        raise StartupRefused(refusal)
    plan = _checked_plan(args, hf_config)
    ledger, device = plan.ledger, plan.inputs.device
    if device == "cpu":
        torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    model_config = ModelConfig.from_hf_dict(resolve_model_path(args.model_path), hf_config)
    phase("loading_weights", {})
    tokenizer = load_tokenizer(args.model_path, args.tokenizer_path, args.chat_template)
    runner = _load_runner(args, plan, model_config, phase)
    _start_graphs(runner, ledger, args, phase)
    scheduler = _scheduler(runner, tokenizer, ledger, args)
    logger.info(
        f"max_total_num_tokens={ledger.max_total_num_tokens}, chunked_prefill_size={ledger.chunked_prefill_size}, "
        f"max_prefill_tokens={ledger.max_prefill_tokens}, max_running_requests={ledger.max_running_requests}, "
        f"context_len={ledger.context_len}"
    )
    return EngineParts(scheduler, tokenizer, model_config, ledger, args, device)
