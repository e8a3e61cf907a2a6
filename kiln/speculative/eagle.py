"""EAGLE and EAGLE-3 drafting: a one-layer head fed the target's hidden states (kiln/models/eagle.py).

The head's position p reads the pair (token p + 1, the target's hidden state at p): the hidden state that
predicted that token. The verify step hands the pairs over through `accepted(rid, tokens, hidden)`, with
hidden[i] the target's hidden state of the row that predicted tokens[i]: after a prefill (chunk) of tokens
[s, e) the tokens are the sequence's [s + 1, e + 1) and the hidden states the chunk's rows; after a verify the
accepted drafts and the bonus token and the rows of the last token and the accepted drafts. A prompt prefix
the target read from its cache has no hidden states: the head starts after it. A request whose pairs have a
hole later (a step that handed none over) proposes nothing rather than guess across it.

EAGLE reads the target's final normed hidden state; EAGLE-3 the residual stream entering three of its layers
(low, middle, high), concatenated: `attach_target` sets the target model to keep them.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.loader.model_config import DRAFT_MODEL_FLAG, load_model_config
from kiln.loader.weights import build_materialized, iter_safetensors, load_checked
from kiln.models.config import ModelConfig
from kiln.models.eagle import LlamaForCausalLMEagle, LlamaForCausalLMEagle3, eagle3_capture_layers
from kiln.models.spec import ModelSpec
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.speculative.base import DraftInput
from kiln.speculative.draft_model import ChainDrafter, DraftRefused, _Sequence
from kiln.speculative.head_kv import TargetSlotKV, head_pool_sizes, target_pool_rows

HEADS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,
    "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
}


class EagleDrafter(TargetSlotKV, ChainDrafter):
    """Drafts with an EAGLE or EAGLE-3 head on the target's hidden states."""

    def __init__(self, runner: ModelRunner, num_steps: int, topk: int = 1, num_nodes: int | None = None):
        super().__init__(runner, num_steps, topk, num_nodes)
        self.head = runner.model
        self.pending: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        # requests whose pairs have a gap (a prefix the target read from its cache, a step that handed out no
        # hidden states): they draft nothing until they start over, and keep no pairs meanwhile
        self.gapped: set[str] = set()

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        if rid in self.gapped:
            return
        if hidden is None or len(tokens) != hidden.shape[0]:
            self._gap(rid)
            return
        self.pending.setdefault(rid, []).append((list(tokens), hidden))

    def release(self, rid: str) -> None:
        super().release(rid)
        self._forget(rid)
        self.pending.pop(rid, None)
        self.gapped.discard(rid)

    def _gap(self, rid: str) -> None:
        self.gapped.add(rid)
        self.pending.pop(rid, None)

    def _catch_up(self, seq: _Sequence, inp: DraftInput) -> tuple[list[int], torch.Tensor | None] | None:
        if inp.rid in self.gapped:
            return None
        self._note_input(inp)
        parts = self.pending.pop(inp.rid, [])
        ids = [t for tokens, _ in parts for t in tokens]
        # the pairs must run up to the request's last token, which the target predicted at the last verify
        missing = len(inp.token_ids) - 1 - (seq.kept + len(ids))
        if missing > 0 and seq.kept == 0 and ids:
            # the target read the prompt's first `missing` tokens from its prefix cache and computed no hidden
            # states for them: the head's KV for them is in the target's slots when it computed them before
            # (head_kv.py); otherwise it starts after them, attending to what it has
            if not self._join_cached_prefix(seq, inp, missing):
                seq.base = seq.kept = missing
        elif missing or not ids:
            self._gap(inp.rid)
            return None
        return ids, torch.cat([h for _, h in parts]).to(self.runner.device)

    def _idle(self, inp: DraftInput) -> None:
        """A request that takes no drafts at this step (under a grammar, at its last tokens) keeps no pairs."""
        self._gap(inp.rid)

    def _set_features(self, features: torch.Tensor | None) -> None:
        self.head.set_features(features)

    def _step_features(self) -> torch.Tensor | None:
        # the runner's: a replayed draft graph hands the head's output out with the logits
        return self.runner.last_hidden

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        convert = getattr(self.head, "to_target_ids", None)
        return convert(ids) if convert is not None else ids


def read_head_config(path: str) -> ModelConfig:
    return load_model_config(path, flag=DRAFT_MODEL_FLAG)


def head_class(arch: str) -> type[nn.Module]:
    if arch not in HEADS:
        raise DraftRefused(
            f"draft model architecture {arch!r} is not an EAGLE head Kiln reads ({sorted(HEADS)})"
        )
    return HEADS[arch]


def load_head(path: str, target: nn.Module, dtype: torch.dtype, device: str, max_positions: int) -> nn.Module:
    """The head at `path` (config.json + safetensors in SGLang's layouts), sharing the target's embedding (and
    head, for EAGLE or a checkpoint without its own)."""
    cfg = read_head_config(path)
    head = build_materialized(head_class(cfg.architecture), cfg, dtype, device)
    try:  # the target's checks: a whole tensor or one part of a merged one (q, k or v) left unfilled
        load_checked(head, iter_safetensors(path), path, set())
    except ValueError as e:
        raise DraftRefused(f"draft {e}") from None
    head.share_target(target)
    head.init_buffers(max_positions, device)
    return head.eval()


def attach_target(target: nn.Module, head: ModelSpec, target_path: str) -> None:
    """Set the target to keep the hidden states the head reads; DraftRefused when it cannot."""
    if not hasattr(target, "capture_hidden"):
        raise DraftRefused(f"target {target_path} ({type(target).__name__}) cannot hand out hidden states")
    if head_class(head.architecture) is LlamaForCausalLMEagle:
        target.capture_hidden = "last"
        return
    layers = eagle3_capture_layers(head.aux_hidden_layers, len(target.model.layers))
    if len(set(layers)) != len(layers) or not all(0 <= i < len(target.model.layers) for i in layers):
        raise DraftRefused(
            f"EAGLE-3 reads the hidden states entering layers {list(layers)} of the target {target_path}, which "
            f"has {len(target.model.layers)} layers: set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    target.capture_hidden = tuple(layers)


def check_head_vocabulary(size: int, target_vocab: int, draft_path: str, target_path: str) -> None:
    """An EAGLE head's embedding is the target's: its config must name the target's vocabulary size."""
    if size != target_vocab:
        raise DraftRefused(
            f"draft model {draft_path} has a vocabulary of {size} tokens, the target {target_path} {target_vocab}:"
            " an EAGLE head must be trained on the target's vocabulary"
        )


def build_eagle_drafter(
    path: str,
    target: ModelRunner,
    sizes: PoolSizes,
    num_steps: int,
    topk: int = 1,
    num_nodes: int | None = None,
) -> EagleDrafter:
    """The head at `path` on its own KV pool and request table (`sizes`), the target set to hand out the hidden
    states it reads, drafting chains (topk 1) or trees. DraftRefused when the head does not fit the target."""
    head_cfg = read_head_config(path)
    target_cfg = target.model_config
    check_head_vocabulary(head_cfg.vocab_size, target_cfg.vocab_size, path, target_cfg.model_path)
    attach_target(target.model, head_cfg.spec, target_cfg.model_path)
    max_positions = max(sizes.context_len, target_cfg.max_position_embeddings) + 8
    head = load_head(path, target.model, target.dtype, target.device, max_positions)
    runner = ModelRunner(head_cfg, target.dtype, target.kv_dtype, target.device, target.attention_backend)
    runner.model = head
    shared = {id(p) for p in target.model.parameters()}
    runner.measured["weights"] = sum(p.nbytes for p in head.parameters() if id(p) not in shared)
    return head_drafter(runner, target, sizes, num_steps, topk, num_nodes)


def head_drafter(
    runner: ModelRunner,
    target: ModelRunner,
    sizes: PoolSizes,
    num_steps: int,
    topk: int,
    num_nodes: int | None,
) -> EagleDrafter:
    """A head's drafter on a pool that mirrors the target's slots (head_kv.py), with room for its guesses."""
    runner.init_memory_pool(head_pool_sizes(target, sizes, num_steps, topk))
    drafter = EagleDrafter(runner, num_steps, topk, num_nodes)
    drafter.share_target_slots(target_pool_rows(target))
    return drafter
