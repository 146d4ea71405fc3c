"""Container images, statically: the Dockerfiles build what the manifests run, as non-root
users, on digest-pinned bases; the operator image installs no torch (the operator never imports
it, see docs/architecture.md); the CUDA variant, which cannot be built without a registry, is
consistent with itself. tests/images builds and runs both images (-m images)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
from manifests_helpers import MANIFESTS, ROOT, render

IMAGES = MANIFESTS / "images"
RUNTIME = IMAGES / "runtime.Dockerfile"
OPERATOR = IMAGES / "operator.Dockerfile"
BUILD_SCRIPT = ROOT / "scripts" / "build-images.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage(path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def arg_defaults(path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", path.read_text(), re.M))


def run_commands(steps) -> list[str]:
    """The shell commands of the RUN steps, split at &&."""
    return [c.strip() for k, a in steps if k == "RUN" for c in a.split("&&")]


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile):
    users = [arg for k, arg in final_stage(dockerfile) if k == "USER"]
    assert users, f"{dockerfile.name}: the final stage never switches away from root"
    uid = users[-1].split(":")[0]
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, users[-1]


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_base_images_are_pinned_by_digest(dockerfile):
    args = arg_defaults(dockerfile)
    steps = instructions(dockerfile)
    stages = {a.split()[-1] for k, a in steps if k == "FROM" and " AS " in a.upper()}
    for keyword, arg in steps:
        if keyword != "FROM":
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), arg.split()[0])
        if image in stages or image == "scratch":
            continue
        # The tag is for people; the digest is what an engine pulls, so a rebuild gets the same base.
        assert re.match(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$", image), f"{dockerfile.name}: unpinned base {image}"


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_final_stage_carries_the_oci_labels(dockerfile):
    steps = final_stage(dockerfile)
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', " ".join(a for k, a in steps if k == "LABEL")))
    assert set(labels) >= {f"org.opencontainers.image.{key}" for key in
                           ("title", "source", "version", "revision", "licenses")}
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["license"]
    # Version and revision come from the build (scripts/build-images.sh reads pyproject and git).
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.revision"] == "${REVISION}"
    declared = {a.split("=")[0] for k, a in steps if k == "ARG"}
    assert {"VERSION", "REVISION"} <= declared
    assert arg_defaults(dockerfile)["VERSION"] == PYPROJECT["version"]


def test_runtime_image_has_cuda_torch_and_triton():
    args = arg_defaults(RUNTIME)
    (pinned,) = [d for d in PYPROJECT["optional-dependencies"]["runtime"] if d.startswith("torch")]
    assert args["TORCH_VERSION"] == pinned.split("==")[1], "the image's torch differs from pyproject.toml's pin"
    assert args["EXTRAS"] == "runtime,triton,gpu"  # gpu: NVML gauges
    assert '".[${EXTRAS}]"' in RUNTIME.read_text()
    entry = [a for k, a in final_stage(RUNTIME) if k == "ENTRYPOINT"]
    assert entry and '"tokenlane"' in entry[-1] and '"serve"' in entry[-1]


def test_cuda_base_and_torch_index_agree():
    """The CUDA variant is not built here (no registry): its base tag must be an nvidia/cuda
    runtime image, and the torch index must be the one built for that CUDA version."""
    args = arg_defaults(RUNTIME)
    base = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(runtime|devel)-ubuntu(\d+\.\d+)@sha256:[0-9a-f]{64}$",
                    args["CUDA_IMAGE"])
    assert base, f"CUDA_IMAGE is not a digest-pinned nvidia/cuda runtime image: {args['CUDA_IMAGE']}"
    index = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", args["TORCH_INDEX_URL"])
    assert index, args["TORCH_INDEX_URL"]
    assert index.group(1) == base.group(1) + base.group(2), "torch's CUDA build differs from the base's CUDA"


def test_triton_gets_a_c_compiler_in_the_final_image():
    # Triton compiles its launcher at the first kernel launch, in the running pod.
    commands = " ".join(run_commands(final_stage(RUNTIME)))
    assert re.search(r'\*,triton,\*\) compiler="gcc libc6-dev python3-dev"', commands)
    assert re.search(r"apt-get install [^&]*\$\{compiler\}", commands)
    assert "python3-dev" not in " ".join(run_commands(final_stage(OPERATOR)))


def test_runtime_defaults_keep_writes_under_tmp():
    # The Deployment's root filesystem is read-only; without the operator's env the image's
    # own defaults must still point at a writable /tmp.
    env = " ".join(a for k, a in final_stage(RUNTIME) if k == "ENV")
    for name in ("HOME", "TRITON_CACHE_DIR", "HF_HOME"):
        value = re.search(rf"\b{name}=(\S+)", env)
        assert value and value.group(1).startswith("/tmp"), name


def test_operator_image_has_no_torch():
    text = OPERATOR.read_text()
    installs = " ".join(c for c in run_commands(instructions(OPERATOR)) if c.startswith("pip install"))
    assert '".[operator]"' in installs
    for heavy in ("torch", "triton", "runtime", "cuda"):
        assert heavy not in installs.lower(), f"the operator image installs {heavy}: {installs}"
    assert "find_spec('torch') is None" in text, "the build should prove torch did not sneak in"
    # And the [operator] extra itself pulls in no torch.
    deps = PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["operator"]
    assert not [d for d in deps if re.match(r"(torch|triton|transformers)\b", d)], deps
    entry = [a for k, a in final_stage(OPERATOR) if k == "ENTRYPOINT"]
    assert entry and '"operator"' in entry[-1]


def test_operator_image_exposes_the_ports_the_deployment_uses():
    exposed = {int(p) for k, a in final_stage(OPERATOR) if k == "EXPOSE" for p in a.split()}
    (dep,) = [o for o in render("manifests/overlays/cluster-wide") if o["kind"] == "Deployment"]
    ports = {p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports <= exposed
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(
        [a for k, a in final_stage(OPERATOR) if k == "USER"][-1].split(":")[0])


def test_build_context_keeps_out_the_virtualenv_tests_and_caches():
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "**", "the context starts from nothing and lists what it needs"
    allowed = {line[1:].rstrip("/*") for line in ignore if line.startswith("!")}
    assert not allowed & {".venv", "tests", ".git", "out", "build", ".pytest_cache"}, allowed
    assert {"**/__pycache__", "**/*.pyc"} <= set(ignore)
    for dockerfile in (RUNTIME, OPERATOR):
        copied = [src for k, a in instructions(dockerfile) if k == "COPY" and "--from" not in a
                  for src in a.split()[:-1]]
        for src in copied:
            assert src.rstrip("/") in allowed, f"{dockerfile.name} copies {src}, which .dockerignore excludes"


def test_pip_settings_never_reach_the_image():
    # The build's pip settings are mounted for one step (a named context, a secret), never
    # copied: no wheel, CA bundle or index URL is left in a layer or the image's ENV.
    for dockerfile in (RUNTIME, OPERATOR):
        steps = instructions(dockerfile)
        assert not [a for k, a in steps if k == "ENV" and re.search(r"PIP_(CERT|INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)", a)]
        for keyword, arg in steps:
            if keyword == "RUN" and "PIP_CERT" in arg:
                assert "--mount=type=secret,id=pip-cert" in arg
            if keyword == "RUN" and "/wheels" in arg:
                assert "--mount=type=bind,from=wheels,target=/wheels" in arg


def dry_run(*args: str) -> list[list[str]]:
    """The build commands scripts/build-images.sh would run, one argv per image."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    import shlex

    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def build_args(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")


def test_build_script_tags_what_the_manifests_run():
    from tokenlane.operator.api.schema import DEFAULT_IMAGE

    runtime, operator = dry_run("--engine", "docker")
    assert runtime[runtime.index("-t") + 1] == DEFAULT_IMAGE
    (dep,) = [o for o in render("manifests/base") if o["kind"] == "Deployment"]
    assert operator[operator.index("-t") + 1] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert runtime[runtime.index("-f") + 1] == "manifests/images/runtime.Dockerfile"
    assert build_args(runtime)["VERSION"] == PYPROJECT["version"]
    # The default (CUDA) build uses the Dockerfile's own pinned base and torch index.
    assert "CUDA_IMAGE" not in build_args(runtime) and "TORCH_INDEX_URL" not in build_args(runtime)


def test_build_script_cpu_variant_and_pass_through(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    runtime, operator = dry_run("--engine", "buildah", "--variant", "cpu", "--wheels", str(wheels),
                                "--build-arg", "TORCH_INDEX_URL=https://mirror.example/cpu")
    args = build_args(runtime)
    assert args["EXTRAS"] == "runtime"
    assert args["CUDA_IMAGE"] == arg_defaults(OPERATOR)["BASE_IMAGE"], "the CPU runtime shares the operator's Debian"
    assert f"wheels={wheels}" in runtime
    # A pass-through --build-arg comes after the script's own, so it wins.
    indexes = [runtime[i + 1] for i, a in enumerate(runtime) if a == "--build-arg" and runtime[i + 1].startswith("TORCH_INDEX_URL=")]
    assert indexes == ["TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu", "TORCH_INDEX_URL=https://mirror.example/cpu"]
    assert runtime[:4] == ["buildah", "build", "--isolation", "chroot"]
    assert "--build-context" not in operator


def test_gpu_smoke_script_runs_the_cuda_path_the_pod_way():
    # It needs a GPU to run; here: it parses, and it exercises what only the CUDA image has.
    script = ROOT / "scripts" / "gpu-smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    assert "--device cuda --attention-backend triton" in text
    assert "--read-only --user 10001:10001 --cap-drop ALL" in text
    # Triton loads the launcher it compiles from its cache: a noexec tmpfs would break it.
    assert re.search(r"scratch=rw,exec\b", text)


def test_build_script_rejects_unknown_input():
    for args in (["--variant", "rocm"], ["--engine", "kaniko"], ["--frobnicate"]):
        result = subprocess.run(["bash", str(BUILD_SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                                timeout=60, cwd=ROOT)
        assert result.returncode == 2 and "build-images:" in result.stderr, (args, result.stderr)
