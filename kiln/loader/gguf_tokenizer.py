"""The tokenizer of a GGUF file: transformers' conversion of its metadata, kept on disk after the first start."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("kiln")

CACHE_FORMAT = 1  # what a kept copy holds: raised when that changes, so older copies are not read
DONE = ".kiln-complete"  # written last into a kept copy, before it is renamed into place


def load_gguf_tokenizer(path: str):
    """A transformers fast tokenizer built from the GGUF metadata (vocab, merges, specials, chat template).

    Only the GGUF is visible to the conversion: files that sit next to it (tokenizer_config.json, ...)
    are ignored. The conversion takes seconds (the whole vocabulary and merges in Python); its result is kept
    under ~/.cache/kiln/tokenizers, keyed by the file (path, inode, size, times) and the converting libraries'
    versions, so later starts load it in a fraction of that. A kept copy that cannot be read is converted again.
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
            _keep(tokenizer, cached)
    tokenizer.name_or_path = path
    return tokenizer


def _read_kept(path: str):
    """(the kept tokenizer or None, where it is kept or None where the cache cannot be used)."""
    from transformers import PreTrainedTokenizerFast

    try:
        cached = tokenizer_cache_dir() / _key(path)
        if not (cached / DONE).is_file():
            return None, cached
    except Exception:  # noqa: BLE001 - no home, no permission: the cache is skipped, never fatal
        return None, None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True), cached
    except Exception as e:  # noqa: BLE001 - a damaged copy is converted again
        logger.warning(f"the kept tokenizer {cached} could not be read ({e!r}); converting the GGUF's again")
        _remove(cached)
        return None, cached


def tokenizer_cache_dir() -> Path:
    return Path("~/.cache/kiln/tokenizers").expanduser()


def _key(path: str) -> str:
    """The file as it is now (inode, size, modification and change times) and what converts it."""
    from importlib.metadata import version

    stat = os.stat(path)
    file = f"{os.path.realpath(path)}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
    versions = "|".join([str(CACHE_FORMAT), *(version(p) for p in ("transformers", "tokenizers", "gguf"))])
    return hashlib.sha256(f"{file}|{versions}".encode()).hexdigest()[:24]


def _keep(tokenizer, cached: Path) -> None:
    """Save a converted tokenizer where later loads find it: written aside, marked whole, and renamed into place,
    so a reader finds no copy or a whole one (of two processes converting at once, the first to rename keeps
    its copy)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(str(tmp))
            (tmp / DONE).touch()
            os.rename(tmp, cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:  # noqa: BLE001 - the cache cannot be written, or another process kept its copy first
        pass


def _remove(cached: Path) -> None:
    """Take a damaged copy away whole (renamed aside first), so no reader sees part of it."""
    aside = cached.with_name(f".gone-{cached.name}-{os.getpid()}")
    try:
        os.rename(cached, aside)
    except OSError:
        return  # another process took it away already
    shutil.rmtree(aside, ignore_errors=True)
