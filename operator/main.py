"""`tokenlane operator`: run the kopf operator for ModelService and ServingLane.

    tokenlane operator [--namespace NS ... | --all-namespaces]
                       [--peering NAME | --standalone] [--priority N]
                       [--liveness URL] [--metrics-port N] [--log-format json|plain] [--verbose]
                       [--tuning-tick-seconds S] [--autoscaling-tick-seconds S]

Login: in-cluster service account, else KUBECONFIG / ~/.kube/config (client certificates, tokens,
exec credential plugins), read by `tokenlane.kube.load`; kopf's watches and the executor use the
same login.
Peering: with --peering (default "tokenlane") every instance writes keep-alives into kopf's
KopfPeering object of that name (ClusterKopfPeering with --all-namespaces; CRDs in crds/), and
an instance that sees a live peer with a higher --priority pauses until that peer is gone
(how `kopf run --dev` or `kopf freeze` take over safely). This is not leader election: two
instances of equal priority both keep running, which is why the Deployment in manifests/ runs
one replica with the Recreate strategy (docs/operations.md, "One operator at a time").
kopf waits, silently, for a peering object that does not exist; so before starting, the
operator looks for it and, where it is missing, says so at info level and runs standalone
(right for a single operator, e.g. on a laptop against a fresh cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import math
import sys
from typing import Any, Optional

import kopf

from tokenlane import kube
from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.controllers import scaling, tuning
from tokenlane.operator.controllers.handlers import Operator, register

log = logging.getLogger("tokenlane.operator")


def load_credentials() -> kube.Credentials:
    """The operator's identity: its pod's service account, else the kubeconfig."""
    try:
        return kube.load(prefer_in_cluster=True)
    except kube.CredentialsError as exc:
        raise kopf.LoginError(str(exc)) from None


async def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's login: the credentials of `load_credentials`, with the current token (a rotated
    service account token, an exec plugin's answer). kopf logs in again on a 401 and when an
    exec credential expires."""
    creds = load_credentials()
    auth = kube.Authenticator(creds)
    try:
        await auth.authorization()
    except kube.CredentialsError as exc:
        raise kopf.LoginError(str(exc)) from None
    token = auth.token
    cert, key = auth.exec_certificate or (creds.cert_data, creds.key_data)
    expires = auth.expires_at
    return kopf.ConnectionInfo(
        server=creds.server,
        ca_path=str(creds.ca_file) if creds.ca_file else None,
        ca_data=creds.ca_data.decode() if creds.ca_data else None,
        insecure=creds.insecure or None,
        token=token, username=creds.username, password=creds.password,
        certificate_path=None if auth.exec_certificate or not creds.cert_file else str(creds.cert_file),
        certificate_data=cert.decode() if cert else None,
        private_key_path=None if auth.exec_certificate or not creds.key_file else str(creds.key_file),
        private_key_data=key.decode() if key else None,
        default_namespace=creds.namespace,
        expiration=datetime.datetime.fromtimestamp(expires, datetime.timezone.utc) if expires else None,
    )


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
    # A run starts at most one tick after its interval is due; each tick reads the ModelService
    # once (Prometheus is queried once per interval, whatever the tick).
    parser.add_argument("--tuning-tick-seconds", type=positive_seconds, default=tuning.TICK_S, metavar="S",
                        help="how often the tuning timer checks whether each ModelService's spec.tuning.interval "
                             "has passed (default %(default)g; shorter: runs closer to their interval, one "
                             "ModelService read per tick each)")
    parser.add_argument("--autoscaling-tick-seconds", type=positive_seconds, default=scaling.TICK_S, metavar="S",
                        help="the same for spec.autoscaling.interval, for the ModelServices with autoscaling "
                             "enabled (default %(default)g)")
    args = parser.parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        parser.error("choose the scope: --namespace NS (repeatable) or --all-namespaces")
    return args


def positive_seconds(text: str) -> float:
    """argparse type of the timer ticks: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def operator_registry(args: argparse.Namespace) -> tuple[kopf.OperatorRegistry, Operator, tuning.Tuning]:
    """The handlers and timers of one operator process, with the timer ticks of `args`."""
    op = Operator(autoscaling=scaling.Autoscaling(tick_s=args.autoscaling_tick_seconds))
    registry = register(kopf.OperatorRegistry(), op, login=login)
    # the rollout guard and SLO tuner timer
    t = tuning.register(registry, op, tuning=tuning.Tuning(op, tick_s=args.tuning_tick_seconds))
    return registry, op, t


def start_metrics_server(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
        log.info("operator metrics on :%d/metrics", port)


async def missing_peering(args: argparse.Namespace) -> Optional[str]:
    """Why the peering object of `args` cannot be used (None: it exists everywhere it must).

    Namespace globs are not resolved here: kopf follows them, so they are taken as they are."""
    resource = k8s.CLUSTER_KOPF_PEERINGS if args.all_namespaces else k8s.KOPF_PEERINGS
    kind, plural = resource.kind, resource.plural
    namespaces = [None] if args.all_namespaces else [ns for ns in args.namespace if not any(c in ns for c in "*?[!")]
    client = k8s.KubeClient(load_credentials())
    try:
        for namespace in namespaces:
            where = f"namespace {namespace!r}" if namespace else "the cluster"
            try:
                found = await client.list(resource, namespace)
            except k8s.ApiError as exc:
                if exc.status == 404:
                    return f"the {kind} CRD is not installed (kubectl apply -k crds/)"
                if exc.status == 403:
                    return f"this account may not list {plural} in {where} (RBAC: list, watch, patch on kopf.dev {plural})"
                raise
            if not any(o["metadata"]["name"] == args.peering for o in found):
                return f"no {kind} named {args.peering!r} in {where}"
    finally:
        await client.close()
    return None


def choose_peering(args: argparse.Namespace) -> None:
    """Use --peering when its object exists; otherwise say why at info level and run standalone."""
    if args.standalone:
        log.info("peering: off (--standalone); make sure this is the only operator for its namespaces")
        return
    kind = "ClusterKopfPeering" if args.all_namespaces else "KopfPeering"
    try:
        problem = asyncio.run(missing_peering(args))
    except Exception as exc:  # the API is not reachable yet: kopf retries and reports it
        log.info("peering: could not check for %s %r (%s); using it as configured", kind, args.peering, exc)
        return
    if problem is None:
        log.info("peering: %s %r (instances with a higher --priority take over)", kind, args.peering)
        return
    log.info("peering: %s, so this operator runs standalone (fine for a single operator). To let several "
             "instances coordinate, create it (manifests/overlays/*/peering.yaml, or: kubectl apply -f - with "
             "apiVersion: kopf.dev/v1, kind: %s, metadata.name: %s) and restart; --standalone skips this check.",
             problem, kind, args.peering)
    args.standalone = True


def run(args: argparse.Namespace, stop_flag: Optional[asyncio.Event] = None) -> None:
    kopf.configure(verbose=args.verbose,
                   log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN)
    start_metrics_server(args.metrics_port)
    choose_peering(args)
    registry, _, _ = operator_registry(args)

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
