"""Build a ready scheduler from ServerArgs: model config -> ledger -> weights -> pools -> graphs -> scheduler.
Shared by the in-process Engine and the engine process behind the HTTP server."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kiln.distributed as distributed
import kiln.memory.storage_tier as storage_tier
import kiln.platform as platform
from kiln.config import ServerArgs, lora_modules, lora_path_pairs
from kiln.core.dtypes import kv_torch_dtype, torch_dtype
from kiln.layers.cpu_gemm import set_cpu_gemm
from kiln.layers.kernel_builds import build_kernels, kernels_for
from kiln.loader.hub import download_weights
from kiln.loader.pooling_config import read_pooling_config
from kiln.memory.kv_pool import copyable
from kiln.memory.ledger_format import format_table
from kiln.memory.ledger_types import Ledger, storage_dir
from kiln.memory.storage_tier import FileStorageTier
from kiln.models.config import ModelConfig
from kiln.runner.lora import AdapterError, LoraSettings
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.scheduler.io import PoolSpec
from kiln.scheduler.lora_resolve import delta_method
from kiln.scheduler.resolve import Deployment, MemoryPlan, StartupRefused, resolve, target_platform
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.base import Drafter
from kiln.speculative.settings import SpecSettings
from kiln.text.tokenizer import load_tokenizer

logger = logging.getLogger("kiln")

OnPhase = Callable[[str, dict], None]


@dataclass
class EngineParts:
    scheduler: Scheduler
    tokenizer: object
    model_config: ModelConfig
    ledger: Ledger
    args: ServerArgs
    device: str
    pooling: PoolSpec | None = None  # an embedding server's (--is-embedding); None: a generation server


def embedding_pooling(args: ServerArgs) -> PoolSpec | None:
    """How an embedding server pools: the model's sentence-transformers config, else its last token, normalised
    (kiln.loader.pooling_config); None for a generation server."""
    if not args.is_embedding:
        return None
    config = read_pooling_config(args.model_path)
    logger.info(f"Embedding model: {config.mode} pooling, normalize={config.normalize} ({config.source})")
    return PoolSpec(config.mode, config.normalize)


def capture_graphs(
    runner: ModelRunner, ledger: Ledger, args: ServerArgs, on_progress, verify_tokens_per_req: int = 0
) -> None:
    """The target's shapes; under speculative decoding its verify shapes too (verify_tokens_per_req rows per
    request: num_draft_tokens)."""
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
        verify_tokens_per_req=verify_tokens_per_req,
        lora=runner.lora.batch if runner.lora is not None else None,
    )
    graphs.capture(on_progress)
    runner.graphs = graphs
    runner.measured["graph_capture"] = graphs.capture_bytes


def _checked_plan(deployment: Deployment) -> MemoryPlan:
    """The plan, logged; StartupRefused when it does not fit."""
    ledger = deployment.ledger
    logger.info("Memory ledger (per rank):\n" + format_table(ledger))
    deployment.check_fits()
    logger.info(f"mem_fraction_static={ledger.mem_fraction_static:.3f} ({ledger.mem_fraction_reason})")
    if ledger.running_clamp:  # said before anything is allocated or captured
        logger.warning(ledger.running_clamp)
    for warning in deployment.warnings:
        logger.warning(warning)
    return deployment.memory


def _load_runner(
    args: ServerArgs, plan: MemoryPlan, model_config: ModelConfig, phase: OnPhase
) -> ModelRunner:
    """Weights loaded in the planned dtype, then the KV pool and the request table at the planned sizes."""
    inputs, ledger = plan.inputs, plan.ledger
    set_cpu_gemm(args.cpu_gemm, args.quantization)  # this load's weights are packed for the --cpu-gemm kernel
    runner = ModelRunner(
        model_config,
        torch_dtype(inputs.dtype),
        kv_torch_dtype(inputs.kv_cache_dtype),
        inputs.device,
        args.attention_backend,
    )
    if args.attention_backend == "triton":
        # Triton before the load, which may import it (it picks its interpreter when first imported)
        import kiln.layers.triton_attention  # noqa: F401
    runner.load(
        max(ledger.context_len, model_config.max_position_embeddings) + 8,
        on_progress=lambda info: phase("progress", info),
        prepack=not args.disable_weight_prepack,
        dummy=args.load_format == "dummy",
        head=not args.is_embedding,  # an embedding checkpoint (Qwen3-Embedding's) may have no lm_head
    )
    if args.enable_lora:
        _init_lora(runner, args, ledger)
    phase("allocating_kv", {})
    sizes = PoolSizes(
        ledger.max_total_num_tokens,
        ledger.max_running_requests,
        ledger.context_len,
        args.page_size,
        ledger.state_slots,
    )
    runner.init_memory_pool(sizes)
    return runner


def _start_graphs(
    runner: ModelRunner, ledger: Ledger, args: ServerArgs, phase: OnPhase, spec: SpecDecoder | None
) -> None:
    if platform.attention_interpreted(runner.device, args.attention_backend) and not args.disable_cuda_graph:
        logger.info(
            "Steps run eagerly: Triton's interpreter (--attention-backend triton on the CPU) is not compiled."
        )
    elif args.is_embedding:
        logger.info("No decode graphs: an embedding server's requests end with their prefill.")
    elif runner.device == "cpu" and not ledger.graph_batch_sizes and not args.disable_cuda_graph:
        logger.info(
            "Decode graphs are off on the CPU by default: each batch size compiles at the first start (the "
            "compile cache makes later starts quick) and their payoff over eager decode depends on the batch "
            "(docs/benchmarks.md). --cuda-graph-max-bs 1 compiles batch 1, 8 up to 8."
        )
    if ledger.graph_batch_sizes or ledger.graph_prefill_tokens:
        phase("capturing", {})
        verify = spec.num_draft_tokens if spec is not None else 0
        capture_graphs(runner, ledger, args, lambda info: phase("progress", info), verify)


def _start_draft_graphs(spec: SpecDecoder, ledger: Ledger, args: ServerArgs, phase: OnPhase) -> None:
    """The draft's decode shapes, after the target's: a startup phase of its own with its progress; a draft
    model's catch-up extends on prefill pieces (draft_extend_tokens), a head's catch-ups as decode rows."""
    from kiln.core.graph_shapes import draft_extend_tokens
    from kiln.runner.compiler import compile_cache_dir
    from kiln.speculative.draft_model import capture_draft_graphs

    sizes, drafter = list(ledger.graph_batch_sizes), spec.drafter
    if sizes and getattr(drafter, "runner", None) is not None:
        phase("capture_draft", {})
        on_progress = lambda info: phase("progress", info)  # noqa: E731
        cache = compile_cache_dir(args.compile_cache_dir)
        extend = draft_extend_tokens(list(ledger.graph_prefill_tokens), sizes, spec.num_draft_tokens)
        capture_draft_graphs(drafter, sizes, ledger.context_len, cache, on_progress, extend)


def _drafter(
    settings: SpecSettings, runner: ModelRunner, tokenizer, ledger: Ledger, args: ServerArgs
) -> Drafter:
    """The drafter of --speculative-algorithm; a model drafter gets a KV pool and table of the target's sizes."""
    if settings.algorithm == "NGRAM":
        from kiln.speculative.ngram import NgramDrafter

        return NgramDrafter(max_breadth=settings.topk, max_nodes=settings.num_draft)
    path = args.speculative_draft_model_path
    sizes = PoolSizes(
        ledger.max_total_num_tokens, ledger.max_running_requests, ledger.context_len, args.page_size
    )
    steps = settings.draft_steps
    tree = {"topk": settings.topk, "num_nodes": settings.num_draft}
    if settings.algorithm == "STANDALONE" and path:
        from kiln.speculative.draft_model import build_standalone_drafter

        return build_standalone_drafter(path, runner, tokenizer, sizes, steps, **tree)
    if settings.algorithm in ("EAGLE", "EAGLE3") and path:
        from kiln.speculative.eagle import build_eagle_drafter

        return build_eagle_drafter(path, runner, sizes, steps, **tree)
    if settings.algorithm == "NEXTN":  # the model's own MTP layer: no draft path
        from kiln.speculative.nextn import build_nextn_drafter

        return build_nextn_drafter(runner, sizes, steps, **tree)
    raise StartupRefused(f"--speculative-algorithm {settings.algorithm} is not available in this build")


def _spec_decoder(
    settings: SpecSettings | None, runner: ModelRunner, tokenizer, ledger: Ledger, args: ServerArgs
) -> SpecDecoder | None:
    if settings is None:
        return None
    try:
        drafter = _drafter(settings, runner, tokenizer, ledger, args)
    except ValueError as e:  # a draft that does not fit the target (DraftRefused)
        raise StartupRefused(str(e)) from e
    logger.info(
        f"Speculative decoding: {settings.algorithm}, speculative_num_steps={settings.num_steps}, "
        f"speculative_eagle_topk={settings.topk}, speculative_num_draft_tokens={settings.num_draft_tokens}"
    )
    return SpecDecoder(drafter, settings.num_draft, settings.num_draft_tokens)


def _init_lora(runner: ModelRunner, args: ServerArgs, ledger: Ledger) -> None:
    """The adapter slots (the ledger's line) and the startup adapters, in host memory; a bad adapter refuses."""
    settings = LoraSettings(
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank or 0,
        target_modules=lora_modules(args.lora_target_modules),
        max_loaded_loras=args.max_loaded_loras,
        backend=delta_method(args, runner.device),
        paths=lora_path_pairs(args.lora_paths),
    )
    rows = max(ledger.chunked_prefill_size or 0, ledger.max_prefill_tokens, ledger.max_running_requests, 512)
    try:
        runner.init_lora(settings, rows)
    except AdapterError as e:
        raise StartupRefused(f"--enable-lora --lora-paths: {e}") from None


def _scheduler(
    runner: ModelRunner, tokenizer, ledger: Ledger, args: ServerArgs, spec: SpecDecoder | None = None
) -> Scheduler:
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
        spec=spec,
        mamba_track_interval=args.mamba_track_interval,
        overlap=overlap_schedule(args, runner.device),
    )


def overlap_schedule(args: ServerArgs, device: str) -> bool:
    """Decode steps overlapped with scheduling: on CUDA unless --disable-overlap-schedule, on the CPU with
    --enable-overlap-schedule."""
    return not args.disable_overlap_schedule and (device != "cpu" or args.enable_overlap_schedule)


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
    tensors = [copyable(t) for t in (*runner.kv_pool.k, *runner.kv_pool.v)]
    block = math.lcm(storage_tier.DEFAULT_BLOCK_TOKENS, args.page_size)
    root = storage_dir(args)
    assert root is not None  # the file backend has a directory, given or the default
    return FileStorageTier(root, storage_tier.model_fingerprint(identity), tensors, block)


def host_tier_tokens(ledger: Ledger) -> int:
    """Tokens the host tier holds: the ledger's per-rank bytes over the bytes of one token's KV."""
    if not ledger.has_line("host tier per rank") or not ledger.kv_bytes_per_token:
        return 0
    return ledger.line("host tier per rank").bytes // ledger.kv_bytes_per_token


def build_engine(args: ServerArgs, on_phase: OnPhase | None = None) -> EngineParts:
    phase = on_phase or (lambda name, info: None)
    if args.tp_size != distributed.tp_size():  # the layers shard by the group this process joined
        raise StartupRefused(
            f"--tp-size {args.tp_size} runs one process per rank (`kiln serve --tp-size {args.tp_size}`); this "
            f"process is one of {distributed.tp_size()}"
        )
    deployment = resolve(args, target_platform(args, serving=True), serving=True)
    args, model_config, spec_settings = deployment.args, deployment.model_config, deployment.spec
    plan = _checked_plan(deployment)
    ledger, device = plan.ledger, plan.inputs.device
    if device == "cpu":
        torch.set_num_threads(platform.cpu_threads(args.num_threads))
        build_kernels(kernels_for(args.cpu_gemm, args.quantization), phase)  # a first build takes minutes
    if args.hub_model_id:  # kiln.Engine by model id; under serve the front has downloaded them: found cached
        try:
            download_weights(args.hub_model_id, args.model_path, args.download_dir)
        except ValueError as e:
            raise StartupRefused(str(e)) from e
    phase("loading_weights", {})
    tokenizer = load_tokenizer(args.model_path, args.tokenizer_path, args.chat_template)
    runner = _load_runner(args, plan, model_config, phase)
    # the drafter first: an EAGLE head sets the target to keep hidden states, which its captured steps then do
    spec = _spec_decoder(spec_settings, runner, tokenizer, ledger, args)
    # a checkpoint's MTP layers, set aside at load for NEXTN (whose head has its own copy by now): without NEXTN
    # they would hold host memory the ledger does not count (DeepSeek-V3's: one MoE layer) for nothing
    getattr(runner.model, "mtp_weights", {}).clear()
    _start_graphs(runner, ledger, args, phase, spec)
    if spec is not None:
        _start_draft_graphs(spec, ledger, args, phase)
    scheduler = _scheduler(runner, tokenizer, ledger, args, spec)
    logger.info(
        f"max_total_num_tokens={ledger.max_total_num_tokens}, chunked_prefill_size={ledger.chunked_prefill_size}, "
        f"max_prefill_tokens={ledger.max_prefill_tokens}, max_running_requests={ledger.max_running_requests}, "
        f"context_len={ledger.context_len}"
    )
    return EngineParts(scheduler, tokenizer, model_config, ledger, args, device, embedding_pooling(args))
