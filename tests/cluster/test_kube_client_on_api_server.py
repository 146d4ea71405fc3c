"""tokenlane.kube on a real API server: every way the cluster tier's kubeconfig authenticates
(client certificate, bearer token, the same token through an exec plugin) reaches the server as
its user (SelfSubjectReview), and the calls the operator, the router and `tokenlane check` make
behave as the server defines them: server-side apply with managed fields, list with labels and
resourceVersion, watch events, merge patches on the status and scale subresources, delete, API
discovery, and errors carrying the server's status and reason."""

from __future__ import annotations

import asyncio
import copy
import json
import sys

import pytest
import yaml

from cluster_harness import ROOT, Cluster

from tokenlane import kube
from tokenlane.kube.credentials import kubeconfig_paths

NS = "kube-client-tests"
CONFIG_MAPS = kube.Resource("", "v1", "configmaps", "ConfigMap")
DEPLOYMENTS = kube.Resource("apps", "v1", "deployments", "Deployment")
MODEL_SERVICES = kube.Resource("tokenlane.dev", "v1alpha1", "modelservices", "ModelService")
REVIEWS = kube.Resource("authentication.k8s.io", "v1", "selfsubjectreviews", "SelfSubjectReview", namespaced=False)


@pytest.fixture(scope="module")
def ns(crds: Cluster):
    crds.kubectl("create", "namespace", NS)
    yield crds
    crds.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def contexts(cluster: Cluster) -> dict[str, dict]:
    config = json.loads(cluster.kubectl("config", "view", "--raw", "-o", "json").stdout)
    users = {u["name"]: u.get("user") or {} for u in config.get("users") or []}
    return {c["name"]: users.get(c["context"].get("user"), {}) for c in config.get("contexts") or []}


async def username(creds: kube.Credentials) -> str:
    api = kube.KubeApi(creds)
    try:
        review = await api.create(REVIEWS, {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
                                            "metadata": {}})
    finally:
        await api.close()
    return review["status"]["userInfo"]["username"]


async def test_every_credential_of_the_kubeconfig_reaches_the_server(ns: Cluster, tmp_path):
    paths = kubeconfig_paths(ns.kubeconfig)
    kinds = set()
    for context in contexts(ns):
        creds = kube.load_kubeconfig(paths, context=context)
        name = await username(creds)
        assert name, context
        kinds.add("cert" if (creds.cert_data or creds.cert_file) else "token" if creds.token else "other")
    if ns.source == "shared":  # up.sh's two contexts: a client certificate and a bearer token
        assert kinds == {"cert", "token"}
        token_user = next(u for u in contexts(ns).values() if u.get("token"))
        # The same token through an exec credential plugin.
        plugin = tmp_path / "plugin.py"
        plugin.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({{'apiVersion': "
                          f"'client.authentication.k8s.io/v1', 'kind': 'ExecCredential', "
                          f"'status': {{'token': {token_user['token']!r}}}}}))\n")
        plugin.chmod(0o755)
        config = json.loads(ns.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
        config["users"] = [{"name": "exec", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                             "command": str(plugin)}}}]
        config["contexts"][0]["context"]["user"] = "exec"
        (tmp_path / "config").write_text(yaml.safe_dump(config))
        assert await username(kube.load_kubeconfig([tmp_path / "config"])) == "admin-token"


async def test_apply_list_watch_patch_scale_delete(ns: Cluster):
    api = kube.KubeApi(kube.load_kubeconfig(kubeconfig_paths(ns.kubeconfig)), field_manager="tokenlane-kube-test")
    try:
        assert await api.has_resource(DEPLOYMENTS) and not await api.has_resource(
            kube.Resource("apps", "v1", "no-such-things", "NoSuchThing"))
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "applied", "namespace": NS, "labels": {"app": "kube-test"}}, "data": {"a": "1"}}
        created = await api.apply(CONFIG_MAPS, cm)  # server-side apply creates a missing object
        assert [m["manager"] for m in created["metadata"]["managedFields"]] == ["tokenlane-kube-test"]
        items, version = await api.list_with_version(CONFIG_MAPS, NS, {"app": "kube-test"})
        assert [i["metadata"]["name"] for i in items] == ["applied"] and items[0]["kind"] == "ConfigMap" and version
        assert await api.list(CONFIG_MAPS, NS, {"app": "other"}) == []

        events: list[tuple[str, str]] = []

        async def follow() -> None:
            async for event in api.watch(CONFIG_MAPS, NS, resource_version=version, labels={"app": "kube-test"},
                                         timeout_s=60):
                if event["type"] != "BOOKMARK":
                    events.append((event["type"], event["object"]["data"].get("a", "")))
                if event["type"] == "DELETED":
                    return

        watching = asyncio.create_task(follow())
        await api.merge_patch(CONFIG_MAPS, NS, "applied", {"data": {"a": "2"}})
        assert await api.delete(CONFIG_MAPS, NS, "applied") and not await api.delete(CONFIG_MAPS, NS, "applied")
        await asyncio.wait_for(watching, 60)
        assert events == [("MODIFIED", "2"), ("DELETED", "2")]

        # The scale subresource (the autoscaler's) and errors with the server's reason.
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "scaled", "namespace": NS},
                      "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "scaled"}},
                               "template": {"metadata": {"labels": {"app": "scaled"}},
                                            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}
        await api.create(DEPLOYMENTS, deployment)
        with pytest.raises(kube.ApiError) as exists:
            await api.create(DEPLOYMENTS, deployment)
        assert (exists.value.status, exists.value.reason, exists.value.transient) == (409, "AlreadyExists", True)
        scale = await api.scale(DEPLOYMENTS, NS, "scaled", 3)
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        assert (await api.get(DEPLOYMENTS, NS, "scaled", "scale"))["spec"]["replicas"] == 3
        with pytest.raises(kube.ApiError) as invalid:
            await api.scale(DEPLOYMENTS, NS, "scaled", -1)
        assert (invalid.value.status, invalid.value.reason) == (422, "Invalid") and "replicas" in invalid.value.message

        # The status subresource of our CRD: a status patch leaves the spec alone.
        sample = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text())
                      if d and d["kind"] == "ModelService")
        msvc = copy.deepcopy(sample)
        msvc["metadata"] = {"name": "status-test", "namespace": NS}
        stored = await api.create(MODEL_SERVICES, msvc)
        patched = await api.merge_patch(MODEL_SERVICES, NS, "status-test", {
            "status": {"observedGeneration": 1}, "spec": {"replicas": 5}}, subresource="status")
        assert patched["status"]["observedGeneration"] == 1 and patched["spec"] == stored["spec"]
    finally:
        await api.close()
