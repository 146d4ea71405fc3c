"""The C helper pool (kernels/csrc/pool.c, "the helper pool"; `cpu_native.pool_step`): in a pool
step the decode attention, prefill attention and panel kernels share their items with helper
threads instead of torch's OpenMP team. Each item is computed the same way whichever thread
claims it, so every kernel's result is bitwise the OpenMP team's (and one thread's); the pool
never hands one caller's items to another, survives a fork, and puts its helpers where
engine.cpuBind says."""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from tokenlane.kernels import cpu_native
from tokenlane.kernels.cpu_attention import paged_attention_cpu

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason=f"no native library here: {cpu_native.load_error()}")


# The bitwise tests run on every prebuilt level this CPU runs (tests/conftest.py, native_levels).
every_level = pytest.mark.usefixtures("native_level")


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


def _attention(case, threads: int, pool: bool) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))

    def call():
        paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.seq_lens, case.query_start_loc, case.scale, out, native=True)

    if pool:
        with cpu_native.pool_step(threads):
            call()
    else:
        torch.set_num_threads(threads)
        try:
            call()
        finally:
            torch.set_num_threads(1)
    return out


@every_level
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_in_a_pool_step_is_the_openmp_teams_to_the_bit(kcase, threads, cache_dtype):
    """48 decodes and two prefill chunks with cached context (both C kernels), on the pool and on
    the OpenMP team; 3 threads on a 2-core host too (more helpers than cores)."""
    rng = random.Random(threads)
    shapes = [(rng.randint(16, 600), 1) for _ in range(48)] + [(300, 70), (90, 90)]
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=8, num_kv_heads=4,
                       head_dim=32, block_size=16, dtype=cache_dtype, seed=threads)
    team = _attention(case, threads, pool=False)
    pooled = _attention(case, threads, pool=True)
    assert not torch.isnan(pooled).any()
    assert torch.equal(pooled, team)
    assert torch.equal(_attention(case, 1, pool=False), team)


@every_level
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", [(1, 256, 32000), (16, 256, 1376), (64, 200, 257), (96, 64, 130), (5, 33, 65)])
def test_panels_in_a_pool_step_are_the_openmp_teams_to_the_bit(rows, k, n, dtype):
    """Products and the fused argmax: slices of panels claimed by whichever thread is free give
    the same bits, and the argmax the same first column, as the team's and one thread's."""
    if dtype == torch.bfloat16 and not cpu_native.panel_bf16_pairs():
        pytest.skip("bf16 panels need AVX512-BF16")
    gen = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    linear = cpu_native.PanelLinear((torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype),
                                    torch.randn(n, generator=gen).to(dtype))
    want, want_argmax = linear(x), linear.argmax(x)
    for threads in (2, 3):
        with cpu_native.pool_step(threads):
            assert cpu_native.in_pool_step() and cpu_native.pool_threads() == threads
            got, got_argmax = linear(x), linear.argmax(x)
        assert torch.equal(got, want) and torch.equal(got_argmax, want_argmax)
        assert torch.equal(got_argmax, linear(x).float().argmax(dim=-1))


def test_a_pool_step_runs_torch_on_one_thread_and_restores_its_count():
    torch.set_num_threads(2)
    try:
        with cpu_native.pool_step(2):
            assert torch.get_num_threads() == 1 and cpu_native.pool_threads() == 2
        assert torch.get_num_threads() == 2 and not cpu_native.in_pool_step()
        assert cpu_native.pool_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with cpu_native.pool_step(2):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2 and not cpu_native.in_pool_step()
    finally:
        torch.set_num_threads(1)


def test_concurrent_callers_each_get_their_own_results():
    """Two threads in pool steps at once (two engines in one process): one caller has the pool,
    the other runs its items itself; neither gets the other's items."""
    gen = torch.Generator().manual_seed(5)
    linears = [cpu_native.PanelLinear(torch.randn(2000, 128, generator=gen)) for _ in range(2)]
    inputs = [torch.randn(32, 128, generator=gen) for _ in range(2)]
    wants = [linear(x) for linear, x in zip(linears, inputs)]
    failures: list[str] = []

    def worker(i: int) -> None:
        with cpu_native.pool_step(2):
            for _ in range(200):
                if not torch.equal(linears[i](inputs[i]), wants[i]):
                    failures.append(f"caller {i}")
                    return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and failures == []


def _pool_helpers(pid: str = "self") -> dict[str, str]:
    """tid -> name of the pool's helper threads (named tl-pool-<worker>)."""
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("tl-pool-"):
            names[tid] = name
    return names


def test_helpers_are_started_once_named_and_take_items():
    linear = cpu_native.PanelLinear(torch.randn(4000, 64))
    x = torch.randn(8, 64)
    want = linear(x)
    before = cpu_native.pool_helper_items()
    with cpu_native.pool_step(3):
        linear(x)
    first = _pool_helpers()
    assert {"tl-pool-1", "tl-pool-2"} <= set(first.values())
    # A helper that wakes after the caller has claimed every item takes none; within a few
    # calls (or, on a very busy host, many more) one is awake in time.
    deadline = time.monotonic() + 120
    while cpu_native.pool_helper_items() == before and time.monotonic() < deadline:
        with cpu_native.pool_step(3):
            assert torch.equal(linear(x), want)
    assert cpu_native.pool_helper_items() > before
    assert _pool_helpers() == first  # reused, not restarted


def _seeded_product():
    gen = torch.Generator().manual_seed(9)
    return cpu_native.PanelLinear(torch.randn(3000, 64, generator=gen)), torch.randn(16, 64, generator=gen)


def _child_product(queue) -> None:
    linear, x = _seeded_product()
    with cpu_native.pool_step(2):
        queue.put(linear(x).tolist())


def test_a_forked_child_runs_pool_steps():
    """A child forked after the pool started has no helpers (threads do not survive fork); its
    pool steps run on the caller and finish."""
    with cpu_native.pool_step(2):
        cpu_native.PanelLinear(torch.randn(500, 32))(torch.randn(4, 32))
    assert _pool_helpers()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_product, args=(queue,))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    linear, x = _seeded_product()
    assert child.exitcode == 0 and torch.equal(torch.tensor(got), linear(x))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_bind_threads_pins_the_pool_helpers():
    """engine.cpuBind pins the helpers as it pins the OpenMP team: helper i on the i-th CPU."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    code = f"""
import os, torch
from tokenlane.kernels import cpu_native
with cpu_native.pool_step(2):
    cpu_native.PanelLinear(torch.randn(500, 32))(torch.randn(4, 32))
assert cpu_native.bind_threads({cpus}) is not None
masks = {{}}
for tid in os.listdir("/proc/self/task"):
    name = open(f"/proc/self/task/{{tid}}/comm").read().strip()
    if name.startswith("tl-pool-"):
        status = open(f"/proc/self/task/{{tid}}/status").read()
        masks[name] = next(l.split(":", 1)[1].strip() for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
print(masks)
assert masks == {{"tl-pool-1": "{cpus[1]}"}}, masks
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
