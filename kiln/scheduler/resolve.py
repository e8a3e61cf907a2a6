"""One resolve path: the flags and the platform in, a Deployment (every derived setting, the memory plan) or a
refusal out. `kiln plan`, `kiln serve`'s front process, `kiln.Engine` and each engine rank call `resolve` and
nothing else decides whether a configuration runs, so a plan is serve's dry run: both refuse the same
configurations with the same words.

The platform is an input: serve takes this machine's (`target_platform(args, serving=True)`, which refuses a GPU
described by --device-name or --compute-capability that is not the one here), while plan may describe a GPU it
does not run on (--device-name H200, --compute-capability 8.0) and says what it had to assume for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import kiln.distributed as distributed
import kiln.memory.storage_tier as storage_tier
from kiln import platform
from kiln.config import ServerArgs
from kiln.core import envs
from kiln.core.devices import device_spec, same_device
from kiln.core.dtypes import kv_cache_dtype_name
from kiln.layers.fp8_linear import FIX as FP8_FIX
from kiln.loader.model_config import load_model_config, read_model_spec
from kiln.loader.pooling_config import has_pooling_config, read_pooling_config
from kiln.memory.ledger import compute_ledger, context_length_refusal
from kiln.memory.ledger_format import format_refusal
from kiln.memory.ledger_types import Ledger, LedgerInputs, storage_dir
from kiln.models.config import ModelConfig
from kiln.models.registry import check_model_config
from kiln.models.spec import ModelSpec
from kiln.platform import Platform
from kiln.scheduler.lora_resolve import lora_refusal, resolve_lora
from kiln.speculative.checks import draft_refusal
from kiln.speculative.settings import SpecSettings, with_speculation
from kiln.speculative.settings import resolve as resolve_speculative


class StartupRefused(ValueError):
    """The configuration does not fit, or serve cannot run it; raised before anything large is allocated."""


@dataclass(frozen=True)
class MemoryPlan:
    """What serve decides before it loads anything: the ledger, and the inputs it was computed from (the device
    and the dtypes resolved, memory probed), which the load then follows."""

    inputs: LedgerInputs
    ledger: Ledger


@dataclass(frozen=True)
class Deployment:
    """A configuration resolved: the arguments (defaults filled), the platform, the model's config, the memory
    plan, the speculative settings, and the warnings to say once (a context past the model's, allowed)."""

    args: ServerArgs
    platform: Platform
    model_config: ModelConfig
    memory: MemoryPlan
    spec: SpecSettings | None
    warnings: tuple[str, ...] = ()

    @property
    def ledger(self) -> Ledger:
        return self.memory.ledger

    def check_fits(self) -> None:
        """StartupRefused when the ledger does not fit (plan prints the same ledger and exits 1)."""
        if not self.ledger.fits:
            raise StartupRefused(format_refusal(self.ledger))


def target_platform(args: ServerArgs, serving: bool) -> Platform:
    """The platform these arguments target. Serving, it is this machine's device, and --device cuda without a
    GPU, or a --device-name/--compute-capability other than this GPU's, is refused (they describe a machine for
    `kiln plan`). Planning, a GPU named or assumed is described from Kiln's table, with what was assumed."""
    if not serving:
        return platform.planned_platform(args.device, args.device_name, args.capability)
    here = platform.machine_platform(args.device if args.device_name is None else "cuda")
    _check_here(args, here)
    return here


def _check_here(args: ServerArgs, here: Platform) -> None:
    if not here.here:
        raise StartupRefused(
            "--device cuda: this machine has no usable CUDA GPU (torch.cuda.is_available() is False); "
            "`kiln plan --device cuda` plans for one, `kiln serve` runs on the device it finds"
        )
    if args.device_name is not None and not same_device(args.device_name, here.name):
        device_spec(args.device_name)  # an unknown name is said as such
        raise StartupRefused(
            f"--device-name {args.device_name} describes another GPU than this machine's ({here.name}): it is "
            "for `kiln plan` on another machine; drop it to serve here"
        )
    if args.capability is not None and args.capability != here.capability:
        found = "none (the CPU)" if here.capability is None else "{}.{}".format(*here.capability)
        raise StartupRefused(
            f"--compute-capability {args.compute_capability} is not this machine's ({found}): it is for "
            "`kiln plan` on another machine; drop it to serve here"
        )


@dataclass(frozen=True)
class Checked:
    """A configuration whose flags and model config Kiln runs (before any memory is probed)."""

    args: ServerArgs
    model_config: ModelConfig
    spec: SpecSettings | None

    @property
    def model(self) -> ModelSpec:
        return self.model_config.spec


def check(args: ServerArgs, target: Platform, serving: bool = False) -> Checked:
    """Every refusal the flags and the model's config decide, without probing memory (serve's front process
    asks this much before it starts an engine, and touches no device): the model's config, the model and its
    sharding, the context length, the storage directory (made and kept when `serving`), speculative decoding,
    attention kernels. Serving, a config.json in place of the model is refused: serve loads weights, plan plans
    from a config alone. Raises StartupRefused naming the flag and the fix."""
    args = args.with_defaults()
    if serving and args.model_path.endswith(".json"):
        raise StartupRefused(
            f"--model-path {args.model_path} is a config.json, which `kiln plan` plans from; `kiln serve` loads "
            "weights: give the model's directory"
        )
    try:  # the config, the architecture, or a config field the model would refuse when built
        model_config = load_model_config(args.model_path)
        model = model_config.spec
        check_model_config(model_config)
        args = embedding_args(args)
    except (ValueError, KeyError, OSError) as e:
        raise StartupRefused(str(e)) from e
    refusal = (
        embedding_refusal(args)
        or tp_refusal(args, model, target)
        or hybrid_refusal(args, model)
        or draft_refusal(args, model)
        or context_length_refusal(model, args.context_length, envs.allow_longer_context_len())
        or storage_refusal(args, keep=serving)
        or triton_refusal(args, target)
        or lora_refusal(args, model)
    )
    if refusal:
        raise StartupRefused(refusal)
    try:
        args = resolve_lora(args, target.device).with_torch_compile(target.device)
        spec = resolve_speculative(args, model_config.architecture)
        dtype = model.serving_dtype(target.device, args.dtype)
    except ValueError as e:
        raise StartupRefused(str(e)) from e
    kv_dtype = kv_cache_dtype_name(args.kv_cache_dtype, dtype)
    refusal = attention_refusal(args, model_config, kv_dtype, target.capability)
    if refusal:
        raise StartupRefused(refusal)
    return Checked(args, model_config, spec)


def resolve(args: ServerArgs, target: Platform, serving: bool = False) -> Deployment:
    """`check`, then the memory plan on `target`: every derived setting of these arguments, or StartupRefused.
    The plan not fitting is not raised here (Deployment.check_fits): `kiln plan` prints that ledger."""
    checked = check(args, target, serving)
    try:
        memory = plan_ledger(checked.args, checked.model, target)
    except ValueError as e:
        raise StartupRefused(str(e)) from e
    overrun = checked.model.context_overrun(checked.args.context_length)  # allowed by SGLang's switch
    warnings = (overrun,) if overrun else ()
    return Deployment(checked.args, target, checked.model_config, memory, checked.spec, warnings)


def embedding_args(args: ServerArgs) -> ServerArgs:
    """--is-embedding, also on by itself for a model laid out for sentence-transformers pooling (Qwen3-Embedding's
    modules.json and 1_Pooling/config.json); its pooling read here, so a layout Kiln cannot pool is refused now."""
    embedding = args.is_embedding or has_pooling_config(args.model_path)
    if embedding:
        read_pooling_config(args.model_path)  # ValueError naming the file
    return replace(args, is_embedding=True) if embedding and not args.is_embedding else args


def embedding_refusal(args: ServerArgs) -> str | None:
    """An embedding server generates nothing: a draft for speculative decoding would have nothing to draft."""
    if args.is_embedding and args.speculative_algorithm:
        return (
            f"--speculative-algorithm {args.speculative_algorithm} speeds up generation, and this is an embedding "
            "server (--is-embedding, or the model's sentence-transformers pooling config): drop one of them"
        )
    return None


def plan_ledger(
    args: ServerArgs, model: ModelSpec | None = None, target: Platform | None = None
) -> MemoryPlan:
    """The memory plan for these arguments on `target` (default: this machine). Raises ValueError."""
    model = model if model is not None else read_model_spec(args.model_path)
    inputs = LedgerInputs.from_args(args, model, target)
    inputs = _agreed(with_speculation(inputs, args))
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


def storage_refusal(args: ServerArgs, keep: bool) -> str | None:
    """Why the file storage tier cannot keep files where --hicache-storage-dir says, found by making the directory
    and writing a file in it before any weight loads (`keep`: serve keeps the directory; plan removes it)."""
    root = storage_dir(args)
    return None if root is None else storage_tier.storage_dir_problem(root, keep)


def tp_refusal(args: ServerArgs, model: ModelSpec, target: Platform) -> str | None:
    """Why --tp-size cannot split this model (a dimension it does not divide, or an FP8 weight block it cuts
    where FP8 weights are kept), naming the sizes that can."""
    if (args.tp_size > 1 or args.ep_size > 1) and model.has_linear_attention:
        return (
            f"--tp-size {args.tp_size} --ep-size {args.ep_size}: Kiln runs a hybrid linear-attention model on one "
            "rank (its conv and recurrent states are not sharded); serve it with --tp-size 1"
        )
    block = model.fp8_block if platform.fp8_weights_kept(target, args.load_format) else None
    problems = model.tp_problems(args.tp_size, args.ep_size, block)
    if not problems:
        return None
    sizes = ", ".join(str(tp) for tp in model.valid_tp_sizes(fp8_block=block))
    flags = f"--tp-size {args.tp_size}" + (f" --ep-size {args.ep_size}" if args.ep_size > 1 else "")
    fp8 = f"; {FP8_FIX}" if block else ""
    return (
        f"{flags} does not divide this model's {', '.join(problems)}; tensor-parallel sizes that work: {sizes}"
        + fp8
    )


def hybrid_refusal(args: ServerArgs, model: ModelSpec) -> str | None:
    """What a hybrid model (linear-attention states, or sliding-window rings) cannot be served with yet: its
    per-request states are not in the host tier, and a verify step would advance them past rejected draft tokens
    (a ring would overwrite positions still in the window with them)."""
    if model.has_linear_attention:
        kind, states = "hybrid linear-attention model", "state"
    elif model.window_rings:
        kind, states = "hybrid sliding-window model", "windowed layers' rings"
    else:
        return None
    if args.enable_hierarchical_cache:
        return (
            f"--enable-hierarchical-cache keeps KV only: a {kind}'s prefix cache also needs its {states} "
            "checkpoints, which the host tier does not hold; serve it without the host tier"
        )
    if args.speculative_algorithm:
        return (
            f"--speculative-algorithm {args.speculative_algorithm}: a {kind}'s {states} would advance past "
            "rejected draft tokens (no per-draft-token states yet); serve it without speculation"
        )
    interval, page = args.mamba_track_interval, args.page_size
    if interval % page:  # checkpoints sit where the radix tree can split: at page ends
        return f"--mamba-track-interval {interval} must be a multiple of --page-size {page}"
    return None


def triton_refusal(args: ServerArgs, target: Platform) -> str | None:
    """--attention-backend triton where Triton is not installed."""
    if args.attention_backend == "triton" and not target.triton:
        return "--attention-backend triton needs Triton: `pip install triton`"
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
