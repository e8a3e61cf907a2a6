"""Gemma 2 and Gemma 3 (text): Llama's decoder with Gemma's RMSNorm (scaled by 1 + weight), a norm after attention
and around the MLP as well as before attention, a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden_size),
softmax scale query_pre_attn_scalar^-0.5, and layer_types alternating sliding-window and full attention. Gemma 2
softcaps the attention scores (attn_logit_softcapping) and the logits (final_logit_softcapping); Gemma 3 has q/k
norms instead, and two rope tables: rope_local_base_freq for its sliding layers, rope_theta with its scaling for the
full ones. The window and the softcap are the layer's, handed to the attention backend with each call."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch, Pieces
from kiln.layers.activation import gelu_tanh_and_mul
from kiln.layers.norm import GemmaRMSNorm
from kiln.layers.rotary import RotaryEmbedding, check_choice, check_rope_type
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"


def rope_by_layer_type(hf_config: Any) -> bool:
    """Whether the config keys its rope parameters by layer type (Gemma 3's)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return SLIDING in params or FULL in params


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' Gemma 2 / Gemma 3 would run and Kiln does not implement."""
    if rope_by_layer_type(hf_config):
        for kind in set(hf_config.layer_types):
            check_rope_type(hf_config, layer_type=kind)
    else:
        check_rope_type(hf_config)
    check_choice("hidden_activation", getattr(hf_config, "hidden_activation", None), ("gelu_pytorch_tanh",))
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(
            "model config use_bidirectional_attention True is not implemented by Kiln (it attends causally)"
        )


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        hf = cfg.hf_config
        self.scale = float(hf.query_pre_attn_scalar) ** -0.5
        self.qk_norm = cfg.architecture.startswith("Gemma3")
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.layer_type = hf.layer_types[layer_id]
        cap = getattr(hf, "attn_logit_softcapping", None)
        self.softcap: float | None = float(cap) if cap else None


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        nn.Module.__init__(self)
        self.self_attn = GemmaAttention(cfg, layer_id)
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def after_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer
    windowed = True  # the layers layer_types marks sliding attend over sliding_window tokens

    check_config = staticmethod(check_config)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # transformers scales the embeddings by sqrt(hidden_size) rounded to the weights' dtype
        dtype = self.model.embed_tokens.weight.dtype
        self.normalizer = float(torch.tensor(cfg.hidden_size**0.5, device="cpu").to(dtype))
        self.final_softcap: float | None = getattr(cfg.hf_config, "final_logit_softcapping", None) or None
        self.rotaries: dict[str, RotaryEmbedding] = {}

    def init_buffers(self, max_positions: int, device) -> None:
        hf = self.cfg.hf_config
        if rope_by_layer_type(hf):
            kinds = sorted(set(hf.layer_types))
            self.rotaries = {k: RotaryEmbedding(hf, max_positions, k).to(device) for k in kinds}
            self.rotary = self.rotaries.get(FULL, self.rotaries[kinds[0]])
        else:
            self.rotary = RotaryEmbedding(hf, max_positions).to(device)
            self.rotaries = {kind: self.rotary for kind in set(hf.layer_types)}

    def forward(self, fb: ForwardBatch, pieces: Pieces | None = None) -> torch.Tensor:
        ids, pos = (
            (pieces.pad(fb.input_ids), pieces.pad(fb.positions)) if pieces else (fb.input_ids, fb.positions)
        )
        h = self.model.embed_tokens(ids) * self.normalizer
        tables = {id(r): r.cos_sin_for(pos, h.dtype, fb) for r in self.rotaries.values()}
        capture, rows = self.capture_hidden, fb.input_ids.shape[0]
        taken: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            if isinstance(capture, tuple) and i in capture:  # a copy: the next piece may reuse the buffer
                taken.append(h[:rows].clone())
            rotary = self.rotaries[layer.self_attn.layer_type]
            h = layer(tables[id(rotary)], h, fb, rotary, self.attn, pieces)
        if taken:
            self.last_hidden = torch.cat(taken, dim=-1)
        if capture == "last":
            self.last_hidden = h = self.model.norm(h[:rows])
        return self.head(h, fb, normed=capture == "last")

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(h), self.final_softcap).float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with q/k norms (GemmaAttention, by the architecture's name), rope tables by layer type, and
    transformers' defaults of Gemma3TextConfig: no softcap."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's multimodal checkpoints (4B and up) served as their language model: the text config's model under
    transformers' names for it (language_model.model.*, or model.language_model.* from transformers 5); the
    vision tower and its projector are not loaded (images are not taken)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_language_model(weights))


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION):
            continue
        for prefix, kiln in (("language_model.model.", "model."), ("model.language_model.", "model.")):
            if name.startswith(prefix):
                name = kiln + name.removeprefix(prefix)
        yield name.removeprefix("language_model."), tensor
