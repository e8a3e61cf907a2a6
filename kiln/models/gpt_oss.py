"""GPT-OSS: Llama's decoder with biases on all four attention projections, attention sinks (a learned logit per
query head in every softmax, whose share goes to no key), layer_types alternating sliding-window and full
attention, YaRN rope, and a sparse MoE in every layer: a router with a bias (top-k of its logits, softmaxed over
those k, which is softmax-then-renormalize), experts with biases and a clamped SwiGLU ((up + 1) * gate *
sigmoid(alpha * gate)). transformers stores each expert's gate and up interleaved, column by column, and its
matrices input-major ([E, H, 2I], [E, I, H]); the loader turns them into Kiln's stacked layout (gate rows, then up
rows). MXFP4 checkpoints arrive here dequantized (kiln/loader/mxfp4.py)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from kiln.distributed import tp_rank
from kiln.layers.activation import clamped_swiglu
from kiln.layers.moe import FusedMoE, MoESpec, RouterSpec, SparseMoeBlock, num_routed_experts
from kiln.layers.rotary import check_rope_type
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaAttention, LlamaDecoderLayer
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM

_EXPERTS = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)(?P<bias>_bias)?")


def moe_spec(hf_config: Any) -> MoESpec:
    router = RouterSpec(
        num_experts=num_routed_experts(hf_config),
        top_k=int(hf_config.num_experts_per_tok),
        norm_topk_prob=True,
        logit_bias=True,
    )
    inter = int(hf_config.intermediate_size)
    return MoESpec(int(hf_config.hidden_size), inter, shared_intermediate_size=0, router=router)


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' GPT-OSS would run and Kiln does not implement."""
    check_rope_type(hf_config)
    moe_spec(hf_config)


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.sinks = nn.Parameter(torch.empty(self.q_heads), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """This rank's heads of the checkpoint's sinks [num_attention_heads]."""
        param.data.copy_(loaded.narrow(0, tp_rank() * self.q_heads, self.q_heads))


def sparse_block(cfg: ModelConfig) -> SparseMoeBlock:
    hf, spec = cfg.hf_config, moe_spec(cfg.hf_config)
    activation = partial(clamped_swiglu, alpha=float(hf.swiglu_alpha), limit=float(hf.swiglu_limit))
    experts = FusedMoE(
        spec.router.num_experts, spec.hidden_size, spec.expert_intermediate_size, True, activation
    )
    return SparseMoeBlock(spec, experts)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.self_attn = GptOssAttention(cfg, layer_id)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return sparse_block(cfg)


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's loading (experts stacked, every expert's tensors required) under GPT-OSS's layer."""

    layer_cls = GptOssDecoderLayer
    windowed = True  # the layers layer_types marks sliding attend over sliding_window tokens

    check_config = staticmethod(check_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_kiln_layout(weights))


def _kiln_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-OSS's checkpoint names and layouts -> the stacked experts' and the router's (mlp.gate)."""
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        match = _EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
        elif match["bias"]:  # [E, 2I] interleaved -> gate, then up; [E, H] as it is
            bias = _halves(tensor, -1) if match["param"] == "gate_up_proj" else tensor
            yield f"{match['prefix']}.{match['param'].removesuffix('_proj')}_bias", bias
        else:  # [E, H, 2I] -> [E, 2I, H] gate rows, then up rows; [E, I, H] -> [E, H, I]
            tensor = tensor.transpose(1, 2)
            yield name, _halves(tensor, 1) if match["param"] == "gate_up_proj" else tensor


def _halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate, up, gate, up, ... along `dim` -> all gates, then all ups."""
    index = torch.arange(t.shape[dim])
    return t.index_select(dim, torch.cat((index[0::2], index[1::2]))).contiguous()
