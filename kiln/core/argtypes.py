"""argparse `type=` functions that refuse out-of-range values at parse time. argparse turns their message into
one line, `error: argument --flag: must be ..., got ...`, with exit code 2: a bad number otherwise surfaces
later as a traceback, or as a run that measures nothing (0 sequences, 0 tok/s)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from urllib.parse import urlsplit


def _describe(kind: type, lo: float, hi: float, lo_open: bool) -> str:
    noun = "an integer" if kind is int else "a number"
    if hi == math.inf:
        return f"{noun} {'>' if lo_open else '>='} {lo:g}"
    return f"{noun} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"


def bounded(kind: type, lo: float, hi: float = math.inf, lo_open: bool = False) -> Callable[[str], float]:
    """A type function parsing `kind` (int or float) within [lo, hi], or (lo, hi] with `lo_open`."""
    want = _describe(kind, lo, hi, lo_open)

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        # NaN compares false with every bound, so it would slip through the range test below
        if math.isnan(value) or value < lo or value > hi or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    return parse


positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
positive_float = bounded(float, 0, lo_open=True)  # "inf" is allowed: no limit (e.g. --request-rate)
fraction = bounded(float, 0, 1)
port = bounded(int, 1, 65535)


def json_object(text: str) -> str:
    """A JSON object, checked here and kept as text (its users parse it themselves)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return text


def key_value(text: str) -> str:
    """KEY=VALUE, kept as text."""
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    return text


def server_url(text: str) -> str:
    """An http(s) URL with a host (a server to reach): a word that is none would be tried until a timeout."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError as e:
        message = f"must be an http(s) URL such as http://127.0.0.1:30000, got {text!r} ({e})"
        raise argparse.ArgumentTypeError(message) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"must be an http(s) URL such as http://127.0.0.1:30000, got {text!r}"
        )
    return text
