"""A local stand-in for the Hugging Face Hub, for tests that drive Kiln's downloads through huggingface_hub itself
(these machines reach no hub). It speaks the routes snapshot_download uses: the repo's commit
(GET /api/models/{id}/revision/{rev}), its file listing (GET /api/models/{id}/tree/{rev}) and the files (HEAD and
GET /{id}/resolve/{rev}/{path}, ranges for a resumed download), and answers errors with the X-Error-Code headers
huggingface_hub maps to its exceptions. It records every request, and can slow file bodies down (a download to
watch, or to kill halfway)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

PIECE = 1 << 20  # a slowed body is written a piece at a time


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    # a gated repo: its files need this bearer token (its metadata does not, as on the Hub)
    token: str | None = None


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # unquoted, without the query
    range: str | None


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    bytes_per_s: float | None = None  # file bodies written at this rate; None: at once
    url: str = ""

    def add(
        self, repo_id: str, directory: Path, extra: dict[str, bytes] | None = None, token: str | None = None
    ):
        """A repo holding every file of `directory` (and `extra`: path -> content)."""
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()
        }
        files.update(extra or {})
        digest = hashlib.sha1(repo_id.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        self.repos[repo_id] = Repo(files, digest.hexdigest(), token)

    def start(self) -> str:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_requests(self, suffix: str = "") -> list[Request]:
        return [r for r in self.requests if "/resolve/" in r.path and r.path.endswith(suffix)]


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _etag(name: str, content: bytes) -> str:
    """The Hub's: an LFS file's sha256, else its git blob id."""
    return hashlib.sha256(content).hexdigest() if name.endswith(".safetensors") else _git_oid(content)


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the request list is the log
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(Request(self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                self._api("/".join(parts[2:4]), parts[4], parts[5])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "EntryNotFound")

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:  # as the Hub answers an anonymous client: 401 for a repo that may be private
                self._error(401, "RepoNotFound")
            elif revision not in ("main", repo.sha):
                self._error(404, "RevisionNotFound")
            else:
                return repo
            return None

        def _api(self, repo_id: str, route: str, revision: str) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if route == "revision":
                siblings = [{"rfilename": name} for name in sorted(repo.files)]
                info = {"id": repo_id, "sha": repo.sha, "siblings": siblings, "gated": bool(repo.token)}
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
                return
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                | (
                    {"lfs": {"oid": _etag(name, data), "size": len(data), "pointerSize": 134}}
                    if name.endswith(".safetensors")
                    else {}
                )
                for name, data in sorted(repo.files.items())
            ]
            self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", {"X-Repo-Commit": repo.sha})
                return
            if name not in repo.files:
                self._error(404, "EntryNotFound", {"X-Repo-Commit": repo.sha})
                return
            data = repo.files[name]
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_etag(name, data)}"', "Accept-Ranges": "bytes"}
            start = _range_start(self.headers.get("Range"))
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._send(206 if start else 200, data[start:], headers, body)

        def _error(self, status: int, code: str, headers: dict[str, str] | None = None) -> None:
            self._send(
                status, b"{}", {"X-Error-Code": code, "Content-Type": "application/json", **(headers or {})}
            )

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool = True) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if not body or self.command == "HEAD":
                return
            for at in range(0, len(data), PIECE):
                if hub.bytes_per_s:
                    time.sleep(PIECE / hub.bytes_per_s)
                try:
                    self.wfile.write(data[at : at + PIECE])
                except (BrokenPipeError, ConnectionResetError):  # a killed client
                    return

    return Handler


def _range_start(header: str | None) -> int:
    """The first byte of a `bytes=N-` range (the only kind huggingface_hub asks for), else 0."""
    if not header or not header.startswith("bytes="):
        return 0
    first = header[len("bytes=") :].split("-", 1)[0]
    return int(first) if first.isdigit() else 0
