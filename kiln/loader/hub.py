"""A Hugging Face model id (--model-path ORG/NAME), fetched through huggingface_hub into its cache (--download-dir,
else HF_HUB_CACHE or HF_HOME/hub). huggingface_hub itself reads HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE and
HF_HUB_ETAG_TIMEOUT. Two steps, so that a plan never fetches weights: `fetch_metadata` takes the small files (the
config, the tokenizer's files, the generation config, the safetensors index) in seconds, and `download_weights`
the checkpoint's safetensors, the server's `downloading` phase. A killed download leaves a `<blob>.incomplete`
file, which the next one continues; with HF_HUB_OFFLINE=1 both steps read the cache alone."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tqdm import tqdm

from kiln.core.units import human

# the top-level config and tokenizer files; a repo's folders hold other formats' copies (original/, onnx/, ...)
META_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
TOP_LEVEL = ["*/*"]  # as ignore_patterns: nothing inside a folder
INDEX_FILE = "model.safetensors.index.json"
FETCH_WORKERS = 8  # files downloaded at once, as snapshot_download
# huggingface_hub's API calls (the repo's commit, its file list) carry no timeout of their own: a hub that never
# answers a connection would hold a start for minutes, where an unreachable one should be an error in seconds
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# the most often progress is reported (each report is a /status update and an event line)
REPORT_EVERY_S = 0.5


class DownloadCancelled(Exception):
    """The server is stopping: the download stops at its next chunk (its .incomplete file is kept)."""


@dataclass(frozen=True)
class DownloadProgress:
    model: str
    done: int  # bytes of the weights on disk, those cached before this download included
    total: int | None  # all the weights' bytes; None when no listing of the repo is cached
    rate: float  # bytes per second over the last few seconds
    finished: bool = False

    def status(self) -> dict:
        """The fields /status, the startup events and `kiln wait` show."""
        return {
            "model": self.model,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "bytes_per_s": round(self.rate),
        }


def progress_text(progress: dict) -> str:
    """A download's progress (DownloadProgress.status()) in words, for the log and `kiln wait`."""
    done, total = progress.get("bytes_done", 0), progress.get("bytes_total")
    of = f" of {human(total)} ({100 * done // total if total else 100}%)" if total is not None else ""
    return f"{progress.get('model', '?')}: {human(done)}{of}, {human(int(progress.get('bytes_per_s', 0)))}/s"


def fetch_metadata(
    model_id: str, revision: str | None, download_dir: str | None, flag: str = "--model-path"
) -> str:
    """The snapshot directory of `model_id` at `revision` (a branch, tag or commit; default main), holding its
    config, tokenizer files and safetensors index, downloaded when not cached. Raises ValueError naming the id
    and the fix."""
    from huggingface_hub import snapshot_download

    shown = model_id + (f"@{revision}" if revision else "")
    _bound_connect_time()
    try:
        snapshot = snapshot_download(
            model_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=META_PATTERNS,
            ignore_patterns=TOP_LEVEL,
            tqdm_class=_tracker_bar(None),
        )
    except Exception as e:  # noqa: BLE001 - any failure to reach the files must name the id, never a traceback
        raise hub_refusal(e, f"{flag} {shown}", download_dir) from e
    if not (Path(snapshot) / "config.json").is_file():
        raise ValueError(
            f"{flag} {shown}: the repo has no config.json (Kiln serves a model id in Hugging Face's safetensors "
            "layout; for a GGUF repo, download its .gguf file and give its path)"
        )
    return snapshot


def weight_patterns(snapshot: Path) -> list[str]:
    """The checkpoint's files: those its safetensors index names, else every top-level *.safetensors (as
    kiln.loader.weights reads them: another copy beside the shards, Mistral's consolidated.safetensors, is left)."""
    index = snapshot / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            names = []  # the loader names what is wrong with it
        if names:
            return names
    return ["*.safetensors"]


@dataclass(frozen=True)
class Checkpoint:
    """The files download_weights fetches: what its safetensors index names (else the top level's
    *.safetensors), found in the repo's cached listing with their sizes. kiln.server.startup_prediction reads it
    too, so that a first start predicts the download it will do."""

    patterns: list[str]  # snapshot_download's allow_patterns
    ignore: list[str] | None  # and its ignore_patterns
    listing: dict[str, int] | None  # the repo's files and sizes; None when no listing is cached
    files: dict[str, int]  # the checkpoint's files in the listing, and their sizes
    missing: list[str]  # those of them not in the snapshot yet

    @property
    def total(self) -> int | None:
        """All the checkpoint's bytes; None without a listing (nothing says what there is to fetch)."""
        return sum(self.files.values()) if self.listing is not None else None

    @property
    def cached(self) -> int:
        return sum(size for name, size in self.files.items() if name not in self.missing)

    @property
    def to_fetch(self) -> int:
        return sum(self.files[name] for name in self.missing)


def checkpoint(model_id: str, snapshot: str | Path, download_dir: str | None) -> Checkpoint:
    """The checkpoint of `model_id` in `snapshot` (fetch_metadata's directory, named by its commit): which files,
    which of them are missing, their sizes. Reads the cache alone: no network, no weight."""
    from huggingface_hub.utils import filter_repo_objects

    path = Path(snapshot)
    patterns = weight_patterns(path)
    # an index names the files, those in folders too; the glob takes the top level's
    ignore = TOP_LEVEL if patterns == ["*.safetensors"] else None
    listing = _cached_listing(model_id, path.name, download_dir)
    known = listing or {}
    files = {
        name: known[name]
        for name in filter_repo_objects(known, allow_patterns=patterns, ignore_patterns=ignore)
    }
    missing = [name for name in files if not (path / name).is_file()]
    return Checkpoint(patterns, ignore, listing, files, missing)


def download_weights(
    model_id: str,
    snapshot: str,
    download_dir: str | None,
    on_progress: Callable[[DownloadProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """The safetensors of `model_id` into `snapshot` (fetch_metadata's directory, named by its commit), what is
    cached already kept and what a killed download left continued. Raises ValueError naming the id,
    DownloadCancelled once `cancel` is set."""
    from huggingface_hub import constants, snapshot_download

    path = Path(snapshot)
    files = checkpoint(model_id, path, download_dir)
    if files.listing is not None and not files.files:
        raise ValueError(
            f"--model-path {model_id}: the repo holds no safetensors weights (Kiln loads *.safetensors; "
            f"its files: {', '.join(sorted(files.listing)[:8])})"
        )
    tracker = _Tracker(model_id, files.total, files.cached, on_progress, cancel)
    tracker.report()  # the total at once, before the first chunk
    _bound_connect_time()
    try:
        if files.missing and not constants.is_offline_mode():
            _each(files.missing, lambda name: _fetch(model_id, path.name, name, download_dir, tracker))
        # links what is missing from the snapshot; offline, checks the cache holds every file (and says which not)
        snapshot_download(
            model_id,
            revision=path.name,
            cache_dir=download_dir,
            allow_patterns=files.patterns,
            ignore_patterns=files.ignore,
            tqdm_class=_tracker_bar(None),
        )
    except DownloadCancelled:
        raise
    except Exception as e:  # noqa: BLE001 - as in fetch_metadata
        raise hub_refusal(e, f"--model-path {model_id}", download_dir) from e
    tracker.report(finished=True)


def _fetch(model_id: str, commit: str, name: str, download_dir: str | None, tracker: _Tracker) -> None:
    """One file of the checkpoint into the cache, continuing the `<blob>.incomplete` a killed download left:
    huggingface_hub's own downloads start over (they remove their partial file on failure, and never reuse the
    one a kill leaves). Its HTTP does the work (metadata, redirects, ranges, retries); hf_hub_download then links
    the blob into the snapshot."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(model_id, name, revision=commit)
    meta = get_hf_file_metadata(url)
    folder = Path(download_dir or constants.HF_HUB_CACHE).expanduser()
    repo = repo_folder_name(repo_id=model_id, repo_type="model")
    blob = folder / repo / "blobs" / meta.etag
    lock = folder / ".locks" / repo / f"{meta.etag}.lock"  # huggingface_hub's lock of that blob: one writer
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:  # a CDN's signed URL: the token is the Hub's
        headers.pop("authorization", None)
    with WeakFileLock(lock):
        if not blob.exists():
            partial = blob.with_name(blob.name + ".incomplete")
            with partial.open("ab") as f:
                http_get(
                    meta.location,
                    f,
                    resume_size=f.tell(),
                    headers=headers,
                    expected_size=meta.size,
                    tqdm_class=_tracker_bar(tracker),
                )
            partial.replace(blob)
    hf_hub_download(model_id, name, revision=commit, cache_dir=download_dir)


def _each(names: list[str], fetch: Callable[[str], None]) -> None:
    """fetch(name) for each name, FETCH_WORKERS at a time (as snapshot_download); the first error stops the
    rest (a cancel reaches each at its next chunk)."""
    with ThreadPoolExecutor(max_workers=FETCH_WORKERS) as pool:
        futures = [pool.submit(fetch, name) for name in names]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def hub_refusal(error: Exception, what: str, download_dir: str | None) -> ValueError:
    """huggingface_hub's error as what went wrong and the fix, naming `what` (the flag and the id)."""
    from huggingface_hub import constants, errors

    cache = download_dir or constants.HF_HUB_CACHE
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, errors.GatedRepoError):
        why = "is a gated repo: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
    elif isinstance(error, errors.RepositoryNotFoundError):
        why = f"no such repo on {constants.ENDPOINT} (check the name; a private repo needs HF_TOKEN)"
    elif isinstance(error, errors.RevisionNotFoundError):
        why = "the repo has no such revision (check --revision)"
    elif isinstance(error, errors.IncompleteSnapshotError):
        why = f"the hub cache {cache} holds only part of it, and the Hub cannot be reached to complete it"
    elif constants.is_offline_mode() and isinstance(error, errors.LocalEntryNotFoundError):
        why = (
            f"not in the hub cache {cache}, and HF_HUB_OFFLINE=1 forbids downloading it (run once where the Hub "
            "is reachable, or point --download-dir / HF_HUB_CACHE at a cache that holds it)"
        )
    elif isinstance(error, errors.LocalEntryNotFoundError):
        why = (
            f"cannot reach the Hub at {constants.ENDPOINT}, and the hub cache {cache} holds no copy (check the "
            "network and HF_ENDPOINT)"
        )
    elif status in (401, 403):
        why = f"the Hub refused access ({status}): check HF_TOKEN"
    else:
        why = f"cannot fetch it from {constants.ENDPOINT}: {type(error).__name__}: {_first_line(error)}"
    return ValueError(f"{what}: {why}")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _bound_connect_time() -> None:
    """A connect timeout on huggingface_hub's shared client (see CONNECT_TIMEOUT_S); file downloads pass their
    own (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT), which win. Its Timeout type is whichever HTTP library
    this huggingface_hub uses, hence type()."""
    from huggingface_hub.utils import get_session

    session = get_session()
    session.timeout = type(session.timeout)(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)


def _cached_listing(model_id: str, commit: str, download_dir: str | None) -> dict[str, int] | None:
    """The repo's files and sizes at `commit`, as fetch_metadata's download cached them; None when no listing is
    cached (a cache filled by an older huggingface_hub)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        files = get_cached_repo_tree(model_id, revision=commit, cache_dir=download_dir)
    except CachedRepoTreeNotFoundError:
        return None
    return {f.path: f.size for f in files}


class _Tracker:
    """The bytes each file's progress bar counts (huggingface_hub's http_get updates it per chunk), as
    DownloadProgress reports (at most every REPORT_EVERY_S); once `cancel` is set, each download stops at its
    next chunk."""

    def __init__(
        self,
        model: str,
        total: int | None,
        cached: int,
        on_progress: Callable[[DownloadProgress], None] | None,
        cancel: threading.Event | None,
    ):
        self.model, self.total, self.cached = model, total, cached
        self.on_progress, self.cancel = on_progress, cancel
        self.bars: list[tqdm] = []
        self.samples: deque[tuple[float, int]] = deque()  # (time, bytes done) lately: the rate
        self.reported = 0.0
        self.lock = threading.Lock()

    def counted(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(self.model)
        if time.monotonic() - self.reported >= REPORT_EVERY_S:
            self.report()

    def report(self, finished: bool = False) -> None:
        with self.lock:
            now = time.monotonic()
            # each file's bar starts at the bytes it resumed from
            done = self.cached + sum(int(bar.n) for bar in self.bars)
            if finished and self.total is not None:  # a blob another revision had: linked, never counted
                done = self.total
            self.samples.append((now, done))
            while len(self.samples) > 2 and now - self.samples[0][0] > 5.0:
                self.samples.popleft()
            t0, d0 = self.samples[0]
            rate = (done - d0) / (now - t0) if now > t0 else 0.0
            self.reported = now
        if self.on_progress is not None:
            self.on_progress(DownloadProgress(self.model, done, self.total, rate, finished))


class _Quiet:
    """A stream that drops what it is written: huggingface_hub's bars count, Kiln reports."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _tracker_bar(tracker: _Tracker | None) -> type[tqdm]:
    """A tqdm class for huggingface_hub's tqdm_class that draws nothing and tells `tracker` of each count. A
    subclass of tqdm's own class: huggingface_hub would hand a subclass of its tqdm its own `disable` (off where
    stderr is no terminal, so nothing would be counted)."""

    class Bar(tqdm):
        monitor_interval = 0  # no tqdm monitor thread per download

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "file": _Quiet(), "disable": False})
            if tracker is not None and self.unit == "B":
                tracker.bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if tracker is not None and self.unit == "B":
                tracker.counted()
            return shown

    return Bar
