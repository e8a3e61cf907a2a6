"""Small JSON files Kiln keeps beside its caches (the graph payoff verdicts, the startup history, the compiled
shapes' marker): read as a dict whatever state a crash or another version left them in, written whole or not at
all."""

from __future__ import annotations

import json
import os


def read_json_dict(path: str) -> dict:
    """The file's object, or {} where it is missing, unreadable, not JSON or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: str, data: dict, **dump_options) -> None:
    """Writes through a temporary file and a rename, so a reader sees the old file or the whole new one; an
    OSError (a read-only cache) is the caller's to judge."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, **dump_options)
    os.replace(tmp, path)
