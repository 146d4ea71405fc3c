"""The operator image, built for real: it runs as the Deployment's numeric non-root user, its
`tokenlane operator` starts, and torch is not in it."""

from __future__ import annotations

import tomllib

import pytest
from images_buildah import ROOT, TIER_TIMEOUT_S, Container, changes, image_config, snapshot, unpacked_size

# The first test's setup builds both images (BUILD_TIMEOUT_S); the suite's 300 s is for one test.
pytestmark = [pytest.mark.images, pytest.mark.timeout(TIER_TIMEOUT_S)]


@pytest.fixture(scope="module")
def operator_container(built_images):
    with Container(built_images["operator"]) as container:
        yield container


def test_runs_as_uid_10001_by_default(operator_container):
    config = image_config(operator_container.image)
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["tokenlane", "operator"]
    # No --user: buildah run takes the image's USER, as a kubelet would.
    result = operator_container.run(["id", "-u"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "10001"


def test_operator_help_as_uid_10001(operator_container):
    result = operator_container.run(["tokenlane", "operator", "--help"], user="10001:10001")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage: tokenlane operator" in result.stdout
    assert "--liveness" in result.stdout  # kopf's health endpoint, the Deployment's probe


def test_imports_the_operator_without_torch(operator_container):
    ok = operator_container.run(["python", "-c", "import tokenlane.operator.main, kopf, kubernetes"],
                                user="10001:10001")
    assert ok.returncode == 0, ok.stderr
    no_torch = operator_container.run(["python", "-c", "import torch"], user="10001:10001")
    assert no_torch.returncode != 0
    assert "No module named 'torch'" in no_torch.stderr


def test_labels_name_the_version(operator_container):
    labels = image_config(operator_container.image)["Labels"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.revision"] not in ("", "unknown")


def test_the_root_filesystem_check_sees_a_stray_write(operator_container):
    # The runtime test proves a read-only root by comparing snapshots; here that comparison
    # catches a write the container's user can make (Debian's /var/tmp is world-writable).
    rootfs = operator_container.rootfs()
    skip = {"proc", "sys", "dev"}
    before = snapshot(rootfs, skip)
    wrote = operator_container.run(["sh", "-c", "echo stray > /var/tmp/stray"], user="10001:10001")
    assert wrote.returncode == 0, wrote.stderr
    assert changes(before, snapshot(rootfs, skip)) == ["+ var/tmp/stray"]


def test_report_size(operator_container, images_report):
    size = unpacked_size(operator_container.rootfs())
    images_report["operator"] = {"image": operator_container.image, "unpacked_bytes": size,
                                 "unpacked_mb": round(size / 1e6)}
    print(f"\noperator image {operator_container.image}: {size / 1e6:.0f} MB unpacked")
    assert size < 1e9, "the operator image carries no torch: it should stay well under a gigabyte"
