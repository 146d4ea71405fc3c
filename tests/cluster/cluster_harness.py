"""The cluster tier's harness: a real Kubernetes API server to test against, and helpers.

Which cluster (`TOKENLANE_CLUSTER`):
- `auto` (default): start the loopback control plane of `../shared/k8s` (kube-apiserver and
  kube-controller-manager v1.28.7, etcd, an audit log; no kubelet) when that folder exists,
  else use the cluster `KUBECONFIG` names (kind, minikube, any), else skip with the reason;
- `shared` / `kubeconfig`: only that one (fail if it cannot be had); `off`: skip.

Ports of the started control plane default to ones next to, not on, the usual ones (a
developer's own `up.sh` cluster keeps running) and are overridable for parallel runs:
`TOKENLANE_K8S_APISERVER_PORT` (16443), `TOKENLANE_K8S_ETCD_PORT` (12379),
`TOKENLANE_K8S_ETCD_PEER_PORT` (12380), `TOKENLANE_K8S_KCM_PORT` (20257); its state lives in
`TOKENLANE_K8S_HOME` (default /tmp/tokenlane-k8s-test-<apiserver port>) and is wiped after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
SHARED_K8S = Path(os.environ.get("TOKENLANE_SHARED_K8S", ROOT.parent / "shared" / "k8s"))
OPERATOR_SA = ("tokenlane-system", "tokenlane-operator")
WORKLOAD_NS = "tokenlane"


class Unavailable(Exception):
    """No cluster to test against (the tier skips with this reason)."""


def run(args: list[str], *, input: Optional[str] = None, env: Optional[dict] = None, timeout: float = 120,
        check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, input=input, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout[-2000:]}")
    return result


def wait_for(predicate: Callable[[], Any], timeout: float = 60, what: str = "", interval: float = 0.25) -> Any:
    """Poll until `predicate()` is truthy (a readiness wait with a generous cap, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Cluster:
    kubeconfig: str
    source: str  # "shared" (started here, has an audit log) or "kubeconfig"
    home: Optional[Path] = None  # K8S_HOME of a started control plane
    env: dict = field(default_factory=dict)  # up.sh / down.sh environment

    # ---- kubectl

    def kubectl(self, *args: str, input: Optional[str] = None, check: bool = True, kubeconfig: Optional[str] = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return run(["kubectl", "--kubeconfig", kubeconfig or self.kubeconfig, *args], input=input, check=check,
                   timeout=timeout)

    def get(self, kind: str, name: str, namespace: Optional[str] = None) -> Optional[dict]:
        ns = ["-n", namespace] if namespace else []
        result = self.kubectl("get", kind, name, *ns, "-o", "json", "--show-managed-fields", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def apply(self, docs: list[dict], *args: str) -> subprocess.CompletedProcess:
        return self.kubectl("apply", *args, "-f", "-", input=yaml.safe_dump_all(docs))

    # ---- the started control plane only

    @property
    def has_audit_log(self) -> bool:
        return self.home is not None

    def audit_events(self, since: str = "", user_contains: str = "") -> list[dict]:
        """Write requests (create/update/patch/delete) the API server completed, from its audit log."""
        assert self.home is not None, "only the started control plane has an audit log"
        events = []
        with open(self.home / "run" / "logs" / "audit.log") as f:
            for line in f:
                event = json.loads(line)
                if event.get("stage") != "ResponseComplete" or event.get("stageTimestamp", "") < since:
                    continue
                if user_contains and user_contains not in event["user"]["username"]:
                    continue
                events.append(event)
        return events

    def restart_apiserver(self) -> None:
        """Kill kube-apiserver (SIGKILL: every connection drops at once, as when its node dies;
        on SIGTERM it stops listening at once but lingers for its open watches) and start it again
        with the same command line; etcd and the controller manager keep running."""
        assert self.home is not None
        pid_file = self.home / "run" / "kube-apiserver.pid"
        pid = int(pid_file.read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), timeout=60,
                 what="kube-apiserver to exit")
        port = self.env["APISERVER_PORT"]
        log = self.home / "run" / "logs" / "kube-apiserver.log"
        command = " ".join(shlex.quote(a.decode()) for a in argv)
        for _ in range(5):
            # The killed server's listening socket can outlive it for a moment.
            wait_for(lambda: not run(["ss", "-Hltn", f"sport = :{port}"], check=False).stdout.strip(), timeout=60,
                     what=f"port {port} to be free")
            # Detached as up.sh starts it (not our child: down.sh stops it by the pid file).
            started = run(["bash", "-c", f"setsid nohup {command} >> {shlex.quote(str(log))} 2>&1 < /dev/null & echo $!"])
            new_pid = int(started.stdout.strip())
            pid_file.write_text(f"{new_pid}\n")
            wait_for(lambda: _apiserver_ready(self.kubeconfig) or not Path(f"/proc/{new_pid}").exists()
                             or "zombie" in _state(new_pid), timeout=120, what="kube-apiserver ready again")
            if _apiserver_ready(self.kubeconfig):
                return
        raise AssertionError(f"kube-apiserver did not come back (see {log})")

    def stop(self) -> None:
        if self.home is not None:
            run(["bash", str(SHARED_K8S / "down.sh"), "--wipe"], env=self.env, timeout=120, check=False)


def _apiserver_ready(kubeconfig: str) -> bool:
    return run(["kubectl", "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"], check=False, timeout=20).stdout == "ok"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "gone"


def now_stamp() -> str:
    """An audit-log timestamp of now (RFC 3339, microseconds), for `audit_events(since=...)`."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _reachable(kubeconfig: str) -> Optional[str]:
    try:
        result = run(["kubectl", "--kubeconfig", kubeconfig, "version", "-o", "json", "--request-timeout=10s"],
                     check=False, timeout=20)
    except subprocess.TimeoutExpired:
        return "kubectl version timed out"
    if result.returncode != 0 or "serverVersion" not in result.stdout:
        return result.stderr.strip()[:300] or "no server version"
    return None


def _kubeconfig_cluster() -> Cluster:
    config = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if not Path(config.split(os.pathsep)[0]).exists():
        raise Unavailable("no ../shared/k8s to start and no KUBECONFIG cluster (set KUBECONFIG to a kind/minikube cluster)")
    problem = _reachable(config)
    if problem:
        raise Unavailable(f"the KUBECONFIG cluster is not reachable: {problem}")
    return Cluster(kubeconfig=config, source="kubeconfig")


def _start_shared() -> Cluster:
    if not (SHARED_K8S / "up.sh").exists():
        raise Unavailable(f"{SHARED_K8S}/up.sh not found")
    port = os.environ.get("TOKENLANE_K8S_APISERVER_PORT", "16443")
    home = Path(os.environ.get("TOKENLANE_K8S_HOME", f"/tmp/tokenlane-k8s-test-{port}"))
    env = {
        "K8S_HOME": str(home),
        "APISERVER_PORT": port,
        "ETCD_PORT": os.environ.get("TOKENLANE_K8S_ETCD_PORT", "12379"),
        "ETCD_PEER_PORT": os.environ.get("TOKENLANE_K8S_ETCD_PEER_PORT", "12380"),
        "KCM_PORT": os.environ.get("TOKENLANE_K8S_KCM_PORT", "20257"),
    }
    run(["bash", str(SHARED_K8S / "down.sh"), "--wipe"], env=env, check=False)  # leftovers of a killed run
    run(["bash", str(SHARED_K8S / "up.sh"), "--fresh"], env=env, timeout=600)
    return Cluster(kubeconfig=str(home / "kubeconfig"), source="shared", home=home, env=env)


def start_cluster() -> Cluster:
    """The cluster to test against (see the module docstring); raises Unavailable to skip."""
    mode = os.environ.get("TOKENLANE_CLUSTER", "auto")
    if mode == "off":
        raise Unavailable("TOKENLANE_CLUSTER=off")
    if mode == "kubeconfig":
        return _kubeconfig_cluster()
    if mode == "shared" or (mode == "auto" and (SHARED_K8S / "up.sh").exists()):
        return _start_shared()
    if mode != "auto":
        raise ValueError(f"TOKENLANE_CLUSTER={mode!r}: expected auto, shared, kubeconfig or off")
    return _kubeconfig_cluster()


# --------------------------------------------------------------------------- the operator


def service_account_kubeconfig(cluster: Cluster, path: Path, namespace: str = OPERATOR_SA[0],
                               name: str = OPERATOR_SA[1]) -> Path:
    """A kubeconfig that authenticates as ServiceAccount namespace/name with a token minted
    through the TokenRequest API (what the kubelet mounts into the operator's pod)."""
    token = cluster.kubectl("-n", namespace, "create", "token", name, "--duration=2h").stdout.strip()
    config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    config["users"] = [{"name": f"{namespace}-{name}", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = f"{namespace}-{name}"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The operator's timers check every tick whether a ModelService's spec.tuning.interval /
# spec.autoscaling.interval has passed; the defaults (10 s, 5 s) would make every run of a test's
# short intervals up to that late. A tick adds no decisions: a run still waits for its interval.
TUNING_TICK_S = 1.0
AUTOSCALING_TICK_S = 1.0


class OperatorProcess:
    """`tokenlane operator ARGS` as a subprocess, logging to a file, with its /metrics, and with
    short timer ticks (TUNING_TICK_S, AUTOSCALING_TICK_S)."""

    def __init__(self, kubeconfig: Path, args: list[str], log_path: Path, pod_id: str = "tokenlane-operator-0"):
        self.args, self.log_path = args, log_path
        self.metrics_port = free_port()
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenlane.cli", "operator", *args, "--liveness", "",
             "--metrics-port", str(self.metrics_port), "--log-format", "plain",
             "--tuning-tick-seconds", str(TUNING_TICK_S), "--autoscaling-tick-seconds", str(AUTOSCALING_TICK_S)],
            cwd="/", stdout=self._log, stderr=subprocess.STDOUT, text=True,
            # POD_ID is kopf's peering identity; the Deployment sets it to the pod's name, so a
            # restarted container is the same peer and does not wait for its own stale keep-alive.
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "POD_ID": pod_id})

    def log(self) -> str:
        return self.log_path.read_text()

    def reconciles(self) -> float:
        """ModelService reconciles finished so far (any result), from the operator's /metrics."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tokenlane_operator_reconciles_total{"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when the node dies."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


def operator_args_from(overlay_docs: list[dict]) -> list[str]:
    """The args the overlay's operator Deployment runs with, minus the probes' and metrics'
    ports (the test owns those)."""
    (deployment,) = [d for d in overlay_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tokenlane-operator"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if not a.startswith(("--liveness", "--metrics-port"))]


def kustomize(rel: str) -> list[dict]:
    result = run(["kubectl", "kustomize", str(ROOT / rel)], timeout=60)
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def start_namespaced_operator(cluster: Cluster, workdir: Path, pod_id: str) -> "OperatorProcess":
    """Install the namespaced overlay and run the operator as its ServiceAccount, with the
    overlay's own args (what a module that needs a live operator under real RBAC starts)."""
    overlay = "manifests/overlays/namespaced"
    cluster.kubectl("apply", "-k", str(ROOT / overlay))
    wait_for(lambda: cluster.kubectl("-n", OPERATOR_SA[0], "get", "serviceaccount", OPERATOR_SA[1], check=False)
             .returncode == 0, what="the operator's ServiceAccount")
    kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
    return OperatorProcess(kubeconfig, operator_args_from(kustomize(overlay)), workdir / "operator.log",
                           pod_id=pod_id)


@contextlib.contextmanager
def kubelet_standin(cluster: Cluster, namespace: str, selector: str, configmap: str, mounted: Path):
    """../shared/k8s/kubelet-standin.sh while the block runs: marks the pods matching `selector`
    Ready (podIP 127.0.0.1) and keeps `mounted` equal to the ConfigMap's runtime.yaml, as a
    mounted volume would. Yields False where there is no stand-in (a real cluster's kubelet)."""
    standin = SHARED_K8S / "kubelet-standin.sh"
    if not standin.exists():
        yield False
        return
    proc = subprocess.Popen(["bash", str(standin), namespace, selector, configmap, "runtime.yaml", str(mounted), "0.5"],
                            env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield True
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def rbac_denials(log: str) -> list[str]:
    """Log lines where the API server refused the operator by RBAC ("... is forbidden: User
    "..." cannot ..."); a 403 for a namespace being deleted is not one."""
    import re

    return [line[:500] for line in log.splitlines() if re.search(r'forbidden: User \\?"', line)]


def condition(obj: Optional[dict], type_: str) -> Optional[dict]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None
