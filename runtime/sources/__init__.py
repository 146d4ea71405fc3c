"""Model sources: fetch a checkpoint from the Hugging Face Hub, S3 or a local folder into a
shared cache (`tokenlane fetch-model`, the init container of a ModelService with a source).

Modules:

- `uri`: `ModelSource`, a parsed and validated SOURCE (`hf://ORG/NAME[@REV]`,
  `s3://BUCKET/PREFIX`, a local folder); bad URIs raise ValueError;
- `errors`: `SourceError` (the source's own message, transient or not) and the bounded
  exponential back-off that retries the transient ones;
- `cache`: the cache layout, the entry lock, the completion marker, the verification of sizes
  and hashes, and publishing DEST (an atomic symlink or rename);
- `hub`, `s3`, `local`: one fetcher per kind (huggingface_hub, boto3, a file copy);
- `fetch`: `FetchOptions`, `fetch_model()` and the `tokenlane fetch-model` command line.

This room imports nothing of the runtime but `tokenlane.runtime.config` (and needs none of it
today): the init container runs it without torch.
"""

from tokenlane.runtime.sources.errors import SourceError
from tokenlane.runtime.sources.uri import ModelSource, parse_source

__all__ = ["ModelSource", "SourceError", "parse_source"]
