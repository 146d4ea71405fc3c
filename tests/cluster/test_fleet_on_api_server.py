"""The fleet on a real API server: the router's EndpointSlice discovery under the router's own
RBAC (manifests/base/router-rbac.yaml), and the operator (namespaced overlay, its own
ServiceAccount) rendering the router and owning the Deployment's replicas while autoscaling is
on, with the ModelService's spec untouched; with autoscaling off the scale subresource drives
the Deployment again.

Only the metrics are stood in for: a small HTTP server in this process answers Prometheus's
instant-query API with a fleet KV usage the test sets. The tests of this module run in order
and share one installation (module fixtures)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import uvicorn
import yaml

from cluster_harness import (
    ROOT,
    WORKLOAD_NS,
    Cluster,
    OperatorProcess,
    kustomize,
    operator_args_from,
    rbac_denials,
    service_account_kubeconfig,
    wait_for,
)

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from test_scaling import AUTOSCALING_INVALID  # noqa: E402  (tests/operator: the offline CEL cases)

from tokenlane.bench.serve_proc import free_port  # noqa: E402
from tokenlane import kube  # noqa: E402
from tokenlane.runtime.fleet.discovery import EndpointSliceWatcher  # noqa: E402
from tokenlane.runtime.fleet.router import RouterOptions, create_router_app  # noqa: E402
from tokenlane.runtime.fleet.state import BackendSet  # noqa: E402

NAMESPACED = "manifests/overlays/namespaced"
ROUTER_SA = "tokenlane-router"
NAME = "fleet"  # the ModelService of this module (the tiny sample, renamed)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def installed(crds: Cluster) -> Cluster:
    crds.kubectl("apply", "-k", str(ROOT / NAMESPACED))
    wait_for(lambda: crds.kubectl("-n", WORKLOAD_NS, "get", "serviceaccount", ROUTER_SA, check=False)
             .returncode == 0, what="the router's ServiceAccount")
    return crds


class FakePrometheus:
    """Prometheus's /api/v1/query, answering the fleet KV usage query with `kv_usage` and
    every other query with no series (so only the KV signal drives the decisions)."""

    def __init__(self) -> None:
        self.kv_usage = 0.5
        self.queries: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                query = parse_qs(urlparse(self.path).query).get("query", [""])[0]
                fake.queries.append(query)
                result = ([{"metric": {}, "value": [0, str(fake.kv_usage)]}]
                          if "kv_cache_usage_ratio" in query else [])
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def prometheus():
    fake = FakePrometheus()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def operator(installed: Cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet-operator")
    kubeconfig = service_account_kubeconfig(installed, workdir / "operator.kubeconfig")
    process = OperatorProcess(kubeconfig, operator_args_from(kustomize(NAMESPACED)), workdir / "operator.log",
                              pod_id="tokenlane-operator-fleet")
    yield process
    installed.kubectl("-n", WORKLOAD_NS, "delete", "msvc", NAME, "--ignore-not-found", "--wait=true",
                      "--timeout=60s", check=False)
    process.stop()
    print(process.log()[-6000:])


def tiny_model_service(**spec) -> dict:
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text()) if d]
    doc = copy.deepcopy(next(d for d in docs if d["kind"] == "ModelService"))
    doc["metadata"] = {"name": NAME, "namespace": WORKLOAD_NS}
    doc["spec"].update(spec)
    return doc


def api_access(cluster: Cluster, token: str, workdir: Path) -> kube.Credentials:
    """The router's credentials in its pod: the API server, its CA and the ServiceAccount's token
    in files (what the kubelet mounts), read through tokenlane.kube.in_cluster."""
    config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    server = config["clusters"][0]["cluster"]
    mount = workdir / "serviceaccount"
    mount.mkdir(exist_ok=True)
    if "certificate-authority-data" in server:
        (mount / "ca.crt").write_bytes(base64.b64decode(server["certificate-authority-data"]))
    else:
        (mount / "ca.crt").write_bytes(Path(server["certificate-authority"]).read_bytes())
    (mount / "token").write_text(token)
    (mount / "namespace").write_text(WORKLOAD_NS)
    url = urlparse(server["server"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KUBERNETES_SERVICE_HOST", url.hostname)
        env.setenv("KUBERNETES_SERVICE_PORT", str(url.port or 443))
        return kube.in_cluster(mount)


def endpoint_slice(name: str, service: str, addresses: dict[str, bool]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": WORKLOAD_NS,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a, ready in addresses.items()]}


async def eventually(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------- the CRD


@pytest.mark.parametrize("autoscaling, message", AUTOSCALING_INVALID)
def test_api_server_refuses_invalid_autoscaling(installed: Cluster, autoscaling: dict, message: str):
    doc = tiny_model_service(autoscaling=autoscaling)
    result = installed.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_api_server_accepts_and_defaults_autoscaling_and_router(installed: Cluster):
    doc = tiny_model_service(autoscaling={"enabled": True, "prometheusUrl": "http://p:9090", "maxReplicas": 4},
                             router={"enabled": True})
    result = installed.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(doc))
    spec = json.loads(result.stdout)["spec"]
    assert spec["autoscaling"] == {"enabled": True, "prometheusUrl": "http://p:9090", "minReplicas": 1,
                                   "maxReplicas": 4, "interval": "30s", "window": "2m",
                                   "scaleUp": {"stabilizationWindow": "0s"},
                                   "scaleDown": {"stabilizationWindow": "5m"}, "kvUsageTarget": 0.75,
                                   "scaleToZeroAfter": "15m"}
    assert spec["router"] == {"enabled": True, "replicas": 1, "serviceAccountName": ROUTER_SA}
    # Scale to zero: accepted with the router on (without it: AUTOSCALING_INVALID above).
    zero = tiny_model_service(autoscaling={"enabled": True, "prometheusUrl": "http://p:9090", "minReplicas": 0,
                                           "maxReplicas": 4, "scaleToZeroAfter": "1h"}, router={"enabled": True})
    result = installed.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(zero))
    assert json.loads(result.stdout)["spec"]["autoscaling"]["minReplicas"] == 0


# --------------------------------------------------------------------------- discovery


async def test_router_discovery_follows_endpointslices(installed: Cluster, tmp_path: Path):
    """Hand-made EndpointSlices (no kubelet needed), read with the router's own token: the ready
    endpoints become the backends, and follow an endpoint turning unready, a new slice and a
    deleted one."""
    service = "discovery-test"
    installed.apply([endpoint_slice(f"{service}-a", service, {"10.1.0.1": True, "10.1.0.2": False})])
    token = installed.kubectl("-n", WORKLOAD_NS, "create", "token", ROUTER_SA, "--duration=1h").stdout.strip()
    backends = BackendSet()
    watcher = EndpointSliceWatcher(api_access(installed, token, tmp_path), WORKLOAD_NS, service, backends,
                                   backoff_s=0.2)
    await watcher.start()
    try:
        assert backends.urls == ("http://10.1.0.1:8000",)
        installed.apply([endpoint_slice(f"{service}-a", service, {"10.1.0.1": True, "10.1.0.2": True})])
        await eventually(lambda: backends.urls == ("http://10.1.0.1:8000", "http://10.1.0.2:8000"), "ready endpoint")
        installed.apply([endpoint_slice(f"{service}-b", service, {"10.1.0.3": True}),
                         endpoint_slice("someone-else", "other-service", {"10.9.9.9": True})])
        await eventually(lambda: len(backends.urls) == 3, "a second slice")
        assert "http://10.9.9.9:8000" not in backends.urls
        installed.kubectl("-n", WORKLOAD_NS, "delete", "endpointslice", f"{service}-a")
        await eventually(lambda: backends.urls == ("http://10.1.0.3:8000",), "a deleted slice")
    finally:
        await watcher.stop()
        installed.kubectl("-n", WORKLOAD_NS, "delete", "endpointslice", f"{service}-b", "someone-else",
                          "--ignore-not-found", check=False)


def host_address() -> str | None:
    """This machine's own non-loopback IPv4 address (an EndpointSlice may not name loopback), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # UDP: picks the outgoing address, sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@contextlib.contextmanager
def replica_on(address: str, workdir: Path):
    """`tokenlane serve` (the simulated executor: no weights) listening on `address`."""
    port = free_port()
    config = workdir / "replica.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "simulated/llama3-8b", "servedName": "sim", "maxModelLen": 4096},
        "engine": {"executor": "simulated", "kvCacheBlocks": 1024, "blockSize": 16}}))
    with open(workdir / "replica.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tokenlane.cli", "serve", "--config", str(config),
                                 "--host", address, "--port", str(port), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://{address}:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (workdir / "replica.log").read_text()[-3000:]
        try:
            return httpx.get(url + "/ready", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=180, what="the replica ready")
        yield url, port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_router_routes_to_the_replicas_its_endpointslices_name(installed: Cluster, tmp_path: Path):
    """The router app with discovery, in front of a real (simulated-executor) `tokenlane serve`
    that a hand-made EndpointSlice names: it becomes ready, routes to it, and stops when the
    endpoint turns unready."""
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine (EndpointSlices may not name loopback)")
    service = "routed-test"
    token = installed.kubectl("-n", WORKLOAD_NS, "create", "token", ROUTER_SA, "--duration=1h").stdout.strip()
    backends = BackendSet()
    watcher = EndpointSliceWatcher(api_access(installed, token, tmp_path), WORKLOAD_NS, service, backends,
                                   backoff_s=0.2)
    app = create_router_app(backends, None, RouterOptions(scrape_interval_s=0.1), discovery=watcher)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True, name="router")
    url = f"http://127.0.0.1:{port}"

    def healthy_replicas() -> int:
        # /ready answers 200 at zero replicas too: the router holds requests for one (scale from zero).
        try:
            answer = httpx.get(url + "/ready", timeout=2, trust_env=False)
        except httpx.HTTPError:
            return -1
        return answer.json()["healthy_replicas"] if answer.status_code == 200 else -1

    with replica_on(address, tmp_path) as (replica_url, replica_port):
        slice_ = endpoint_slice(service, service, {address: True})
        slice_["ports"][0]["port"] = replica_port
        installed.apply([slice_])
        thread.start()
        try:
            wait_for(lambda: healthy_replicas() == 1, timeout=60, what="the router ready with the discovered replica")
            answer = httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 2},
                                timeout=60, trust_env=False)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-tokenlane-replica"] == replica_url
            slice_["endpoints"][0]["conditions"]["ready"] = False
            installed.apply([slice_])
            wait_for(lambda: healthy_replicas() == 0, timeout=60, what="the router with no ready replica")
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            installed.kubectl("-n", WORKLOAD_NS, "delete", "endpointslice", service, "--ignore-not-found",
                              check=False)


def test_router_service_account_may_only_read_endpointslices(installed: Cluster):
    user = f"system:serviceaccount:{WORKLOAD_NS}:{ROUTER_SA}"

    def can(*args: str) -> str:
        return installed.kubectl("auth", "can-i", *args, "-n", WORKLOAD_NS, "--as", user, check=False).stdout.strip()

    assert [can(verb, "endpointslices.discovery.k8s.io") for verb in ("get", "list", "watch")] == ["yes"] * 3
    assert can("create", "endpointslices.discovery.k8s.io") == "no"
    assert can("get", "secrets") == "no" and can("get", "pods") == "no"


# --------------------------------------------------------------------------- the operator


def mark_pods_ready(cluster: Cluster, namespace: str, selector: str) -> None:
    """The kubelet's part on a node-less control plane: the pods matching `selector` Running
    and Ready, so their Deployment counts them as ready replicas."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for pod in pods:
        conditions = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
        if conditions.get("Ready") == "True":
            continue
        status = {"phase": "Running", "startTime": now, "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}
        cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                        "--type=merge", "-p", json.dumps({"status": status}), check=False)


def shared_replicas(cluster: Cluster) -> int:
    return int(cluster.get("deployment", NAME, WORKLOAD_NS)["spec"]["replicas"])


def test_operator_renders_the_router_and_scales_the_deployment(installed: Cluster, operator: OperatorProcess,
                                                               prometheus: FakePrometheus):
    prometheus.kv_usage = 0.5  # comfortable: no scaling until the test overloads the fleet
    autoscaling = {"enabled": True, "prometheusUrl": prometheus.url, "minReplicas": 1, "maxReplicas": 3,
                   "interval": "1s", "window": "1m", "scaleDown": {"stabilizationWindow": "1h"}}
    installed.apply([tiny_model_service(replicas=1, router={"enabled": True}, autoscaling=autoscaling)],
                    "--server-side", "--field-manager=gitops")
    router = wait_for(lambda: installed.get("deployment", f"{NAME}-router", WORKLOAD_NS), timeout=90,
                      what="the router Deployment")
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:5] == ["router", "--endpointslice-service", NAME, "--namespace", WORKLOAD_NS]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == ROUTER_SA
    service = wait_for(lambda: installed.get("service", f"{NAME}-router", WORKLOAD_NS), what="the router Service")
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]

    holding = wait_for(lambda: ((installed.get("msvc", NAME, WORKLOAD_NS) or {}).get("status") or {})
                       .get("autoscaling"), timeout=60, what="a first autoscaling decision")
    assert holding["currentReplicas"] == holding["desiredReplicas"] == 1 and shared_replicas(installed) == 1
    before = installed.get("msvc", NAME, WORKLOAD_NS)

    prometheus.kv_usage = 0.95  # x1.27 of the 0.75 target: one replica more per decision, up to max

    def scaled_to_max() -> bool:
        # The autoscaler adds no replica while the ones it added are still starting (as an HPA
        # discounts unready pods); with no kubelet here, the test marks them Ready itself.
        mark_pods_ready(installed, WORKLOAD_NS, f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=runtime")
        return shared_replicas(installed) == 3

    wait_for(scaled_to_max, timeout=120, what="the Deployment scaled to maxReplicas")
    after = installed.get("msvc", NAME, WORKLOAD_NS)
    status = after["status"]["autoscaling"]
    assert status["desiredReplicas"] == 3 and status["reason"] in ("ScaledUp", "Holding"), status
    assert status.get("lastScaleTime")
    # The spec is the user's: same generation, same spec, and the operator owns no spec field.
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"] and after["spec"]["replicas"] == 1
    for entry in after["metadata"]["managedFields"]:
        if entry["manager"] == "tokenlane-operator":
            assert entry.get("subresource") == "status", entry
    deployment = installed.get("deployment", NAME, WORKLOAD_NS)
    owners = {e["manager"] for e in deployment["metadata"]["managedFields"]
              if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})}
    assert owners == {"tokenlane-operator"}, owners
    assert rbac_denials(operator.log()) == []


def test_metrics_gone_hold_the_replicas(installed: Cluster, operator: OperatorProcess, prometheus: FakePrometheus):
    asked = len(prometheus.queries)
    prometheus.close()  # Prometheus unreachable: every decision holds
    wait_for(lambda: ((installed.get("msvc", NAME, WORKLOAD_NS) or {}).get("status") or {})
             .get("autoscaling", {}).get("reason") == "MetricsUnavailable", timeout=60, what="a hold on no metrics")
    assert shared_replicas(installed) == 3 and len(prometheus.queries) >= asked


def test_scale_subresource_drives_the_deployment_with_autoscaling_off(installed: Cluster, operator: OperatorProcess):
    installed.kubectl("-n", WORKLOAD_NS, "patch", "msvc", NAME, "--type=merge",
                      "-p", json.dumps({"spec": {"autoscaling": {"enabled": False}}}))
    wait_for(lambda: shared_replicas(installed) == 1, timeout=60, what="spec.replicas back in force")
    installed.kubectl("-n", WORKLOAD_NS, "scale", "msvc", NAME, "--replicas=2")
    wait_for(lambda: shared_replicas(installed) == 2, timeout=60, what="kubectl scale reaching the Deployment")
    wait_for(lambda: "autoscaling" not in (installed.get("msvc", NAME, WORKLOAD_NS).get("status") or {}),
             timeout=60, what="status.autoscaling dropped once autoscaling is off")
