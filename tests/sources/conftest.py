"""fetch-model harness: a Hub-compatible endpoint and moto's S3 server on loopback (see
sources_harness.py for `tokenlane fetch-model` run as a real child process against them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# --import-mode=importlib does not put test folders on sys.path: hub_server.py, s3_server.py
# and sources_harness.py (unique names) are the helper modules of this folder.
sys.path.insert(0, str(Path(__file__).parent))

from hub_server import HubServer  # noqa: E402
from sources_harness import BUCKET, GATED_REPO, HF_TOKEN, PREFIX, PRIVATE_REPO, REPO  # noqa: E402


@pytest.fixture
def hub(tiny_model_dir):
    server = HubServer()
    server.add_repo(REPO, Path(tiny_model_dir))
    server.add_repo(PRIVATE_REPO, Path(tiny_model_dir), token=HF_TOKEN)
    server.add_repo(GATED_REPO, Path(tiny_model_dir), token=HF_TOKEN, gated=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(tiny_model_dir):
    import boto3

    from s3_server import S3Server

    server = S3Server()
    server.start()
    client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(Path(tiny_model_dir).iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.name}", Body=path.read_bytes())
    server.requests.clear()
    yield server
    server.stop()


