"""A Hugging Face Hub–compatible endpoint on loopback for the fetch-model tests.

It serves folders as model repos over the routes huggingface_hub uses (checked against the
installed client, 2.x): `GET /api/models/{repo}/revision/{rev}` (the commit `sha` and
`siblings`), `GET /api/models/{repo}/tree/{rev}?recursive=...` (paths, sizes, git blob ids,
LFS sha256), and `HEAD`/`GET /{repo}/resolve/{rev}/{path}` (`X-Repo-Commit`, `ETag`,
`X-Linked-Etag`/`X-Linked-Size` for LFS files, `Content-Length`, Range). Errors carry the
`X-Error-Code` / `X-Error-Message` headers the client turns into RepositoryNotFound,
RevisionNotFound, GatedRepo and EntryNotFound errors; a private repo answers 401 without the
right token, a gated one 401 GatedRepo.

Tests control it with a `Gate` (a GET of one file stops after N bytes until the test opens
it: a slow download by construction), `fail_next` (answer the next requests with a status,
to exercise the back-off), and read `requests` (method, path, Range, bytes sent).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")  # served as LFS files, as on the Hub


@dataclass
class Gate:
    """Stop the GET of `path` after `after_bytes` bytes until `release` is set."""

    path: str
    after_bytes: int
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class Logged:
    method: str
    path: str
    range: Optional[str]
    status: int
    bytes_sent: int = 0


@dataclass
class Repo:
    folder: Path
    commit: str
    refs: dict
    token: Optional[str] = None  # private: only this bearer token may read it
    gated: bool = False  # gated rather than private: GatedRepo without the token


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Logged] = []
        self.gate: Optional[Gate] = None
        self.fail_next: list[int] = []  # statuses for the next requests, then normal answers
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, folder: Path, *, token: Optional[str] = None, gated: bool = False,
                 tags=("v1",)) -> str:
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        commit = hashlib.sha1(json.dumps(
            [(f, (folder / f).stat().st_size) for f in files]).encode()).hexdigest()
        self.repos[repo_id] = Repo(folder, commit, {"main": commit, **{t: commit for t in tags}}, token, gated)
        return commit

    def file_gets(self, since: int = 0) -> list[Logged]:
        return [r for r in self.requests[since:] if r.method == "GET" and "/resolve/" in r.path]

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.release.set()
        self._server.shutdown()
        self._server.server_close()


def _handler_for(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _log(self, status: int) -> Logged:
            entry = Logged(self.command, urlsplit(self.path).path, self.headers.get("Range"), status)
            with hub._lock:
                hub.requests.append(entry)
            return entry

        def _error(self, status: int, code: Optional[str], message: str) -> None:
            self._log(status)
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload) -> None:
            self._log(200)
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self, repo: Repo) -> bool:
            if repo.token is None:
                return True
            auth = self.headers.get("Authorization", "")
            if not auth and repo.gated:
                self._error(401, "GatedRepo", "Access to this model is restricted. You must have access to it "
                                              "and be authenticated to access it. Please log in.")
                return False
            if not auth:
                self._error(401, "RepoNotFound", "Repository not found")
                return False
            if auth != f"Bearer {repo.token}":
                self._error(401, None, "Invalid credentials in Authorization header")
                return False
            return True

        def _repo_and_commit(self, repo_id: str, revision: str):
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None, None
            if not self._authorized(repo):
                return None, None
            commit = repo.refs.get(revision, revision if revision == repo.commit else None)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None, None
            return repo, commit

        def do_HEAD(self):
            self._route()

        def do_GET(self):
            self._route()

        def _route(self):
            with hub._lock:
                fail = hub.fail_next.pop(0) if hub.fail_next else None
            if fail is not None:
                return self._error(fail, None, f"injected {fail}")
            split = urlsplit(self.path)
            parts = [unquote(p) for p in split.path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo, commit = self._repo_and_commit(f"{parts[2]}/{parts[3]}", parts[5])
                if repo is None:
                    return
                if parts[4] == "revision":
                    files = sorted(p.relative_to(repo.folder).as_posix() for p in repo.folder.rglob("*") if p.is_file())
                    return self._json({"id": f"{parts[2]}/{parts[3]}", "sha": commit, "private": repo.token is not None,
                                       "siblings": [{"rfilename": f} for f in files]})
                recursive = parse_qs(split.query).get("recursive", ["false"])[0].lower() == "true"
                return self._json(self._tree(repo, recursive))
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, commit = self._repo_and_commit(f"{parts[0]}/{parts[1]}", parts[3])
                if repo is None:
                    return
                return self._file(repo, commit, "/".join(parts[4:]))
            self._error(404, None, f"no route for {split.path}")

        def _tree(self, repo: Repo, recursive: bool) -> list:
            entries = []
            for path in sorted(repo.folder.rglob("*") if recursive else repo.folder.iterdir()):
                rel = path.relative_to(repo.folder).as_posix()
                if path.is_dir():
                    entries.append({"type": "directory", "path": rel, "oid": "0" * 40, "size": 0})
                    continue
                data = path.read_bytes()
                entry = {"type": "file", "path": rel, "size": len(data), "oid": _git_blob_sha1(data)}
                if rel.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            return entries

        def _file(self, repo: Repo, commit: str, rel: str) -> None:
            path = repo.folder / rel
            if not path.is_file():
                return self._error(404, "EntryNotFound", f"{rel} does not exist on {commit}")
            data = path.read_bytes()
            start, status = 0, 200
            range_header = self.headers.get("Range")
            if range_header and self.command == "GET" and range_header.startswith("bytes="):
                first, _, last = range_header[len("bytes="):].partition("-")
                start = int(first or 0)
                end = int(last) + 1 if last else len(data)
                if start >= len(data):
                    return self._error(416, None, "Range Not Satisfiable")
                data, status = data[start:end], 206
            entry = self._log(status)
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            full = path.read_bytes() if status == 206 else data
            if rel.endswith(LFS_SUFFIXES):
                sha256 = hashlib.sha256(full).hexdigest()
                self.send_header("X-Linked-Etag", f'"{sha256}"')
                self.send_header("X-Linked-Size", str(len(full)))
                self.send_header("ETag", f'"{sha256}"')
            else:
                self.send_header("ETag", f'"{_git_blob_sha1(full)}"')
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{start + len(data) - 1}/{len(full)}")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            gate = hub.gate
            if gate is not None and gate.path == rel and not gate.release.is_set() and len(data) > gate.after_bytes:
                self.wfile.write(data[: gate.after_bytes])
                self.wfile.flush()
                entry.bytes_sent = gate.after_bytes
                gate.reached.set()
                gate.release.wait(timeout=120)
                data = data[gate.after_bytes:]
            try:
                self.wfile.write(data)
                entry.bytes_sent += len(data)
            except OSError:  # the client was killed while we waited
                self.close_connection = True

    return Handler
