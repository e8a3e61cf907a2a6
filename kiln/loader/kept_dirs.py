"""Directories kept under ~/.cache/kiln that stand for a slow conversion of a file (a GGUF's tokenizer, a test's
reference model): keyed by the file as it is now and by what converted it, written whole or not at all, and never
fatal when the cache cannot be used."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DONE = ".kiln-complete"  # written last into a kept directory, before it is renamed into place


def kept_dir(root: Path, path: str, *converters: str) -> Path:
    """Where the conversion of `path` is kept under `root`: keyed by the file (real path, inode, size,
    modification and change times) and by `converters` (what converts it, with its version), so a changed file
    or a new converter is converted again."""
    stat = os.stat(path)
    file = f"{os.path.realpath(path)}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
    return _keyed(root, file, converters)


def content_kept_dir(root: Path, path: str, *converters: str) -> Path:
    """As kept_dir, keyed by the file's bytes instead of where it lies: a copy of the same file elsewhere (another
    checkout's virtual environment) finds the same conversion, at the price of reading the file once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return _keyed(root, digest.hexdigest(), converters)


def _keyed(root: Path, file: str, converters: tuple[str, ...]) -> Path:
    return root / hashlib.sha256("|".join([file, *converters]).encode()).hexdigest()[:24]


def is_kept(kept: Path) -> bool:
    return (kept / DONE).is_file()


def keep(kept: Path, write: Callable[[Path], None]) -> None:
    """`write` into a directory aside, marked whole, then renamed to `kept`, so a reader finds none or all of it
    (of two processes converting at once, the first to rename keeps its copy). Fails silently: the cache cannot
    be written, or another process kept its copy first."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=kept.parent, prefix=".tmp-"))
        try:
            write(tmp)
            (tmp / DONE).touch()
            os.rename(tmp, kept)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:  # noqa: BLE001 - a cache is never fatal
        pass


def remove(kept: Path) -> None:
    """Take a damaged copy away whole (renamed aside first), so no reader sees part of it."""
    aside = kept.with_name(f".gone-{kept.name}-{os.getpid()}")
    try:
        os.rename(kept, aside)
    except OSError:
        return  # another process took it away already
    shutil.rmtree(aside, ignore_errors=True)
