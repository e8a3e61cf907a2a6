"""Checkpoint readers -> (name, tensor) streams -> each parameter's weight_loader.

The model is built on `meta` (no memory), materialized empty on the target device, then filled tensor by
tensor, so peak RAM stays near the model's own size."""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kiln import platform
from kiln.layers.fp8_linear import FP8, check_blocks_loaded, convert_to_fp8
from kiln.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from kiln.layers.quant_rows import pop_rows
from kiln.loader import compressed, fp8, mxfp4, packed_int
from kiln.models.config import ModelConfig
from kiln.models.registry import model_class

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: those its index's weight_map names where it has one, else every
    *.safetensors. A repo may ship another copy of the weights beside its shards (Mistral's consolidated.
    safetensors, in its own tensor names), which transformers, SGLang and vLLM leave out by the index too."""
    index = os.path.join(model_dir, INDEX_FILE)
    if not os.path.isfile(index):
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        return files
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from e
    if not names:
        raise FileNotFoundError(f"{index} names no safetensors files")
    absent = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
    if absent:
        raise FileNotFoundError(
            f"{index} names {len(absent)} files absent from {model_dir}, e.g. {absent[:3]}: the download is "
            "incomplete"
        )
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(model_dir)
    bar = tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard", disable=len(files) < 2)
    for path in bar:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # its message names no file: say which of the shards is damaged
            raise ValueError(
                f"checkpoint file {os.path.relpath(path, model_dir)} in {model_dir} cannot be read "
                f"(truncated or corrupt?): {e}"
            ) from e


def fp8_block(cfg: ModelConfig, device: str, load_format: str) -> tuple[int, int] | None:
    """The weight block of an FP8 checkpoint whose weights stay in FP8 on `device` (kiln.platform.
    fp8_weights_kept); None where the checkpoint is not FP8 or is dequantized at load."""
    quant = cfg.config_dict.get("quantization_config")
    if (
        cfg.is_gguf
        or not fp8.is_fp8_config(quant)
        or not platform.fp8_weights_kept(platform.machine_platform(device), load_format)
    ):
        return None
    return fp8.block_size(quant)


def iter_weights(cfg: ModelConfig, keep_fp8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; an FP8 checkpoint's weights dequantized here, on the CPU (the model
    loads plain weights), or kept in FP8 with their block factors (keep_fp8); an MXFP4, GPTQ, AWQ or
    compressed-tensors one's dequantized."""
    if cfg.is_gguf:
        from kiln.loader.gguf_loader import iter_gguf_tensors

        return iter_gguf_tensors(cfg.model_path)
    quant = cfg.config_dict.get("quantization_config")
    if fp8.is_fp8_config(quant):
        return fp8.block_stream(iter_safetensors(cfg.model_path), fp8.block_size(quant), keep_fp8)
    if mxfp4.is_mxfp4_config(quant):
        return mxfp4.dequantized_stream(iter_safetensors(cfg.model_path))
    if compressed.is_compressed_tensors(quant):
        return compressed.dequantized_stream(iter_safetensors(cfg.model_path), quant)
    packed = packed_int.packed_format(quant)
    if packed is not None:
        return packed_int.dequantized_stream(iter_safetensors(cfg.model_path), packed)
    return iter_safetensors(cfg.model_path)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter uniform in [-1e-3, 1e-3], as SGLang's dummy loader draws them, from one seeded generator:
    a model of any size to measure without its checkpoint (a load reads nothing), the same weights every time."""
    params = dict(model.named_parameters())  # shared (tied) parameters once
    generators: dict[torch.device, torch.Generator] = {}
    for p in params.values():
        gen = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.uniform_(-1e-3, 1e-3, generator=gen)


def materialize(model: torch.nn.Module, device: str) -> None:
    """Replace each `meta` parameter by an empty one on `device`, keeping its attributes (weight_loader)
    and its sharing (tied embeddings); each `meta` buffer (FP8 weights' block factors, which their weights'
    loaders fill) by one of NaN, so a part no loader filled shows."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.full_like(buffer, float("nan"), device=device))
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in done:
                new = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                done[id(param)] = new
            setattr(module, name, done[id(param)])


def _reporting(items, on_progress, what: str = "tensors_loaded", every: float = 1.0):
    """Passes items through, reporting the count at most once per `every` seconds (for the startup watchdog)."""
    last = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        if on_progress is not None and time.perf_counter() - last >= every:
            on_progress({what: i})
            last = time.perf_counter()


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model and what loading it took: the model itself carries no record of its load."""

    model: torch.nn.Module
    seconds: float  # building, reading the checkpoint and prepacking
    prepacked_weights: int  # linear weights packed into a CPU layout (0: none, or prepack off)
    # how many of them in each format: "float32", "Q4_1 (integer)", "Q8_0 (float32)" (GGUF blocks multiplied in
    # float32), "I8 (integer)" (--quantization int8), ...
    packed_formats: dict[str, int] = field(default_factory=dict)
    fp8_weights: int = 0  # weights held in FP8 blocks as the checkpoint stores them


def build_materialized(
    cls: type, cfg: ModelConfig, dtype: torch.dtype, device: str, fp8_block: tuple[int, int] | None = None
) -> torch.nn.Module:
    """cls(cfg) built on meta with `dtype` as the default (no memory touched), its FP8-holding weights made fp8
    when fp8_block is given, then materialized on `device`, ready for its weights."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    if fp8_block is not None:
        convert_to_fp8(model, fp8_block)
    materialize(model, device)
    return model


def merged_parts(model: torch.nn.Module) -> dict[str, tuple[str | int, ...]]:
    """Each merged parameter (q, k and v, or gate and up, as one matrix) -> the shard ids its weight_loader must
    be handed, one checkpoint tensor each: a part never handed stays torch.empty memory, which a per-parameter
    check cannot see. The routed experts' stacks keep their own record (kiln.layers.moe.check_experts_loaded)."""
    parts: dict[str, tuple[str | int, ...]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, QKVParallelLinear):
            ids: tuple[str | int, ...] = ("q", "k", "v")
        elif isinstance(module, MergedColumnParallelLinear):
            ids = tuple(range(len(module.out_sizes)))
        else:
            continue
        for name, _ in module.named_parameters(prefix=prefix, recurse=False):
            parts[name] = ids
    return parts


@contextmanager
def shards_recorded(model: torch.nn.Module, names: Iterable[str]) -> Iterator[dict[str, set]]:
    """While open, the shard ids each named parameter's weight_loader was handed, by wrapping the loaders the
    models' load_weights call, so that no model keeps a record of its own."""
    params = dict(model.named_parameters())
    seen: dict[str, set] = {}
    originals = {}
    for name in names:
        param, got = params[name], seen.setdefault(name, set())
        originals[name] = original = param.weight_loader  # type: ignore[attr-defined]

        def record(p, loaded, shard_id=None, _load=original, _got=got) -> None:
            _load(p, loaded, shard_id)
            _got.add(shard_id)

        param.weight_loader = record  # type: ignore[attr-defined]
    try:
        yield seen
    finally:
        for name, original in originals.items():
            params[name].weight_loader = original  # type: ignore[attr-defined]


def _checkpoint_name(param: str, shard_id: str | int, stacked: list[tuple[str, str, str | int]]) -> str:
    """The checkpoint tensor that fills `shard_id` of a merged parameter (model.stacked_params backwards)."""
    for ckpt, merged, sid in stacked:
        if sid == shard_id and merged in param:
            return param.replace(merged, ckpt)
    return f"{param} (part {shard_id!r})"


def load_checked(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], path: str, exempt: set[str]
) -> None:
    """model.load_weights(weights), then refuses, naming the checkpoint tensors, a checkpoint that left any
    parameter, or any part of a merged one, unfilled (`exempt`: the parameters a checkpoint may leave out)."""
    parts = merged_parts(model)
    with shards_recorded(model, parts) as seen:
        loaded = model.load_weights(weights)
    filled = loaded | exempt
    missing = [n for n, _ in model.named_parameters() if n not in filled and n not in parts]
    stacked = getattr(model, "stacked_params", [])
    for name, ids in parts.items():  # a fused tensor (shard id None) fills no part by the layers' loaders
        missing += [_checkpoint_name(name, i, stacked) for i in ids if i not in seen[name]]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    on_progress=None,
    prepack: bool = False,
    dummy: bool = False,
    head: bool = True,
) -> LoadedModel:
    """Build the model on meta, materialize it and load every weight; checks nothing was missed. dummy
    (--load-format dummy): random weights instead, nothing read but the config. head False: the lm_head may be
    missing (an embedding model's checkpoint, saved from transformers' base model, has none)."""
    if dummy and cfg.is_gguf:
        raise ValueError(
            f"--load-format dummy builds a model from a config.json, and {cfg.model_path} is a GGUF file: give a "
            "model directory (its config.json and tokenizer; no weights needed) or --load-format auto"
        )
    t0 = time.perf_counter()
    block = fp8_block(cfg, device, "dummy" if dummy else "auto")
    if block is not None and not device.startswith("cuda"):
        from kiln.layers.triton_import import check_runnable  # Triton, imported only where FP8 is kept

        check_runnable("FP8 weights kept in their blocks (KILN_FP8_WEIGHTS=keep)")
    model = build_materialized(model_class(cfg.architecture), cfg, dtype, device, block)
    if dummy:
        init_dummy_weights(model)
    else:
        exempt = {"lm_head.weight"} if cfg.tie_word_embeddings or not head else set()
        load_checked(
            model, _reporting(iter_weights(cfg, block is not None), on_progress), cfg.model_path, exempt
        )
        check_blocks_loaded(model)
    model.init_buffers(max_positions, device)
    prepacked, formats = 0, {}
    if prepack:
        from kiln.layers.cpu_gemm import prepack_module_weights

        prepacked, formats = prepack_module_weights(
            model, lambda layers: _reporting(layers, on_progress, "weights_prepacked")
        )
    for p in model.parameters():  # the GGUF blocks no layer packed (an untied embedding, GPU weights)
        pop_rows(p)
    model.eval()
    fp8_weights = sum(p.dtype == FP8 for p in model.parameters())
    return LoadedModel(model, time.perf_counter() - t0, prepacked, formats, fp8_weights)
