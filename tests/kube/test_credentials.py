"""tokenlane.kube's credentials over real TLS: kubeconfigs with client certificates (data and
files), bearer tokens, token files, basic auth, exec plugins, merged KUBECONFIG lists and
`tls-server-name`; a pod's service account with a rotating token; and the errors that name
what is wrong. The server is kube_https_server.py (a real HTTPS server that authenticates as
kube-apiserver does); the same client against a real kube-apiserver is in
tests/cluster/test_fleet_on_api_server.py and test_check_on_api_server.py."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from kube_https_server import SERVER_NAME, KubeHttpsServer  # noqa: E402

from tokenlane import kube  # noqa: E402
from tokenlane.kube.credentials import kubeconfig_paths  # noqa: E402

CONFIG_MAPS = kube.Resource("", "v1", "configmaps", "ConfigMap")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    api = KubeHttpsServer(tmp_path_factory.mktemp("apiserver"))
    yield api
    api.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(path: Path, cluster: dict, user: dict, *, context: str = "test", namespace: str = "team-a") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": context, "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
    }))
    return path


def cluster_of(api: KubeHttpsServer, **extra) -> dict:
    return {"server": api.url, "certificate-authority-data": b64(api.ca.cert), **extra}


async def whoami(creds: kube.Credentials) -> str:
    api = kube.KubeApi(creds)
    try:
        found = await api.get(CONFIG_MAPS, creds.namespace or "default", "whoami")
    finally:
        await api.close()
    return found["data"]["user"]


async def test_client_certificate_embedded_and_in_files(server, tmp_path):
    alice = server.client_cert("alice")
    embedded = kubeconfig(tmp_path / "embedded", cluster_of(server),
                          {"client-certificate-data": b64(alice.cert), "client-key-data": b64(alice.key)})
    creds = kube.load_kubeconfig(kubeconfig_paths(str(embedded)))
    assert (creds.namespace, creds.cert_data) == ("team-a", alice.cert)
    assert await whoami(creds) == "cert:alice"

    # Files: paths relative to the kubeconfig that names them, the CA by path too.
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "pki").mkdir()
    bob = server.client_cert("bob")
    (folder / "pki" / "bob.crt").write_bytes(bob.cert)
    (folder / "pki" / "bob.key").write_bytes(bob.key)
    (folder / "pki" / "ca.crt").write_bytes(server.ca.cert)
    files = kubeconfig(folder / "config", {"server": server.url, "certificate-authority": "pki/ca.crt"},
                       {"client-certificate": "pki/bob.crt", "client-key": "pki/bob.key"})
    creds = kube.load_kubeconfig(kubeconfig_paths(str(files)))
    assert creds.cert_file == folder / "pki" / "bob.crt" and creds.ca_file == folder / "pki" / "ca.crt"
    assert await whoami(creds) == "cert:bob"


async def test_bearer_token_token_file_and_basic_auth(server, tmp_path):
    server.tokens |= {"static-token", "file-token"}
    server.passwords["carol"] = "s3cret"
    config = kubeconfig(tmp_path / "token", cluster_of(server), {"token": "static-token"})
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(str(config)))) == "token:static-token"
    (tmp_path / "tok").write_text("file-token\n")
    config = kubeconfig(tmp_path / "tokenfile", cluster_of(server), {"tokenFile": "tok"})
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(str(config)))) == "token:file-token"
    config = kubeconfig(tmp_path / "basic", cluster_of(server), {"username": "carol", "password": "s3cret"})
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(str(config)))) == "basic:carol"


async def test_a_wrong_token_is_an_api_error_with_status_and_reason(server, tmp_path):
    config = kubeconfig(tmp_path / "config", cluster_of(server), {"token": "nobody-knows-me"})
    api = kube.KubeApi(kube.load_kubeconfig(kubeconfig_paths(str(config))))
    try:
        with pytest.raises(kube.ApiError) as refused:
            await api.get(CONFIG_MAPS, "team-a", "whoami")
        assert (refused.value.status, refused.value.reason) == (401, "Unauthorized")
        server.tokens.add("nobody-knows-me")
        assert await api.get(CONFIG_MAPS, "team-a", "no-such-object") is None  # 404: None, not an error
        with pytest.raises(kube.ApiError) as missing:
            await api.request("GET", "/api/v1/nothing-here")
        assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    finally:
        await api.close()


async def test_list_and_watch_over_tls_and_an_expired_watch_is_a_410(server, tmp_path):
    server.tokens.add("watcher")
    config = kubeconfig(tmp_path / "config", cluster_of(server), {"token": "watcher"})
    api = kube.KubeApi(kube.load_kubeconfig(kubeconfig_paths(str(config))))
    server.watch_events = [
        {"type": "ADDED", "object": {"kind": "ConfigMap", "metadata": {"name": "a", "resourceVersion": "8"}}},
        {"type": "BOOKMARK", "object": {"kind": "ConfigMap", "metadata": {"resourceVersion": "9"}}},
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                     "message": "too old resource version: 7 (9)"}},
    ]
    try:
        items, version = await api.list_with_version(CONFIG_MAPS, "team-a")
        assert ([i["data"]["user"] for i in items], items[0]["apiVersion"], version) == (["token:watcher"], "v1", "7")
        seen = []
        with pytest.raises(kube.ApiError) as expired:
            async for event in api.watch(CONFIG_MAPS, "team-a", resource_version=version):
                seen.append((event["type"], event["object"]["metadata"]["resourceVersion"]))
        assert seen == [("ADDED", "8"), ("BOOKMARK", "9")]  # the caller lists again on a 410
        assert (expired.value.status, expired.value.reason) == (410, "Expired")
        server.watch_events = server.watch_events[:1]  # the server ends a watch: the iteration ends
        assert [e["type"] async for e in api.watch(CONFIG_MAPS, "team-a", resource_version="8")] == ["ADDED"]
    finally:
        await api.close()


async def test_server_verification_wrong_ca_insecure_and_tls_server_name(server, tmp_path):
    server.tokens.add("tls-token")
    other_ca = KubeHttpsServer(tmp_path / "other")  # a CA that did not sign this server's certificate
    other_ca.close()
    wrong = kubeconfig(tmp_path / "wrong", {"server": server.url, "certificate-authority-data": b64(other_ca.ca.cert)},
                       {"token": "tls-token"})
    with pytest.raises(kube.ApiError) as refused:
        await whoami(kube.load_kubeconfig(kubeconfig_paths(str(wrong))))
    assert refused.value.reason == "ConnectionError" and "CERTIFICATE_VERIFY_FAILED" in refused.value.message
    assert refused.value.transient  # 503: kopf and the router retry

    insecure = kubeconfig(tmp_path / "insecure", {"server": server.url, "insecure-skip-tls-verify": True},
                          {"token": "tls-token"})
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(str(insecure)))) == "token:tls-token"

    # The server's certificate names 127.0.0.1 and kubernetes.test, not localhost.
    by_name = f"https://localhost:{server.port}"
    mismatch = kubeconfig(tmp_path / "mismatch", cluster_of(server, server=by_name), {"token": "tls-token"})
    with pytest.raises(kube.ApiError, match="CERTIFICATE_VERIFY_FAILED"):
        await whoami(kube.load_kubeconfig(kubeconfig_paths(str(mismatch))))
    named = kubeconfig(tmp_path / "named", cluster_of(server, server=by_name, **{"tls-server-name": SERVER_NAME}),
                       {"token": "tls-token"})
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(str(named)))) == "token:tls-token"


async def test_merged_kubeconfig_list_and_context_choice(server, tmp_path):
    server.tokens |= {"first", "second"}
    first = kubeconfig(tmp_path / "a" / "config", cluster_of(server), {"token": "first"}, context="one")
    second = tmp_path / "b" / "config"
    second.parent.mkdir()
    (second.parent / "tok").write_text("second")
    second.write_text(yaml.safe_dump({
        "current-context": "two",  # the first file's current-context wins
        "clusters": [{"name": "c", "cluster": {"server": "https://ignored.invalid"}},  # the first file's "c" wins
                     {"name": "c2", "cluster": cluster_of(server)}],
        "users": [{"name": "u2", "user": {"tokenFile": "tok"}}],  # relative to this file's folder
        "contexts": [{"name": "two", "context": {"cluster": "c2", "user": "u2"}}],
    }))
    merged = f"{first}:{second}"
    assert await whoami(kube.load_kubeconfig(kubeconfig_paths(merged))) == "token:first"
    two = kube.load_kubeconfig(kubeconfig_paths(merged), context="two")
    assert two.token_file == second.parent / "tok" and await whoami(two) == "token:second"
    with pytest.raises(kube.CredentialsError, match="no context named 'three'"):
        kube.load_kubeconfig(kubeconfig_paths(merged), context="three")


async def test_exec_plugin_runs_once_until_expiry_and_again_after_a_401(server, tmp_path):
    plugin = tmp_path / "plugin.py"
    runs = tmp_path / "runs"
    plugin.write_text(f"""#!{sys.executable}
import json, os, pathlib
runs = pathlib.Path({str(runs)!r})
n = len(runs.read_text().splitlines()) + 1 if runs.exists() else 1
runs.write_text((runs.read_text() if runs.exists() else "") + os.environ["KUBERNETES_EXEC_INFO"] + "\\n")
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": os.environ["TOKEN_PREFIX"] + str(n),
                             "expirationTimestamp": "2999-01-01T00:00:00Z"}}}}))
""")
    plugin.chmod(0o755)
    config = kubeconfig(tmp_path / "config", cluster_of(server), {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "./plugin.py", "args": [],
        "env": [{"name": "TOKEN_PREFIX", "value": "exec-"}], "interactiveMode": "Never"}})
    creds = kube.load_kubeconfig(kubeconfig_paths(str(config)))
    server.tokens.add("exec-1")
    api = kube.KubeApi(creds)
    try:
        for _ in range(2):  # cached until its expirationTimestamp
            assert (await api.get(CONFIG_MAPS, "team-a", "whoami"))["data"]["user"] == "token:exec-1"
        assert len(runs.read_text().splitlines()) == 1
        info = json.loads(runs.read_text().splitlines()[0])
        assert (info["kind"], info["spec"]) == ("ExecCredential", {"interactive": False})
        # The server stops accepting it (revoked): a 401 runs the plugin again, once.
        server.tokens.discard("exec-1")
        server.tokens.add("exec-2")
        assert (await api.get(CONFIG_MAPS, "team-a", "whoami"))["data"]["user"] == "token:exec-2"
        assert len(runs.read_text().splitlines()) == 2
    finally:
        await api.close()

    failing = kubeconfig(tmp_path / "failing", cluster_of(server), {"exec": {"command": "false"}})
    with pytest.raises(kube.ApiError) as refused:
        await whoami(kube.load_kubeconfig(kubeconfig_paths(str(failing))))
    assert refused.value.reason == "CredentialsError" and "exec plugin 'false': exit status 1" in refused.value.message


async def test_service_account_token_rotates(server, tmp_path, monkeypatch):
    mount = tmp_path / "serviceaccount"
    mount.mkdir()
    (mount / "ca.crt").write_bytes(server.ca.cert)
    (mount / "namespace").write_text("team-b")
    (mount / "token").write_text("projected-1")
    server.tokens.add("projected-1")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    creds = kube.in_cluster(mount)
    assert (creds.server, creds.namespace) == (server.url, "team-b")
    api = kube.KubeApi(creds)
    try:
        assert (await api.get(CONFIG_MAPS, "team-b", "whoami"))["data"]["user"] == "token:projected-1"
        # The kubelet writes a new token and the old one stops working: the 401 re-reads the file.
        (mount / "token").write_text("projected-2")
        server.tokens.discard("projected-1")
        server.tokens.add("projected-2")
        assert (await api.get(CONFIG_MAPS, "team-b", "whoami"))["data"]["user"] == "token:projected-2"
    finally:
        await api.close()


async def test_an_unreadable_token_file_is_a_credentials_error(tmp_path):
    auth = kube.Authenticator(kube.Credentials("https://127.0.0.1:1", token_file=tmp_path / "absent"))
    with pytest.raises(kube.CredentialsError, match="cannot read the token file"):
        await auth.authorization()


async def test_a_token_file_is_reread_every_minute(tmp_path):
    clock = [1000.0]
    token = tmp_path / "token"
    token.write_text("one")
    auth = kube.Authenticator(kube.Credentials("https://127.0.0.1:1", token_file=token), clock=lambda: clock[0])
    assert await auth.authorization() == "Bearer one"
    token.write_text("two")
    clock[0] += 59
    assert await auth.authorization() == "Bearer one"
    clock[0] += 1  # a minute after the last read, as client-go
    assert await auth.authorization() == "Bearer two"


def test_load_prefers_the_kubeconfig_or_the_pod_and_says_when_there_is_neither(server, tmp_path, monkeypatch):
    mount = tmp_path / "sa"
    mount.mkdir()
    (mount / "token").write_text("pod-token")
    config = kubeconfig(tmp_path / "config", cluster_of(server), {"token": "kubeconfig-token"})
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert kube.load(sa_dir=mount).token == "kubeconfig-token"  # kubectl's order
    assert kube.load(sa_dir=mount, prefer_in_cluster=True).token_file == mount / "token"  # a controller's
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert kube.load(sa_dir=mount).token_file == mount / "token"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(kube.NoCredentials, match="no Kubernetes credentials: no kubeconfig.*KUBERNETES_SERVICE_HOST"):
        kube.load(sa_dir=mount)
    # A kubeconfig that exists but is broken is reported, not skipped for the pod's account.
    (tmp_path / "broken").write_text("current-context: nowhere\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "broken"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.raises(kube.CredentialsError, match="no context named 'nowhere'"):
        kube.load(sa_dir=mount)


@pytest.mark.parametrize("user, cluster, message", [
    ({"auth-provider": {"name": "oidc"}}, {}, "auth-provider 'oidc' plugin is not supported; use an exec"),
    ({"client-certificate": "a.crt", "client-certificate-data": "QQ=="}, {},
     "both client-certificate and client-certificate-data are set"),
    ({"token": "t"}, {"certificate-authority-data": "not base64!"}, "certificate-authority-data is not base64"),
    ({"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}}, {},
     "exec apiVersion 'client.authentication.k8s.io/v1alpha1' is not one of"),
    ({"token": "t"}, {"server": "ftp://x"}, "server 'ftp://x' is not an http(s) URL"),
])
def test_bad_kubeconfigs_are_refused_naming_the_key(tmp_path, user, cluster, message):
    config = kubeconfig(tmp_path / "config", {"server": "https://127.0.0.1:6443", **cluster}, user)
    with pytest.raises(kube.CredentialsError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        kube.load_kubeconfig(kubeconfig_paths(str(config)))
    assert str(config) in str(refused.value)
