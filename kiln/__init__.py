"""Kiln: an LLM inference server with a predictable startup."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from kiln.engine import Engine

        return Engine
    raise AttributeError(name)
