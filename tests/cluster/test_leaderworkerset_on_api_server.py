"""spec.parallelism.pipeline on a real API server: a LeaderWorkerSet per pool.

With the upstream LeaderWorkerSet CRD installed (pinned in ../shared/k8s/thirdparty-crds; no
LeaderWorkerSet controller runs here, so the tests play it by writing its status), the
operator, running as its ServiceAccount under the namespaced overlay's RBAC, applies the
LeaderWorkerSet of a ModelService with `parallelism.pipeline: 2`, and the API server accepts it
under the upstream schema. `kubectl scale` of the ModelService moves the groups; the groups'
readiness (the status the missing controller would write) flows into the ModelService's status
through the operator's watch, with no write in steady state (audit log). Going back to one
stage swaps the LeaderWorkerSet for a Deployment (and the Service's selector loses the leader
label, by server-side apply). With the operator stopped and its finalizer removed, deleting the
ModelService lets the garbage collector remove the LeaderWorkerSet (its owner reference).

The tests of this module run in order and share one installation (module fixtures)."""

from __future__ import annotations

import json

import pytest

from cluster_harness import (
    OPERATOR_SA,
    SHARED_K8S,
    WORKLOAD_NS,
    Cluster,
    OperatorProcess,
    condition,
    now_stamp,
    rbac_denials,
    start_namespaced_operator,
    wait_for,
)

LWS_CRD_FILE = SHARED_K8S / "thirdparty-crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
SA_USER = f"system:serviceaccount:{OPERATOR_SA[0]}:{OPERATOR_SA[1]}"
LEADER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
NAME = "pipelined"
MSVC = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": NAME, "namespace": WORKLOAD_NS},
        "spec": {"model": {"path": "/models/tiny", "source": {"tinyModel": {}}},
                 "engine": {"device": "cpu"}, "gpus": {"count": 0},
                 "parallelism": {"tensor": 2, "pipeline": 2}}}


def _lws(cluster: Cluster) -> dict | None:
    return cluster.get(LWS_CRD, NAME, WORKLOAD_NS)


def _writes(cluster: Cluster, since: str) -> list[str]:
    """The operator's writes since `since` (any object), from the audit log."""
    return [f"{e['verb']} {(e.get('objectRef') or {}).get('resource')}/{(e.get('objectRef') or {}).get('name')}"
            for e in cluster.audit_events(since=since, user_contains=SA_USER)
            if e["verb"] not in ("get", "list", "watch")]


@pytest.fixture(scope="module")
def lws_crd(crds: Cluster):
    if not LWS_CRD_FILE.exists():
        pytest.skip(f"the upstream LeaderWorkerSet CRD is not at {LWS_CRD_FILE}")
    installed = crds.get("crd", LWS_CRD) is None
    if installed:
        crds.kubectl("apply", "--server-side", "--field-manager=tokenlane-cluster-tests", "-f", str(LWS_CRD_FILE))
    wait_for(lambda: (condition(crds.get("crd", LWS_CRD), "Established") or {}).get("status") == "True",
             what=f"{LWS_CRD} Established")
    yield crds
    if installed:  # other modules of the session see the cluster as it was
        crds.kubectl("-n", WORKLOAD_NS, "delete", "msvc", NAME, "--ignore-not-found", "--wait=false", check=False)
        crds.kubectl("delete", "crd", LWS_CRD, "--wait=true", "--timeout=120s", check=False)


@pytest.fixture(scope="module")
def operator(lws_crd: Cluster, tmp_path_factory):
    process = start_namespaced_operator(lws_crd, tmp_path_factory.mktemp("lws"), "tokenlane-operator-lws")
    yield process
    process.stop()
    print(process.log()[-4000:])


def test_api_server_accepts_the_rendered_leader_worker_set(lws_crd: Cluster, operator: OperatorProcess):
    lws_crd.apply([MSVC])  # our CRD's schema and CEL accept the parallelism (gpus.count 0: ranks on the CPU)
    lws = wait_for(lambda: _lws(lws_crd), timeout=120, what="the LeaderWorkerSet")
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    msvc = lws_crd.get("msvc", NAME, WORKLOAD_NS)
    owner = lws["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ModelService", msvc["metadata"]["uid"], True)
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert {"name": "dist", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    service = wait_for(lambda: lws_crd.get("service", NAME, WORKLOAD_NS), what="the Service")
    assert service["spec"]["selector"][LEADER_LABEL] == "0"
    config = wait_for(lambda: lws_crd.get("configmap", f"{NAME}-config", WORKLOAD_NS), what="the ConfigMap")
    assert "tensorParallelSize: 2" in config["data"]["runtime.yaml"]
    assert "pipelineParallelSize: 2" in config["data"]["runtime.yaml"]
    assert lws_crd.get("deployment", NAME, WORKLOAD_NS) is None
    assert not rbac_denials(operator.log())


def test_kubectl_scale_moves_the_groups(lws_crd: Cluster, operator: OperatorProcess):
    lws_crd.kubectl("-n", WORKLOAD_NS, "scale", f"msvc/{NAME}", "--replicas=2")
    wait_for(lambda: _lws(lws_crd)["spec"]["replicas"] == 2, timeout=120, what="two groups")


def test_group_readiness_flows_into_status_without_writes_in_steady_state(lws_crd: Cluster,
                                                                           operator: OperatorProcess):
    # Play the LeaderWorkerSet controller: both groups are ready.
    lws_crd.kubectl("-n", WORKLOAD_NS, "patch", LWS_CRD, NAME, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}))
    msvc = wait_for(lambda: (m := lws_crd.get("msvc", NAME, WORKLOAD_NS)) and
                    (condition(m, "Ready") or {}).get("status") == "True" and m, timeout=120,
                    what=f"{NAME} Ready=True from the groups' readiness")
    assert (msvc["status"]["replicas"], msvc["status"]["readyReplicas"]) == (2, 2)
    assert f"{LEADER_LABEL}=0" in msvc["status"]["selector"]  # an HPA counts the leaders
    if not lws_crd.has_audit_log:
        return
    # Steady state: another manager's change on the LeaderWorkerSet is an event, a reconcile and
    # no write at all.
    since, reconciles = now_stamp(), operator.reconciles()
    lws_crd.kubectl("-n", WORKLOAD_NS, "annotate", LWS_CRD, NAME, "example.com/touched=yes")
    wait_for(lambda: operator.reconciles() > reconciles, timeout=120, what="the reconcile after the annotation")
    assert _writes(lws_crd, since) == []


def test_one_stage_again_is_a_deployment(lws_crd: Cluster, operator: OperatorProcess):
    lws_crd.kubectl("-n", WORKLOAD_NS, "patch", "msvc", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"parallelism": {"tensor": 2, "pipeline": 1}}}))
    deployment = wait_for(lambda: lws_crd.get("deployment", NAME, WORKLOAD_NS), timeout=120, what="the Deployment")
    assert deployment["spec"]["replicas"] == 2
    wait_for(lambda: _lws(lws_crd) is None, timeout=120, what="the LeaderWorkerSet deleted")
    wait_for(lambda: LEADER_LABEL not in lws_crd.get("service", NAME, WORKLOAD_NS)["spec"]["selector"],
             timeout=120, what="the Service selecting every pod again")
    lws_crd.kubectl("-n", WORKLOAD_NS, "patch", "msvc", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"parallelism": {"tensor": 2, "pipeline": 2}}}))
    wait_for(lambda: _lws(lws_crd), timeout=120, what="the LeaderWorkerSet again")
    wait_for(lambda: lws_crd.get("deployment", NAME, WORKLOAD_NS) is None, timeout=120, what="the Deployment deleted")


def test_the_garbage_collector_removes_the_leader_worker_set(lws_crd: Cluster, operator: OperatorProcess):
    """Owner references are right when the real garbage collector, not the operator, deletes."""
    assert _lws(lws_crd) is not None
    operator.stop()
    since = now_stamp()
    lws_crd.kubectl("-n", WORKLOAD_NS, "patch", "msvc", NAME, "--type=merge", "-p", '{"metadata": {"finalizers": null}}')
    lws_crd.kubectl("-n", WORKLOAD_NS, "delete", "msvc", NAME, "--wait=true", "--timeout=60s")
    wait_for(lambda: _lws(lws_crd) is None, timeout=120, what="the LeaderWorkerSet garbage-collected")
    if lws_crd.has_audit_log:
        deleters = {e["user"]["username"] for e in lws_crd.audit_events(since=since)
                    if e["verb"] == "delete" and (e.get("objectRef") or {}).get("resource") == "leaderworkersets"}
        assert deleters == {"system:serviceaccount:kube-system:generic-garbage-collector"}, deleters
