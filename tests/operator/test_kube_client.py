"""The operator's login and client over real TLS: `tokenlane operator` logs kopf in with
tokenlane.kube's credentials (the kopf.ConnectionInfo carries the client certificate, the token,
an exec credential's expiry), and `KubeClient` built from that ConnectionInfo authenticates as
the same identity (kube_https_server.py: a real HTTPS server that authenticates as
kube-apiserver does)."""

from __future__ import annotations

import base64
import datetime
import sys
from pathlib import Path

import kopf
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kube"))

from kube_https_server import KubeHttpsServer  # noqa: E402

from tokenlane import kube  # noqa: E402
from tokenlane.operator import main  # noqa: E402
from tokenlane.operator.clients import kube as k8s  # noqa: E402

WHOAMI = k8s.Resource("", "v1", "configmaps", "ConfigMap")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    api = KubeHttpsServer(tmp_path_factory.mktemp("apiserver"))
    yield api
    api.close()


def write_kubeconfig(path: Path, server: KubeHttpsServer, user: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "current-context": "op",
        "clusters": [{"name": "c", "cluster": {"server": server.url,
                                               "certificate-authority-data": base64.b64encode(server.ca.cert).decode()}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "op", "context": {"cluster": "c", "user": "u", "namespace": "ops"}}],
    }))
    return path


async def whoami(client: k8s.KubeClient) -> str:
    try:
        return (await client.get(WHOAMI, "ops", "whoami"))["data"]["user"]
    finally:
        await client.close()


async def test_login_with_a_client_certificate_reaches_the_server_as_that_user(server, tmp_path, monkeypatch):
    pem = server.client_cert("tokenlane-operator")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "config", server, {
        "client-certificate-data": base64.b64encode(pem.cert).decode(),
        "client-key-data": base64.b64encode(pem.key).decode()})))
    info = await main.login()
    assert isinstance(info, kopf.ConnectionInfo)
    assert (info.server, info.default_namespace, info.token, info.expiration) == (server.url, "ops", None, None)
    assert await whoami(k8s.KubeClient(info)) == "cert:tokenlane-operator"
    # kopf's own client takes the same ConnectionInfo: its TLS context holds the certificate.
    assert info.as_ssl_context() is not None


async def test_login_with_an_exec_plugin_passes_its_token_and_expiry_to_kopf(server, tmp_path, monkeypatch):
    plugin = tmp_path / "plugin.sh"
    plugin.write_text('#!/bin/sh\necho \'{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",'
                      ' "status": {"token": "from-exec", "expirationTimestamp": "2999-01-01T00:00:00Z"}}\'\n')
    plugin.chmod(0o755)
    server.tokens.add("from-exec")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "config", server,
                                                          {"exec": {"command": str(plugin)}})))
    info = await main.login()
    assert info.token == "from-exec"
    assert info.expiration == datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc)  # kopf logs in again then
    assert await whoami(k8s.KubeClient(lambda: info)) == "token:from-exec"


async def test_login_without_credentials_is_a_kopf_login_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(kopf.LoginError, match="no Kubernetes credentials"):
        await main.login()


async def test_the_client_waits_for_a_login(server):
    with pytest.raises(k8s.ApiError) as pending:
        await k8s.KubeClient(lambda: None).get(WHOAMI, "ops", "whoami")
    assert (pending.value.status, pending.value.reason) == (503, "NotLoggedIn") and pending.value.transient
    assert k8s.ApiError is kube.ApiError and k8s.Resource is kube.Resource  # one exception, one resource type
