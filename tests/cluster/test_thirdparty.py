"""Third-party objects against their real CRDs, and the Argo CD health checks on real objects.

- The upstream CRDs of Argo CD (Application, AppProject) and the Prometheus Operator
  (PrometheusRule, ServiceMonitor, PodMonitor) from ../shared/k8s/thirdparty-crds are
  installed; every such object of manifests/argocd, manifests/monitoring (+ its optional
  PodMonitor) and the ServiceMonitor `tokenlane render --service-monitor` prints is accepted
  by the API server with strict field validation and stored as sent (nothing pruned).
- Per kind, a wrong object is refused with the server's own message (the schemas validate).
- manifests/argocd/health/*.lua run on ModelService / ServingLane objects as the server
  returns them after the status the operator's own functions (operator/desired/status.py) compute
  was written through the status subresource: pruning, defaults and generation are the
  server's, not a hand-written dict's.

No operator watches the namespace the health tests use; every health is evaluated on the
response of the write that set the state (the stored object at that resourceVersion), so an
operator running cluster-wide elsewhere in the session cannot race the assertions.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import uuid
from pathlib import Path
from typing import Optional

import pytest
import yaml

from cluster_harness import ROOT, SHARED_K8S, Cluster, kustomize, run, wait_for

from tokenlane import kube
from tokenlane.kube.credentials import kubeconfig_paths

THIRDPARTY = SHARED_K8S / "thirdparty-crds"
CRD_OF = {  # kind -> CRD name
    "Application": "applications.argoproj.io",
    "AppProject": "appprojects.argoproj.io",
    "PrometheusRule": "prometheusrules.monitoring.coreos.com",
    "ServiceMonitor": "servicemonitors.monitoring.coreos.com",
    "PodMonitor": "podmonitors.monitoring.coreos.com",
}
FIELD_MANAGER = "tokenlane-cluster-tests"
SAMPLE = ROOT / "manifests" / "samples" / "tiny-cpu.yaml"
HEALTH = ROOT / "manifests" / "argocd" / "health"
NOW = "2026-01-01T00:00:00Z"


def _load(path: Path) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the Argo CD CRD is 400 kB
    return yaml.load(path.read_text(), Loader=loader)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def thirdparty(crds: Cluster):
    """kind -> "pinned" (installed here from thirdparty-crds) or "cluster's" (a KUBECONFIG
    cluster with Argo CD or kube-prometheus-stack keeps its own version) for each kind of
    CRD_OF the server serves. What was installed here is removed after, so other modules of
    the session see the cluster as it was (the operator renders ServiceMonitors once their
    CRD exists)."""
    present = set(crds.kubectl("get", "crd", "-o", "name").stdout.split())
    present = {name.split("/", 1)[1] for name in present}
    files = {}
    if THIRDPARTY.is_dir():
        files = {_load(p)["metadata"]["name"]: p for p in sorted(THIRDPARTY.glob("*.yaml"))}
    install = sorted(name for name in files if name not in present)
    try:
        if install:
            # Server-side: the Argo CD CRD is too big for client-side apply's last-applied annotation.
            crds.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}",
                         *[a for name in install for a in ("-f", str(files[name]))])
        served = sorted(n for n in CRD_OF.values() if n in present or n in files)
        # Polled, not `kubectl wait`: that fails on a CRD the server has not given conditions yet.
        if served:
            wait_for(lambda: all(_established(c) for c in _items(crds.kubectl("get", "crd", *served, "-o", "json"))),
                     what=f"{served} Established")
        # "pinned": the CRD served is the one in THIRDPARTY, whoever installed it (another module
        # of this session may have applied the same file first).
        live = {c["metadata"]["name"]: c for c in _items(crds.kubectl("get", "crd", *served, "-o", "json"))} \
            if served else {}
        yield {kind: "pinned" if name in install or (name in files and _same_schemas(live.get(name), _load(files[name])))
               else "cluster's" for kind, name in CRD_OF.items() if name in served}
    finally:
        if install:
            _remove(crds, install)


def _items(result) -> list[dict]:
    """The objects of `kubectl ... -o json`: a List for several, the object itself for one."""
    out = json.loads(result.stdout) if result.stdout.strip() else {"kind": "List", "items": []}
    return out["items"] if out.get("kind") == "List" else [out]


def _same_schemas(live: Optional[dict], pinned: dict) -> bool:
    def schemas(crd: dict) -> list:
        return [(v["name"], v.get("schema")) for v in crd["spec"]["versions"]]
    return live is not None and schemas(live) == schemas(pinned)


def _established(crd: dict) -> bool:
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


def _remove(cluster: Cluster, crd_names: list[str]) -> None:
    # Argo CD's resources-finalizer would keep the Applications, and so their CRD, forever
    # without an Argo CD controller: drop it before deleting the CRDs.
    if CRD_OF["Application"] in crd_names:
        listed = cluster.kubectl("get", "applications.argoproj.io", "-A", "-o", "json", check=False)
        for app in _items(listed) if listed.returncode == 0 else []:
            if app["metadata"].get("finalizers"):
                cluster.kubectl("patch", "applications.argoproj.io", app["metadata"]["name"], "-n",
                                app["metadata"]["namespace"], "--type=merge",
                                "-p", '{"metadata":{"finalizers":null}}', check=False)
    cluster.kubectl("delete", "crd", "--wait=true", "--timeout=120s", *crd_names, check=False)


def need(thirdparty: dict, *kinds: str, pinned: bool = False) -> None:
    missing = sorted(set(kinds) - set(thirdparty))
    if missing:
        pytest.skip(f"no CRD for {', '.join(missing)} on this cluster and no {THIRDPARTY} to install it from")
    theirs = sorted(k for k in kinds if thirdparty[k] != "pinned")
    if pinned and theirs:
        pytest.skip(f"the cluster has its own {', '.join(theirs)} CRD; the messages asserted here are those "
                    f"of the versions in {THIRDPARTY.name}")


@pytest.fixture(scope="module")
def own_ns(crds: Cluster):
    """A namespace only this module uses (no operator of the session watches it by name)."""
    name = f"tokenlane-thirdparty-{uuid.uuid4().hex[:6]}"
    crds.kubectl("create", "namespace", name)
    yield name
    crds.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _write_mode(cluster: Cluster) -> list[str]:
    """The started control plane is ours (wiped after): create for real. A KUBECONFIG cluster
    may run Argo CD or a Prometheus Operator that would act on these objects (sync the
    Applications from GitHub...): there, a server-side dry run, which runs the same
    admission, schema and field validation but stores nothing."""
    return [] if cluster.source == "shared" else ["--dry-run=server"]


def _apply(cluster: Cluster, docs: list[dict], check: bool = True):
    """`kubectl apply --server-side` with strict field validation (an unknown field is an
    error, not silently pruned); returns the stored objects and the result."""
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
                  for n in sorted({d["metadata"].get("namespace") for d in docs} - {None})]
    mode = _write_mode(cluster)
    if namespaces and mode:  # a dry run needs the namespaces they name for real
        cluster.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-",
                        input=yaml.safe_dump_all(namespaces))
        namespaces = []
    # Namespaces first in the same request stream (idempotent: other modules may own them too).
    result = cluster.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "--validate=strict",
                             *mode, "-o", "json", "-f", "-", input=yaml.safe_dump_all(namespaces + docs), check=check)
    return _items(result), result


def _contained(sent, stored, where: str = "") -> list[str]:
    """Paths where `stored` lacks or changed what `sent` has (the server may add defaults)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [f"{where}: {stored!r}"]
        return [p for k, v in sent.items() for p in
                (_contained(v, stored[k], f"{where}.{k}") if k in stored else [f"{where}.{k}: pruned"])]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [f"{where}: {stored!r}"]
        return [p for i, (a, b) in enumerate(zip(sent, stored)) for p in _contained(a, b, f"{where}[{i}]")]
    return [] if sent == stored else [f"{where}: sent {sent!r}, stored {stored!r}"]


# --------------------------------------------------------------------------- acceptance


def _rendered_service_monitor(namespace: str) -> list[dict]:
    """What the operator would create for the CPU sample when the ServiceMonitor CRD exists."""
    result = run([sys.executable, "-m", "tokenlane.cli", "render",
                  "-f", str(SAMPLE), "--service-monitor", "-n", namespace])
    return [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "ServiceMonitor"]


SOURCES = {
    # source -> (the third-party kinds it must hold, how to get its objects)
    "manifests/argocd": ({"Application"}, lambda ns: kustomize("manifests/argocd")),
    "manifests/monitoring": ({"PrometheusRule", "ServiceMonitor"}, lambda ns: kustomize("manifests/monitoring")),
    "manifests/monitoring/optional": ({"PodMonitor"}, lambda ns: _load_all(
        ROOT / "manifests" / "monitoring" / "optional" / "podmonitor-runtime.yaml")),
    "tokenlane render --service-monitor": ({"ServiceMonitor"}, _rendered_service_monitor),
}


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_api_server_accepts_and_stores_as_sent(crds: Cluster, thirdparty: dict, own_ns: str, source: str):
    kinds, get_docs = SOURCES[source]
    need(thirdparty, *kinds)
    docs = get_docs(own_ns)
    found = {d["kind"] for d in docs if d["kind"] in CRD_OF}
    assert found == kinds, f"{source} holds {sorted(found)}, expected {sorted(kinds)}"
    stored, result = _apply(crds, docs)
    assert not result.stderr.strip(), result.stderr  # no warnings either (e.g. deprecated fields)
    by_id = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in stored}
    for doc in docs:
        key = (doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"])
        assert key in by_id, f"{key} not in the server's answer: {sorted(by_id)}"
        assert not _contained(doc, by_id[key]), (key, _contained(doc, by_id[key]))


# (kind, name, a wrong object's spec, what the server's refusal says): a wrong type (refused by
# server-side apply's typed conversion of the CRD schema) and a pattern / required field
# (refused by the CRD's OpenAPI validation).
REFUSALS = [
    ("ServiceMonitor", "sm-endpoints-not-a-list",
     {"selector": {"matchLabels": {"a": "b"}}, "endpoints": "metrics"},
     ".spec.endpoints: expected list"),
    ("ServiceMonitor", "sm-bad-interval",
     {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "http", "interval": "30 seconds"}]},
     'spec.endpoints[0].interval: Invalid value: "30 seconds": spec.endpoints[0].interval in body should match'),
    ("ServiceMonitor", "sm-unknown-field",
     {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "http", "intervall": "30s"}]},
     ".spec.endpoints[0].intervall: field not declared in schema"),
    ("PodMonitor", "pm-port-not-a-string",
     {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": 8080}]},
     ".spec.podMetricsEndpoints[0].port: expected string"),
    ("PrometheusRule", "pr-bad-for",
     {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5 minutes"}]}]},
     'spec.groups[0].rules[0].for: Invalid value: "5 minutes"'),
    ("PrometheusRule", "pr-no-expr",
     {"groups": [{"name": "g", "rules": [{"alert": "A"}]}]},
     "spec.groups[0].rules[0].expr: Required value"),
    ("Application", "app-no-project",
     {"source": {"repoURL": "https://example.com/x.git", "path": "p"},
      "destination": {"server": "https://kubernetes.default.svc"}},
     "spec.project: Required value"),
    ("Application", "app-retry-limit-not-a-number",
     {"project": "default", "source": {"repoURL": "https://example.com/x.git", "path": "p"},
      "destination": {"server": "https://kubernetes.default.svc"}, "syncPolicy": {"retry": {"limit": "five"}}},
     ".spec.syncPolicy.retry.limit: expected numeric"),
    ("AppProject", "proj-source-repos-not-a-list", {"sourceRepos": "*"}, ".spec.sourceRepos: expected list"),
]
API_VERSION = {"Application": "argoproj.io/v1alpha1", "AppProject": "argoproj.io/v1alpha1"}


@pytest.fixture(scope="module")
def refusals(crds: Cluster, thirdparty: dict, own_ns: str) -> dict[str, str]:
    """One `kubectl apply` of every wrong object (kubectl goes on after a refusal): name -> the
    server's error line, or '' if it was accepted."""
    docs = [{"apiVersion": API_VERSION.get(kind, "monitoring.coreos.com/v1"), "kind": kind,
             "metadata": {"name": name, "namespace": own_ns}, "spec": spec}
            for kind, name, spec, _ in REFUSALS if kind in thirdparty]
    if not docs:
        return {}
    _, result = _apply(crds, docs, check=False)
    lines = result.stderr.splitlines()
    return {d["metadata"]["name"]: next((l for l in lines if f'/{d["metadata"]["name"]};' in l
                                         or f'"{d["metadata"]["name"]}"' in l), "") for d in docs}


@pytest.mark.parametrize("kind,name,spec,message", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_api_server_refuses_a_wrong_object(thirdparty: dict, refusals: dict, kind, name, spec, message):
    need(thirdparty, kind, pinned=True)
    line = refusals[name]
    assert line, f"the API server accepted the wrong {kind} {name}"
    assert line.startswith("Error from server") and message in line, line


# --------------------------------------------------------------------------- Argo CD health on real objects


def run_health(kind: str, obj: dict) -> dict:
    """The health script as Argo CD runs it: `obj` a global table, the chunk returns hs."""
    lupa = pytest.importorskip("lupa", reason="lupa (a Python Lua runtime) runs the health scripts")
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((HEALTH / f"{kind.lower()}.lua").read_text())
    return {"status": result["status"], "message": result["message"]}


PLURAL = {"ModelService": "modelservices", "ServingLane": "servinglanes"}


class Objects:
    """ModelService / ServingLane objects through tokenlane.kube (one request each, no kubectl
    start-up): every method returns the object as the server stored it."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.credentials = kube.load_kubeconfig(kubeconfig_paths(cluster.kubeconfig))
        self.namespace = namespace

    def _call(self, method: str, *args) -> dict:
        async def call() -> dict:
            api = kube.KubeApi(self.credentials, field_manager="tokenlane-tests")
            try:
                return await getattr(api, method)(*args)
            finally:
                await api.close()

        return asyncio.run(call())

    @staticmethod
    def _resource(kind: str) -> kube.Resource:
        return kube.Resource("tokenlane.dev", "v1alpha1", PLURAL[kind], kind)

    def create(self, body: dict) -> dict:
        body = {**body, "metadata": {**body["metadata"], "namespace": self.namespace}}
        return self._call("create", self._resource(body["kind"]), body)

    def write_status(self, obj: dict, wanted: dict) -> dict:
        """The operator's write (handlers._write_status): a merge patch of the status keys that
        differ, on the status subresource."""
        from tokenlane.operator.desired import status

        patch = status.status_patch(obj.get("status") or {}, wanted, tuple(obj.get("status") or {}))
        return self._call("merge_patch", self._resource(obj["kind"]), self.namespace, obj["metadata"]["name"],
                          {"status": patch or {}}, "status")

    def patch_spec(self, obj: dict, spec: dict) -> dict:
        return self._call("merge_patch", self._resource(obj["kind"]), self.namespace, obj["metadata"]["name"],
                          {"spec": spec})


@pytest.fixture(scope="module")
def objects(crds: Cluster, own_ns: str) -> Objects:
    return Objects(crds, own_ns)


def create_sample(objects: Objects, name: str, extra_lanes: tuple = ()) -> tuple[dict, list[dict]]:
    """The CPU sample's ModelService and lanes, renamed after `name`; returns the created objects."""
    msvc_body, *lane_bodies = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d]
    msvc_body["metadata"] = {"name": name, "namespace": objects.namespace}
    for lane in lane_bodies:
        lane["metadata"] = {"name": lane["metadata"]["name"].replace("tiny", name, 1), "namespace": objects.namespace}
        lane["spec"]["modelServiceRef"]["name"] = name
    for suffix, spec in extra_lanes:
        lane_bodies.append({**copy.deepcopy(lane_bodies[0]), "metadata": {"name": f"{name}-{suffix}",
                                                                           "namespace": objects.namespace}})
        lane_bodies[-1]["spec"].update(spec)
    return objects.create(msvc_body), [objects.create(body) for body in lane_bodies]


def operator_status(msvc_obj: dict, lane_objs: list[dict], deployment_status: Optional[dict]):
    """The status the operator computes from the objects as stored (defaults applied by the
    server) and a state of the shared pool's Deployment (None: not created yet)."""
    from tokenlane.operator.desired import builders, status
    from tokenlane.operator.api import resources as model

    msvc = model.parse_model_service(msvc_obj)
    lanes = [model.parse_serving_lane(o) for o in lane_objs]
    desired = builders.build(msvc, lanes)
    deployments = {} if deployment_status is None else {desired.pools[0].object_name: {"status": deployment_status}}
    return (status.model_service_status(msvc, desired, deployments, NOW),
            [status.lane_status(lane, msvc, desired, deployments, NOW) for lane in lanes])


def write_and_read(objects: Objects, obj: dict, wanted: dict) -> dict:
    stored = objects.write_status(obj, wanted)
    # The server keeps every key the operator writes: a CRD status schema that pruned one
    # would make the operator rewrite it on every reconcile.
    assert not _contained(wanted, stored["status"]), _contained(wanted, stored["status"])
    return stored


READY_DEPLOYMENT = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
DEPLOYMENT_STATES = [
    # (name, Deployment status, health of the ModelService and of each lane, a word in the ModelService's message)
    ("ready", READY_DEPLOYMENT, "Healthy", "1/1 replicas ready"),
    ("pods starting", {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1}, "Progressing", "RollingOut"),
    ("no deployment yet", None, "Progressing", "RollingOut"),
    ("progress deadline exceeded", {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "tiny-5d4f" has timed out progressing.'}]}, "Degraded", "DeploymentFailed"),
]


def test_health_before_the_operator_wrote_status(objects: Objects):
    msvc, lanes = create_sample(objects, "fresh")
    for obj in [msvc, *lanes]:
        assert "status" not in obj, obj.get("status")  # the server drops status on create
        assert run_health(obj["kind"], obj) == {"status": "Progressing",
                                                "message": "Waiting for the operator to reconcile"}


@pytest.mark.parametrize("name,deployment_status,expected,word", DEPLOYMENT_STATES,
                         ids=[s[0] for s in DEPLOYMENT_STATES])
def test_health_of_the_status_the_operator_writes(objects: Objects, name, deployment_status, expected, word):
    msvc, lanes = create_sample(objects, "dep-" + name.replace(" ", "-"))
    msvc_status, lane_statuses = operator_status(msvc, lanes, deployment_status)
    msvc = write_and_read(objects, msvc, msvc_status)
    health = run_health("ModelService", msvc)
    assert health["status"] == expected and word in health["message"], (health, msvc["status"])
    for lane, wanted in zip(lanes, lane_statuses):
        lane = write_and_read(objects, lane, wanted)
        health = run_health("ServingLane", lane)
        assert health["status"] == expected, (lane["metadata"]["name"], health, lane["status"])


def test_health_when_the_spec_changes_and_when_scaled_to_zero(objects: Objects):
    msvc, lanes = create_sample(objects, "scaled")
    msvc = write_and_read(objects, msvc, operator_status(msvc, lanes, READY_DEPLOYMENT)[0])
    assert run_health("ModelService", msvc)["status"] == "Healthy"
    # A spec change (as `kubectl scale` / an HPA make): the server bumps metadata.generation,
    # the status still describes generation 1.
    msvc = objects.patch_spec(msvc, {"replicas": 0})
    assert (msvc["metadata"]["generation"], msvc["status"]["observedGeneration"]) == (2, 1)
    assert run_health("ModelService", msvc) == {
        "status": "Progressing", "message": "Waiting for the operator to observe generation 2"}
    msvc = write_and_read(objects, msvc, operator_status(
        msvc, lanes, {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0})[0])
    assert any(c["reason"] == "ScaledToZero" for c in msvc["status"]["conditions"]), msvc["status"]
    assert run_health("ModelService", msvc)["status"] == "Healthy"


def test_health_of_a_lane_the_operator_rejects(objects: Objects):
    # A second lane named "interactive": the server cannot see the clash, the operator refuses
    # the younger lane and keeps serving the others.
    msvc, lanes = create_sample(objects, "clash", extra_lanes=[("zz-clash", {"default": False})])
    msvc_status, lane_statuses = operator_status(msvc, lanes, READY_DEPLOYMENT)
    msvc = write_and_read(objects, msvc, msvc_status)
    health = run_health("ModelService", msvc)
    assert health["status"] == "Degraded" and "LanesRejected" in health["message"], health
    results = {lane["metadata"]["name"]: run_health("ServingLane", write_and_read(objects, lane, wanted))
               for lane, wanted in zip(lanes, lane_statuses)}
    assert results["clash-zz-clash"]["status"] == "Degraded", results
    assert "already used" in results["clash-zz-clash"]["message"], results
    assert results["clash-interactive"]["status"] == results["clash-batch"]["status"] == "Healthy", results


def test_health_of_an_invalid_spec(objects: Objects):
    from tokenlane.operator.api import resources as model
    from tokenlane.operator.desired import status

    msvc, lanes = create_sample(objects, "invalid")
    # A spec stored before the CRD had a rule the operator's parser enforces (a CRD upgrade
    # does not revalidate stored objects): the operator writes InvalidSpec with its parser's message.
    bad = copy.deepcopy(msvc)
    bad["spec"]["scheduler"]["prefillChunkSize"] = bad["spec"]["scheduler"]["maxBatchedTokens"] * 2
    with pytest.raises(ValueError) as refused:
        model.parse_model_service(bad)
    for obj in (msvc, lanes[0]):
        stored = write_and_read(objects, obj, status.invalid_status(
            obj.get("status") or {}, obj["metadata"]["generation"], str(refused.value), NOW))
        health = run_health(obj["kind"], stored)
        assert health["status"] == "Degraded" and health["message"].startswith("InvalidSpec: "), health
        assert "prefillChunkSize" in health["message"], health


def test_health_of_a_lane_whose_model_service_is_missing(objects: Objects):
    from tokenlane.operator.api import resources as model
    from tokenlane.operator.desired import status

    (lane,) = [objects.create({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
                               "metadata": {"name": "orphan", "namespace": objects.namespace},
                               "spec": {"modelServiceRef": {"name": "no-such-model"}, "laneName": "orphan"}})]
    wanted = status.lane_status(model.parse_serving_lane(lane), None, None, {}, NOW)
    health = run_health("ServingLane", write_and_read(objects, lane, wanted))
    assert health == {"status": "Degraded", "message": "ModelServiceNotFound: ModelService 'no-such-model' not found"}


def test_health_with_the_tuners_conditions(objects: Objects):
    """RolledBack and SLOMet are written by the rollout guard and the tuner (operator/controllers/tuning.py)
    next to the reconciler's conditions; merge_conditions keeps both."""
    from tokenlane.operator.desired import status

    msvc, lanes = create_sample(objects, "tuned")
    msvc_status, lane_statuses = operator_status(msvc, lanes, READY_DEPLOYMENT)
    msvc = write_and_read(objects, msvc, msvc_status)
    rolled_back = status.condition("RolledBack", True, "SLORegression",
                                   "revision 3f2a regressed against 9c1d: interactive TTFT p95 1.9s > 1.2x 0.4s; "
                                   "restored 9c1d")
    msvc = write_and_read(objects, msvc, {**msvc["status"], "conditions": status.merge_conditions(
        msvc["status"]["conditions"], [rolled_back], 1, NOW)})
    health = run_health("ModelService", msvc)
    assert health["status"] == "Degraded" and "SLORegression" in health["message"], health

    lane = write_and_read(objects, lanes[0], lane_statuses[0])
    slo_missed = status.condition("SLOMet", False, "TtftAboveTarget",
                                  "TTFT p95 1400ms > 1000ms (120 requests in 300s)")
    lane = write_and_read(objects, lane, {**lane["status"], "conditions": status.merge_conditions(
        lane["status"]["conditions"], [slo_missed], 1, NOW)})
    health = run_health("ServingLane", lane)
    assert health["status"] == "Healthy" and "SLO missed: TtftAboveTarget" in health["message"], health
