"""The one way from a --model-path to a model config: an HF model directory, its config.json, a .gguf file, a
directory holding exactly one .gguf file, or a Hugging Face model id (its config and tokenizer files fetched
into the hub cache: kiln.loader.hub). Reads metadata only, never weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kiln.loader import compressed, packed_int
from kiln.models.config import ModelConfig, model_spec
from kiln.models.spec import ModelSpec

# "name" or "org/name" as the Hub spells them; anything else (./x, /x, a/b/c, ~/x) can only be a local path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(model_path: str) -> bool:
    """Whether --model-path names a Hugging Face model id rather than a local path: it is spelled like one and
    nothing exists at it locally (a local directory of the same name wins, as in transformers)."""
    return _HUB_ID.fullmatch(model_path) is not None and not Path(model_path).exists()


# the flag a speculative draft's path comes from, named by the errors about it
DRAFT_MODEL_FLAG = "--speculative-draft-model-path"


def hub_snapshot(
    model_id: str, revision: str | None = None, flag: str = "--model-path", download_dir: str | None = None
) -> str:
    """The snapshot directory of a Hugging Face model id at `revision` (a branch, tag or commit; default main) in
    the hub cache (`download_dir`, else HF_HUB_CACHE or HF_HOME/hub), holding its config and tokenizer files,
    fetched when not cached; its weights are the server's to download (kiln.loader.hub). A ValueError names the
    id and the fix."""
    from kiln.loader.hub import fetch_metadata

    return fetch_metadata(model_id, revision, download_dir, flag)


def resolve_model_path(model_path: str, revision: str | None = None, flag: str = "--model-path") -> str:
    """The path weights load from: a directory with a config.json, a .gguf file (also the one .gguf file of a
    directory without config.json), a config.json file (planning only: its directory must hold the weights to
    serve), or the hub cache's snapshot of a model id at `revision` (see hub_snapshot). Raises ValueError naming
    what was expected and `flag`, the flag that gave the path."""
    if is_hub_id(model_path):
        model_path = hub_snapshot(model_path, revision, flag)
    path = Path(model_path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise ValueError(
            f"{flag} {model_path}: no config.json and {len(ggufs)} .gguf files (give a Hugging Face model "
            f"directory, a .gguf file, or a directory holding exactly one .gguf file)"
        )
    if path.is_file() and path.suffix in (".gguf", ".json"):
        return str(path)
    raise ValueError(
        f"{flag} {model_path}: not found (give a Hugging Face model directory, a config.json or a .gguf file)"
    )


def read_hf_config(model_path: str, revision: str | None = None, flag: str = "--model-path") -> dict:
    """The HF config dict of a model path (see resolve_model_path); GGUF metadata is translated to HF names."""
    path = Path(resolve_model_path(model_path, revision, flag))
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


def read_model_spec(model_path: str, revision: str | None = None, flag: str = "--model-path") -> ModelSpec:
    """The ModelSpec of a model path (see read_hf_config); ValueError naming the flag for a config it cannot use."""
    config = read_hf_config(model_path, revision, flag)
    try:
        return model_spec(config)
    except ValueError as e:
        raise ValueError(f"{flag} {model_path}: {e}") from None


def load_model_config(
    model_path: str, revision: str | None = None, flag: str = "--model-path"
) -> ModelConfig:
    """The ModelConfig of a model path, its weights' path resolved (see resolve_model_path)."""
    resolved = resolve_model_path(model_path, revision, flag)
    hf_config = read_hf_config(resolved, flag=flag)
    check_quantization(hf_config.get("quantization_config"))
    return ModelConfig.from_hf_dict(resolved, hf_config)


def check_quantization(quant: dict | None) -> None:
    """Refuses, naming the field, a GPTQ, AWQ or compressed-tensors variant the loader cannot read: before any
    weight is read, and by `kiln plan`."""
    packed_int.packed_format(quant)
    if compressed.is_compressed_tensors(quant):
        compressed.read_config(quant)
