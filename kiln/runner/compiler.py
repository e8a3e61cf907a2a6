"""The compiler settings Kiln changes, all in one place. They are process-wide by nature: torch._dynamo.config is
module state shared by every compiled function of the process, and inductor reads its on-disk cache directory
from the environment. A per-function or per-call setting does not exist for them (the cache directory, the
recompile limit) or would be checked on every step (a compile stance), so Kiln sets them for the process and
says so here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kiln.core import envs


def default_compile_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "kiln", "compile")


def compile_cache_dir(flag: str | None) -> str:
    """Where compiled shapes are cached between starts: the --compile-cache-dir flag, else inductor's own
    TORCHINDUCTOR_CACHE_DIR, else Kiln's default under the user's cache directory."""
    return flag or envs.inductor_cache_dir() or default_compile_cache_dir()


def configure_compiler(cache_dir: str | None, shapes: int) -> None:
    """Inductor's on-disk cache directory (None: leave inductor's own choice), and room for one compiled entry
    per captured shape before dynamo gives up recompiling."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ[envs.TORCHINDUCTOR_CACHE_DIR] = cache_dir
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 2 * shapes + 8)


@contextmanager
def capture_window() -> Iterator[None]:
    """Compiling is for startup only: inside the window shapes compile; after it a shape that would need a new
    compile in the serving loop raises instead (the graph runner then runs that batch eagerly). The next capture,
    of another engine in this process, opens the window again while it compiles."""
    torch._dynamo.config.error_on_recompile = False
    try:
        yield
    finally:
        torch._dynamo.config.error_on_recompile = True


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of the on-disk caches so far. A hit of AOTAutograd's cache loads inductor's compiled code
    too: nothing is lowered or built. A miss or a bypass of either means the shape was compiled."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    misses = aot["autograd_cache_miss"] + aot["autograd_cache_bypass"] + inductor["fxgraph_cache_miss"]
    return aot["autograd_cache_hit"], misses
