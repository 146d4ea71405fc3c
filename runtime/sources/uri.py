"""SOURCE strings: `hf://ORG/NAME[@REV]`, `s3://BUCKET/PREFIX`, or a local folder."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

KINDS = ("hf", "s3", "local")

# The Hub's repo id rules: [ORG/]NAME, letters, digits, '-', '_', '.'; no '--' or '..'.
_HF_REPO = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")
# S3 bucket names: 3-63 characters, lower case letters, digits, '.', '-'.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint comes from.

    `name` is the repo id (hf), `BUCKET/PREFIX` (s3) or the absolute folder (local);
    `revision` is the Hub branch, tag or commit (hf only; None means `main`).
    """

    kind: str
    name: str
    revision: Optional[str] = None
    bucket: Optional[str] = None
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"source kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.revision is not None and self.kind != "hf":
            raise ValueError(f"a revision applies to hf:// sources only, not {self.uri}")
        if self.revision is not None and (not self.revision or self.revision != self.revision.strip()):
            raise ValueError(f"revision {self.revision!r} is empty or has surrounding blanks")

    @property
    def uri(self) -> str:
        if self.kind == "hf":
            return f"hf://{self.name}" + (f"@{self.revision}" if self.revision else "")
        if self.kind == "s3":
            return f"s3://{self.name}"
        return self.name


def parse_source(text: str, revision: Optional[str] = None) -> ModelSource:
    """Parse SOURCE; `revision` (from `--revision`) overrides nothing: giving both
    `hf://ORG/NAME@REV` and a different `--revision` is an error."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("SOURCE is empty: give hf://ORG/NAME[@REV], s3://BUCKET/PREFIX or a folder")
    text = text.strip()
    if text.startswith("hf://"):
        body = text[len("hf://"):]
        repo, _, inline = body.partition("@")
        if "@" in body and not inline:
            raise ValueError(f"SOURCE {text!r}: nothing after '@' (give a branch, tag or commit)")
        repo = repo.strip("/")
        if not _HF_REPO.match(repo) or "--" in repo or ".." in repo:
            raise ValueError(f"SOURCE {text!r}: the Hub repo must be ORG/NAME or NAME (letters, digits, '-', '_', '.')")
        if inline and revision and inline != revision:
            raise ValueError(f"SOURCE {text!r} names revision {inline!r} but --revision is {revision!r}")
        return ModelSource("hf", repo, revision=inline or revision or None)
    if text.startswith("s3://"):
        body = text[len("s3://"):]
        bucket, _, prefix = body.partition("/")
        if not _S3_BUCKET.match(bucket) or ".." in bucket:
            raise ValueError(f"SOURCE {text!r}: {bucket!r} is not a valid S3 bucket name")
        prefix = prefix.strip("/")
        if revision:
            raise ValueError(f"--revision applies to hf:// sources only, not {text!r}")
        name = f"{bucket}/{prefix}" if prefix else bucket
        return ModelSource("s3", name, bucket=bucket, prefix=prefix)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"SOURCE {text!r}: unknown scheme {scheme!r}:// (use hf://, s3:// or a folder)")
    if revision:
        raise ValueError(f"--revision applies to hf:// sources only, not the folder {text!r}")
    return ModelSource("local", os.path.abspath(text))
