"""`tokenlane bench`: drive an endpoint, simulate at scale, compare configurations.

    tokenlane bench run --url http://127.0.0.1:8000 --traffic traffic.yaml
    tokenlane bench simulate --scenario continuous-vs-static
    tokenlane bench simulate --config runtime.yaml --traffic traffic.yaml --phase static:engine.continuousBatching=false
    tokenlane bench simulate --scenario lanes-kv-flood --set engine.kvCacheDtype=fp8_e4m3
    tokenlane bench compare --config runtime.yaml --traffic traffic.yaml \\
        --phase continuous --phase static:engine.continuousBatching=false
    tokenlane bench report --steps steps.jsonl
    tokenlane bench fleet --scenario routing    # or: --scenario burst / ramp (autoscaler vs fixed sizes)

`run`, `simulate`, `compare` and `fleet` print the table (and ratios between phases) and write
<out>/<stem>.json and <out>/<stem>.png; `report` draws flight recorder steps (docs/operations.md)
as a timeline PNG. Traffic comes from a YAML spec (keys of trace.TrafficSpec) or the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from tokenlane.bench import report, scenarios
from tokenlane.bench.trace import LaneMix, TrafficSpec, build_requests, load_spec


def _traffic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic (ignored with --traffic, except --seed)")
    g.add_argument("--traffic", help="traffic spec YAML (trace.TrafficSpec keys)")
    g.add_argument("--source", choices=["trace", "synthetic"], default="synthetic")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    g.add_argument("--rate", type=float, default=2.0, help="synthetic: requests/s (Poisson)")
    g.add_argument("--time-scale", type=float, default=None, help="trace: speed-up factor")
    g.add_argument("--target-rate", type=float, default=None, help="trace: scale time to this mean rate")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt/output lengths")
    g.add_argument("--max-prompt-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None)
    g.add_argument("--lane", action="append", default=[], metavar="NAME[:SHARE[:PROMPT[:OUTPUT]]]",
                   help="traffic class, e.g. interactive:0.7:short:short (repeatable; default: router decides)")
    g.add_argument("--stream-share", type=float, default=1.0)
    g.add_argument("--cancel-share", type=float, default=0.0)
    g.add_argument("--deadline-share", type=float, default=0.0)
    g.add_argument("--deadline-ms", type=float, default=10000.0)
    g.add_argument("--max-requests", type=int, default=None)


def _lane_mix(text: str) -> LaneMix:
    parts = text.split(":")
    mix = LaneMix(lane=parts[0] or None)
    if len(parts) > 1:
        mix.share = float(parts[1])
    if len(parts) > 2:
        mix.prompt = parts[2]
    if len(parts) > 3:
        mix.output = parts[3]
    return mix


def spec_from_args(args: argparse.Namespace) -> TrafficSpec:
    if args.traffic:
        spec = load_spec(args.traffic)
        if args.seed is not None:
            spec.seed = args.seed
        return spec
    return TrafficSpec(
        source=args.source,
        seed=args.seed or 0,
        duration_s=args.duration,
        max_requests=args.max_requests,
        rate_rps=args.rate,
        time_scale=args.time_scale,
        target_rate_rps=args.target_rate,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        lanes=[_lane_mix(x) for x in args.lane] or [LaneMix(lane=None)],
        stream_share=args.stream_share,
        cancel_share=args.cancel_share,
        deadline_share=args.deadline_share,
        deadline_ms=args.deadline_ms,
    )


def _phase_spec(text: str) -> tuple[str, list[str]]:
    """'static:engine.continuousBatching=false,scheduler.policy=mixed' -> name, overrides."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"phase {text!r} needs a name")
    return name, [o for o in rest.split(",") if o]


def _patched(config_data: dict, overrides: list[str]) -> dict:
    from tokenlane.bench.serve_proc import parse_override, set_path

    data = copy.deepcopy(config_data)
    for o in overrides:
        key, value = parse_override(o)
        set_path(data, key, value)
    return data


def _finish(out: Path, stem: str, results: list[report.RunResult], meta: dict, title: str,
            include_records: bool = True, ratios: bool = True, show_traffic: bool = True) -> None:
    text, json_path, png = report.write_all(out, stem, results, meta, title, include_records)
    if not ratios:  # the caller prints its own headline ratios
        text = report.format_table([report.summarize(r) for r in results])
    if show_traffic and results and results[0].description:
        print(f"traffic: {results[0].description}")
    print(text)
    for r in results:
        if r.extra:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.extra.items()}
            print(f"{r.name}: {json.dumps(shown)}")
    print(f"\nwrote {json_path} and {png}")


# --------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from tokenlane.bench.loadgen import Target, run_load

    spec = spec_from_args(args)
    traffic = build_requests(spec)
    print(f"traffic: {traffic.describe()}")
    slos = _slos_from_file(args.config) if args.config else {}
    target = Target(args.url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                    prompt_mode=args.prompt_mode, send_ignore_eos=not args.no_ignore_eos)
    result = asyncio.run(run_load(target, traffic, args.name, slos=slos, max_requests=args.max_requests or 10_000,
                                  time_limit_s=args.time_limit, progress=not args.no_progress))
    _finish(Path(args.out), args.stem or "bench-run", [result], {"command": "run", "spec": spec.to_dict()},
            f"tokenlane bench run against {args.url}", show_traffic=False)  # printed above
    return 0


def _slos_from_file(path: str) -> dict[str, report.LaneSLO]:
    from tokenlane.runtime.config import load_config

    return report.slos_from_config(load_config(path))


# --------------------------------------------------------------------------- simulate


def _scenario_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The traffic flags a named scenario takes over its own defaults (given ones only)."""
    kwargs: dict[str, Any] = {}
    if args.time_scale is not None:
        kwargs["time_scale"] = args.time_scale
    if args.duration_set:
        kwargs["duration_s"] = args.duration
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return kwargs


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenlane.bench.sim import simulate

    t0 = time.perf_counter()
    if args.scenario:
        scenario = scenarios.SCENARIOS[args.scenario](**_scenario_overrides(args))
        phases = scenario.phases
        title, stem = scenario.title, args.stem or f"sim-{scenario.name}"
        pairs = scenario.ratio_pairs
    else:
        if not args.config:
            print("tokenlane bench simulate: give --scenario or --config", file=sys.stderr)
            return 2
        from tokenlane.runtime.config import RuntimeConfig

        base = yaml.safe_load(Path(args.config).read_text())
        base.setdefault("engine", {})["executor"] = "simulated"
        traffic = build_requests(spec_from_args(args))
        specs = [_phase_spec(p) for p in args.phase] or [("sim", [])]
        phases = [scenarios.Phase(name, RuntimeConfig.from_dict(_patched(base, ov)), traffic) for name, ov in specs]
        title, stem, pairs = f"simulated: {args.config}", args.stem or "sim", []
    if args.set:
        phases = [dataclasses.replace(ph, config=_with_overrides(ph.config, args.set)) for ph in phases]
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenlane-bench-lora-") as lora_root:
        if args.lora_adapters:
            phases = _with_lora(phases, args.lora_adapters, args.lora_rank, Path(lora_root), args.seed or 0)
        for ph in phases:
            results.append(simulate(ph.config, ph.traffic, ph.name, progress=not args.no_progress, slos=ph.slos))
    wall = time.perf_counter() - t0
    meta = {"command": "simulate", "scenario": args.scenario, "wall_seconds": wall, "set": args.set,
            "phase_traffic": {ph.name: ph.traffic.describe() for ph in phases}}
    out = Path(args.out)
    _finish(out, stem, results, meta, title, include_records=args.records, ratios=not pairs)
    if pairs:
        summaries = {s["name"]: s for s in (report.summarize(r) for r in results)}
        print(format_pairs(summaries, pairs))
    print(f"simulated {sum(len(ph.traffic.requests) for ph in phases)} requests in {wall:.1f} s wall")
    return 0


def _with_lora(phases: list, count: int, rank: int, root: Path, seed: int) -> list:
    """Every phase serving `count` LoRA adapters of rank `rank`, its requests spread over them."""
    from tokenlane.bench import lora_cost as lora

    if count < 1:
        raise SystemExit(f"--lora-adapters must be >= 1, got {count}")
    names = lora.adapter_names(count)
    return [dataclasses.replace(ph, config=lora.with_adapters(ph.config, names, rank, root / ph.name),
                                traffic=lora.spread_over_adapters(ph.traffic, names, seed)) for ph in phases]


def _with_overrides(config, overrides: list[str]):
    """`config` with `section.key=value` overrides (camelCase keys, YAML values) applied."""
    from tokenlane.runtime.config import RuntimeConfig

    return RuntimeConfig.from_dict(_patched(config.to_dict(), overrides))


def format_pairs(summaries: dict[str, dict], pairs: list[tuple[str, str]]) -> str:
    lines = ["headline ratios:"]
    for a, b in pairs:
        sa, sb = summaries[a], summaries[b]
        for lane in ["all"] + sorted(set(sa["lanes"]) & set(sb["lanes"])):
            da = sa["all"] if lane == "all" else sa["lanes"][lane]
            db = sb["all"] if lane == "all" else sb["lanes"][lane]
            g = report.ratio(da["goodput_rps"], db["goodput_rps"])
            t = report.ratio(da["ttft_s"]["p95"], db["ttft_s"]["p95"])
            lines.append(
                f"  {a} vs {b} [{lane}]: goodput {'-' if g is None else f'{g:.2f}x'} "
                f"({da['goodput_rps']:.2f} vs {db['goodput_rps']:.2f} req/s), TTFT p95 "
                f"{'-' if t is None else f'{t:.2f}x'} ({report._ms(da['ttft_s']['p95'])} vs {report._ms(db['ttft_s']['p95'])} ms)"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- fleet


def _fleet_phases(args: argparse.Namespace):
    """(experiment, config) for `bench fleet`: a named experiment, or --config + traffic flags."""
    from tokenlane.bench import fleet_sim

    if args.scenario:
        experiment = fleet_sim.FLEET_EXPERIMENTS[args.scenario](**_scenario_overrides(args))
    else:
        traffic = build_requests(spec_from_args(args))
        experiment = fleet_sim.FleetExperiment(
            name="fleet", title="simulated fleet", traffic=traffic, system_prompts=fleet_sim.SystemPrompts(),
            replicas=4, policies=fleet_sim.POLICIES)
    if args.config:
        from tokenlane.runtime.config import RuntimeConfig

        data = yaml.safe_load(Path(args.config).read_text())
        data.setdefault("engine", {})["executor"] = "simulated"
        config = RuntimeConfig.from_dict(data)
    else:
        config = fleet_sim.fleet_config()
    prompts = experiment.system_prompts
    overrides = {k: v for k, v in (("count", args.system_prompts), ("tokens", args.system_prompt_tokens),
                                   ("share", args.system_prompt_share), ("zipf", args.system_prompt_zipf))
                 if v is not None}
    if overrides:
        prompts = fleet_sim.SystemPrompts(**{**dataclasses.asdict(prompts), **overrides})
    changes: dict[str, Any] = {"system_prompts": prompts}
    if args.replicas is not None:
        changes["replicas"] = args.replicas
    if args.policy is not None:
        changes["policies"] = fleet_sim.POLICIES if args.policy == "both" else (args.policy,)
    if args.autoscale is not None:
        changes["autoscale"] = args.autoscale
    if args.min_replicas is not None:
        changes["min_replicas"] = args.min_replicas
    if args.max_replicas is not None:
        changes["max_replicas"] = args.max_replicas
    if args.fixed_sizes is not None:
        changes["fixed_sizes"] = tuple(int(x) for x in args.fixed_sizes.split(",") if x.strip())
    return dataclasses.replace(experiment, **changes), config


def _fleet_scaling(args: argparse.Namespace, experiment, config):
    """The autoscaler's settings for `bench fleet --autoscale`: fleet_sim.default_scaling_policy,
    with the knobs and windows that flags override."""
    from tokenlane.bench import fleet_sim

    knobs = {name: getattr(args, name) for name in ("running_share_target", "headroom_replicas", "target_utilization")
             if getattr(args, name) is not None}
    if knobs.get("running_share_target") == RUNNING_SIGNAL_OFF:
        knobs["running_share_target"] = None
    policy = fleet_sim.default_scaling_policy(config, experiment.min_replicas, experiment.max_replicas,
                                              args.scale_attainment_target, **knobs)
    down = experiment.scale_down_stabilization_s if args.scale_down_stabilization is None \
        else args.scale_down_stabilization
    return fleet_sim.AutoscaleSettings(
        policy=dataclasses.replace(policy, scale_down_stabilization_s=down), interval_s=args.scale_interval,
        window_s=args.scale_window, startup_delay_s=args.startup_delay, settle_s=args.settle)


def cmd_fleet(args: argparse.Namespace) -> int:
    from tokenlane.runtime.fleet import pick as fleet_pick
    from tokenlane.bench import fleet_sim

    t0 = time.perf_counter()
    experiment, config = _fleet_phases(args)
    affinity = fleet_pick.PickPolicy(affinity_slack=args.affinity_slack)
    runs: list[tuple[str, Any]] = []

    def run(name: str, policy: str, replicas: int, autoscale=None) -> None:
        result = fleet_sim.simulate_fleet(config, experiment.traffic, name=name, replicas=replicas, policy=policy,
                                          system_prompts=experiment.system_prompts, autoscale=autoscale,
                                          affinity=affinity)
        runs.append((name, result))
        if not args.no_progress:
            print(f"  {name}: done ({time.perf_counter() - t0:.0f} s wall so far)", file=sys.stderr)

    if experiment.autoscale:
        if len(experiment.policies) != 1:
            raise ValueError("--autoscale runs one pick policy: give --policy router or --policy round-robin")
        policy = experiment.policies[0]
        run("autoscale", policy, experiment.replicas, _fleet_scaling(args, experiment, config))
        for size in experiment.fixed_sizes:
            run(f"fixed-{size}", policy, size)
    else:
        for policy in experiment.policies:
            run(policy, policy, experiment.replicas)
    wall = time.perf_counter() - t0
    results = [r.run for _, r in runs]
    meta = {"command": "fleet", "scenario": args.scenario, "wall_seconds": wall,
            "system_prompts": dataclasses.asdict(experiment.system_prompts),
            "timelines": {name: r.replica_timeline for name, r in runs},
            "decisions": {name: r.decisions for name, r in runs if r.decisions}}
    stem = args.stem or (f"fleet-{experiment.name}" if args.scenario else "fleet")
    _finish(Path(args.out), stem, results, meta, experiment.title,
            include_records=args.records, ratios=False)
    summaries = {name: report.summarize(r.run) for name, r in runs}
    print(format_fleet(runs, summaries, args.attainment_target))
    print(f"simulated {len(experiment.traffic.requests)} requests x {len(runs)} runs in {wall:.1f} s wall")
    return 0


def format_fleet(runs: list, summaries: dict[str, dict], attainment_target: float) -> str:
    """The fleet table and its headline lines (routing ratios, autoscaler against fixed sizes)."""
    lines = ["| run | replicas (peak) | replica-hours | prefix-cache hit rate | interactive TTFT p95 ms "
             "| goodput req/s | SLO attainment |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def interactive(name: str) -> dict:
        s = summaries[name]
        return s["lanes"].get("interactive", s["all"])

    for name, r in runs:
        a = summaries[name]["all"]
        hit = r.prefix_hit_rate
        lines.append(f"| {name} | {r.run.extra['replicas_peak']} | {r.replica_hours:.3f} | "
                     f"{'-' if hit is None else f'{hit:.1%}'} | {report._ms(interactive(name)['ttft_s']['p95'])} | "
                     f"{a['goodput_rps']:.2f} | {a['slo_attainment']:.1%} |")
    names = [name for name, _ in runs]
    if "round-robin" in names and "router" in names:
        ttft = report.ratio(interactive("round-robin")["ttft_s"]["p95"], interactive("router")["ttft_s"]["p95"])
        good = report.ratio(summaries["router"]["all"]["goodput_rps"], summaries["round-robin"]["all"]["goodput_rps"])
        lines.append(f"router vs round-robin: interactive TTFT p95 {'-' if ttft is None else f'{ttft:.2f}x'} lower, "
                     f"goodput {'-' if good is None else f'{good:.2f}x'} higher")
    by_name = dict(runs)
    if "autoscale" in by_name:
        auto = by_name["autoscale"]
        reaching = [(r.replica_hours, name) for name, r in runs
                    if name.startswith("fixed-") and summaries[name]["all"]["slo_attainment"] >= attainment_target]
        att = summaries["autoscale"]["all"]["slo_attainment"]
        lines.append(f"autoscale: SLO attainment {att:.1%} (target {attainment_target:.0%}), "
                     f"{auto.replica_hours:.3f} replica-hours")
        if reaching:
            hours, cheapest = min(reaching)
            lines.append(f"cheapest fixed size reaching {attainment_target:.0%}: {cheapest}, "
                         f"{hours:.3f} replica-hours; autoscale / cheapest = {auto.replica_hours / hours:.2f}x")
        else:
            lines.append(f"no fixed size reached {attainment_target:.0%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    from tokenlane.bench.loadgen import Target, run_load
    from tokenlane.bench.serve_proc import ServerProcess
    from tokenlane.runtime.config import RuntimeConfig

    base = yaml.safe_load(Path(args.config).read_text())
    specs = [_phase_spec(p) for p in args.phase] or [("continuous", []), ("static", ["engine.continuousBatching=false"])]
    spec = spec_from_args(args)
    traffic = build_requests(spec)
    print(f"traffic: {traffic.describe()}")
    out = Path(args.out)
    results = []
    for name, overrides in specs:
        data = _patched(base, overrides)
        config = RuntimeConfig.from_dict(data)  # validate before starting anything
        print(f"phase {name}: starting tokenlane serve ({', '.join(overrides) or 'config as given'})")
        with ServerProcess(data, out, name) as server:
            target = Target(server.url, api_key=args.api_key)
            results.append(asyncio.run(run_load(target, traffic, name, slos=report.slos_from_config(config),
                                                time_limit_s=args.time_limit, progress=not args.no_progress)))
        print(f"phase {name}: server stopped (exit {server.exit_code}) in {server.stop_seconds:.1f} s")
    _finish(out, args.stem or "bench-compare", results, {"command": "compare", "spec": spec.to_dict(),
                                                          "phases": dict(specs)}, f"tokenlane bench compare: {args.config}")
    return 0


# --------------------------------------------------------------------------- main


def cmd_report(args: argparse.Namespace) -> int:
    """A timeline PNG of flight recorder steps (GET /debug/steps output or a SIGUSR1 dump)."""
    from tokenlane.runtime.observability.flight_recorder import read_steps

    source = Path(args.steps)
    if not source.is_file():
        raise ValueError(f"--steps {source}: no such file")
    steps = read_steps(source)
    if not steps:
        raise ValueError(f"--steps {source}: no steps in the file")
    png = report.plot_steps(Path(args.out) / f"{args.stem or source.stem + '-timeline'}.png", steps,
                            title=f"flight recorder: {source.name}")
    refusals = sum(n for s in steps for reasons in s.get("refusals", {}).values() for n in reasons.values())
    print(f"{len(steps)} steps ({steps[0]['step']}..{steps[-1]['step']}); peak KV usage "
          f"{max(s['kv']['usage'] for s in steps):.0%}; {sum(s.get('preemptions', 0) for s in steps)} preemptions; "
          f"{refusals} refusals")
    print(f"wrote {png}")
    return 0


RUNNING_SIGNAL_OFF = "off"


def _share_or_off(text: str) -> "float | str":
    """--running-share-target: a share, or `off` (the running signal off)."""
    if text.strip().lower() == RUNNING_SIGNAL_OFF:
        return RUNNING_SIGNAL_OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a share in (0, 1] or {RUNNING_SIGNAL_OFF!r}, got {text!r}") from None


def fleet_pick_default_slack() -> float:
    from tokenlane.runtime.fleet.pick import PickPolicy

    return PickPolicy().affinity_slack


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenlane bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
        sp.add_argument("--stem", default=None, help="file name stem for JSON/PNG")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = sub.add_parser("run", help="drive an OpenAI-compatible endpoint on loopback")
    r.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000 (loopback only)")
    r.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    r.add_argument("--api-key", default=None)
    r.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    r.add_argument("--prompt-mode", choices=["tokens", "text"], default="tokens")
    r.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (plain OpenAI)")
    r.add_argument("--config", default=None, help="runtime.yaml to read lane SLOs from (for goodput)")
    r.add_argument("--name", default="run")
    r.add_argument("--time-limit", type=float, default=600.0)
    common(r)
    _traffic_args(r)
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("simulate", help="in-process engine + simulated GPU on a virtual clock")
    s.add_argument("--scenario", choices=list(scenarios.SCENARIOS), default=None)
    s.add_argument("--config", default=None, help="runtime.yaml (executor forced to simulated)")
    s.add_argument("--phase", action="append", default=[], metavar="NAME[:key=value,...]",
                   help="a phase with config overrides, e.g. static:engine.continuousBatching=false")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override every phase's config (scenario or --config), e.g. engine.kvCacheDtype=fp8_e4m3, "
                        "engine.kvOffload.hostBytes=68719476736, engine.simulatorProfile=h100-llama3-8b; repeatable")
    s.add_argument("--records", action="store_true", help="include every request record in the JSON")
    s.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="serve N LoRA adapters in every phase and spread the requests uniformly over them")
    s.add_argument("--lora-rank", type=int, default=16, metavar="R", help="rank of those adapters (default 16)")
    common(s)
    _traffic_args(s)
    s.set_defaults(func=cmd_simulate)

    f = sub.add_parser("fleet", help="N simulated replicas behind the router's pick policy, autoscaler in the loop")
    f.add_argument("--scenario", choices=["routing", "burst", "ramp"], default=None,
                   help="routing: round-robin vs router on 4 replicas; burst (a 5x step) and ramp (a long 5x "
                        "burst that ramps up and down): autoscale vs fixed sizes")
    f.add_argument("--config", default=None,
                   help="runtime.yaml (default: the production example config with prefix caching on)")
    f.add_argument("--replicas", type=int, default=None, help="fleet size (with --autoscale: the starting size)")
    f.add_argument("--policy", choices=["round-robin", "router", "both"], default=None)
    f.add_argument("--system-prompts", type=int, default=None, help="shared system prompts (0: none)")
    f.add_argument("--system-prompt-tokens", type=int, default=None)
    f.add_argument("--system-prompt-share", type=float, default=None, help="share of requests with one")
    f.add_argument("--system-prompt-zipf", type=float, default=None, help="popularity skew (0: uniform)")
    f.add_argument("--affinity-slack", type=float, default=fleet_pick_default_slack(),
                   help="the router's --affinity-slack")
    f.add_argument("--autoscale", action=argparse.BooleanOptionalAction, default=None,
                   help="run the autoscaler's decide() in the loop (then also every --fixed-sizes size)")
    f.add_argument("--min-replicas", type=int, default=None)
    f.add_argument("--max-replicas", type=int, default=None)
    f.add_argument("--fixed-sizes", default=None, metavar="N,N,...", help="fixed fleet sizes to compare with")
    f.add_argument("--startup-delay", type=float, default=60.0, help="seconds until a new replica is ready")
    f.add_argument("--scale-interval", type=float, default=15.0, help="seconds between decisions")
    f.add_argument("--scale-window", type=float, default=60.0, help="the sample's window, seconds")
    f.add_argument("--settle", type=float, default=0.0,
                   help="seconds a replica must have been ready before the decision counts it as ready")
    f.add_argument("--scale-down-stabilization", type=float, default=None,
                   help="seconds (default: the scenario's, a sixth of its run; else 300)")
    f.add_argument("--attainment-target", type=float, default=0.95,
                   help="SLO attainment a run needs to count as reaching the target (the comparison)")
    f.add_argument("--scale-attainment-target", type=float, default=0.97,
                   help="per-lane SLO attainment target given to the autoscaler")
    # Defaults: fleet_sim.default_scaling_policy (SIM_* there), calibrated for the simulated H200;
    # the numbers are not imported here so that every `bench` command does not load the simulator.
    f.add_argument("--running-share-target", type=_share_or_off, default=None, metavar="SHARE|off",
                   help="the autoscaler's runningShareTarget: a lane's running share at which a replica is "
                        "fully loaded (default 0.4; off: no running signal)")
    f.add_argument("--headroom-replicas", type=float, default=None,
                   help="the autoscaler's headroomReplicas: spare capacity, in replicas, for what arrives "
                        "during a start-up (default 0.4)")
    f.add_argument("--target-utilization", type=float, default=None,
                   help="the autoscaler's targetUtilization: how full a scale-up sized by the queue leaves "
                        "the replicas (default 0.8)")
    f.add_argument("--records", action="store_true", help="include every request record in the JSON")
    common(f)
    _traffic_args(f)
    f.set_defaults(func=cmd_fleet)

    c = sub.add_parser("compare", help="restart `tokenlane serve` per phase with config overrides")
    c.add_argument("--config", required=True, help="base runtime.yaml")
    c.add_argument("--phase", action="append", default=[], metavar="NAME[:key=value,...]",
                   help="default: continuous, then static:engine.continuousBatching=false")
    c.add_argument("--api-key", default=None)
    c.add_argument("--time-limit", type=float, default=600.0)
    common(c)
    _traffic_args(c)
    c.set_defaults(func=cmd_compare)

    rp = sub.add_parser("report", help="draw a timeline PNG of flight recorder steps")
    rp.add_argument("--steps", required=True, metavar="FILE",
                    help="GET /debug/steps output (JSON Lines) or a SIGUSR1 dump file")
    rp.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    rp.add_argument("--stem", default=None, help="PNG file name stem (default: FILE's stem + -timeline)")
    rp.set_defaults(func=cmd_report)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.duration_set = any(a == "--duration" or a.startswith("--duration=") for a in argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"tokenlane bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
