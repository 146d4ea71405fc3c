"""The synchronous engine: admission, the step loop, and the step's outputs (token ids).

    def step(self):
        self._apply_staged()                       # new requests, aborts, config reload
        plan = self.scheduler.schedule()           # who runs how many tokens
        output = self._execute(plan)               # model (or simulated) step
        got_token = self.scheduler.update_from_output(plan, output)
        outputs = self._outputs(got_token)         # new token ids, finished requests
        self._report_step(plan, output, schedule_seconds)  # step stats to the observers
        return outputs

`add_request`, `abort_request` and `reload_config` only stage their change (under a small
lock) so the asyncio front may call them while a step runs in its worker thread; the change
takes effect at the next step boundary. Admission checks run at once, in `add_request`.

The engine never detokenizes: its outputs carry token ids, and the front end (the
OutputProcessor of runtime/engine/output.py, on the API process's event loop) makes their
text, finds stop strings and ends a stopped request here with `abort_request`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from tokenlane.runtime.core.admission import (
    AdmissionError,
    AdmissionLimits,
    StepTimeEstimator,
    check_load,
    check_request_shape,
    check_tenant_rate,
)
from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.core.step_plan import Executor, ExecutorGroupFailed, ExecutorOutput, StepPlan
from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.scheduler import Scheduler
from tokenlane.runtime.core.startup import StartupPhase
from tokenlane.runtime.core.tenant_limits import TenantRateLimiter
from tokenlane.runtime.core.stats import EngineObserver, LaneStepStats, StepStats
from tokenlane.runtime.engine.adapters import (
    API,
    CONFIG,
    AdapterTable,
    ServedAdapter,
    adapter_folder,
    check_adapter_name,
    info_fields,
)
from tokenlane.runtime.engine.output import RequestOutput

log = logging.getLogger(__name__)

# This many steps in a row in which the executor failed for every request (each also run
# alone) mean the executor is broken: raise (the loop goes unhealthy).
MAX_CONSECUTIVE_STEP_FAILURES = 3

# finish_detail (and metrics reason) of the requests of a step that ran out of accelerator memory.
OOM_REASON = "oom"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory error (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError is
    the same class). torch is not imported for it: an executor that raises it loaded torch."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom)


def release_cached_accelerator_memory() -> None:
    """Give torch's cached CUDA blocks back after an OOM (best effort), so the next step
    starts from what is really in use."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        log.debug("emptying the CUDA cache after an OOM failed", exc_info=True)


def restart_field_changes(before: RuntimeConfig, after: RuntimeConfig) -> list[str]:
    """The restart-only fields that differ between two configs, as sorted "section.key"
    names (empty: `after` can be hot-reloaded)."""
    old, new = before.restart_fields(), after.restart_fields()
    return sorted(
        f"{section}.{key}"
        for section in old.keys() | new.keys()
        for key in old.get(section, {}).keys() | new.get(section, {}).keys()
        if old.get(section, {}).get(key) != new.get(section, {}).get(key)
    )


class RestartRequired(ValueError):
    """A config whose model or engine fields changed: only a restart can apply it."""

    def __init__(self, changed: list[str]) -> None:
        self.changed = changed
        sections = sorted({name.split(".", 1)[0] for name in changed})
        super().__init__(f"{'/'.join(sections)} fields changed and need a restart ({', '.join(changed)})")


class LLMEngine:
    # What its start-up took (tokenizer, then the executor's load, kv and warmup), as
    # `from_config` measured it; the server logs and exports them (runtime/core/startup.py).
    startup_phases: Sequence[StartupPhase] = ()

    def __init__(
        self,
        config: RuntimeConfig,
        executor: Executor,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer  # for structured output's grammars and the front end; never to detokenize
        self.clock = clock
        self.max_model_len: int = self._max_model_len(config)
        self.scheduler = Scheduler(
            config,
            executor.num_kv_blocks,
            executor.block_size,
            max_model_len=self.max_model_len,
            clock=clock,
            # engine.kvOffload: the host tier's slots the executor allocated (0: none).
            num_host_kv_blocks=getattr(executor, "num_host_kv_blocks", 0),
        )
        self.limits = AdmissionLimits(self.max_model_len, executor.num_kv_blocks, executor.block_size,
                                      self.vocab_size)
        self.estimator = StepTimeEstimator()
        self.tenant_limits = TenantRateLimiter(config.tenants, clock())
        self._set_tenant_weights(config)
        self.observers: list[EngineObserver] = []
        self._lock = threading.Lock()  # guards the staged changes below
        self._staged: list[Request] = []
        self._staged_ids: set[str] = set()
        self._staged_per_lane: dict[str, int] = {}
        self._aborts: list[tuple[str, RequestStatus, str, float]] = []
        # request_id -> when its cancel was asked for (engine clock), until its blocks are free.
        self._cancelled_at: dict[str, float] = {}
        # Engine clock when the step learned of the ends it handles: its start, then the
        # return of its execution (a finish by the last token, an executor error).
        self._ends_known_at = 0.0
        self._kv_releases: list[tuple[str, float]] = []  # (lane, seconds) of this step
        self._oom_events = 0  # of this step
        self._pending_config: Optional[RuntimeConfig] = None
        self._failures = 0
        self._prefix_counters = (0, 0, 0)
        self._queued_since_step: dict[str, int] = {}  # lane -> requests queued since the last step
        self.last_step_tokens = 0  # tokens the last step ran (0: nothing was runnable)
        # LoRA adapters (adapters.py). The executor's adapter calls and its steps take turns
        # under this lock: an adapter loads from another thread between two steps.
        self.adapters = AdapterTable()
        self._executor_lock = threading.Lock()
        for i, adapter in enumerate(config.model.adapters or ()):
            try:
                self.load_adapter(adapter.name, adapter.path, origin=CONFIG)
            except ValueError as exc:
                raise ConfigError(f"config.model.adapters[{i}] ({adapter.name}): {exc}") from None

    @property
    def vocab_size(self) -> Optional[int]:
        """The executor's vocabulary size (None if it has no vocabulary to check ids against)."""
        return getattr(self.executor, "vocab_size", None)

    @property
    def supports_logprobs(self) -> bool:
        return bool(getattr(self.executor, "supports_logprobs", False))

    def _max_model_len(self, config: RuntimeConfig) -> int:
        """The smallest of the model's, the config's and the executor's length limits."""
        limits = [
            v
            for v in (
                config.model.max_model_len,
                config.scheduler.max_model_len,  # hot-reloadable
                getattr(self.executor, "max_model_len", None),
            )
            if v
        ]
        if not limits:
            raise ValueError("no model length known: set model.maxModelLen")
        return min(limits)

    @classmethod
    def from_config(cls, config: RuntimeConfig, clock: Callable[[], float] = time.monotonic) -> "LLMEngine":
        if config.engine.executor == "simulated":
            from tokenlane.runtime.executor.simulated import SimulatedExecutor

            return cls(config, SimulatedExecutor(config), tokenizer=None, clock=clock)
        from tokenlane.runtime.executor.model_executor import ModelExecutor
        from tokenlane.runtime.engine.tokenizer import load_tokenizer

        started = time.perf_counter()
        first = "transformers" not in sys.modules  # its import is most of this phase's time
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
        loaded = StartupPhase("tokenizer", time.perf_counter() - started,
                              f"{type(tokenizer).__name__}, {len(tokenizer)} tokens"
                              + ("; transformers imported" if first else ""))
        log.info("%s", loaded.log_line())
        if config.engine.tp_size * config.engine.pp_size > 1:
            from tokenlane.runtime.distributed.executor import DistributedExecutor

            executor = DistributedExecutor.launch(config)  # this process is rank 0 (docs/parallelism.md)
        else:
            executor = ModelExecutor(config)
        engine = cls(config, executor, tokenizer=tokenizer, clock=clock)
        engine.startup_phases = (loaded, *executor.startup_phases)
        return engine

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Admit a request (raises AdmissionError with status and reason) and queue it for
        the next step. Fills in the lane (the default lane for "default") and EOS id."""
        try:
            self._admit(request)
        except AdmissionError as exc:
            self.record_rejection(request, exc)
            raise

    def add_group(self, requests: list[Request]) -> None:
        """Admit the sequences of one prompt sampled in parallel (n > 1, best_of: a
        SequenceGroup, leader first), all or none. Admission counts every sequence: the KV
        pool must hold the prompt once plus each sequence's own blocks, and n must fit
        maxActiveSequences (globally and in the lane)."""
        group = requests[0].group
        assert group is not None and len(group.members) == len(requests) and all(
            a is b for a, b in zip(group.members, requests)
        ), "add_group takes one whole group, leader first"
        try:
            self._admit(requests[0], followers=requests[1:])
        except AdmissionError as exc:
            for request in requests:
                self.record_rejection(request, exc)
            raise

    def record_rejection(self, request: Request, error: AdmissionError) -> None:
        """Finish a refused request as rejected and tell the observers (metrics count every
        rejection, also those the async front makes: draining, engine down)."""
        request.finish(RequestStatus.FINISHED_REJECTED, error.reason, now=self.clock())
        self._notify_finished(request)

    def _admit(self, request: Request, followers: Sequence[Request] = ()) -> None:
        if request.eos_token_id is None:
            request.eos_token_id = getattr(self.executor, "eos_token_id", None)
        check_request_shape(request, self.limits)
        if followers:
            self._check_group_shape(request, len(followers) + 1)
        scheduler = self.scheduler
        with self._lock:  # config and lanes change only under it (at the step boundary)
            config = self.config
            if request.lane not in scheduler.lanes:
                if request.lane != "default":
                    names = [lane.name for lane in config.lanes]
                    raise AdmissionError(400, "invalid", f"unknown lane {request.lane!r}; lanes: {names}")
                request.lane = config.default_lane.name
            budgets = config.lane_budgets(request.lane)
            if request.adapter is not None and request.adapter not in self.adapters:
                raise AdmissionError(404, "model_not_found", f"model {request.adapter!r} does not exist "
                                     f"(adapter not loaded); this server serves {config.model.name!r}")
            rid = request.request_id
            if rid in self._staged_ids or rid in scheduler.requests:
                raise AdmissionError(400, "invalid", f"request id {rid!r} is already in use")
            if followers:
                self._check_group_load(request, len(followers) + 1, config, budgets)
            if scheduler.quotas.active and scheduler.exceeds_lane_capacity(request):
                raise AdmissionError(
                    400, "too_long", f"prompt + max_tokens needs more KV blocks than lane {request.lane!r} may "
                    f"ever hold ({scheduler.lane_kv_capacity(request.lane)} blocks: its maxKvCacheShare, less "
                    "the other lanes' kvCacheReserved); lower max_tokens or shorten the prompt")
            # The tenant's own limit first: a tenant over its rate is told so, with the wait its
            # bucket needs, even when the queue is full as well (a queue slot alone would not do).
            now = self.clock()
            check_tenant_rate(request, self.tenant_limits, now)
            check_load(
                request,
                waiting_total=scheduler.num_waiting + len(self._staged),
                waiting_in_lane=scheduler.num_waiting_in(request.lane)
                + self._staged_per_lane.get(request.lane, 0),
                max_waiting_total=config.scheduler.max_waiting_requests,
                max_waiting_lane=budgets.max_waiting_requests,
                kv_usage=scheduler.lane_kv_usage(request.lane),
                kv_reject_watermark=config.scheduler.kv_cache_reject_watermark,
                estimator=self.estimator,
                now=now,
            )
            self.tenant_limits.charge(request.tenant, request.num_prompt_tokens, now)  # once per group
            request.status = RequestStatus.WAITING
            self._staged.append(request)
            self._staged_ids.add(rid)
            self._staged_per_lane[request.lane] = self._staged_per_lane.get(request.lane, 0) + 1
            for follower in followers:  # the leader's lane; they wait for its prompt
                follower.lane = request.lane
                follower.adapter = request.adapter
                follower.eos_token_id = request.eos_token_id
                follower.status = RequestStatus.WAITING
                self._staged.append(follower)
                self._staged_ids.add(follower.request_id)

    def _check_group_shape(self, leader: Request, size: int) -> None:
        """400 `too_long` when the pool cannot hold a parallel-sampling group at full length:
        the prompt's full blocks once (shared), and per sequence the rest of its context."""
        bs = self.limits.block_size
        shared = (leader.num_prompt_tokens - 1) // bs
        own = -(-(leader.num_prompt_tokens + leader.sampling_params.max_tokens) // bs) - shared
        blocks = shared + size * own
        if blocks > self.limits.kv_blocks_total:
            raise AdmissionError(
                400, "too_long",
                f"{size} sequences of this prompt need {blocks} KV cache blocks ({shared} shared "
                f"prompt blocks + {size} x {own}) but the cache has only {self.limits.kv_blocks_total}",
            )

    def _check_group_load(self, leader: Request, size: int, config: RuntimeConfig, budgets) -> None:
        """400 when n sequences can never run together under maxActiveSequences; duplicate ids."""
        cap = min(config.scheduler.max_active_sequences, budgets.max_active_sequences)
        if size > cap:
            raise AdmissionError(
                400, "invalid",
                f"{size} parallel sequences exceed maxActiveSequences ({cap}) of lane {leader.lane!r}",
            )
        for follower in leader.group.members[1:]:
            rid = follower.request_id
            if rid in self._staged_ids or rid in self.scheduler.requests:
                raise AdmissionError(400, "invalid", f"request id {rid!r} is already in use")

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_CANCELLED, detail: str = ""
    ) -> None:
        """End a request in any state at the next step boundary (its blocks are freed there)."""
        assert status.is_finished, status
        with self._lock:
            self._aborts.append((request_id, status, detail or "cancelled", self.clock()))

    def reload_config(self, new: RuntimeConfig) -> None:
        """Stage a new config (budgets, lanes, tenants) for the next step boundary.
        RestartRequired (a ValueError) if a restart-only (model/engine) field differs."""
        if not isinstance(new, RuntimeConfig):
            raise ValueError(f"expected a RuntimeConfig, got {type(new).__name__}")
        changed = restart_field_changes(self.config, new)
        if changed:
            error = RestartRequired(changed)
            for observer in self.observers:
                observer.on_config_applied(new, False, str(error))
            raise error
        try:
            self._reload_adapters(new)
        except ValueError as exc:
            for observer in self.observers:
                observer.on_config_applied(new, False, str(exc))
            raise
        with self._lock:
            self._pending_config = new

    # ------------------------------------------------------------------ LoRA adapters

    def adapter_names(self) -> list[str]:
        """The adapters served now (a request may name any of them as its model)."""
        return self.adapters.names()

    def served_adapters(self) -> list[ServedAdapter]:
        return list(self.adapters.served.values())

    def load_adapter(self, name: str, path: str, origin: str = API) -> ServedAdapter:
        """Load and serve LoRA adapter `name` from a PEFT folder or a source URI. ValueError
        naming the adapter if the name is taken or invalid, or the executor refuses it (bad
        files, rank above engine.maxLoraRank, shapes that do not fit the base); nothing changes
        then. Blocking (file reads, a download): callers off the step thread may call it."""
        check_adapter_name(name, self.config.model.name)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first or pick another name")
        if name in self.adapters.unloading:
            raise ValueError(f"adapter {name!r} is being unloaded (requests still use it); retry when they finish")
        add = getattr(self.executor, "add_adapter", None)
        if add is None:
            raise ValueError(f"adapter {name!r}: this executor serves no LoRA adapters")
        folder = adapter_folder(name, path, self.config.model)
        with self._executor_lock:
            try:
                info = add(name, folder)
            except ValueError as exc:
                message = str(exc)
                raise ValueError(message if name in message else f"adapter {name!r}: {message}") from None
            except OSError as exc:
                raise ValueError(f"adapter {name!r}: cannot read {folder}: {exc}") from None
        served = ServedAdapter(name, path, origin, **info_fields(info))
        self.adapters.add(served)
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, served.rank,
                 ",".join(served.target_modules) or "-")
        return served

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (KeyError if not served): new requests naming it get 404 at once;
        its queued and running requests finish with it, and its weights are dropped at the
        step boundary after the last of them."""
        self.adapters.remove(name)
        log.info("LoRA adapter %s unloaded (weights freed once its requests finish)", name)
        if not self._adapters_in_use({name}):
            self._drop_unused_adapters()

    def _adapters_in_use(self, names: set[str]) -> set[str]:
        """The adapters of `names` that a queued or running request still uses."""
        used = set()
        with self._lock:
            pending = list(self._staged)
        for request in list(self.scheduler.requests.values()) + pending:
            if request.adapter in names:
                used.add(request.adapter)
        return used

    def _drop_unused_adapters(self) -> None:
        unloading = self.adapters.unloading
        if not unloading:
            return
        for name in sorted(unloading - self._adapters_in_use(set(unloading))):
            with self._executor_lock:
                if name not in unloading:  # another thread dropped it meanwhile
                    continue
                unloading.discard(name)
                remove = getattr(self.executor, "remove_adapter", None)
                try:
                    if remove is not None:
                        remove(name)
                except Exception:  # its weights may stay; the engine serves on without it
                    log.exception("freeing LoRA adapter %s failed", name)

    def _reload_adapters(self, new: RuntimeConfig) -> None:
        """Apply a reload's `model.adapters`: load those it adds, unload those it removes. A
        bad adapter refuses the whole reload (ValueError naming it; the adapters loaded for
        it are unloaded again), before anything else of the reload is staged."""
        before = self.adapters.config_names()
        wanted = {a.name: a.path for a in new.model.adapters or ()}
        loaded: list[str] = []
        adopted: list[str] = []
        try:
            for name, path in wanted.items():
                if before.get(name) == path:
                    continue
                served = self.adapters.served.get(name)
                if name in before:
                    raise ValueError(f"adapter {name!r}: its path changed ({before[name]} -> {path}); an "
                                     "adapter is not replaced in place: give the new version a new name")
                if served is not None:
                    if served.source != path:
                        raise ValueError(f"adapter {name!r} is already loaded (through the API) from "
                                         f"{served.source}; unload it first or pick another name")
                    adopted.append(name)
                    continue
                try:
                    self.load_adapter(name, path, origin=CONFIG)
                except ValueError as exc:
                    raise ValueError(f"model.adapters ({name}): {exc}") from None
                loaded.append(name)
        except ValueError:
            for name in loaded:
                self.unload_adapter(name)
            raise
        for name in adopted:
            self.adapters.adopt(name)
        for name in before:
            if name not in wanted and name in self.adapters:
                self.unload_adapter(name)

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests or self._staged or self._aborts)

    def has_pending_work(self) -> bool:
        """Anything for `step()` to do: requests, or a staged config reload."""
        return self.has_unfinished_requests() or self._pending_config is not None or bool(self.adapters.unloading)

    # ------------------------------------------------------------------ the step

    def pin_step_thread(self) -> None:
        """A step loop's thread of its own calls this before its first step: engine.cpuBind
        pins that thread's compute threads (runtime/executor/cpu_placement.py). Offline callers that
        step from their own thread are left alone."""
        pin = getattr(self.executor, "pin_step_thread", None)
        if pin is not None:
            pin()

    def step(self) -> list[RequestOutput]:
        self._ends_known_at = self.clock()
        self._apply_staged()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        with self._executor_lock:
            output = self._execute(plan)
        t2 = time.perf_counter()
        self._ends_known_at = self.clock()
        got_token = self.scheduler.update_from_output(plan, output)
        self._charge_output_tokens(got_token)
        schedule_seconds = (t1 - t0) + (time.perf_counter() - t2)
        outputs = self._outputs(got_token)
        self.last_step_tokens = plan.num_batched_tokens
        if self.adapters.unloading:
            self._drop_unused_adapters()
        self._report_step(plan, output, schedule_seconds)
        return outputs

    def _apply_staged(self) -> None:
        """Config reload, then new requests, then aborts (an abort of a request submitted in
        the same interval finds it). Under the lock: a concurrent add_request sees each
        request either staged or queued, never neither (duplicate ids, queue limits)."""
        scheduler = self.scheduler
        with self._lock:
            config, self._pending_config = self._pending_config, None
            if config is not None:
                scheduler.apply_config(config)
                self.config = config
                self.tenant_limits.configure(config.tenants, self.clock())
                self._set_tenant_weights(config)
                self.max_model_len = scheduler.max_model_len = self._max_model_len(config)
                self.limits = dataclasses.replace(self.limits, max_model_len=self.max_model_len)
            queued = self._queued_since_step
            for request in self._staged:
                if request.lane not in scheduler.lanes:  # its lane went away in a reload
                    request.lane = self.config.default_lane.name
                scheduler.add_request(request)
                queued[request.lane] = queued.get(request.lane, 0) + 1
            self._staged = []
            self._staged_ids.clear()
            self._staged_per_lane.clear()
            aborts, self._aborts = self._aborts, []
        if config is not None:
            for observer in self.observers:
                observer.on_config_applied(config, True, "applied at step boundary")
        for request_id, status, detail, asked_at in aborts:
            request = scheduler.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._cancelled_at[request_id] = asked_at
                scheduler.finish_request(request, status, detail)

    def _set_tenant_weights(self, config: RuntimeConfig) -> None:
        weights = {tenant.name: tenant.fair_share_weight for tenant in config.tenants}
        for lane in self.scheduler.lanes.values():
            lane.set_tenant_weights(weights)

    def _charge_output_tokens(self, got_token: list[Request]) -> None:
        """Output tokens count against their tenant's rate limit and fair share as produced."""
        # Counted per (tenant, lane) first: a step's tokens mostly share a few of them.
        counts: dict[tuple[str, str], int] = {}
        get = counts.get
        for request in got_token:
            key = (request.tenant, request.lane)
            counts[key] = get(key, 0) + 1
        now = self.clock()
        lanes, limits = self.scheduler.lanes, self.tenant_limits
        for (tenant, lane_name), tokens in counts.items():
            limits.charge(tenant, tokens, now)
            lane = lanes.get(lane_name)
            if lane is not None:
                lane.charge_tenant(tenant, tokens)

    def _execute(self, plan: StepPlan) -> ExecutorOutput:
        # An executor that mirrors requests on other ranks hears of ends and preemptions even then.
        if not plan.chunks and not ((plan.finished or plan.preempted) and getattr(self.executor, "mirrors_requests", False)):
            return ExecutorOutput()
        try:
            output = self.executor.execute(plan)
        except ExecutorGroupFailed:
            raise  # a rank is gone: every request would fail alike, the loop goes down
        except Exception as exc:
            # The host tier's copies of a failed step may be incomplete: its offloaded slots are
            # dropped (never re-run: the step may have written the reused blocks since).
            self.scheduler.kv.forget_failed_transfers(plan.kv_offloads, ())
            if is_out_of_memory(exc):
                return self._fail_out_of_memory(plan, exc)
            log.exception("executor step of %d chunks failed", len(plan.chunks))
            return self._execute_isolating(plan, exc)
        self._failures = 0
        return output

    def _fail_out_of_memory(self, plan: StepPlan, exc: Exception) -> ExecutorOutput:
        """The step ran out of accelerator memory: its requests end as errors (reason "oom",
        a 500 to their clients), their blocks go back to the pool, and the loop goes on with
        the other requests. Not re-run in halves as other failures are: a re-run would most
        likely run out of memory again, and an OOM says nothing about a broken executor."""
        self._oom_events += 1
        self.scheduler.kv.forget_failed_transfers((), plan.kv_restores)  # their requests fail with the step
        log.error("out of accelerator memory in a step of %d chunks (%d tokens); failing its requests: %s",
                  len(plan.chunks), plan.num_batched_tokens, exc)
        release_cached_accelerator_memory()
        return ExecutorOutput(errors={chunk.request.request_id: OOM_REASON for chunk in plan.chunks})

    def _execute_isolating(self, plan: StepPlan, exc: Exception) -> ExecutorOutput:
        """Re-run a failed step in halves until the failing chunks stand alone: they end as
        errors, every other request keeps its token. Chunks of one step are independent
        (each reads only K/V computed in earlier steps), and re-writing a chunk's K/V
        writes the same values, so re-running is safe.

        A step in which nothing succeeded counts toward MAX_CONSECUTIVE_STEP_FAILURES (any
        success resets the count); at that many in a row the executor is broken and the error
        propagates (the loop goes unhealthy). So a bad request never fails another request,
        and while other requests run it never counts against the engine. Only failing
        requests that are each alone in three consecutive steps look like a broken executor
        (inputs are validated so that none can make the executor raise)."""
        output = ExecutorOutput()
        failed_alone: dict[str, str] = {}
        succeeded = False
        if len(plan.chunks) == 1:  # already alone
            failed_alone[plan.chunks[0].request.request_id] = f"executor error: {exc}"
            pending = []
        else:
            pending = [plan.chunks[len(plan.chunks) // 2:], plan.chunks[: len(plan.chunks) // 2]]
        # The first sub-step that runs repeats the step's block copies, host-tier restores and
        # executor clean-up (all idempotent: a dst is only read past what its sequence has
        # written; a restore's host slot is pinned until the next plan) in case the failure came
        # before them.
        first = {"block_copies": plan.block_copies, "kv_restores": plan.kv_restores, "finished": plan.finished,
                 "preempted": plan.preempted}
        while pending:
            chunks = pending.pop()
            sub = StepPlan(chunks=chunks, num_batched_tokens=sum(c.num_tokens for c in chunks), **first)
            try:
                part = self.executor.execute(sub)
                first = {}
            except Exception as sub_exc:
                exc = sub_exc
                if len(chunks) == 1:
                    failed_alone[chunks[0].request.request_id] = f"executor error: {sub_exc}"
                else:
                    half = len(chunks) // 2
                    pending += [chunks[half:], chunks[:half]]
                continue
            succeeded = True
            output.sampled.update(part.sampled)
            output.logprobs.update(part.logprobs)
            output.prompt_logprobs.update(part.prompt_logprobs)
            output.errors.update(part.errors)
            output.step_seconds += part.step_seconds
        output.errors.update(failed_alone)
        if succeeded:
            self._failures = 0
            return output
        self._failures += 1
        log.error("executor failed for every request of the step (%d steps in a row)", self._failures)
        if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise exc
        return output

    def _outputs(self, got_token: list) -> list[RequestOutput]:
        """RequestOutputs of this step: new tokens, then every final status (no text: the
        front end detokenizes)."""
        output = self._output
        outputs = [output(request, request.output_token_ids[-1:]) for request in got_token]
        finished = self.scheduler.drain_finished()
        by_id = {out.request_id: out for out in outputs} if finished else {}
        for request in finished:
            self._time_kv_release(request)
            out = by_id.get(request.request_id)
            if out is None:
                out = self._output(request, [])
                outputs.append(out)
            out.finished = True
            out.finish_reason = request.finish_reason
            out.finish_detail = request.finish_detail
            self._notify_finished(request)
        return outputs

    def _time_kv_release(self, request: Request) -> None:
        """Record how long a finished request's blocks stayed taken after its end was known:
        from the cancel call (an abort waits for the step boundary), from its deadline, or
        from the end of the step that computed its last token. Only requests that held
        blocks at the end (a waiting or preempted request holds none)."""
        asked_at = self._cancelled_at.pop(request.request_id, None)
        if request.num_computed_tokens <= 0 or request.finish_time is None:
            return
        if asked_at is not None:
            start = asked_at
        elif request.finish_detail == "deadline" and request.deadline is not None:
            start = request.deadline
        else:
            start = self._ends_known_at
        self._kv_releases.append((request.lane, max(0.0, request.finish_time - start)))

    @staticmethod
    def _output(request: Request, new_ids: list[int]) -> RequestOutput:
        params = request.sampling_params
        new_logprobs = prompt_logprobs = None
        if params.logprobs is not None:
            new_logprobs = request.output_logprobs[len(request.output_logprobs) - len(new_ids):] if new_ids else []
        if params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True
            prompt_logprobs = list(request.prompt_logprobs)
        # Positional, in RequestOutput's field order: once per request and step.
        return RequestOutput(
            request.request_id, request.lane,
            new_ids,  # new_token_ids: a fresh list from the caller
            "", False, None, "",  # new_text, finished, finish_reason, finish_detail
            len(request.prompt_token_ids), len(request.output_token_ids), request.num_cached_tokens,
            new_logprobs, prompt_logprobs, request.first_scheduled_time,
        )

    # ------------------------------------------------------------------ observers

    def _notify_finished(self, request: Request) -> None:
        for observer in self.observers:
            try:
                observer.on_request_finished(request)
            except Exception:
                log.exception("observer %r failed", observer)

    def _report_step(self, plan: StepPlan, output: ExecutorOutput, schedule_seconds: float) -> None:
        # Each lane's prefill and decode tokens in one pass (256+ chunks a step), counted as
        # plan.num_prefill_tokens counts them; plain dicts here, LaneStepStats below.
        lane_prefill: dict[str, int] = {}
        lane_decode: dict[str, int] = {}
        prefill_get, decode_get = lane_prefill.get, lane_decode.get
        for chunk in plan.chunks:
            request = chunk.request
            name = request.lane
            if chunk.start < len(request.prompt_token_ids):
                lane_prefill[name] = prefill_get(name, 0) + chunk.num_tokens
            else:
                lane_decode[name] = decode_get(name, 0) + chunk.num_tokens
        prefill = sum(lane_prefill.values())
        decode = plan.num_batched_tokens - prefill
        self.estimator.observe(output.step_seconds, prefill, decode)
        queued, self._queued_since_step = self._queued_since_step, {}
        releases, self._kv_releases = self._kv_releases, []
        oom_events, self._oom_events = self._oom_events, 0
        if not self.observers:
            return
        stats = self.snapshot()
        stats.kv_releases = releases
        stats.oom_events = oom_events
        stats.step_seconds = output.step_seconds
        stats.schedule_seconds = schedule_seconds
        stats.num_batched_tokens = plan.num_batched_tokens
        stats.num_prefill_tokens = prefill
        stats.num_decode_tokens = decode
        stats.num_preemptions = len(plan.preempted)
        kv = self.scheduler.kv
        queries, hits, host_hits = self._prefix_counters
        stats.prefix_cache_queries = kv.prefix_queries - queries
        stats.prefix_cache_hits = kv.prefix_hits - hits
        stats.prefix_cache_host_hits = kv.host_prefix_hits - host_hits
        self._prefix_counters = (kv.prefix_queries, kv.prefix_hits, kv.host_prefix_hits)
        block_bytes = getattr(self.executor, "kv_bytes_per_block", 0)
        stats.kv_blocks_offloaded = len(plan.kv_offloads)
        stats.kv_blocks_restored = len(plan.kv_restores)
        stats.kv_bytes_offloaded = stats.kv_blocks_offloaded * block_bytes
        stats.kv_bytes_restored = stats.kv_blocks_restored * block_bytes
        stats.kv_restore_seconds = output.kv_restore_seconds
        lanes = stats.lanes
        for name, tokens in lane_prefill.items():
            lane = lanes.get(name)
            if lane is not None:
                lane.prefill_tokens = tokens
        for name, tokens in lane_decode.items():
            lane = lanes.get(name)
            if lane is not None:
                lane.decode_tokens = tokens
        for lane in lanes.values():
            lane.scheduled_tokens = lane.prefill_tokens + lane.decode_tokens
        for request in plan.preempted:
            lane = lanes.get(request.lane)
            if lane is not None:
                lane.preempted += 1
        for name, count in queued.items():
            lane = lanes.get(name)
            if lane is not None:
                lane.queued = count
        for name, count in self.scheduler.last_started.items():
            lane = lanes.get(name)
            if lane is not None:
                lane.started = count
        for name, blocks in self.scheduler.kv_blocks_held().items():
            lane = lanes.get(name)
            if lane is not None:
                lane.kv_blocks_held = blocks
        if self.scheduler.sched.step_time_budget == "auto":
            for name, lane in lanes.items():
                lane.time_capped = self.scheduler.time_capped_last_step(name)
        for observer in self.observers:
            try:
                observer.on_step(stats)
            except Exception:
                log.exception("observer %r failed", observer)

    def snapshot(self) -> StepStats:
        """Current KV and queue occupancy (no step numbers)."""
        scheduler = self.scheduler
        kv, quotas = scheduler.kv, scheduler.quotas
        held = quotas.held
        lanes = {
            name: LaneStepStats(
                running=lane.num_running,
                waiting=scheduler.num_waiting_in(name),
                kv_blocks_held=held.get(name, 0),  # the engine's step report recounts
            )
            for name, lane in scheduler.lanes.items()
        }
        with self._lock:
            staged = list(self._staged)
        for request in staged:
            if request.lane in lanes:
                lanes[request.lane].waiting += 1
        served = self.adapters.served
        adapters: dict[str, tuple[int, int]] = {}
        if served or self.adapters.unloading:
            counts = {name: [0, 0] for name in served}
            for request in list(scheduler.requests.values()) + staged:
                name = request.adapter
                if name is not None:
                    entry = counts.setdefault(name, [0, 0])
                    entry[0 if request.status is RequestStatus.RUNNING else 1] += 1
            adapters = {name: (c[0], c[1]) for name, c in counts.items()}
        return StepStats(
            max_loras=self.config.engine.lora_slots,
            block_size=kv.block_size,
            adapters=adapters,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_cached_free=kv.num_cached_free_blocks,
            # Free blocks only lanes below their kvCacheReserved may take (O(lanes)).
            kv_blocks_reserved=min(kv.num_free_blocks, sum(quotas.unmet(name) for name in quotas.reserve)),
            kv_usage=kv.usage,
            kv_host_blocks_total=kv.host.num_slots if kv.host is not None else 0,
            kv_host_blocks_used=kv.host.num_used_slots if kv.host is not None else 0,
            lanes=lanes,
        )
