"""STANDALONE speculative decoding: a smaller model with the target's tokenizer drafts a chain of tokens.

The draft has its own ModelRunner (weights, KV pool, request table) sized for the target's running requests at
its context. Each verify step it catches up on the tokens the target kept since the last one in one forward, an
extend (whose last row gives the first draft token), then decodes greedily for the rest of the chain. The KV of
the draft's own guesses is dropped right after proposing: the catch-up of the next step recomputes the accepted
ones, so the draft's KV only ever holds tokens the target kept and a rejected guess costs nothing to undo.

`ChainDrafter` is that loop for any draft model; the EAGLE heads (eagle.py) feed it features as well as tokens,
and once their catch-ups are captured (`CatchUpShapes`) run those the captured shapes hold as decode rows, one a
token, each row's logits wanted at its request's last token only.
With --speculative-eagle-topk above 1 it grows a tree instead, as SGLang's EAGLE worker does (`_Branches`,
`select_tree`): every draft step expands the `topk` best branches so far by their `topk` likeliest children, each
branch attending to the kept KV and its own path's draft KV only.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace

import torch

from kiln.core.forward_batch import ForwardBatch, ForwardMode
from kiln.loader.model_config import DRAFT_MODEL_FLAG
from kiln.runner.model_runner import ModelRunner, PoolSizes
from kiln.speculative.base import DraftInput, DraftTree

logger = logging.getLogger("kiln")


# tokens of one catch-up at most: a prompt the draft has not seen goes in chunks, as the target's prefill
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
class CatchUpShapes:
    """What a head's captured catch-ups hold (capture_draft_graphs): `tokens` tokens a request (num_steps + 1),
    `requests` requests (the largest captured shape's), KV columns up to `columns` (the CUDA graphs' static
    width; None: any). Catch-ups they hold run as decode rows; others as an extend, which reads each request's
    KV once where decode rows read it once a token."""

    tokens: int
    requests: int
    columns: int | None = None

    def hold(self, work: list[_CatchUp], sequences: dict[str, _Sequence]) -> bool:
        if len(work) > self.requests or any(len(c.ids) > self.tokens for c in work):
            return False
        last = max(c.start - sequences[c.rid].base + len(c.ids) for c in work)
        return self.columns is None or last <= self.columns


@dataclass(frozen=True)
class _CatchUp:
    """What one request feeds the draft before drafting: tokens (and features) from position `start`."""

    rid: str
    ids: list[int]
    start: int
    steps: int
    features: torch.Tensor | None = None


def top_candidates(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` highest scores, best first; a tie goes to the earlier index, which in SGLang's
    flat order is never a descendant of the later one, so a chosen node's parent is always chosen too."""
    return torch.sort(scores, descending=True, stable=True).indices[:count]


def select_tree(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> DraftTree:
    """SGLang's organize_draft_results for one request: of every candidate (flat order: the root's top k, then
    k x k per later step; `parents` holds each one's parent's flat index, -1 for the root), the `num_nodes` best
    scored, kept in flat order so that parents come first and siblings keep their likeliest-first order. A
    child's score is its parent's times a probability, never more: the set holds every chosen node's ancestors."""
    chosen = torch.sort(top_candidates(scores, num_nodes)).values.tolist()
    where = {flat: node for node, flat in enumerate(chosen)}
    token_ids, parent_ids = tokens.tolist(), parents.tolist()
    return DraftTree(
        tuple(token_ids[flat] for flat in chosen),
        tuple(-1 if parent_ids[flat] < 0 else where[parent_ids[flat]] for flat in chosen),
    )


@dataclass
class _Branches:
    """One request's tree while it grows, as SGLang's draft_forward for topk > 1 keeps it: every candidate so far
    in SGLang's flat order with its cumulative score (the product of the draft's probabilities down its path),
    token and parent; the `topk` live branches the next step expands, the draft KV slots of the path each has
    been forwarded along, and the rows of the last forward whose hidden states are their features."""

    work: _CatchUp
    scores: list[torch.Tensor]
    tokens: list[torch.Tensor]
    parents: list[torch.Tensor]
    live: torch.Tensor  # flat indices of the live branches
    live_scores: torch.Tensor
    live_tokens: torch.Tensor
    paths: torch.Tensor  # [topk, steps so far - 1] draft KV slots, on the KV pool's device
    rows: torch.Tensor
    size: int

    @classmethod
    def first(
        cls, work: _CatchUp, probs: torch.Tensor, tokens: torch.Tensor, row: int, device: torch.device
    ) -> _Branches:
        """The root's `topk` likeliest children (SGLang's first select_top_k_tokens), all live."""
        k = probs.numel()
        return cls(
            work, [probs], [tokens], [torch.full((k,), -1, dtype=torch.int64)], torch.arange(k), probs, tokens,
            torch.empty((k, 0), dtype=torch.int64, device=device), torch.full((k,), row, dtype=torch.int64), k,
        )  # fmt: skip

    def expand(self, probs: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor, first_row: int) -> None:
        """One step: each live branch's `topk` likeliest children ([topk, topk] `probs` and `tokens`, the live
        branches forwarded along `paths` at rows `first_row`..) become candidates; the best `topk` of them live on."""
        k = probs.shape[0]
        above = self.live_scores.unsqueeze(1)
        scores = torch.minimum(above * probs, above).flatten()  # rounding never lifts a child over its parent
        self.scores.append(scores)
        self.tokens.append(tokens.flatten())
        self.parents.append(self.live.repeat_interleave(k))
        pick = top_candidates(scores, k)
        self.live, self.size = self.size + pick, self.size + scores.numel()
        self.live_scores, self.live_tokens = scores[pick], tokens.flatten()[pick]
        parent_rows = pick // k
        self.paths = paths[parent_rows.to(paths.device)]
        self.rows = first_row + parent_rows

    def tree(self, num_nodes: int | None) -> DraftTree:
        scores = torch.cat(self.scores)
        count = scores.numel() if num_nodes is None else num_nodes
        return select_tree(scores, torch.cat(self.tokens), torch.cat(self.parents), count)


class ChainDrafter:
    """Drives a draft model greedily: a chain of up to `num_steps` tokens per request (topk 1), or with `topk`
    above 1 a tree of `num_steps` levels and at most `num_nodes` nodes (None: every candidate)."""

    def __init__(self, runner: ModelRunner, num_steps: int, topk: int = 1, num_nodes: int | None = None):
        self.runner = runner
        self.num_steps = num_steps
        self.topk = topk
        self.num_nodes = num_nodes
        self.sequences: dict[str, _Sequence] = {}
        # since startup: what the model proposed (the verify step counts what the target kept)
        self.drafted_tokens = 0
        # a head whose catch-ups are captured (capture_draft_graphs): those they hold run as decode rows, the
        # captured shapes; None: every catch-up runs as an extend
        self.catch_up_shapes: CatchUpShapes | None = None

    # ---- the Drafter protocol
    def propose(self, inputs: list[DraftInput]) -> list[list[int] | DraftTree]:
        work = [c for c in (self._plan(inp) for inp in inputs) if c is not None]
        draft = self._draft if self.topk == 1 else self._draft_trees
        drafts: dict[str, list[int] | DraftTree] = draft(work) if work else {}
        for c in work:  # the draft's guesses leave its KV: only what the target keeps stays
            self._trim(self.sequences[c.rid], c.start + len(c.ids))
        self.drafted_tokens += sum(len(d) for d in drafts.values())
        return [drafts.get(inp.rid, []) for inp in inputs]

    def accepted(self, rid: str, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Nothing to do here: the next propose sees the kept tokens in its inputs and catches up on them in
        the same forward that drafts its first token."""

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
            fb = self._catch_up_batch([_CatchUp(c.rid, c.ids[:CATCH_UP_CHUNK], c.start, 0, features)])
            if fb is None:
                return None
            self._set_features(features)
            self.runner.forward(fb)
            self.sequences[c.rid].kept = c.start + CATCH_UP_CHUNK
            rest = None if c.features is None else c.features[CATCH_UP_CHUNK:]
            c = replace(c, ids=c.ids[CATCH_UP_CHUNK:], start=c.start + CATCH_UP_CHUNK, features=rest)
        return c

    def _draft(self, work: list[_CatchUp]) -> dict[str, list[int]]:
        work = [c for c in (self._feed_leading(c) for c in work) if c is not None]
        fb = self._catch_up_batch(work) if work else None
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

    def _draft_trees(self, work: list[_CatchUp]) -> dict[str, DraftTree]:
        """topk > 1: the catch-up gives each request's first `topk` branches; each later step forwards
        every live branch (one decode row each, on a draft KV slot of its own) and keeps the best `topk` of their
        children. Every guess slot is freed at the end: the next catch-up recomputes what the target kept."""
        work = [c for c in (self._feed_leading(c) for c in work) if c is not None]
        fb = self._catch_up_batch(work) if work else None
        if fb is None:
            return {}
        self._set_features(self._cat([c.features for c in work]))
        probs, tokens = self._top(self.runner.forward(fb))
        for c in work:
            self.sequences[c.rid].kept = c.start + len(c.ids)
        device = self.runner.allocator.device
        trees = [_Branches.first(c, probs[i], tokens[i], i, device) for i, c in enumerate(work)]
        guesses: list[torch.Tensor] = []
        try:
            for step in range(1, max(c.steps for c in work)):
                if not self._grow([b for b in trees if b.work.steps > step], step, guesses):
                    break
        finally:
            for slots in guesses:
                self.runner.allocator.free(slots)
        return {b.work.rid: b.tree(self.num_nodes) for b in trees}

    def _grow(self, active: list[_Branches], step: int, guesses: list[torch.Tensor]) -> bool:
        """Forward the live branches of `active` one step and expand them; False when the pool is short."""
        features = self._step_features()  # the last forward's rows, read before this one replaces them
        batch = self._tree_batch(active, step)
        if batch is None:
            return False
        fb, paths = batch
        guesses.append(fb.out_cache_loc)
        rows = torch.cat([b.rows for b in active])
        self._set_features(None if features is None else features[rows.to(features.device)])
        probs, tokens = self._top(self.runner.forward(fb))
        k = self.topk
        for i, b in enumerate(active):
            b.expand(probs[i * k : (i + 1) * k], tokens[i * k : (i + 1) * k], paths[i], i * k)
        return True

    def _tree_batch(
        self, active: list[_Branches], step: int
    ) -> tuple[ForwardBatch, list[torch.Tensor]] | None:
        """Step `step` of the trees: each live branch's token at position kept + step - 1, attending to the
        request's kept columns and its own path (its ancestors' slots and its own); with each tree's new paths."""
        k = self.topk
        slots = self._alloc(len(active) * k)
        if slots is None:
            return None
        paths = [
            torch.cat((b.paths, slots[i * k : (i + 1) * k].unsqueeze(1)), dim=1) for i, b in enumerate(active)
        ]
        seqs = [self.sequences[b.work.rid] for b in active]
        rows = torch.tensor([seq.table_idx for seq in seqs], dtype=torch.int64).repeat_interleave(k)
        columns = torch.tensor([seq.kept - seq.base for seq in seqs], dtype=torch.int64).repeat_interleave(k)
        kv_table, mask = self.runner.table.branch_table(rows, columns, torch.cat(paths))
        positions = [b.work.start + len(b.work.ids) + step - 1 for b in active]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.cat([b.live_tokens for b in active]),
            positions=torch.tensor(positions, dtype=torch.int64).repeat_interleave(k),
            out_cache_loc=slots,
            logits_index=torch.arange(len(active) * k),
            kv_table=kv_table,
            kv_mask=mask,
        )
        return fb, paths

    def _top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `topk` likeliest tokens (target ids) and their probabilities, as SGLang's draft step takes
        them from the softmax of the draft's logits."""
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(self.topk, dim=-1)
        return probs.cpu(), self._to_target_ids(ids).cpu()

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return self._to_target_ids(logits.argmax(dim=-1)).tolist()

    @staticmethod
    def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if any(p is None for p in parts) else torch.cat(parts)

    def _alloc(self, n: int) -> torch.Tensor | None:
        return self.runner.allocator.alloc(n)

    def _catch_up_slots(self, work: list[_CatchUp]) -> torch.Tensor | None:
        """The KV slots of the tokens a catch-up feeds, in order; None when the pool is short."""
        return self._alloc(sum(len(c.ids) for c in work))

    def _free(self, slots: torch.Tensor) -> None:
        """Give back slots of a sequence's table row (trimmed guesses, or everything on release)."""
        self.runner.allocator.free(slots)

    def _catch_up_batch(self, work: list[_CatchUp]) -> ForwardBatch | None:
        """The catch-ups as one batch whose logits rows are each request's last token: decode rows when the
        captured catch-up shapes hold them, else an extend; None when the pool is short."""
        placed = self._place(work)
        if placed is None:
            return None
        slots, columns = placed
        lens = torch.tensor([len(c.ids) for c in work], dtype=torch.int64)
        ids = torch.tensor([t for c in work for t in c.ids], dtype=torch.int64)
        common = {"input_ids": ids, "out_cache_loc": slots, "logits_index": lens.cumsum(0) - 1}
        if self.catch_up_shapes is not None and self.catch_up_shapes.hold(work, self.sequences):
            return self._as_decode_rows(work, columns, lens, common)
        table = self.runner.table.req_to_token
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            positions=torch.cat([torch.arange(c.start, c.start + len(c.ids)) for c in work]),
            extend_lens=lens.tolist(),
            prefix_lens=columns,
            seq_slots=[
                table[self.sequences[c.rid].table_idx, : col + len(c.ids)] for c, col in zip(work, columns)
            ],
            **common,
        )

    def _place(self, work: list[_CatchUp]) -> tuple[torch.Tensor, list[int]] | None:
        """Write the catch-ups' KV slots into their table rows: the slots in order and each request's first
        column; None when the pool is short."""
        slots = self._catch_up_slots(work)
        if slots is None:
            return None
        table, columns, offset = self.runner.table.req_to_token, [], 0
        for c in work:
            seq, n = self.sequences[c.rid], len(c.ids)
            column = c.start - seq.base
            table[seq.table_idx, column : column + n] = slots[offset : offset + n]
            columns.append(column)
            offset += n
        return slots, columns

    def _as_decode_rows(
        self, work: list[_CatchUp], columns: list[int], lens: torch.Tensor, common: dict
    ) -> ForwardBatch:
        """The catch-ups as decode rows, one a token, as the target's verify rows are: row j of a request attends
        to its columns up to its own (SGLang's draft extend after a verify, which a graph can hold)."""
        idx = torch.tensor([self.sequences[c.rid].table_idx for c in work], dtype=torch.int64)
        offsets = torch.cat([torch.arange(len(c.ids)) for c in work])  # each token's place in its catch-up
        starts = torch.tensor([c.start for c in work], dtype=torch.int64).repeat_interleave(lens)
        seq_lens = torch.tensor(columns, dtype=torch.int64).repeat_interleave(lens) + offsets + 1
        kv_table, mask = self.runner.table.decode_table(idx.repeat_interleave(lens), seq_lens)
        return ForwardBatch(
            mode=ForwardMode.DECODE, positions=starts + offsets, kv_table=kv_table, kv_mask=mask, **common
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
            self._free(slots.clone())
        row[first:used] = 0
        seq.kept = max(min(seq.kept, length), seq.base)


class StandaloneDrafter(ChainDrafter):
    """STANDALONE: a complete smaller language model with the target's vocabulary."""


# ---------------------------------------------------------------------------------------------- startup checks
def vocabulary_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's token -> id table: two tokenizers that split text alike match."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


def check_same_vocab_size(target_path: str, target_size: int, draft_path: str, draft_size: int) -> None:
    """DraftRefused, naming both, when the draft's vocabulary size is not the target's (from the configs alone:
    `kiln plan` asks too)."""
    if target_size != draft_size:
        raise DraftRefused(
            f"draft model {draft_path} has a vocabulary of {draft_size} tokens, the target {target_path} "
            f"{target_size}: {DRAFT_MODEL_FLAG} needs a draft with the target's vocabulary"
        )


def check_same_vocabulary(target: tuple[str, int, object], draft: tuple[str, int, object]) -> None:
    """(path, vocab size, tokenizer) of each; DraftRefused, naming both, when the draft cannot propose the
    target's token ids."""
    (target_path, target_size, target_tok), (draft_path, draft_size, draft_tok) = target, draft
    check_same_vocab_size(target_path, target_size, draft_path, draft_size)
    target_print, draft_print = vocabulary_fingerprint(target_tok), vocabulary_fingerprint(draft_tok)
    if target_print != draft_print:
        raise DraftRefused(
            f"draft model {draft_path}'s tokenizer (vocabulary {draft_print}) differs from the target "
            f"{target_path}'s (vocabulary {target_print}): --speculative-draft-model-path needs a draft with "
            "the target's tokenizer"
        )


def build_standalone_drafter(
    path: str,
    target: ModelRunner,
    target_tokenizer,
    sizes: PoolSizes,
    num_steps: int,
    prepack: bool = True,
    topk: int = 1,
    num_nodes: int | None = None,
) -> StandaloneDrafter:
    """The draft model at `path` loaded in the target's dtypes on its own KV pool and request table (`sizes`),
    drafting chains (topk 1) or trees; DraftRefused when its vocabulary or tokenizer is not the target's."""
    from kiln.loader.model_config import load_model_config
    from kiln.text.tokenizer import load_tokenizer

    cfg = load_model_config(path, flag=DRAFT_MODEL_FLAG)
    target_cfg = target.model_config
    check_same_vocabulary(
        (target_cfg.model_path, target_cfg.vocab_size, target_tokenizer),
        (path, cfg.vocab_size, load_tokenizer(path)),
    )
    runner = ModelRunner(cfg, target.dtype, target.kv_dtype, target.device, target.attention_backend)
    logger.info(f"Draft model {path}:")
    runner.load(max(sizes.context_len, cfg.max_position_embeddings) + 8, prepack=prepack)
    runner.init_memory_pool(draft_pool_sizes(sizes, num_steps, topk))
    return StandaloneDrafter(runner, num_steps, topk, num_nodes)


def draft_pool_sizes(target: PoolSizes, num_steps: int, topk: int = 1) -> PoolSizes:
    """The draft's pool: the target's token count (the ledger counts the draft's bytes per token into the pool),
    never more than its running requests reach with their guesses (`topk` branches a step for a tree); pages of
    one token, as its rows are trimmed to the token. A draft that finds its pool short proposes nothing for that
    step, or a smaller tree."""
    running, context = target.max_running_requests, target.context_len
    tokens = min(target.max_total_num_tokens, running * (context + topk * num_steps))
    return PoolSizes(tokens, running, context + num_steps, 1)


def capture_draft_graphs(
    drafter: ChainDrafter,
    batch_sizes: list[int],
    kv_width: int,
    cache_dir: str | None,
    on_progress=None,
    extend_tokens: list[int] | None = None,
) -> bool:
    """The draft's decode steps captured at the target's batch sizes (CUDA graphs, or compiled on the CPU), as the
    target's are: a draft model's, or an EAGLE / EAGLE-3 / NEXTN head's with its features as a static input (as
    SGLang's EAGLE draft graphs take them), topk rows per request when it drafts trees (SGLang's draft decode
    graph's num_tokens_per_req); False when there is nothing to capture. A draft model's catch-up
    extends also run on the prefill pieces at `extend_tokens` token counts. A head's layers do not split into
    those pieces: its catch-ups after a verify (at most num_steps + 1 tokens a request) run as decode rows,
    captured at each batch size x num_steps + 1 rows with the target's hidden states as their features."""
    if not batch_sizes or not isinstance(drafter, ChainDrafter):
        return False
    from kiln.runner.graph_backends import takes_features
    from kiln.runner.graph_runner import GraphRunner

    runner = drafter.runner
    extend = extend_tokens if isinstance(drafter, StandaloneDrafter) else None
    catch_up = drafter.num_steps + 1 if takes_features(runner.model) else 0
    graphs = GraphRunner(
        runner.model, runner.device, batch_sizes, extend, kv_width, cache_dir, attn_backend=runner.attn_backend,
        role="draft", decode_tokens_per_req=drafter.topk,  # a tree's steps run topk rows per request
        catch_up_tokens_per_req=catch_up,
    )  # fmt: skip
    graphs.capture(on_progress)
    runner.graphs = graphs
    if graphs.captured("extend"):
        largest, width = max(graphs.captured("extend")), graphs.phases["extend"].backend.kv_width
        drafter.catch_up_shapes = CatchUpShapes(catch_up, largest // catch_up, width)
    runner.measured["graph_capture"] = graphs.capture_bytes
    return True
