"""`tokenlane plan`: capacity planning from a user's own traffic, in the simulator.

Inputs: the traffic (an Azure-format CSV, a JSONL of `{arrival_s, prompt_tokens,
output_tokens, lane?, tenant?}`, or a `tokenlane bench` result JSON), the serving config (a
ModelService with its ServingLanes, or a runtime.yaml) and a simulator profile (GPU + model).

Per pool of the config (the shared pool, and each dedicated lane's pool):
1. before: the traffic, split evenly across the pool's replicas, replayed against the config
   as given (sim.simulate: the real engine on the simulated executor);
2. tuning: the same traffic replayed `passes` times with the operator's tuner in the loop
   (tuned_sim.run), budgets hot-reloaded as the runtime does; its last budgets are the
   recommendation, kept only if they beat the input config;
3. after: the traffic replayed against the recommended budgets;
4. engine options: the same traffic with an fp8 KV cache (twice the blocks, half the bytes
   decode reads) and, where prefix caching is on, with a host-memory tier for evicted prefix
   blocks; each is recommended where it raises SLO goodput by at least MIN_ENGINE_OPTION_GAIN
   (they restart the pods, and fp8 changes the numbers attention sees), and the replica
   sweep runs with the recommended ones;
5. replicas: the smallest replica count at which each lane meets its SLO (>= 95% of its
   requests within every target, i.e. its p95s), at the trace's rate and at x2. With an even
   split every replica sees the same kind of traffic, so one replica's share stands for all.

Out: before/after tables, the knob changes, the replica counts, a patch (ServingLanes for
manifests, lanes[] keys for a runtime.yaml) with only the knobs the tuner moved and the
recommended engine options, a PNG and a JSON. Docs: docs/plan.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from tokenlane.operator.api.tuning_types import GLOBAL, Bounds, EffectiveBudgets, LaneTarget, TunerSettings
from tokenlane.bench import report, sim, tuned_sim
from tokenlane.runtime.executor.simulated import DEFAULT_PROFILE, get_profile, kv_blocks_for
from tokenlane.bench.trace import (
    TRACE_NAME,
    PlannedRequest,
    Traffic,
    TrafficSpec,
    find_trace,
    load_trace,
    summarize,
    trace_name,
)
from tokenlane.runtime.config import ConfigError, KVOffloadConfig, RuntimeConfig, knob, loads_config

# A lane meets its SLO when this share of its requests finished within every target: the
# SLOs are p95 targets, and a refused or timed-out request counts as a miss.
SLO_QUANTILE = 0.95
# Bounds the tuner gets for a runtime.yaml (which declares none): from a quarter to twice
# each lane's value in force, the lane caps still capped at the global budget.
RUNTIME_BOUNDS_LOW, RUNTIME_BOUNDS_HIGH = 0.25, 2.0
RUNTIME_TUNED_KNOBS = ("maxActiveSequences", "maxBatchedTokens", "prefillChunkSize")
# An engine option (fp8 KV cache, host tier) is recommended only above this SLO goodput gain:
# it restarts every pod, and fp8 is a (small) accuracy change.
MIN_ENGINE_OPTION_GAIN = 0.02
# The host tier tried: this many times the device KV pool's bytes.
HOST_TIER_POOL_MULTIPLE = 4
# The replay's control interval: about eight decisions per pass, within these limits.
DECISIONS_PER_PASS, MIN_INTERVAL_S, MAX_INTERVAL_S = 8, 1.0, 60.0


class PlanInputError(ValueError):
    """An input cannot be read (exit status 2)."""


# --------------------------------------------------------------------------- traffic


def _planned(index: int, arrival_s: float, prompt: int, output: int, lane: Optional[str] = None,
             tenant: Optional[str] = None, stream: bool = True) -> PlannedRequest:
    return PlannedRequest(index=index, arrival_s=arrival_s, lane=lane or None, tenant=tenant or "default",
                          prompt_tokens=max(1, int(prompt)), max_tokens=max(1, int(output)), stream=stream)


def _read_jsonl(path: Path) -> list[PlannedRequest]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, prompt, output = float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanInputError(f"{path}: line {number} is not {{arrival_s, prompt_tokens, output_tokens, "
                                 f"lane?, tenant?}} ({exc!r})") from None
        if arrival < 0 or prompt < 1 or output < 1:
            raise PlanInputError(f"{path}: line {number}: arrival_s must be >= 0 and the token counts >= 1")
        out.append(_planned(len(out), arrival, prompt, output, row.get("lane"), row.get("tenant")))
    return out


def _read_bench_result(path: Path, phase: Optional[str]) -> list[PlannedRequest]:
    try:
        doc = json.loads(path.read_text())
        records = doc["records"]
    except (ValueError, KeyError, TypeError):
        raise PlanInputError(f"{path}: not a tokenlane bench result (JSON with per-request 'records'); "
                             "write one with `tokenlane bench run`") from None
    name = phase or next(iter(records), None)
    if name not in records:
        raise PlanInputError(f"{path}: no phase {name!r}; phases: {sorted(records)}")
    # What was asked for (max_tokens), not what came back: a refused request asked too.
    return [_planned(i, r["arrival_s"], r["prompt_tokens"], r["max_tokens"], r.get("lane"), r.get("tenant"),
                     r.get("stream", True))
            for i, r in enumerate(sorted(records[name], key=lambda r: r["arrival_s"]))]


def read_traffic(source: str, *, start_s: float = 0.0, duration_s: Optional[float] = None,
                 time_scale: float = 1.0, phase: Optional[str] = None) -> Traffic:
    """The user's traffic: `source` is a .jsonl, a bench result .json, an Azure-format .csv
    (or .csv.gz), or `azure-llm-2023-conv` for the packaged trace. The window
    [start_s, start_s + duration_s) of it (trace seconds) is replayed `time_scale` times faster."""
    if time_scale <= 0:
        raise PlanInputError(f"--time-scale must be > 0, got {time_scale}")
    if duration_s is not None and duration_s <= 0:
        raise PlanInputError(f"--duration must be > 0, got {duration_s}")
    path = None if source == TRACE_NAME else Path(source)
    if path is not None and not path.is_file():
        raise PlanInputError(f"{source}: no such traffic file")
    if path is not None and path.suffix == ".jsonl":
        requests = _read_jsonl(path)
    elif path is not None and path.suffix == ".json":
        requests = _read_bench_result(path, phase)
    else:
        try:
            rows = load_trace(find_trace(path))
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
        requests = [_planned(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(rows)]
    if not requests:
        raise PlanInputError(f"{source}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    end = float("inf") if duration_s is None else start_s + duration_s
    chosen = [r for r in requests if start_s <= r.arrival_s < end]
    if not chosen:
        raise PlanInputError(f"{source}: the window [{start_s:g}, {end:g}) s holds no request")
    chosen = [dataclasses.replace(r, index=i, arrival_s=(r.arrival_s - start_s) / time_scale)
              for i, r in enumerate(chosen)]
    name = trace_name(path)
    window = f"[{start_s:g}, {end:g}) s" if duration_s is not None else f"from {start_s:g} s"
    description = (f"trace {name}: {len(chosen)} of {len(requests)} requests {window}, time x{time_scale:g}; "
                   f"{summarize(chosen)}")
    spec = TrafficSpec(source="trace", trace_path=None if path is None else str(path), trace_start_s=start_s,
                       time_scale=time_scale)
    return Traffic(chosen, description, spec)


def renumbered(requests: list[PlannedRequest]) -> list[PlannedRequest]:
    return [dataclasses.replace(r, index=i) for i, r in enumerate(requests)]


def replica_share(requests: list[PlannedRequest], replicas: int, rate: float = 1.0) -> list[PlannedRequest]:
    """What one of `replicas` replicas receives under an even (round-robin) split, with the
    arrivals `rate` times as dense."""
    return renumbered([dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in requests[::replicas]])


def default_interval(requests: list[PlannedRequest], replicas: int) -> float:
    span = max(r.arrival_s for r in requests[::replicas]) - min(r.arrival_s for r in requests[::replicas])
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, span / DECISIONS_PER_PASS))


def repeated(requests: list[PlannedRequest], passes: int, gap_s: float) -> tuple[list[PlannedRequest], float]:
    """The traffic `passes` times back to back (the tuner needs time to converge), and the
    length of one pass."""
    period = max(r.arrival_s for r in requests) + gap_s
    out = [dataclasses.replace(r, arrival_s=r.arrival_s + k * period) for k in range(passes) for r in requests]
    return renumbered(out), period


# --------------------------------------------------------------------------- configs


@dataclass
class PlanPool:
    """One Deployment's worth of replicas to plan: its config as the simulator runs it."""

    name: str
    config: RuntimeConfig
    replicas: int
    targets: list[LaneTarget]
    settings: TunerSettings
    lane_objects: dict[str, dict] = field(default_factory=dict)  # lane -> ServingLane metadata

    @property
    def lanes(self) -> list[str]:
        return [lane.name for lane in self.config.lanes]


@dataclass
class PlanConfig:
    source: str
    kind: str  # "manifests" | "runtime"
    pools: list[PlanPool]
    model_service: Optional[dict] = None  # the ModelService's metadata (manifests)

    def routing_config(self) -> RuntimeConfig:
        """All lanes of all pools, as the front door routes (the shared pool's default)."""
        shared = self.pools[0].config
        extra = [dataclasses.replace(lane, default=False) for pool in self.pools[1:] for lane in pool.config.lanes]
        return dataclasses.replace(shared, lanes=list(shared.lanes) + extra)


def for_simulator(config: RuntimeConfig, profile: str) -> RuntimeConfig:
    """The config on the simulated executor with `profile`. Tenants are dropped: the plan
    replays traffic without API keys (a request's lane comes from the trace or the lane
    match rules)."""
    engine = dataclasses.replace(config.engine, executor="simulated", simulator_profile=profile)
    return dataclasses.replace(config, engine=engine, tenants=[])


def runtime_bounds(config: RuntimeConfig) -> dict[str, dict[str, Bounds]]:
    out: dict[str, dict[str, Bounds]] = {}
    budgets = EffectiveBudgets.from_config(config)
    for lane in config.lanes:
        out[lane.name] = {}
        for key in RUNTIME_TUNED_KNOBS:
            value = budgets.get(lane.name, key)
            if value:
                out[lane.name][key] = Bounds(max(1, int(value * RUNTIME_BOUNDS_LOW)), int(value * RUNTIME_BOUNDS_HIGH))
    return out


def read_config(paths: list[str], profile: Optional[str], *, replicas: Optional[int] = None,
                model_service: Optional[str] = None) -> PlanConfig:
    docs: list[Any] = []
    for raw in paths:
        path = Path(raw)
        files = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml")) if path.is_dir() else [path]
        for f in files:
            try:
                docs += [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
            except (OSError, yaml.YAMLError) as exc:
                raise PlanInputError(f"{f}: cannot read: {exc}") from None
    ours = [d for d in docs if isinstance(d, dict) and d.get("kind") in ("ModelService", "ServingLane")]
    label = ", ".join(paths)
    if ours:
        return _from_manifests(label, ours, profile, replicas, model_service)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise PlanInputError(f"{label}: neither a runtime.yaml nor ModelService/ServingLane manifests")
    try:
        config = loads_config(yaml.safe_dump(docs[0]))
    except ConfigError as exc:
        raise PlanInputError(f"{label}: {exc}") from None
    config = for_simulator(config, profile or config.engine.simulator_profile or DEFAULT_PROFILE)
    settings = TunerSettings(reject_watermark=config.scheduler.kv_cache_reject_watermark)
    pool = PlanPool("runtime", config, replicas or 1, tuned_sim.lane_targets(config, runtime_bounds(config)),
                    settings)
    return PlanConfig(label, "runtime", [pool])


def _from_manifests(label: str, docs: list[dict], profile: Optional[str], replicas: Optional[int],
                    model_service: Optional[str]) -> PlanConfig:
    from tokenlane.operator.desired import builders, precedence
    from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
    from tokenlane.operator.controllers.tuning import lane_targets, settings_from_spec

    try:
        services = [parse_model_service(d) for d in docs if d["kind"] == "ModelService"]
        lanes = [parse_serving_lane(d) for d in docs if d["kind"] == "ServingLane"]
    except ValueError as exc:
        raise PlanInputError(f"{label}: {exc}") from None
    if model_service:
        services = [m for m in services if m.name == model_service]
    if len(services) != 1:
        names = [m.name for m in services]
        raise PlanInputError(f"{label}: need exactly one ModelService (--model-service NAME picks one), found {names}")
    msvc = services[0]
    mine = [lane for lane in lanes if lane.parent == msvc.name and lane.ref.namespace == msvc.namespace]
    try:
        desired = builders.build(msvc, mine)
    except ValueError as exc:
        raise PlanInputError(f"ModelService {msvc.name}: {exc}") from None
    for lane_name, why in desired.rejected.items():
        print(f"tokenlane plan: ServingLane {lane_name} is not served and not planned: {why}", file=sys.stderr)
    budgets = precedence.budgets_of(desired)
    targets = {t.name: t for t in lane_targets(msvc, desired, budgets)}
    settings = settings_from_spec(msvc.spec)
    # A patch names a namespace only where the input did (`kubectl -n` then picks it).
    declared = {(d["kind"], (d.get("metadata") or {}).get("name")): (d.get("metadata") or {}).get("namespace")
                for d in docs}

    def metadata(kind: str, name: str) -> dict:
        namespace = declared.get((kind, name))
        return {"name": name, **({"namespace": namespace} if namespace else {})}

    lane_meta = {lane.lane_name: metadata("ServingLane", lane.ref.name) for lane in desired.admitted}
    chosen_profile = profile or DEFAULT_PROFILE
    pools = []
    for pool in desired.pools:
        pools.append(PlanPool(pool.name, for_simulator(pool.config, chosen_profile),
                              replicas if replicas and pool is desired.shared else pool.replicas,
                              [targets[name] for name in pool.lanes if name in targets], settings,
                              {name: lane_meta[name] for name in pool.lanes if name in lane_meta}))
    return PlanConfig(label, "manifests", pools, metadata("ModelService", msvc.name))


# --------------------------------------------------------------------------- the plan


@dataclass
class PoolPlan:
    pool: PlanPool
    before: report.RunResult
    after: report.RunResult
    tuning: tuned_sim.LoopResult
    recommended: EffectiveBudgets  # the input's budgets when the tuner's do not beat them
    accepted: bool  # the tuner's budgets beat the input config's SLO goodput
    replicas_needed: dict[str, dict[str, Optional[int]]]  # "x1"/"x2" -> lane -> replicas (None: > max)
    sweep: list[dict[str, Any]]
    engine_options: list["EngineOption"] = field(default_factory=list)  # tried on top of the budgets

    def engine_changes(self) -> dict[str, Any]:
        """engine keys (camelCase) of the recommended options."""
        out: dict[str, Any] = {}
        for option in self.engine_options:
            if option.recommended:
                out.update(option.engine)
        return out

    def changes(self) -> list[dict[str, Any]]:
        base = EffectiveBudgets.from_config(self.pool.config)
        out = []
        for lane, values in sorted(self.recommended.lanes.items()):
            for key, value in sorted(values.items()):
                if base.get(lane, key) != value:
                    out.append({"lane": lane, "knob": key, "from": base.get(lane, key), "to": value})
        for key, value in sorted(self.recommended.global_.items()):
            if base.get(GLOBAL, key) != value:
                out.append({"lane": GLOBAL, "knob": key, "from": base.get(GLOBAL, key), "to": value})
        return out


@dataclass
class EngineOption:
    """An engine setting tried on top of the recommended budgets."""

    name: str  # "fp8-kv-cache" | "host-tier"
    engine: dict[str, Any]  # the runtime.yaml engine keys it sets
    result: report.RunResult
    gain: Optional[float]  # SLO goodput relative to the budgets-only run (0.05: +5%); None: that had none
    recommended: bool

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.name, "engine": self.engine, "goodput_rps": goodput(self.result), "gain": self.gain,
                "recommended": self.recommended, "summary": report.summarize(self.result)}


def kv_pool_bytes(config: RuntimeConfig) -> float:
    """The simulated device KV pool's bytes (the host tier is sized against it)."""
    engine = config.engine
    profile = get_profile(engine.simulator_profile, engine.kv_cache_dtype)
    blocks = engine.kv_cache_blocks or kv_blocks_for(profile, engine.block_size, engine.gpu_memory_utilization)
    return float(blocks * engine.block_size * profile.kv_bytes_per_token)


def engine_option_candidates(config: RuntimeConfig) -> list[tuple[str, dict[str, Any], RuntimeConfig]]:
    """(name, engine keys, config) of each option the config does not use yet."""
    out = []
    engine = config.engine
    if not engine.kv_cache_dtype.startswith("fp8"):
        out.append(("fp8-kv-cache", {"kvCacheDtype": "fp8_e4m3"},
                    dataclasses.replace(config, engine=dataclasses.replace(engine, kv_cache_dtype="fp8_e4m3"))))
    if engine.enable_prefix_caching and engine.kv_offload is None:
        host_bytes = int(HOST_TIER_POOL_MULTIPLE * kv_pool_bytes(config))
        out.append(("host-tier", {"kvOffload": {"hostBytes": host_bytes}},
                    dataclasses.replace(config, engine=dataclasses.replace(
                        engine, kv_offload=KVOffloadConfig(host_bytes=host_bytes)))))
    return out


def goodput(result: report.RunResult) -> float:
    return report.summarize(result)["all"]["goodput_rps"]


def lanes_meeting(result: report.RunResult, lanes: list[str]) -> dict[str, bool]:
    summary = report.summarize(result)["lanes"]
    out = {}
    for lane in lanes:
        attainment = summary.get(lane, {}).get("slo_attainment")
        out[lane] = attainment is None or attainment >= SLO_QUANTILE  # no request: nothing missed
    return out


def _sweep_point(result: report.RunResult, rate: float, replicas: int, lanes: list[str]) -> dict[str, Any]:
    summary = report.summarize(result)["lanes"]
    per = {}
    for lane in lanes:
        d = summary.get(lane)
        if d is None:
            continue
        per[lane] = {"slo_attainment": d["slo_attainment"], "ttft_p95_s": d["ttft_s"]["p95"],
                     "tpot_p95_s": d["tpot_s"]["p95"], "requests": d["requests"]}
    return {"rate": rate, "replicas": replicas, "lanes": per}


def plan_pool(pool: PlanPool, requests: list[PlannedRequest], *, passes: int, interval_s: float,
              max_replicas: int, rates: tuple[float, ...] = (1.0, 2.0), progress=None,
              try_engine_options: bool = True) -> PoolPlan:
    say = progress or (lambda text: None)
    slos = report.slos_from_config(pool.config)
    share = replica_share(requests, pool.replicas)
    traffic = Traffic(share, summarize(share), TrafficSpec(source="trace"))
    say(f"{pool.name}: before ({len(share)} requests per replica, {pool.replicas} replica(s))")
    before = sim.simulate(pool.config, traffic, f"{pool.name}/before", slos=slos)

    # The replay runs the operator's tuner on a compressed clock: one decision per interval.
    settings = dataclasses.replace(pool.settings, cooldown_s=interval_s, window_s=interval_s)
    looped, period = repeated(share, passes, gap_s=interval_s)
    say(f"{pool.name}: tuning ({passes} pass(es), a decision every {interval_s:g} s)")
    tuning = tuned_sim.run(pool.config, looped, pool.targets, settings, tune=True, interval_s=interval_s,
                           end_s=passes * period)
    proposed = tuning.final_budgets or EffectiveBudgets.from_config(pool.config)
    tuned_config = tuned_sim.apply_budgets(pool.config, proposed)
    say(f"{pool.name}: after")
    after = sim.simulate(tuned_config, traffic, f"{pool.name}/after", slos=slos)
    accepted = goodput(after) > goodput(before)
    if not accepted:
        proposed, tuned_config, after = EffectiveBudgets.from_config(pool.config), pool.config, before
    options = []
    base = goodput(after)
    candidates = engine_option_candidates(tuned_config) if try_engine_options else []
    for name, engine_keys, option_config in candidates:
        say(f"{pool.name}: with {name}")
        result = sim.simulate(option_config, traffic, f"{pool.name}/{name}", slos=slos)
        gain = goodput(result) / base - 1 if base else None
        recommended = goodput(result) > base * (1 + MIN_ENGINE_OPTION_GAIN)
        options.append(EngineOption(name, engine_keys, result, gain, recommended))
    for option, (_, _, option_config) in zip(options, candidates):
        if option.recommended:  # the sweep runs with every recommended option
            tuned_config = dataclasses.replace(tuned_config, engine=_merged_engine(tuned_config, option_config))
    cache = {(1.0, pool.replicas): after}
    needed: dict[str, dict[str, Optional[int]]] = {}
    sweep = []
    start = 1
    served = [lane for lane in pool.lanes if any(r.lane == lane for r in requests)]  # a lane without traffic needs none
    for rate in rates:
        found: dict[str, Optional[int]] = {lane: None for lane in served}
        for n in range(start, max_replicas + 1):
            result = cache.get((rate, n))
            if result is None:
                say(f"{pool.name}: x{rate:g} on {n} replica(s)")
                part = replica_share(requests, n, rate)
                result = sim.simulate(tuned_config, Traffic(part, "", TrafficSpec(source="trace")),
                                      f"{pool.name}/x{rate:g}/{n}", slos=slos)
            sweep.append(_sweep_point(result, rate, n, served))
            for lane, met in lanes_meeting(result, served).items():
                if met and found[lane] is None:
                    found[lane] = n
            if all(v is not None for v in found.values()):
                break
        needed[f"x{rate:g}"] = found
        # More traffic never needs fewer replicas: start the next rate where this one ended.
        start = max([v for v in found.values() if v is not None], default=start)
    return PoolPlan(pool, before, after, tuning, proposed, accepted, needed, sweep, options)


def _merged_engine(config: RuntimeConfig, option_config: RuntimeConfig):
    """config's engine with the fields option_config's engine changed."""
    changed = {f.name: getattr(option_config.engine, f.name) for f in dataclasses.fields(option_config.engine)
               if getattr(option_config.engine, f.name) != getattr(config.engine, f.name)}
    return dataclasses.replace(config.engine, **changed)


# --------------------------------------------------------------------------- the patch


def patch_documents(config: PlanConfig, plans: list[PoolPlan]) -> list[dict]:
    """SSA-able objects with only the knobs the tuner moved: ServingLanes (spec.budgets) and
    the ModelService (spec.scheduler, global knobs) for manifests; runtime.yaml keys otherwise."""
    changes = [(plan, c) for plan in plans for c in plan.changes()]
    # Engine options are one ModelService setting: recommended where the shared pool's plan (or
    # the runtime.yaml's only one) recommends them.
    engine = plans[0].engine_changes() if plans and plans[0].pool is config.pools[0] else {}
    if not changes and not engine:
        return []
    if config.kind == "runtime":
        lanes: dict[str, dict] = {}
        scheduler: dict[str, Any] = {}
        for _, c in changes:
            if c["lane"] == GLOBAL:
                scheduler[c["knob"]] = c["to"]
            else:
                lanes.setdefault(c["lane"], {"name": c["lane"]})[c["knob"]] = _value(c["knob"], c["to"])
        doc: dict[str, Any] = {}
        if engine:
            doc["engine"] = engine
        if scheduler:
            doc["scheduler"] = scheduler
        if lanes:
            doc["lanes"] = list(lanes.values())
        return [doc]
    from tokenlane.operator.api.resources import API_VERSION

    docs = []
    by_lane: dict[str, dict] = {}
    scheduler = {}
    for plan, c in changes:
        if c["lane"] == GLOBAL:
            scheduler[c["knob"]] = c["to"]
            continue
        meta = plan.pool.lane_objects[c["lane"]]
        doc = by_lane.setdefault(c["lane"], {"apiVersion": API_VERSION, "kind": "ServingLane",
                                             "metadata": dict(meta), "spec": {"budgets": {}}})
        doc["spec"]["budgets"][c["knob"]] = _value(c["knob"], c["to"])
    if (scheduler or engine) and config.model_service:
        spec: dict[str, Any] = {}
        if engine:
            spec["engine"] = engine
        if scheduler:
            spec["scheduler"] = scheduler
        docs.append({"apiVersion": API_VERSION, "kind": "ModelService", "metadata": dict(config.model_service),
                     "spec": spec})
    return docs + [by_lane[lane] for lane in sorted(by_lane)]


def _value(key: str, value: float) -> Any:
    return int(value) if knob(key).type is int else value


def patch_text(config: PlanConfig, plans: list[PoolPlan]) -> str:
    docs = patch_documents(config, plans)
    if not docs:
        return "# no change: the input config's budgets already do at least as well on this traffic\n"
    restart = ("# engine keys restart the pods (a rolling update); the others are hot-reloaded.\n"
               if any("engine" in d.get("spec", d) for d in docs) else "")
    if config.kind == "runtime":
        head = "# runtime.yaml: set these keys (lanes by name); nothing else changes\n"
    else:
        head = ("# Only the knobs the tuner moved. Apply with server-side apply (leaves every other field alone):\n"
                "#   kubectl apply --server-side --field-manager=tokenlane-plan -f <this file>\n"
                "# or commit it as a kustomize patch (patches: [{path: <this file>}]).\n")
    return head + restart + yaml.safe_dump_all(docs, sort_keys=False)


# --------------------------------------------------------------------------- output


def _phases(plan: PoolPlan) -> list[report.RunResult]:
    """Before and after; only before when the input config was kept (after is the same run)."""
    return [plan.before, plan.after] if plan.accepted else [plan.before]


def _fmt_replicas(found: dict[str, Optional[int]], max_replicas: int) -> str:
    if not found:
        return "no lane with traffic"
    return ", ".join(f"{lane} {n if n is not None else f'>{max_replicas}'}" for lane, n in found.items())


def _fmt_engine(engine: dict[str, Any]) -> str:
    return ", ".join(f"engine.{k}: {v}" if not isinstance(v, dict) else
                     ", ".join(f"engine.{k}.{sub}: {subv}" for sub, subv in v.items()) for k, v in engine.items())


def text_report(traffic: Traffic, config: PlanConfig, plans: list[PoolPlan], max_replicas: int) -> str:
    lines = [f"traffic: {traffic.description}", f"config: {config.source}", ""]
    summaries = [report.summarize(r) for plan in plans for r in _phases(plan)]
    lines.append(report.format_table(summaries))
    for plan in plans:
        b, a = goodput(plan.before), goodput(plan.after)
        gain = (a / b - 1) * 100 if b else float("inf") if a else 0.0
        lines.append(f"{plan.pool.name}: SLO goodput {b:.2f} -> {a:.2f} req/s per replica ({gain:+.1f}%); "
                     f"{plan.tuning.reloads} budget change(s) in the replay"
                     + ("" if plan.accepted else "; the tuner's budgets did not beat the input: keeping them"))
        for c in plan.changes():
            lines.append(f"  {c['lane']:<14} {c['knob']:<20} {c['from']:g} -> {c['to']:g}")
        for option in plan.engine_options:
            gain = "-" if option.gain is None else f"{option.gain:+.1%}"
            lines.append(f"  engine option {option.name} ({_fmt_engine(option.engine)}): SLO goodput "
                         f"{goodput(option.result):.2f} req/s per replica ({gain}): "
                         + ("recommended" if option.recommended else
                            f"not recommended (below +{MIN_ENGINE_OPTION_GAIN:.0%})"))
        for rate, found in plan.replicas_needed.items():
            lines.append(f"  replicas to meet each lane's SLO at {rate} the trace's rate"
                         + (" (with the recommended engine options)" if plan.engine_changes() else "")
                         + f": {_fmt_replicas(found, max_replicas)}")
        lines.append("")
    return "\n".join(lines)


def plan_json(traffic: Traffic, config: PlanConfig, plans: list[PoolPlan], elapsed_s: float) -> dict[str, Any]:
    pools = []
    for plan in plans:
        b, a = goodput(plan.before), goodput(plan.after)
        pools.append({
            "pool": plan.pool.name,
            "replicas": plan.pool.replicas,
            "before": report.summarize(plan.before),
            "after": report.summarize(plan.after),
            "goodput_rps": {"before": b, "after": a, "gain": (a / b - 1) if b else None},
            "accepted": plan.accepted,
            "changes": plan.changes(),
            "budget_changes_in_replay": plan.tuning.reloads,
            "decisions": [{"at_s": i.end_s, "action": i.decision.action, "reason": i.decision.reason,
                           "changes": [dataclasses.asdict(c) for c in i.decision.changes]}
                          for i in plan.tuning.intervals if i.decision is not None and i.decision.changes],
            "engine_options": [option.to_dict() for option in plan.engine_options],
            "replicas_needed": plan.replicas_needed,
            "replica_sweep": plan.sweep,
        })
    return report._jsonable({"traffic": traffic.description, "config": config.source, "pools": pools,
                             "patch": patch_documents(config, plans), "elapsed_s": elapsed_s})


def run_plan(args: argparse.Namespace, say=None) -> tuple[Traffic, PlanConfig, list[PoolPlan]]:
    if args.profile:
        try:
            get_profile(args.profile)
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
    traffic = read_traffic(args.traffic, start_s=args.start, duration_s=args.duration, time_scale=args.time_scale,
                           phase=args.phase)
    config = read_config(args.config, args.profile, replicas=args.replicas, model_service=args.model_service)
    routing = config.routing_config()
    by_pool: dict[str, list[PlannedRequest]] = {pool.name: [] for pool in config.pools}
    pool_of = {lane: pool.name for pool in config.pools for lane in pool.lanes}
    for planned in traffic.requests:
        if planned.lane and planned.lane not in pool_of:
            raise PlanInputError(f"request {planned.index} asks for lane {planned.lane!r}, which the config does "
                                 f"not have; lanes: {sorted(pool_of)}")
        try:
            lane = sim._route(routing, planned)
        except Exception as exc:  # the router's APIError: a lane the config does not have
            raise PlanInputError(f"request {planned.index} (lane {planned.lane!r}) cannot be routed: {exc}") from None
        by_pool[pool_of[lane]].append(dataclasses.replace(planned, lane=lane))
    plans = []
    for pool in config.pools:
        requests = renumbered(by_pool[pool.name])
        if not requests:
            continue
        interval = args.interval or default_interval(requests, pool.replicas)
        plans.append(plan_pool(pool, requests, passes=args.passes, interval_s=interval,
                               max_replicas=args.max_replicas, progress=say,
                               try_engine_options=not args.no_engine_options))
    return traffic, config, plans


EPILOG = """\
examples:
  tokenlane plan --traffic my-traffic.jsonl -f manifests/samples/llama3-8b.yaml
  tokenlane plan --traffic azure-llm-2023-conv --duration 90 --time-scale 4 -f manifests/samples/llama3-8b.yaml
  tokenlane plan --traffic bench-run.json --config runtime.yaml --profile h100-llama3-8b -o json

Traffic: a JSONL of {arrival_s, prompt_tokens, output_tokens, lane?, tenant?}, an Azure-format
CSV (TIMESTAMP,ContextTokens,GeneratedTokens), a `tokenlane bench` result JSON, or
azure-llm-2023-conv (the packaged trace). Exit status: 0 done, 2 an input cannot be read.
More: docs/plan.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlane plan", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay your traffic in the simulator with the operator's tuner in the loop: recommended\n"
                    "lane budgets (a ServingLane patch), the replicas each lane's SLO needs at the trace's\n"
                    "rate and at x2, before/after tables, a PNG and a JSON.")
    p.add_argument("--traffic", required=True, metavar="FILE", help="traffic: .jsonl, .csv[.gz], bench result .json, "
                                                                    f"or {TRACE_NAME}")
    p.add_argument("-f", "--config", action="append", required=True, metavar="FILE",
                   help="ModelService + ServingLane YAML (files or folders) or a runtime.yaml; repeatable")
    p.add_argument("--model-service", metavar="NAME", help="the ModelService to plan when the files hold several")
    p.add_argument("--profile", help=f"simulator profile <gpu>-<model> (default {DEFAULT_PROFILE}, or the "
                                     "runtime.yaml's engine.simulatorProfile)")
    p.add_argument("--phase", help="bench result: the phase whose requests to replay (default: the first)")
    p.add_argument("--start", type=float, default=0.0, help="replay the traffic from this second (default 0)")
    p.add_argument("--duration", type=float, default=None, help="replay this many seconds of it (default: all)")
    p.add_argument("--time-scale", type=float, default=1.0, help="replay this many times faster (default 1)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas serving the traffic now (default: the ModelService's spec.replicas, 1 for a "
                        "runtime.yaml)")
    p.add_argument("--passes", type=int, default=3, help="replays of the traffic with the tuner (default 3)")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds of simulated time between the tuner's decisions (default: an eighth of the "
                        f"replayed traffic's span, {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} s)")
    p.add_argument("--max-replicas", type=int, default=8, help="largest replica count tried (default 8)")
    p.add_argument("--no-engine-options", action="store_true",
                   help="do not try an fp8 KV cache and a host-memory KV tier on top of the budgets")
    p.add_argument("--out", default="plan-out", help="folder for plan.json, plan.png, patch.yaml (default plan-out)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in ("passes", "max_replicas"):
        if getattr(args, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.replicas is not None and args.replicas < 1:
        raise PlanInputError(f"--replicas must be >= 1, got {args.replicas}")
    if args.interval is not None and args.interval <= 0:
        raise PlanInputError(f"--interval must be > 0, got {args.interval}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    say = None if args.output == "json" else (lambda text: print(f"... {text}", file=sys.stderr))
    try:
        _check_args(args)
        traffic, config, plans = run_plan(args, say)
    except PlanInputError as exc:
        print(f"tokenlane plan: {exc}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = plan_json(traffic, config, plans, elapsed)
    (out / "plan.json").write_text(json.dumps(doc, indent=1))
    (out / "patch.yaml").write_text(patch_text(config, plans))
    results = [r for plan in plans for r in _phases(plan)]
    png = report.plot(out / "plan.png", results, title=f"tokenlane plan: {trace_name(traffic.spec.trace_path)}")
    if args.output == "json":
        print(json.dumps(doc, indent=1))
        return 0
    print(text_report(traffic, config, plans, args.max_replicas))
    print(patch_text(config, plans))
    print(f"wrote {out / 'plan.json'}, {out / 'patch.yaml'} and {png} in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
