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


def verify(chain: Chain) -> Verdict:
    """The tokens the target keeps from one request's chain (greedy or sampled by the request's params)."""
    if chain.rows[0].params.is_greedy:
        return verify_greedy(chain)
    return verify_sampled(chain)


def verify_batch(chains: list[Chain]) -> list[Verdict]:
    """Every chain's verdict, in order."""
    plain = _verify_plain_greedy(chains)
    return plain if plain is not None else [verify(chain) for chain in chains]


def _verify_plain_greedy(chains: list[Chain]) -> list[Verdict] | None:
    """Every chain greedy with no logit processing and no logprobs (the common case): one argmax over all
    rows at once instead of one per chain; None when some chain needs more."""
    if not chains or any(not is_plain_greedy(row) for chain in chains for row in chain.rows):
        return None
    chosen = argmax_ids(torch.cat([chain.logits for chain in chains]))
    verdicts, start = [], 0
    for chain in chains:
        mine = chosen[start : start + len(chain.rows)]
        start += len(chain.rows)
        n = _accepted_prefix(mine, chain.draft)
        verdicts.append(Verdict(mine[: n + 1], n, [None] * (n + 1), [None] * (n + 1)))
    return verdicts
