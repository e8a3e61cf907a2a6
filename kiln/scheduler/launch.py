"""Build a ready scheduler from ServerArgs: model config -> ledger -> weights -> pools -> graphs -> scheduler.
Shared by the in-process Engine and the engine process behind the HTTP server."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import kiln.core.sharding as sharding
import kiln.distributed as distributed
import kiln.memory.storage_tier as storage_tier
import kiln.platform as platform
from kiln.config import ServerArgs
from kiln.core.dtypes import kv_cache_dtype_name, kv_torch_dtype, torch_dtype
from kiln.core.layer_kinds import has_linear_attention
from kiln.layers.cpu_gemm import set_cpu_gemm
from kiln.layers.fp8_linear import FIX as FP8_FIX
from kiln.layers.kernel_builds import build_kernels, kernels_for
from kiln.loader.model_config import read_hf_config, resolve_model_path
from kiln.memory.kv_pool import copyable
from kiln.memory.ledger import compute_ledger
from kiln.memory.ledger_format import format_refusal, format_table
from kiln.memory.ledger_types import Ledger, LedgerInputs, storage_dir
from kiln.memory.model_shapes import context_len_of, context_overrun, fp8_weight_block
from kiln.memory.storage_tier import FileStorageTier
from kiln.models.config import ModelConfig
from kiln.models.registry import check_model_config
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.spec_step import SpecDecoder
from kiln.speculative.base import Drafter
from kiln.speculative.checks import draft_refusal
from kiln.speculative.settings import SpecSettings, with_speculation
from kiln.speculative.settings import resolve as resolve_speculative
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
    inputs = _agreed(with_speculation(LedgerInputs.from_args(args, config), args))
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


def model_refusal(args: ServerArgs, hf_config: dict) -> str | None:
    """What `kiln serve` (and so `kiln plan`) refuses to run this model with, before any memory arithmetic: its
    architecture or a config field the model would refuse when built, a --tp-size, a flag a hybrid cannot take,
    a speculative setup the configs show it cannot run."""
    try:
        model_config = ModelConfig.from_hf_dict(resolve_model_path(args.model_path), hf_config)
        check_model_config(model_config, args.context_length or context_len_of(hf_config))
    except ValueError as e:
        return str(e)
    return tp_refusal(args, hf_config) or hybrid_refusal(args, hf_config) or draft_refusal(args, hf_config)


def storage_refusal(args: ServerArgs, keep: bool) -> str | None:
    """Why the file storage tier cannot keep files where --hicache-storage-dir says, found by making the directory
    and writing a file in it before any weight loads (`keep`: serve keeps the directory; plan removes it)."""
    root = storage_dir(args)
    return None if root is None else storage_tier.storage_dir_problem(root, keep)


def tp_refusal(args: ServerArgs, hf_config: dict) -> str | None:
    """Why --tp-size cannot split this model (a dimension it does not divide, or an FP8 weight block it cuts
    where FP8 weights are kept), naming the sizes that can."""
    if (args.tp_size > 1 or args.ep_size > 1) and has_linear_attention(hf_config):
        return (
            f"--tp-size {args.tp_size} --ep-size {args.ep_size}: Kiln runs a hybrid linear-attention model on one "
            "rank (its conv and recurrent states are not sharded); serve it with --tp-size 1"
        )
    device = platform.detect_device() if args.device == "auto" else args.device
    block = fp8_weight_block(hf_config) if platform.fp8_weights_kept(device, args.load_format) else None
    problems = sharding.tp_size_problems(hf_config, args.tp_size, args.ep_size, block)
    if not problems:
        return None
    sizes = ", ".join(str(tp) for tp in sharding.valid_tp_sizes(hf_config, fp8_block=block))
    flags = f"--tp-size {args.tp_size}" + (f" --ep-size {args.ep_size}" if args.ep_size > 1 else "")
    fp8 = f"; {FP8_FIX}" if block else ""
    return (
        f"{flags} does not divide this model's {', '.join(problems)}; tensor-parallel sizes that work: {sizes}"
        + fp8
    )


def hybrid_refusal(args: ServerArgs, hf_config: dict) -> str | None:
    """What a hybrid linear-attention model cannot be served with yet: its per-request states are not in the host
    tier, and a verify step would advance them past rejected draft tokens."""
    if not has_linear_attention(hf_config):
        return None
    if args.enable_hierarchical_cache:
        return (
            "--enable-hierarchical-cache keeps KV only: a hybrid linear-attention model's prefix cache also needs "
            "its state checkpoints, which the host tier does not hold; serve it without the host tier"
        )
    if args.speculative_algorithm:
        return (
            f"--speculative-algorithm {args.speculative_algorithm}: a hybrid linear-attention model's state would "
            "advance past rejected draft tokens (no per-draft-token states yet); serve it without speculation"
        )
    interval, page = args.mamba_track_interval, args.page_size
    if interval % page:  # checkpoints sit where the radix tree can split: at page ends
        return f"--mamba-track-interval {interval} must be a multiple of --page-size {page}"
    return None


def attention_refusal(
    args: ServerArgs, model_config: ModelConfig, kv_cache_dtype: str, capability: tuple[int, int] | None
) -> str | None:
    """A KV pool --attention-backend triton cannot read on this GPU (compute `capability`, None on the CPU):
    Triton converts fp8 e4m3 only from compute capability 8.9 on. Latent attention (MLA) runs no Triton kernel."""
    if args.attention_backend != "triton" or model_config.mla is not None or capability is None:
        return None
    if kv_cache_dtype != "fp8_e4m3" or capability >= (8, 9):
        return None
    major, minor = capability
    return (
        f"--attention-backend triton reads a --kv-cache-dtype fp8_e4m3 pool on compute capability 8.9 or newer "
        f"(Ada, Hopper, Blackwell), and this GPU's is {major}.{minor}: use --kv-cache-dtype fp8_e5m2 (the same "
        "bytes per token) or --attention-backend torch_native"
    )


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
    if ledger.running_clamp:  # said before anything is allocated or captured
        logger.warning(ledger.running_clamp)
    return plan


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
    )
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
    args = args.with_defaults()
    refusal = args.serve_refusal()
    if refusal:
        raise StartupRefused(refusal)
    if args.tp_size != distributed.tp_size():  # the layers shard by the group this process joined
        raise StartupRefused(
            f"--tp-size {args.tp_size} runs one process per rank (`kiln serve --tp-size {args.tp_size}`); this "
            f"process is one of {distributed.tp_size()}"
        )
    if args.model_path.endswith(
        ".json"
    ):  # resolve_model_path takes one for planning: its weights are elsewhere
        raise StartupRefused(
            f"--model-path {args.model_path} is a config.json, which `kiln plan` plans from; `kiln serve` loads "
            "weights: give the model's directory"
        )
    hf_config = read_hf_config(args.model_path)
    refusal = model_refusal(args, hf_config) or storage_refusal(args, keep=True)
    if refusal:
        raise StartupRefused(refusal)
    plan = _checked_plan(args, hf_config)
    ledger, device = plan.ledger, plan.inputs.device
    overrun = context_overrun(hf_config, args.context_length)  # past the ledger: allowed by SGLang's switch
    if overrun:
        logger.warning(overrun)
    if device == "cpu":
        torch.set_num_threads(platform.cpu_threads(args.num_threads))
    model_config = ModelConfig.from_hf_dict(resolve_model_path(args.model_path), hf_config)
    try:
        spec_settings = resolve_speculative(args, model_config.architecture)
    except ValueError as e:
        raise StartupRefused(str(e)) from e
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    kv_dtype = kv_cache_dtype_name(plan.inputs.kv_cache_dtype, plan.inputs.dtype)
    refusal = attention_refusal(args, model_config, kv_dtype, capability)
    if refusal:
        raise StartupRefused(refusal)
    if device == "cpu":  # its own phase: a first build compiles for a minute or more
        build_kernels(kernels_for(args.cpu_gemm, args.quantization), phase)
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
    return EngineParts(scheduler, tokenizer, model_config, ledger, args, device)
