"""STANDALONE speculative decoding: a smaller model with the target's tokenizer drafts a chain of tokens.

The draft has its own ModelRunner (weights, KV pool, request table) sized for the target's running requests at
its context. Each verify step it catches up on the tokens the target kept since the last one with one extend
(whose last row gives the first draft token), then decodes greedily for the rest of the chain. The KV of the
draft's own guesses is dropped right after proposing: the catch-up extend of the next step recomputes the
accepted ones, so the draft's KV only ever holds tokens the target kept and a rejected guess costs nothing to
undo.

`ChainDrafter` is that loop for any draft model; the EAGLE heads (eagle.py) feed it features as well as tokens.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.models.config import ModelConfig
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.speculative.base import DraftInput

logger = logging.getLogger("kiln")


# tokens of one catch-up extend at most: a prompt the draft has not seen goes in chunks, as the target's prefill
CATCH_UP_CHUNK = 2048


class DraftRefused(ValueError):
    """The draft model cannot serve this target (another vocabulary or tokenizer); raised at startup."""


@dataclass
class _Sequence:
    """One request's rows in the draft's KV: positions [base, kept) hold what the target kept, in the columns
    [0, kept - base) of its table row. `base` is 0 but for an EAGLE head that joined after a prefix it has no
    features for (see eagle.py)."""

    table_idx: int
    kept: int = 0
    base: int = 0


@dataclass(frozen=True)
class _CatchUp:
    """What one request feeds the draft before drafting: tokens (and features) from position `start`."""

    rid: str
    ids: list[int]
    start: int
    steps: int
    features: torch.Tensor | None = None


class ChainDrafter:
    """Drives a draft model greedily: a chain of up to `num_steps` tokens per request (topk 1)."""

    def __init__(self, runner: ModelRunner, num_steps: int):
        self.runner = runner
        self.num_steps = num_steps
        self.sequences: dict[str, _Sequence] = {}
        # since startup: what the model proposed (the verify step counts what the target kept)
        self.drafted_tokens = 0

    # ---- the Drafter protocol
    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        work = [c for c in (self._plan(inp) for inp in inputs) if c is not None]
        chains = self._draft(work) if work else {}
        for c in work:  # the draft's guesses leave its KV: only what the target keeps stays
            self._trim(self.sequences[c.rid], c.start + len(c.ids))
        self.drafted_tokens += sum(len(chain) for chain in chains.values())
        return [chains.get(inp.rid, []) for inp in inputs]

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Nothing to do here: the next propose sees the kept tokens in its inputs and catches up on them in
        the same extend that drafts its first token."""

    def release(self, rid: str) -> None:
        seq = self.sequences.pop(rid, None)
        if seq is not None:
            self._trim(seq, 0)
            self.runner.table.free(seq.table_idx)

    # ---- what a kind of draft feeds the model
    def _catch_up(self, seq: _Sequence, inp: DraftInput) -> tuple[list[int], torch.Tensor | None] | None:
        """Tokens from position seq.kept on (and their features), or None when this request cannot draft now."""
        if len(inp.token_ids) <= seq.kept:  # never expected; recompute the last token rather than fail
            self._trim(seq, len(inp.token_ids) - 1)
        return inp.token_ids[seq.kept :], None

    def _set_features(self, features: torch.Tensor | None) -> None:
        """Hand the next forward its features (a head reading hidden states); a plain draft model has none."""

    def _idle(self, inp: DraftInput) -> None:
        """The request takes no drafts at this step; a plain draft model catches up whenever it next drafts."""

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def _step_features(self) -> torch.Tensor | None:
        """The features of a draft decode step: a head's own last hidden state; none for a plain model."""
        return None

    # ---- the loop
    def _plan(self, inp: DraftInput) -> _CatchUp | None:
        if inp.num_draft <= 0:
            self._idle(inp)
            return None
        seq = self.sequences.get(inp.rid)
        if seq is None:
            idx = self.runner.table.alloc()
            if idx is None:
                return None
            self.runner.table.req_to_token[idx] = 0  # _trim frees what a row holds: none of a former owner's
            seq = self.sequences[inp.rid] = _Sequence(idx)
        caught = self._catch_up(seq, inp)
        if caught is None:
            return None
        ids, features = caught
        # the chain's last guess is never written to the KV: it needs no column of the table
        room = self.runner.table.max_context_len - (seq.kept - seq.base + len(ids)) + 1
        steps = min(inp.num_draft, self.num_steps, room)
        if steps <= 0 or not ids:
            return None
        return _CatchUp(inp.rid, ids, seq.kept, steps, features)

    def _feed_leading(self, c: _CatchUp) -> _CatchUp | None:
        """A long catch-up (a prompt the draft has not seen) fed in chunks, as the target's prefill is, all but
        the last; the rest, or None when the pool is short."""
        while len(c.ids) > CATCH_UP_CHUNK:
            features = None if c.features is None else c.features[:CATCH_UP_CHUNK]
            fb = self._extend_batch([_CatchUp(c.rid, c.ids[:CATCH_UP_CHUNK], c.start, 0, features)])
            if fb is None:
                return None
            self._set_features(features)
            self.runner.forward(fb)
            self.sequences[c.rid].kept = c.start + CATCH_UP_CHUNK
            rest = None if c.features is None else c.features[CATCH_UP_CHUNK:]
            c = _CatchUp(c.rid, c.ids[CATCH_UP_CHUNK:], c.start + CATCH_UP_CHUNK, c.steps, rest)
        return c

    def _draft(self, work: list[_CatchUp]) -> dict[str, list[int]]:
        work = [c for c in (self._feed_leading(c) for c in work) if c is not None]
        fb = self._extend_batch(work) if work else None
        if fb is None:
            return {}
        self._set_features(self._cat([c.features for c in work]))
        last = self._greedy(self.runner.forward(fb))
        chains = {c.rid: [t] for c, t in zip(work, last)}
        for c in work:
            self.sequences[c.rid].kept = c.start + len(c.ids)
        active = work
        for step in range(1, max(c.steps for c in work)):
            # the rows of the previous step whose chains go on
            rows = [i for i, c in enumerate(active) if c.steps > step]
            active = [active[i] for i in rows]
            fb = self._decode_batch(active, step, [chains[c.rid][-1] for c in active])
            if fb is None:
                break
            features = self._step_features()
            self._set_features(None if features is None else features[rows])
            for c, t in zip(active, self._greedy(self.runner.forward(fb))):
                chains[c.rid].append(t)
        return chains

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return self._to_target_ids(logits.argmax(dim=-1)).tolist()

    @staticmethod
    def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if any(p is None for p in parts) else torch.cat(parts)

    def _alloc(self, n: int) -> torch.Tensor | None:
        return self.runner.allocator.alloc(n)

    def _extend_batch(self, work: list[_CatchUp]) -> ForwardBatch | None:
        slots = self._alloc(sum(len(c.ids) for c in work))
        if slots is None:
            return None
        table, ids, positions, seq_slots, rows, offset = self.runner.table.req_to_token, [], [], [], [], 0
        columns = []
        for c in work:
            seq, n = self.sequences[c.rid], len(c.ids)
            column = c.start - seq.base
            table[seq.table_idx, column : column + n] = slots[offset : offset + n]
            ids.extend(c.ids)
            positions.append(torch.arange(c.start, c.start + n))
            seq_slots.append(table[seq.table_idx, : column + n])
            columns.append(column)
            offset += n
            rows.append(offset - 1)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            out_cache_loc=slots,
            logits_index=torch.tensor(rows, dtype=torch.int64),
            extend_lens=[len(c.ids) for c in work],
            prefix_lens=columns,
            seq_slots=seq_slots,
        )

    def _decode_batch(self, active: list[_CatchUp], step: int, last: list[int]) -> ForwardBatch | None:
        """Step `step` of the chain: each request's previous guess at position kept + step - 1."""
        slots = self._alloc(len(active))
        if slots is None:
            return None
        seqs = [self.sequences[c.rid] for c in active]
        idx = torch.tensor([seq.table_idx for seq in seqs], dtype=torch.int64)
        positions = torch.tensor([c.start + len(c.ids) + step - 1 for c in active], dtype=torch.int64)
        columns = positions - torch.tensor([seq.base for seq in seqs], dtype=torch.int64)
        table = self.runner.table.req_to_token
        table[idx, columns] = slots
        kv_table, mask = self.runner.table.decode_table(idx, columns + 1)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(last, dtype=torch.int64),
            positions=positions,
            out_cache_loc=slots,
            logits_index=torch.arange(len(active)),
            kv_table=kv_table,
            kv_mask=mask,
        )

    def _trim(self, seq: _Sequence, length: int) -> None:
        """Free the request's draft KV from position `length` on (its guesses, or everything on release)."""
        row = self.runner.table.req_to_token[seq.table_idx]
        first, used = (
            max(length - seq.base, 0),
            seq.kept - seq.base + self.num_steps,
        )  # the furthest a chain wrote
        slots = row[first:used]
        slots = slots[slots > 0]  # page 0 is never handed out: a zero is a column nothing was written to
        if slots.numel():
            self.runner.allocator.free(slots.clone())
        row[first:used] = 0
        seq.kept = max(min(seq.kept, length), seq.base)


class StandaloneDrafter(ChainDrafter):
    """STANDALONE: a complete smaller language model with the target's vocabulary."""


# ---------------------------------------------------------------------------------------------- startup checks
def vocabulary_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's token -> id table: two tokenizers that split text alike match."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


def check_same_vocabulary(target: tuple[str, int, object], draft: tuple[str, int, object]) -> None:
    """(path, vocab size, tokenizer) of each; DraftRefused, naming both, when the draft cannot propose the
    target's token ids."""
    (target_path, target_size, target_tok), (draft_path, draft_size, draft_tok) = target, draft
    if target_size != draft_size:
        raise DraftRefused(
            f"draft model {draft_path} has a vocabulary of {draft_size} tokens, the target {target_path} "
            f"{target_size}: --speculative-draft-model-path needs a draft with the target's vocabulary"
        )
    target_print, draft_print = vocabulary_fingerprint(target_tok), vocabulary_fingerprint(draft_tok)
    if target_print != draft_print:
        raise DraftRefused(
            f"draft model {draft_path}'s tokenizer (vocabulary {draft_print}) differs from the target "
            f"{target_path}'s (vocabulary {target_print}): --speculative-draft-model-path needs a draft with "
            "the target's tokenizer"
        )


def build_standalone_drafter(
    path: str, target: ModelRunner, target_tokenizer, sizes: PoolSizes, num_steps: int, prepack: bool = True
) -> StandaloneDrafter:
    """The draft model at `path` loaded in the target's dtypes on its own KV pool and request table (`sizes`);
    DraftRefused when its vocabulary or tokenizer is not the target's."""
    from kiln.loader.model_config import read_hf_config
    from kiln.text.tokenizer import load_tokenizer

    cfg = ModelConfig.from_hf_dict(path, read_hf_config(path))
    target_cfg = target.model_config
    check_same_vocabulary(
        (target_cfg.model_path, target_cfg.vocab_size, target_tokenizer),
        (path, cfg.vocab_size, load_tokenizer(path)),
    )
    runner = ModelRunner(cfg, target.dtype, target.kv_dtype, target.device)
    logger.info(f"Draft model {path}:")
    runner.load(max(sizes.context_len, cfg.max_position_embeddings) + 8, prepack=prepack)
    runner.init_memory_pool(draft_pool_sizes(sizes, num_steps))
    return StandaloneDrafter(runner, num_steps)


def draft_pool_sizes(target: PoolSizes, num_steps: int) -> PoolSizes:
    """The draft's pool: the target's token count (the ledger counts the draft's bytes per token into the pool),
    never more than its running requests reach with their guesses; pages of one token, as its rows are trimmed
    to the token. A draft that finds its pool short proposes nothing for that step."""
    running, context = target.max_running_requests, target.context_len
    tokens = min(target.max_total_num_tokens, running * (context + num_steps))
    return PoolSizes(tokens, running, context + num_steps, 1)


def capture_draft_graphs(
    drafter: ChainDrafter, batch_sizes: list[int], kv_width: int, cache_dir: str | None, on_progress=None
) -> bool:
    """The draft model's decode steps captured at the target's batch sizes (CUDA graphs, or compiled on the CPU),
    as the target's are; False when this draft runs eagerly (an EAGLE head, whose features are an input the
    captured step does not take)."""
    if not batch_sizes or not isinstance(drafter, StandaloneDrafter):
        return False
    from kiln.runner.graph_runner import GraphRunner

    runner = drafter.runner
    graphs = GraphRunner(
        runner.model, runner.device, batch_sizes, None, kv_width, cache_dir, attn_backend=runner.attn_backend,
        role="draft",
    )  # fmt: skip
    graphs.capture(on_progress)
    runner.graphs = graphs
    runner.measured["graph_capture"] = graphs.capture_bytes
    return True
