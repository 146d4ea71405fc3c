"""The closed loop on real parts (docs/architecture.md, "The budget path"): a real API server and
controller manager, the kubelet stand-in projecting the operator's ConfigMap into the runtime's
config file, Debian's Prometheus scraping a real `tokenlane serve`, and the operator with
tuning on, under a scripted interactive stream and a batch flood.

The tests of this module run in order on one setup (module fixture) and tell one story:
1. the flood starves the interactive lane; the tuner restores its SLO (TTFT p95 and refusals);
2. a probe that hurts is reverted (with headroom the tuner probes the batch lane's share
   upward, at worst back to where the flood starves the interactive lane); right after, a
   user's bad edit of a lane knob is in force within one reconcile, and the rollout guard
   rolls it back against the last-known-good revision's frozen baseline;
3. with Prometheus stopped the tuner holds (Tuning=False/PrometheusUnavailable), no budget moves,
   and the operator makes no API write at all (the API server's audit log).

Slow paths are slow by construction, not by the machine's load: the runtime runs the simulated
executor (real scheduler and lanes, a model step that sleeps for a cost model's time) and the
flood's batch requests take every slot for hundreds of steps, so an interactive request waits
seconds for a slot whenever the batch lane may use all of them, and a step or two otherwise.
Every wait is for an observable state (an Event, a condition, a value), with generous bounds.
A timeline is printed (`-s`) and written to $TOKENLANE_CLOSED_LOOP_TIMELINE when set.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest
import yaml

from closed_loop_harness import PROMETHEUS, KubeletStandin, Prometheus, Runtime, Timeline, Traffic, lane_window
from cluster_harness import (
    SHARED_K8S,
    Cluster,
    OperatorProcess,
    condition,
    free_port,
    now_stamp,
    service_account_kubeconfig,
    wait_for,
)
from tokenlane.runtime.config import SLOConfig

NS = "closed-loop"
NAME = "loop"
SA = "closed-loop-operator"
SA_USER = f"system:serviceaccount:{NS}:{SA}"
MODEL = "tiny"
WINDOW_S = 15.0  # tuning window, cooldown and verification window: 30 interactive requests each
# How often the tuner and the rollout guard run. Every decision waits for WINDOW_S of data
# after the change it judges, whatever the interval; a short one only makes each run come
# sooner after its window is complete (the operator's tick is shorter still: cluster_harness).
INTERVAL_S = 2.0
# A starved interactive request waits seconds; one with a free slot a step or two (tens of ms,
# a few hundred on a loaded machine): the target sits far from both.
TARGET_TTFT_MS = 1000.0
REFUSED_SHARE_TARGET = SLOConfig(ttft_p95_ms=TARGET_TTFT_MS).refused_share_target
LANES = ["interactive", "batch"]
SELECTOR = f"app.kubernetes.io/instance={NAME}"

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS),
                       reason="Debian's prometheus is not installed (scripts/test.sh installs it with apt-get)"),
    pytest.mark.skipif(not (SHARED_K8S / "kubelet-standin.sh").exists(),
                       reason="needs ../shared/k8s/kubelet-standin.sh (pods of a node-less control plane)"),
]


def model_service(prometheus_url: str) -> dict:
    """Eight slots in all; the batch lane may take all of them (what starves the interactive
    lane under the flood) and the tuner may move only its share, between 6 and 8. Short
    intervals so that the loop turns in seconds."""
    return {
        "apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "replicas": 1,
            "model": {"path": "/models/simulated", "servedName": MODEL, "maxModelLen": 2048},
            "engine": {"device": "cpu", "executor": "simulated"},
            "gpus": {"count": 0},
            "scheduler": {"maxActiveSequences": 8, "maxWaitingRequests": 64, "maxBatchedTokens": 512,
                          "prefillChunkSize": 128},
            "monitoring": {"serviceMonitor": False},
            "tuning": {"enabled": True, "prometheusUrl": prometheus_url, "interval": f"{INTERVAL_S:.0f}s",
                       "window": f"{WINDOW_S:.0f}s", "cooldown": f"{WINDOW_S:.0f}s"},
            "rollout": {"verificationWindow": f"{WINDOW_S:.0f}s", "progressDeadline": "120s"},
        },
    }


def lanes() -> list[dict]:
    def lane(lane_name: str, spec: dict) -> dict:
        return {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
                "metadata": {"name": f"{NAME}-{lane_name}", "namespace": NS},
                "spec": {"modelServiceRef": {"name": NAME}, "laneName": lane_name, **spec}}

    return [
        lane("interactive", {"class": "interactive", "priority": 100, "weight": 4, "default": True,
                             "slo": {"ttftP95Ms": TARGET_TTFT_MS}}),
        lane("batch", {"class": "batch", "priority": 10, "weight": 1,
                       "tuning": {"bounds": {"maxActiveSequences": {"min": 6, "max": 8}}}}),
    ]


class Loop:
    """The running setup the tests share."""

    def __init__(self, cluster: Cluster, operator: OperatorProcess, prometheus: Prometheus, runtime: Runtime,
                 traffic: Traffic, timeline: Timeline):
        self.cluster, self.operator, self.prometheus = cluster, operator, prometheus
        self.runtime, self.traffic, self.timeline = runtime, traffic, timeline
        self.baseline_ttft_ms: float | None = None  # the first revision's, frozen at its promotion

    def msvc(self) -> dict:
        return self.cluster.get("msvc", NAME, NS)

    def lane(self, lane_name: str) -> dict:
        return self.cluster.get("lane", f"{NAME}-{lane_name}", NS)

    def events(self, reason: str) -> list[dict]:
        items = json.loads(self.cluster.kubectl("-n", NS, "get", "events", "-o", "json").stdout)["items"]
        found = [e for e in items if e["reason"] == reason and e["involvedObject"]["name"] == NAME]
        return sorted(found, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def wait_event(self, reason: str, after: int = 0, timeout: float = 180) -> dict:
        """The first `reason` Event about the ModelService beyond the `after` already seen."""
        return wait_for(lambda: (found := self.events(reason)) and len(found) > after and found[after],
                        timeout=timeout, what=f"Event {reason}")

    def config_lane(self, lane_name: str) -> dict:
        config = yaml.safe_load(self.cluster.get("configmap", f"{NAME}-config", NS)["data"]["runtime.yaml"])
        (found,) = [lane for lane in config["lanes"] if lane["name"] == lane_name]
        return found

    def window(self) -> dict:
        return lane_window(self.prometheus.url, MODEL, NS, WINDOW_S, LANES)

    def tuning_runs(self) -> float:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.operator.metrics_port}/metrics",
                                          timeout=10).read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tokenlane_operator_tuning_runs_total{") and f'modelservice="{NAME}"' in line)

    def operator_writes(self, since: str) -> list[str]:
        writes = []
        for e in self.cluster.audit_events(since=since, user_contains=SA_USER):
            ref = e.get("objectRef") or {}
            if e["verb"] in ("get", "list", "watch"):
                continue
            writes.append(f"{e['verb']} {ref.get('resource')}/{ref.get('subresource') or ''} {ref.get('name')} "
                          f"-> {e['responseStatus']['code']}")
        return writes


@pytest.fixture(scope="module")
def loop(crds: Cluster, tmp_path_factory):
    if not crds.has_audit_log:
        pytest.skip("needs the control plane this tier starts (../shared/k8s): its audit log and pods without a kubelet")
    workdir = tmp_path_factory.mktemp("closed-loop")
    cluster = crds
    # The operator's own identity (a ServiceAccount token), so the audit log tells its writes
    # apart from the test's and the stand-in's. Its RBAC is not what this module tests
    # (test_operator_on_api_server does): cluster-admin keeps the setup to the loop.
    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("-n", NS, "create", "serviceaccount", SA)
    cluster.kubectl("create", "clusterrolebinding", SA, "--clusterrole=cluster-admin", f"--serviceaccount={NS}:{SA}")
    runtime_port = free_port()
    prometheus = Prometheus(workdir, runtime_port, NS)
    mounted = workdir / "mounted" / "runtime.yaml"
    runtime = Runtime(mounted, workdir / "serve.log", runtime_port)
    traffic = Traffic(runtime.url)
    timeline = Timeline(cluster, NS, NAME, WINDOW_S, lambda: prometheus.url if prometheus.running else None,
                        MODEL, LANES)
    operator = projection = readiness = None
    try:
        prometheus.start()
        kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig", namespace=NS, name=SA)
        operator = OperatorProcess(kubeconfig, ["--namespace", NS, "--standalone"], workdir / "operator.log",
                                   pod_id=SA)
        cluster.apply([model_service(prometheus.url), *lanes()])
        timeline.start()
        timeline.note("phase", "ModelService and lanes applied; operator, Prometheus up")
        # The file first (no pod matches the selector), then the runtime, then readiness.
        projection = KubeletStandin(cluster, NS, "tokenlane.dev/no-pod=none", f"{NAME}-config", mounted)
        wait_for(lambda: mounted.exists(), timeout=120, what="the ConfigMap projected into the runtime's file")
        runtime.start()
        traffic.start()
        timeline.note("phase", f"runtime serving; interactive stream on ({1 / traffic.every:g} req/s)")
        readiness = KubeletStandin(cluster, NS, SELECTOR, f"{NAME}-config", workdir / "readiness-standin.yaml")
        yield Loop(cluster, operator, prometheus, runtime, traffic, timeline)
    finally:
        timeline.close()
        timeline.write()
        traffic.close()
        for standin in (readiness, projection):
            if standin is not None:
                standin.stop()
        if operator is not None:
            # Deleted while the operator runs, so it removes the finalizers it added.
            cluster.kubectl("-n", NS, "delete", "msvc,servinglanes", "--all", "--wait=true", "--timeout=60s",
                            check=False, timeout=90)
            operator.stop()
            print(operator.log()[-5000:])
        runtime.close()
        prometheus.close()
        cluster.kubectl("delete", "clusterrolebinding", SA, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=90s", check=False, timeout=120)


def test_the_tuner_restores_the_interactive_slo_under_a_batch_flood(loop: Loop):
    # The first revision is verified on calm traffic: its window is the rollout guard's baseline.
    promoted = loop.wait_event("LastKnownGood", timeout=180)
    assert "first revision" in promoted["message"], promoted["message"]
    baseline = loop.msvc()["status"]["rollout"]["baseline"]
    assert baseline["interactive"]["ttftP95Ms"] < TARGET_TTFT_MS, baseline
    loop.baseline_ttft_ms = baseline["interactive"]["ttftP95Ms"]

    loop.traffic.flood(True)
    loop.timeline.note("phase", f"batch flood on ({loop.traffic.flood_clients} clients, "
                                f"{loop.traffic.flood_max_tokens}-token outputs)")
    tuned = loop.wait_event("BudgetsTuned", timeout=180)
    # The flood made the interactive lane miss (it queued for a slot) and the batch lane gave.
    assert "interactive TTFT p95" in tuned["message"] and "queueing" in tuned["message"], tuned["message"]
    assert "batch.maxActiveSequences 8->6" in tuned["message"], tuned["message"]
    # In force in the runtime (the next change, a probe, waits a full window after this one).
    wait_for(lambda: loop.runtime.budget("batch", "maxActiveSequences") == 6, timeout=60,
             what="the tuned budget in force in the runtime")

    # Restored: the operator says so, and Prometheus has a whole window within the SLO.
    wait_for(lambda: (condition(loop.lane("interactive"), "SLOMet") or {}).get("status") == "True"
             and condition(loop.lane("interactive"), "SLOMet")["lastTransitionTime"] >= tuned["lastTimestamp"],
             timeout=120, what="the interactive lane's SLOMet=True after the tuning")
    numbers = wait_for(lambda: (w := loop.window()) and w["interactive"][0] is not None
                       and w["interactive"][0] < TARGET_TTFT_MS and w, timeout=90,
                       what="a Prometheus window with the interactive TTFT p95 under target")
    ttft_ms, refused, requests = numbers["interactive"]
    loop.timeline.note("check", f"SLO restored: interactive TTFT p95 {ttft_ms:.0f}ms < {TARGET_TTFT_MS:.0f}ms, "
                                f"refused {refused:.1%} <= {REFUSED_SHARE_TARGET:.0%} ({requests} requests)")
    assert requests >= 20
    assert refused <= REFUSED_SHARE_TARGET


def test_a_bad_edit_right_after_a_reverted_probe_is_in_force_then_rolled_back(loop: Loop):
    # With headroom everywhere and batch work queued, the tuner probes the batch lane's share
    # upward, one slot at a time; a probe whose window is worse is reverted, and at the
    # latest the one to 8 slots is: it starves the interactive lane as the flood did.
    reverted = loop.wait_event("TuningReverted", timeout=240)
    move = re.search(r"batch\.maxActiveSequences (\d+)->(\d+)", reverted["message"])
    assert move and int(move[2]) < int(move[1]), reverted["message"]
    assert loop.events("TuningProbe"), "the reverted change was a probe"
    wait_for(lambda: loop.runtime.budget("batch", "maxActiveSequences") == int(move[2]), timeout=60,
             what="the revert in force in the runtime")
    loop.timeline.note("check", f"probe reverted: batch.maxActiveSequences back at {move[2]} in the runtime")

    # A user's edit right after: the interactive lane's prefill chunk down to 16 tokens, so
    # each interactive prompt (100 tokens) needs seven steps to its first token, not one.
    rolled_back_before = len(loop.events("RolledBack"))
    # The guard's yardstick is still the promotion's window, not the reverted probe's.
    assert loop.msvc()["status"]["rollout"]["baseline"]["interactive"]["ttftP95Ms"] == loop.baseline_ttft_ms
    loop.cluster.kubectl("-n", NS, "patch", "servinglane", f"{NAME}-interactive", "--type=merge",
                         "-p", json.dumps({"spec": {"budgets": {"prefillChunkSize": 16}}}))
    loop.timeline.note("phase", "user edit: interactive prefillChunkSize 128 -> 16")
    # In force within one reconcile: once the lane's status has seen the new generation (the
    # reconcile the edit triggered has finished) the ConfigMap already has it; no tuning run
    # is needed. Then the mounted file and the runtime follow.
    wait_for(lambda: (lane := loop.lane("interactive")) and lane["status"].get("observedGeneration")
             == lane["metadata"]["generation"], timeout=60, what="the reconcile of the edit")
    assert loop.config_lane("interactive")["prefillChunkSize"] == 16
    wait_for(lambda: loop.runtime.budget("interactive", "prefillChunkSize") == 16, timeout=60,
             what="the runtime to hot-reload the edit")
    loop.timeline.note("check", "edit in force: the runtime's interactive prefillChunkSize is 16")

    # Verified against the last-known-good revision's frozen baseline, not against the
    # reverted probe's bad window: rolled back, with the numbers.
    rolled_back = loop.wait_event("RolledBack", after=rolled_back_before, timeout=180)
    assert rolled_back["type"] == "Warning"
    assert "interactive TTFT p95" in rolled_back["message"], rolled_back["message"]
    assert f"vs {loop.baseline_ttft_ms:.0f}ms" in rolled_back["message"], (loop.baseline_ttft_ms, rolled_back["message"])
    msvc = loop.msvc()
    assert condition(msvc, "RolledBack")["status"] == "True"
    assert condition(msvc, "RolledBack")["reason"] == "SLORegression"
    wait_for(lambda: loop.runtime.budget("interactive", "prefillChunkSize") == 128, timeout=60,
             what="the last-known-good prefill chunk back in the runtime")
    loop.timeline.note("check", "rolled back: the runtime's interactive prefillChunkSize is 128 again")

    # The user takes the edit back: the spec renders the last-known-good revision again.
    loop.cluster.kubectl("-n", NS, "patch", "servinglane", f"{NAME}-interactive", "--type=merge",
                         "-p", json.dumps({"spec": {"budgets": {"prefillChunkSize": None}}}))
    wait_for(lambda: (loop.msvc()["status"].get("rollout") or {}).get("phase") == "Stable", timeout=120,
             what="the rollout guard Stable on the last-known-good revision")
    loop.traffic.flood(False)
    loop.timeline.note("phase", "edit taken back; batch flood off")


def test_the_tuner_holds_through_a_prometheus_outage_without_writing(loop: Loop):
    loop.prometheus.stop()
    loop.timeline.note("phase", "Prometheus stopped")
    wait_for(lambda: (c := condition(loop.msvc(), "Tuning")) and c["status"] == "False"
             and c["reason"] == "PrometheusUnavailable", timeout=120,
             what="Tuning=False/PrometheusUnavailable")
    # Past the run that started the hold (its condition, its Event): from here it only holds.
    runs = loop.tuning_runs()
    wait_for(lambda: loop.tuning_runs() >= runs + 1, timeout=60, what="one more tuning run")
    msvc = loop.msvc()
    overrides = msvc["status"].get("overrides")
    in_force = loop.runtime.budget("batch", "maxActiveSequences")
    since, runs = now_stamp(), loop.tuning_runs()
    wait_for(lambda: loop.tuning_runs() >= runs + 2, timeout=120, what="two tuning runs while holding")

    # The hold: no budget moved, in status or in the runtime.
    after = loop.msvc()
    assert condition(after, "Tuning")["reason"] == "PrometheusUnavailable"
    assert after["status"].get("overrides") == overrides
    assert loop.runtime.budget("batch", "maxActiveSequences") == in_force
    # Quiet status: not one write by the operator while it holds (the API server's audit log).
    writes = loop.operator_writes(since)
    loop.timeline.note("check", f"held for {loop.tuning_runs() - runs:.0f} runs with {len(writes)} operator writes")
    assert writes == []
    assert after["metadata"]["resourceVersion"] == msvc["metadata"]["resourceVersion"]
