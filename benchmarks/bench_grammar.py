"""Constrained decoding on the CPU: the grammar libraries side by side, and the served cost of constraints.

  python benchmarks/bench_grammar.py libraries   # compile time, per-token mask time, refusals: llguidance / xgrammar
  python benchmarks/bench_grammar.py cache       # Kiln's cache: a large schema's compile at first and second use
  python benchmarks/bench_grammar.py serve       # output tok/s of 32 streams, half constrained against none

Every figure is one JSON line on stdout. The mask walk follows a fixed random path through the grammar (seeded),
so the libraries see the same kind of states; the first mask of a grammar (lazy lexer work) is reported apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_runs import start_server  # noqa: E402

from kiln.loader.default_model import default_model_path  # noqa: E402
from kiln.structured.spec import ANY_JSON_OBJECT  # noqa: E402
from kiln.text.tokenizer import load_tokenizer  # noqa: E402


def _large_schema(fields: int = 60) -> dict:
    """An object of `fields` properties of every common kind (nested objects, enums, bounded arrays, patterns)."""
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 8},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 10}},
            "required": ["a"],
            "additionalProperties": False,
        },
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[: fields // 2],
        "additionalProperties": False,
    }


SCHEMAS = {
    "any_object": json.loads(ANY_JSON_OBJECT),
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "large": _large_schema(),
}
UNSUPPORTED = {
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "format": {"type": "string", "format": "ipv9"},
}


def _walk(fill, accept, ended, vocab: int, steps: int, seed: int = 0) -> tuple[float, list[float]]:
    """Masks along a seeded random path until the grammar ends: (first mask seconds, the later masks' seconds)."""
    chooser, times = random.Random(seed), []
    for _ in range(steps):
        if ended():
            break
        start = time.perf_counter()
        words = fill()
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits).tolist()
        if not allowed:
            break
        if not accept(chooser.choice(allowed)):
            break
    return times[0], times[1:]


def _summary(library: str, schema: str, compile_s: float, first: float, rest: list[float]) -> dict:
    return {
        "library": library,
        "schema": schema,
        "compile_ms": round(1000 * compile_s, 2),
        "first_mask_ms": round(1000 * first, 2),
        "mask_median_us": round(1e6 * statistics.median(rest), 1) if rest else None,
        "mask_p90_us": round(1e6 * sorted(rest)[int(0.9 * len(rest))], 1) if rest else None,
        "masks": len(rest) + 1,
    }


def _llguidance(tokenizer, steps: int) -> None:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    print(
        json.dumps(
            {"library": "llguidance", "tokenizer_setup_ms": round(1000 * (time.perf_counter() - start))}
        )
    )
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_s = time.perf_counter() - start
        words = torch.zeros((lltok.vocab_size + 31) // 32, dtype=torch.int32)

        def fill(current=matcher, buffer=words):
            current.unsafe_compute_mask_ptr(buffer.data_ptr(), buffer.numel() * 4)
            return buffer

        first, rest = _walk(fill, matcher.consume_token, matcher.is_stopped, lltok.vocab_size, steps)
        print(json.dumps(_summary("llguidance", name, compile_s, first, rest)))
    for feature, schema in UNSUPPORTED.items():
        error = llguidance.LLMatcher.validate_grammar(
            llguidance.grammar_from("json_schema", json.dumps(schema))
        )
        print(
            json.dumps(
                {"library": "llguidance", "unsupported": feature, "refused": bool(error), "error": error}
            )
        )


def _xgrammar(tokenizer, steps: int) -> None:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    print(
        json.dumps({"library": "xgrammar", "tokenizer_setup_ms": round(1000 * (time.perf_counter() - start))})
    )
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        compile_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

        def fill(current=matcher, buffer=bitmask):
            current.fill_next_token_bitmask(buffer, 0)
            return buffer[0]

        first, rest = _walk(fill, matcher.accept_token, matcher.is_terminated, info.vocab_size, steps)
        print(json.dumps(_summary("xgrammar", name, compile_s, first, rest)))
    for feature, schema in UNSUPPORTED.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
            refused, error = False, ""
        except Exception as e:  # noqa: BLE001 - any refusal counts
            refused, error = True, str(e)[:200]
        print(json.dumps({"library": "xgrammar", "unsupported": feature, "refused": refused, "error": error}))


def _outlines(tokenizer) -> None:
    """outlines-core: the schema's regex, then its index over the whole vocabulary (the compile); refusals."""
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    pieces: dict[str, list[int]] = {}
    for token in range(len(tokenizer)):
        if token != tokenizer.eos_token_id:
            text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)])
            pieces.setdefault(text, []).append(token)
    vocabulary = Vocabulary(tokenizer.eos_token_id, pieces)
    print(
        json.dumps(
            {"library": "outlines-core", "tokenizer_setup_ms": round(1000 * (time.perf_counter() - start))}
        )
    )
    for name, schema in SCHEMAS.items():
        if name == "any_object":
            continue  # outlines-core writes an open object as a regex of bounded nesting: not the same grammar
        start = time.perf_counter()
        Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
        compile_ms = round(1000 * (time.perf_counter() - start), 2)
        print(json.dumps({"library": "outlines-core", "schema": name, "compile_ms": compile_ms}))
    for feature, schema in UNSUPPORTED.items():
        try:
            build_regex_from_schema(json.dumps(schema))
            refused, error = False, ""
        except Exception as e:  # noqa: BLE001 - any refusal counts
            refused, error = True, str(e)[:200]
        print(
            json.dumps(
                {"library": "outlines-core", "unsupported": feature, "refused": refused, "error": error}
            )
        )


def libraries(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.model_path or default_model_path())
    _llguidance(tokenizer, args.steps)
    _xgrammar(tokenizer, args.steps)
    if not args.skip_outlines:
        _outlines(tokenizer)


def cache(args: argparse.Namespace) -> None:
    """The large schema through Kiln's GrammarCache: the matcher ready at first use (tokenizer setup apart), and
    at second use (a cache hit)."""
    from kiln.structured.backend import make_backend
    from kiln.structured.cache import GrammarCache
    from kiln.structured.spec import GrammarSpec

    tokenizer = load_tokenizer(args.model_path or default_model_path())
    backend = make_backend("llguidance", tokenizer, [tokenizer.eos_token_id])
    start = time.perf_counter()
    backend.tokenizer()
    setup = time.perf_counter() - start
    grammars = GrammarCache(backend)
    spec = GrammarSpec("json_schema", json.dumps(_large_schema(args.fields)))
    record = {"fields": args.fields, "tokenizer_setup_ms": round(1000 * setup)}
    width = len(tokenizer)
    for use in ("first", "second", "third"):
        start = time.perf_counter()
        matcher = grammars.submit(spec).result()
        ready = time.perf_counter()
        matcher.allowed(width)  # the first mask: what the request's first token waits for
        record[f"{use}_use_ready_ms"] = round(1000 * (ready - start), 3)
        record[f"{use}_use_first_mask_ms"] = round(1000 * (time.perf_counter() - ready), 3)
    print(json.dumps(record))
    grammars.close()


LONG_TEXT = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
    "required": ["story"],
    "additionalProperties": False,
}


async def _run_streams(url: str, streams: int, constrained: int, output_len: int) -> dict:
    async def one(k: int, client: httpx.AsyncClient) -> int:
        params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
        if k < constrained:
            params["json_schema"] = json.dumps(LONG_TEXT)
        body = {"text": f"Story number {k}: once upon a time", "sampling_params": params}
        r = await client.post(f"{url}/generate", json=body, timeout=1800)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    async with httpx.AsyncClient() as client:
        await one(0, client)  # compile (and warm) the grammar before the clock starts
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(k, client) for k in range(streams)))
        elapsed = time.perf_counter() - start
    return {
        "streams": streams,
        "constrained": constrained,
        "tokens": sum(tokens),
        "tok_s": sum(tokens) / elapsed,
    }


def serve(args: argparse.Namespace) -> None:
    url, proc = args.url, None
    if url is None:
        proc, url = start_server(["--max-running-requests", str(args.streams)], Path(args.log))
    try:
        for _ in range(args.rounds):  # alternated, so that neither side always runs on the warmer server
            free = asyncio.run(_run_streams(url, args.streams, 0, args.output_len))
            half = asyncio.run(_run_streams(url, args.streams, args.streams // 2, args.output_len))
            print(json.dumps(free))
            print(json.dumps(half))
            print(json.dumps({"ratio_half_constrained": round(half["tok_s"] / free["tok_s"], 3)}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["libraries", "cache", "serve"])
    parser.add_argument(
        "--model-path", default=None, help="tokenizer to measure with (default: Kiln's model)"
    )
    parser.add_argument("--steps", type=int, default=200, help="masks per schema in `libraries`")
    parser.add_argument(
        "--skip-outlines", action="store_true", help="`libraries` without outlines-core (slow)"
    )
    parser.add_argument("--fields", type=int, default=60, help="properties of the large schema in `cache`")
    parser.add_argument("--url", default=None, help="`serve` against this server instead of starting one")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="`serve`: free / half-constrained pairs")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--log", default="/tmp/bench_grammar_serve.log")
    args = parser.parse_args()
    {"libraries": libraries, "cache": cache, "serve": serve}[args.mode](args)


if __name__ == "__main__":
    main()
