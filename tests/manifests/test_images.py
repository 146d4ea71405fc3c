"""Container images: the Dockerfiles build what the manifests run, as non-root users; the
operator image installs no torch (DESIGN.md §2: the operator never imports it)."""

from __future__ import annotations

import re
import tomllib

import pytest
from manifests_helpers import MANIFESTS, ROOT, render

IMAGES = MANIFESTS / "images"
RUNTIME = IMAGES / "runtime.Dockerfile"
OPERATOR = IMAGES / "operator.Dockerfile"


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


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile):
    users = [arg for k, arg in final_stage(dockerfile) if k == "USER"]
    assert users, f"{dockerfile.name}: the final stage never switches away from root"
    uid = users[-1].split(":")[0]
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, users[-1]


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_base_images_are_pinned(dockerfile):
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile.read_text(), re.M))
    for keyword, arg in instructions(dockerfile):
        if keyword == "FROM":
            image = arg.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
            if image in {a.split()[-1] for k, a in instructions(dockerfile) if k == "FROM" and " AS " in a.upper()}:
                continue
            assert ":" in image and not image.endswith(":latest"), f"{dockerfile.name}: unpinned base {image}"


def test_runtime_image_has_cuda_torch_and_triton():
    text = RUNTIME.read_text()
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+", text)
    torch_pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    (pinned,) = [d for d in torch_pin if d.startswith("torch")]
    assert f"TORCH_VERSION={pinned.split('==')[1]}" in text, "the image's torch differs from pyproject.toml's pin"
    assert '".[runtime,triton]"' in text
    entry = [a for k, a in final_stage(RUNTIME) if k == "ENTRYPOINT"]
    assert entry and '"tokenlane"' in entry[-1] and '"serve"' in entry[-1]


def test_operator_image_has_no_torch():
    text = OPERATOR.read_text()
    commands = [c.strip() for k, a in instructions(OPERATOR) if k == "RUN" for c in a.split("&&")]
    installs = " ".join(c for c in commands if c.startswith("pip install"))
    assert '".[operator]"' in installs
    for heavy in ("torch", "triton", "runtime", "cuda"):
        assert heavy not in installs.lower(), f"the operator image installs {heavy}: {installs}"
    assert "find_spec('torch') is None" in text, "the build should prove torch did not sneak in"
    # And the [operator] extra itself pulls in no torch.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = extras["dependencies"] + extras["optional-dependencies"]["operator"]
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


def test_build_contexts_keep_out_the_virtualenv_and_tests():
    for dockerfile in (RUNTIME, OPERATOR):
        ignore = (IMAGES / f"{dockerfile.name}.dockerignore").read_text().splitlines()
        assert "**" in ignore, "the context starts from nothing and lists what it needs"
        assert "!.venv" not in ignore and "!tests/**" not in ignore
        copied = [src for k, a in instructions(dockerfile) if k == "COPY" and "--from" not in a
                  for src in a.split()[:-1]]
        allowed = {line[1:].rstrip("/*") for line in ignore if line.startswith("!")}
        for src in copied:
            assert src.rstrip("/") in allowed, f"{dockerfile.name} copies {src}, which its .dockerignore excludes"
