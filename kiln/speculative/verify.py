"""Which draft tokens the target keeps.

The target ran once over each request's last token and its chain of drafts, so row j of a request's logits is
the target's prediction after the drafts d1..dj. Row j is processed as plain decoding would process it with
d1..dj already in the output (penalties, min_new_tokens bans, logit_bias), so an accepted prefix gives exactly
the tokens plain decoding gives:

- greedy rows accept a draft while it equals the argmax; the first mismatch's argmax (or, with every draft
  accepted, the last row's) is the bonus token;
- sampled rows use speculative sampling, which keeps the target distribution p: accept draft x with probability
  min(1, p(x) / q(x)), q the drafter's distribution (a point mass on x for a drafter that proposes without
  one, such as NGRAM); on rejection draw from max(p - q, 0) normalised; with every draft accepted draw the
  bonus from the last row's p. p is the sampler's own distribution (kiln.runner.sampler.target_probs).

A tree of drafts (topk > 1) has one row per node, the target's prediction after that node's path; from the root
down, at each node reached:

- greedy: descend into the child holding the row's argmax; where no child does, that argmax is the bonus;
- sampled (SGLang's target-only tree rule): try the children in order, accepting child c with probability
  p'(c), p' the row's p with the siblings already rejected zeroed and renormalised; with all of them rejected,
  draw from that p'; at a leaf draw from p. Each try is speculative sampling of a point-mass proposal against
  what is left of p, so the token emitted at every node is distributed as p exactly, whatever the drafter's own
  distribution was; a drafter's q is not used for trees (the multi-draft rules that use it need proposals
  drawn independently from q, which top-k branches are not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.runner.sampler import (
    SamplingRow,
    argmax_ids,
    is_plain_greedy,
    logprobs_of,
    sample,
    target_probs,
)
from kiln.speculative.base import DraftTree


@dataclass(frozen=True)
class Verdict:
    """The tokens one request gains from a verify step: its accepted drafts, then the target's own token."""

    tokens: list[int]
    accepted: int  # how many drafts were accepted (len(tokens) - 1)
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(frozen=True)
class Chain:
    """One request's verify input: its logits rows (len(draft) + 1), the sampling row of each (row j as if
    d1..dj were output), its drafts and, when the drafter has one, their distribution [len(draft), V]."""

    logits: torch.Tensor
    rows: list[SamplingRow]
    draft: list[int]
    draft_probs: torch.Tensor | None = None


def _accepted_prefix(chosen: Sequence[int], draft: Sequence[int]) -> int:
    n = 0
    while n < len(draft) and chosen[n] == draft[n]:
        n += 1
    return n


def verify_greedy(chain: Chain) -> Verdict:
    """Greedy acceptance: the target's choice at every row, kept while it agrees with the draft."""
    result = sample(chain.logits, chain.rows)
    n = _accepted_prefix(result.next_token_ids, chain.draft)
    keep = n + 1
    return Verdict(result.next_token_ids[:keep], n, result.logprobs[:keep], result.top_logprobs[:keep])


def _uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        return float(torch.rand(()))
    return float(torch.rand((), generator=generator, device=generator.device))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id from a distribution [V] (nonnegative, not necessarily normalised)."""
    cdf = probs.double().cumsum(0)
    target = _uniform(generator) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)[0])
    index = min(index, probs.shape[0] - 1)
    while float(probs[index]) <= 0.0 and index > 0:  # never a token of zero probability (rounding at the top)
        index -= 1
    return index


def speculative_tokens(
    probs: torch.Tensor,
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling over target probabilities probs [len(draft) + 1, V]: the tokens kept (accepted
    drafts then one drawn token) and how many drafts were accepted."""
    tokens: list[int] = []
    for j, x in enumerate(draft):
        p = probs[j]
        q = draft_probs[j] if draft_probs is not None else None
        q_x = float(q[x]) if q is not None else 1.0
        p_x = float(p[x])
        if q_x > 0.0 and _uniform(generator) < min(1.0, p_x / q_x):
            tokens.append(x)
            continue
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p is all on x (or equals q): the residual is empty, draw from p
            residual = p
        tokens.append(_draw(residual, generator))
        return tokens, j
    tokens.append(_draw(probs[len(draft)], generator))
    return tokens, len(draft)


def verify_sampled(chain: Chain) -> Verdict:
    """Speculative sampling against the sampler's distribution at every row."""
    probs = target_probs(chain.logits, chain.rows)
    generator = chain.rows[0].generator
    tokens, accepted = speculative_tokens(probs, chain.draft, chain.draft_probs, generator)
    rows = chain.rows[: len(tokens)]
    lp = logprobs_of(chain.logits[: len(tokens)], rows, tokens)
    return Verdict(tokens, accepted, lp.logprobs, lp.top_logprobs)


@dataclass(frozen=True)
class Tree:
    """One request's verify input as a tree: its logits rows (the root's first, then node i's at row i + 1), the
    sampling row of each (node i's as if its path were output) and the tree."""

    logits: torch.Tensor
    rows: list[SamplingRow]
    tree: DraftTree


def _children(tree: DraftTree) -> dict[int, list[int]]:
    """Each node's children in order (-1: the root's), computed once per verdict."""
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(node)
    return kids


def greedy_path(chosen: Sequence[int], tree: DraftTree) -> list[int]:
    """The nodes greedy acceptance walks: from the root, into the child holding the current row's choice
    (`chosen[0]` the root's, `chosen[i + 1]` node i's), until no child holds it."""
    kids, path, node = _children(tree), [], -1
    while True:
        token = chosen[node + 1]
        child = next((c for c in kids.get(node, ()) if tree.tokens[c] == token), None)
        if child is None:
            return path
        path.append(child)
        node = child


def _path_rows(path: list[int]) -> list[int]:
    """The logits rows that chose a verdict's tokens: the root's, then each accepted node's."""
    return [0] + [node + 1 for node in path]


def verify_tree_greedy(tree: Tree) -> Verdict:
    """Greedy acceptance down the tree, with the sampler's processing of every row."""
    result = sample(tree.logits, tree.rows)
    rows = _path_rows(greedy_path(result.next_token_ids, tree.tree))
    return Verdict(
        [result.next_token_ids[i] for i in rows],
        len(rows) - 1,
        [result.logprobs[i] for i in rows],
        [result.top_logprobs[i] for i in rows],
    )


def tree_tokens(
    probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """SGLang's target-only tree rule over target probabilities probs [len(tree) + 1, V] (see the module
    docstring): the tokens kept (the accepted path's then one drawn token) and the accepted nodes. On a chain
    it draws exactly what speculative_tokens draws for a point-mass chain."""
    kids = _children(tree)
    tokens: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        p = probs[node + 1]
        residual, rejected_mass = p, 0.0
        for child in kids.get(node, ()):
            x = tree.tokens[child]
            left = 1.0 - rejected_mass
            p_x = float(residual[x]) / left if left > 0.0 else 0.0
            if _uniform(generator) < min(1.0, p_x):
                break
            rejected_mass += float(residual[x])
            residual = residual.clone()
            residual[x] = 0.0
        else:
            if float(residual.sum()) <= 0.0:  # p is all on rejected tokens (rounding): draw from p
                residual = p
            tokens.append(_draw(residual, generator))
            return tokens, path
        tokens.append(x)
        path.append(child)
        node = child


def verify_tree_sampled(tree: Tree) -> Verdict:
    """The target-only tree rule against the sampler's distribution at every row."""
    probs = target_probs(tree.logits, tree.rows)
    tokens, path = tree_tokens(probs, tree.tree, tree.rows[0].generator)
    rows = _path_rows(path)
    lp = logprobs_of(tree.logits[rows], [tree.rows[i] for i in rows], tokens)
    return Verdict(tokens, len(path), lp.logprobs, lp.top_logprobs)


def verify(item: Chain | Tree) -> Verdict:
    """The tokens the target keeps from one request's drafts (greedy or sampled by the request's params)."""
    greedy = item.rows[0].params.is_greedy
    if isinstance(item, Tree):
        return verify_tree_greedy(item) if greedy else verify_tree_sampled(item)
    return verify_greedy(item) if greedy else verify_sampled(item)


def verify_batch(items: list[Chain | Tree]) -> list[Verdict]:
    """Every request's verdict, in order."""
    plain = _verify_plain_greedy(items)
    return plain if plain is not None else [verify(item) for item in items]


def _verify_plain_greedy(items: list[Chain | Tree]) -> list[Verdict] | None:
    """Every request greedy with no logit processing and no logprobs (the common case): one argmax over all
    rows at once instead of one per request; None when some request needs more."""
    if not items or any(not is_plain_greedy(row) for item in items for row in item.rows):
        return None
    chosen = argmax_ids(torch.cat([item.logits for item in items]))
    verdicts, start = [], 0
    for item in items:
        mine = chosen[start : start + len(item.rows)]
        start += len(item.rows)
        if isinstance(item, Tree):
            tokens = [mine[i] for i in _path_rows(greedy_path(mine, item.tree))]
        else:
            tokens = mine[: _accepted_prefix(mine, item.draft) + 1]
        n = len(tokens)
        verdicts.append(Verdict(tokens, n - 1, [None] * n, [None] * n))
    return verdicts
