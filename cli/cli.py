"""The `tokenlane` console script: one subcommand per tool, each owning its own flags.

Subcommand modules are imported lazily so that `tokenlane operator` and `tokenlane render`
never import torch (the operator image does not ship it).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module exposing `main(argv: list[str]) -> int | None`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tokenlane.runtime.entrypoints.server", "start the OpenAI-compatible runtime server"),
    "router": ("tokenlane.runtime.fleet.router", "route requests across replicas by lane, load and prefix"),
    "operator": ("tokenlane.operator.main", "run the Kubernetes operator (kopf)"),
    "render": ("tokenlane.operator.tools.render", "print the objects the operator would create"),
    "check": ("tokenlane.operator.tools.check", "lint a runtime.yaml or ModelService/ServingLanes for going live"),
    "bench": ("tokenlane.bench.cli", "load generator, simulator and report"),
    "plan": ("tokenlane.bench.plan", "lane budgets and replicas for your own traffic, in the simulator"),
    "demo": ("tokenlane.bench.demo", "the embedded demo: tiny model, three lanes"),
    "fetch-model": ("tokenlane.runtime.sources.fetch", "fetch a model (Hugging Face Hub, S3, a folder) into a shared cache"),
    "make-tiny-model": ("tokenlane.runtime.executor.tiny_model", "write a small random-weight checkpoint"),
}


def _usage() -> str:
    lines = ["usage: tokenlane <command> [options]", "", "commands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<16} {text}")
    lines.append("")
    lines.append("Run `tokenlane <command> --help` for the options of one command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from tokenlane import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tokenlane: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
