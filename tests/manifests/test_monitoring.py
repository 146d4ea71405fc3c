"""Observability: the alert and recording rules pass promtool (syntax and unit tests), the
PrometheusRule matches the plain rule file, the Prometheus config is valid, and every metric
named in the rules and the Grafana dashboard is one the runtime or the operator exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from manifests_helpers import MANIFESTS, free_port, render, stop_process, wait_http_ready

MONITORING = MANIFESTS / "monitoring"
RULES = MONITORING / "prometheus" / "tokenlane-rules.yaml"
RULES_TEST = MONITORING / "prometheus" / "tokenlane-rules.test.yaml"
PROMETHEUS_YML = MONITORING / "prometheus" / "prometheus.yml"
DASHBOARD = MONITORING / "grafana" / "tokenlane-dashboard.json"
KSM_CONFIG = MONITORING / "kube-state-metrics" / "custom-resource-state.yaml"
# Series Prometheus itself adds (not exported by us).
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian's `prometheus` package; scripts/setup.sh --system "
                    "installs it)")
    return path


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def _rules() -> list[dict]:
    return [rule for group in _rule_groups() for rule in group["rules"]]


# ---- metric names

def kube_state_metrics_names() -> set[str]:
    """The series kube-state-metrics exports for our custom resources with our config."""
    config = yaml.safe_load(KSM_CONFIG.read_text())
    return {f"{res['metricNamePrefix']}_{metric['name']}"
            for res in config["spec"]["resources"] for metric in res["metrics"]}


def test_kube_state_metrics_config_reads_fields_the_crds_have():
    from manifests_helpers import ROOT

    config = yaml.safe_load(KSM_CONFIG.read_text())
    for res in config["spec"]["resources"]:
        gvk = res["groupVersionKind"]
        plural = {"ModelService": "modelservices", "ServingLane": "servinglanes"}[gvk["kind"]]
        crd = yaml.safe_load((ROOT / "crds" / f"{plural}.{gvk['group']}.yaml").read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == gvk["version"]]
        schema = version["schema"]["openAPIV3Schema"]

        def resolve(path: list[str]) -> dict:
            node = schema
            for key in path:
                if key == "metadata":
                    return {"type": "object"}
                node = node["properties"][key]
            return node

        for path in res.get("labelsFromPath", {}).values():
            resolve(path)
        for metric in res["metrics"]:
            gauge = metric["each"]["gauge"]
            node = resolve(gauge["path"])
            if node.get("type") == "array":
                node = node["items"]
                for path in list(gauge.get("labelsFromPath", {}).values()) + [gauge.get("valueFrom", [])]:
                    sub = node
                    for key in path:
                        sub = sub["properties"][key]


def exported_series_names() -> set[str]:
    """Every series name the runtime's and the operator's registries can expose, and what
    kube-state-metrics exports from our custom resources."""
    from prometheus_client.metrics import MetricWrapperBase

    from tokenlane.runtime.observability.metrics import PrometheusMetrics

    families = list(PrometheusMetrics(model="probe").registry.collect())
    try:
        import tokenlane.operator.controllers.metrics as operator_metrics
    except ImportError:
        operator_metrics = None
    if operator_metrics is not None:
        for value in vars(operator_metrics).values():
            if isinstance(value, MetricWrapperBase):
                families += value.describe()
    from tokenlane.runtime.observability import gpu_metrics

    names = kube_state_metrics_names() | set(gpu_metrics.NAMES)  # NVML gauges: only where a GPU is
    for family in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""],
                    "summary": ["", "_count", "_sum"], "info": ["_info"]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def series_names(expr: str) -> tuple[set[str], set[str]]:
    """(exported metric names, recording rule names) a PromQL expression reads."""
    bare = _STRING.sub('""', expr)
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors and subqueries: [5m], [$__rate_interval]
    metrics, recorded = set(), set()
    for token in _NAME.findall(bare):
        if ":" in token:
            recorded.add(token)
        elif token.startswith(("tokenlane_", "kube_tokenlane_")) or token in PROMETHEUS_BUILTINS:
            metrics.add(token)
    return metrics, recorded


def test_series_name_parser():
    metrics, recorded = series_names(
        'sum by (lane) (rate(tokenlane_requests_total{outcome="tokenlane_fake"}[5m])) '
        '/ on (lane) model_lane:tokenlane_requests:rate5m')
    assert metrics == {"tokenlane_requests_total"}
    assert recorded == {"model_lane:tokenlane_requests:rate5m"}


def test_rules_read_only_metrics_the_runtime_and_operator_export():
    exported = exported_series_names()
    assert "tokenlane_time_to_first_token_seconds_bucket" in exported  # the registry was read
    defined = {rule["record"] for rule in _rules() if "record" in rule}
    for rule in _rules():
        metrics, recorded = series_names(rule["expr"])
        unknown = sorted(m for m in metrics if m not in exported and m not in PROMETHEUS_BUILTINS)
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads metrics nobody exports: {unknown}"
        undefined = sorted(recorded - defined)
        assert not undefined, f"{rule.get('alert') or rule.get('record')} reads undefined recording rules: {undefined}"


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    exprs += [v["query"]["query"].split("(", 1)[1].rsplit(",", 1)[0]
              for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_reads_only_exported_metrics():
    exported = exported_series_names()
    for expr in _dashboard_exprs():
        metrics, recorded = series_names(expr)
        assert metrics, f"a dashboard query reads no tokenlane metric: {expr}"
        unknown = sorted(metrics - exported - PROMETHEUS_BUILTINS)
        assert not unknown, f"dashboard query reads metrics nobody exports: {unknown}\n{expr}"


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "model", "lane"} <= names
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("first token", "per output token", "queue delay", "tokens/s", "kv cache", "budgets"):
        assert topic in titles, f"the dashboard has no panel on {topic}"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in names or var.startswith("__"), f"{panel['title']}: unknown variable ${var}"


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every dashboard query (as a recording rule, template variables filled)."""
    exprs = []
    for expr in _dashboard_exprs():
        expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
        exprs.append(re.sub(r"\$(\w+)", r".*", expr))
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query:{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(rules))
    result = _promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_ships_as_a_grafana_sidecar_configmap():
    (cm,) = [o for o in render("manifests/monitoring") if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["tokenlane-dashboard.json"]) == json.loads(DASHBOARD.read_text())


# ---- rules

def test_rules_pass_promtool_check():
    result = _promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_fire_on_the_series_they_are_about():
    result = _promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheusrule_matches_the_plain_rule_file(tmp_path):
    (rule,) = [o for o in render("manifests/monitoring") if o["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == _rule_groups(), (
        "manifests/monitoring/prometheusrule.yaml drifted from prometheus/tokenlane-rules.yaml")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = _promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_the_platform_needs_exist():
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    for needed in ("TokenlaneLaneTTFTBudgetBurnFast", "TokenlaneLaneTTFTBudgetBurnSlow",
                   "TokenlaneLaneTPOTBudgetBurnFast", "TokenlaneLaneTPOTBudgetBurnSlow",
                   "TokenlaneKVCacheNearRejectWatermark", "TokenlaneHighRejectionRate",
                   "TokenlaneHighTimeoutRate", "TokenlaneRolledBack", "TokenlaneTunerStuck",
                   "TokenlaneOutOfMemory", "TokenlaneKVReleaseSlow"):
        assert needed in alerts
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_every_alert_has_a_unit_test():
    tested = {case["alertname"] for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    untested = sorted({rule["alert"] for rule in _rules() if "alert" in rule} - tested)
    assert not untested, f"alerts without a promtool unit test in {RULES_TEST.name}: {untested}"


# ---- scrape configuration

def test_prometheus_config_is_valid(tmp_path):
    """promtool checks the config and its rule files. Debian's promtool is built without
    Kubernetes service discovery, so the kubernetes_sd_configs are swapped for static targets
    (the relabelling rules, which are what can go wrong, are still checked)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs"), job["job_name"]
        job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(RULES, tmp_path / RULES.name)
    result = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_keeps_the_pods_the_operator_renders():
    """The runtime job keeps exactly the label values the operator puts on runtime pods."""
    builders = pytest.importorskip("tokenlane.operator.desired.builders")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tokenlane-runtime"]
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep"
    labels = {"app.kubernetes.io/name": "tokenlane", "app.kubernetes.io/component": "runtime"}
    assert builders.LABEL_NAME in labels and builders.LABEL_COMPONENT in labels
    values = ";".join(labels[k] for k in (builders.LABEL_NAME, builders.LABEL_COMPONENT))
    assert re.fullmatch(keep["regex"], values)


def test_operator_servicemonitor_selects_the_operator_metrics_service():
    (monitor,) = [o for o in render("manifests/monitoring") if o["kind"] == "ServiceMonitor"]
    (service,) = [o for o in render("manifests/overlays/cluster-wide")
                  if o["kind"] == "Service" and o["metadata"]["name"] == "tokenlane-operator-metrics"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


# ---- the rules against a real Prometheus scraping a real runtime

@pytest.fixture(scope="module")
def prometheus(quickstart_server, tmp_path_factory):
    """Debian's prometheus scraping the quickstart's runtime every second, with our rules
    (every group evaluated every second) and the labels Kubernetes discovery would add."""
    import os

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian's `prometheus` package)")
    base, _, _ = quickstart_server
    tmp = tmp_path_factory.mktemp("prometheus")
    groups = _rule_groups()
    for group in groups:
        group["interval"] = "1s"
    (tmp / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [{"job_name": "tokenlane-runtime", "static_configs": [{
            "targets": [base.removeprefix("http://")],
            "labels": {"namespace": "tokenlane-demo", "pod": "tiny-0"}}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(f"{url}/-/ready", proc, 60, "prometheus")
        yield url
    finally:
        stop_process(proc, timeout_s=20)


def _query_until(url: str, promql: str, timeout_s: float = 30.0) -> list[dict]:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
        assert body["status"] == "success", body
        if body["data"]["result"]:
            return body["data"]["result"]
        assert time.monotonic() < deadline, f"no result for {promql} after {timeout_s:.0f}s"
        time.sleep(0.5)


def test_recording_rules_produce_per_lane_series_from_a_real_runtime(quickstart_server, prometheus):
    """The rules' label names and metric names match what the runtime really exposes: the
    per-lane SLO targets (from the sample's ServingLanes) and request rates come out per lane."""
    import httpx

    base, _, _ = quickstart_server
    for lane in ("interactive", "batch"):
        response = httpx.post(f"{base}/v1/completions", headers={"X-Lane": lane}, timeout=60,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert response.status_code == 200, response.text
    targets = _query_until(prometheus, 'model_lane:tokenlane_lane_slo_target_seconds:max{slo="ttft_p95"}')
    by_lane = {r["metric"]["lane"]: float(r["value"][1]) for r in targets}
    assert by_lane == {"interactive": 1.0}  # tiny-interactive: slo.ttftP95Ms 1000; tiny-batch has none
    assert {r["metric"]["namespace"] for r in targets} == {"tokenlane-demo"}
    rates = _query_until(prometheus, 'model_lane:tokenlane_requests:rate5m{model="tiny"}')
    assert {"interactive", "batch"} <= {r["metric"]["lane"] for r in rates}
    p95 = _query_until(prometheus, 'model_lane:tokenlane_time_to_first_token_seconds:p95_5m{lane="interactive"}')
    assert p95[0]["metric"]["model"] == "tiny"
    # And the alert that compares the two evaluates without error (not firing: one request).
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    unhealthy = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"] if r.get("health") == "err"]
    assert not unhealthy, unhealthy


def test_optional_runtime_podmonitor_selects_the_pods_the_operator_renders(tmp_path):
    from manifests_helpers import SAMPLE, load_yaml_docs, operator_render

    (monitor,) = load_yaml_docs(MONITORING / "optional" / "podmonitor-runtime.yaml")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    templates = [o["spec"]["template"] for o in operator_render(load_yaml_docs(SAMPLE), tmp_path)
                 if o["kind"] == "Deployment"]
    assert templates
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        (runtime,) = [c for c in template["spec"]["containers"] if c["name"] == "runtime"]
        assert endpoint["port"] in {p["name"] for p in runtime["ports"]}
        assert template["metadata"]["annotations"]["prometheus.io/path"] == endpoint["path"]
