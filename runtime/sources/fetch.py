"""`tokenlane fetch-model SOURCE DEST`: fetch a checkpoint into a shared cache (or DEST).

Exit status: 0 on success (the last stdout line is the resolved folder), 2 for usage errors
and a malformed SOURCE, 1 for a source error: the source's own message goes to stderr and to
the termination log, so Kubernetes shows it in the pod status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import traceback
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tokenlane.runtime.sources import cache
from tokenlane.runtime.sources.errors import Backoff, SourceError
from tokenlane.runtime.sources.uri import ModelSource, parse_source

DEFAULT_TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class FetchOptions:
    """The options of one fetch; validated on construction (ValueError names the option)."""

    cache_dir: Optional[str] = None
    allow_patterns: tuple[str, ...] = ()
    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    max_attempts: int = 5
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"--backoff must be >= 0 seconds, got {self.backoff_s}")
        if any(not p.strip() for p in self.allow_patterns):
            raise ValueError("--allow-patterns: an empty pattern")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint-url must be an http(s) URL, got {self.endpoint_url!r}")

    @property
    def backoff(self) -> Backoff:
        return Backoff(attempts=self.max_attempts, base_s=self.backoff_s)


@dataclass(frozen=True)
class FetchResult:
    path: Path  # the resolved folder (the cache entry, or DEST without a cache)
    dest: Path
    cache_hit: bool
    key: str
    files: int
    total_bytes: int
    received_bytes: int


def make_fetcher(source: ModelSource, options: FetchOptions):
    if source.kind == "hf":
        from tokenlane.runtime.sources.hub import HubFetcher

        return HubFetcher(source, options.allow_patterns)
    if source.kind == "s3":
        from tokenlane.runtime.sources.s3 import S3Fetcher

        return S3Fetcher(source, options.allow_patterns, endpoint_url=options.endpoint_url,
                         region=options.region, max_attempts=options.max_attempts)
    from tokenlane.runtime.sources.local import LocalFetcher

    return LocalFetcher(source, options.allow_patterns)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _download_and_verify(fetcher, listing: cache.Listing, staging: Path) -> tuple[list[dict], int]:
    received = fetcher.download(listing, staging)
    checksums = getattr(fetcher, "checksums", {})
    if checksums:
        listing = dataclasses.replace(listing, files=tuple(
            dataclasses.replace(f, sha256=checksums.get(f.path, f.sha256)) for f in listing.files))
    return cache.verify(staging, listing), received


def fetch_model(source: ModelSource, dest: str | Path, options: FetchOptions = FetchOptions()) -> FetchResult:
    """Resolve the source, then reuse or complete its entry under the entry's lock, then publish DEST.

    Raises SourceError (the source's message) or cache.DestinationError (a DEST it must not touch).
    """
    dest = Path(os.path.abspath(dest))
    backoff = options.backoff
    fetcher = backoff.run("resolve", lambda: make_fetcher(source, options), _construction_error)
    listing = backoff.run(f"resolve {source.uri}", fetcher.resolve, fetcher.classify)
    _log(f"{source.uri}: {len(listing.files)} files, {listing.total_bytes} bytes, key {listing.key}")

    if options.cache_dir:
        paths = cache.entry_paths(Path(os.path.abspath(options.cache_dir)), source.kind, source.name, listing.key)
        done = paths.entry
    else:
        paths = cache.EntryPaths(entry=dest, staging=dest.parent / f".{dest.name}.partial",
                                 lock=dest.parent / f".{dest.name}.lock")
        done = dest.parent / f".{dest.name}.complete"

    def result(hit: bool, received: int) -> FetchResult:
        return FetchResult(path=paths.entry, dest=dest, cache_hit=hit, key=listing.key, files=len(listing.files),
                           total_bytes=listing.total_bytes, received_bytes=received)

    if options.cache_dir and dest.is_symlink() and dest.resolve() == paths.entry.resolve() \
            and cache.is_complete(paths.entry, listing.key):
        _log(f"cache hit: {dest} already points at {paths.entry}; nothing downloaded")
        return result(True, 0)

    with cache.EntryLock(paths.lock):
        if cache.is_complete(paths.entry, listing.key) and (options.cache_dir or not paths.entry.is_symlink()):
            hit, received = True, 0
            _log(f"cache hit: {paths.entry} is complete; nothing downloaded")
        elif not options.cache_dir and cache.is_complete(done, listing.key):
            hit, received = False, 0  # a previous run completed but died before the rename
        else:
            for stale in (paths.entry, done) if options.cache_dir else (done,):
                if stale.is_dir() and not stale.is_symlink() and not cache.is_complete(stale, listing.key):
                    shutil.rmtree(stale)  # not under its name by our rename: an older key, or tampered with
            cache.prepare_staging(paths.staging, listing.key)
            cache.check_free_space(paths.staging, listing)
            started = time.monotonic()
            rows, received = backoff.run(
                f"download {source.uri}", lambda: _download_and_verify(fetcher, listing, paths.staging),
                fetcher.classify)
            cache.complete(paths.staging, done, source.uri, listing, rows)
            hit = False
            _log(f"downloaded and verified {len(rows)} files ({listing.total_bytes} bytes) "
                 f"in {time.monotonic() - started:.1f}s")
        if options.cache_dir:
            cache.publish_link(dest, paths.entry)
        elif not hit:
            cache.publish_folder(dest, done)
    return result(hit, received)


def _construction_error(exc: BaseException) -> SourceError:
    return SourceError(f"{type(exc).__name__}: {exc}")


def _write_termination_log(path: Optional[str], message: str) -> None:
    """Kubernetes shows this file's text in the pod's status (terminationMessagePath)."""
    if path is None:
        if not (os.path.exists(DEFAULT_TERMINATION_LOG) and os.access(DEFAULT_TERMINATION_LOG, os.W_OK)):
            return
        path = DEFAULT_TERMINATION_LOG
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message[-4000:] + "\n")  # the kubelet keeps at most 4096 bytes
    except OSError as exc:
        _log(f"could not write the termination log {path}: {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenlane fetch-model",
        description="Fetch a model from the Hugging Face Hub, S3 or a folder into a shared cache (or DEST).",
    )
    parser.add_argument("source", metavar="SOURCE", help="hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, or a folder")
    parser.add_argument("dest", metavar="DEST", help="the folder the runtime's model.path names")
    parser.add_argument("--cache-dir", help="the shared cache: DEST becomes a symlink to the complete entry")
    parser.add_argument("--revision", help="Hub branch, tag or commit (default main)")
    parser.add_argument("--allow-patterns", nargs="+", default=[], metavar="GLOB",
                        help="fetch only the files matching these globs")
    parser.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    parser.add_argument("--region", help="S3 region (default: AWS_REGION / AWS_DEFAULT_REGION)")
    parser.add_argument("--termination-log", help=f"write a failure here (default {DEFAULT_TERMINATION_LOG} "
                                                  "when it exists and is writable)")
    parser.add_argument("--max-attempts", type=int, default=5, help="tries per step for transient errors")
    parser.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                        help="first back-off wait; doubles per retry (capped at 30 s)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for usage errors, 0 for --help
        return int(exc.code or 0)
    try:
        source = parse_source(args.source, revision=args.revision)
        options = FetchOptions(cache_dir=args.cache_dir, allow_patterns=tuple(args.allow_patterns),
                               endpoint_url=args.endpoint_url, region=args.region,
                               max_attempts=args.max_attempts, backoff_s=args.backoff)
        if source.kind == "local" and os.path.abspath(args.dest) == source.name:
            raise ValueError("SOURCE and DEST are the same folder")
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"tokenlane fetch-model: error: {exc}", file=sys.stderr)
        return 2
    try:
        fetched = fetch_model(source, args.dest, options)
    except cache.DestinationError as exc:
        print(f"tokenlane fetch-model: error: {exc}", file=sys.stderr)
        return 2
    except SourceError as exc:
        message = f"fetch-model {source.uri}: {exc.message}"
        print(message, file=sys.stderr, flush=True)
        _write_termination_log(args.termination_log, message)
        return 1
    except Exception as exc:  # a bug or the local disk: still say why in the pod's status
        traceback.print_exc()
        _write_termination_log(args.termination_log, f"fetch-model {source.uri}: {type(exc).__name__}: {exc}")
        return 1
    received = "nothing" if fetched.cache_hit else f"{fetched.received_bytes} bytes"
    print(f"{source.uri} -> {fetched.dest}: {fetched.files} files, {fetched.total_bytes} bytes, "
          f"{'cache hit' if fetched.cache_hit else 'fetched'} (downloaded {received}), key {fetched.key}")
    if fetched.dest != fetched.path:
        print(f"{fetched.dest} -> {fetched.path}")
    print(fetched.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
