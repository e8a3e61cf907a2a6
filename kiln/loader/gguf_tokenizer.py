"""The tokenizer of a GGUF file: transformers' conversion of its metadata, kept on disk after the first start."""

from __future__ import annotations

import logging
import os
import tempfile
from importlib.metadata import version
from pathlib import Path

from kiln.loader.kept_dirs import is_kept, keep, kept_dir, remove

logger = logging.getLogger("kiln")

CACHE_FORMAT = 1  # what a kept copy holds: raised when that changes, so older copies are not read


def load_gguf_tokenizer(path: str):
    """A transformers fast tokenizer built from the GGUF metadata (vocab, merges, specials, chat template).

    Only the GGUF is visible to the conversion: files that sit next to it (tokenizer_config.json, ...)
    are ignored. The conversion takes seconds (the whole vocabulary and merges in Python); its result is kept
    under ~/.cache/kiln/tokenizers, keyed by the file and the converting libraries' versions
    (kiln.loader.kept_dirs), so later starts load it in a fraction of that. A kept copy that cannot be read is
    converted again.
    """
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    tokenizer, cached = _read_kept(path)
    if tokenizer is None:
        with tempfile.TemporaryDirectory(prefix="kiln-gguf-tok-") as tmp:
            os.symlink(path, os.path.join(tmp, os.path.basename(path)))
            tokenizer = PreTrainedTokenizerFast.from_pretrained(
                tmp, gguf_file=os.path.basename(path), local_files_only=True
            )
        if cached is not None:
            keep(cached, lambda tmp: tokenizer.save_pretrained(str(tmp)))
    tokenizer.name_or_path = path
    return tokenizer


def _read_kept(path: str):
    """(the kept tokenizer or None, where it is kept or None where the cache cannot be used)."""
    from transformers import PreTrainedTokenizerFast

    try:
        versions = [
            f"format {CACHE_FORMAT}",
            *(f"{p} {version(p)}" for p in ("transformers", "tokenizers", "gguf")),
        ]
        cached = kept_dir(tokenizer_cache_dir(), path, *versions)
        if not is_kept(cached):
            return None, cached
    except Exception:  # noqa: BLE001 - no home, no permission: the cache is skipped, never fatal
        return None, None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True), cached
    except Exception as e:  # noqa: BLE001 - a damaged copy is converted again
        logger.warning(f"the kept tokenizer {cached} could not be read ({e!r}); converting the GGUF's again")
        remove(cached)
        return None, cached


def tokenizer_cache_dir() -> Path:
    return Path("~/.cache/kiln/tokenizers").expanduser()
