"""The images tier (-m images, opt-in): scripts/build-images.sh builds the operator image and
the CPU runtime image with buildah on a local base, and the tests run them the way the
operator's pod spec does. Needs root and `apt-get install buildah debootstrap`; 10 to 20
minutes on two cores (the base is cached, see scripts/build-images.sh --help)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# --import-mode=importlib does not put test folders on sys.path; the helper module has a
# unique name so it cannot shadow anything else.
sys.path.insert(0, str(Path(__file__).parent))

from images_buildah import ROOT, buildah, engine_env, missing_tools  # noqa: E402

TAGS = {
    "runtime": "localhost/tokenlane-images-test/tokenlane:cpu",
    "operator": "localhost/tokenlane-images-test/tokenlane-operator:test",
}
REPORT = ROOT / "out" / "images" / "report.json"
BUILD_TIMEOUT_S = 1500


def pytest_collection_modifyitems(config, items):
    # A bare `pytest` must not spend minutes building images: the tier runs only when the
    # marker expression asks for it (`-m images`, `-m "images or slow"`, ...).
    expression = config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bimages\b", expression):
        return
    skip = pytest.mark.skip(reason="opt-in tier: run with -m images")
    for item in items:
        if "images" in item.keywords:
            item.add_marker(skip)


def _build_prerequisite() -> str:
    """Why the images cannot be built here ('' when they can)."""
    missing = missing_tools()
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install buildah debootstrap)"
    if os.environ.get("TOKENLANE_IMAGES_BASE"):
        return ""
    if shutil.which("debootstrap") is None:
        return "needs debootstrap for the local base (apt-get install debootstrap), or TOKENLANE_IMAGES_BASE=IMAGE"
    if os.geteuid() != 0:
        return "needs root: debootstrap and buildah's chroot builds run as root"
    return ""


@pytest.fixture(scope="session")
def images_report():
    """Facts the tier reports (image sizes, build time, the smoke test's answer): printed at the
    end (pytest -s) and written to out/images/report.json."""
    report: dict = {}
    yield report
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nimages tier report ({REPORT.relative_to(ROOT)}):\n{json.dumps(report, indent=2)}")


@pytest.fixture(scope="session")
def built_images(images_report):
    """Both images, built once per session by scripts/build-images.sh (the quickstart's entry
    point) on the local Debian base, or on TOKENLANE_IMAGES_BASE when that is set."""
    reason = _build_prerequisite()
    if reason:
        pytest.skip(reason)
    base = os.environ.get("TOKENLANE_IMAGES_BASE")
    command = ["scripts/build-images.sh", "--engine", "buildah", "--variant", "cpu", "--host-pip",
               *(["--base", base] if base else ["--debian-base"]),
               "--runtime-tag", TAGS["runtime"], "--operator-tag", TAGS["operator"]]
    log = REPORT.parent / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        # Its own process group: if the build is interrupted, buildah goes with the script.
        build = subprocess.Popen(command, cwd=ROOT, env=engine_env(), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            returncode = build.wait(timeout=BUILD_TIMEOUT_S)
        finally:
            if build.poll() is None:
                os.killpg(build.pid, signal.SIGTERM)
                build.wait()
    elapsed = time.monotonic() - started
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert returncode == 0, f"{' '.join(command)} exited {returncode} (full log: {log}):\n{tail}"
    images_report["build"] = {"command": " ".join(command), "seconds": round(elapsed), "log": str(log)}
    yield dict(TAGS)
    # The store is the tier's own: drop what this session built, stage images included (vfs
    # stores each as a full copy), and keep the base.
    for tag in TAGS.values():
        buildah("rmi", tag, check=False)
    buildah("rmi", "--prune", check=False)
