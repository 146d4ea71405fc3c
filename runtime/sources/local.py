"""A local folder as a source: copied into the cache (or DEST), file by file."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from tokenlane.runtime.sources.cache import STAGING_STAMP, Listing, RemoteFile, content_key
from tokenlane.runtime.sources.errors import SourceError
from tokenlane.runtime.sources.uri import ModelSource


def classify(exc: BaseException) -> SourceError:
    return SourceError(f"{type(exc).__name__}: {exc}")


class LocalFetcher:
    def __init__(self, source: ModelSource, allow_patterns: tuple[str, ...] = ()):
        self.source = source
        self.allow_patterns = allow_patterns
        self.classify = classify

    def resolve(self) -> Listing:
        from fnmatch import fnmatch

        root = Path(self.source.name)
        if not root.is_dir():
            raise SourceError(f"{root} is not a folder")
        files, rows = [], []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".tokenlane-"):
                    continue
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if self.allow_patterns and not any(fnmatch(rel, p) for p in self.allow_patterns):
                    continue
                stat = path.stat()
                files.append(RemoteFile(rel, stat.st_size))
                rows.append((rel, stat.st_size, stat.st_mtime_ns))
        if not files:
            raise SourceError(f"{root} has no files matching {list(self.allow_patterns) or 'anything'}")
        return Listing(key=content_key(rows), files=tuple(files), details={"folder": str(root)})

    def download(self, listing: Listing, staging: Path) -> int:
        root = Path(self.source.name)
        copied = 0
        for remote in listing.files:
            target = staging / remote.path
            if target.name == STAGING_STAMP:
                continue
            if target.exists() and target.stat().st_size == remote.size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / remote.path, target)
            copied += remote.size
            print(f"copied {remote.path} ({remote.size} bytes)", file=sys.stderr, flush=True)
        return copied
