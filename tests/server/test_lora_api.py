"""Multi-LoRA through the HTTP API (real uvicorn on loopback, the official `openai` client),
on the simulated executor (adapter folders are checked, no weights run): `model` selects the
base or an adapter, unknown names and adapters a tenant may not use answer 404
`model_not_found`, /v1/models lists the adapters with their parent, vLLM's load/unload
endpoints behind the admin key (and a bad load answers 400 while serving goes on), hot reload
adds and removes adapters, the metrics per adapter and the model-server protocol's signals.
The same API over the model executor, checked against transformers + peft, is
tests/server/test_lora_vs_peft.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tokenlane.runtime.config import hash_api_key
from tokenlane.runtime.entrypoints import server as server_main

ADMIN_KEY = "admin-secret"
TEAM_A_KEY, TEAM_B_KEY = "key-team-a", "key-team-b"


def write_adapter(folder: Path, rank: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return folder


def config_text(adapters: dict[str, Path]) -> str:
    """A runtime.yaml (plain YAML; `served` escapes it for the harness's str.format)."""
    entries = ", ".join(f"{{name: {name}, path: '{path}'}}" for name, path in adapters.items())
    return f"""
model: {{path: simulated/llama3-8b, servedName: base, maxModelLen: 4096, adapters: [{entries}]}}
engine: {{executor: simulated, kvCacheBlocks: 512, blockSize: 16, maxLoras: 2, maxLoraRank: 16}}
lanes:
  - {{name: main, default: true}}
  - {{name: sql, match: {{models: [sql-lora]}}}}
tenants:
  - {{name: team-a, apiKeySha256: {hash_api_key(TEAM_A_KEY)}, adapters: [sql-lora]}}
  - {{name: team-b, apiKeySha256: {hash_api_key(TEAM_B_KEY)}}}
"""


def served(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql-lora": write_adapter(root / "sql"), "chat-lora": write_adapter(root / "chat", rank=16),
            "extra": write_adapter(root / "extra", rank=4), "too-big": write_adapter(root / "big", rank=32)}


@pytest.fixture(scope="module")
def live(serve, adapters):
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENLANE_ADMIN_API_KEY", ADMIN_KEY)
    try:
        yield serve(served(config_text({"sql-lora": adapters["sql-lora"], "chat-lora": adapters["chat-lora"]})))
    finally:
        mp.undo()


def oai(live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)


def test_models_lists_base_and_adapters_with_parent(live, adapters):
    ids = {m.id: m for m in oai(live, TEAM_B_KEY).models.list().data}
    assert set(ids) >= {"base", "sql-lora", "chat-lora"}
    raw = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {TEAM_B_KEY}"}).json()["data"]
    cards = {card["id"]: card for card in raw}
    assert cards["sql-lora"]["parent"] == "base" and cards["sql-lora"]["root"] == str(adapters["sql-lora"])
    assert cards["base"]["parent"] is None
    # team-a may use sql-lora only: the others are not listed for it (nor retrievable).
    assert {m.id for m in oai(live, TEAM_A_KEY).models.list().data} == {"base", "sql-lora"}
    with pytest.raises(openai.NotFoundError):
        oai(live, TEAM_A_KEY).models.retrieve("chat-lora")
    assert oai(live, TEAM_B_KEY).models.retrieve("chat-lora").id == "chat-lora"


def test_model_selects_adapter_lane_and_unknown_is_404(live):
    client = oai(live, TEAM_B_KEY)
    for model in ("base", "sql-lora", "chat-lora"):
        raw = client.completions.with_raw_response.create(model=model, prompt="hello there", max_tokens=3)
        completion = raw.parse()
        assert completion.model == model and completion.usage.completion_tokens == 3
        assert raw.headers["x-lane"] == ("sql" if model == "sql-lora" else "main")
    chat = client.chat.completions.create(model="chat-lora", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
    assert chat.model == "chat-lora"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-lora", prompt="hi", max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"


def test_tenant_may_not_use_other_adapters_404_and_counted(live):
    before = live.metric("tokenlane_adapter_denied_total", tenant="team-a", adapter="chat-lora")
    with pytest.raises(openai.NotFoundError) as denied:
        oai(live, TEAM_A_KEY).completions.create(model="chat-lora", prompt="hi", max_tokens=2)
    assert denied.value.body["code"] == "model_not_found"
    assert "chat-lora" in denied.value.body["message"]
    assert live.metric("tokenlane_adapter_denied_total", tenant="team-a", adapter="chat-lora") == before + 1
    assert oai(live, TEAM_A_KEY).completions.create(model="sql-lora", prompt="hi", max_tokens=2).model == "sql-lora"


def test_load_and_unload_endpoints(live, adapters):
    url = live.url
    body = {"lora_name": "extra", "lora_path": str(adapters["extra"])}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    tenant = httpx.post(url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TEAM_B_KEY}"})
    assert tenant.status_code == 401 and tenant.json()["error"]["code"] == "invalid_admin_key"
    # Bad loads: 400 with the reason, nothing changes, serving goes on.
    for bad, reason in (({"lora_name": "too-big", "lora_path": str(adapters["too-big"])}, "exceeds engine.maxLoraRank"),
                        ({"lora_name": "gone", "lora_path": "/nowhere/at/all"}, "not a folder"),
                        ({"lora_name": "sql-lora", "lora_path": str(adapters["extra"])}, "already loaded"),
                        ({"lora_name": "base", "lora_path": str(adapters["extra"])}, "own name"),
                        ({"lora_name": "x", "lora_path": "ftp://host/a"}, "neither a folder")):
        r = httpx.post(url + "/v1/load_lora_adapter", json=bad, headers=admin)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"}, headers=admin)
    assert r.status_code == 400
    client = oai(live, TEAM_B_KEY)
    assert client.completions.create(model="base", prompt="still serving", max_tokens=2).usage.completion_tokens == 2
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 200 and "extra" in r.text
    assert "extra" in {m.id for m in client.models.list().data}
    assert client.completions.create(model="extra", prompt="hi", max_tokens=2).model == "extra"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=admin)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="hi", max_tokens=2)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "extra" not in live.engine.executor.adapters
    kv = live.engine.scheduler.kv
    assert kv.num_used_blocks == 0  # every request above finished; no block left taken
    kv.check_invariants([])


def test_load_endpoints_are_off_without_an_admin_key(serve, adapters, monkeypatch):
    monkeypatch.delenv("TOKENLANE_ADMIN_API_KEY", raising=False)
    other = serve(served(config_text({})))
    r = httpx.post(other.url + "/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(adapters["extra"])},
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 404 and "TOKENLANE_ADMIN_API_KEY" in r.json()["error"]["message"]


def test_hot_reload_adds_and_removes_adapters_and_refuses_a_bad_one(serve, adapters, tmp_path):
    live = serve(served(config_text({"sql-lora": adapters["sql-lora"]})))
    client = oai(live, TEAM_B_KEY)

    def listed() -> set[str]:
        return {m.id for m in client.models.list().data} - {"base"}

    def reload(text: str, result: str) -> None:
        before = live.metric("tokenlane_config_reloads_total", result=result)
        live.config_path.write_text(text)
        live.wait_metric("tokenlane_config_reloads_total", lambda v: v > before, result=result)

    reload(config_text({"sql-lora": adapters["sql-lora"], "chat-lora": adapters["chat-lora"]}), "success")
    assert listed() == {"sql-lora", "chat-lora"}
    assert client.completions.create(model="chat-lora", prompt="hi", max_tokens=2).model == "chat-lora"
    # A bad adapter refuses the whole reload, naming it; serving goes on with what was loaded.
    reload(config_text({"sql-lora": adapters["sql-lora"], "chat-lora": adapters["chat-lora"],
                        "extra": adapters["extra"], "too-big": adapters["too-big"]}), "error")
    assert "too-big" in live.state.watcher.last_message and listed() == {"sql-lora", "chat-lora"}
    assert client.completions.create(model="sql-lora", prompt="hi", max_tokens=2).model == "sql-lora"
    reload(config_text({"chat-lora": adapters["chat-lora"]}), "success")
    assert listed() == {"chat-lora"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql-lora", prompt="hi", max_tokens=2)


def test_adapter_metrics_and_model_server_protocol_signals(live):
    client = oai(live, TEAM_B_KEY)
    before = live.metric("tokenlane_adapter_requests_total", adapter="chat-lora", outcome="finished")
    client.completions.create(model="chat-lora", prompt="count me", max_tokens=3)
    assert live.metric("tokenlane_adapter_requests_total", adapter="chat-lora", outcome="finished") == before + 1
    assert live.metric("tokenlane_adapter_generation_tokens_total", adapter="chat-lora") >= 3
    assert live.metric("tokenlane_adapter_prompt_tokens_total", adapter="chat-lora") > 0
    text = live.metrics_text()
    for name in ("tokenlane_num_requests_waiting", "tokenlane_num_requests_running", "tokenlane_kv_cache_usage_ratio",
                 'tokenlane_adapter_requests_running{adapter="sql-lora"',
                 'tokenlane_adapter_requests_waiting{adapter="chat-lora"'):
        assert name in text, name
    info = [line for line in text.splitlines() if line.startswith("tokenlane_lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > time.time() - 3600
    cache = [line for line in text.splitlines() if line.startswith("tokenlane_cache_config_info{")]
    assert cache == ['tokenlane_cache_config_info{block_size="16",model="base",num_gpu_blocks="512"} 1.0']


def test_a_bad_adapter_at_start_exits_2_naming_it(adapters, tmp_path, capsys):
    path = tmp_path / "runtime.yaml"
    path.write_text(config_text({"sql-lora": adapters["sql-lora"], "too-big": adapters["too-big"]}))
    assert server_main.main(["--config", str(path)], exit_when_served=False) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "too-big" in err and "maxLoraRank" in err


def test_adapters_in_the_engine_core_process(serve, adapters, monkeypatch):
    """engine.coreProcess: the load and unload travel as typed messages to the core."""
    monkeypatch.setenv("TOKENLANE_ADMIN_API_KEY", ADMIN_KEY)
    text = config_text({"sql-lora": adapters["sql-lora"]}).replace("maxLoraRank: 16}", "maxLoraRank: 16, coreProcess: true}")
    live = serve(served(text))
    client = oai(live, TEAM_B_KEY)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert {m.id for m in client.models.list().data} == {"base", "sql-lora"}
    assert client.completions.create(model="sql-lora", prompt="hi", max_tokens=2).model == "sql-lora"
    bad = httpx.post(live.url + "/v1/load_lora_adapter", headers=admin,
                     json={"lora_name": "too-big", "lora_path": str(adapters["too-big"])})
    assert bad.status_code == 400 and "maxLoraRank" in bad.json()["error"]["message"]
    ok = httpx.post(live.url + "/v1/load_lora_adapter", headers=admin,
                    json={"lora_name": "extra", "lora_path": str(adapters["extra"])})
    assert ok.status_code == 200, ok.text
    assert client.completions.create(model="extra", prompt="hi", max_tokens=2).model == "extra"
    assert httpx.post(live.url + "/v1/unload_lora_adapter", headers=admin, json={"lora_name": "extra"}).status_code == 200
    assert httpx.post(live.url + "/v1/unload_lora_adapter", headers=admin, json={"lora_name": "extra"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="hi", max_tokens=2)
    # A hot reload that adds an adapter is applied in the core; the API process learns of it.
    before = live.metric("tokenlane_config_reloads_total", result="success")
    live.config_path.write_text(config_text({"sql-lora": adapters["sql-lora"], "chat-lora": adapters["chat-lora"]})
                                .replace("maxLoraRank: 16}", "maxLoraRank: 16, coreProcess: true}"))
    live.wait_metric("tokenlane_config_reloads_total", lambda v: v > before, result="success")
    deadline = time.monotonic() + 30
    while "chat-lora" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the core's reload did not reach the API process"
        time.sleep(0.05)
    assert client.completions.create(model="chat-lora", prompt="hi", max_tokens=2).model == "chat-lora"
