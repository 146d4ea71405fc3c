"""docs/quickstart.md works as written: the paths and names it uses exist, its patches do what
it says (the good one validates and changes only the ConfigMap, the bad one is refused by the
CRD's CEL rule), and its HTTP steps replayed against a real `tokenlane serve` running the
runtime.yaml the operator renders for the sample: a streamed completion through the chosen
lane, the `openai` client snippet, then the budget change hot-reloaded and visible on
/metrics exactly as the page shows."""

from __future__ import annotations

import json
import re
import time

import yaml
from manifests_helpers import MANIFESTS, ROOT, SAMPLE, load_yaml_docs, operator_render, render
from manifests_schemas import validate_custom_resource

QUICKSTART = ROOT / "docs" / "quickstart.md"
OPERATIONS = ROOT / "docs" / "operations.md"


def _text() -> str:
    return QUICKSTART.read_text()


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _text(), re.S)


def _patches() -> list[dict]:
    return [json.loads(p) for p in re.findall(r"patch servinglane tiny-interactive --type merge \\\n\s+-p '([^']+)'",
                                             _text())]


def _merge_patch(target, patch):
    """RFC 7386 JSON merge patch (what `kubectl patch --type merge` sends)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _lane_crd() -> dict:
    return next(o for o in render("manifests/overlays/cluster-wide")
                if o["kind"] == "CustomResourceDefinition" and o["metadata"]["name"] == "servinglanes.tokenlane.dev")


def _sample_with(patch: dict | None) -> list[dict]:
    docs = load_yaml_docs(SAMPLE)
    if patch is not None:
        docs = [_merge_patch(d, patch) if d["metadata"]["name"] == "tiny-interactive" else d for d in docs]
    return docs


def test_paths_in_the_docs_exist():
    for doc in (QUICKSTART, OPERATIONS):
        for path in set(re.findall(r"(?<![\w/.-])((?:manifests|crds|docs|tests)/[\w./-]*\w)", doc.read_text())):
            assert (ROOT / path).exists(), f"{doc.name} mentions {path}, which does not exist"


def test_kustomizations_the_docs_apply_render():
    for rel in set(re.findall(r"kubectl (?:apply|delete) -k ([\w/.-]+)", _text())):
        assert render(rel.rstrip("/")), rel


def test_names_in_the_quickstart_are_what_the_operator_renders(tmp_path):
    objects = operator_render(_sample_with(None), tmp_path)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for kind, name in [("ConfigMap", "tiny-config"), ("Deployment", "tiny"), ("Service", "tiny")]:
        assert (kind, name) in names and f"{name}" in _text()
    (service,) = [o for o in objects if o["kind"] == "Service"]
    assert "service/tiny 8000:8000" in _text() and service["spec"]["ports"][0]["port"] == 8000
    lanes = {d["metadata"]["name"] for d in _sample_with(None) if d["kind"] == "ServingLane"}
    assert {"tiny-interactive", "tiny-batch"} == lanes


def test_the_documented_budget_change_validates_and_restarts_nothing(tmp_path):
    good, bad = _patches()
    patched = _sample_with(good)
    lane = next(d for d in patched if d["metadata"]["name"] == "tiny-interactive")
    assert validate_custom_resource(lane, _lane_crd()) == []
    before, after = operator_render(_sample_with(None), tmp_path), operator_render(patched, tmp_path)

    def pick(objs, kind):
        return next(o for o in objs if o["kind"] == kind)

    # The pod template is unchanged: budgets reload in place, no rollout.
    assert pick(before, "Deployment")["spec"]["template"] == pick(after, "Deployment")["spec"]["template"]
    config = yaml.safe_load(pick(after, "ConfigMap")["data"]["runtime.yaml"])
    (interactive,) = [lane for lane in config["lanes"] if lane["name"] == "interactive"]
    assert interactive["maxActiveSequences"] == good["spec"]["budgets"]["maxActiveSequences"] == 4

    refused = _sample_with(bad)
    lane = next(d for d in refused if d["metadata"]["name"] == "tiny-interactive")
    problems = validate_custom_resource(lane, _lane_crd())
    assert any("prefillChunkSize must be <= maxBatchedTokens" in p for p in problems), problems
    assert "prefillChunkSize must be <= maxBatchedTokens" in _text()


# ---- the HTTP steps, replayed against a real server

def test_streamed_completion_through_the_chosen_lane(quickstart_server):
    import httpx

    base, _, _ = quickstart_server
    (curl,) = [b for b in _code_blocks("bash") if "/v1/completions" in b]
    body = json.loads(re.search(r"-d '([^']+)'", curl).group(1))
    lane = re.search(r"-H 'X-Lane: (\S+)'", curl).group(1)
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"X-Lane": lane}, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-lane"] == lane == "interactive"
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == body["max_tokens"]
    assert sum(1 for c in chunks if c["choices"]) >= 1


def test_openai_snippet_streams_through_the_batch_lane(quickstart_server, capsys):
    base, _, _ = quickstart_server
    (snippet,) = [b for b in _code_blocks("python") if "OpenAI(" in b]
    assert 'extra_headers={"X-Lane": "batch"}' in snippet
    exec(snippet.replace("http://127.0.0.1:8000/v1", f"{base}/v1"), {})  # noqa: S102 - our own docs
    assert capsys.readouterr().out.strip()


def test_budget_change_is_hot_reloaded_and_shows_on_metrics(quickstart_server):
    """Step 5: the new ConfigMap content lands in the mounted file; /metrics then shows
    exactly the lines the page promises."""
    import httpx

    base, config_path, tmp = quickstart_server
    good, _ = _patches()
    (configmap,) = [o for o in operator_render(_sample_with(good), tmp) if o["kind"] == "ConfigMap"]
    config = yaml.safe_load(configmap["data"]["runtime.yaml"])
    config["model"]["path"] = yaml.safe_load(config_path.read_text())["model"]["path"]
    # The kubelet swaps a ConfigMap volume's files atomically; so do we.
    staged = config_path.with_suffix(".new")
    staged.write_text(yaml.safe_dump(config))
    staged.replace(config_path)
    block = re.search(r"```\n\s*(tokenlane_config_reloads_total.*?)```", _text(), re.S).group(1)
    expected = [line.strip() for line in block.strip().splitlines()]
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{base}/metrics", timeout=5).text.splitlines()
        if all(line in metrics for line in expected):
            break
        assert time.monotonic() < deadline, f"after 30s /metrics still lacks {expected}"
        time.sleep(0.3)


def _anchor(heading: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_alert_runbook_links_point_at_sections_of_operations_md():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    rules = yaml.safe_load((MANIFESTS / "monitoring" / "prometheus" / "tokenlane-rules.yaml").read_text())
    links = [r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]
             if "runbook_url" in r.get("annotations", {})]
    assert links
    for link in links:
        path, anchor = link.split("/blob/main/", 1)[1].split("#")
        assert path == "docs/operations.md" and anchor in anchors, link


def test_operations_md_names_every_alert():
    rules = yaml.safe_load((MANIFESTS / "monitoring" / "prometheus" / "tokenlane-rules.yaml").read_text())
    text = OPERATIONS.read_text()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["alert"] in text, f"docs/operations.md does not explain {rule['alert']}"
