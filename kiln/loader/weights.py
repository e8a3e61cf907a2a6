"""Checkpoint readers -> (name, tensor) streams -> each parameter's weight_loader.

The model is built on `meta` (no memory), materialized empty on the target device, then filled tensor by
tensor, so peak RAM stays near the model's own size."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kiln import platform
from kiln.layers.fp8_linear import FP8, check_blocks_loaded, convert_to_fp8
from kiln.layers.quant_rows import pop_rows
from kiln.loader import fp8
from kiln.models.config import ModelConfig
from kiln.models.registry import model_class


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    bar = tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard", disable=len(files) < 2)
    for path in bar:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def fp8_block(cfg: ModelConfig, device: str, load_format: str) -> tuple[int, int] | None:
    """The weight block of an FP8 checkpoint whose weights stay in FP8 on `device` (kiln.platform.
    fp8_weights_kept); None where the checkpoint is not FP8 or is dequantized at load."""
    quant = cfg.config_dict.get("quantization_config")
    if cfg.is_gguf or not fp8.is_fp8_config(quant) or not platform.fp8_weights_kept(device, load_format):
        return None
    return fp8.block_size(quant)


def iter_weights(cfg: ModelConfig, keep_fp8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; an FP8 checkpoint's weights dequantized here, on the CPU (the model
    loads plain weights), or kept in FP8 with their block factors (keep_fp8)."""
    if cfg.is_gguf:
        from kiln.loader.gguf_loader import iter_gguf_tensors

        return iter_gguf_tensors(cfg.model_path)
    quant = cfg.config_dict.get("quantization_config")
    if fp8.is_fp8_config(quant):
        return fp8.block_stream(iter_safetensors(cfg.model_path), fp8.block_size(quant), keep_fp8)
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


def _reporting(weights, on_progress, every: float = 1.0):
    """Passes tensors through, reporting the count at most once per `every` seconds (for the startup watchdog)."""
    last = time.perf_counter()
    for i, item in enumerate(weights, 1):
        yield item
        if on_progress is not None and time.perf_counter() - last >= every:
            on_progress({"tensors_loaded": i})
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


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    on_progress=None,
    prepack: bool = False,
    dummy: bool = False,
) -> LoadedModel:
    """Build the model on meta, materialize it and load every weight; checks nothing was missed. dummy
    (--load-format dummy): random weights instead, nothing read but the config."""
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
        loaded = model.load_weights(_reporting(iter_weights(cfg, block is not None), on_progress))
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        if missing:
            raise ValueError(
                f"checkpoint {cfg.model_path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
        check_blocks_loaded(model)
    model.init_buffers(max_positions, device)
    prepacked, formats = 0, {}
    if prepack:
        from kiln.layers.cpu_gemm import prepack_module_weights

        prepacked, formats = prepack_module_weights(model)
    for p in model.parameters():  # the GGUF blocks no layer packed (an untied embedding, GPU weights)
        pop_rows(p)
    model.eval()
    fp8_weights = sum(p.dtype == FP8 for p in model.parameters())
    return LoadedModel(model, time.perf_counter() - t0, prepacked, formats, fp8_weights)
