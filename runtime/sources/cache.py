"""The model cache: layout, the entry lock, verification, the completion marker, publishing DEST.

Layout under the cache folder DIR:

    DIR/<kind>/<escaped name>/<key>/            a complete entry (holds MARKER)
    DIR/<kind>/<escaped name>/.<key>.partial/    the download in progress (resumed by the next run)
    DIR/<kind>/<escaped name>/.<key>.lock        the lock file (fcntl.flock) of that entry

`kind` is hf, s3 or local; `key` is the Hub commit, or a content key (a hash of the listing:
names, sizes, ETags) for S3 and local folders. An entry is complete when the folder `<key>/`
exists: the marker is written into the staging folder last, after every file is verified, and
the staging folder is then renamed to `<key>/` in one step, so a half-written entry is never
seen under its final name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import quote

from tokenlane.runtime.sources.errors import SourceError

MARKER = ".tokenlane-complete.json"
STAGING_STAMP = ".tokenlane-staging.json"
MARKER_FORMAT = 1
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class RemoteFile:
    """One file of a listing: its relative path, size and whatever hashes the source gives."""

    path: str
    size: int
    sha256: Optional[str] = None
    md5: Optional[str] = None  # S3's ETag of a single-part upload
    git_sha1: Optional[str] = None  # the Hub's blob id of a non-LFS file

    def __post_init__(self) -> None:
        parts = Path(self.path).parts
        if not self.path or self.path.startswith("/") or ".." in parts:
            raise SourceError(f"the source lists an unsafe file name {self.path!r}")


@dataclass(frozen=True)
class Listing:
    """What a source resolved to: the entry key, the files, and details for the marker."""

    key: str
    files: tuple[RemoteFile, ...]
    details: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def content_key(rows: list[tuple]) -> str:
    """A stable key for sources without a commit: a hash of (name, size, version) rows."""
    digest = hashlib.sha256(json.dumps(sorted(rows), separators=(",", ":")).encode()).hexdigest()
    return digest[:20]


def escape_name(name: str) -> str:
    """One folder name per source name ('/' becomes %2F): unambiguous and reversible."""
    return quote(name.strip("/"), safe="-_.@+=")


@dataclass(frozen=True)
class EntryPaths:
    entry: Path
    staging: Path
    lock: Path


def entry_paths(cache_dir: Path, kind: str, name: str, key: str) -> EntryPaths:
    root = cache_dir / kind / escape_name(name)
    return EntryPaths(entry=root / key, staging=root / f".{key}.partial", lock=root / f".{key}.lock")


def read_marker(folder: Path) -> Optional[dict]:
    try:
        with open(folder / MARKER, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def is_complete(folder: Path, key: str) -> bool:
    marker = read_marker(folder)
    return marker is not None and marker.get("key") == key


class EntryLock:
    """An exclusive fcntl.flock on the entry's lock file, held for the whole download.

    Concurrent fetches of one entry (replicas on one shared volume) wait here; the first
    downloads, the others find the entry complete when they get the lock. On NFS, flock is
    carried by NFS byte-range locks (NFSv4, or NFSv3 with lockd; never mount with `nolock`).
    The holder's host and pid are written into the file for the waiters' log line.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: Optional[int] = None

    def __enter__(self) -> "EntryLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another fetch"
            print(f"waiting for the lock {self.path} (held by {holder})", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def prepare_staging(staging: Path, key: str) -> None:
    """Keep a staging folder of the same key (its files are resumed); wipe one of another key."""
    stamp = staging / STAGING_STAMP
    if staging.exists():
        try:
            same = json.loads(stamp.read_text()).get("key") == key
        except (OSError, ValueError):
            same = False
        if same:
            return
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    stamp.write_text(json.dumps({"key": key}))


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def check_free_space(staging: Path, listing: Listing) -> None:
    """Refuse up front a model larger than the free space left (a clear error, not a full disk)."""
    have = 0
    for remote in listing.files:
        for candidate in (staging / remote.path, staging / (remote.path + ".part")):
            if candidate.is_file():
                have += min(candidate.stat().st_size, remote.size)
    need, free = listing.total_bytes - have, free_bytes(staging)
    if need > free:
        raise SourceError(f"the model needs {need} more bytes but {staging.parent} has only {free} free")


def _hashes(path: Path, size: int) -> tuple[str, str, str]:
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            sha256.update(chunk)
            md5.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), md5.hexdigest(), git.hexdigest()


def verify(staging: Path, listing: Listing) -> list[dict]:
    """Check every listed file's size and the hashes the source gave; a bad file is deleted (the
    next try downloads it again) and raises a transient SourceError. Returns the marker rows."""
    rows = []
    for remote in listing.files:
        path = staging / remote.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SourceError(f"{remote.path}: missing after the download", transient=True) from None
        if size != remote.size:
            path.unlink()
            raise SourceError(f"{remote.path}: size mismatch: got {size} bytes, the source lists {remote.size}",
                              transient=True)
        sha256, md5, git_sha1 = _hashes(path, size)
        for kind, want, got in (("sha256", remote.sha256, sha256), ("md5 (ETag)", remote.md5, md5),
                                ("git blob sha1", remote.git_sha1, git_sha1)):
            if want is not None and want.lower() != got:
                path.unlink()
                raise SourceError(f"{remote.path}: {kind} mismatch: got {got}, the source lists {want}",
                                  transient=True)
        rows.append({"path": remote.path, "size": size, "sha256": sha256})
    return rows


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete(staging: Path, entry: Path, source_uri: str, listing: Listing, rows: list[dict]) -> None:
    """Write the marker last (after every file is verified) and rename staging to the entry."""
    for leftover in (staging / STAGING_STAMP, staging / ".cache"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.exists():
            leftover.unlink()
    marker = {
        "format": MARKER_FORMAT,
        "source": source_uri,
        "key": listing.key,
        **listing.details,
        "files": rows,
        "total_bytes": sum(r["size"] for r in rows),
        "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = staging / (MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / MARKER)
    _fsync_dir(staging)
    os.replace(staging, entry)
    _fsync_dir(entry.parent)


def _unique() -> str:
    """A name part no other fetch uses at the same time, even on another host sharing the volume."""
    return f"{socket.gethostname()}-{os.getpid()}"


class DestinationError(ValueError):
    """DEST is something fetch-model must not replace (a usage error)."""


def _clear_for(dest: Path) -> Optional[Path]:
    """Make room at DEST: returns a folder moved aside (a previous fetch) to delete afterwards."""
    if dest.is_symlink() or not dest.exists():
        return None
    if not dest.is_dir():
        raise DestinationError(f"DEST {dest} exists and is not a folder")
    if not any(dest.iterdir()):
        dest.rmdir()
        return None
    if read_marker(dest) is None:
        raise DestinationError(f"DEST {dest} is a non-empty folder that fetch-model did not write; "
                               "refusing to replace it")
    aside = dest.parent / f".{dest.name}.old-{_unique()}"
    os.replace(dest, aside)
    return aside


def publish_link(dest: Path, entry: Path) -> None:
    """DEST becomes a symlink to the entry, atomically (a new link renamed over the old one)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    aside = _clear_for(dest)
    tmp = dest.parent / f".{dest.name}.link-{_unique()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.abspath(entry), tmp)  # the runtime container mounts the cache at the same path
    os.replace(tmp, dest)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def publish_folder(dest: Path, entry_staging_done: Path) -> None:
    """Without a cache: the completed folder (next to DEST) is renamed to DEST."""
    aside = _clear_for(dest)
    os.replace(entry_staging_done, dest)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
