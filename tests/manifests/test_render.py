"""The kustomizations render, and every rendered object is valid: built-in kinds against
Kubernetes' own OpenAPI schemas (kubernetes-validate), custom resources against the CRDs
rendered alongside them (structural schema + CEL rules), pod security as documented."""

from __future__ import annotations

import kubernetes_validate
import pytest
from manifests_helpers import (
    KUSTOMIZATIONS,
    MANIFESTS,
    OVERLAYS,
    WORKLOAD_NAMESPACE,
    load_yaml_docs,
    render,
    samples_present,
)
from manifests_schemas import validate_custom_resource

# The oldest Kubernetes the CRDs support (CEL validation rules are GA in 1.29; 1.30 is the
# oldest release kubernetes-validate ships that every current managed offering still runs).
K8S_VERSION = "1.30.0"
# ...and the newest release it ships, so a field removed since then shows up too.
K8S_VERSIONS = [K8S_VERSION, kubernetes_validate.latest_version()]
# Kinds whose CRDs come from other projects and are not in the tree; checked structurally by
# the Argo CD and monitoring tests.
EXTERNAL_KINDS = {
    ("argoproj.io/v1alpha1", "Application"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("inference.networking.k8s.io/v1", "InferencePool"),  # checked below against the upstream CRD
}


def _all_rendered() -> list[tuple[str, dict]]:
    out = [(rel, obj) for rel in KUSTOMIZATIONS for obj in render(rel)]
    if samples_present():
        out += [("manifests/samples", obj) for obj in render("manifests/samples")]
    return out


def _crds_by_kind() -> dict[tuple[str, str], dict]:
    crds = {}
    for obj in render("manifests/overlays/cluster-wide"):
        if obj["kind"] == "CustomResourceDefinition":
            spec = obj["spec"]
            for version in spec["versions"]:
                crds[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = obj
    return crds


def _id(obj: dict) -> str:
    meta = obj.get("metadata", {})
    return f"{obj.get('kind')}/{meta.get('namespace', '')}/{meta.get('name')}"


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_kustomization_renders(rel):
    objects = render(rel)
    assert objects, f"{rel} rendered nothing"
    ids = [(o["apiVersion"].split("/")[0], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
           for o in objects]
    assert len(ids) == len(set(ids)), f"{rel} renders duplicates"


def test_samples_kustomization_renders_every_sample_file():
    if not samples_present():
        pytest.skip("manifests/samples/kustomization.yaml not written yet")
    rendered = {(o["kind"], o["metadata"]["name"]) for o in render("manifests/samples")}
    listed = load_yaml_docs(MANIFESTS / "samples" / "kustomization.yaml")[0]["resources"]
    for name in listed:
        assert (MANIFESTS / "samples" / name).exists(), name
    assert rendered


@pytest.mark.parametrize("rel", OVERLAYS)
def test_overlays_install_everything(rel):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(rel)}
    for needed in [
        ("CustomResourceDefinition", "modelservices.tokenlane.dev"),
        ("CustomResourceDefinition", "servinglanes.tokenlane.dev"),
        ("Namespace", "tokenlane-system"),
        ("Namespace", WORKLOAD_NAMESPACE),
        ("ServiceAccount", "tokenlane-operator"),
        ("Deployment", "tokenlane-operator"),
        ("NetworkPolicy", "tokenlane-runtime"),
    ]:
        assert needed in kinds, f"{rel} lacks {needed}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate_against_kubernetes_schemas(version):
    crds = _crds_by_kind()
    checked = 0
    for rel, obj in _all_rendered():
        key = (obj["apiVersion"], obj["kind"])
        if key in crds or key in EXTERNAL_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{rel}: {_id(obj)} is invalid for Kubernetes {version}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{rel}: {_id(obj)} is neither a Kubernetes {version} kind nor one of our CRDs")
        checked += 1
    assert checked > 20


def test_custom_resources_validate_against_our_crds():
    crds = _crds_by_kind()
    checked = []
    for rel, obj in _all_rendered():
        crd = crds.get((obj["apiVersion"], obj["kind"]))
        if crd is None:
            continue
        problems = validate_custom_resource(obj, crd)
        assert not problems, f"{rel}: {_id(obj)}: {problems}"
        checked.append(obj["kind"])
    assert "KopfPeering" in checked and "ClusterKopfPeering" in checked
    if samples_present():
        assert "ModelService" in checked and "ServingLane" in checked


def test_rendered_inference_pools_validate_against_the_upstream_crd():
    """The InferencePool the operator renders for a sample (spec.gateway) passes the schema and
    CEL rules of the Gateway API Inference Extension's CRD (../shared/k8s/thirdparty-crds)."""
    import os
    from pathlib import Path

    import yaml

    shared = Path(os.environ.get("TOKENLANE_SHARED_K8S", MANIFESTS.parent.parent / "shared" / "k8s"))
    crd_file = shared / "thirdparty-crds" / "inference.networking.k8s.io_inferencepools.yaml"
    if not crd_file.exists():
        pytest.skip(f"the upstream InferencePool CRD is not at {crd_file}")
    crd = yaml.safe_load(crd_file.read_text())
    pools = [obj for obj in _operator_rendered("llama3-8b-lora.yaml") if obj["kind"] == "InferencePool"]
    assert pools, "llama3-8b-lora.yaml renders no InferencePool"
    for pool in pools:
        assert validate_custom_resource(pool, crd) == [], _id(pool)
    broken = {**pools[0], "spec": {**pools[0]["spec"], "targetPorts": []}}
    assert validate_custom_resource(broken, crd)


def test_crd_validation_catches_bad_resources():
    # The validator above must be able to fail: a wrong type, an unknown field, a broken CEL rule.
    crds = _crds_by_kind()
    lane_crd = crds[("tokenlane.dev/v1alpha1", "ServingLane")]
    good = {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane", "metadata": {"name": "x"},
            "spec": {"modelServiceRef": {"name": "llm"}, "class": "interactive"}}
    assert validate_custom_resource(good, lane_crd) == []
    wrong_enum = {**good, "spec": {**good["spec"], "class": "realtime"}}
    assert validate_custom_resource(wrong_enum, lane_crd)
    unknown = {**good, "spec": {**good["spec"], "prority": 3}}
    assert validate_custom_resource(unknown, lane_crd)
    cel = {**good, "spec": {**good["spec"], "match": {"minPromptTokens": 100, "maxPromptTokens": 10}}}
    assert any("minPromptTokens" in p for p in validate_custom_resource(cel, lane_crd))


def test_namespaced_objects_name_their_namespace():
    for rel, obj in _all_rendered():
        if rel == "manifests/samples":
            continue  # samples go wherever the user applies them (-n), like any app manifest
        cluster_scoped = obj["kind"] in {"Namespace", "CustomResourceDefinition", "ClusterRole",
                                         "ClusterRoleBinding", "ClusterKopfPeering"}
        if cluster_scoped:
            assert "namespace" not in obj["metadata"], _id(obj)
        else:
            assert obj["metadata"].get("namespace"), f"{rel}: {_id(obj)} has no namespace"


def _operator_deployment(rel: str) -> dict:
    (dep,) = [o for o in render(rel) if o["kind"] == "Deployment" and o["metadata"]["name"] == "tokenlane-operator"]
    return dep


@pytest.mark.parametrize("rel", OVERLAYS)
def test_operator_pod_is_locked_down(rel):
    dep = _operator_deployment(rel)
    spec = dep["spec"]
    # One instance, never two during an upgrade (kopf has no per-object locks).
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == "tokenlane-operator"


@pytest.mark.parametrize("rel", OVERLAYS)
def test_operator_probes_hit_kopfs_liveness_endpoint(rel):
    container = _operator_deployment(rel)["spec"]["template"]["spec"]["containers"][0]
    (liveness,) = [a for a in container["args"] if a.startswith("--liveness=")]
    url = liveness.split("=", 1)[1]
    port, path = url.rsplit(":", 1)[1].split("/", 1)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert ports[get["port"]] == int(port), probe
        assert get["path"] == "/" + path, probe


def test_overlays_differ_only_in_scope():
    scoped = {rel: [a for a in _operator_deployment(rel)["spec"]["template"]["spec"]["containers"][0]["args"]
                    if a.startswith(("--namespace", "--all-namespaces"))] for rel in OVERLAYS}
    assert scoped["manifests/overlays/namespaced"] == [f"--namespace={WORKLOAD_NAMESPACE}"]
    assert scoped["manifests/overlays/cluster-wide"] == ["--all-namespaces"]


def test_operator_cli_accepts_the_deployments_flags():
    """`tokenlane operator` parses the Deployment's arguments into the intended settings."""
    from tokenlane.operator.main import parse_args

    for rel in OVERLAYS:
        args = parse_args(_operator_deployment(rel)["spec"]["template"]["spec"]["containers"][0]["args"])
        assert args.peering == "tokenlane" and not args.standalone
        assert args.liveness == "http://0.0.0.0:8080/healthz" and args.metrics_port == 9090
        if rel.endswith("namespaced"):
            assert args.namespace == [WORKLOAD_NAMESPACE] and not args.all_namespaces
        else:
            assert args.all_namespaces and not args.namespace


def test_namespaces_enforce_restricted_pod_security():
    for obj in render("manifests/overlays/namespaced"):
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_argocd_sync_waves_order_namespaces_crds_then_the_rest():
    for rel in OVERLAYS:
        for obj in render(rel):
            wave = int(obj["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))
            expected = {"Namespace": -2, "CustomResourceDefinition": -1}.get(obj["kind"], 0)
            assert wave == expected, f"{rel}: {_id(obj)} is in wave {wave}, expected {expected}"
            if obj["kind"] in ("KopfPeering", "ClusterKopfPeering"):
                options = obj["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]
                assert "SkipDryRunOnMissingResource=true" in options


def _operator_rendered(sample: str) -> list[dict]:
    """What the operator would create for a sample (`tokenlane render`, no cluster)."""
    import subprocess
    import sys

    import yaml

    result = subprocess.run([sys.executable, "-m", "tokenlane.cli", "render", "-f", str(MANIFESTS / "samples" / sample)],
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def _runtime_pod_templates(sample: str) -> list[dict]:
    templates = [o["spec"]["template"] for o in _operator_rendered(sample) if o["kind"] == "Deployment"]
    assert templates, f"the operator renders no Deployment for {sample}"
    return templates


@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "llama3-8b.yaml", "llama3-8b-lora.yaml"])
def test_runtime_networkpolicy_selects_the_pods_the_operator_renders(sample):
    (policy,) = [o for o in render("manifests/overlays/namespaced")
                 if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "tokenlane-runtime"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    (ingress,) = policy["spec"]["ingress"]
    port_names = {p["port"] for p in ingress["ports"]}
    for template in _runtime_pod_templates(sample):
        assert selector.items() <= template["metadata"]["labels"].items(), template["metadata"]["labels"]
        (runtime,) = [c for c in template["spec"]["containers"] if c["name"] == "runtime"]
        assert port_names <= {p["name"] for p in runtime["ports"]}


def test_group_networkpolicy_lets_a_leader_worker_set_group_reach_itself():
    """The pods of a LeaderWorkerSet group (spec.parallelism.pipeline > 1) reach each other on
    every port (rendezvous, collectives); other runtime pods stay under the HTTP-only policy."""
    from tokenlane.operator.api.resources import parse_model_service
    from tokenlane.operator.desired import builders

    (policy,) = [o for o in render("manifests/overlays/namespaced")
                 if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "tokenlane-runtime-groups"]
    msvc = parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                "metadata": {"name": "m", "namespace": WORKLOAD_NAMESPACE},
                                "spec": {"model": {"path": "/models/m"}, "gpus": {"count": 2},
                                         "parallelism": {"tensor": 2, "pipeline": 2}}})
    (lws,) = [o for o in builders.build(msvc, []).objects if o["kind"] == "LeaderWorkerSet"]
    controller_labels = {"leaderworkerset.sigs.k8s.io/name": "m", "leaderworkerset.sigs.k8s.io/worker-index": "1"}

    def selects(selector: dict, labels: dict) -> bool:
        exprs_hold = all((e["key"] in labels) == (e["operator"] == "Exists") for e in selector.get("matchExpressions", []))
        return selector.get("matchLabels", {}).items() <= labels.items() and exprs_hold

    for role in ("leaderTemplate", "workerTemplate"):
        labels = lws["spec"]["leaderWorkerTemplate"][role]["metadata"]["labels"]
        assert not selects(policy["spec"]["podSelector"], labels)  # a Deployment's pod: not a group's
        pod = {**labels, **controller_labels}
        assert selects(policy["spec"]["podSelector"], pod)
        ((peer,),) = [rule["from"] for rule in policy["spec"]["ingress"]]
        assert selects(peer["podSelector"], pod) and all("ports" not in r for r in policy["spec"]["ingress"])
        ((peer,),) = [rule["to"] for rule in policy["spec"]["egress"]]
        assert selects(peer["podSelector"], pod)


@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "llama3-8b.yaml", "llama3-8b-lora.yaml"])
def test_rendered_runtime_pods_meet_the_restricted_pod_security_standard(sample):
    """Namespace `tokenlane` enforces `restricted`: pods that miss it would be refused."""
    for template in _runtime_pod_templates(sample):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
        for container in pod.get("initContainers", []) + pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, container["name"]
            assert sc["readOnlyRootFilesystem"] is True, container["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
            assert set(sc["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, container["name"]
            assert not sc.get("privileged"), container["name"]
        for volume in pod.get("volumes", []):
            assert "hostPath" not in volume, "restricted forbids hostPath volumes"
