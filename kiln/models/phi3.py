"""Phi-3 (Phi-3 / Phi-3.5 mini and medium, Phi-4-mini): Llama's decoder with q, k and v in one checkpoint tensor
(qkv_proj) and gate and up in another (gate_up_proj), rotary over the first head_dim x partial_rotary_factor dims,
and LongRoPE ("longrope" rope scaling: short and long factors around original_max_position_embeddings)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kiln.layers.activation import check_hidden_act
from kiln.layers.rotary import ROPE_TYPES, LongRopeEmbedding, RotaryEmbedding, check_rope_type, rotary_config
from kiln.models.llama import LlamaForCausalLM


def check_config(hf_config: Any) -> None:
    """Refuses, naming the field, what transformers' Phi-3 would run and Kiln does not implement."""
    check_rope_type(hf_config, (*ROPE_TYPES, "longrope"))
    check_hidden_act(hf_config)


class Phi3ForCausalLM(LlamaForCausalLM):
    windowed = True  # transformers' Phi-3 masks every layer to the config's sliding_window

    check_config = staticmethod(check_config)

    def init_buffers(self, max_positions: int, device) -> None:
        hf = self.cfg.hf_config
        params = getattr(hf, "rope_parameters", None) or {}
        if params.get("rope_type") == "longrope":
            self.rotary = LongRopeEmbedding(hf, max_positions).to(device)
        else:
            self.rotary = RotaryEmbedding(rotary_config(hf, self.cfg.head_dim), max_positions).to(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused checkpoint tensors as the separate projections Llama's loader merges, each loaded into its
        part of the merged parameter (and sharded there, as a separate checkpoint's would be)."""
        q = self.cfg.num_heads * self.cfg.head_dim
        kv = self.cfg.num_kv_heads * self.cfg.head_dim
        for name, tensor in weights:
            if name.endswith(".qkv_proj.weight"):
                for part, rows in zip(("q", "k", "v"), tensor.split([q, kv, kv])):
                    yield name.replace(".qkv_proj.", f".{part}_proj."), rows
            elif name.endswith(".gate_up_proj.weight"):
                gate, up = tensor.chunk(2)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
