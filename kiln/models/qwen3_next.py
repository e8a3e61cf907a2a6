"""Qwen3-Next: a hybrid decoder whose layers are gated DeltaNet linear attention, with gated full attention every
full_attention_interval-th layer, and a mixture of experts with one sigmoid-gated shared expert as MLP.

As transformers' Qwen3NextForCausalLM computes it: the norms are zero-centred (x * (1 + w)) except the gated
RMSNorm of the linear layers' output (x * w * silu(z)); full attention has q/k norm, partial rotary and an output
gate that comes out of q_proj beside each head's query. Only the full-attention layers keep KV, in the pool at
their index among full-attention layers; the linear layers keep a conv and a recurrent state per request in the
state pool (kiln.memory.state_pool), at their index among linear layers, in the request's slot (ForwardBatch.
state_slots). A request with no prefix starts from a zero state; one with a prefix (chunked prefill, a prefix
whose state was restored into its slot) continues from the slot's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.forward_batch import ForwardBatch, ForwardMode, Pieces
from kiln.core.layer_kinds import LINEAR_ATTENTION
from kiln.distributed import ep_size, tp_size
from kiln.layers.activation import check_hidden_act
from kiln.layers.fp8_linear import as_dtype
from kiln.layers.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_extend,
    decay_and_beta,
    delta_rule_extend,
    delta_rule_step,
)
from kiln.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kiln.layers.moe import (
    GatedMLP,
    SparseMoeBlock,
    check_experts_loaded,
    is_sparse_layer,
    load_expert_weights,
    num_routed_experts,
)
from kiln.layers.rotary import RotaryEmbedding, check_rope_type, rotary_config, rotary_dim
from kiln.models.config import LinearAttentionSpec, ModelConfig
from kiln.models.llama import LlamaForCausalLM
from kiln.models.qwen3_moe import moe_spec
from kiln.models.spec import EAGER_LINEAR


class StatePool(Protocol):
    """What the linear layers read of kiln.memory.state_pool.StatePool (a package above this one, which the
    runner hands the model): per linear layer and slot, the conv and recurrent states."""

    conv: torch.Tensor  # [linear layers, slots, conv_dim, kernel - 1]
    ssm: torch.Tensor  # [linear layers, slots, value heads, key head dim, value head dim]


STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    (".q_proj", ".qkv_proj", 0),
    (".k_proj", ".qkv_proj", 1),
    (".v_proj", ".qkv_proj", 2),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
    (".in_proj_qkvz", ".in_proj", 0),
    (".in_proj_ba", ".in_proj", 1),
]


def check_config(hf: Any) -> None:
    """Refuses, naming the field or flag, what transformers' Qwen3-Next would run and Kiln does not."""
    check_rope_type(hf)
    check_hidden_act(hf)
    if num_routed_experts(hf):
        moe_spec(hf)
    if tp_size() > 1 or ep_size() > 1:
        raise ValueError(
            "Qwen3-Next (linear-attention layers) is not implemented with --tp-size or --ep-size above 1"
        )
    spec = LinearAttentionSpec.from_hf(hf)
    if spec is not None and spec.num_value_heads % spec.num_key_heads:
        raise ValueError(
            f"model config linear_num_value_heads {spec.num_value_heads} is not a multiple of "
            f"linear_num_key_heads {spec.num_key_heads}"
        )


# ---------------------------------------------------------------------------------------------- norms
class ZeroCentredRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNorm: the weight is stored centred on zero and applied as (1 + w), in float32,
    the product cast back to the input's dtype (where Llama's norm casts before the product)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated: RMSNorm of each value head's output, then times silu(z)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)


# ---------------------------------------------------------------------------------------------- attention
class GatedAttention(nn.Module):
    """Full attention whose q_proj gives each head its query and an output gate side by side; q and k are
    normed per head, the first rotary_dim of each head rotated."""

    def __init__(self, cfg: ModelConfig, kv_layer: int):
        super().__init__()
        hf = cfg.hf_config
        self.kv_layer = kv_layer  # the layer's index in the KV pool, among full-attention layers
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(cfg.hidden_size, [2 * q_width, kv_width, kv_width], bias)
        self.o_proj = RowParallelLinear(q_width, cfg.hidden_size, bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = rotary_dim(hf, self.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(
        self, cos_sin, x: torch.Tensor, fb: ForwardBatch, rotary: RotaryEmbedding, attn
    ) -> torch.Tensor:
        t, h, hk, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([2 * h * d, hk * d, hk * d], dim=-1)
        q_gate = q_gate.view(t, h, 2 * d)
        gate = q_gate[..., d:].reshape(t, h * d)
        qk = torch.cat((self.q_norm(q_gate[..., :d]), self.k_norm(k.view(t, hk, d))), dim=1)
        r = self.rotary_dim
        qk = (
            torch.cat((rotary.apply(qk[..., :r], cos_sin), qk[..., r:]), dim=-1)
            if r < d
            else rotary.apply(qk, cos_sin)
        )
        out = attn.forward(self.kv_layer, qk[:, :h], qk[:, h:], v.view(t, hk, d), fb, self.scale)
        return self.o_proj(out * torch.sigmoid(gate))


# ---------------------------------------------------------------------------------------------- linear attention
class CausalConv1d(nn.Module):
    """The depthwise conv's weight, [channels, 1, kernel] as in the checkpoint (no bias: Qwen3-Next has none)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer. in_proj holds in_proj_qkvz and in_proj_ba as one matrix whose rows the loader
    reorders (checkpoint: interleaved per key-head group) to q, k, v, z, b, a, each over all heads: the conv's
    input is then one slice of the projection and no step reorders activations."""

    def __init__(self, cfg: ModelConfig, spec: LinearAttentionSpec, linear_layer: int):
        super().__init__()
        self.spec = spec
        self.linear_layer = linear_layer  # the layer's index in the state pool, among linear layers
        qkvz, ba = 2 * spec.key_dim + 2 * spec.value_dim, 2 * spec.num_value_heads
        self.in_proj = MergedColumnParallelLinear(cfg.hidden_size, [qkvz, ba])
        # held in the serving dtype from an FP8 checkpoint too: in_proj_ba is left unquantized there, and the rows
        # are reordered at load (Qwen3NextForCausalLM._renamed), where their block factors would not follow
        self.in_proj.fp8_weight_names = ()
        self.conv1d = CausalConv1d(spec.conv_dim, spec.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(spec.num_value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(spec.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(spec.value_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, states: StatePool) -> torch.Tensor:
        spec, t = self.spec, x.shape[0]
        nv = spec.num_value_heads
        mixed, z, b, a = self.in_proj(x).split([spec.conv_dim, spec.value_dim, nv, nv], dim=-1)
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        if fb.mode == ForwardMode.DECODE:
            core = self._decode(mixed, g, beta, fb.state_slots, states)
        else:
            core = self._extend(mixed, g, beta, fb, states)
        dv = spec.value_head_dim
        core = self.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(t, spec.value_dim)
        return self.out_proj(core)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        spec = self.spec
        q, k, v = mixed.split([spec.key_dim, spec.key_dim, spec.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        return (
            q.reshape(*lead, spec.num_key_heads, spec.key_head_dim),
            k.reshape(*lead, spec.num_key_heads, spec.key_head_dim),
            v.reshape(*lead, spec.num_value_heads, spec.value_head_dim),
        )

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, states: StatePool
    ) -> torch.Tensor:
        """One token per request, the whole batch at once: [B, conv_dim] -> [B, Hv, Dv]. Each state is gathered
        (index_select: a copy the step may update in place), stepped and written back to its slot."""
        conv, ssm = states.conv[self.linear_layer], states.ssm[self.linear_layer]
        mixed, conv_state = causal_conv1d_decode(mixed, self.conv1d.weight[:, 0], conv.index_select(0, slots))
        conv.index_copy_(0, slots, conv_state)
        q, k, v = self._heads(mixed)
        state = ssm.index_select(0, slots)
        out = delta_rule_step(q, k, v, g, beta, state)
        ssm.index_copy_(0, slots, state)
        return out

    def _extend(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, fb: ForwardBatch, states: StatePool
    ) -> torch.Tensor:
        """Each request's new tokens (the delta rule in the form delta_rule_extend picks for their number), from
        its slot's state when it has a prefix, else from zeros: [T, conv_dim] -> [T, Hv, Dv]."""
        layer, weight = self.linear_layer, self.conv1d.weight[:, 0]
        outs, start = [], 0
        for n, prefix, slot in zip(fb.extend_lens, fb.prefix_lens, fb.state_slots.tolist()):
            end = start + n
            conv_state = states.conv[layer, slot] if prefix else None
            ssm_state = states.ssm[layer, slot].unsqueeze(0) if prefix else None
            conv_out, states.conv[layer, slot] = causal_conv1d_extend(mixed[start:end], weight, conv_state)
            q, k, v = (t.unsqueeze(0) for t in self._heads(conv_out))
            out, state = delta_rule_extend(
                q, k, v, g[start:end].unsqueeze(0), beta[start:end].unsqueeze(0), ssm_state
            )
            states.ssm[layer, slot] = state[0]
            outs.append(out[0])
            start = end
        return torch.cat(outs)


def qkvz_rows_by_kind(tensor: torch.Tensor, spec: LinearAttentionSpec) -> torch.Tensor:
    """in_proj_qkvz's rows, stored per key-head group as [q, k, v, z] of that group, reordered to q, k, v, z
    each over all heads (transformers' fix_query_key_value_ordering, done once on the weight)."""
    per_group = spec.num_value_heads // spec.num_key_heads * spec.value_head_dim
    groups = tensor.view(spec.num_key_heads, -1, tensor.shape[-1])
    parts = groups.split([spec.key_head_dim, spec.key_head_dim, per_group, per_group], dim=1)
    return torch.cat([p.reshape(-1, tensor.shape[-1]) for p in parts])


def ba_rows_by_kind(tensor: torch.Tensor, spec: LinearAttentionSpec) -> torch.Tensor:
    """in_proj_ba's rows, [b, a] per key-head group, reordered to b then a over all value heads."""
    per_group = spec.num_value_heads // spec.num_key_heads
    groups = tensor.view(spec.num_key_heads, 2 * per_group, tensor.shape[-1])
    b, a = groups.split([per_group, per_group], dim=1)
    return torch.cat((b.reshape(-1, tensor.shape[-1]), a.reshape(-1, tensor.shape[-1])))


# ---------------------------------------------------------------------------------------------- the model
class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        spec, hf = cfg.linear_attention, cfg.hf_config
        self.is_linear = spec.layer_types[layer_id] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, spec, spec.linear_layers.index(layer_id))
        else:
            self.self_attn = GatedAttention(cfg, spec.full_layers.index(layer_id))
        if is_sparse_layer(hf, layer_id):
            self.mlp: nn.Module = SparseMoeBlock(moe_spec(hf))
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, cos_sin, h: torch.Tensor, fb: ForwardBatch, rotary, attn, states) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_linear:
            h = h + self.linear_attn(x, fb, states)
        else:
            h = h + self.self_attn(cos_sin, x, fb, rotary, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3NextDecoderLayer
    stacked_params = STACKED_PARAMS
    eager_only = EAGER_LINEAR  # read by the graph runner, as the ledger reads ModelSpec.eager_only

    check_config = staticmethod(check_config)

    def __init__(self, cfg: ModelConfig):
        if cfg.linear_attention is None:
            raise ValueError("model config: Qwen3-Next without linear_attention layers in layer_types")
        super().__init__(cfg)
        self.model.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.state_pool: StatePool | None = None  # the linear layers' states, set by the model runner

    def init_buffers(self, max_positions: int, device) -> None:
        config = rotary_config(self.cfg.hf_config, self.cfg.head_dim)
        self.rotary = RotaryEmbedding(config, max_positions).to(device)

    def forward(self, fb: ForwardBatch, pieces: Pieces | None = None) -> torch.Tensor:
        if pieces is not None:
            raise ValueError(f"{type(self).__name__} runs eagerly: {self.eager_only}")
        h = self.model.embed_tokens(fb.input_ids)
        cos_sin = self.rotary.cos_sin_for(fb.positions, h.dtype)
        for layer in self.model.layers:
            h = layer(cos_sin, h, fb, self.rotary, self.attn, self.state_pool)
        return self.head(h, fb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(load_expert_weights(self, self._renamed(weights), loaded))
        check_experts_loaded(self)
        return loaded

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Kiln's names: the multi-token-prediction head left out (Kiln does not
        run it), the shared expert under the sparse block's name, the linear layers' input projections in the
        row order the model reads."""
        spec = self.cfg.linear_attention
        for name, tensor in weights:
            if name.startswith("mtp."):
                continue
            name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
            if name.endswith("in_proj_qkvz.weight"):  # reordered dequantized (in_proj is not held in FP8)
                tensor = qkvz_rows_by_kind(as_dtype(tensor, torch.float32), spec)
            elif name.endswith("in_proj_ba.weight"):
                tensor = ba_rows_by_kind(as_dtype(tensor, torch.float32), spec)
            yield name, tensor
