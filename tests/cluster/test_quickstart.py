"""docs/quickstart.md verbatim against the real API server.

Every shell command of the page's bash blocks and of its clean-up step runs as written, in
order, with bash, against this tier's cluster: the CRDs, the cluster-wide overlay, the
operator run from this machine (the page's no-image option), the sample, the wait for Ready
(the kubelet stand-in plays the node), the budget patch and every `kubectl get` after it, the
refused patch (its message must be the server's), and the uninstall. Skipped by name: what
needs an image, a node or a port-forward (below, each with its reason); tests/manifests/
test_docs.py replays the page's HTTP steps against a real runtime."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_harness import ROOT, Cluster, condition, kubelet_standin, rbac_denials, wait_for

QUICKSTART = ROOT / "docs" / "quickstart.md"

# (pattern, why it cannot run here) for the page's commands that are not run.
NOT_HERE = [
    (r"^docker build", "builds an image: no Docker engine in the test environment"),
    (r"^scripts/build-images.sh", "builds the images: the opt-in images tier does (-m images)"),
    (r"^kind load", "needs a kind cluster"),
    (r"^cd manifests/overlays/cluster-wide && kustomize edit", "edits the checkout's kustomization"),
    (r"rollout status deployment/tokenlane-operator", "the in-cluster operator needs its image on a node"),
    (r"logs deployment/tokenlane-operator", "the in-cluster operator needs its image on a node"),
    (r"^pip install", "this checkout is installed already (scripts/setup.sh)"),
    (r"port-forward", "needs a pod serving on a node"),
    (r"^curl ", "needs the port-forward"),
    (r"^watch ", "needs the port-forward"),
]


def _commands() -> list[tuple[str, str]]:
    """(command, the comment lines that follow it) from every bash block, in page order, then
    the clean-up step's inline commands."""
    text = QUICKSTART.read_text()
    out: list[tuple[str, str]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        for line in lines:
            if not line:
                continue
            if line.startswith("#"):
                if out:
                    out[-1] = (out[-1][0], out[-1][1] + line.lstrip("# ") + " ")
                continue
            command = re.sub(r"\s+#\s.*$", "", line)  # a trailing comment
            out.append((re.sub(r"\s+", " ", command), ""))
    cleanup = re.search(r"- Clean up:(.*?)(?:\n\n|\Z)", text, re.S).group(1)
    out += [(c, "") for c in re.findall(r"`(kubectl [^`]+)`", cleanup)]
    return out


def _bash(command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def _expectation(command: str):
    """For the page's look-after-a-change commands: what their output must show (the operator
    acts asynchronously, so these are looked at again until they show it), else None."""
    if "grep -A6 'name: interactive'" in command:
        return lambda out: "maxActiveSequences: 4" in out
    if "{.status.observedGeneration} {.metadata.generation}" in command:
        return lambda out: len(set(out.split())) == 1
    if "{.status.effectiveBudgets}" in command:
        return lambda out: '"maxActiveSequences":4' in out.replace(" ", "")
    return None


def _skip_reason(command: str) -> str | None:
    for pattern, why in NOT_HERE:
        if re.search(pattern, command):
            return why
    return None


def test_every_command_of_the_page_is_run_or_skipped_for_a_reason():
    commands = [c for c, _ in _commands()]
    assert sum(1 for c in commands if c.startswith("tokenlane operator")) == 1
    assert sum(1 for c in commands if c.startswith("kubectl") and not _skip_reason(c)) >= 15, commands


@pytest.fixture
def stand_in(crds: Cluster, tmp_path: Path):
    """The kubelet's part for tiny's pods (Ready, podIP 127.0.0.1)."""
    with kubelet_standin(crds, "tokenlane", "app.kubernetes.io/instance=tiny", "tiny-config",
                         tmp_path / "runtime.yaml"):
        yield


def test_the_quickstart_verbatim(crds: Cluster, stand_in, tmp_path: Path):
    env = {**os.environ, "KUBECONFIG": crds.kubeconfig,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    operator = None
    ran: list[str] = []
    try:
        for command, comment in _commands():
            if _skip_reason(command):
                continue
            if command.endswith("&"):  # the operator, in the background as the page runs it
                assert operator is None, "the page starts a second operator"
                log = open(tmp_path / "operator.log", "w")
                operator = subprocess.Popen(["bash", "-c", "exec " + command.rstrip("& ")], cwd=ROOT, env=env,
                                            stdout=log, stderr=subprocess.STDOUT)
                wait_for(lambda: "peering:" in (tmp_path / "operator.log").read_text(), timeout=60,
                         what="the operator's first log lines")
                ran.append(command)
                continue
            if "delete -k manifests/overlays" in command:
                # Alive up to the uninstall, which takes the peering CRD from under it (kopf then exits).
                assert operator is not None and operator.poll() is None, "the operator exited"
            ran.append(command)
            expected = _expectation(command)
            if expected is not None:  # the operator acts asynchronously: look again, as a user would
                wait_for(lambda: (r := _bash(command, env)).returncode == 0 and expected(r.stdout), timeout=60,
                         what=f"`{command}` to show what the page says")
                continue
            result = _bash(command, env)
            if "is invalid" in comment:  # the page shows this one refused, with the server's words
                assert result.returncode != 0, command
                assert " ".join(comment.split()) in " ".join(result.stderr.split()), (comment, result.stderr)
                continue
            assert result.returncode == 0, f"{command}\n{result.stderr}\n{result.stdout[-2000:]}"
            if "wait modelservice/tiny --for=condition=Ready" in command:
                assert "condition met" in result.stdout
        assert rbac_denials((tmp_path / "operator.log").read_text()) == []
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=60)
        print("ran:\n" + "\n".join(ran))
        if (tmp_path / "operator.log").exists():
            print("operator log:\n" + (tmp_path / "operator.log").read_text()[-5000:])
        # The page ends by uninstalling: put back what later modules of the session rely on.
        for namespace in ("tokenlane", "tokenlane-system"):
            crds.kubectl("wait", "--for=delete", f"namespace/{namespace}", "--timeout=90s", check=False, timeout=120)
        crds.kubectl("wait", "--for=delete", "crd/modelservices.tokenlane.dev", "crd/servinglanes.tokenlane.dev",
                     "--timeout=90s", check=False, timeout=120)
        crds.kubectl("apply", "-k", str(ROOT / "crds"))
        wait_for(lambda: (c := condition(crds.get("crd", "modelservices.tokenlane.dev"), "Established"))
                 and c["status"] == "True", what="the CRDs back")
    assert any("delete -k manifests/overlays/cluster-wide" in c for c in ran)
