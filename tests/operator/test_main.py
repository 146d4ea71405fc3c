"""`tokenlane operator` flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenlane.operator import main


def test_scope_is_required():
    with pytest.raises(SystemExit):
        main.parse_args([])


def test_namespaced_and_peering_flags():
    args = main.parse_args(["-n", "a", "--namespace", "b", "--metrics-port", "0"])
    assert args.namespace == ["a", "b"] and not args.all_namespaces
    assert args.peering == "tokenlane" and not args.standalone and args.log_format == "json"
    args = main.parse_args(["--all-namespaces", "--standalone", "--liveness", ""])
    assert args.all_namespaces and args.standalone and args.liveness == ""


def test_namespace_and_all_namespaces_conflict():
    with pytest.raises(SystemExit):
        main.parse_args(["-n", "a", "--all-namespaces"])
    with pytest.raises(SystemExit):
        main.parse_args(["-A", "--peering", "x", "--standalone"])


async def test_tokenlane_operator_cli_against_kmock(declared, tmp_path):
    """The real entry point as a subprocess: kubeconfig login, kopf, JSON logs, metrics."""
    import asyncio
    import json
    import os
    import socket
    import sys
    import time

    import yaml

    from tokenlane.operator.clients import kube as k8s
    import kopf

    kmock = declared
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}],
    }))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenlane.cli", "operator", "--all-namespaces", "--standalone",
        "--liveness", "", "--metrics-port", str(port), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    client = k8s.KubeClient(kopf.ConnectionInfo(server=str(kmock.url)), user_agent="tokenlane-tests")
    try:
        sample = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "tiny-cpu.yaml"
        docs = [d for d in yaml.safe_load_all(sample.read_text()) if d and d.get("kind")]
        for d in docs[:2]:
            d["metadata"].update(uid="u-" + d["metadata"]["name"], generation=1, resourceVersion="1",
                                 namespace="tokenlane-demo")  # the samples leave it to `kubectl -n`
            await client.create(k8s.resource_for(d["apiVersion"], d["kind"]), d)
        deadline = time.monotonic() + 60
        cm = None
        while time.monotonic() < deadline and cm is None:
            cm = await client.get(k8s.CONFIG_MAPS, "tokenlane-demo", "tiny-config")
            await asyncio.sleep(0.2)
        assert cm is not None and "name: interactive" in cm["data"]["runtime.yaml"]
        import httpx
        ok = 'tokenlane_operator_reconciles_total{kind="ModelService",result="ok"}'
        async with httpx.AsyncClient() as http:  # the ConfigMap comes first; the reconcile ends later
            while time.monotonic() < deadline and ok not in (metrics := (await http.get(f"http://127.0.0.1:{port}/metrics")).text):
                await asyncio.sleep(0.2)
        assert ok in metrics
    finally:
        proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        await client.close()
    lines = [l for l in out.decode().splitlines() if l.startswith("{")]
    assert lines, out.decode()[-2000:]
    assert all("message" in json.loads(l) for l in lines)  # structured logs
