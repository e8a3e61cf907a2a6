"""Rotary position embedding with a precomputed cos/sin table (any rope_type transformers knows).

rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed has its first half negated: one roll instead
of two slices, a negation and a concatenation per call."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kiln.layers import fused

# rope types whose cos/sin table is fixed at startup; dynamic and longrope change with the sequence length, which
# the one table built at startup cannot follow
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_choice(field: str, value: Any, accepted: tuple[str, ...]) -> None:
    """Refuses a model config value Kiln does not implement, naming the field: running a near miss would give
    plausible but wrong text."""
    if value not in accepted:
        raise ValueError(
            f"model config {field} {value!r} is not implemented by Kiln (accepted: {', '.join(accepted)})"
        )


def check_rope_type(hf_config: Any) -> None:
    """Refuses a rope type whose table is not static; called when a model is built, before weights load."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    check_choice("rope_type (rope_parameters / rope_scaling)", params.get("rope_type", "default"), ROPE_TYPES)


def _inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        inv_freq, scaling = _inv_freq(hf_config)
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos_sin", torch.stack((cos, sin_signed)), persistent=False)  # [2, P, D]
        self.half = half

    def cos_sin_for(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, T, 1, D]: looked up once per forward and shared by every layer."""
        return self.cos_sin[:, positions].unsqueeze(2).to(dtype)

    def apply(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]."""
        kernels = fused.kernels(x)
        if kernels is not None:
            return kernels.rotary(x, cos_sin)
        return x * cos_sin[0] + torch.roll(x, self.half, dims=-1) * cos_sin[1]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] with rotary pairs interleaved (x0, x1), (x2, x3), ... -> evens then odds, the half-split layout
    `apply` rotates. DeepSeek's checkpoints lay their rope dimensions out interleaved (rope_interleave);
    transformers rotates them as pairs, which gives exactly the half-split rotation of the de-interleaved
    vector, in that layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(hf_config: Any, head_dim: int) -> float:
    """DeepSeek's attention scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope is scaled
    and the config names mscale_all_dim (yarn stretches the logits' range; this undoes it), as transformers'
    DeepseekV3Attention does."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scale = head_dim**-0.5
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale
