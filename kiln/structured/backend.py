"""The grammar library behind --grammar-backend: llguidance.

llguidance refuses a JSON schema keyword it cannot enforce ("Unimplemented keys: ...", "Unknown format: ...")
instead of dropping it, so a spec it accepts is enforced in full: the fail-closed property Kiln promises.
Its grammars compile lazily (the lexer at the matcher's creation, parser states at each mask), so a spec costs
little before its first token. The compiled form Kiln caches is a pristine matcher: each request gets a copy of it
(microseconds), where a new matcher would rebuild the lexer (milliseconds for a large schema). See
docs/structured_output.md for the comparison with the other libraries.
"""

from __future__ import annotations

import json
import threading

from kiln.structured.matcher import GrammarMatcher
from kiln.structured.spec import GrammarError, GrammarSpec

BACKENDS = ("llguidance",)
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "gbnf"}


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (not yet checked against its features)."""
    import llguidance

    if spec.kind == "json_schema":
        try:
            json.loads(spec.text)
        except ValueError as e:
            raise GrammarError(spec.kind, f"json_schema is not valid JSON: {e}") from None
    try:
        return llguidance.grammar_from(_FORMATS[spec.kind], spec.text)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise GrammarError(spec.kind, f"{spec.kind}: {e}") from None


def check_spec(spec: GrammarSpec) -> str:
    """The spec compiled into an llguidance grammar and validated without a tokenizer (no vocabulary needed):
    GrammarError names the first feature or syntax error the backend refuses."""
    import llguidance

    grammar = _grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(spec.kind, f"{spec.kind} refused by the grammar backend: {error}")
    return grammar


class LLGuidanceBackend:
    """Compiles specs against the model's tokenizer and creates one matcher per request.

    The llguidance tokenizer (the vocabulary as byte strings) is built at the first constrained request, so a
    server that never sees one never pays for it; a lock keeps the compile threads from building it twice."""

    name = "llguidance"

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self._hf_tokenizer = tokenizer
        self._eos = [t for t in eos_token_ids if t is not None]
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                eos = self._eos[0] if self._eos else None
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, eos_token=eos)
            return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer().vocab_size

    def compile(self, spec: GrammarSpec):
        """A pristine llguidance matcher for spec, never advanced itself; GrammarError names what is refused."""
        import llguidance

        grammar = _grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise GrammarError(spec.kind, f"{spec.kind} refused by the grammar backend: {error}")
        pristine = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        pristine.compute_bitmask()  # the first mask's lexer work, done here and shared by every copy
        return pristine

    def matcher(self, compiled) -> GrammarMatcher:
        """A request's own matcher: a copy of the compiled one, at the grammar's start."""
        return GrammarMatcher(compiled.deep_copy(), self.vocab_size)


def make_backend(name: str, tokenizer, eos_token_ids: list[int]) -> LLGuidanceBackend | None:
    """The backend --grammar-backend names; None for `none` (constrained requests are then refused)."""
    if name == "none":
        return None
    if name not in BACKENDS:
        raise ValueError(
            f"--grammar-backend {name} is not available in Kiln: use one of {', '.join(BACKENDS)} or none"
        )
    return LLGuidanceBackend(tokenizer, eos_token_ids)
