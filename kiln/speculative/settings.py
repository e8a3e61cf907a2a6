"""--speculative-* resolved as SGLang resolves them, and refused where Kiln cannot run them.

Auto defaults (no --speculative-num-steps): SGLang's (steps, topk, num_draft_tokens) by architecture, (5, 4, 8)
for Llama and (3, 1, 4) for the rest and STANDALONE; Kiln verifies a chain, so it keeps SGLang's steps and
takes topk 1 with steps + 1 draft tokens. NGRAM: 12 draft tokens unless given, steps = num_draft_tokens - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config import ServerArgs

NEEDS_DRAFT_PATH = ("STANDALONE", "EAGLE", "EAGLE3")
NGRAM_DRAFT_TOKENS = 12  # SGLang's default --speculative-num-draft-tokens for NGRAM
WIDE_AUTO_ARCHITECTURES = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")


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


def _auto_steps(algorithm: str, architecture: str) -> int:
    if algorithm != "STANDALONE" and architecture in WIDE_AUTO_ARCHITECTURES:
        return 5
    return 3


def max_draft_tokens(steps: int, topk: int) -> int:
    """The most tokens `steps` draft steps of `topk` branches can offer a verify, the root included."""
    return 1 + topk + (steps - 1) * topk * topk


def resolve(args: ServerArgs, architecture: str) -> SpecSettings | None:
    """The settings serve runs, or None without speculative decoding. Raises ValueError naming the flag."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm in NEEDS_DRAFT_PATH and not args.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    topk = args.speculative_eagle_topk if args.speculative_eagle_topk is not None else 1
    if topk != 1:
        raise ValueError(
            f"--speculative-eagle-topk {topk}: Kiln verifies a chain of drafts (no tree attention), so the "
            "supported value is 1"
        )
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if algorithm == "NGRAM":
        tokens = tokens if tokens is not None else NGRAM_DRAFT_TOKENS
        steps = steps if steps is not None else tokens - 1
    elif steps is None:
        steps = _auto_steps(algorithm, architecture)
    tokens = tokens if tokens is not None else steps + 1
    if steps < 1:
        raise ValueError(f"--speculative-num-steps {steps} must be >= 1")
    top = max_draft_tokens(steps, topk)
    if not 2 <= tokens <= top:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} cannot be produced by --speculative-num-steps {steps} and "
            f"--speculative-eagle-topk {topk}: the valid range is 2..{top}"
        )
    return SpecSettings(algorithm, steps, topk, tokens)
