"""An in-process fake Hugging Face hub on 127.0.0.1 for download tests (no network).

Serves one model repo the way huggingface_hub 0.36/1.x/2.x expect (repo info, recursive tree with
LFS sha256, HEAD/GET resolve with ETag/X-Repo-Commit/X-Linked-*, Range → 206) and can misbehave on
request: drop a transfer once, serve corrupted bytes, require a token, act gated. Logs every request.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query string
    range: str | None
    token: str | None


@dataclass
class FakeHub:
    repo_id: str
    files: dict[str, bytes]
    lfs: set[str] = field(default_factory=set)
    commit: str = "3f1e2d4c5b6a79880716253443526170819a0b1c"
    truncate_once: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the drop
    corrupt: set[str] = field(default_factory=set)  # served with one byte flipped, same size
    tokens: set[str] = field(default_factory=set)  # tokens the hub accepts
    private: bool = False  # every route needs an accepted token
    gated: bool = False  # file downloads need an accepted token
    requests: list[Request] = field(default_factory=list)

    def __enter__(self) -> FakeHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = _QuietServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def file_requests(self, method: str = "GET", path: str | None = None) -> list[Request]:
        """Requests for file contents (resolve URLs), optionally for one file."""
        marker = f"/{self.repo_id}/resolve/"
        return [r for r in self.requests if r.method == method and marker in r.path
                and (path is None or r.path.endswith("/" + path))]

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in self.lfs else git_blob_id(data)

    def tree(self, prefix: str) -> list[dict]:
        entries, folders = [], set()
        for path in sorted(self.files):
            data = self.files[path]
            folders.update("/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1))
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
            if path in self.lfs:
                entry["lfs"] = {"oid": self.etag(path), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(folders)]
        return [e for e in entries if not prefix or e["path"].startswith(prefix.rstrip("/") + "/")]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hang up on purpose (cancel)
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def do_GET(self) -> None:
        self._route(send_body=True)

    def _route(self, send_body: bool) -> None:
        hub, raw = self.hub, urlsplit(self.path).path
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        hub.requests.append(Request(self.command, unquote(raw), self.headers.get("Range"), token))
        api, resolve = f"/api/models/{hub.repo_id}", f"/{hub.repo_id}/resolve/"
        if hub.private and token not in hub.tokens:
            return self._deny_private(token)
        if raw == api or raw.startswith(api + "/revision/"):
            rev = unquote(raw[len(api + "/revision/"):]) if raw != api else "main"
            return self._if_revision(rev, lambda: self._json(self._info()))
        if raw.startswith(api + "/tree/"):
            rev, _, prefix = raw[len(api + "/tree/"):].partition("/")
            return self._if_revision(unquote(rev), lambda: self._json(hub.tree(unquote(prefix))))
        if raw.startswith(resolve):
            rev, _, path = raw[len(resolve):].partition("/")
            return self._if_revision(unquote(rev), lambda: self._file(unquote(path), token, send_body))
        self._error(404, "RepoNotFound")

    def _if_revision(self, rev: str, serve) -> None:
        if rev in ("main", self.hub.commit):
            return serve()
        self._error(404, "RevisionNotFound")

    def _info(self) -> dict:
        hub = self.hub
        return {"id": hub.repo_id, "modelId": hub.repo_id, "sha": hub.commit, "private": hub.private,
                "gated": "manual" if hub.gated else False, "tags": [],
                "siblings": [{"rfilename": p} for p in sorted(hub.files)]}

    def _deny_private(self, token: str | None) -> None:
        if token is None:
            return self._error(401, "RepoNotFound")
        self._error(401, None, message="Invalid credentials in Authorization header")

    def _file(self, path: str, token: str | None, send_body: bool) -> None:
        hub = self.hub
        if path not in hub.files:
            return self._error(404, "EntryNotFound", {"X-Repo-Commit": hub.commit})
        if hub.gated and token not in hub.tokens:
            return self._error(401 if token is None else 403, "GatedRepo")
        data = hub.files[path]
        if path in hub.corrupt:
            data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        start, end, status = self._range(len(data))
        headers = {"ETag": f'"{hub.etag(path)}"', "X-Repo-Commit": hub.commit, "Accept-Ranges": "bytes",
                   "Content-Length": str(end - start)}
        if path in hub.lfs:
            headers.update({"X-Linked-Etag": f'"{hub.etag(path)}"', "X-Linked-Size": str(len(data))})
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        self._head(status, headers)
        if send_body:
            self._body(data[start:end], hub.truncate_once.pop(path, None) if status == 200 else None)

    def _range(self, total: int) -> tuple[int, int, int]:
        spec = self.headers.get("Range", "")
        if not spec.startswith("bytes="):
            return 0, total, 200
        first, _, last = spec[len("bytes="):].partition("-")
        return int(first), (int(last) + 1 if last else total), 206

    def _body(self, payload: bytes, cut_at: int | None) -> None:
        if cut_at is None:
            self.wfile.write(payload)
            return
        self.wfile.write(payload[:cut_at])  # promised the full Content-Length, then hang up
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self._head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))})
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, extra: dict | None = None, message: str | None = None) -> None:
        body = json.dumps({"error": message or code or "error"}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        if message:
            headers["X-Error-Message"] = message
        self._head(status, headers)
        if self.command != "HEAD":
            self.wfile.write(body)
