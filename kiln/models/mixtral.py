"""Mixtral: Mistral's decoder (no attention biases, sliding_window honoured) whose every MLP is a sparse mixture of
experts: softmax over num_local_experts, top num_experts_per_tok, renormalized; each expert a gated MLP of
intermediate_size; no shared experts. The blocks are Qwen3-MoE's (kiln.layers.moe), under Mixtral's checkpoint
names (block_sparse_moe, experts' w1 / w3 / w2) or transformers' own (mlp, stacked experts)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kiln.layers.activation import check_hidden_act
from kiln.layers.moe import MoESpec, RouterSpec, SparseMoeBlock, num_routed_experts
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM

# Mixtral's expert projections -> transformers' names for them: w1 gate, w3 up, w2 down
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def moe_spec(hf_config: Any) -> MoESpec:
    """transformers' MixtralSparseMoeBlock: the router always renormalizes its top-k weights (Mixtral's config
    has no norm_topk_prob), and every expert is intermediate_size wide (no moe_intermediate_size)."""
    check_hidden_act(hf_config)
    router = RouterSpec(
        num_experts=num_routed_experts(hf_config),
        top_k=int(hf_config.num_experts_per_tok),
        norm_topk_prob=True,
    )
    return MoESpec(
        hidden_size=int(hf_config.hidden_size),
        expert_intermediate_size=int(hf_config.intermediate_size),
        shared_intermediate_size=0,
        router=router,
    )


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' Mixtral would run and Kiln does not implement."""
    LlamaForCausalLM.check_config(hf_config)
    moe_spec(hf_config)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return SparseMoeBlock(moe_spec(cfg.hf_config))


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's loading (experts stacked, every expert's tensors required) under Mixtral's layer."""

    layer_cls = MixtralDecoderLayer
    windowed = True  # transformers' Mixtral masks every layer to the config's sliding_window

    check_config = staticmethod(check_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        yield _EXPERT.sub(lambda m: f".experts.{m[1]}.{_PARTS[m[2]]}.", name), tensor
