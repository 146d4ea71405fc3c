"""The operator on a real API server, as installed: both overlays applied for real, the operator
running as the ServiceAccount they ship (a token from the TokenRequest API) with exactly their
RBAC, reconciling every sample. Proven here, not in kmock: server-side apply and managed
fields (zero writes in steady state), owner references and the real garbage collector, status
subresource and observedGeneration, hot-reloadable lane changes (ConfigMap only), a restart
mid-reconcile, an API-server restart, and an HPA driving a ModelService's scale subresource.

The tests of this module run in order and share one installation (module fixtures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster_harness import (
    OPERATOR_SA,
    ROOT,
    SHARED_K8S,
    WORKLOAD_NS,
    Cluster,
    OperatorProcess,
    condition,
    kubelet_standin,
    kustomize,
    now_stamp,
    operator_args_from,
    rbac_denials,
    service_account_kubeconfig,
    wait_for,
)

SA_USER = f"system:serviceaccount:{OPERATOR_SA[0]}:{OPERATOR_SA[1]}"
OWNED_RESOURCES = {"configmaps", "deployments", "services", "poddisruptionbudgets", "servicemonitors"}
NAMESPACED = "manifests/overlays/namespaced"
CLUSTER_WIDE = "manifests/overlays/cluster-wide"
PROMETHEUS_OPERATOR_CRDS = ["monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_podmonitors.yaml",
                            "monitoring.coreos.com_prometheusrules.yaml"]


# The ModelServices of manifests/samples/kustomization.yaml (what `kubectl apply -k` creates).
SAMPLE_NAMES = ("tiny", "llama3-8b", "llama3-8b-lora")


def rendered_objects(namespace: str, *paths: Path, service_monitor: bool = True) -> set[tuple[str, str]]:
    """(kind, name) of every object `tokenlane render` says the operator creates."""
    args = [sys.executable, "-m", "tokenlane.cli", "render", "-n", namespace] + [a for p in paths for a in ("-f", str(p))]
    out = subprocess.run(args + (["--service-monitor"] if service_monitor else []), capture_output=True,
                         text=True, check=True).stdout
    return {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d}


def owned(cluster: Cluster, namespace: str, instance: str) -> dict[tuple[str, str], dict]:
    kinds = "configmaps,deployments,services,poddisruptionbudgets" + (
        ",servicemonitors" if cluster.get("crd", "servicemonitors.monitoring.coreos.com") else "") + (
        ",inferencepools" if cluster.get("crd", "inferencepools.inference.networking.k8s.io") else "")
    out = cluster.kubectl("-n", namespace, "get", kinds, "-l",
                          f"app.kubernetes.io/managed-by=tokenlane-operator,app.kubernetes.io/instance={instance}",
                          "-o", "json", "--show-managed-fields").stdout
    return {(o["kind"], o["metadata"]["name"]): o for o in json.loads(out)["items"]}


def operator_writes(cluster: Cluster, since: str, objects: dict | None = None) -> list[str]:
    """The operator's writes since `since` (to `objects` only, when given: keys (kind, name)),
    from the audit log where the API server keeps one; elsewhere nothing is claimed and the
    callers compare managed-field timestamps instead. (The tuning timer's own status writes and
    the rollout guard's `<name>-rollout` ConfigMap are not rendered objects.)"""
    if not cluster.has_audit_log:
        return []
    names = {(kind.lower() + "s", name) for kind, name in objects} if objects is not None else None
    writes = []
    for e in cluster.audit_events(since=since, user_contains=SA_USER):
        ref = e.get("objectRef") or {}
        if e["verb"] in ("get", "list", "watch") or (names is not None and (ref.get("resource"), ref.get("name")) not in names):
            continue
        writes.append(f"{e['verb']} {ref.get('resource')}/{ref.get('subresource') or ''} {ref.get('name')} "
                      f"-> {e['responseStatus']['code']}")
    return writes


def applied_at(objects: dict) -> dict:
    """When the operator last applied each object (its managed-fields entry): moves only when it writes."""
    return {key: [(m["manager"], m["operation"], m.get("time")) for m in o["metadata"].get("managedFields") or []
                  if m["manager"] == "tokenlane-operator"] for key, o in objects.items()}


def observed(obj: dict | None) -> bool:
    status = (obj or {}).get("status") or {}
    return status.get("observedGeneration") == (obj or {}).get("metadata", {}).get("generation")


# An HPA below whose minReplicas the llama3-8b sample (2 replicas) sits: the HPA controller
# reads the ModelService's scale subresource (spec.replicas and the status.selector the operator
# writes) and scales it to 3 without needing any metric; the operator then scales the Deployment.
HPA = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
       "metadata": {"name": "llama3-8b", "namespace": WORKLOAD_NS},
       "spec": {"scaleTargetRef": {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService", "name": "llama3-8b"},
                "minReplicas": 3, "maxReplicas": 4,
                "metrics": [{"type": "Resource", "resource": {
                    "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def installed(crds: Cluster) -> Cluster:
    """The namespaced overlay applied for real, plus the Prometheus Operator's CRDs when at hand
    (so the operator renders ServiceMonitors through its RBAC too)."""
    third_party = [SHARED_K8S / "thirdparty-crds" / name for name in PROMETHEUS_OPERATOR_CRDS]
    if all(path.exists() for path in third_party):
        crds.kubectl("apply", "--server-side", *[a for p in third_party for a in ("-f", str(p))])
    crds.kubectl("apply", "-k", str(ROOT / NAMESPACED))
    crds.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/modelservices.tokenlane.dev")
    wait_for(lambda: crds.kubectl("-n", OPERATOR_SA[0], "get", "serviceaccount", OPERATOR_SA[1], check=False)
             .returncode == 0, what="the operator's ServiceAccount")
    return crds


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("operator")


class Run:
    """The operator of this module: restartable, under the ServiceAccount's token."""

    def __init__(self, cluster: Cluster, workdir: Path, overlay: str):
        self.cluster, self.workdir, self.overlay = cluster, workdir, overlay
        self.args = operator_args_from(kustomize(overlay))
        self.process: OperatorProcess | None = None
        self.logs: list[Path] = []

    def start(self) -> OperatorProcess:
        kubeconfig = service_account_kubeconfig(self.cluster, self.workdir / "operator.kubeconfig")
        log = self.workdir / f"operator-{Path(self.overlay).name}-{len(self.logs)}.log"
        self.logs.append(log)
        self.process = OperatorProcess(kubeconfig, self.args, log, pod_id=f"tokenlane-operator-{Path(self.overlay).name}")
        return self.process

    def log(self) -> str:
        return "".join(p.read_text() for p in self.logs if p.exists())

    def stop(self) -> None:
        if self.process:
            self.process.stop()


@pytest.fixture(scope="module")
def operator(installed: Cluster, workdir: Path):
    run = Run(installed, workdir, NAMESPACED)
    assert run.args[-1] == f"--namespace={WORKLOAD_NS}" and "--peering=tokenlane" in run.args, run.args
    run.start()
    yield run
    run.stop()
    print(run.log()[-6000:])


@pytest.fixture(scope="module")
def samples(operator: Run) -> Cluster:
    """Every sample applied as a user would (`kubectl apply -k manifests/samples`), then reconciled."""
    cluster = operator.cluster
    cluster.kubectl("apply", "-k", str(ROOT / "manifests" / "samples"))
    for name in SAMPLE_NAMES:
        wait_for(lambda: observed(cluster.get("msvc", name, WORKLOAD_NS)), timeout=90,
                 what=f"ModelService {name} reconciled (status.observedGeneration)")
    cluster.apply([HPA])  # once status.selector is there: the HPA controller acts on its first sync
    return cluster


# --------------------------------------------------------------------------- install and RBAC


def test_both_overlays_apply_for_real(installed: Cluster):
    """The namespaced overlay is installed (fixture); the cluster-wide one applies on top (the
    quickstart's `kubectl apply -k`) as a server dry run here and for real at the end."""
    result = installed.kubectl("apply", "--dry-run=server", "-k", str(ROOT / CLUSTER_WIDE))
    assert "clusterrole.rbac.authorization.k8s.io/tokenlane-operator created (server dry run)" in result.stdout
    deployment = installed.get("deployment", "tokenlane-operator", OPERATOR_SA[0])
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == OPERATOR_SA[1]
    assert installed.get("kopfpeering", "tokenlane", WORKLOAD_NS) is not None


def test_operator_reconciles_every_sample_under_its_own_rbac(samples: Cluster, operator: Run):
    samples_dir = ROOT / "manifests" / "samples"
    files = yaml.safe_load((samples_dir / "kustomization.yaml").read_text())["resources"]
    expected = rendered_objects(WORKLOAD_NS, *(samples_dir / f for f in files),
                                service_monitor=bool(samples.get("crd", "servicemonitors.monitoring.coreos.com")))
    if not samples.get("crd", "inferencepools.inference.networking.k8s.io"):
        # Without the Gateway API Inference Extension's CRD the operator skips the pool (an Event).
        expected = {(kind, name) for kind, name in expected if kind != "InferencePool"}
    actual: dict = {}
    for name in SAMPLE_NAMES:
        msvc = samples.get("msvc", name, WORKLOAD_NS)
        objects = wait_for(lambda: owned(samples, WORKLOAD_NS, name), what=f"objects of {name}")
        for obj in objects.values():
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref == {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService", "name": name,
                           "uid": msvc["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}, ref
        actual.update(objects)
        status = msvc["status"]
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "Degraded"}
        assert condition(msvc, "Degraded")["status"] == "False"
        assert status["selector"].startswith("app.kubernetes.io/instance=" + name) or name in status["selector"]
    assert set(actual) == expected
    for lane in json.loads(samples.kubectl("-n", WORKLOAD_NS, "get", "lane", "-o", "json").stdout)["items"]:
        wait_for(lambda: observed(samples.get("lane", lane["metadata"]["name"], WORKLOAD_NS)),
                 what=f"lane {lane['metadata']['name']} status")
    log = operator.log()
    assert rbac_denials(log) == [], log[-4000:]
    assert "peering: KopfPeering 'tokenlane'" in log  # the overlay's peering object is used, and said so


def test_operator_cannot_read_secrets(operator: Run, workdir: Path):
    kubeconfig = str(workdir / "operator.kubeconfig")
    cluster = operator.cluster
    for namespace in (WORKLOAD_NS, OPERATOR_SA[0], "kube-system"):
        answer = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", namespace, kubeconfig=kubeconfig,
                                 check=False)
        assert answer.stdout.strip() == "no", (namespace, answer.stdout)
    result = cluster.kubectl("-n", WORKLOAD_NS, "get", "secrets", kubeconfig=kubeconfig, check=False)
    assert result.returncode != 0 and "Forbidden" in result.stderr and SA_USER in result.stderr


# --------------------------------------------------------------------------- steady state


@pytest.fixture(scope="module")
def before_ready(samples: Cluster, operator: Run) -> dict:
    """tiny's owned objects, their last applies, the time and the operator's reconcile count,
    taken before the stand-in kubelet starts: the pod can turn Ready (and the operator
    reconcile) at once, before a test body could look."""
    objects = owned(samples, WORKLOAD_NS, "tiny")
    return {"objects": objects, "applied": applied_at(objects), "since": now_stamp(),
            "reconciles": operator.process.reconciles()}


@pytest.fixture(scope="module")
def kubelet(samples: Cluster, workdir: Path, before_ready: dict):
    """../shared/k8s/kubelet-standin.sh marks tiny's pods Ready (the Deployment status changes)
    and keeps a local file equal to the ConfigMap, as a mounted volume would."""
    config_file = workdir / "mounted" / "runtime.yaml"
    with kubelet_standin(samples, WORKLOAD_NS, "app.kubernetes.io/instance=tiny", "tiny-config", config_file) as on:
        if not on:
            pytest.skip("no kubelet stand-in (../shared/k8s); on a real cluster pods become ready by themselves")
        yield config_file


def test_zero_writes_to_owned_objects_while_the_deployment_status_changes(samples: Cluster, operator: Run, kubelet,
                                                                           before_ready: dict):
    objects, before = before_ready["objects"], before_ready["applied"]
    since, reconciles = before_ready["since"], before_ready["reconciles"]
    # The stand-in kubelet marks the pod Ready: the controller manager updates the Deployment's
    # status, the operator sees the event, reconciles, and reports readiness in status.
    msvc = wait_for(lambda: (m := samples.get("msvc", "tiny", WORKLOAD_NS)) and
                    condition(m, "Ready")["status"] == "True" and m, timeout=90, what="tiny Ready=True")
    assert msvc["status"]["readyReplicas"] == 1
    # The reconcile writes the status before its count goes up: wait for the count, not race it.
    wait_for(lambda: operator.process.reconciles() > reconciles, what="the reconcile count after Ready")
    assert operator_writes(samples, since, objects) == []
    assert applied_at(owned(samples, WORKLOAD_NS, "tiny")) == before

    # Steady state: a change on the Deployment that is not ours (an annotation another manager
    # sets) is an event, a reconcile, and no write at all.
    since = now_stamp()
    reconciles = operator.process.reconciles()
    samples.kubectl("-n", WORKLOAD_NS, "annotate", "deployment", "tiny", "example.com/touched=yes")
    wait_for(lambda: operator.process.reconciles() > reconciles, what="the reconcile after the annotation")
    assert operator_writes(samples, since, objects) == []
    assert applied_at(owned(samples, WORKLOAD_NS, "tiny")) == before


def tuning_runs(process: OperatorProcess) -> float:
    """Tuning runs of ModelService tiny so far (any outcome), from the operator's /metrics."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenlane_operator_tuning_runs_total{") and 'modelservice="tiny"' in line)


# The tuning interval and verification window of the hold test: the runs it counts and the
# guard's promotion without metrics (after two windows) come that often; a hold decides the
# same whatever the interval.
HOLD_INTERVAL = "2s"


def test_zero_writes_while_the_tuner_holds(samples: Cluster, operator: Run, kubelet):
    """Quiet status: with tuning on and nothing to change (here: Prometheus cannot be reached,
    so it holds), a tuning run writes nothing: no per-run timestamp in status, the hold's Event
    once, and no Deployment patch or "Reconciled" Event (counted among the writes about tiny),
    also with a tuner override in force (as after the tuner acted)."""
    override = {"lanes": {"batch": {"maxBatchedTokens": 384}},
                "learnedFrom": {"lanes": {"batch": {"maxBatchedTokens": 512}}}}
    # The override first: a status change triggers no reconcile, the spec change after it does,
    # and that reconcile renders the override (rather than the periodic one, a minute later).
    samples.kubectl("-n", WORKLOAD_NS, "patch", "msvc", "tiny", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"overrides": override}}))
    samples.kubectl("-n", WORKLOAD_NS, "patch", "msvc", "tiny", "--type=merge", "-p",
                    json.dumps({"spec": {"tuning": {"enabled": True, "interval": HOLD_INTERVAL,
                                                    "prometheusUrl": "http://127.0.0.1:9"},
                                         "rollout": {"verificationWindow": HOLD_INTERVAL}}}))
    try:
        wait_for(lambda: [l.get("maxBatchedTokens") for l in yaml.safe_load(
            samples.get("configmap", "tiny-config", WORKLOAD_NS)["data"]["runtime.yaml"])["lanes"]
            if l["name"] == "batch"] == [384], timeout=300, what="the tuner's override in the ConfigMap")
        # Past the rollout guard's verification and the hold's first run (its condition, its Event).
        wait_for(lambda: (m := samples.get("msvc", "tiny", WORKLOAD_NS)) and
                 (m["status"].get("rollout") or {}).get("phase") == "Stable" and
                 (condition(m, "Tuning") or {}).get("reason") == "PrometheusUnavailable",
                 timeout=120, what="tiny Stable and holding (Tuning=False/PrometheusUnavailable)")
        runs = tuning_runs(operator.process)
        wait_for(lambda: tuning_runs(operator.process) >= runs + 1, timeout=60, what="one more tuning run")
        msvc = samples.get("msvc", "tiny", WORKLOAD_NS)
        assert "lastRunAt" not in (msvc["status"].get("tuning") or {})
        since, runs = now_stamp(), tuning_runs(operator.process)
        wait_for(lambda: tuning_runs(operator.process) >= runs + 3, timeout=120, what="three tuning runs")
        if samples.has_audit_log:  # tiny, its lanes, its objects and Events ("tiny.<id>"); llama3-8b is scaling
            about_tiny = [w for w in operator_writes(samples, since) if w.split()[2].startswith("tiny")]
            assert about_tiny == []
        assert samples.get("msvc", "tiny", WORKLOAD_NS)["metadata"]["resourceVersion"] == \
            msvc["metadata"]["resourceVersion"]
        assert samples.get("msvc", "tiny", WORKLOAD_NS)["status"]["overrides"]["lanes"] == override["lanes"]
    finally:
        # The override goes first: the spec change's reconcile then renders without it, here
        # rather than in a later test's measured window.
        samples.kubectl("-n", WORKLOAD_NS, "patch", "msvc", "tiny", "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"overrides": None}}))
        samples.kubectl("-n", WORKLOAD_NS, "patch", "msvc", "tiny", "--type=merge", "-p",
                        json.dumps({"spec": {"tuning": {"enabled": False, "interval": None, "prometheusUrl": None},
                                             "rollout": {"verificationWindow": None}}}))
        wait_for(lambda: "maxBatchedTokens: 384" not in
                 samples.get("configmap", "tiny-config", WORKLOAD_NS)["data"]["runtime.yaml"],
                 timeout=300, what="the ConfigMap without the override")


def test_someone_elses_edit_of_a_rendered_field_is_put_back(samples: Cluster, operator: Run):
    """Drift is judged by managed fields: an edit takes a field over from the operator, which
    applies it back (and only that object)."""
    objects = owned(samples, WORKLOAD_NS, "tiny")
    since = now_stamp()
    samples.kubectl("-n", WORKLOAD_NS, "patch", "deployment", "tiny", "--type=merge",
                    "-p", '{"spec": {"revisionHistoryLimit": 42}}')
    wait_for(lambda: samples.get("deployment", "tiny", WORKLOAD_NS)["spec"]["revisionHistoryLimit"] != 42,
             what="the operator to restore revisionHistoryLimit")
    writes = operator_writes(samples, since, objects)
    if samples.has_audit_log:
        assert writes == ["patch deployments/ tiny -> 200"], writes
    assert "drifted: spec.revisionHistoryLimit" in operator.log()


# --------------------------------------------------------------------------- lanes, scale, HPA


def test_lane_change_rewrites_the_config_map_not_the_pod_template(samples: Cluster, operator: Run, kubelet):
    deployment = samples.get("deployment", "tiny", WORKLOAD_NS)
    pods = samples.kubectl("-n", WORKLOAD_NS, "get", "pods", "-l", "app.kubernetes.io/instance=tiny",
                           "-o", "name").stdout.split()
    samples.kubectl("-n", WORKLOAD_NS, "patch", "servinglane", "tiny-interactive", "--type=merge",
                    "-p", '{"spec": {"budgets": {"maxActiveSequences": 4}}}')
    lane = wait_for(lambda: (l := samples.get("lane", "tiny-interactive", WORKLOAD_NS)) and observed(l) and l,
                    what="lane status for the new generation")
    assert lane["status"]["effectiveBudgets"]["maxActiveSequences"] == 4
    config = yaml.safe_load(samples.get("configmap", "tiny-config", WORKLOAD_NS)["data"]["runtime.yaml"])
    (interactive,) = [l for l in config["lanes"] if l["name"] == "interactive"]
    assert interactive["maxActiveSequences"] == 4
    # The "mounted" file follows the ConfigMap (what a pod's runtime hot-reloads).
    wait_for(lambda: kubelet.exists() and yaml.safe_load(kubelet.read_text()) == config, what="the mounted file")
    after = samples.get("deployment", "tiny", WORKLOAD_NS)
    assert after["metadata"]["generation"] == deployment["metadata"]["generation"]
    assert after["spec"]["template"] == deployment["spec"]["template"]
    assert samples.kubectl("-n", WORKLOAD_NS, "get", "pods", "-l", "app.kubernetes.io/instance=tiny",
                           "-o", "name").stdout.split() == pods


def test_kubectl_scale_drives_the_deployment(samples: Cluster, operator: Run):
    samples.kubectl("-n", WORKLOAD_NS, "scale", "msvc/tiny", "--replicas=2")
    wait_for(lambda: samples.get("deployment", "tiny", WORKLOAD_NS)["spec"]["replicas"] == 2,
             what="the Deployment to follow kubectl scale")
    samples.kubectl("-n", WORKLOAD_NS, "scale", "msvc/tiny", "--replicas=1")
    wait_for(lambda: samples.get("deployment", "tiny", WORKLOAD_NS)["spec"]["replicas"] == 1,
             what="the Deployment to follow kubectl scale back")


def test_a_lane_the_operator_rejects_gets_a_condition_and_an_event(samples: Cluster, operator: Run):
    clash = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
             "metadata": {"name": "tiny-second-default", "namespace": WORKLOAD_NS},
             "spec": {"modelServiceRef": {"name": "tiny"}, "laneName": "second", "default": True}}
    samples.apply([clash])
    lane = wait_for(lambda: (l := samples.get("lane", "tiny-second-default", WORKLOAD_NS)) and observed(l) and l,
                    what="the rejected lane's status")
    ready = condition(lane, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Rejected", ready
    events = wait_for(lambda: [e for e in json.loads(samples.kubectl(
        "-n", WORKLOAD_NS, "get", "events", "--field-selector", "involvedObject.name=tiny-second-default",
        "-o", "json").stdout)["items"] if e["reason"] == "Rejected"], what="a Rejected Event")
    assert events[0]["type"] == "Warning" and "default" in events[0]["message"]
    samples.kubectl("-n", WORKLOAD_NS, "delete", "servinglane", "tiny-second-default")


def test_an_hpa_scales_a_model_service_through_its_scale_subresource(samples: Cluster, operator: Run):
    wait_for(lambda: samples.get("deployment", "llama3-8b", WORKLOAD_NS)["spec"]["replicas"] == 3, timeout=90,
             what="the HPA to scale llama3-8b to its minReplicas, and the operator the Deployment")
    hpa = samples.get("hpa", "llama3-8b", WORKLOAD_NS)
    assert condition(hpa, "AbleToScale")["status"] == "True", hpa["status"]
    assert samples.get("msvc", "llama3-8b", WORKLOAD_NS)["spec"]["replicas"] == 3


# --------------------------------------------------------------------------- restarts and GC


def test_killed_mid_reconcile_it_converges_on_restart(samples: Cluster, operator: Run):
    """Made mid-reconcile by construction: with the Role's Deployment rights taken away the
    reconcile stops after the ConfigMap; the operator is SIGKILLed there, the rights come back,
    and a new process finishes the job."""
    role = samples.get("role", "tokenlane-operator", WORKLOAD_NS)
    crippled = json.loads(json.dumps(role))
    for rule in crippled["rules"]:
        if "deployments" in rule.get("resources", []):
            rule["verbs"] = [v for v in rule["verbs"] if v not in ("create", "patch")]
    for key in ("managedFields", "resourceVersion", "uid", "creationTimestamp"):
        crippled["metadata"].pop(key, None)
    samples.kubectl("replace", "-f", "-", input=json.dumps(crippled))
    doc = next(yaml.safe_load_all((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text()))
    doc["metadata"] = {"name": "crash", "namespace": WORKLOAD_NS}
    samples.apply([doc])
    wait_for(lambda: samples.get("configmap", "crash-config", WORKLOAD_NS), what="the first object of the reconcile")
    wait_for(lambda: "deployments.apps \"crash\" is forbidden" in operator.log(), what="the refused Deployment write")
    operator.process.kill()
    assert samples.get("deployment", "crash", WORKLOAD_NS) is None
    assert not observed(samples.get("msvc", "crash", WORKLOAD_NS))

    (shipped,) = [d for d in kustomize(NAMESPACED)
                  if d["kind"] == "Role" and d["metadata"]["name"].startswith("tokenlane-operator")]
    samples.apply([shipped])  # the shipped RBAC again
    operator.start()
    wait_for(lambda: observed(samples.get("msvc", "crash", WORKLOAD_NS)), timeout=90, what="crash reconciled")
    assert set(owned(samples, WORKLOAD_NS, "crash")) >= {("ConfigMap", "crash-config"), ("Deployment", "crash"),
                                                         ("Service", "crash"), ("PodDisruptionBudget", "crash")}


def test_reconnects_after_an_api_server_restart(samples: Cluster, operator: Run):
    if samples.source != "shared":
        pytest.skip("restarts only the control plane this tier started (../shared/k8s)")
    process = operator.process
    samples.restart_apiserver()
    samples.kubectl("-n", WORKLOAD_NS, "patch", "servinglane", "tiny-batch", "--type=merge",
                    "-p", '{"spec": {"budgets": {"maxWaitingRequests": 99}}}')
    wait_for(lambda: "maxWaitingRequests: 99" in samples.get("configmap", "tiny-config", WORKLOAD_NS)["data"]["runtime.yaml"],
             timeout=120, what="the change made after the restart to reach the ConfigMap")
    assert process.alive() and operator.process is process  # the same process, not restarted


def test_garbage_collector_removes_owned_objects(samples: Cluster, operator: Run):
    """Owner references are right when the real garbage collector, not the operator, deletes:
    the operator is stopped and its finalizer removed before the ModelService is deleted."""
    assert owned(samples, WORKLOAD_NS, "crash")
    operator.stop()
    since = now_stamp()
    samples.kubectl("-n", WORKLOAD_NS, "patch", "msvc", "crash", "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
    samples.kubectl("-n", WORKLOAD_NS, "delete", "msvc", "crash", "--wait=true", "--timeout=60s")
    wait_for(lambda: not owned(samples, WORKLOAD_NS, "crash"), timeout=90, what="garbage collection")
    if samples.has_audit_log:
        deleters = {(e["objectRef"]["resource"], e["user"]["username"]) for e in samples.audit_events(since=since)
                    if e["verb"] == "delete" and e["objectRef"].get("name", "").startswith("crash")
                    and e["objectRef"]["resource"] in OWNED_RESOURCES}
        assert {r for r, _ in deleters} >= {"configmaps", "deployments", "services", "poddisruptionbudgets"}
        assert {u for _, u in deleters} == {"system:serviceaccount:kube-system:generic-garbage-collector"}, deleters


def test_without_its_peering_object_it_says_so_and_runs_standalone(samples: Cluster, workdir: Path):
    """kopf alone would wait forever, silently, for a KopfPeering that does not exist."""
    samples.kubectl("create", "namespace", "peerless")
    process = OperatorProcess(Path(samples.kubeconfig), ["--namespace", "peerless"], workdir / "peerless.log",
                              pod_id="tokenlane-operator-peerless")
    try:
        samples.kubectl("apply", "-n", "peerless", "-f", str(ROOT / "manifests" / "samples" / "tiny-cpu.yaml"))
        wait_for(lambda: observed(samples.get("msvc", "tiny", "peerless")), timeout=90, what="peerless/tiny reconciled")
        assert ("peering: no KopfPeering named 'tokenlane' in namespace 'peerless', so this operator runs "
                "standalone") in process.log()
    finally:
        # Deleted while the operator still runs, so it removes the finalizers it added.
        samples.kubectl("delete", "-n", "peerless", "-f", str(ROOT / "manifests" / "samples" / "tiny-cpu.yaml"),
                        "--wait=true", "--timeout=60s", check=False, timeout=90)
        process.stop()
        samples.kubectl("delete", "namespace", "peerless", "--wait=false", check=False)


# --------------------------------------------------------------------------- the cluster-wide overlay


def test_cluster_wide_overlay_serves_a_new_namespace(samples: Cluster, workdir: Path):
    """Swap the namespaced RBAC for the cluster-wide overlay's, run the operator as that overlay
    runs it (--all-namespaces, ClusterKopfPeering) and serve a namespace created afterwards."""
    operator_rbac = [d for d in kustomize(NAMESPACED) if d["kind"] in ("Role", "RoleBinding", "ClusterRole",
                                                                       "ClusterRoleBinding")
                     and d["metadata"]["name"].startswith("tokenlane-operator")]
    samples.kubectl("delete", "-f", "-", input=yaml.safe_dump_all(operator_rbac))
    samples.kubectl("apply", "-k", str(ROOT / CLUSTER_WIDE))
    run = Run(samples, workdir, CLUSTER_WIDE)
    assert "--all-namespaces" in run.args
    run.start()
    try:
        samples.kubectl("create", "namespace", "team-a")
        samples.kubectl("apply", "-n", "team-a", "-f", str(ROOT / "manifests" / "samples" / "tiny-cpu.yaml"))
        wait_for(lambda: observed(samples.get("msvc", "tiny", "team-a")), timeout=90, what="team-a/tiny reconciled")
        assert set(owned(samples, "team-a", "tiny")) == rendered_objects(
            "team-a", ROOT / "manifests" / "samples" / "tiny-cpu.yaml",
            service_monitor=bool(samples.get("crd", "servicemonitors.monitoring.coreos.com")))
        log = run.log()
        assert rbac_denials(log) == [], log[-4000:]
        assert "peering: ClusterKopfPeering 'tokenlane'" in log
        kubeconfig = str(workdir / "operator.kubeconfig")
        answer = samples.kubectl("auth", "can-i", "list", "secrets", "-A", kubeconfig=kubeconfig, check=False)
        assert answer.stdout.strip() == "no"
    finally:
        samples.kubectl("delete", "-n", "team-a", "-f", str(ROOT / "manifests" / "samples" / "tiny-cpu.yaml"),
                        "--wait=true", "--timeout=60s", check=False, timeout=90)
        run.stop()
        samples.kubectl("delete", "namespace", "team-a", "--wait=false", check=False)
