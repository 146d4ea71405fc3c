"""The rollout guard and tuner timer in the running operator (kopf) against the kmock emulator.

Time is a fake clock the test moves; "Prometheus" is a sample the test sets (the real PromQL
path is covered by test_prometheus_integration.py). Each `advance()` moves the clock past
spec.tuning.interval and waits until the timer has run once at that time.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import yaml

from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.api.tuning_types import LaneMetrics, MetricSample
from tokenlane.runtime.config import loads_config

NS = "tokenlane-demo"
INTERVAL = 60.0

pytestmark = pytest.mark.timeout(240)


def _samples(cluster, tuning: dict | None = None, rollout: dict | None = None) -> list[dict]:
    msvc, interactive, batch = copy.deepcopy(cluster.harness.load_samples("tiny-cpu.yaml"))
    msvc["spec"]["tuning"] = {"enabled": False, "prometheusUrl": "http://prometheus.test:9090",
                              "interval": "60s", "window": "60s", "cooldown": "60s", **(tuning or {})}
    msvc["spec"]["rollout"] = {"verificationWindow": "120s", "progressDeadline": "300s", **(rollout or {})}
    return [msvc, interactive, batch]


def sample(ttft_ms: float = 300.0, tpot_ms: float = 50.0, queue_ms: float = 100.0) -> MetricSample:
    """One window: 120 interactive and 60 batch requests, nothing queued (so no probing)."""
    return MetricSample(60.0, {
        "interactive": LaneMetrics(2.0, ttft_ms / 1000, tpot_ms / 1000, queue_ms / 1000, 0.0, 0.0, 100.0),
        "batch": LaneMetrics(1.0, 5.0, 0.1, 2.0, 0.0, 0.0, 300.0),
    }, kv_usage=0.4)


async def wait(cluster, predicate, what: str = ""):
    """Generous timeouts: the machine running the suite may be busy (kopf reacts in ms when idle)."""
    return await cluster.wait_for(predicate, timeout=40.0, what=what)


def status(cluster) -> dict:
    return (cluster.obj("modelservices", "tiny") or {}).get("status") or {}


def runtime_yaml(cluster):
    return loads_config(cluster.obj("configmaps", "tiny-config")["data"]["runtime.yaml"])


def restart_hash(cluster) -> str:
    dep = cluster.obj("deployments", "tiny")
    return dep["spec"]["template"]["metadata"]["annotations"]["tokenlane.dev/restart-hash"]


async def advance(cluster, seconds: float = INTERVAL + 1) -> dict:
    cluster.clock.now += seconds
    now = cluster.clock.now
    await wait(cluster, lambda: cluster.tuning.last_run_at(NS, "tiny") == now, what=f"a tuning run at {now}")
    return status(cluster)


async def pods(cluster, ready: int, updated: int | None = None) -> None:
    """Play the Deployment controller."""
    updated = ready if updated is None else updated
    await cluster.client.merge_patch(k8s.DEPLOYMENTS, NS, "tiny",
                                     {"status": {"replicas": 1, "readyReplicas": ready, "updatedReplicas": updated}},
                                     subresource="status")


def events(cluster, reason: str) -> list[dict]:
    return [e for e in cluster.events() if e.get("reason") == reason]


async def start_stable(cluster, objs: list[dict]) -> str:
    """Create the ModelService and lanes, make its pods ready, verify it: it becomes the LKG."""
    for obj in objs:
        # kopf guards its own patches with a JSON-patch test of resourceVersion, which the
        # emulator does not set by itself.
        obj["metadata"].setdefault("resourceVersion", "1")
        await cluster.create(obj)
    await wait(cluster, lambda: cluster.obj("deployments", "tiny") and cluster.obj("configmaps", "tiny-config")
                           and len(runtime_yaml(cluster).lanes) == 2, what="rendered objects")
    await pods(cluster, 1)
    cluster.metrics.sample = sample()
    # The timer may already have run once at the start time; step by intervals until verified:
    # first sight (Verifying), pods ready (the window starts), window over (Stable).
    phases = []
    for _ in range(6):
        st = await advance(cluster)
        phases.append((st["rollout"]["phase"], st["rollout"].get("readyAt")))
        if st["rollout"]["phase"] == "Stable":
            break
    assert phases[-1][0] == "Stable" and phases[0][0] == "Verifying", phases
    ready_at = next(r for p, r in phases if r is not None)
    assert cluster.clock.now - ready_at >= 120  # promoted only after the verification window
    return st["rollout"]["lastKnownGood"]


async def test_good_revision_becomes_last_known_good(guarded_cluster):
    cluster = guarded_cluster
    first = await start_stable(cluster, _samples(cluster))
    cm = cluster.obj("configmaps", "tiny-rollout")
    assert cm["data"]["revision"] == first
    assert any(o["kind"] == "Deployment" for o in yaml.safe_load_all(cm["data"]["objects.yaml"]))
    assert cluster.condition("modelservices", "tiny", "RolledBack")["status"] == "False"
    await wait(cluster, lambda: events(cluster, "LastKnownGood"), what="LastKnownGood Event")
    # Prometheus is asked about this namespace's series only (same model name elsewhere must not mix).
    assert cluster.metrics.calls and {call[4] for call in cluster.metrics.calls} == {NS}

    # Not due before spec.tuning.interval has passed: the timer ticks, nothing runs.
    last = cluster.tuning.last_run_at(NS, "tiny")
    cluster.clock.now += 30
    await asyncio.sleep(5 * cluster.tuning.tick_s)  # five timer ticks
    assert cluster.tuning.last_run_at(NS, "tiny") == last
    assert "lastRunAt" not in status(cluster)["tuning"]  # a metric, not a status write every interval

    # A budget change is a new revision (new runtime config, same pods): verified, then promoted.
    await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"maxBatchedTokens": 384}})
    await wait(cluster, lambda: runtime_yaml(cluster).scheduler.max_batched_tokens == 384, what="new budget")
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Verifying" and st["rollout"]["revision"] != first
    await advance(cluster)
    st = await advance(cluster, 121)
    assert st["rollout"]["phase"] == "Stable"
    assert st["rollout"]["lastKnownGood"] == st["rollout"]["revision"] != first
    assert cluster.obj("configmaps", "tiny-rollout")["data"]["revision"] == st["rollout"]["lastKnownGood"]
    assert runtime_yaml(cluster).scheduler.max_batched_tokens == 384


async def test_revision_whose_pods_never_become_ready_is_rolled_back(guarded_cluster):
    cluster = guarded_cluster
    lkg = await start_stable(cluster, _samples(cluster))
    good_hash = restart_hash(cluster)

    await cluster.patch_spec("modelservices", "tiny", {"model": {"maxModelLen": 512}})  # new pod template
    await wait(cluster, lambda: restart_hash(cluster) != good_hash, what="new pod template")
    await pods(cluster, ready=0, updated=0)  # the new pods never become ready
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Verifying"
    st = await advance(cluster, 200)
    assert st["rollout"]["phase"] == "Verifying"  # still inside the 300 s progress deadline
    st = await advance(cluster, 120)

    assert st["rollout"]["phase"] == "RolledBack"
    cond = cluster.condition("modelservices", "tiny", "RolledBack")
    assert cond["status"] == "True" and cond["reason"] == "ProgressDeadlineExceeded"
    assert "0/1 pods ready" in cond["message"] and lkg in cond["message"]
    warn = await wait(cluster, lambda: events(cluster, "RolledBack"), what="RolledBack Event")
    assert warn[-1]["type"] == "Warning" and "progress deadline" in warn[-1]["message"]
    # The last-known-good objects are back; the spec is as the user wrote it.
    await wait(cluster, lambda: restart_hash(cluster) == good_hash, what="LKG pod template restored")
    assert runtime_yaml(cluster).model.max_model_len == 1024
    assert cluster.obj("modelservices", "tiny")["spec"]["model"]["maxModelLen"] == 512
    # The operator's own reconcile (timer, resume, lane change) keeps the LKG in force.
    from tokenlane.operator.controllers.handlers import reconcile_model_service

    await reconcile_model_service(cluster.op, NS, "tiny")
    assert restart_hash(cluster) == good_hash
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "RolledBack"

    # Fixing the spec (here: back to the LKG) ends the rollback.
    await cluster.patch_spec("modelservices", "tiny", {"model": {"maxModelLen": 1024}})
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Stable" and st["rollout"]["lastKnownGood"] == lkg
    assert cluster.condition("modelservices", "tiny", "RolledBack")["status"] == "False"


async def test_revision_whose_metrics_regress_is_rolled_back(guarded_cluster):
    cluster = guarded_cluster
    lkg = await start_stable(cluster, _samples(cluster))

    await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"prefillChunkSize": 512}})
    await wait(cluster, lambda: runtime_yaml(cluster).scheduler.prefill_chunk_size == 512, what="new chunk size")
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Verifying"
    cluster.metrics.sample = sample(ttft_ms=900)  # the new revision is 3x slower to first token
    await advance(cluster)
    st = await advance(cluster, 121)

    assert st["rollout"]["phase"] == "RolledBack"
    cond = cluster.condition("modelservices", "tiny", "RolledBack")
    assert cond["status"] == "True" and cond["reason"] == "SLORegression"
    assert "interactive TTFT p95 900ms vs 300ms (+200% > +25%)" in cond["message"]
    warn = await wait(cluster, lambda: events(cluster, "RolledBack"), what="RolledBack Event")
    assert warn[-1]["type"] == "Warning" and "SLORegression" not in warn[-1]["message"]
    assert "interactive TTFT p95 900ms vs 300ms" in warn[-1]["message"]
    await wait(cluster, lambda: runtime_yaml(cluster).scheduler.prefill_chunk_size == 128, what="LKG config")
    assert cluster.obj("modelservices", "tiny")["spec"]["scheduler"]["prefillChunkSize"] == 512
    assert st["rollout"]["lastKnownGood"] == lkg and st["rollout"]["rolledBackRevision"] != lkg


async def test_fallback_when_even_the_last_known_good_misses_badly(guarded_cluster):
    cluster = guarded_cluster
    objs = _samples(cluster, rollout={"fallback": {"policy": "StaticBatching", "budgetPercent": 50,
                                                   "after": "120s"}})
    await start_stable(cluster, objs)
    cluster.metrics.sample = sample(ttft_ms=2500)  # > 2 x the 1000 ms target
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Stable" and st["rollout"]["badSince"] == cluster.clock.now
    st = await advance(cluster, 121)
    assert st["rollout"]["phase"] == "Fallback"
    assert st["overrides"]["engine"] == {"continuousBatching": False}
    assert st["overrides"]["scheduler"]["maxBatchedTokens"] == 256
    await wait(cluster, lambda: runtime_yaml(cluster).engine.continuous_batching is False, what="static batching")
    assert runtime_yaml(cluster).scheduler.max_batched_tokens == 256
    cond = cluster.condition("modelservices", "tiny", "RolledBack")
    assert cond["status"] == "True" and cond["reason"] == "FallbackApplied"
    fallback = await wait(cluster, lambda: events(cluster, "FallbackApplied"), what="FallbackApplied Event")
    assert "continuousBatching: false" in fallback[-1]["message"]


async def test_tuner_timer_writes_budgets_status_and_events(guarded_cluster):
    cluster = guarded_cluster
    objs = _samples(cluster, tuning={"enabled": True, "bounds": {
        "maxActiveSequences": {"min": 2, "max": 16}, "maxBatchedTokens": {"min": 128, "max": 512}}})
    await start_stable(cluster, objs)
    good_hash = restart_hash(cluster)

    # Interactive misses TTFT because requests queue: batch gives up token budget.
    cluster.metrics.sample = sample(ttft_ms=2000, queue_ms=1500)
    st = await advance(cluster)
    changes = st["tuning"]["history"][-1]["changes"]
    assert st["tuning"]["lastDecision"]["action"] == "adjust"
    assert {"scope": "batch", "knob": "maxBatchedTokens", "old": 512, "new": 384} == \
        {k: v for k, v in next(c for c in changes if c["scope"] == "batch" and c["knob"] == "maxBatchedTokens").items()
         if k != "why"}
    assert st["overrides"]["lanes"]["batch"]["maxBatchedTokens"] == 384
    await wait(cluster, lambda: runtime_yaml(cluster).lane("batch").max_batched_tokens == 384, what="hot reload")
    assert restart_hash(cluster) == good_hash  # budgets never restart pods
    await wait(cluster, lambda: events(cluster, "BudgetsTuned"), what="BudgetsTuned Event")
    slo = cluster.condition("modelservices", "tiny", "SLOMet")
    assert slo["status"] == "False" and "TTFT p95 2000ms > 1000ms" in slo["message"]
    await wait(cluster, lambda: cluster.obj("servinglanes", "tiny-interactive")["status"]["slo"]["met"] == "False",
                           what="lane SLOMet")
    lane_cond = cluster.condition("servinglanes", "tiny-interactive", "SLOMet")
    assert lane_cond["status"] == "False" and lane_cond["reason"] == "TtftAboveTarget"
    assert st["rollout"]["phase"] == "Stable"  # tuned budgets are not a new revision

    # Prometheus goes away: the tuner holds the budgets and says so, once.
    cluster.metrics.sample = None
    st = await advance(cluster)
    cond = cluster.condition("modelservices", "tiny", "Tuning")
    assert cond["status"] == "False" and cond["reason"] == "PrometheusUnavailable"
    assert st["overrides"]["lanes"]["batch"]["maxBatchedTokens"] == 384
    def unavailable_events():
        return [e for e in events(cluster, "TuningHeld") if "Prometheus unavailable" in e["message"]]

    held = await wait(cluster, unavailable_events, what="TuningHeld Event")
    assert held[0]["type"] == "Warning"
    await advance(cluster)
    await advance(cluster)
    assert len(unavailable_events()) == 1  # said once, not every interval
    assert (await advance(cluster))["overrides"]["lanes"]["batch"]["maxBatchedTokens"] == 384


def writes(cluster) -> list[tuple[str, str, str, str]]:
    return cluster.harness.operator_write_calls(cluster.kmock)


async def test_holding_writes_nothing(guarded_cluster):
    """Quiet status: while the tuner only holds, a run is no API write at all (no per-run
    timestamp in status, SLO messages kept, the same Event not posted again)."""
    cluster = guarded_cluster
    await start_stable(cluster, _samples(cluster, tuning={"enabled": True, "bounds": {
        "maxActiveSequences": {"min": 2, "max": 16}}}))
    # Every lane has headroom and nothing queues: hold. The first hold may write its record.
    await advance(cluster)
    st = await advance(cluster)
    assert st["tuning"]["lastDecision"]["action"] == "hold", st["tuning"]["lastDecision"]
    before = writes(cluster)
    for step in range(4):
        # A window's numbers move while the verdict holds (live numbers are metrics).
        cluster.metrics.sample = sample(ttft_ms=300 + 10 * step)
        await advance(cluster)
    assert writes(cluster)[len(before):] == []
    from tokenlane.operator.controllers import metrics

    runs = metrics.TUNING_RUNS.labels(namespace=NS, modelservice="tiny", outcome="hold")._value.get()
    assert runs >= 5
    assert metrics.TUNING_LAST_RUN.labels(namespace=NS, modelservice="tiny")._value.get() == cluster.clock.now

    # Prometheus goes away: one run writes the new condition and one Warning; then quiet again.
    cluster.metrics.sample = None
    await advance(cluster)
    assert cluster.condition("modelservices", "tiny", "Tuning")["reason"] == "PrometheusUnavailable"
    def outage_events():
        return [e for e in events(cluster, "TuningHeld") if "Prometheus unavailable" in e["message"]]

    await wait(cluster, outage_events, what="TuningHeld Event")
    before = writes(cluster)
    for _ in range(3):
        await advance(cluster)
    assert writes(cluster)[len(before):] == []
    assert [e["type"] for e in outage_events()] == ["Warning"]


async def test_hold_while_verifying_is_a_normal_event(guarded_cluster):
    """Verifying a revision is routine: its TuningHeld is Normal even while Prometheus is down."""
    cluster = guarded_cluster
    await start_stable(cluster, _samples(cluster, tuning={"enabled": True}))
    await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"maxBatchedTokens": 384}})
    await wait(cluster, lambda: runtime_yaml(cluster).scheduler.max_batched_tokens == 384, what="new budget")
    cluster.metrics.sample = None
    earlier = len(events(cluster, "TuningHeld"))  # start_stable's own verification held too
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Verifying"
    held = await wait(cluster, lambda: events(cluster, "TuningHeld")[earlier:], what="TuningHeld Event")
    assert [(e["type"], "verifying revision" in e["message"]) for e in held] == [("Normal", True)]
    assert cluster.condition("modelservices", "tiny", "Tuning")["reason"] == "VerifyingRevision"


async def test_user_edit_wins_over_the_tuner_override(guarded_cluster):
    """Precedence: the tuner's override of a knob is dropped when the user edits that knob's
    spec value; the edit is in force after one reconcile, status says where each value comes from."""
    cluster = guarded_cluster
    await start_stable(cluster, _samples(cluster, tuning={"enabled": True, "bounds": {
        "maxActiveSequences": {"min": 2, "max": 16}, "maxBatchedTokens": {"min": 128, "max": 512}}}))
    cluster.metrics.sample = sample(ttft_ms=2000, queue_ms=1500)
    st = await advance(cluster)
    assert st["overrides"]["lanes"]["batch"]["maxBatchedTokens"] == 384
    assert st["overrides"]["learnedFrom"]["lanes"]["batch"]["maxBatchedTokens"] == 512
    await wait(cluster, lambda: runtime_yaml(cluster).lane("batch").max_batched_tokens == 384, what="tuned value")
    lane = await wait(cluster, lambda: (cluster.obj("servinglanes", "tiny-batch")["status"].get("budgets") or {})
                      .get("maxBatchedTokens", {}).get("source") == "tuner" and cluster.obj("servinglanes", "tiny-batch"),
                      what="lane status: source tuner")
    assert lane["status"]["budgets"]["maxBatchedTokens"] == {"value": 384, "source": "tuner"}
    assert lane["status"]["overriddenKnobs"] >= 1

    # The user sets the knob: the ServingLane's reconcile renders it, no tuning run needed.
    cluster.metrics.sample = sample()
    runs_before = cluster.tuning.last_run_at(NS, "tiny")
    batch = cluster.obj("servinglanes", "tiny-batch")
    await cluster.patch_spec("servinglanes", "tiny-batch", {"budgets": {**batch["spec"]["budgets"],
                                                                        "maxBatchedTokens": 256}})
    await wait(cluster, lambda: runtime_yaml(cluster).lane("batch").max_batched_tokens == 256, what="user's value")
    assert cluster.tuning.last_run_at(NS, "tiny") == runs_before
    await wait(cluster, lambda: cluster.obj("servinglanes", "tiny-batch")["status"]["budgets"]["maxBatchedTokens"]
               == {"value": 256, "source": "spec"}, what="lane status: source spec")

    # The next tuning run drops the override from status and says so; the spec value stays in force.
    st = await advance(cluster)
    assert "maxBatchedTokens" not in ((st.get("overrides") or {}).get("lanes") or {}).get("batch", {})
    dropped = await wait(cluster, lambda: events(cluster, "OverrideDropped"), what="OverrideDropped Event")
    assert "batch.maxBatchedTokens: spec changed 512->256, tuner override 384 dropped" in dropped[-1]["message"]
    for _ in range(3):  # verifying the new revision, then tuning again: never over the edit
        await advance(cluster, 61)
        assert runtime_yaml(cluster).lane("batch").max_batched_tokens <= 256
    assert cluster.obj("servinglanes", "tiny-batch")["spec"]["budgets"]["maxBatchedTokens"] == 256


async def test_no_decision_on_a_bad_window(guarded_cluster):
    """The tuner does not decide in the run that rolls a revision back, nor on a window that
    spans the rollback; the change it was evaluating when the revision changed is inconclusive
    (never credited with what the rollback did)."""
    cluster = guarded_cluster
    await start_stable(cluster, _samples(cluster, tuning={"enabled": True, "window": "120s", "bounds": {
        "maxActiveSequences": {"min": 2, "max": 16}, "maxBatchedTokens": {"min": 128, "max": 512}}}))
    missing = dataclasses.replace(sample(ttft_ms=2000, queue_ms=1500), window_s=120.0)
    cluster.metrics.sample = missing
    st = await advance(cluster)
    assert st["tuning"]["lastDecision"]["action"] == "adjust"
    experiment = st["tuning"]["history"][-1]["at"]
    tuned = st["overrides"]

    # A bad spec change: verifying it makes the experiment inconclusive (the window no longer measures it).
    await cluster.patch_spec("modelservices", "tiny", {"scheduler": {"prefillChunkSize": 512}})
    await wait(cluster, lambda: runtime_yaml(cluster).scheduler.prefill_chunk_size == 512, what="new chunk size")
    st = await advance(cluster)
    assert st["rollout"]["phase"] == "Verifying"
    last = st["tuning"]["history"][-1]
    assert (last["action"], last["judged"], last["verdict"]) == ("hold", experiment, "inconclusive")
    await advance(cluster)
    st = await advance(cluster, 121)

    # The run that rolls back: no decision from the bad revision's window.
    assert st["rollout"]["phase"] == "RolledBack"
    assert st["tuning"]["lastDecision"]["action"] == "hold"
    assert st["tuning"]["lastDecision"]["reason"].startswith("holding budgets: rolling back revision")
    assert cluster.condition("modelservices", "tiny", "Tuning")["reason"] == "RollingBack"
    assert st["overrides"] == tuned

    # The next run's 120 s window still holds the bad revision: hold again.
    st = await advance(cluster)
    assert st["tuning"]["lastDecision"]["action"] == "hold"
    assert "spans the change" in st["tuning"]["lastDecision"]["reason"]
    assert cluster.condition("modelservices", "tiny", "Tuning")["reason"] == "SettlingWindow"
    assert st["overrides"] == tuned

    # A whole window on the last-known-good: the tuner decides again, and never credited itself.
    st = await advance(cluster)
    assert st["tuning"]["lastDecision"]["action"] == "adjust", st["tuning"]["lastDecision"]
    assert not [r for r in st["tuning"]["history"] if r.get("judged") == experiment and r["verdict"] != "inconclusive"]
