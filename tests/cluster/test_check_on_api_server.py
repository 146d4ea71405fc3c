"""`tokenlane check -n NS` on a real API server: the live ModelServices and ServingLanes give the
same findings as their files, the tuner's status.overrides are what is checked, and the alert
rules are looked up as PrometheusRule objects (absent API, then present)."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster_harness import ROOT, SHARED_K8S, Cluster, wait_for

from tokenlane.cli import main as tokenlane

NS = "check-tests"
SAMPLE = ROOT / "manifests" / "samples" / "llama3-8b.yaml"
PROMETHEUS_RULE = ROOT / "manifests" / "monitoring" / "prometheusrule.yaml"
PROMETHEUS_RULE_CRD = "prometheusrules.monitoring.coreos.com"


@pytest.fixture(scope="module")
def ns(crds: Cluster):
    crds.kubectl("create", "namespace", NS)
    crds.kubectl("apply", "-n", NS, "-f", str(SAMPLE))
    yield crds
    crds.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


def check_json(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    status = tokenlane(["check", *argv, "-o", "json"])
    return status, json.loads(capsys.readouterr().out)


def findings(report: dict, *, but: tuple[str, ...] = ("alerts-not-found", "alerts-missing")) -> set[tuple]:
    return {(f["rule"], f["object"], f["key"]) for f in report["findings"] if f["rule"] not in but}


def test_live_objects_are_checked_as_their_files(ns: Cluster, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", ns.kubeconfig)
    status, live = check_json(capsys, "-n", NS)
    _, files = check_json(capsys, "-f", str(SAMPLE))
    assert status == 0, live
    assert live["checked"] == [f"ModelService {NS}/llama3-8b"]
    assert findings(live) == {(rule, obj.replace("default/", f"{NS}/"), key) for rule, obj, key in findings(files)}
    assert findings(live)  # the sample's batch lane cap, at least: the comparison is not of two empty sets

    # --context picks the kubeconfig's context by name.
    context = yaml.safe_load(open(ns.kubeconfig.split(":")[0]))["current-context"]
    status, again = check_json(capsys, "-n", NS, "--context", context)
    assert (status, findings(again)) == (0, findings(live))


def test_tuned_overrides_are_what_is_checked(ns: Cluster, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", ns.kubeconfig)
    patch = {"status": {"overrides": {"lanes": {"interactive": {"queueTimeoutMs": 300}}}}}
    ns.kubectl("-n", NS, "patch", "modelservice", "llama3-8b", "--subresource=status", "--type=merge",
               "-p", json.dumps(patch))
    try:
        status, report = check_json(capsys, "-n", NS)
        assert status == 1
        (finding,) = [f for f in report["findings"] if f["severity"] == "error"]
        assert (finding["rule"], finding["object"], finding["key"]) == (
            "queue-timeout-below-ttft", f"ServingLane {NS}/llama3-8b-interactive", "spec.budgets.queueTimeoutMs")
        assert "300 ms" in finding["message"]
    finally:
        ns.kubectl("-n", NS, "patch", "modelservice", "llama3-8b", "--subresource=status", "--type=merge",
                   "-p", json.dumps({"status": {"overrides": None}}))


def test_alert_rules_are_read_from_prometheusrule_objects(ns: Cluster, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", ns.kubeconfig)
    installed = False
    if ns.get("crd", PROMETHEUS_RULE_CRD) is None:
        _, report = check_json(capsys, "-n", NS)
        (absent,) = [f for f in report["findings"] if f["rule"] == "alerts-not-found"]
        assert "no PrometheusRule API" in absent["message"]
        crd_file = SHARED_K8S / "thirdparty-crds" / "monitoring.coreos.com_prometheusrules.yaml"
        if not crd_file.exists():
            pytest.skip(f"{crd_file} not found: cannot install the PrometheusRule CRD")
        ns.kubectl("apply", "--server-side", "-f", str(crd_file))
        installed = True
        wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True"
                             for c in (ns.get("crd", PROMETHEUS_RULE_CRD) or {}).get("status", {}).get("conditions", [])),
                 what="PrometheusRule CRD Established")
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    rule["metadata"]["namespace"] = NS
    try:
        # Only some of the project's alerts: the missing ones are named.
        partial = json.loads(json.dumps(rule))
        for group in partial["spec"]["groups"]:
            group["rules"] = [r for r in group["rules"] if r.get("alert") != "TokenlaneHighErrorRate"]
        wait_for(lambda: ns.apply([partial]).returncode == 0, what="PrometheusRule accepted")
        other = [r for r in json.loads(ns.kubectl("get", "prometheusrules", "-A", "-o", "json").stdout)["items"]
                 if "TokenlaneHighErrorRate" in json.dumps(r)]
        _, report = check_json(capsys, "-n", NS)
        alert_findings = [f for f in report["findings"] if f["rule"].startswith("alerts-")]
        if not other:  # a KUBECONFIG cluster may already carry the project's rules elsewhere
            assert [(f["rule"], f["message"]) for f in alert_findings] == [
                ("alerts-missing", "missing alert(s): TokenlaneHighErrorRate")]
        ns.apply([rule])
        status, report = check_json(capsys, "-n", NS)
        assert status == 0 and not [f for f in report["findings"] if f["rule"].startswith("alerts-")]
    finally:
        ns.kubectl("-n", NS, "delete", "prometheusrule", rule["metadata"]["name"], "--ignore-not-found", check=False)
        if installed:
            ns.kubectl("delete", "crd", PROMETHEUS_RULE_CRD, "--wait=true", "--timeout=120s", check=False)


def test_a_namespace_without_tokenlane_objects_is_a_usage_error(crds: Cluster, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", crds.kubeconfig)
    assert tokenlane(["check", "-n", "kube-public"]) == 2
    assert "no ModelService or ServingLane in namespace kube-public" in capsys.readouterr().err
