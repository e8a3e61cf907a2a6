"""Rotary position embedding with a precomputed cos/sin table (any rope_type transformers knows), over the whole
head or its first rotary_dim dims (partial_rotary_factor); LongRoPE (Phi-3) with a short and a long table.

rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed has its first half negated: one roll instead
of two slices, a negation and a concatenation per call."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.layers import fused

# rope types whose cos/sin table is fixed at startup; dynamic and longrope change with the sequence length, which
# the one table built at startup cannot follow (Phi-3 builds its own for longrope: LongRopeEmbedding)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_choice(field: str, value: Any, accepted: tuple[str, ...]) -> None:
    """Refuses a model config value Kiln does not implement, naming the field: running a near miss would give
    plausible but wrong text."""
    if value not in accepted:
        raise ValueError(
            f"model config {field} {value!r} is not implemented by Kiln (accepted: {', '.join(accepted)})"
        )


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The config's rope parameters, or those of one layer type where a model keys them by layer type (Gemma 3:
    rope_local_base_freq for its sliding layers, rope_theta and its rope_scaling for the full ones)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        return params.get(layer_type) or {}
    return params


def check_rope_type(
    hf_config: Any, accepted: tuple[str, ...] = ROPE_TYPES, layer_type: str | None = None
) -> None:
    """Refuses a rope type whose table is not static (`accepted`: a model's own, where it builds another table);
    called when a model is built, before weights load."""
    params = rope_parameters(hf_config, layer_type)
    field = "rope_type (rope_parameters / rope_scaling)" + (f" of {layer_type}" if layer_type else "")
    check_choice(field, params.get("rope_type", "default"), accepted)


def rotary_dim(hf: Any, head_dim: int) -> int:
    """The dims of each head that rotate: head_dim x partial_rotary_factor."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def rotary_config(hf: Any, head_dim: int) -> Any:
    """The config RotaryEmbedding builds its table from: for the default rope, one whose head_dim is the rotary
    dim (the default table spans the whole head dim); scaled ropes apply partial_rotary_factor themselves."""
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        return hf
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return SimpleNamespace(
        rope_parameters={"rope_type": "default", "rope_theta": theta}, head_dim=rotary_dim(hf, head_dim)
    )


def _inv_freq(hf_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if layer_type is not None:
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


def _table(inv_freq: torch.Tensor, scaling: float, positions: int) -> torch.Tensor:
    """[2, P, D]: cos and the signed sin of positions 0 .. P - 1, as transformers computes them."""
    pos = torch.arange(positions, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = sin.shape[-1] // 2
    return torch.stack((cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)))


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_positions: int, layer_type: str | None = None):
        """layer_type: the layers whose rope parameters it turns by, where the config keys them by layer type."""
        super().__init__()
        inv_freq, scaling = _inv_freq(hf_config, layer_type)
        self.register_buffer("cos_sin", _table(inv_freq, scaling, max_positions), persistent=False)
        self.half = inv_freq.shape[0]

    def cos_sin_for(
        self, positions: torch.Tensor, dtype: torch.dtype, fb: ForwardBatch | None = None
    ) -> torch.Tensor:
        """[2, T, 1, D]: looked up once per forward and shared by every layer. `fb`, the batch, for a table
        that depends on more than the position (LongRopeEmbedding)."""
        return self.cos_sin[:, positions].unsqueeze(2).to(dtype)

    def apply(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; a table narrower than D (partial rotary) turns the first dims of each head only."""
        d = cos_sin.shape[-1]
        if d < x.shape[-1]:
            return torch.cat((self.apply(x[..., :d], cos_sin), x[..., d:]), dim=-1)
        kernels = fused.kernels(x)
        if kernels is not None:
            return kernels.rotary(x, cos_sin)
        return x * cos_sin[0] + torch.roll(x, self.half, dims=-1) * cos_sin[1]


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3) as transformers runs it: a forward's tokens turn by the short factors while their
    sequence, up to the forward's last position, is within original_max_position_embeddings, by the long factors
    once it goes past (transformers' longrope_frequency_update, per request here). So a prompt longer than that
    is prefilled long, and a shorter one short, its decoded tokens long from that position on; the KV already
    written stays as it was computed, as in transformers' cache.

    A prompt prefilled in chunks turns by the factors of its whole length (ForwardBatch.fill_lens), as
    transformers' one forward over it does; a cached prefix is reused as it was computed (a prefix computed short,
    then reused by a longer prompt, keeps its short rows where a fresh forward would turn them long). The table holds the short rows of positions 0 .. original - 1, then the long rows of
    every position."""

    def __init__(self, hf_config, max_positions: int):
        nn.Module.__init__(self)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        self.original = int(
            params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        )
        init = ROPE_INIT_FUNCTIONS["longrope"]
        # one attention factor for both: transformers swaps only the frequencies past the original length
        short, scaling = init(hf_config, "cpu")
        long, _ = init(hf_config, "cpu", seq_len=self.original + 1)
        table = torch.cat(
            (_table(short, scaling, min(self.original, max_positions)), _table(long, scaling, max_positions)),
            dim=1,
        )
        self.register_buffer("cos_sin", table, persistent=False)
        self.half = short.shape[0]

    def cos_sin_for(
        self, positions: torch.Tensor, dtype: torch.dtype, fb: ForwardBatch | None = None
    ) -> torch.Tensor:
        return super().cos_sin_for(positions + self.original * self._long(positions, fb), dtype)

    def _long(self, positions: torch.Tensor, fb: ForwardBatch | None) -> torch.Tensor:
        """Per row, 1 where it turns by the long factors: an extend's rows where their request's sequence (the whole
        prompt, of which this forward may be a chunk) ends past `original`; elsewhere (a decode row, a position without its batch) from its own
        position, the last of its sequence. Rows past the batch's (padding) are short."""
        if fb is None or fb.mode != ForwardMode.EXTEND:
            return (positions >= self.original).long()
        whole = fb.fill_lens or [p + e for p, e in zip(fb.prefix_lens, fb.extend_lens)]
        ends = [max(n, p + e) > self.original for n, p, e in zip(whole, fb.prefix_lens, fb.extend_lens)]
        rows = torch.repeat_interleave(torch.tensor(ends, dtype=torch.long), torch.tensor(fb.extend_lens))
        padded = torch.zeros(positions.shape[0], dtype=torch.long)
        padded[: rows.shape[0]] = rows
        return padded.to(positions.device, non_blocking=True)


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
