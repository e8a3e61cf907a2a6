"""Dtype names, their sizes, and the one rule for what `--dtype auto` and `--kv-cache-dtype auto` mean.

A leaf module: the memory ledger (names and bytes only) and the model loader (torch dtypes) both read it, so the
planned ledger and the loaded model can never disagree on a dtype. torch is imported only where a torch dtype is
asked for, which keeps `kiln plan` free of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}  # fmt: skip
# The dtypes weights, activations and the KV cache are served in, and the spellings that mean them.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
# The KV cache may also be stored in fp8 (SGLang's names), converted on every write and read: without calibrated
# scales, as SGLang's default, the values are stored as they are (a scale of 1.0)
KV_CACHE_DTYPES = (*SERVING_DTYPES, "fp8_e4m3", "fp8_e5m2")
_KV_ALIASES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_FP8_TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_SERVING_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def _plain_name(name: str) -> str:
    return str(name).lower().removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name ("bfloat16", "torch.float16", "fp8_e4m3", ...)."""
    try:
        return DTYPE_BYTES[_plain_name(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (use one of {', '.join(sorted(DTYPE_BYTES))})") from None


def serving_dtype_name(name: str) -> str:
    """The canonical serving dtype a name means ("half" -> "float16"); ValueError for any other dtype."""
    plain = _plain_name(name)
    plain = _SERVING_ALIASES.get(plain, plain)
    if plain not in SERVING_DTYPES:
        raise ValueError(f"dtype {name!r} cannot be served (use one of {', '.join(SERVING_DTYPES)})")
    return plain


def resolve_dtype_name(checkpoint: str | None, half: str, device: str, requested: str | None = "auto") -> str:
    """The weight/activation dtype served: the requested one, or for "auto" float32 on the CPU (stock PyTorch is
    fastest there) and on CUDA what SGLang's model_config `_get_and_verify_dtype` picks: the `checkpoint`'s half
    type, and the model's `half` type for a float32 or unspecified checkpoint (ModelSpec.half_dtype)."""
    if requested and requested != "auto":
        return serving_dtype_name(requested)
    if not device.startswith("cuda"):
        return "float32"
    return checkpoint if checkpoint in ("bfloat16", "float16") else half


def kv_cache_dtype_name(requested: str | None, dtype: str) -> str:
    """The canonical KV cache dtype (one of KV_CACHE_DTYPES): "auto" (or none given) is the resolved
    weight/activation dtype; ValueError for a dtype the KV cache cannot be stored in."""
    if requested in (None, "auto"):
        return dtype
    plain = _plain_name(requested)
    plain = _KV_ALIASES.get(plain, _SERVING_ALIASES.get(plain, plain))
    if plain not in KV_CACHE_DTYPES:
        raise ValueError(
            f"KV cache dtype {requested!r} is not one Kiln stores (use {', '.join(KV_CACHE_DTYPES)})"
        )
    return plain


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a serving dtype name."""
    import torch

    return getattr(torch, serving_dtype_name(name))


def kv_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype the KV pool stores a KV cache dtype name in (fp8_e4m3 -> torch.float8_e4m3fn)."""
    import torch

    canonical = kv_cache_dtype_name(name, "")
    return getattr(torch, _FP8_TORCH_NAMES.get(canonical, canonical))
