"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch, Pieces
from kiln.layers.activation import check_hidden_act, silu_and_mul
from kiln.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.layers.fp8_linear import as_dtype
from kiln.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, check_rope_type
from kiln.models.config import ModelConfig
from kiln.models.weight_utils import default_weight_loader

logger = logging.getLogger("kiln")

# checkpoint name fragment -> (merged parameter name fragment, shard id)
STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        hf = cfg.hf_config
        self.layer_id = layer_id
        # its index in the token pool, or among the windowed layers' rings (LlamaForCausalLM._set_windows)
        self.kv_layer = layer_id
        self.head_dim = cfg.head_dim
        # transformers' biases: attention_bias puts one on all four projections (Llama, Qwen3); Qwen2 has them on
        # q, k and v only, always; Mistral has none
        bias = bool(getattr(hf, "attention_bias", False)) and not cfg.architecture.startswith("Mistral")
        qwen2 = cfg.architecture.startswith("Qwen2")
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias or qwen2
        )
        self.q_heads, self.kv_heads = self.qkv_proj.q_heads, self.qkv_proj.kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias and not qwen2
        )
        self.qk_norm = cfg.architecture.startswith("Qwen3")
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        # what a family's layer adds to plain causal attention (Gemma's window and softcap, GPT-OSS's sinks),
        # handed to the attention backend with each call
        self.window: int | None = None
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None

    def qkv(self, cos_sin: torch.Tensor, x: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
        """[T, hidden] -> q [T, Hq, D], k and v [T, Hk, D], q and k rotated."""
        qkv = self.qkv_proj(x)
        t, hq, hk, d = qkv.shape[0], self.q_heads, self.kv_heads, self.head_dim
        if self.qk_norm:
            q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            qk = torch.cat((self.q_norm(q.view(t, hq, d)), self.k_norm(k.view(t, hk, d))), dim=1)
        else:
            qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)  # q and k are adjacent: rotate them together
        qk = rotary.apply(qk, cos_sin)
        return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hk) * d :].view(t, hk, d)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x), `residual` consumed: the add in down_proj's GEMM where it can be
        (RowParallelLinear.forward_add)."""
        return self.down_proj.forward_add(silu_and_mul(self.gate_up_proj(x)), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = self.make_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        """The layer's MLP: dense here; a mixture-of-experts model's layer returns its sparse block."""
        return LlamaMLP(cfg)

    # A layer is two attention-free pieces around the attention call, so that graph capture can take the pieces
    # at fixed token counts while attention, whose shapes follow the batch's sequences, runs in between.
    def before_attention(self, cos_sin, h: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
        return self.self_attn.qkv(cos_sin, self.input_layernorm(h), rotary)

    def after_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h, normed = self.post_attention_layernorm.add_forward(self.self_attn.o_proj(attn_out), h)
        return self.mlp.forward_add(normed, h) if isinstance(self.mlp, LlamaMLP) else h + self.mlp(normed)

    def forward(self, cos_sin, h: torch.Tensor, fb: ForwardBatch, rotary, attn, pieces: Pieces | None = None):
        before = pieces.before if pieces else type(self).before_attention
        after = pieces.after if pieces else type(self).after_attention
        q, k, v = before(self, cos_sin, h, rotary)
        n, sa = fb.out_cache_loc.shape[0], self.self_attn  # padded rows (pieces) never reach attention
        out = attn.forward(sa.kv_layer, q[:n], k[:n], v[:n], fb, sa.scale, sa.window, sa.softcap, sa.sinks)
        return after(self, h, pieces.pad(out) if pieces else out)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = (
        LlamaDecoderLayer  # one class for every layer: graphs compile it once
    )
    # the checkpoint's separate projections that load into one merged parameter each
    stacked_params = STACKED_PARAMS

    # whether transformers applies the config's sliding_window to this architecture; where it does, Kiln masks
    # the same layers (layer_windows)
    windowed = False

    @staticmethod
    def check_config(hf_config: Any) -> None:
        """Refuses, naming the field, a config this model would run as a near miss: called before any weight is
        allocated, and by `kiln plan` (kiln.models.registry.check_model_config)."""
        check_rope_type(hf_config)
        check_hidden_act(hf_config)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        type(self).check_config(cfg.hf_config)
        self.cfg = cfg
        self.model = LlamaModel(cfg, type(self).layer_cls)
        self._set_windows(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True
        self.rotary: RotaryEmbedding | None = None
        self.attn = None  # the attention backend, set by the model runner
        # hidden states a draft head reads (set by a speculative drafter at startup): "last" keeps the final
        # normed hidden state of every row (EAGLE), a tuple of layer indices keeps the residual stream entering
        # each of those layers, concatenated (EAGLE-3); None keeps nothing
        self.capture_hidden: str | tuple[int, ...] | None = None
        self.last_hidden: torch.Tensor | None = None  # [rows, width] of the last forward, when captured
        self.prompt_hidden: torch.Tensor | None = None  # the last forward's hidden_index rows, normed (head)

    def _set_windows(self, cfg: ModelConfig) -> None:
        """Each layer's window (layer_windows); where the windowed layers keep rings (ModelSpec.window_rings),
        each attention layer's kv_layer counts among its kind: the pool holds the full-attention layers alone."""
        windows = layer_windows(cfg.hf_config, type(self).windowed)
        rings, counts = cfg.spec.window_rings, {True: 0, False: 0}
        for layer, window in zip(self.model.layers, windows):
            attention = getattr(layer, "self_attn", None)
            if isinstance(attention, LlamaAttention):
                attention.window = window
                if rings:
                    attention.kv_layer = counts[window is not None]
                    counts[window is not None] += 1

    def init_buffers(self, max_positions: int, device) -> None:
        """Non-parameter state, built after the weights were materialized off `meta`."""
        self.rotary = RotaryEmbedding(self.cfg.hf_config, max_positions).to(device)

    def forward(self, fb: ForwardBatch, pieces: Pieces | None = None) -> torch.Tensor:
        ids, pos = (
            (pieces.pad(fb.input_ids), pieces.pad(fb.positions)) if pieces else (fb.input_ids, fb.positions)
        )
        h = self.model.embed_tokens(ids)
        cos_sin = self.rotary.cos_sin_for(pos, h.dtype, fb)
        capture, rows = self.capture_hidden, fb.input_ids.shape[0]
        taken: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            if isinstance(capture, tuple) and i in capture:  # a copy: the next piece may reuse the buffer
                taken.append(h[:rows].clone())
            h = layer(cos_sin, h, fb, self.rotary, self.attn, pieces)
        if capture == "last":
            self.last_hidden = h = self.model.norm(h[:rows])
            return self.head(h, fb, normed=True)
        if taken:
            self.last_hidden = torch.cat(taken, dim=-1)
        return self.head(h, fb)

    def head(self, h: torch.Tensor, fb: ForwardBatch, normed: bool = False) -> torch.Tensor:
        """The logits of fb.logits_index's rows of the last layer's output `h` (`normed`: the final norm already
        applied). fb.hidden_index's rows are kept normed in `prompt_hidden` (set only then, so a compiled decode
        step mutates nothing): their logits (prompt logprobs) are computed afterwards a chunk of rows at a time
        (compute_logits), never [prompt x vocab] at once."""
        norm = (lambda x: x) if normed else self.model.norm
        if fb.hidden_index is not None:
            self.prompt_hidden = norm(h[fb.hidden_index])
        return self.compute_logits(norm(h if fb.logits_index is None else h[fb.logits_index]))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of normed hidden states [rows, hidden] (the whole vocabulary on every rank)."""
        return self.lm_head(h).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unused: list[str] = []
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            original, shard_id = name, None
            for ckpt, merged, sid in self.stacked_params:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, merged), sid
                    break
            if name not in params and f"model.{name}" in params:
                name = (
                    f"model.{name}"  # transformers' base model's names (Qwen3-Embedding saves Qwen3Model's)
                )
            if name not in params:
                # skipped, as transformers and SGLang do (an adapter, a head Kiln does not run): a checkpoint
                # that is not this model's is still refused, by the parameters it leaves unfilled
                unused.append(original)
                continue
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, as_dtype(tensor, param.dtype), shard_id)
            loaded.add(name)
        if unused:
            logger.warning(
                f"{len(unused)} checkpoint tensors have no parameter in {type(self).__name__} and were not "
                f"used, e.g. {unused[:3]}"
            )
        return loaded


def layer_windows(hf_config: Any, windowed: bool) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: none unless the architecture is `windowed`; then
    the resolved config's sliding_window (Qwen's configs clear it without use_sliding_window) on the layers
    layer_types marks sliding, or on every layer where the config has no layer_types (Mistral, Mixtral, Phi-3,
    Qwen3-MoE)."""
    layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None) if windowed else None
    if not window:
        return [None] * layers
    kinds = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * layers
    return [int(window) if kind == "sliding_attention" else None for kind in kinds]


class MistralForCausalLM(LlamaForCausalLM):
    windowed = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    windowed = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    windowed = True
