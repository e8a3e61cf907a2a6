"""EAGLE and EAGLE-3 draft heads: one Llama decoder layer that reads the target model's hidden states.

Both take their token embedding from the target (the drafter hands it over with `share_target`); EAGLE also
shares the target's lm head, while EAGLE-3 keeps its own head over a smaller draft vocabulary whose ids `d2t`
maps to the target's. The checkpoints load as SGLang reads them (`fc`, `midlayer.*` or `layers.0.*`,
`lm_head`, `d2t`), with or without a `model.` prefix.

The head's input features are handed in with `set_features` before a forward (the model runner calls the model
with the batch alone); after it, `last_hidden` holds the head's own output at the logits rows, which the next
draft step feeds back in place of the target's features. A captured draft decode step takes those features
(`step_feature_width` wide) as a static input, a captured catch-up the target's (`catch_up_feature_width`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch
from kiln.layers.embedding import ParallelLMHead
from kiln.layers.fp8_linear import as_dtype
from kiln.layers.linear import QKVParallelLinear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.config import ModelConfig
from kiln.models.llama import STACKED_PARAMS, LlamaDecoderLayer
from kiln.models.weight_utils import default_weight_loader

# SGLang's older EAGLE-3 checkpoints name the decoder layer and the per-feature norms so
LEGACY_NAMES = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                "aux_norm_high": "fc_norm.2"}  # fmt: skip


def eagle3_capture_layers(aux_layers: tuple[int, ...] | None, target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming hidden state EAGLE-3 reads: the head's taps (ModelSpec.aux_hidden_layers,
    each + 1: SGLang captures the output of layer i as the input of layer i + 1), else SGLang's low, middle and
    high default."""
    ids = aux_layers
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return (2, target_layers // 2, target_layers - 3)


class _DraftHead(nn.Module):
    """What both heads share: the decoder layers, rotary, features in and hidden states out."""

    # the checkpoint's separate projections that load into one merged parameter each (kiln.loader.weights.
    # load_checked reads it too, to name a missing one)
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.rotary: RotaryEmbedding | None = None
        self.attn = None  # the attention backend, set by the model runner
        self.embed_tokens: nn.Module | None = None  # the target's, set by share_target
        self.features: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None

    @property
    def step_feature_width(self) -> int:
        """The width of a draft decode step's features: the head's own output, fed back."""
        return self.cfg.hidden_size

    def init_buffers(self, max_positions: int, device) -> None:
        self.rotary = RotaryEmbedding(self.cfg.hf_config, max_positions).to(device)

    def set_features(self, features: torch.Tensor) -> None:
        """[T, width] features for the next forward's T rows: the target's, or the head's own last_hidden."""
        self.features = features

    def _rest(self, cos_sin, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        for layer in self.layers[1:]:
            h = layer(cos_sin, h, fb, self.rotary, self.attn)
        return h

    def _attend(self, layer_id: int, x: torch.Tensor, cos_sin, fb: ForwardBatch) -> torch.Tensor:
        attention = self.layers[layer_id].self_attn
        q, k, v = attention.qkv(cos_sin, x, self.rotary)
        return self.attn.forward(layer_id, q, k, v, fb, attention.scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self._param_name(name.removeprefix("model."))
            if name is None:
                continue
            shard_id = None
            for ckpt, merged, sid in self.stacked_params:
                if ckpt in name:
                    name, shard_id = name.replace(ckpt, merged), sid
                    break
            if name not in params:
                continue  # SGLang skips what the head does not hold (a checkpoint's own norm or embedding)
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(
                param, as_dtype(tensor, param.dtype), shard_id
            )
            loaded.add(name)
        return loaded

    def _param_name(self, name: str) -> str | None:
        for legacy, new in LEGACY_NAMES.items():
            name = name.replace(legacy, new)
        return None if name.startswith("embed_tokens") or "rotary_emb" in name else name


class LlamaForCausalLMEagle(_DraftHead):
    """EAGLE: fc over [embedding(token); target hidden] into decoder layers (the first without its input norm),
    then the target's lm head on the raw output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.lm_head: nn.Module | None = None  # the target's, set by share_target
        del self.layers[0].input_layernorm  # EAGLE's first layer reads fc's output as it is

    @property
    def catch_up_feature_width(self) -> int:
        """The width of a catch-up's features: the target's final hidden state, as wide as the head's."""
        return self.cfg.hidden_size

    def share_target(self, target: nn.Module) -> None:
        self.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head

    def _param_name(self, name: str) -> str | None:
        name = super()._param_name(name)
        return None if name is None or name.startswith("lm_head") else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if "fc.bias" not in loaded:  # SGLang's fc has a bias some checkpoints leave out: zero there
            self.fc.bias.data.zero_()
            loaded.add("fc.bias")
        return loaded

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.fc(torch.cat((self.embed_tokens(fb.input_ids), self.features.to(self.fc.weight.dtype)), -1))
        cos_sin = self.rotary.cos_sin_for(fb.positions, h.dtype)
        # the first layer skips its input norm (EAGLE's cnets); the rest are plain Llama layers
        h = self.layers[0].after_attention(h, self._attend(0, h, cos_sin, fb))
        h = self._rest(cos_sin, h, fb)
        h = h if fb.logits_index is None else h[fb.logits_index]
        self.last_hidden = h
        return self.lm_head(h).float()


class LlamaForCausalLMEagle3(_DraftHead):
    """EAGLE-3: the target's low, middle and high features through fc, then one decoder layer over
    [input_norm(embedding); hidden_norm(feature)] (qkv twice as wide), its own norm and head over the draft
    vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf, width = cfg.hf_config, cfg.hidden_size
        options = ("fc_norm", "use_aux_norm", "norm_before_fc")
        unread = [
            o for o in options if getattr(hf, o, None) or (getattr(hf, "eagle_config", None) or {}).get(o)
        ]
        if unread:
            raise ValueError(f"EAGLE-3 head option {', '.join(unread)} is not supported by Kiln's head")
        target_width = int(getattr(hf, "target_hidden_size", None) or width)
        ids = (getattr(hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        self.num_features = int(getattr(hf, "num_aux_hidden_states", None) or (len(ids) if ids else 3))
        self.fc = nn.Linear(target_width * self.num_features, width, bias=bool(getattr(hf, "bias", False)))
        first = self.layers[0]
        first.self_attn.qkv_proj = QKVParallelLinear(2 * width, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
        first.hidden_norm = RMSNorm(width, cfg.rms_norm_eps)
        self.norm = RMSNorm(width, cfg.rms_norm_eps)
        self.draft_vocab_size = int(getattr(hf, "draft_vocab_size", None) or cfg.vocab_size)
        self.lm_head: nn.Module = ParallelLMHead(self.draft_vocab_size, width)
        self.head_from_target = False  # a checkpoint without its own head uses the target's (SGLang's rule)
        self.hot_token_id: torch.Tensor | None = None  # draft id -> target id (None: the target's vocabulary)

    @property
    def catch_up_feature_width(self) -> int:
        """The width of a catch-up's features: the target's low, middle and high hidden states, concatenated."""
        return self.fc.in_features

    def share_target(self, target: nn.Module) -> None:
        self.embed_tokens = target.model.embed_tokens
        if self.head_from_target:
            self.lm_head = target.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        maps: dict[str, torch.Tensor] = {}

        def plain(stream):
            for name, tensor in stream:
                if name.endswith(("d2t", "t2d")):
                    maps[name.rsplit(".", 1)[-1]] = tensor
                else:
                    yield name, tensor

        loaded = super().load_weights(plain(weights))
        if "d2t" in maps:  # d2t holds each draft id's offset to its target id
            d2t = maps["d2t"].to(torch.int64)
            self.hot_token_id = d2t + torch.arange(d2t.shape[0], device=d2t.device)
        if "lm_head.weight" not in loaded:
            self.head_from_target = True
            loaded.add("lm_head.weight")
        return loaded

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        features = self.features.to(self.fc.weight.dtype)
        if features.shape[-1] != self.cfg.hidden_size:  # the target's concatenated features, not our own
            features = self.fc(features)
        embeds = self.embed_tokens(fb.input_ids)
        cos_sin = self.rotary.cos_sin_for(fb.positions, features.dtype)
        first = self.layers[0]
        x = torch.cat((first.input_layernorm(embeds), first.hidden_norm(features)), dim=-1)
        h = first.after_attention(features, self._attend(0, x, cos_sin, fb))
        h = self._rest(cos_sin, h, fb)
        h = h if fb.logits_index is None else h[fb.logits_index]
        self.last_hidden = h  # pre-norm, as SGLang feeds back by default
        return self.lm_head(self.norm(h)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.hot_token_id is None else self.hot_token_id.to(draft_ids.device)[draft_ids]
