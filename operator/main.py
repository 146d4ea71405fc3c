"""`tokenlane operator`: run the kopf operator for ModelService and ServingLane.

    tokenlane operator [--namespace NS ... | --all-namespaces]
                       [--peering NAME | --standalone] [--priority N]
                       [--liveness URL] [--metrics-port N] [--log-format json|plain] [--verbose]

Login: in-cluster service account, else KUBECONFIG / ~/.kube/config, through the official
`kubernetes` client (kopf's piggybacking); the executor reuses kopf's credentials.
Peering: with --peering (default "tokenlane") every instance writes keep-alives into kopf's
KopfPeering object of that name (ClusterKopfPeering with --all-namespaces; CRDs in crds/), and
an instance that sees a live peer with a higher --priority pauses until that peer is gone
(how `kopf run --dev` or `kopf freeze` take over safely). This is not leader election: two
instances of equal priority both keep running, which is why the Deployment in manifests/ runs
one replica with the Recreate strategy (docs/operations.md, "One operator at a time").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any, Optional

import kopf

from tokenlane.operator import tuning
from tokenlane.operator.handlers import Operator, register

log = logging.getLogger("tokenlane.operator")


def login(**kwargs: Any) -> Any:
    """In-cluster service account or kubeconfig (exec / auth-provider plugins included) through
    the official client; kopf's own readers when that client is not installed."""
    info = kopf.login_via_client(**kwargs)
    if info is None:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no credentials: neither a service account nor a kubeconfig was found")
    return info


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenlane operator", description="Run the tokenlane Kubernetes operator.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peering", default="tokenlane", help="kopf peering object: instances pause while a higher-priority peer runs")
    peer.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this instance (the highest live one runs)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL served by kopf ('' to disable)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 to disable)")
    parser.add_argument("--log-format", choices=("json", "plain"), default="json")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        parser.error("choose the scope: --namespace NS (repeatable) or --all-namespaces")
    return args


def start_metrics_server(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
        log.info("operator metrics on :%d/metrics", port)


def run(args: argparse.Namespace, stop_flag: Optional[asyncio.Event] = None) -> None:
    kopf.configure(verbose=args.verbose,
                   log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN)
    start_metrics_server(args.metrics_port)
    op = Operator()
    registry = register(kopf.OperatorRegistry(), op, login=login)
    tuning.register(registry, op)  # issue 7: the rollout guard and SLO tuner timer

    @kopf.on.startup(registry=registry)
    def peering_settings(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.peering.mandatory = not args.standalone
        settings.peering.clusterwide = bool(args.all_namespaces)

    asyncio.run(kopf.operator(
        registry=registry,
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespace,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness or None,
        stop_flag=stop_flag,
    ))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
