"""Our CRDs on a real API server: accepted by client- and server-side apply, every CEL rule and
schema bound enforced with the server's own message, server-applied defaults equal to the
runtime's and to `tokenlane render`'s, `kubectl explain`, printer columns and short names, the
scale subresource, an HPA aimed at a ModelService, and a CRD upgrade that keeps stored objects
valid. No operator runs here: this is what the API server alone guarantees."""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest
import yaml

from cluster_harness import ROOT, Cluster, wait_for

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from crd_cases import (  # noqa: E402  (tests/operator: the same table the offline tests use)
    LANE_INVALID,
    MSVC_INVALID,
    OUT_OF_RANGE,
    invalid_lane,
    invalid_model_service,
    sample,
    set_field,
)

from tokenlane.operator.api import schema  # noqa: E402
from tokenlane.runtime.config import SchedulerConfig  # noqa: E402

NS = "crd-tests"


@pytest.fixture(scope="module")
def ns(crds: Cluster):
    crds.kubectl("create", "namespace", NS)
    yield crds
    # Gone before the next module starts operators that watch every namespace (no operator
    # has put a finalizer on these objects yet, so this is quick).
    crds.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


def test_crds_established_with_client_and_server_side_apply(crds: Cluster):
    # The `crds` fixture applied them client-side (`kubectl apply -k crds/`, the quickstart's step 1).
    result = crds.kubectl("apply", "--server-side", "-k", str(ROOT / "crds"))
    assert result.stdout.count("serverside-applied") == 4, result.stdout
    for name in ("modelservices.tokenlane.dev", "servinglanes.tokenlane.dev"):
        crd = crds.get("crd", name)
        established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert established.get("Established") == "True" and established.get("NamesAccepted") == "True", crd["status"]
    resources = crds.kubectl("api-resources", "--api-group=tokenlane.dev", "-o", "wide").stdout
    assert re.search(r"^modelservices\s+msvc\s+tokenlane.dev/v1alpha1\s+true\s+ModelService", resources, re.M), resources
    assert re.search(r"^servinglanes\s+lane\s+tokenlane.dev/v1alpha1\s+true\s+ServingLane", resources, re.M), resources


# --------------------------------------------------------------------------- refusals


def _named(doc: dict, name: str) -> dict:
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": name, "namespace": NS}
    return doc


def _cases() -> list[tuple[str, dict, str]]:
    """(object name, object, what the server's message must say) for every refusal."""
    cases = []
    for i, (field, value, message) in enumerate(MSVC_INVALID):
        cases.append((f"cel-msvc-{i}", invalid_model_service(field, value), message))
    for i, (field, value, message) in enumerate(LANE_INVALID):
        cases.append((f"cel-lane-{i}", invalid_lane(field, value), message))
    for i, (field, value) in enumerate(OUT_OF_RANGE):
        doc = sample("ModelService", "tiny")
        set_field(doc, field, value)
        cases.append((f"range-{i}", doc, field.split(".")[-1]))
    long_name = sample("ModelService", "tiny")
    cases.append(("m" * 51, long_name, "metadata.name must be at most 50 characters"))
    dotted = sample("ServingLane", "tiny-batch")
    del dotted["spec"]["laneName"]
    cases.append(("team.batch", dotted, "metadata.name is not a valid lane name"))
    return [(name, _named(doc, name), message) for name, doc, message in cases]


CASES = _cases()


@pytest.fixture(scope="module")
def refusals(ns: Cluster) -> dict[str, str]:
    """One server-side dry run of every invalid object; the server's error line per object."""
    docs = [doc for _, doc, _ in CASES]
    result = ns.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    errors: dict[str, str] = {}
    for line in result.stderr.splitlines():
        match = re.search(r'(?:ModelService|ServingLane)(?:\.tokenlane\.dev)? "([^"]+)"', line)
        if match:
            errors[match.group(1)] = errors.get(match.group(1), "") + line
    created = [l for l in result.stdout.splitlines() if "created" in l]
    assert not created, f"the server accepted invalid objects: {created}"
    # Decoding errors (an unknown field) do not name the object: ask for those one by one.
    for name, doc, _ in CASES:
        if name not in errors:
            alone = ns.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)
            assert alone.returncode != 0, f"the server accepted {name}"
            errors[name] = alone.stderr
    return errors


@pytest.mark.parametrize("name,doc,message", CASES, ids=[c[0][:24] for c in CASES])
def test_api_server_refuses(refusals, name, doc, message):
    assert name in refusals, f"{name} was not refused by the server"
    assert message in refusals[name], refusals[name]


def test_quickstart_refusal_message(ns: Cluster):
    """docs/quickstart.md quotes the server's refusal of a lane patch: it must be what it says."""
    lane = _named(sample("ServingLane", "tiny-interactive"), "tiny-interactive")
    ns.apply([lane])
    result = ns.kubectl("-n", NS, "patch", "servinglane", "tiny-interactive", "--type", "merge", "-p",
                        json.dumps({"spec": {"budgets": {"prefillChunkSize": 4096, "maxBatchedTokens": 1024}}}),
                        check=False)
    assert result.returncode != 0
    assert 'The ServingLane "tiny-interactive" is invalid: spec.budgets: Invalid value: "object": ' \
           "prefillChunkSize must be <= maxBatchedTokens" in result.stderr, result.stderr
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "prefillChunkSize must be <= maxBatchedTokens" in quickstart


# --------------------------------------------------------------------------- defaults


def test_server_defaults_equal_the_runtimes_and_renders(ns: Cluster):
    minimal = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
               "metadata": {"name": "minimal", "namespace": NS}, "spec": {"model": {"path": "/m"}}}
    lane = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane",
            "metadata": {"name": "minimal", "namespace": NS}, "spec": {"modelServiceRef": {"name": "minimal"}}}
    result = ns.kubectl("create", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump_all([minimal, lane]))
    stored = {o["kind"]: o for o in yaml.safe_load_all(result.stdout) if o}
    for kind, doc in (("ModelService", minimal), ("ServingLane", lane)):
        # What `tokenlane render` and the operator's parser assume the server stores.
        offline = schema.apply_defaults(schema.crd_schema(kind), doc)
        assert stored[kind]["spec"] == offline["spec"], kind
    scheduler = stored["ModelService"]["spec"]["scheduler"]
    runtime = SchedulerConfig()
    for key, value in scheduler.items():
        attr = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)
        assert getattr(runtime, attr) == value, key
    assert set(scheduler) == set(schema.SCHEDULER_DEFAULTS)


def test_kubectl_explain(crds: Cluster):
    out = crds.kubectl("explain", "modelservice.spec.scheduler").stdout
    assert "Global scheduler budgets" in out
    for key in schema.SCHEDULER_DEFAULTS:
        assert key in out, key
    out = crds.kubectl("explain", "servinglane.spec.slo").stdout
    assert "ttftP95Ms" in out and "Time to first token" in out
    out = crds.kubectl("explain", "msvc.spec.engine.blockSize").stdout
    assert "Tokens per KV-cache block" in out


# --------------------------------------------------------------------------- stored objects


@pytest.fixture(scope="module")
def stored(ns: Cluster) -> Cluster:
    docs = [_named(sample("ModelService", "tiny"), "tiny"), _named(sample("ServingLane", "tiny-batch"), "tiny-batch")]
    ns.apply(docs)
    return ns


def test_printer_columns_and_short_names(stored: Cluster):
    out = stored.kubectl("-n", NS, "get", "msvc").stdout.splitlines()
    assert re.split(r"\s{2,}", out[0].strip()) == ["NAME", "REPLICAS", "READY", "LANES", "SLO MET", "AGE"], out
    assert out[1].split()[:2] == ["tiny", "1"]
    wide = stored.kubectl("-n", NS, "get", "msvc", "-o", "wide").stdout.splitlines()
    assert re.split(r"\s{2,}", wide[0].strip())[-3:] == ["STATUS", "MODEL", "AGE"] or "MODEL" in wide[0], wide
    assert "/models/tiny-llama" in wide[1]
    out = stored.kubectl("-n", NS, "get", "lane").stdout.splitlines()
    assert re.split(r"\s{2,}", out[0].strip()) == ["NAME", "MODEL SERVICE", "CLASS", "ISOLATION", "READY", "SLO MET",
                                                   "OVERRIDES", "AGE"], out
    assert out[1].split()[:4] == ["tiny-batch", "tiny", "batch", "shared"]
    assert "tiny" in stored.kubectl("get", "tokenlane", "-n", NS).stdout  # the `tokenlane` category


def test_kubectl_scale_goes_through_the_scale_subresource(stored: Cluster):
    stored.kubectl("-n", NS, "scale", "msvc/tiny", "--replicas=3")
    scale = json.loads(stored.kubectl(
        "get", "--raw", f"/apis/tokenlane.dev/v1alpha1/namespaces/{NS}/modelservices/tiny/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert stored.get("msvc", "tiny", NS)["spec"]["replicas"] == 3
    # Out of the schema's range: refused through the subresource too.
    bad = stored.kubectl("-n", NS, "scale", "msvc/tiny", "--replicas=1001", check=False)
    assert bad.returncode != 0 and "spec.replicas" in bad.stderr, bad.stderr


def test_hpa_aimed_at_a_model_service_is_accepted(stored: Cluster):
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "tiny", "namespace": NS},
           "spec": {"scaleTargetRef": {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService", "name": "tiny"},
                    "minReplicas": 1, "maxReplicas": 4,
                    "metrics": [{"type": "Pods", "pods": {
                        "metric": {"name": "tokenlane_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "8"}}}]}}
    result = stored.apply([hpa], "--server-side")
    assert "serverside-applied" in result.stdout
    assert stored.get("hpa", "tiny", NS)["spec"]["scaleTargetRef"]["kind"] == "ModelService"


def test_crd_upgrade_keeps_stored_objects_valid(stored: Cluster):
    """Re-apply the CRD with a new optional field: stored objects stay readable and writable,
    the new field is served, and going back prunes nothing that was valid before."""
    path = ROOT / "crds" / "modelservices.tokenlane.dev.yaml"
    crd = yaml.safe_load(path.read_text())
    spec_props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec_props["owner"] = {"type": "string", "description": "A new optional field (upgrade test).", "maxLength": 63}
    try:
        stored.apply([crd], "--server-side")
        stored.kubectl("wait", "--for=condition=Established", "crd/modelservices.tokenlane.dev")
        before = stored.get("msvc", "tiny", NS)
        stored.kubectl("-n", NS, "label", "msvc", "tiny", "upgraded=yes")
        # The new field is accepted (and served) once the upgraded schema is in force.
        wait_for(lambda: stored.kubectl("-n", NS, "patch", "msvc", "tiny", "--type=merge", "-p",
                                        '{"spec": {"owner": "team-a"}}', check=False).returncode == 0,
                 timeout=30, what="the upgraded schema to serve spec.owner")
        after = stored.get("msvc", "tiny", NS)
        assert after["spec"]["owner"] == "team-a"
        assert {k: v for k, v in after["spec"].items() if k != "owner"} == before["spec"]
        stored.kubectl("-n", NS, "patch", "msvc", "tiny", "--type=json", "-p",
                       '[{"op": "remove", "path": "/spec/owner"}]')
    finally:
        stored.kubectl("apply", "--server-side", "-f", str(path))
    # Back on the released CRD, the object is still valid and can be changed.
    stored.kubectl("-n", NS, "scale", "msvc/tiny", "--replicas=1")
    assert stored.get("msvc", "tiny", NS)["metadata"]["labels"]["upgraded"] == "yes"
