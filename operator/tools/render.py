"""`tokenlane render -f FILE_OR_DIR`: print the objects the operator would create, no cluster.

Reads ModelService / ServingLane documents (other kinds are ignored) from YAML files, runs
the same parse -> build path as the operator, and prints the desired objects as one YAML
multi-document stream (for review and GitOps diffs). Owner references need the ModelService's
uid and are omitted unless the input carries metadata.uid. Lanes the operator would refuse
are reported on stderr and the exit status is 1; an invalid ModelService exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, Optional

import yaml

from tokenlane.operator.desired import builders
from tokenlane.operator.api.resources import API_VERSION, ModelService, ServingLane, parse_model_service, parse_serving_lane


def read_documents(paths: Iterable[str]) -> list[dict]:
    docs: list[dict] = []
    for raw in paths:
        path = Path(raw)
        if raw == "-":
            files_text = [("<stdin>", sys.stdin.read())]
        elif path.is_dir():
            files_text = [(str(p), p.read_text()) for p in sorted(path.rglob("*")) if p.suffix in (".yaml", ".yml")]
        elif path.is_file():
            files_text = [(str(path), path.read_text())]
        else:
            raise ValueError(f"{raw}: no such file or directory")
        for name, text in files_text:
            try:
                docs += [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
            except yaml.YAMLError as exc:
                raise ValueError(f"{name}: not valid YAML: {exc}") from None
    return docs


def render_documents(docs: list[dict], *, service_monitor: bool = False, namespace: Optional[str] = None
                     ) -> tuple[list[dict], dict[str, str]]:
    """(objects, problems): problems maps 'Kind namespace/name' to why it is not rendered/served."""
    services: list[ModelService] = []
    lanes: list[ServingLane] = []
    problems: dict[str, str] = {}
    for doc in docs:
        if doc.get("apiVersion") != API_VERSION or doc.get("kind") not in ("ModelService", "ServingLane"):
            continue
        if namespace:
            doc = {**doc, "metadata": {**(doc.get("metadata") or {}), "namespace": namespace}}
        meta = doc.get("metadata") or {}
        label = f"{doc['kind']} {meta.get('namespace') or 'default'}/{meta.get('name')}"
        try:
            if doc["kind"] == "ModelService":
                services.append(parse_model_service(doc))
            else:
                lanes.append(parse_serving_lane(doc))
        except ValueError as exc:
            problems[label] = str(exc)
    objects: list[dict] = []
    known = {(m.namespace, m.name) for m in services}
    for lane in lanes:
        if (lane.ref.namespace, lane.parent) not in known:
            problems[f"ServingLane {lane.ref.namespace}/{lane.ref.name}"] = (
                f"ModelService {lane.parent!r} not found in namespace {lane.ref.namespace}")
    for msvc in services:
        mine = [l for l in lanes if l.ref.namespace == msvc.namespace and l.parent == msvc.name]
        try:
            desired = builders.build(msvc, mine, overrides=builders.Overrides.from_status(msvc.status),
                                     service_monitor_available=service_monitor)
        except ValueError as exc:
            problems[f"ModelService {msvc.namespace}/{msvc.name}"] = str(exc)
            continue
        for lane_name, why in desired.rejected.items():
            problems[f"ServingLane {msvc.namespace}/{lane_name}"] = why
        objects += desired.objects
    return objects, problems


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (runtime.yaml in ConfigMaps) as readable literal blocks."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data and not any(line != line.rstrip() for line in data.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump_objects(objects: list[dict]) -> str:
    return "".join("---\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenlane render",
                                     description="Print the Kubernetes objects the operator would create for "
                                                 "ModelService/ServingLane manifests, without a cluster.")
    parser.add_argument("-f", "--filename", action="append", required=True,
                        help="YAML file or folder (recursive) of manifests; '-' reads stdin; repeatable")
    parser.add_argument("-n", "--namespace", help="override metadata.namespace of every input object")
    parser.add_argument("--service-monitor", action="store_true",
                        help="render ServiceMonitors, as when the Prometheus Operator's CRD exists")
    args = parser.parse_args(argv)
    try:
        docs = read_documents(args.filename)
    except ValueError as exc:
        print(f"tokenlane render: {exc}", file=sys.stderr)
        return 2
    objects, problems = render_documents(docs, service_monitor=args.service_monitor, namespace=args.namespace)
    sys.stdout.write(dump_objects(objects))
    for label, why in problems.items():
        print(f"tokenlane render: {label}: {why}", file=sys.stderr)
    if any(label.startswith("ModelService") for label in problems):
        return 2
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
