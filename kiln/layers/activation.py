"""The gated MLP activations over a merged gate_up projection: SiLU (Llama's and most families') and GELU with the
tanh approximation (Gemma's gelu_pytorch_tanh)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.layers import fused
from kiln.layers.rotary import check_choice


def check_hidden_act(hf_config: Any) -> None:
    """Refuses, naming the field, a config whose MLPs transformers would run with another activation."""
    check_choice("hidden_act", getattr(hf_config, "hidden_act", "silu"), ("silu",))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = fused.kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh(gate) * up, as transformers' GELUTanh computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at `limit` and up to
    [-limit, limit] (transformers' GptOssExperts._apply_gate, whose gate and up interleave; here they are the
    halves, as the loader stores them)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
