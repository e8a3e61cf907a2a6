"""The one way from a --model-path to a model config: an HF model directory, its config.json, a .gguf file, or a
directory holding exactly one .gguf file. Reads metadata only, never weights."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.models.config import ModelConfig


def resolve_model_path(model_path: str) -> str:
    """The path weights load from: a directory with a config.json, a .gguf file (also the one .gguf file of a
    directory without config.json), or a config.json file (planning only: its directory must hold the weights to
    serve). Raises ValueError naming what was expected."""
    path = Path(model_path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise ValueError(
            f"--model-path {model_path}: no config.json and {len(ggufs)} .gguf files (give a Hugging Face model "
            f"directory, a .gguf file, or a directory holding exactly one .gguf file)"
        )
    if path.is_file() and path.suffix in (".gguf", ".json"):
        return str(path)
    raise ValueError(
        f"--model-path {model_path}: not found (give a Hugging Face model directory, a config.json or a .gguf file)"
    )


def read_hf_config(model_path: str) -> dict:
    """The HF config dict of a model path (see resolve_model_path); GGUF metadata is translated to HF names."""
    path = Path(resolve_model_path(model_path))
    if path.suffix == ".gguf":
        from kiln.loader.gguf_loader import read_gguf_config

        return read_gguf_config(str(path))
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the model config: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def load_model_config(model_path: str) -> ModelConfig:
    """The ModelConfig of a model path, its weights' path resolved (see resolve_model_path)."""
    return ModelConfig.from_hf_dict(resolve_model_path(model_path), read_hf_config(model_path))
