"""How an embedding model pools (--is-embedding): the sentence-transformers layout a model directory may carry
(modules.json naming a Pooling module, its config such as 1_Pooling/config.json, and a Normalize module), as
Qwen3-Embedding's does. Without one, a decoder pools its last token, L2-normalised: SGLang's default for the causal
LMs it serves with --is-embedding (Pooler(LAST, normalize=True)), and Qwen3-Embedding's own configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"
# the sentence-transformers modules pooling may sit between: the model itself (Transformer) and the two above
KNOWN_MODULES = ("sentence_transformers.models.Transformer", POOLING, NORMALIZE)
# 1_Pooling/config.json's switches, by the pooling Kiln runs for each
MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolingConfig:
    """`mode`: last | mean | cls (the first token); `normalize`: L2 after pooling; `source`: where it was read."""

    mode: str = "last"
    normalize: bool = True
    source: str = "the default for a decoder (last token, normalised)"


def has_pooling_config(model_path: str) -> bool:
    """Whether the model directory is laid out for sentence-transformers with a Pooling module: an embedding model,
    served as one without --is-embedding."""
    path = Path(model_path)
    return path.is_dir() and _pooling_dir(path) is not None


def read_pooling_config(model_path: str) -> PoolingConfig:
    """The model's pooling (see the module). Raises ValueError naming the file for a layout Kiln cannot pool as
    sentence-transformers would: another pooling switch, several, or a module between pooling and output (Dense)."""
    path = Path(model_path)
    pooling_dir = _pooling_dir(path) if path.is_dir() else None
    if pooling_dir is None:
        return PoolingConfig()
    modules = _modules(path)
    others = [m.get("type") for m in modules if m.get("type") not in KNOWN_MODULES]
    if others:
        raise ValueError(
            f"{path / 'modules.json'}: module {others[0]} is not run by Kiln, which pools and normalises only"
        )
    config_file = pooling_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: cannot read the pooling config: {e}") from e
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] in UNSUPPORTED:
        raise ValueError(
            f"{config_file}: pooling {on or 'none'} is not one Kiln runs: set exactly one of "
            f"{', '.join(MODES)}"
        )
    normalize = any(m.get("type") == NORMALIZE for m in modules)
    return PoolingConfig(MODES[on[0]], normalize, str(config_file))


def _modules(path: Path) -> list[dict]:
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def _pooling_dir(path: Path) -> Path | None:
    """The Pooling module's folder that modules.json names, when it holds a config.json."""
    for module in _modules(path):
        if module.get("type") == POOLING:
            folder = path / str(module.get("path", ""))
            return folder if (folder / "config.json").is_file() else None
    return None
