"""A local stand-in of the Hugging Face Hub's HTTP API, enough for `snapshot_download`.

Served on 127.0.0.1 (port 0, read back); point `endpoint=` (or HF_ENDPOINT) at `url`.
Routes, as the Hub answers them (huggingface_hub's `HfApi.repo_info`, `list_repo_tree`,
`get_hf_file_metadata` and `http_get` read these):

- GET  /api/models/<repo>/revision/<rev>      {"id", "sha", "siblings"}
- GET  /api/models/<repo>/tree/<rev>[/<dir>]  [{"type": "file", "path", "size", "oid", "lfs"?}]
- HEAD /<repo>/resolve/<rev>/<file>           X-Repo-Commit, ETag (LFS: X-Linked-Etag, X-Linked-Size
                                              = the sha256 and size), Content-Length
- GET  /<repo>/resolve/<rev>/<file>           the bytes; `Range: bytes=N-` answers 206

An LFS file's etag is its sha256, a small file's its git blob id, as on the Hub.
`cut_after[file] = n` ends the first GET of `file` after n bytes (a dropped connection).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    lfs_min: int = 64  # files at least this large are LFS files (etag = sha256)

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= self.lfs_min

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_id(data)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    status_override: int | None = None  # every API answer with this status (a Hub outage)

    def add(self, repo: FakeRepo) -> None:
        self.repos[repo.repo_id] = repo

    def gets(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + file)]


_API = re.compile(
    r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/?]+)(?P<sub>/[^?]*)?"
)
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>[^?]+)")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _json(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                self.send_header("X-Error-Code", "RepoNotFound" if status == 404 else "Error")
            self.end_headers()
            self.wfile.write(data)

        def _record(self) -> None:
            hub.requests.append(
                Request(
                    self.command,
                    self.path.split("?")[0],
                    self.headers.get("Range") or self.headers.get("range"),
                    self.headers.get("Authorization"),
                )
            )

        def _repo(self, repo_id: str, rev: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or rev not in ("main", repo.commit):
                return None
            return repo

        def do_GET(self) -> None:
            self._record()
            if hub.status_override is not None:
                self._json(hub.status_override, {"error": "the Hub is down"})
                return
            m = _API.fullmatch(self.path.split("?")[0])
            if m is not None:
                repo = self._repo(m["repo"], m["rev"])
                if repo is None:
                    self._json(404, {"error": "Repository Not Found"})
                    return
                if m["what"] == "revision":
                    self._json(
                        200,
                        {
                            "id": repo.repo_id,
                            "sha": repo.commit,
                            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                        },
                    )
                    return
                entries = []
                for p in sorted(repo.files):
                    e: dict[str, object] = {
                        "type": "file",
                        "path": p,
                        "size": len(repo.files[p]),
                        "oid": git_blob_id(repo.files[p]),
                    }
                    if repo.is_lfs(p):
                        size = len(repo.files[p])
                        e["lfs"] = {"oid": repo.etag(p), "size": size, "pointerSize": 132}
                    entries.append(e)
                self._json(200, entries)
                return
            self._resolve(body=True)

        def do_HEAD(self) -> None:
            self._record()
            self._resolve(body=False)

        def _resolve(self, *, body: bool) -> None:
            m = _RESOLVE.fullmatch(self.path.split("?")[0])
            repo = self._repo(m["repo"], m["rev"]) if m is not None else None
            if m is None or repo is None or m["file"] not in repo.files:
                self._json(404, {"error": "Entry Not Found"})
                return
            name = m["file"]
            data = repo.files[name]
            start = 0
            rng = self.headers.get("Range")
            if rng and (rm := re.fullmatch(r"bytes=(\d+)-", rng)):
                start = int(rm[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            if repo.is_lfs(name):
                self.send_header("X-Linked-Etag", f'"{repo.etag(name)}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            cut = hub.cut_after.pop(name, None)
            if cut is not None:
                self.wfile.write(data[start : start + cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)
