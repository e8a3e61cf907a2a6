"""The tokenizer of a GGUF file: transformers' conversion of its metadata, kept on disk after the first start."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("kiln")


def load_gguf_tokenizer(path: str):
    """A transformers fast tokenizer built from the GGUF metadata (vocab, merges, specials, chat template).

    Only the GGUF is visible to the conversion: files that sit next to it (tokenizer_config.json, ...)
    are ignored. The conversion takes seconds (the whole vocabulary and merges in Python); its result is kept
    under ~/.cache/kiln/tokenizers, keyed by the file (path, size, modification time) and the tokenizer
    libraries' versions, so later starts load it in a fraction of that. A cached copy that cannot be read is
    converted again.
    """
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    cached = tokenizer_cache_dir() / _key(path)
    tokenizer = None
    if cached.is_dir():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged copy is rebuilt, never fatal
            logger.warning(
                f"the cached tokenizer {cached} could not be read ({e!r}); converting the GGUF's again"
            )
            shutil.rmtree(cached, ignore_errors=True)
    if tokenizer is None:
        with tempfile.TemporaryDirectory(prefix="kiln-gguf-tok-") as tmp:
            os.symlink(path, os.path.join(tmp, os.path.basename(path)))
            tokenizer = PreTrainedTokenizerFast.from_pretrained(
                tmp, gguf_file=os.path.basename(path), local_files_only=True
            )
        _keep(tokenizer, cached)
    tokenizer.name_or_path = path
    return tokenizer


def tokenizer_cache_dir() -> Path:
    return Path("~/.cache/kiln/tokenizers").expanduser()


def _key(path: str) -> str:
    import tokenizers
    import transformers

    stat = os.stat(path)
    versions = f"{transformers.__version__}|{tokenizers.__version__}"
    what = f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{versions}"
    return hashlib.sha256(what.encode()).hexdigest()[:24]


def _keep(tokenizer, cached: Path) -> None:
    """Save a converted tokenizer where later loads find it: written aside and renamed into place, so a reader
    never sees half of one (of two processes converting at once, the first to rename keeps its copy)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(str(tmp))
            os.rename(tmp, cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # the cache cannot be written, or another process kept its copy first: the next start converts
