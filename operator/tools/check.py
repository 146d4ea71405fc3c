"""`tokenlane check`: lint a serving configuration against the go-live checklist.

Three kinds of input, one set of rules (operator/tools/checklist.py):
- a `runtime.yaml` (`tokenlane check runtime.yaml`);
- ModelService / ServingLane manifests (`-f FILE_OR_DIR`, `-k KUSTOMIZE_DIR`): rendered into
  the runtime.yaml of each pool exactly as `tokenlane render` and the operator do;
- the live objects of a namespace (`-n NS [--context C]`), read with the Kubernetes API; their
  `status.overrides` (the tuner's values) are applied, so what is checked is what serves.

This module reads the inputs into `Subject`s, the alert rules into `AlertRules`, and prints
the findings as a table or JSON. Exit status: 1 on an error (or a warning with `--strict`),
0 otherwise, 2 when the input cannot be read. Imports no torch (the operator image has none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

from tokenlane import kube
from tokenlane.operator.tools import render
from tokenlane.operator.desired.builders import CONFIG_FILE, LABEL_MODEL_SERVICE, LABEL_POOL, SHARED_POOL
from tokenlane.operator.api.schema import ENGINE_KEYS_ELSEWHERE
from tokenlane.operator.tools.checklist import (
    RULES,
    SEVERITIES,
    AlertRules,
    Checkpoint,
    Finding,
    Problem,
    Subject,
    alert_names,
    check_alerts,
    check_subject,
)
from tokenlane.operator.api.resources import (
    API_VERSION,
    MODEL_SERVICE,
    SERVING_LANE,
    ModelService,
    parse_model_service,
    parse_serving_lane,
)
from tokenlane.runtime.config import LANE_KNOBS, ConfigError, RuntimeConfig, loads_config


class CheckInputError(Exception):
    """The input cannot be read at all (exit status 2), as opposed to a config that fails a rule."""


PROMETHEUS_RULE_GROUP, PROMETHEUS_RULE_VERSION, PROMETHEUS_RULE_PLURAL = "monitoring.coreos.com", "v1", "prometheusrules"


# --------------------------------------------------------------------------- inputs -> subjects


def _runtime_locator(name: str) -> Callable[[Problem], tuple[str, str]]:
    return lambda problem: (name, problem.key)


def read_checkpoint(folder: Path) -> Checkpoint:
    """The dimensions in a checkpoint folder's config.json (or the file itself)."""
    path = folder if folder.name == "config.json" else folder / "config.json"
    try:
        raw = json.loads(path.read_text())
        heads = int(raw["num_attention_heads"])
        return Checkpoint(
            num_layers=int(raw["num_hidden_layers"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            max_position_embeddings=raw.get("max_position_embeddings"),
            num_attention_heads=heads,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckInputError(f"{path}: cannot read the checkpoint's dimensions: {exc}") from None


def subject_from_runtime_yaml(name: str, config: RuntimeConfig, checkpoint: Optional[Checkpoint]) -> Subject:
    device = config.engine.device
    if checkpoint is None:
        folder = Path(config.model.path)
        if (folder / "config.json").is_file():
            try:
                checkpoint = read_checkpoint(folder)
            except CheckInputError:
                checkpoint = None  # a checkpoint the runtime could not load either; the KV rules say unknown
    return Subject(label=name, configs=[config], locate=_runtime_locator(name),
                   on_cpu=True if device == "cpu" else False if device == "cuda" else None, checkpoint=checkpoint)


_LANE_SPEC_KEYS = {"class": "spec.class", "priority": "spec.priority", "weight": "spec.weight",
                   "default": "spec.default"}
_BUDGET_KEYS = tuple(k.key for k in LANE_KNOBS)  # a ServingLane's spec.budgets


def _manifest_locator(msvc_label: str, lane_objects: dict[str, str]) -> Callable[[Problem], tuple[str, str]]:
    """runtime.yaml keys -> the ModelService / ServingLane field a user edits."""

    def locate(problem: Problem) -> tuple[str, str]:
        key = problem.key
        if key.startswith("lanes[") and "]" in key:
            lane, _, rest = key[len("lanes["):].partition("]")
            rest = rest.lstrip(".")
            obj = lane_objects.get(lane)
            if obj is None:
                return msvc_label, "ServingLanes"
            head = rest.split(".")[0]
            if head in _BUDGET_KEYS:
                return obj, f"spec.budgets.{rest}"
            return obj, _LANE_SPEC_KEYS.get(rest, f"spec.{rest}")
        if key == "lanes":
            return msvc_label, "ServingLanes"
        if key.startswith("engine.") and key[len("engine."):] in ENGINE_KEYS_ELSEWHERE:
            return msvc_label, f"spec.{ENGINE_KEYS_ELSEWHERE[key[len('engine.'):]]}"
        if key.startswith("tenants"):
            return msvc_label, f"spec.{key}"
        return msvc_label, f"spec.{key}"

    return locate


def _is_ours(doc: Any, kind: str) -> bool:
    return isinstance(doc, dict) and doc.get("apiVersion") == API_VERSION and doc.get("kind") == kind


def _label(kind: str, meta: dict) -> str:
    return f"{kind} {meta.get('namespace') or 'default'}/{meta.get('name')}"


def subjects_from_manifests(docs: list[dict], checkpoint: Optional[Checkpoint]) -> tuple[list[Subject], list[Finding]]:
    """Render the ModelServices and ServingLanes as the operator does; one Subject per ModelService.

    Objects the operator would refuse (invalid spec, refused lane, lane without its ModelService)
    become `config-invalid` findings with the operator's own message."""
    ours = [d for d in docs if _is_ours(d, MODEL_SERVICE) or _is_ours(d, SERVING_LANE)]
    objects, problems = render.render_documents(ours)
    findings = [Finding("config-invalid", RULES["config-invalid"].severity, label, "spec", why,
                        "fix the field named in the message (kubectl apply would refuse it, or the operator does)")
                for label, why in problems.items()]
    lanes_by_parent: dict[tuple[str, str], dict[str, str]] = {}
    for doc in ours:
        if doc["kind"] != SERVING_LANE:
            continue
        try:
            lane = parse_serving_lane(doc)
        except ValueError:
            continue  # reported by render
        label = _label(SERVING_LANE, doc.get("metadata") or {})
        if label in problems:
            continue
        lanes_by_parent.setdefault((lane.ref.namespace, lane.parent), {})[lane.lane_name] = label
    subjects = []
    for doc in ours:
        if doc["kind"] != MODEL_SERVICE:
            continue
        label = _label(MODEL_SERVICE, doc.get("metadata") or {})
        if label in problems:
            continue
        msvc: ModelService = parse_model_service(doc)
        pools = _pool_configs(objects, msvc)
        if not pools:
            continue
        lane_objects = lanes_by_parent.get((msvc.namespace, msvc.name), {})
        gpus = msvc.spec["gpus"]["count"]
        device = msvc.spec["engine"].get("device", "auto")
        on_cpu = device == "cpu" or (device == "auto" and gpus == 0)
        subjects.append(Subject(label=label, configs=pools, locate=_manifest_locator(label, lane_objects),
                                on_cpu=on_cpu, checkpoint=checkpoint, spec=msvc.spec,
                                lane_names=sorted(lane_objects)))
    return subjects, findings


def _pool_configs(objects: list[dict], msvc: ModelService) -> list[RuntimeConfig]:
    """The rendered runtime.yaml of each pool of `msvc`, the shared pool first."""
    pools: list[tuple[bool, str, RuntimeConfig]] = []
    for obj in objects:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        if (obj.get("kind") != "ConfigMap" or meta.get("namespace") != msvc.namespace
                or labels.get(LABEL_MODEL_SERVICE) != msvc.name or CONFIG_FILE not in (obj.get("data") or {})):
            continue
        pool = labels.get(LABEL_POOL, SHARED_POOL)
        pools.append((pool != SHARED_POOL, pool, loads_config(obj["data"][CONFIG_FILE])))
    return [config for _, _, config in sorted(pools, key=lambda p: (p[0], p[1]))]


# --------------------------------------------------------------------------- reading inputs


@dataclass
class Inputs:
    runtime_files: list[tuple[str, str]] = field(default_factory=list)  # (name, text)
    manifests: list[dict] = field(default_factory=list)
    alert_docs: list[tuple[str, list]] = field(default_factory=list)  # (source, docs)
    invalid: list[Finding] = field(default_factory=list)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckInputError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None


def _yaml_files(raw: str) -> list[Path]:
    path = Path(raw)
    if path.is_dir():
        return [p for p in sorted(path.rglob("*")) if p.suffix in (".yaml", ".yml") and p.is_file()]
    if path.is_file():
        return [path]
    raise CheckInputError(f"{raw}: no such file or directory")


def _add_text(inputs: Inputs, name: str, text: str, *, runtime_hint: bool) -> None:
    """Sort one file's content: a runtime.yaml, manifests, and/or alert rules.

    A file named on its own (`runtime_hint`) is a runtime.yaml unless it holds Kubernetes
    objects or rules; in folders and -f, only a mapping with a `model` key is one."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        if runtime_hint:
            inputs.runtime_files.append((name, text))  # loads_config reports it as an invalid config
        else:
            inputs.invalid.append(Finding("config-invalid", "error", name, "", f"not valid YAML: {exc}",
                                          "fix the YAML syntax"))
        return
    objects = [d for d in docs if isinstance(d, dict) and "kind" in d]
    names = alert_names(docs)
    if names:
        inputs.alert_docs.append((name, docs))
    if objects:
        inputs.manifests += objects
    elif not names and (runtime_hint or (len(docs) == 1 and isinstance(docs[0], dict) and "model" in docs[0])):
        inputs.runtime_files.append((name, text))


def read_files(positional: list[str], filenames: list[str], kustomize_dirs: list[str]) -> Inputs:
    inputs = Inputs()
    for raw in positional:
        for path in _yaml_files(raw):
            _add_text(inputs, str(path), _read_text(path), runtime_hint=not Path(raw).is_dir())
    for raw in filenames:
        if raw == "-":
            _add_text(inputs, "<stdin>", sys.stdin.read(), runtime_hint=False)
            continue
        for path in _yaml_files(raw):
            _add_text(inputs, str(path), _read_text(path), runtime_hint=False)
    for folder in kustomize_dirs:
        _add_text(inputs, f"kustomize {folder}", kubectl_kustomize(folder), runtime_hint=False)
    return inputs


def kubectl_kustomize(folder: str) -> str:
    try:
        done = subprocess.run(["kubectl", "kustomize", folder], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise CheckInputError("-k needs kubectl on PATH (kubectl kustomize); or pass the files with -f") from None
    except subprocess.TimeoutExpired:
        raise CheckInputError(f"kubectl kustomize {folder}: timed out") from None
    if done.returncode != 0:
        raise CheckInputError(f"kubectl kustomize {folder}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def discover_alerts(paths: list[str]) -> Optional[AlertRules]:
    """Alert rules lying next to the inputs (same folder): a PrometheusRule or a Prometheus rules file."""
    folders = []
    for raw in paths:
        if raw == "-":
            continue
        path = Path(raw)
        folder = path if path.is_dir() else path.parent
        if folder not in folders:
            folders.append(folder)
    for folder in folders:
        for candidate in sorted(folder.glob("*.y*ml")):
            if "rule" not in candidate.name:
                continue
            try:
                names = alert_names(yaml.safe_load_all(candidate.read_text()))
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if names:
                return AlertRules(names, str(candidate))
    return None


def read_alert_file(raw: str) -> AlertRules:
    names: set[str] = set()
    for path in _yaml_files(raw):
        try:
            names |= alert_names(yaml.safe_load_all(_read_text(path)))
        except yaml.YAMLError as exc:
            raise CheckInputError(f"{path}: not valid YAML: {exc}") from None
    return AlertRules(names, raw)


# --------------------------------------------------------------------------- reading a namespace


@dataclass
class ClusterObjects:
    manifests: list[dict]
    alerts: Optional[AlertRules]
    alerts_absent_why: str = ""


def read_namespace(namespace: str, context: Optional[str]) -> ClusterObjects:
    """The ModelServices and ServingLanes of `namespace`, and the cluster's PrometheusRules.

    Credentials as kubectl finds them (KUBECONFIG, ~/.kube/config, `--context`), else the
    in-cluster service account (`tokenlane.kube.load`)."""
    try:
        credentials = kube.load(context)
    except kube.CredentialsError as exc:
        if context:
            raise CheckInputError(f"cannot load kubeconfig context {context!r}: {exc}") from None
        raise CheckInputError(str(exc)) from None
    return asyncio.run(_read_namespace(kube.KubeApi(credentials, user_agent="tokenlane-check"), namespace))


async def _read_namespace(api: kube.KubeApi, namespace: str) -> ClusterObjects:
    try:
        return await _read_objects(api, namespace)
    finally:
        await api.close()


async def _read_objects(api: kube.KubeApi, namespace: str) -> ClusterObjects:
    group, version = API_VERSION.split("/")

    async def items(kind: str, plural: str) -> list[dict]:
        try:
            return await api.list(kube.Resource(group, version, plural, kind), namespace)
        except kube.ApiError as exc:
            if exc.reason == "ConnectionError":
                raise CheckInputError(f"cannot reach the Kubernetes API server: {exc.message}") from None
            if exc.status == 404:
                raise CheckInputError(f"the API server has no {kind} kind: are the tokenlane CRDs installed "
                                      "(kubectl apply -k crds/)?") from None
            raise CheckInputError(f"listing {plural} in {namespace}: {exc.status} {exc.reason}: {exc.message}") from None

    manifests = await items(MODEL_SERVICE, "modelservices") + await items(SERVING_LANE, "servinglanes")
    rules = kube.Resource(PROMETHEUS_RULE_GROUP, PROMETHEUS_RULE_VERSION, PROMETHEUS_RULE_PLURAL, "PrometheusRule")
    alerts, absent_why = None, ""
    try:
        try:
            found = await api.list(rules)
            source = "PrometheusRules (all namespaces)"
        except kube.ApiError as exc:
            if exc.status != 403:
                raise
            # Namespaced RBAC: the rules may still be readable where the ModelServices are.
            found = await api.list(rules, namespace)
            source = f"PrometheusRules in {namespace}"
        alerts = AlertRules(alert_names(found), source)
    except kube.ApiError as exc:
        if exc.status == 404:
            absent_why = "the cluster has no PrometheusRule API (no Prometheus Operator)"
        elif exc.status == 403:
            absent_why = "PrometheusRules cannot be listed with these credentials (403)"
        else:
            absent_why = f"listing PrometheusRules failed: {exc.status} {exc.reason}"
    return ClusterObjects(manifests, alerts, absent_why)


# --------------------------------------------------------------------------- the report


@dataclass
class Report:
    checked: list[str]
    findings: list[Finding]

    def counts(self) -> dict[str, int]:
        return {sev: sum(f.severity == sev for f in self.findings) for sev in SEVERITIES}

    def exit_status(self, strict: bool) -> int:
        counts = self.counts()
        return 1 if counts["error"] or (strict and counts["warning"]) else 0

    def to_json(self) -> str:
        return json.dumps({"checked": self.checked, "summary": self.counts(),
                           "findings": [f.to_dict() for f in self.findings]}, indent=2)

    def to_table(self) -> str:
        lines = [f"checked: {', '.join(self.checked) or 'nothing'}"]
        if self.findings:
            header = ("SEVERITY", "RULE", "OBJECT", "KEY")
            rows = [(f.severity, f.rule, f.object, f.key) for f in self.findings]
            widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
            fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
            lines.append(fmt.format(*header))
            indent = " " * (widths[0] + 2)
            for finding, row in zip(self.findings, rows):
                lines.append(fmt.format(*row).rstrip())
                lines.append(f"{indent}{finding.message}")
                lines.append(f"{indent}fix: {finding.fix}")
        counts = self.counts()
        lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info")
        return "\n".join(lines) + "\n"


_SEVERITY_ORDER = {sev: i for i, sev in enumerate(SEVERITIES)}


def _dedupe_sorted(findings: Iterable[Finding], skip: set[str]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        ident = (f.rule, f.object, f.key, f.message)
        if f.rule in skip or ident in seen:
            continue
        seen.add(ident)
        out.append(f)
    return sorted(out, key=lambda f: (_SEVERITY_ORDER[f.severity], f.object, f.rule, f.key))


def check_inputs(inputs: Inputs, *, alerts: Optional[AlertRules], checkpoint: Optional[Checkpoint],
                 alerts_absent_why: str = "", skip: Iterable[str] = ()) -> Report:
    findings = list(inputs.invalid)
    checked: list[str] = []
    operator = False
    for name, text in inputs.runtime_files:
        checked.append(name)
        try:
            config = loads_config(text)
        except ConfigError as exc:
            findings.append(Finding("config-invalid", "error", name, "", str(exc),
                                    "fix the key named in the message (tokenlane serve refuses this file)"))
            continue
        findings += check_subject(subject_from_runtime_yaml(name, config, checkpoint))
    if inputs.manifests:
        subjects, invalid = subjects_from_manifests(inputs.manifests, checkpoint)
        findings += invalid
        checked += [s.label for s in subjects] + sorted({f.object for f in invalid if f.object.startswith(MODEL_SERVICE)})
        for subject in subjects:
            operator = True
            findings += check_subject(subject)
    findings += check_alerts(alerts, operator=operator, absent_why=alerts_absent_why)
    return Report(checked, _dedupe_sorted(findings, set(skip)))


def run_check(args: argparse.Namespace) -> Report:
    checkpoint = read_checkpoint(Path(args.checkpoint)) if args.checkpoint else None
    alerts = read_alert_file(args.alerts) if args.alerts else None
    if args.namespace:
        live = read_namespace(args.namespace, args.context)
        inputs = Inputs(manifests=live.manifests)
        if not live.manifests:
            raise CheckInputError(f"no ModelService or ServingLane in namespace {args.namespace}")
        absent_why = ""
        if alerts is None:
            alerts, absent_why = live.alerts, live.alerts_absent_why
    else:
        inputs = read_files(args.config, args.filename or [], args.kustomize or [])
        ours = [d for d in inputs.manifests if _is_ours(d, MODEL_SERVICE) or _is_ours(d, SERVING_LANE)]
        if not (inputs.runtime_files or ours or inputs.invalid):
            raise CheckInputError(f"nothing to check: no runtime.yaml, {MODEL_SERVICE} or {SERVING_LANE} "
                                  f"({API_VERSION}) in the input")
        absent_why = ""
        if alerts is None:
            found = [AlertRules(alert_names(docs), source) for source, docs in inputs.alert_docs]
            if found:
                alerts = AlertRules(set().union(*(a.names for a in found)), ", ".join(a.source for a in found))
            else:
                alerts = discover_alerts(list(args.config) + list(args.filename or []))
    return check_inputs(inputs, alerts=alerts, checkpoint=checkpoint, alerts_absent_why=absent_why,
                        skip=args.skip or ())


EPILOG = """\
examples:
  tokenlane check runtime.yaml
  tokenlane check -f manifests/samples/llama3-8b.yaml --alerts manifests/monitoring/prometheusrule.yaml
  tokenlane check -k manifests/samples -o json
  tokenlane check -n tokenlane --context prod --strict
  tokenlane check -f ms.yaml -f lanes.yaml --checkpoint /models/llama-3.1-8b-instruct

exit status: 0 no error (warnings allowed unless --strict), 1 errors (or warnings with
--strict), 2 the input cannot be read. Rules: docs/check.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenlane check", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Lint a runtime.yaml, ModelService/ServingLane manifests or a namespace's live objects\n"
                    "against the go-live checklist: max model length, watermarks, chunked prefill, lane\n"
                    "classes, SLOs, queue timeouts, KV pool budgets, tenants' keys, alert rules.")
    parser.add_argument("config", nargs="*", metavar="RUNTIME_YAML",
                        help="runtime.yaml file(s) (manifests are recognised too)")
    parser.add_argument("-f", "--filename", action="append", metavar="FILE",
                        help="ModelService/ServingLane YAML file or folder (recursive); '-' reads stdin; repeatable")
    parser.add_argument("-k", "--kustomize", action="append", metavar="DIR",
                        help="kustomization folder (runs kubectl kustomize); repeatable")
    parser.add_argument("-n", "--namespace", help="check the live ModelServices and ServingLanes of this namespace")
    parser.add_argument("--context", help="kubeconfig context for -n (default: the current one)")
    parser.add_argument("--alerts", metavar="FILE", help="Prometheus rules file or PrometheusRule manifest (file or "
                                                         "folder) to check for the needed alerts; default: found in "
                                                         "the input or next to it")
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint folder whose config.json gives the model's "
                                                            "dimensions (KV pool size on CPU, max_position_embeddings)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table",
                        help="a table for people (default) or JSON for machines")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    parser.add_argument("--skip", action="append", metavar="RULE", help="do not report this rule; repeatable")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sources = bool(args.config or args.filename or args.kustomize)
    if sources == bool(args.namespace):
        parser.print_usage(sys.stderr)
        print("tokenlane check: give either files (runtime.yaml, -f, -k) or -n NAMESPACE", file=sys.stderr)
        return 2
    if args.context and not args.namespace:
        print("tokenlane check: --context goes with -n", file=sys.stderr)
        return 2
    unknown = sorted(set(args.skip or ()) - set(RULES))
    if unknown:
        print(f"tokenlane check: unknown rule(s) {unknown} in --skip; rules: {', '.join(RULES)}", file=sys.stderr)
        return 2
    try:
        report = run_check(args)
    except CheckInputError as exc:
        print(f"tokenlane check: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(report.to_json() + "\n" if args.output == "json" else report.to_table())
    return report.exit_status(args.strict)


if __name__ == "__main__":
    sys.exit(main())
