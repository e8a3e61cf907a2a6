"""The file storage tier of the KV cache (--hicache-storage-backend file): KV blocks on disk, found again by a
restarted server or by another replica on the same disk.

A block is `block_tokens` consecutive tokens from the start of a sequence. Its name is a hash chain: the hash of
the previous block's name and this block's token ids, seeded with a fingerprint of everything that makes KV
differ (the model's files, dtype, KV dtype, tensor-parallel rank and size, page size and the pool's row layout),
so a name identifies one prefix of one model's KV and nothing else. Only whole blocks are stored.

A file is a header (magic, the fingerprint, its own name, the row layout, payload length and SHA-256) and the
rows of every layer. A file whose header or checksum does not match what its name promises — corrupted, cut short
by a crash, or written by another model — is skipped with a warning and removed, never served. Writes go to a
temporary file that is fsynced and then renamed over the final name, so a kill -9 mid-write leaves at most a
temporary file, which no reader opens and a later start removes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger("kiln")

MAGIC = b"KILNKV01"
TMP_SUFFIX = ".tmp"
DEFAULT_BLOCK_TOKENS = 64


def default_storage_dir() -> str:
    return str(Path("~/.cache/kiln/hicache").expanduser())


def storage_dir_problem(root: str, keep: bool) -> str | None:
    """Why the storage tier cannot keep files under `root`, or None: the directory is made (with its missing
    parents) and a file written in it and removed, which is what the tier will do. `keep`: leave the directories
    made (serve); otherwise remove them again (`kiln plan` leaves no trace)."""
    path = Path(os.path.abspath(Path(root).expanduser()))  # no "..": each directory made is one removed
    made: list[Path] = []
    try:
        for directory in reversed([p for p in (path, *path.parents) if not p.exists()]):
            try:
                directory.mkdir()
                made.append(directory)
            except FileExistsError:  # another rank (or process) made it meanwhile: not ours to remove
                if not directory.is_dir():
                    raise
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kiln-probe-"):
            pass
    except OSError as e:
        return (
            f"--hicache-storage-dir {root} cannot hold the storage tier's files ({e.strerror or e}: "
            f"{e.filename or path}): give a directory Kiln can write (default {default_storage_dir()})"
        )
    finally:
        if not keep:
            for directory in reversed(made):
                with contextlib.suppress(OSError):  # something else wrote there meanwhile: it stays
                    directory.rmdir()
    return None


def model_fingerprint(identity: dict) -> str:
    """A hash of what makes KV differ between servers (see the module docstring); identity is JSON-able."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def checkpoint_identity(model_path: str) -> list[tuple[str, int]]:
    """The model's files by name and size: a copy of the same checkpoint elsewhere shares its KV files."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [
        (p.name, p.stat().st_size) for p in files if p.suffix in (".safetensors", ".gguf", ".json", ".bin")
    ]


class FileStorageTier:
    """Blocks of the device pool's rows in files under `root`/<fingerprint[:16]>/."""

    def __init__(
        self, root: str, fingerprint: str, tensors: Sequence[torch.Tensor], block_tokens: int
    ) -> None:
        self.fingerprint = fingerprint
        self.block_tokens = block_tokens
        self.dir = Path(root).expanduser() / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tensors = list(tensors)  # the device pool's per-layer row tensors, K then V
        self._layout = [[list(t.shape[1:]), str(t.dtype)] for t in self._tensors]
        self._known: set[str] = set()  # block names seen on disk by this process
        self.hit_tokens = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.load_seconds = 0.0
        self.skipped_files = 0
        # files are written off the scheduler's thread; the rows are copied out before it returns, so the slots
        # may be reused at once
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-kv-storage")
        self._pending: list[Future] = []
        self._remove_stale_temporaries()

    # ------------------------------------------------------------------ names

    def block_names(self, tokens: Sequence[int]) -> list[str]:
        """The names of the whole blocks of `tokens`, in order."""
        names, previous = [], self.fingerprint
        for start in range(0, len(tokens) - self.block_tokens + 1, self.block_tokens):
            block = tokens[start : start + self.block_tokens]
            digest = hashlib.sha256(previous.encode() + struct.pack(f"<{len(block)}q", *block))
            previous = digest.hexdigest()
            names.append(previous)
        return names

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.kv"

    def contains(self, name: str) -> bool:
        if name in self._known:
            return True
        if self._path(name).exists():
            self._known.add(name)
            return True
        return False

    # ------------------------------------------------------------------ write

    def write(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Store the whole blocks of a sequence whose KV sits at `slots` that are not stored yet; returns the
        blocks written."""
        written = 0
        for i, name in enumerate(self.block_names(tokens)):
            if self.contains(name):
                continue
            rows = slots[i * self.block_tokens : (i + 1) * self.block_tokens]
            self._known.add(name)
            self._pending.append(self._writer.submit(self._write_file, name, self._payload(rows)))
            written += 1
        self._pending = [f for f in self._pending if not f.done()]
        return written

    def drain(self) -> None:
        """Wait for the writes under way (tests, shutdown); a failed write is logged, and its block forgotten."""
        for future in self._pending:
            future.result()
        self._pending = []

    def _payload(self, slots: torch.Tensor) -> bytes:
        index = slots.to(self._tensors[0].device)
        parts = [t.index_select(0, index).cpu().contiguous().view(torch.uint8) for t in self._tensors]
        return b"".join(p.numpy().tobytes() for p in parts)

    def _header(self, name: str, payload: bytes) -> bytes:
        header = {
            "fingerprint": self.fingerprint,
            "name": name,
            "tokens": self.block_tokens,
            "layout": self._layout,
            "payload_bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        encoded = json.dumps(header, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(encoded)) + encoded

    def _write_file(self, name: str, payload: bytes) -> None:
        try:
            self._write_atomically(name, payload)
        except OSError as e:  # a full or read-only disk costs the tier its block, never the request
            logger.warning(f"KV storage: could not write {name[:16]}: {e}")
            self._known.discard(name)

    def _write_atomically(self, name: str, payload: bytes) -> None:
        final = self._path(name)
        tmp = final.with_name(f".{final.name}.{os.getpid()}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            f.write(self._header(name, payload))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic: readers see the old state or the whole new file
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
        self.bytes_written += len(payload)

    # ------------------------------------------------------------------ read

    def read(self, name: str) -> list[torch.Tensor] | None:
        """The rows of one block (one tensor per pool tensor, on the host), or None when the file is missing
        or fails its checks (then it is removed, with a warning)."""
        path = self._path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._known.discard(name)
            return None
        problem = self._problem(name, data)
        if problem is not None:
            logger.warning(f"KV storage: skipped {path.name}: {problem}")
            self.skipped_files += 1
            self._known.discard(name)
            path.unlink(missing_ok=True)
            return None
        self._known.add(name)
        (length,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
        payload = memoryview(data)[len(MAGIC) + 4 + length :]
        self.bytes_read += len(payload)
        return self._rows(payload)

    def _problem(self, name: str, data: bytes) -> str | None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return "not a Kiln KV file"
        (length,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
        try:
            header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
        except ValueError:
            return "unreadable header"
        payload = memoryview(data)[len(MAGIC) + 4 + length :]
        expected = {
            "fingerprint": self.fingerprint, "name": name, "tokens": self.block_tokens, "layout": self._layout,
            "payload_bytes": len(payload),
        }  # fmt: skip
        for key, value in expected.items():
            if header.get(key) != value:
                return f"header {key} {header.get(key)!r} != {value!r}"
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return "payload checksum mismatch"
        return None

    def _rows(self, payload: memoryview) -> list[torch.Tensor]:
        rows, offset = [], 0
        for t in self._tensors:
            shape = (self.block_tokens, *t.shape[1:])
            nbytes = self.block_tokens * t[0].nbytes
            flat = torch.frombuffer(bytearray(payload[offset : offset + nbytes]), dtype=torch.uint8)
            rows.append(flat.view(t.dtype).reshape(shape))
            offset += nbytes
        return rows

    def load(self, names: Sequence[str]) -> list[list[torch.Tensor]]:
        """The rows of the leading run of `names` that read back whole (a miss or a bad file ends it)."""
        t0 = time.perf_counter()
        blocks = []
        for name in names:
            rows = self.read(name) if self.contains(name) else None
            if rows is None:
                break
            blocks.append(rows)
        self.load_seconds += time.perf_counter() - t0
        return blocks

    def copy_into(self, blocks: list[list[torch.Tensor]], skip: int, slots: torch.Tensor) -> None:
        """Write the loaded blocks' rows, less their first `skip` tokens, into the device pool at `slots`."""
        index = slots.to(self._tensors[0].device)
        for j, t in enumerate(self._tensors):
            rows = torch.cat([block[j] for block in blocks])[skip:]
            t.index_copy_(0, index, rows.to(t.device))
        self.hit_tokens += int(slots.numel())

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of writers that are gone (a crash mid-write): never read, removed here."""
        for tmp in self.dir.glob(f".*{TMP_SUFFIX}"):
            pid = tmp.name.removesuffix(TMP_SUFFIX).rsplit(".", 1)[-1]
            if not (pid.isdigit() and _alive(int(pid))) or int(pid) == os.getpid():
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
