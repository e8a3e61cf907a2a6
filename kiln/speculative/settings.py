"""--speculative-* resolved as SGLang resolves them, and refused where Kiln cannot run them.

Auto defaults (no --speculative-num-steps): SGLang's (steps, topk, num_draft_tokens) by algorithm and architecture,
(5, 4, 8) for Llama and Grok and (3, 1, 4) for the rest and STANDALONE; a drafter that proposes chains only takes
SGLang's steps with topk 1 and steps + 1 draft tokens. NGRAM: 12 draft tokens unless given and a breadth-first tree
of earlier matches whose widest breadth is --speculative-eagle-topk (SGLang's BFS trie; its default breadth 10,
SGLang's --speculative-ngram-max-bfs-breadth), with SGLang's steps = num_draft_tokens // topk; topk 1 drafts a
chain of num_draft_tokens - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.config import ServerArgs
from kiln.core.graph_shapes import head_guess_tokens
from kiln.memory.ledger_types import LedgerInputs

NEEDS_DRAFT_PATH = ("STANDALONE", "EAGLE", "EAGLE3")
NGRAM_DRAFT_TOKENS = 12  # SGLang's default --speculative-num-draft-tokens for NGRAM
NGRAM_BREADTH = 10  # SGLang's default --speculative-ngram-max-bfs-breadth, which it takes as NGRAM's topk
WIDE_AUTO_ARCHITECTURES = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
# the algorithms whose drafter proposes trees (topk > 1); the others draft a chain
TREE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True)
class SpecSettings:
    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int  # verified per request per step, the last token included

    @property
    def num_draft(self) -> int:
        """Draft tokens per request per verify."""
        return self.num_draft_tokens - 1

    @property
    def draft_steps(self) -> int:
        """Steps a draft model or head runs per verify: a chain drafts one token a step up to the verify's width;
        a tree grows --speculative-num-steps levels and keeps its best num_draft nodes (SGLang's EAGLE tree)."""
        return self.num_draft if self.topk == 1 else self.num_steps


def auto_params(algorithm: str, architecture: str) -> tuple[int, int, int]:
    """SGLang's auto (steps, topk, num_draft_tokens), or its steps with a chain where Kiln drafts no tree."""
    steps, topk, tokens = (3, 1, 4)
    if algorithm != "STANDALONE" and architecture in WIDE_AUTO_ARCHITECTURES:
        steps, topk, tokens = (5, 4, 8)
    if algorithm not in TREE_ALGORITHMS:
        return steps, 1, steps + 1
    return steps, topk, tokens


def max_draft_tokens(steps: int, topk: int) -> int:
    """The most tokens `steps` draft steps of `topk` branches can offer a verify, the root included."""
    return 1 + topk + (steps - 1) * topk * topk


def _ngram_params(args: ServerArgs) -> tuple[int, int, int]:
    topk = args.speculative_eagle_topk if args.speculative_eagle_topk is not None else NGRAM_BREADTH
    tokens = args.speculative_num_draft_tokens
    tokens = tokens if tokens is not None else NGRAM_DRAFT_TOKENS
    steps = args.speculative_num_steps
    if steps is None:
        steps = tokens - 1 if topk == 1 else max(1, tokens // topk)
    return steps, topk, tokens


def _draft_params(args: ServerArgs, algorithm: str, architecture: str) -> tuple[int, int, int]:
    steps, topk, tokens = (
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )
    if steps is None:
        auto_steps, auto_topk, auto_tokens = auto_params(algorithm, architecture)
        topk = topk if topk is not None else auto_topk
        fallback = auto_tokens if topk == auto_topk else auto_steps + 1
        return auto_steps, topk, tokens if tokens is not None else fallback
    topk = topk if topk is not None else 1
    return steps, topk, tokens if tokens is not None else steps + 1


def resolve(args: ServerArgs, architecture: str) -> SpecSettings | None:
    """The settings serve runs, or None without speculative decoding. Raises ValueError naming the flag."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm in NEEDS_DRAFT_PATH and not args.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    if args.speculative_eagle_topk is not None and args.speculative_eagle_topk < 1:
        raise ValueError(f"--speculative-eagle-topk {args.speculative_eagle_topk} must be >= 1")
    if algorithm == "NGRAM":
        steps, topk, tokens = _ngram_params(args)
    else:
        steps, topk, tokens = _draft_params(args, algorithm, architecture)
    if topk > 1 and algorithm not in TREE_ALGORITHMS:
        raise ValueError(
            f"--speculative-eagle-topk {topk}: Kiln's {algorithm} drafter proposes a chain (trees are drafted by "
            f"{', '.join(TREE_ALGORITHMS)}), so the supported value is 1"
        )
    if steps < 1:
        raise ValueError(f"--speculative-num-steps {steps} must be >= 1")
    if algorithm == "NGRAM" and topk > 1:  # trees of earlier matches, not of draft steps: no upper bound
        if tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens {tokens} must be >= 2")
        return SpecSettings(algorithm, steps, topk, tokens)
    top = max_draft_tokens(steps, topk)
    if not 2 <= tokens <= top:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} cannot be produced by --speculative-num-steps {steps} and "
            f"--speculative-eagle-topk {topk}: the valid range is 2..{top}"
        )
    return SpecSettings(algorithm, steps, topk, tokens)


def with_speculation(inputs: LedgerInputs, args: ServerArgs) -> LedgerInputs:
    """The ledger's inputs with speculative decoding's graph shapes (the target's verify rows, the draft's decode
    steps), from the settings serve resolves; unchanged without speculation. Raises ValueError as resolve does."""
    settings = resolve(args, inputs.model.architecture)
    if settings is None:
        return inputs
    draft_rows = 0 if settings.algorithm == "NGRAM" else settings.topk  # NGRAM has no model to capture
    # a draft model's catch-up extends run on prefill pieces; a head's layers do not split into them, its
    # catch-ups run as decode rows (num_steps + 1 a request)
    draft = inputs.draft if settings.algorithm == "STANDALONE" else None
    layers = draft.num_layers if draft else 0
    head = settings.algorithm in ("EAGLE", "EAGLE3", "NEXTN")
    return replace(
        inputs,
        verify_tokens_per_req=settings.num_draft_tokens,
        draft_rows_per_req=draft_rows,
        draft_extend_layers=layers,
        draft_guess_tokens_per_req=head_guess_tokens(settings.draft_steps, settings.topk) if head else 0,
        draft_catch_up_tokens_per_req=settings.draft_steps + 1 if head else 0,
        draft_head_kv_layers=1 if settings.algorithm == "NEXTN" else 0,  # its runner has one layer
    )
