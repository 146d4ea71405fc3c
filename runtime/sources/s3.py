"""The S3 fetcher (boto3): list the objects under the prefix, download each to `<file>.part`
with resume by Range (pinned to the listed ETag with If-Match), check the size, and let the
cache verify the MD5 ETag of single-part uploads and a full-object SHA-256 checksum."""

from __future__ import annotations

import base64
import os
import re
import sys
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

from tokenlane.runtime.sources.cache import Listing, RemoteFile, content_key
from tokenlane.runtime.sources.errors import SourceError
from tokenlane.runtime.sources.uri import ModelSource

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")  # single-part, not SSE-KMS: the ETag is the MD5
_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "RequestTimeout", "RequestTimeTooSkewed", "PreconditionFailed", "BadDigest",
}
_CHUNK = 64 << 10  # small: a killed download keeps all but the last chunk


def classify(exc: BaseException) -> SourceError:
    """S3's own code and message; 5xx, throttling and connection errors are transient."""
    from botocore.exceptions import (
        BotoCoreError, ClientError, ConnectionError as BotoConnectionError, NoCredentialsError,
    )

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = error.get("Code", "?")
        text = f"{code}: {error.get('Message') or exc}"
        bucket = error.get("BucketName")
        if bucket:
            text += f" (bucket {bucket})"
        return SourceError(f"S3 {exc.operation_name}: {text}",
                           transient=status >= 500 or status == 429 or code in _TRANSIENT_CODES)
    if isinstance(exc, NoCredentialsError):
        return SourceError(f"S3: {exc}")
    # a timeout, or a body that does not match the checksum S3 stored (a cut transfer)
    retryable_name = any(word in type(exc).__name__ for word in ("Timeout", "Checksum", "IncompleteRead"))
    if isinstance(exc, (BotoConnectionError, OSError)) or (isinstance(exc, BotoCoreError) and retryable_name):
        return SourceError(f"S3: {type(exc).__name__}: {exc}", transient=True)
    return SourceError(f"S3: {type(exc).__name__}: {exc}")


def _endpoint_overridden(explicit: Optional[str]) -> bool:
    return bool(explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))


class S3Fetcher:
    def __init__(self, source: ModelSource, allow_patterns: tuple[str, ...] = (), *,
                 endpoint_url: Optional[str] = None, region: Optional[str] = None, max_attempts: int = 5):
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        self.source = source
        self.allow_patterns = allow_patterns
        self.classify = classify
        self.checksums: dict[str, str] = {}  # path -> sha256 from S3's full-object checksums
        session = boto3.session.Session()
        # boto3 resolves AWS_ENDPOINT_URL(_S3) and AWS_DEFAULT_REGION itself; AWS_REGION is honoured too.
        region = region or os.environ.get("AWS_REGION") or None
        config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            # S3-compatible stores (MinIO, Ceph) behind an endpoint override want path-style URLs
            s3={"addressing_style": "path"} if _endpoint_overridden(endpoint_url) else {},
        )
        if session.get_credentials() is None:
            # no credentials anywhere: read a public bucket anonymously (`aws s3 --no-sign-request`)
            print("S3: no AWS credentials found; sending unsigned (anonymous) requests", file=sys.stderr)
            config = config.merge(Config(signature_version=UNSIGNED))
        self.client = session.client("s3", endpoint_url=endpoint_url or None, region_name=region, config=config)

    def _key_prefix(self) -> str:
        return f"{self.source.prefix}/" if self.source.prefix else ""

    def resolve(self) -> Listing:
        prefix = self._key_prefix()
        files, rows = [], []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.source.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if not rel or rel.endswith("/"):
                    continue  # folder placeholder objects
                if self.allow_patterns and not any(fnmatch(rel, p) for p in self.allow_patterns):
                    continue
                etag = obj.get("ETag", "").strip('"')
                files.append(RemoteFile(rel, int(obj["Size"]), md5=etag if _MD5_ETAG.match(etag) else None))
                rows.append((rel, int(obj["Size"]), etag))
        if not files:
            raise SourceError(f"no objects under s3://{self.source.name}/"
                              + (f" matching {list(self.allow_patterns)}" if self.allow_patterns else ""))
        self._etags = {rel: etag for rel, _, etag in rows}
        return Listing(key=content_key(rows), files=tuple(files), details={"objects": len(files)})

    def _sha256_checksum(self, key: str, etag: str) -> Optional[str]:
        head = self.client.head_object(Bucket=self.source.bucket, Key=key, IfMatch=etag, ChecksumMode="ENABLED")
        value = head.get("ChecksumSHA256")
        if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
            return None  # a checksum of part checksums cannot be checked against the file
        return base64.b64decode(value).hex()

    def download(self, listing: Listing, staging: Path) -> int:
        """Download every file not yet complete in staging; returns the bytes received."""
        received = 0
        for remote in listing.files:
            received += self._download_one(remote, staging)
        return received

    def _download_one(self, remote: RemoteFile, staging: Path) -> int:
        target = staging / remote.path
        part = target.with_name(target.name + ".part")
        key = self._key_prefix() + remote.path
        etag = self._etags.get(remote.path, "")
        if target.exists() and target.stat().st_size == remote.size:
            return 0
        target.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > remote.size:
            part.unlink()
            have = 0
        received = 0
        if have < remote.size or remote.size == 0:
            args = {"Bucket": self.source.bucket, "Key": key}
            if etag:
                args["IfMatch"] = f'"{etag}"'  # the object must not change between the parts
            if have:
                args["Range"] = f"bytes={have}-"
                print(f"s3://{self.source.bucket}/{key}: resuming at byte {have} of {remote.size}",
                      file=sys.stderr, flush=True)
            response = self.client.get_object(**args)
            mode = "ab" if have and response.get("ContentRange") else "wb"  # 200 (no range): start over
            with open(part, mode) as f:
                for chunk in response["Body"].iter_chunks(_CHUNK):
                    f.write(chunk)
                    received += len(chunk)
                f.flush()
                os.fsync(f.fileno())
        got = part.stat().st_size
        if got != remote.size:
            if got > remote.size:
                part.unlink()
            raise SourceError(f"s3://{self.source.bucket}/{key}: short read: have {got} of {remote.size} bytes",
                              transient=True)
        if remote.sha256 is None and etag:
            sha256 = self._sha256_checksum(key, f'"{etag}"')
            if sha256:
                self.checksums[remote.path] = sha256
        os.replace(part, target)
        print(f"s3://{self.source.bucket}/{key} -> {target} ({remote.size} bytes)", file=sys.stderr, flush=True)
        return received
