"""The CPU runtime image, built for real and run as the operator's pod spec runs it: the pod
that `tokenlane render` makes of the CPU sample (manifests/samples/tiny-cpu.yaml) is played by
`buildah run` — its init container writes the tiny model, its runtime container serves it with
the pod's user, capabilities, environment and volumes, and answers a completion on loopback.

buildah run cannot make the root filesystem read-only, so the test checks the effect instead:
the root filesystem is unchanged afterwards, every write went to the pod's volumes."""

from __future__ import annotations

import os
import subprocess
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml
from images_buildah import ROOT, TIER_TIMEOUT_S, Container, changes, image_config, snapshot, unpacked_size

# The first test's setup builds both images (BUILD_TIMEOUT_S); the suite's 300 s is for one test.
pytestmark = [pytest.mark.images, pytest.mark.timeout(TIER_TIMEOUT_S)]

SAMPLE = ROOT / "manifests" / "samples" / "tiny-cpu.yaml"
POD_NAME = "tiny-images-test"
STARTUP_TIMEOUT_S = 300  # loading torch on a shared two-core machine


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rendered():
    """The objects the operator makes of the CPU sample: the Deployment's pod spec and the
    runtime.yaml its ConfigMap carries."""
    from tokenlane.operator.tools.render import read_documents, render_documents

    objects, problems = render_documents(read_documents([str(SAMPLE)]))
    assert not problems, problems
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return deployment["spec"]["template"]["spec"], config_map


class Pod:
    """A pod spec played with buildah run: its volumes as host folders (emptyDirs owned by
    fsGroup, ConfigMaps written out and mounted read-only), its containers one at a time."""

    def __init__(self, spec: dict, config_map: dict, container: Container, volumes_dir: Path):
        self.spec = spec
        self.container = container
        security = spec["securityContext"]
        self.user = f"{security['runAsUser']}:{security['runAsGroup']}"
        self.host_paths: dict[str, Path] = {}
        for volume in spec["volumes"]:
            path = volumes_dir / volume["name"]
            path.mkdir()
            if "configMap" in volume:
                assert volume["configMap"]["name"] == config_map["metadata"]["name"]
                for key, text in config_map["data"].items():
                    (path / key).write_text(text)
            else:
                assert "emptyDir" in volume, f"this test knows emptyDir and configMap volumes, not {volume}"
                os.chown(path, security["runAsUser"], security["fsGroup"])
            self.host_paths[volume["name"]] = path

    def mount_targets(self) -> set[str]:
        return {m["mountPath"] for c in self.containers() for m in c["volumeMounts"]}

    def containers(self) -> list[dict]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def flags(self, container: dict) -> dict:
        security = container["securityContext"]
        # What the test can reproduce must be what the pod asks for.
        assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
        assert security["capabilities"]["drop"] == ["ALL"] and not security["allowPrivilegeEscalation"]
        env = {}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", item
                env[item["name"]] = POD_NAME
        volumes = [(self.host_paths[m["name"]], m["mountPath"], bool(m.get("readOnly")))
                   for m in container["volumeMounts"]]
        return {"user": self.user, "env": env, "volumes": volumes, "cap_drop_all": True}

    def run(self, container: dict, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.container.run(container["command"] + container["args"], timeout=timeout, **self.flags(container))

    def start(self, container: dict, argv: list[str], log: Path) -> subprocess.Popen:
        return self.container.start(argv, log, **self.flags(container))


def loopback(args: list[str], port: int) -> list[str]:
    """The serve arguments with the pod's 0.0.0.0:8000 replaced: buildah's chroot isolation
    shares the host's network, where 8000 may be taken."""
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


@pytest.fixture(scope="module")
def runtime_container(built_images):
    with Container(built_images["runtime"]) as container:
        yield container


def test_image_runs_as_the_pods_user(runtime_container, rendered):
    spec, _ = rendered
    config = image_config(runtime_container.image)
    security = spec["securityContext"]
    assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert config["Entrypoint"] == ["tokenlane", "serve"]
    env = dict(item.split("=", 1) for item in config["Env"])
    # Without the operator's env (docker run), HOME and the caches still land in /tmp.
    assert env["HOME"] == "/tmp" and env["TRITON_CACHE_DIR"].startswith("/tmp/")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert config["Labels"]["org.opencontainers.image.version"] == version


def test_torch_is_the_pinned_cpu_build(runtime_container):
    pin = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
           ["runtime"] if d.startswith("torch==")][0].split("==")[1]
    result = runtime_container.run(["python", "-c", "import torch; print(torch.__version__)"], user="10001:10001")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{pin}+cpu"


def test_the_image_has_no_c_compiler(runtime_container):
    """The CPU variant carries no compiler: its native kernels came prebuilt in the wheel."""
    result = runtime_container.run(
        ["python", "-c", "import shutil; print([c for c in ('cc', 'gcc', 'clang', 'c99') if shutil.which(c)])"],
        user="10001:10001")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tiny_model_then_serve_answer_a_completion(runtime_container, rendered, tmp_path, images_report):
    from openai import OpenAI

    spec, config_map = rendered
    pod = Pod(spec, config_map, runtime_container, tmp_path)
    (init,) = spec["initContainers"]
    (runtime,) = spec["containers"]
    rootfs = runtime_container.rootfs()
    # The kernel's and buildah's own mount points, and the pod's volumes, are not the image's.
    skip = {"proc", "sys", "dev"} | {target.lstrip("/") for target in pod.mount_targets()}
    # A first run lets buildah create its mount points (/etc/hosts, the volumes' targets).
    warm = runtime_container.run(["true"], **pod.flags(runtime))
    assert warm.returncode == 0, warm.stderr
    before = snapshot(rootfs, skip)

    made = pod.run(init)
    assert made.returncode == 0, made.stdout + made.stderr
    model_dir = pod.host_paths["models"] / Path(init["args"][1]).relative_to("/models")
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()

    port = free_port()
    log = tmp_path / "serve.log"
    started = time.monotonic()
    server = pod.start(runtime, runtime["command"] + loopback(runtime["args"], port), log)
    try:
        deadline = started + STARTUP_TIMEOUT_S
        while True:
            assert server.poll() is None, f"tokenlane serve exited {server.returncode}:\n{log.read_text()}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready after {STARTUP_TIMEOUT_S}s:\n{log.read_text()}"
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        served_name = yaml.safe_load(config_map["data"]["runtime.yaml"])["model"]["servedName"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(model=served_name, prompt="Images are built here, then",
                                               max_tokens=8, temperature=0)
    finally:
        server.terminate()
        server.wait(timeout=60)

    # The engine loaded a prebuilt native library (no compiler in the image to build one).
    served_log = log.read_text()
    assert "native CPU kernels loaded: level " in served_log and ", prebuilt, " in served_log, served_log[-4000:]
    # The start-up log states its phases, process start to ready (runtime/core/startup.py).
    from tokenlane.runtime.core.startup import PHASES, parse_summary

    startup = parse_summary(served_log)
    assert startup is not None and set(startup[1]) <= set(PHASES) and "load" in startup[1], served_log[-4000:]

    choice = completion.choices[0]
    assert completion.model == served_name
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 8
    assert isinstance(choice.text, str) and choice.text
    print(f"\nsmoke: {runtime_container.image} ready in {ready_s:.0f}s; completion {completion.model_dump_json()}")
    images_report["runtime_smoke"] = {"ready_seconds": round(ready_s, 1), "startup_phases": startup[1],
                                      "completion": completion.model_dump()}

    # Read-only root, by its effect: nothing the two containers did changed the image's files.
    after = snapshot(rootfs, skip)
    assert changes(before, after) == [], "written outside the pod's volumes"
    written = [p for volume in ("tmp", "cache", "models") for p in pod.host_paths[volume].rglob("*")]
    assert written and all(p.stat().st_uid == spec["securityContext"]["runAsUser"] for p in written)


def test_report_size(runtime_container, images_report):
    size = unpacked_size(runtime_container.rootfs())
    images_report["runtime_cpu"] = {"image": runtime_container.image, "unpacked_bytes": size,
                                    "unpacked_mb": round(size / 1e6)}
    print(f"\nruntime image (cpu) {runtime_container.image}: {size / 1e6:.0f} MB unpacked")
    assert size < 4e9, "the CPU variant carries no CUDA: it should stay well under four gigabytes"
