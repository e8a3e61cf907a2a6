"""Sampling defaults from a model directory's generation_config.json, for `--sampling-defaults model` (SGLang's
flag and default): a request that leaves one of these parameters unset gets the model's value."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kiln.sampling_params import MODEL_DEFAULT_FIELDS, InvalidParam, SamplingParams

logger = logging.getLogger("kiln")

SAMPLING_DEFAULTS_MODES = ("model", "openai")


def _generation_config_file(model_path: str) -> Path | None:
    """The generation_config.json of a model path (resolve_model_path's kinds): a directory's own, or the one
    beside a config.json given as the path. A .gguf file given as the path has none (GGUF holds no
    generation config; a file beside it belongs to no one in particular)."""
    path = Path(model_path)
    if path.is_file():
        path = path.parent if path.suffix == ".json" else None
    return path / "generation_config.json" if path is not None else None


def _accepted(name: str, value: object, source: Path) -> int | float | None:
    """The value Kiln samples with, or None (with a warning) for one Kiln cannot use: a value every request
    would be refused for (400 naming a parameter the client never sent) is worse than the plain default."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        logger.warning(f"{source}: {name}={value!r} is not a number: ignored")
        return None
    if name == "top_k":
        if isinstance(value, float) and not value.is_integer():  # NaN and infinity included
            logger.warning(f"{source}: top_k={value!r} is not a whole number: ignored")
            return None
        # transformers' top_k 0 is "no top-k filtering", which Kiln (as SGLang) spells -1
        value = int(value) if value != 0 else -1
    else:
        value = float(value)
    try:
        SamplingParams(**{name: value}).validate()
    except InvalidParam as e:
        logger.warning(f"{source}: {e}: ignored")
        return None
    return value


def read_sampling_defaults(model_path: str) -> dict[str, int | float]:
    """The sampling parameters generation_config.json sets (SGLang's list: MODEL_DEFAULT_FIELDS), as SGLang's
    ModelConfig.get_default_sampling_params reads them: only those the file sets (transformers 5's
    GenerationConfig leaves the others None; transformers 4 filled in its own, top_k 50, that no file asked
    for), and do_sample is not read, so a file with do_sample false and a temperature samples at that
    temperature, as SGLang does (transformers' generate would decode greedily). No file: no defaults."""
    source = _generation_config_file(model_path)
    if source is None or not source.is_file():
        return {}
    try:
        config = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        logger.warning(f"{source}: cannot be read ({e}): the OpenAI sampling defaults stay")
        return {}
    if not isinstance(config, dict):
        logger.warning(f"{source}: not a JSON object: the OpenAI sampling defaults stay")
        return {}
    defaults = {}
    for name in MODEL_DEFAULT_FIELDS:
        if config.get(name) is not None:
            value = _accepted(name, config[name], source)
            if value is not None:
                defaults[name] = value
    return defaults


def sampling_defaults(mode: str, model_path: str | None) -> dict[str, int | float]:
    """The defaults a request's unset sampling parameters take under --sampling-defaults `mode`: the model's
    (model) or none beyond SamplingParams' own, OpenAI's (openai)."""
    if mode not in SAMPLING_DEFAULTS_MODES:
        raise ValueError(f"--sampling-defaults {mode}: give one of {', '.join(SAMPLING_DEFAULTS_MODES)}")
    if mode == "openai" or not model_path:
        return {}
    return read_sampling_defaults(model_path)
