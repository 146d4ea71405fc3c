"""The operator's RBAC, in both modes, allows every API call the operator makes and nothing
more: no wildcard, no Secrets, no verb or resource it does not use.

The calls come from the operator's kmock test, which records every request the running
operator sends (tests/operator/api_calls.json), plus the kopf framework calls that test cannot
see (it runs kopf standalone and cluster-wide: peering and the namespace scan are off there).
Until that recording exists, the list below, read off operator/controllers/handlers.py, operator/clients/kube.py
and kopf's own sources, stands in for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs, urlsplit

import pytest
from manifests_helpers import OPERATOR_SA, OVERLAYS, ROOT, WORKLOAD_NAMESPACE, render

RECORDED = ROOT / "tests" / "operator" / "api_calls.json"
ANY_NS = "*"  # a call the cluster-wide operator makes in whichever namespace a resource lives


@dataclass(frozen=True)
class Call:
    verb: str
    group: str
    resource: str  # "deployments" or "modelservices/status"
    namespace: Optional[str]  # None = cluster-scoped

    def __str__(self) -> str:
        where = "cluster" if self.namespace is None else f"ns={self.namespace}"
        return f"{self.verb} {self.group or 'core'}/{self.resource} ({where})"


# ---- the calls the operator makes (see the module docstring)

def _operator_calls(ns: str) -> set[Call]:
    """Calls of the operator's own code and of the kopf handlers it registers, in namespace ns."""
    calls = set()

    def add(group: str, resource: str, *verbs: str) -> None:
        calls.update(Call(v, group, resource, ns) for v in verbs)

    # kopf: watch our kinds; finalizers and progress annotations are merge patches.
    add("tokenlane.dev", "modelservices", "list", "watch", "patch")
    add("tokenlane.dev", "servinglanes", "list", "watch", "patch")
    # handlers: read the parent ModelService; status is written through the subresource.
    add("tokenlane.dev", "modelservices", "get")
    add("tokenlane.dev", "modelservices/status", "patch")
    add("tokenlane.dev", "servinglanes/status", "patch")
    # kopf.on.event("apps", "v1", "deployments"): readiness of the pods it rendered.
    add("apps", "deployments", "list", "watch")
    # executor: observe by label (list), create when missing, server-side apply (patch), delete.
    for group, resource in [("apps", "deployments"), ("", "services"), ("", "configmaps"),
                            ("policy", "poddisruptionbudgets"), ("monitoring.coreos.com", "servicemonitors"),
                            ("inference.networking.k8s.io", "inferencepools"),
                            ("leaderworkerset.x-k8s.io", "leaderworkersets")]:
        add(group, resource, "list", "create", "patch", "delete")
    # kopf.on.event for LeaderWorkerSets: the groups' readiness (spec.parallelism.pipeline > 1).
    add("leaderworkerset.x-k8s.io", "leaderworkersets", "watch")
    # reads.runtime_pods(): the fetch-model init containers of a huggingFace / s3 source (ModelAvailable).
    add("", "pods", "list")
    # k8s.post_event() (handlers and tuner) and kopf itself: Events explaining reconciles, decisions, rollbacks.
    add("", "events", "create")
    # ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement).
    add("tokenlane.dev", "modelservices/finalizers", "update")
    return calls


def _kopf_framework_calls(mode: str) -> set[Call]:
    """What kopf itself needs beyond the handlers' resources (kopf/_core/reactor/observation.py,
    kopf/_core/engines/peering.py): the CRD scan, the namespace scan (only when it serves a list
    of namespaces), and keep-alives in the peering object named by --peering."""
    calls = {Call("list", "apiextensions.k8s.io", "customresourcedefinitions", None),
             Call("watch", "apiextensions.k8s.io", "customresourcedefinitions", None)}
    if mode == "namespaced":
        calls |= {Call("list", "", "namespaces", None), Call("watch", "", "namespaces", None)}
        calls |= {Call(v, "kopf.dev", "kopfpeerings", WORKLOAD_NAMESPACE) for v in ("list", "watch", "patch")}
    else:
        calls |= {Call(v, "kopf.dev", "clusterkopfpeerings", None) for v in ("list", "watch", "patch")}
    return calls


def _parse_request(method: str, url: str, params: Optional[dict] = None) -> Optional[Call]:
    """The RBAC attributes of one HTTP request, as the API server derives them; None for a
    discovery request (allowed to every authenticated user by system:discovery)."""
    split = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(split.query).items()}
    query.update({k: str(v) for k, v in (params or {}).items()})
    parts = [p for p in split.path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = (parts[1] if len(parts) > 1 else ""), parts[3:]
    else:
        return None
    if not rest:
        return None  # /api, /api/v1, /apis/<group>/<version>: discovery
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    method = method.upper()
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1", "True") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}[method]
    return Call(verb, group, f"{resource}/{sub}" if sub else resource, namespace)


def _recorded_calls(mode: str) -> Optional[set[Call]]:
    """The kmock test's recorded requests, namespaced to this mode's scope; None if absent."""
    if not RECORDED.exists():
        return None
    entries = json.loads(RECORDED.read_text())
    if isinstance(entries, dict):
        entries = entries.get("calls") or entries.get("requests") or []
    calls = set()
    for entry in entries:
        if "method" in entry:
            call = _parse_request(entry["method"], entry.get("path") or entry["url"], entry.get("params"))
        else:
            resource = entry["resource"] + (f"/{entry['subresource']}" if entry.get("subresource") else "")
            call = Call(entry["verb"], entry.get("group", ""), resource, entry.get("namespace"))
        if call is None:
            continue
        if call.namespace is not None or call.resource in _NAMESPACED_RESOURCES:
            # The recording runs in some test namespace (or cluster-wide): re-home it.
            call = Call(call.verb, call.group, call.resource, WORKLOAD_NAMESPACE)
        calls.add(call)
    return calls


_NAMESPACED_RESOURCES = {
    "modelservices", "servinglanes", "modelservices/status", "servinglanes/status", "deployments", "services",
    "configmaps", "poddisruptionbudgets", "servicemonitors", "events", "kopfpeerings", "pods", "inferencepools",
    "leaderworkersets",
}


def _calls_the_emulator_cannot_show(recorded: set[Call]) -> set[Call]:
    """Calls a real cluster sees that the kmock recording cannot, derived from the code:
    - ServiceMonitors: the emulator serves no monitoring.coreos.com kind, so the operator only
      lists them there; on a cluster with the Prometheus Operator the executor treats them like
      every other owned kind (operator/clients/kube.py OWNED), i.e. with the verbs recorded for Services.
    - Owner references with blockOwnerDeletion (operator/desired/builders.py owner_reference) need
      `update` on modelservices/finalizers where the OwnerReferencesPermissionEnforcement
      admission plugin is on (OpenShift and hardened clusters)."""
    from tokenlane.operator.desired import builders
    from tokenlane.operator.clients import kube as k8s

    calls = set()
    if k8s.SERVICE_MONITORS in k8s.OWNED:
        for call in recorded:
            if (call.group, call.resource) == ("", "services"):
                calls.add(Call(call.verb, "monitoring.coreos.com", "servicemonitors", call.namespace))
    ref = builders.owner_reference(_ModelServiceStub())
    if ref and ref.get("blockOwnerDeletion"):
        calls.add(Call("update", "tokenlane.dev", "modelservices/finalizers", WORKLOAD_NAMESPACE))
    return calls


class _ModelServiceStub:
    """Just enough of a ModelService for builders.owner_reference."""

    name = "llm"

    class ref:  # noqa: N801 - mirrors ModelService.ref
        uid = "00000000-0000-0000-0000-000000000000"
        name = "llm"


def required_calls(mode: str) -> set[Call]:
    recorded = _recorded_calls(mode)
    if recorded is None:
        own = _operator_calls(WORKLOAD_NAMESPACE)
    else:
        own = recorded | _calls_the_emulator_cannot_show(recorded)
    return own | _kopf_framework_calls(mode)


def test_recorded_calls_are_used_when_present():
    if not RECORDED.exists():
        pytest.skip("tests/operator/api_calls.json not recorded yet")
    recorded = _recorded_calls("cluster-wide")
    assert Call("patch", "apps", "deployments", WORKLOAD_NAMESPACE) in recorded
    assert required_calls("cluster-wide") >= recorded


# ---- a small RBAC authorizer over the rendered objects

@dataclass(frozen=True)
class Grant:
    verb: str
    group: str
    resource: str
    namespace: Optional[str]  # None = every namespace and cluster-scoped resources
    resource_names: tuple = ()


def _is_operator_subject(binding: dict) -> bool:
    return any(s.get("kind") == "ServiceAccount" and (s.get("namespace"), s.get("name")) == OPERATOR_SA
               for s in binding.get("subjects") or [])


def operator_grants(rel: str) -> set[Grant]:
    objects = render(rel)
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    grants = set()
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or not _is_operator_subject(binding):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role_ns = scope if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        assert role is not None, f"{rel}: {binding['metadata']['name']} binds a role not in the manifests: {ref}"
        for rule in role.get("rules") or []:
            assert "nonResourceURLs" not in rule, f"{rel}: the operator needs no non-resource URLs"
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        grants.add(Grant(verb, group, resource, scope, tuple(rule.get("resourceNames") or ())))
    return grants


def allowed(grants: set[Grant], call: Call) -> bool:
    for g in grants:
        if (g.verb, g.group, g.resource) != (call.verb, call.group, call.resource):
            continue
        if g.namespace is None or g.namespace == call.namespace:
            return True
    return False


def _mode(rel: str) -> str:
    return rel.rsplit("/", 1)[1]


# ---- tests

@pytest.mark.parametrize("rel", OVERLAYS)
def test_rbac_has_no_wildcards_secrets_or_escalation(rel):
    for obj in render(rel):
        if obj["kind"] in ("Role", "ClusterRole"):
            for rule in obj.get("rules") or []:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule.get(key, []), f"{obj['metadata']['name']}: wildcard in {key}"
                assert "secrets" not in rule.get("resources", []), f"{obj['metadata']['name']} grants Secrets"
                assert not {"escalate", "bind", "impersonate"} & set(rule.get("verbs", []))
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert obj["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), obj["metadata"]["name"]


@pytest.mark.parametrize("rel", OVERLAYS)
def test_rbac_allows_every_call_the_operator_makes(rel):
    grants = operator_grants(rel)
    missing = sorted(str(c) for c in required_calls(_mode(rel)) if not allowed(grants, c))
    assert not missing, f"{rel}: the operator would get 403 Forbidden on: {missing}"


@pytest.mark.parametrize("rel", OVERLAYS)
def test_rbac_grants_nothing_the_operator_does_not_use(rel):
    needed = required_calls(_mode(rel))
    unused = []
    for g in operator_grants(rel):
        uses = [c for c in needed if (c.verb, c.group, c.resource) == (g.verb, g.group, g.resource)]
        if not uses:
            unused.append(f"{g.verb} {g.group or 'core'}/{g.resource}")
        elif g.namespace is None and all(c.namespace is not None for c in uses) and _mode(rel) == "namespaced":
            unused.append(f"{g.verb} {g.group or 'core'}/{g.resource} cluster-wide (needed in {WORKLOAD_NAMESPACE} only)")
    assert not unused, f"{rel}: grants the operator does not use: {sorted(unused)}"


def test_namespaced_mode_cannot_touch_other_namespaces():
    grants = operator_grants("manifests/overlays/namespaced")
    for call in _operator_calls("someone-elses-namespace"):
        assert not allowed(grants, call), f"namespaced mode may {call}"


@pytest.mark.parametrize("rel", OVERLAYS)
def test_model_sources_need_no_secret_reads(rel):
    """huggingFace / s3 credentials reach the fetch-model init container as secretKeyRefs, which
    the kubelet resolves: the operator reads pods (ModelAvailable) but never a Secret."""
    grants = operator_grants(rel)
    for verb in ("get", "list", "watch"):
        assert not allowed(grants, Call(verb, "", "secrets", WORKLOAD_NAMESPACE)), f"{rel} may {verb} Secrets"
    assert allowed(grants, Call("list", "", "pods", WORKLOAD_NAMESPACE))
    assert not allowed(grants, Call("get", "", "pods/log", WORKLOAD_NAMESPACE))


def test_the_authorizer_can_refuse():
    grants = operator_grants("manifests/overlays/cluster-wide")
    assert not allowed(grants, Call("get", "", "secrets", "tokenlane"))
    assert not allowed(grants, Call("update", "tokenlane.dev", "modelservices", "tokenlane"))
    assert allowed(grants, Call("patch", "apps", "deployments", "anywhere"))


def test_request_parsing_follows_the_api_servers_rules():
    assert _parse_request("GET", "/apis/apps/v1/namespaces/ml/deployments?watch=true") == \
        Call("watch", "apps", "deployments", "ml")
    assert _parse_request("GET", "/apis/apps/v1/deployments") == Call("list", "apps", "deployments", None)
    assert _parse_request("PATCH", "/apis/tokenlane.dev/v1alpha1/namespaces/ml/modelservices/llm/status") == \
        Call("patch", "tokenlane.dev", "modelservices/status", "ml")
    assert _parse_request("GET", "/api/v1/namespaces") == Call("list", "", "namespaces", None)
    assert _parse_request("GET", "/api/v1/namespaces/ml") == Call("get", "", "namespaces", None)
    assert _parse_request("POST", "/api/v1/namespaces/ml/events") == Call("create", "", "events", "ml")
    assert _parse_request("GET", "/apis/monitoring.coreos.com/v1") is None
