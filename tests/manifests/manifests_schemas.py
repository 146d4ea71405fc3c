"""Validating custom resources the way the API server would: structural schema (with
defaults applied) via jsonschema, then the CRD's CEL rules (x-kubernetes-validations) via
cel-python. Kept independent of operator/api/schema.py on purpose: these tests check the CRDs
as rendered into the manifests, whatever produced them."""

from __future__ import annotations

import copy
from typing import Any, Iterator

import jsonschema


def openapi_schema(crd: dict, version: str) -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd['metadata']['name']} has no version {version}")


def apply_defaults(schema: dict, value: Any) -> Any:
    """Fill `default`s of absent properties of present objects (API server semantics)."""
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    if isinstance(schema.get("additionalProperties"), dict):
        sub = schema["additionalProperties"]
        out = {k: (v if k in schema.get("properties", {}) else apply_defaults(sub, v)) for k, v in out.items()}
    return out


def to_jsonschema(schema: dict) -> dict:
    """A structural (OpenAPI v3) schema as JSON Schema; unknown fields are refused, where the
    API server would silently prune them (a typo in a manifest is a bug worth failing on)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default", "format", "nullable", "example"):
            continue
        if key == "properties":
            out[key] = {k: to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_jsonschema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_jsonschema(v) for v in value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            continue
        else:
            out[key] = value
    if schema.get("exclusiveMinimum") is True and "minimum" in out:
        out["exclusiveMinimum"] = out.pop("minimum")
    if schema.get("exclusiveMaximum") is True and "maximum" in out:
        out["exclusiveMaximum"] = out.pop("maximum")
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], **out}
    if (schema.get("type") == "object" and "properties" in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in schema):
        out["additionalProperties"] = False
    return out


def _cel_rules(schema: dict, value: Any, path: str) -> Iterator[tuple[str, dict, Any]]:
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _cel_rules(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _cel_rules(schema["items"], item, f"{path}[{i}]")


def validate_custom_resource(obj: dict, crd: dict) -> list[str]:
    """Every problem the API server would report for `obj` (empty when valid)."""
    version = obj["apiVersion"].split("/")[1]
    schema = copy.deepcopy(openapi_schema(crd, version))
    # The API server accepts these at the root of every object, declared or not.
    schema.setdefault("properties", {})
    for key in ("apiVersion", "kind"):
        schema["properties"].setdefault(key, {"type": "string"})
    schema["properties"].setdefault("metadata", {"type": "object"})
    body = {k: v for k, v in obj.items() if k != "metadata"}
    # CEL rules see only metadata.name and metadata.generateName, as on the API server.
    body["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k in ("name", "generateName")}
    defaulted = apply_defaults(schema, body)
    validator = jsonschema.Draft7Validator(to_jsonschema(schema))
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in validator.iter_errors(defaulted)]
    if problems:
        return problems
    import celpy

    env = celpy.Environment()
    for path, rule, value in _cel_rules(schema, defaulted, ""):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules need a previous object
        program = env.program(env.compile(rule["rule"]))
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as exc:  # the API server reports these as invalid too
            result = exc
        if isinstance(result, Exception) or not bool(result):
            problems.append(f"{path or '<root>'}: {rule.get('message') or rule['rule']}")
    return problems
