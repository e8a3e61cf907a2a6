"""The memory ledger's types: what it is asked (LedgerInputs) and what it answers (Ledger: lines, sizes, verdict).
Plain data, imported by every part of the ledger's arithmetic and by its readers; LedgerInputs.from_args is the one
way from serve's flags to the inputs, for `kiln serve` and `kiln plan` alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import kiln.platform as platform
from kiln.core import envs
from kiln.core.dtypes import kv_cache_dtype_name
from kiln.models.spec import ModelSpec

if TYPE_CHECKING:
    from kiln.config import ServerArgs

MOMENTS = ("load_weights", "kv_allocation", "host_memory", "graph_capture", "first_full_prefill")


@dataclass(frozen=True, kw_only=True)
class LedgerInputs:
    model: ModelSpec
    device: str = "cpu"
    device_memory_bytes: int
    available_memory_bytes: int  # free before loading, per rank
    tp_size: int = 1
    dtype: str = "float32"  # resolved weight/activation dtype name
    kv_cache_dtype: str | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    allow_longer_context: bool = False  # SGLang's switch: a --context-length past the model's longest context
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    page_size: int = 1
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs_prefill: int | None = None
    cuda_graph_bs_prefill: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    disable_prefill_graph: bool = False
    # an embedding server (--is-embedding): prefills only, so no decode graph is captured and no request decodes
    is_embedding: bool = False
    enable_hierarchical_cache: bool = False
    hicache_size_gb: float = 0.0
    hicache_ratio: float = 2.0
    host_memory_bytes: int | None = None  # node RAM available (defaults to probed)
    hicache_storage_dir: str | None = None  # the file storage tier's directory; None: no storage tier
    draft: ModelSpec | None = None  # speculative decoding's draft model or head
    fp8_weights_kept: bool = False  # an FP8 checkpoint's weights held in FP8 (kiln.platform.fp8_weights_kept)
    # decode graphs gather one layer's K and V to the graphs' width (torch SDPA); the Triton backend reads the pool
    attention_gathers: bool = True
    # kiln.platform.fused_step_kernels: no float32 copies in a norm's activations, fewer kernels a graph
    fused_step_kernels: bool = False
    # speculative decoding's graph shapes (kiln.speculative.settings.with_speculation fills them from the resolved
    # settings): verify rows per request (num_draft_tokens), and the draft's decode rows per request (its topk;
    # 0 without a draft model of its own)
    verify_tokens_per_req: int = 0
    draft_rows_per_req: int = 0
    draft_extend_layers: int = 0  # a draft model's layers, whose catch-up extends run on prefill pieces
    # a head's catch-up rows per request (num_steps + 1), captured as decode rows at each size
    draft_catch_up_tokens_per_req: int = 0
    # a head's (EAGLE, EAGLE-3, NEXTN) guess slots per request, above the target's slots its pool mirrors
    draft_guess_tokens_per_req: int = 0
    # NEXTN: the target's own MTP layer drafts, with KV of one target layer per token (no draft config to read)
    draft_head_kv_layers: int = 0
    disable_radix_cache: bool = False  # hybrid models: no checkpoint slots for the prefix cache
    mamba_full_memory_ratio: float | None = None  # hybrid models: SGLang's state : KV split of the pool
    max_mamba_cache_size: int | None = None  # hybrid models: state slots given
    mamba_track_interval: int = 256  # hybrid models: tokens between the prefix cache's state checkpoints
    swa_full_tokens_ratio: float = 0.8  # hybrid sliding-window models: SGLang's windowed : full pool tokens
    weight_prepack: bool = True  # CPU float32: linear weights in a packed layout (a tied lm head gets a copy)
    # CPU float32 with prepacking: the GGUF types whose matrices stay in their blocks under --cpu-gemm (Kiln's
    # kernels, AVX2); from_args asks the platform, plain data does not probe the CPU
    gguf_block_types: tuple[str, ...] = ()
    integer_kernels: bool = False  # --cpu-gemm auto / kiln: kept blocks multiplied in integers (else float32)
    # CPU float32 with prepacking, --quantization int8: linear weights held as int8 with a float32 scale per row
    int8_linears: bool = False
    # multi-LoRA serving: adapter slots, their rank and the projections they cover (kiln.memory.ledger_lora)
    lora_slots: int = 0
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ()

    @classmethod
    def from_args(
        cls, args: ServerArgs, model: ModelSpec, target: platform.Platform | None = None
    ) -> LedgerInputs:
        """What `kiln serve` and `kiln plan` ask the ledger for these flags and this model on `target`
        (default: this machine's device for --device): the device and dtypes resolved, memory probed unless
        given or described. Raises ValueError for what cannot be planned."""
        target = target or platform.planned_platform(args.device, args.device_name, args.capability)
        device = target.device
        total, available = _device_memory(args, target)
        dtype = model.serving_dtype(device, args.dtype)
        # only the CPU kernel keeps GGUF blocks; --cpu-gemm does not concern a CUDA plan
        blocks = platform.gguf_block_types(args.cpu_gemm) if device == "cpu" else ()
        return cls(
            model=model,
            device=device,
            device_memory_bytes=total,
            available_memory_bytes=available,
            tp_size=args.tp_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype_name(args.kv_cache_dtype, dtype),
            mem_fraction_static=args.mem_fraction_static,
            max_total_tokens=args.max_total_tokens,
            context_length=args.context_length,
            allow_longer_context=envs.allow_longer_context_len(),
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
            page_size=args.page_size,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            cuda_graph_bs=args.cuda_graph_bs,
            cuda_graph_max_bs_prefill=args.cuda_graph_max_bs_prefill,
            cuda_graph_bs_prefill=args.cuda_graph_bs_prefill,
            disable_cuda_graph=args.disable_cuda_graph
            or platform.attention_interpreted(device, args.attention_backend),
            disable_prefill_graph=args.disable_prefill_graph,
            is_embedding=args.is_embedding,
            # an MLA model's latent attention gathers its rows whatever --attention-backend says
            attention_gathers=args.attention_backend != "triton" or model.is_mla,
            fused_step_kernels=platform.fused_step_kernels(device, dtype),
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_size_gb=args.hicache_size,
            hicache_ratio=args.hicache_ratio,
            host_memory_bytes=_host_memory(args),
            hicache_storage_dir=storage_dir(args),
            weight_prepack=not args.disable_weight_prepack,
            disable_radix_cache=args.disable_radix_cache,
            mamba_full_memory_ratio=args.mamba_full_memory_ratio,
            max_mamba_cache_size=args.max_mamba_cache_size,
            mamba_track_interval=args.mamba_track_interval,
            swa_full_tokens_ratio=args.swa_full_tokens_ratio,
            gguf_block_types=blocks,
            fp8_weights_kept=platform.fp8_weights_kept(target, args.load_format),
            integer_kernels=bool(blocks) and platform.integer_compute(args.cpu_gemm),
            int8_linears=_int8_linears(args, device),
            draft=_draft_spec(args),
            **_lora_inputs(args),
        )


def _lora_inputs(args: ServerArgs) -> dict:
    """The slot pool's size, once resolve has filled --max-lora-rank and --lora-target-modules."""
    if not args.enable_lora:
        return {}
    from kiln.config import lora_modules

    return dict(
        lora_slots=args.max_loras_per_batch,
        lora_rank=args.max_lora_rank or 0,
        lora_modules=lora_modules(args.lora_target_modules),
    )


def _int8_linears(args: ServerArgs, device: str) -> bool:
    return device == "cpu" and args.quantization == "int8" and platform.int8_kernels(args.cpu_gemm)


def _device_memory(args: ServerArgs, target: platform.Platform) -> tuple[int, int]:
    """(total, available) bytes per rank. A given --device-memory, or a GPU described by --device-name, plans for
    an empty device; CPU ranks share one machine's RAM."""
    device = target.device
    if args.device_memory:
        total = available = platform.parse_size(args.device_memory)
    elif target.memory_bytes is not None:
        total = available = target.memory_bytes
    elif not target.here:
        raise ValueError(
            "--device cuda on a machine without CUDA: give --device-name (e.g. H100) or --device-memory (e.g. 80GiB)"
        )
    else:
        total, available = platform.total_memory_bytes(device), platform.available_memory_bytes(device)
    if device == "cpu" and args.tp_size > 1:
        total, available = total // args.tp_size, available // args.tp_size
    return total, available


def _draft_spec(args: ServerArgs) -> ModelSpec | None:
    """The speculative draft model or head, whose weights and KV the ledger counts (NGRAM and
    NEXTN have none of their own)."""
    algorithm = getattr(args, "speculative_algorithm", None)
    path = getattr(args, "speculative_draft_model_path", None)
    if algorithm not in ("STANDALONE", "EAGLE", "EAGLE3") or not path:
        return None
    from kiln.loader.model_config import DRAFT_MODEL_FLAG, read_model_spec

    return read_model_spec(path, flag=DRAFT_MODEL_FLAG)


def storage_dir(args: ServerArgs) -> str | None:
    """The file storage tier's directory; None without one."""
    if args.hicache_storage_backend != "file":
        return None
    from kiln.memory.storage_tier import default_storage_dir

    return args.hicache_storage_dir or default_storage_dir()


def _host_memory(args: ServerArgs) -> int | None:
    """Node RAM the host tier may use: given, probed when the tier is on, else not needed."""
    if args.host_memory:
        return platform.parse_size(args.host_memory)
    return platform.host_available_bytes() if args.enable_hierarchical_cache else None


@dataclass(frozen=True)
class LedgerLine:
    name: str
    bytes: int
    inputs: str  # the arithmetic behind the number


@dataclass(frozen=True)
class Failure:
    moment: str  # one of MOMENTS
    message: str
    fix: str
    fix_flags: dict = field(default_factory=dict)  # the primary fix as serve flags, e.g. {"--tp-size": "2"}


@dataclass(frozen=True)
class Ledger:
    lines: tuple[LedgerLine, ...]
    kv_bytes_per_token: int
    weight_bytes: int
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    mem_fraction_static: float
    mem_fraction_reason: str
    graph_reserve_bytes: int
    graph_batch_sizes: tuple[int, ...]
    graph_prefill_tokens: tuple[int, ...]
    prefill_activation_bytes: int
    logits_bytes: int
    headroom_bytes: int
    fits: bool
    failure: Failure | None
    device: str = "cpu"
    tp_size: int = 1
    # hybrid linear-attention models: the state pool's slots (running requests' working slots, then the prefix
    # cache's checkpoints), the bytes of one, and the line saying why --max-running-requests was lowered
    state_slots: int = 0
    state_slot_bytes: int = 0
    running_clamp: str = ""

    @property
    def checkpoint_slots(self) -> int:
        return max(0, self.state_slots - self.max_running_requests)

    def line(self, name: str) -> LedgerLine:
        return next(x for x in self.lines if x.name == name)

    def has_line(self, name: str) -> bool:
        return any(x.name == name for x in self.lines)

    def to_dict(self) -> dict:
        return asdict(self)
