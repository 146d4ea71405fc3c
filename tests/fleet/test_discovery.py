"""EndpointSlice discovery, pure parts: which endpoints are replicas, and the router's flags.
The watch itself runs against a real API server in tests/cluster/test_fleet_on_api_server.py;
the service account's credentials are tested over HTTPS in tests/kube/test_credentials.py."""

from __future__ import annotations

import pytest

from tokenlane import kube
from tokenlane.runtime.fleet.discovery import ready_backends
from tokenlane.runtime.fleet.router import main


def endpoint_slice(endpoints, ports=({"name": "http", "port": 8000},), address_type="IPv4"):
    return {"addressType": address_type, "ports": list(ports), "endpoints": list(endpoints)}


def endpoint(address, **conditions):
    return {"addresses": [address], **({"conditions": conditions} if conditions else {})}


def test_ready_endpoints_of_every_slice_are_replicas():
    slices = [
        endpoint_slice([endpoint("10.0.0.2", ready=True), endpoint("10.0.0.1"),  # no condition: ready
                        endpoint("10.0.0.3", ready=False, terminating=True)]),
        endpoint_slice([endpoint("10.0.1.1", ready=True), endpoint("10.0.0.1", ready=True)]),  # a duplicate
    ]
    assert ready_backends(slices) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.1.1:8000"]


def test_the_http_port_is_used_and_ipv6_is_bracketed():
    two_ports = endpoint_slice([endpoint("10.0.0.1")], ports=[{"name": "metrics", "port": 9000},
                                                             {"name": "http", "port": 8080}])
    assert ready_backends([two_ports]) == ["http://10.0.0.1:8080"]
    unnamed = endpoint_slice([endpoint("10.0.0.1")], ports=[{"port": 7000}])
    assert ready_backends([unnamed]) == ["http://10.0.0.1:7000"]
    ambiguous = endpoint_slice([endpoint("10.0.0.1")], ports=[{"name": "a", "port": 1}, {"name": "b", "port": 2}])
    assert ready_backends([ambiguous]) == []
    v6 = endpoint_slice([endpoint("fd00::1")], address_type="IPv6")
    assert ready_backends([v6]) == ["http://[fd00::1]:8000"]
    assert ready_backends([endpoint_slice([])]) == [] and ready_backends([{"ports": None}]) == []


async def test_in_cluster_access_reads_the_service_account(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "namespace").write_text("team-a")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    creds = kube.in_cluster(tmp_path)
    assert (creds.server, creds.namespace, creds.ca_file) == ("https://10.96.0.1:6443", "team-a", None)
    assert await kube.Authenticator(creds).authorization() == "Bearer t0ken"
    assert kube.in_cluster_namespace(tmp_path) == "team-a" and kube.in_cluster_namespace(tmp_path / "none") is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert kube.in_cluster(tmp_path).server == "https://[fd00::1]:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(kube.NoCredentials, match="KUBERNETES_SERVICE_HOST"):
        kube.in_cluster(tmp_path)


@pytest.mark.parametrize("argv, message", [
    ([], "either --backend"),
    (["--backend", "http://a:1", "--endpointslice-service", "tiny"], "either --backend"),
])
def test_router_takes_static_backends_or_discovery(argv, message, capsys):
    assert main(argv) == 2 and message in capsys.readouterr().err


def test_discovery_outside_a_pod_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["--endpointslice-service", "tiny", "--namespace", "ns"]) == 2
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err
