"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention, dense MLPs in the first
first_k_dense_replace layers, then mixtures of experts with a shared expert and DeepSeek-V3's router (sigmoid
scores, grouped top-k ranked with e_score_correction_bias, routed_scaling_factor).

Latent attention keeps one compressed KV row per token in the pool (see kiln.runner.attention.mla): the layer
computes its queries, the normalized latent and the rotated rope key, and lends the backend its up-projection
(kv_b_proj) to decompress or absorb. The MTP layers (num_nextn_predict_layers, checkpoint layers numbered from
num_hidden_layers) are loaded and kept aside for speculative decoding, never run by this model."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch, Pieces
from kiln.layers.activation import check_hidden_act
from kiln.layers.fp8_linear import as_dtype
from kiln.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kiln.layers.moe import (
    MoESpec,
    SparseMoeBlock,
    check_experts_loaded,
    is_sparse_layer,
    load_expert_weights,
    num_routed_experts,
)
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import check_rope_type, deinterleave, softmax_scale
from kiln.models.config import MlaDims, ModelConfig
from kiln.models.llama import LlamaForCausalLM, LlamaMLP

# checkpoint name fragment -> (merged parameter name fragment, shard id): the dense and shared-expert MLPs
STACKED_MLP_PARAMS: list[tuple[str, str, str | int]] = [
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
]

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' DeepseekV3 would run and Kiln does not implement."""
    if not getattr(hf_config, "kv_lora_rank", None):
        raise ValueError("model config kv_lora_rank is missing: DeepseekV3ForCausalLM is latent attention")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("model config attention_bias true is not implemented by Kiln (accepted: false)")
    check_rope_type(hf_config)
    check_hidden_act(hf_config)
    if num_routed_experts(hf_config):
        moe_spec(hf_config)


def moe_spec(hf_config: Any) -> MoESpec:
    """DeepSeek's routing (sigmoid scores, noaux_tc groups), or the one the config names, as SGLang reads it."""
    return MoESpec.from_hf(hf_config, scoring_func="sigmoid", topk_method="noaux_tc", float32_routing=True)


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj [H * (nope + v), lora], split by head across ranks. Decode reads its weight per head (the key
    half absorbed into the queries, the value half applied to the latent output), so it keeps the plain layout
    instead of a prepacked one, and in the serving dtype for an FP8 checkpoint too (as SGLang dequantizes it)."""

    fp8_weight_names = ()

    def __init__(self, dims: MlaDims, num_heads: int):
        super().__init__(dims.kv_lora_rank, num_heads * (dims.qk_nope_head_dim + dims.v_head_dim))
        self.dims = dims
        self.heads = self.out_per_rank // (dims.qk_nope_head_dim + dims.v_head_dim)

    def prepack_weights(self) -> bool:
        return False

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key weights [H, nope, lora] and the value weights [H, v, lora] of this rank's heads."""
        d = self.dims
        w = self.weight.view(self.heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]


class DeepseekV3Attention(nn.Module):
    """The latent attention's projections; the attention itself is the backend's (forward_latent)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        hf, dims = cfg.hf_config, cfg.mla
        if dims is None:
            raise ValueError(
                "model config kv_lora_rank is missing: DeepseekV3ForCausalLM is latent attention"
            )
        self.layer_id, self.dims = layer_id, dims
        h, heads = cfg.hidden_size, cfg.num_heads
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * dims.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(h, dims.q_lora_rank)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, heads * dims.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, dims.latent_width)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(dims, heads)
        self.o_proj = RowParallelLinear(heads * dims.v_head_dim, h)
        self.heads = self.kv_b_proj.heads
        self.rope_interleave = bool(getattr(hf, "rope_interleave", True))
        self.scale = softmax_scale(hf, dims.qk_head_dim)

    def project(self, x: torch.Tensor, cos_sin: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
        """[T, hidden] -> q_nope [T, H, nope], q_rope [T, H, rope] (rotated) and the pool rows [T, lora + rope]:
        the normalized latent, then the rotated rope key."""
        d, t = self.dims, x.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, self.heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], -1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        rope = torch.cat((q_rope, k_rope.unsqueeze(1)), dim=1)  # [T, H + 1, rope]: rotated together
        rope = rotary.apply(deinterleave(rope) if self.rope_interleave else rope, cos_sin)
        return (
            q_nope,
            rope[:, : self.heads],
            torch.cat((self.kv_a_layernorm(latent), rope[:, self.heads]), -1),
        )

    # the LatentProjection the backend uses
    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        w_k, _ = self.kv_b_proj.per_head()  # [H, nope, lora]
        return torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, s = self.dims, latent.shape[0]
        kv = self.kv_b_proj(latent[:, : d.kv_lora_rank]).view(s, self.heads, -1)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k_rope = latent[:, d.kv_lora_rank :].unsqueeze(1).expand(s, self.heads, d.qk_rope_head_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def value_output(self, latent_out: torch.Tensor) -> torch.Tensor:
        _, w_v = self.kv_b_proj.per_head()  # [H, v, lora]
        return torch.bmm(latent_out.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = DeepseekV3Attention(cfg, layer_id)
        self.mlp = self.make_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer_id: int) -> nn.Module:
        if not is_sparse_layer(cfg.hf_config, layer_id):
            return LlamaMLP(cfg)
        return SparseMoeBlock(moe_spec(cfg.hf_config))

    # the attention-free halves, as LlamaDecoderLayer's, so that prefill graphs can take them at fixed sizes
    def before_attention(self, cos_sin, h: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
        return self.self_attn.project(self.input_layernorm(h), cos_sin, rotary)

    def after_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h, normed = self.post_attention_layernorm.add_forward(self.self_attn.o_proj(attn_out), h)
        return h + self.mlp(normed)

    def forward(self, cos_sin, h: torch.Tensor, fb: ForwardBatch, rotary, attn, pieces: Pieces | None = None):
        before = pieces.before if pieces else DeepseekV3DecoderLayer.before_attention
        after = pieces.after if pieces else DeepseekV3DecoderLayer.after_attention
        q_nope, q_rope, latent = before(self, cos_sin, h, rotary)
        n, sa = fb.out_cache_loc.shape[0], self.self_attn  # padded rows (pieces) never reach attention
        out = attn.forward_latent(sa.layer_id, q_nope[:n], q_rope[:n], latent[:n], fb, sa, sa.scale)
        return after(self, h, pieces.pad(out) if pieces else out)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    layer_cls = DeepseekV3DecoderLayer  # type: ignore[assignment]
    stacked_params = STACKED_MLP_PARAMS  # latent attention keeps its projections apart

    check_config = staticmethod(check_config)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # the MTP layers' checkpoint tensors by name, kept for speculative decoding (NEXTN); never run here
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def _set_aside_mtp(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Passes the main model's tensors on; keeps the MTP layers' in mtp_weights, in the serving dtype (an FP8
        checkpoint's dequantized) and where the checkpoint reader put them (host memory)."""
        dtype = self.model.embed_tokens.weight.dtype
        for name, tensor in weights:
            match = _LAYER_INDEX.match(name)
            if match is not None and int(match[1]) >= self.cfg.num_layers:
                self.mtp_weights[name] = as_dtype(tensor, dtype) if tensor.is_floating_point() else tensor
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(load_expert_weights(self, self._set_aside_mtp(weights), loaded))
        check_experts_loaded(self)
        return loaded
