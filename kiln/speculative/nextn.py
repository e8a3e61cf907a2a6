"""NEXTN: DeepSeek-V3's own multi-token-prediction layer as the draft, driven like an EAGLE head.

The target's loader keeps the MTP layer's tensors aside (`mtp_weights`, checkpoint layer num_hidden_layers);
here they become a head: enorm(embedding(token)) and hnorm(the target's hidden state) through eh_proj, one
DeepSeek-V3 decoder layer (latent attention, the experts) on a latent KV pool of its own, shared_head.norm, and
the target's lm head, as SGLang's DeepseekV3ForCausalLMNextN computes it. The embedding, lm head and rotary
tables are the target's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from kiln.core.forward_batch import ForwardBatch
from kiln.layers.moe import check_experts_loaded, load_expert_weights
from kiln.layers.norm import RMSNorm
from kiln.loader.weights import build_materialized, load_checked
from kiln.models.config import ModelConfig
from kiln.models.deepseek_v3 import STACKED_MLP_PARAMS, DeepseekV3DecoderLayer
from kiln.models.llama import LlamaForCausalLM
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.speculative.draft_model import DraftRefused
from kiln.speculative.eagle import EagleDrafter, head_drafter

_MTP_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_HEAD_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the head's own tensors, not the layer's


class NextnHead(nn.Module):
    """The MTP layer of a DeepSeek-V3 target as a draft head (set_features / last_hidden as EAGLE's)."""

    stacked_params = STACKED_MLP_PARAMS

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        width = cfg.hidden_size
        self.enorm = RMSNorm(width, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(width, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(width, cfg.rms_norm_eps)
        self.model = nn.Module()
        # numbered as in the checkpoint (its MLP is sparse or dense as that layer's would be); its KV is the
        # draft pool's only layer
        layer = DeepseekV3DecoderLayer(cfg, cfg.num_layers)
        layer.self_attn.layer_id = 0
        self.model.layers = nn.ModuleList([layer])
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.rotary = None
        self.attn = None  # the attention backend, set by the model runner
        self.features: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None

    def share_target(self, target: nn.Module) -> None:
        self.embed_tokens, self.lm_head, self.rotary = (
            target.model.embed_tokens,
            target.lm_head,
            target.rotary,
        )

    @property
    def step_feature_width(self) -> int:
        """The width of a draft decode step's features (its own output, fed back; a captured step's input)."""
        return self.cfg.hidden_size

    @property
    def catch_up_feature_width(self) -> int:
        """The width of a catch-up's features: the target's final hidden state."""
        return self.cfg.hidden_size

    def set_features(self, features: torch.Tensor | None) -> None:
        self.features = features

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.enorm(self.embed_tokens(fb.input_ids))
        h = self.eh_proj(torch.cat((embeds, self.hnorm(self.features.to(embeds.dtype))), dim=-1))
        cos_sin = self.rotary.cos_sin_for(fb.positions, h.dtype)
        h = self.model.layers[0](cos_sin, h, fb, self.rotary, self.attn)
        h = self.shared_head.norm(h if fb.logits_index is None else h[fb.logits_index])
        self.last_hidden = h  # normed, as the target's hidden state that the head reads is
        return self.lm_head(h).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= LlamaForCausalLM.load_weights(self, load_expert_weights(self, weights, loaded))  # type: ignore[arg-type]
        check_experts_loaded(self)
        return loaded


def head_weights(mtp_weights: dict[str, torch.Tensor], num_layers: int) -> list[tuple[str, torch.Tensor]]:
    """The first MTP layer's tensors under the head's names (the embedding and head copies left out: the
    target's are used)."""
    out = []
    for name, tensor in mtp_weights.items():
        match = _MTP_LAYER.match(name)
        if match is None or int(match[1]) != num_layers:
            continue
        rest = match[2]
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        out.append((rest if rest.startswith(_HEAD_PARTS) else f"model.layers.0.{rest}", tensor))
    return out


def check_has_mtp(model_path: str, architecture: str, mtp_layers: object) -> None:
    """DraftRefused for a NEXTN target without an MTP layer (`mtp_layers` falsy: none in its config, or none of
    its weights; `kiln plan` asks too, from the config alone)."""
    if not mtp_layers:
        raise DraftRefused(
            f"--speculative-algorithm NEXTN drafts with the model's own MTP layer; {model_path} ({architecture}) "
            "has none"
        )


def build_nextn_drafter(
    target: ModelRunner, sizes: PoolSizes, num_steps: int, topk: int = 1, num_nodes: int | None = None
) -> EagleDrafter:
    """The target's MTP layer as a head on a latent KV pool of its own; DraftRefused when the target has none."""
    cfg, model = target.model_config, target.model
    mtp = getattr(model, "mtp_weights", None)
    check_has_mtp(cfg.model_path, cfg.architecture, cfg.spec.nextn_layers and mtp)
    head = build_materialized(NextnHead, cfg, target.dtype, target.device)
    weights = ((n, t.to(target.device)) for n, t in head_weights(mtp, cfg.num_layers))
    try:  # the target's checks: a whole tensor or one part of a merged one (gate or up) left unfilled
        load_checked(head, weights, f"{cfg.model_path}'s MTP layer", set())
    except ValueError as e:
        raise DraftRefused(str(e).removeprefix("checkpoint ")) from None
    head.share_target(model)
    model.capture_hidden = "last"
    runner = ModelRunner(
        replace(cfg, num_layers=1), target.dtype, target.kv_dtype, target.device, target.attention_backend
    )
    runner.model = head.eval()
    shared = {id(p) for p in model.parameters()}
    runner.measured["weights"] = sum(p.nbytes for p in head.parameters() if id(p) not in shared)
    return head_drafter(runner, target, sizes, num_steps, topk, num_nodes)
