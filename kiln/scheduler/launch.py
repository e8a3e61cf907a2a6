"""Build a ready scheduler from ServerArgs: model config -> ledger -> weights -> pools -> scheduler.
Shared by the in-process Engine and the engine process behind the HTTP server."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.config import ServerArgs
from kiln.loader.model_config import load_model_config
from kiln.memory.ledger import Ledger, LedgerInputs, compute_ledger
from kiln.models.config import ModelConfig, dtype_from_name
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.scheduler.scheduler import Scheduler
from kiln.text.tokenizer import load_tokenizer

logger = logging.getLogger("kiln")


class StartupRefused(RuntimeError):
    """The configuration does not fit; raised before anything large is allocated."""


@dataclass
class EngineParts:
    scheduler: Scheduler
    tokenizer: object
    model_config: ModelConfig
    ledger: Ledger
    args: ServerArgs
    device: str


def resolve_device(args: ServerArgs) -> str:
    from kiln.platform import detect_device

    return detect_device() if args.device == "auto" else args.device


def plan(args: ServerArgs, model_config: ModelConfig, device: str) -> Ledger:
    import kiln.platform as platform

    dev_mem = (
        platform.parse_size(args.device_memory) if args.device_memory else platform.total_memory_bytes(device)
    )
    avail = dev_mem if args.device_memory else platform.available_memory_bytes(device)
    host = platform.parse_size(args.host_memory) if args.host_memory else None
    dtype = str(model_config.resolve_dtype(args.dtype, device)).replace("torch.", "")
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    return compute_ledger(
        LedgerInputs(
            hf_config=model_config.config_dict,
            device=device,
            device_memory_bytes=dev_mem,
            available_memory_bytes=avail,
            tp_size=args.tp_size,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            mem_fraction_static=args.mem_fraction_static,
            max_total_tokens=args.max_total_tokens,
            context_length=args.context_length,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
            page_size=args.page_size,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            cuda_graph_bs=args.cuda_graph_bs,
            cuda_graph_max_bs_prefill=args.cuda_graph_max_bs_prefill,
            cuda_graph_bs_prefill=args.cuda_graph_bs_prefill,
            disable_cuda_graph=args.disable_cuda_graph,
            disable_prefill_graph=args.disable_prefill_graph,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_size_gb=args.hicache_size,
            hicache_ratio=args.hicache_ratio,
            host_memory_bytes=host,
            weight_prepack=not args.disable_weight_prepack,
        )
    )


def capture_graphs(runner: ModelRunner, ledger: Ledger, args: ServerArgs, on_progress) -> None:
    from kiln.runner.graph_runner import GraphRunner, default_compile_cache_dir

    graphs = GraphRunner(
        runner.model,
        runner.device,
        list(ledger.graph_batch_sizes),
        list(ledger.graph_prefill_tokens),
        kv_width=ledger.context_len,
        cache_dir=args.compile_cache_dir
        or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or default_compile_cache_dir(),
    )
    graphs.capture(on_progress)
    runner.graphs = graphs
    runner.measured["graph_capture"] = graphs.capture_bytes


def build_engine(args: ServerArgs, on_phase: Callable[[str, dict], None] | None = None) -> EngineParts:
    phase = on_phase or (lambda name, info: None)
    args = args.with_defaults()
    if args.tp_size > 1:
        raise StartupRefused(
            f"--tp-size {args.tp_size}: serving across several ranks is not available yet (the layers are "
            f"tensor-parallel, the multi-process launch is not); `kiln plan --tp-size {args.tp_size}` plans such a "
            f"deployment. Use --tp-size 1."
        )
    device = resolve_device(args)
    if device == "cpu":
        torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    model_config = load_model_config(args.model_path)
    ledger = plan(args, model_config, device)
    from kiln.memory.ledger_format import format_refusal, format_table

    logger.info("Memory ledger (per rank):\n" + format_table(ledger))
    if not ledger.fits:
        raise StartupRefused(format_refusal(ledger))
    logger.info(f"mem_fraction_static={ledger.mem_fraction_static:.3f} ({ledger.mem_fraction_reason})")
    phase("loading_weights", {})
    tokenizer = load_tokenizer(args.model_path, args.tokenizer_path, args.chat_template)
    dtype = model_config.resolve_dtype(args.dtype, device)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else dtype_from_name(args.kv_cache_dtype)
    runner = ModelRunner(model_config, dtype, kv_dtype, device)
    runner.load(
        max(ledger.context_len, model_config.max_position_embeddings) + 8,
        on_progress=lambda info: phase("progress", info),
        prepack=not args.disable_weight_prepack,
    )
    phase("allocating_kv", {})
    runner.init_memory_pool(
        PoolSizes(
            ledger.max_total_num_tokens, ledger.max_running_requests, ledger.context_len, args.page_size
        )
    )
    if device == "cpu" and not ledger.graph_batch_sizes and not args.disable_cuda_graph:
        logger.info(
            "Decode graphs are off on the CPU by default: each batch size is a ~40 s compile at the first start "
            "(~5 s from the cache after); the compiled steps measured 1.25x / 0.99x / 1.16x of eager "
            "decode at batch 1 / 8 / 32 (docs/benchmarks.md). --cuda-graph-max-bs 1 compiles batch 1, 8 up to 8."
        )
    if ledger.graph_batch_sizes or ledger.graph_prefill_tokens:
        phase("capturing", {})
        capture_graphs(runner, ledger, args, lambda info: phase("progress", info))
    chunk = ledger.chunked_prefill_size
    scheduler = Scheduler(
        runner,
        tokenizer,
        max_total_num_tokens=ledger.max_total_num_tokens,
        max_running_requests=ledger.max_running_requests,
        context_len=ledger.context_len,
        chunked_prefill_size=chunk,
        max_prefill_tokens=ledger.max_prefill_tokens,
        page_size=args.page_size,
        disable_radix_cache=args.disable_radix_cache,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        random_seed=args.random_seed,
        stream_interval=args.stream_interval,
        decode_log_interval=args.decode_log_interval,
    )
    logger.info(
        f"max_total_num_tokens={ledger.max_total_num_tokens}, chunked_prefill_size={chunk}, "
        f"max_prefill_tokens={ledger.max_prefill_tokens}, max_running_requests={ledger.max_running_requests}, "
        f"context_len={ledger.context_len}"
    )
    return EngineParts(scheduler, tokenizer, model_config, ledger, args, device)
