"""Qwen3-MoE: Qwen3's decoder (attention with q/k norm, the Llama norms, embedding and LM head) whose MLP is a
sparse mixture of experts in the layers decoder_sparse_step and mlp_only_layers pick, the dense Llama MLP in the
others. Routing: softmax over the experts, top-k, optionally renormalized (norm_topk_prob); no shared experts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kiln.layers.moe import (
    MoESpec,
    SparseMoeBlock,
    check_experts_loaded,
    is_sparse_layer,
    load_expert_weights,
    num_routed_experts,
)
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def moe_spec(hf_config: Any) -> MoESpec:
    """Qwen's routing whatever the config holds besides (transformers and SGLang read no DeepSeek field here)."""
    return MoESpec.from_hf(hf_config, scoring_func="softmax", topk_method="greedy", config_routing=False)


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' Qwen3-MoE would run and Kiln does not implement."""
    LlamaForCausalLM.check_config(hf_config)
    if num_routed_experts(hf_config):
        moe_spec(hf_config)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """One class for dense and sparse layers alike: graph capture compiles the layer type's attention-free
    halves once and runs them for every layer."""

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if not is_sparse_layer(cfg.hf_config, layer_id):
            return super().make_mlp(cfg, layer_id)
        return SparseMoeBlock(moe_spec(cfg.hf_config))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    windowed = True

    check_config = staticmethod(check_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(load_expert_weights(self, weights, loaded))
        check_experts_loaded(self)
        return loaded
