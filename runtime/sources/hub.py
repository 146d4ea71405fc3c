"""The Hugging Face Hub fetcher: huggingface_hub resolves the revision to a commit, lists the
files (sizes, LFS sha256, git blob ids) and downloads them (`snapshot_download` into the staging
folder: its own locks, `HF_ENDPOINT`, `HF_TOKEN`, progress bars). A file that completed in an
interrupted run is kept (huggingface_hub's local-dir metadata); a partial file starts over."""

from __future__ import annotations

from pathlib import Path
from tokenlane.runtime.sources.cache import Listing, RemoteFile
from tokenlane.runtime.sources.errors import SourceError
from tokenlane.runtime.sources.uri import ModelSource

DEFAULT_REVISION = "main"


def _transport_error(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"TransportError", "TimeoutException", "ConnectionError"}) or isinstance(exc, OSError)


def classify(exc: BaseException) -> SourceError:
    """The Hub's own message; 429, 5xx and connection errors are transient, 401/403/404 not."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cause = exc
    while isinstance(cause, LocalEntryNotFoundError) and cause.__cause__ is not None:
        cause = cause.__cause__  # snapshot_download wraps the HTTP error when nothing is cached
    if isinstance(cause, HfHubHTTPError):
        response = getattr(cause, "response", None)
        status = getattr(response, "status_code", None)
        transient = status is not None and (status == 429 or status >= 500)
        return SourceError(str(cause).strip(), transient=transient)
    if isinstance(cause, LocalEntryNotFoundError) or _transport_error(cause):
        return SourceError(f"{type(cause).__name__}: {cause}".strip(), transient=True)
    return SourceError(f"{type(cause).__name__}: {cause}")


class HubFetcher:
    def __init__(self, source: ModelSource, allow_patterns: tuple[str, ...] = ()):
        from huggingface_hub import HfApi

        self.source = source
        self.allow_patterns = list(allow_patterns) or None
        self.api = HfApi()  # HF_ENDPOINT and HF_TOKEN come from the environment
        self.classify = classify

    def resolve(self) -> Listing:
        from huggingface_hub.hf_api import RepoFile
        from huggingface_hub.utils import filter_repo_objects

        revision = self.source.revision or DEFAULT_REVISION
        commit = self.api.model_info(self.source.name, revision=revision).sha
        if not commit:
            raise SourceError(f"the Hub gave no commit for {self.source.uri}")
        files = [
            RemoteFile(
                path=f.path,
                size=int(f.size),
                sha256=f.lfs.sha256 if f.lfs is not None else None,
                git_sha1=f.blob_id if f.lfs is None else None,
            )
            for f in self.api.list_repo_tree(self.source.name, recursive=True, revision=commit)
            if isinstance(f, RepoFile)
        ]
        chosen = set(filter_repo_objects([f.path for f in files], allow_patterns=self.allow_patterns))
        files = [f for f in files if f.path in chosen]
        if not files:
            raise SourceError(f"{self.source.uri} at {commit} has no files matching "
                              f"{self.allow_patterns or 'anything'}")
        return Listing(key=commit, files=tuple(files), details={"revision": revision, "commit": commit})

    def download(self, listing: Listing, staging: Path) -> int:
        """Returns the bytes of the files that were not complete in staging before."""
        from huggingface_hub import snapshot_download

        def complete_bytes() -> int:
            return sum(f.size for f in listing.files
                       if (staging / f.path).is_file() and (staging / f.path).stat().st_size == f.size)

        before = complete_bytes()

        snapshot_download(
            self.source.name,
            revision=listing.key,  # the commit: no second resolution, and it cannot move under us
            local_dir=str(staging),
            allow_patterns=[f.path for f in listing.files],
        )
        return listing.total_bytes - before
