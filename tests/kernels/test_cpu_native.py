"""kernels/csrc (the CPU `backend="native"` decode and prefill kernels) against the
float64 dense reference and the torch reference: head sizes on the vector path (32, 64, 128)
and off it (16, 80), GQA ratios 1-8 and one outside the fixed set (3), block sizes 1-32,
float32 / bfloat16 / float16 caches, one and two threads, thousands of blocks; plus the
launchers' checks, and the developer build (TOKENLANE_NATIVE_JIT): its fallback when there is
no compiler, its cache, its pthread fallback. tests/kernels/test_native_build.py checks the
prebuilt libraries (the wheel's) and the choice of one for this CPU.

The test caches hold NaN in every block no sequence owns and in the table padding
(tests/kernels/conftest.py), so a read past a sequence's context shows up as NaN."""

from __future__ import annotations

import platform
import random
import shutil
import subprocess

import pytest
import torch

from tokenlane.kernels import api, cpu_native, native_build
from tokenlane.kernels.cpu_attention import paged_attention_cpu
from tokenlane.kernels.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason=f"no native library here: {cpu_native.load_error()}")

# (context length, query length): decodes of spread lengths (some not a multiple of 8, the
# vector path's token chunk, or of the block size), chunks with cached context, a fresh chunk,
# an idle sequence; shuffled per case.
MIXED = [(37, 1), (1, 1), (120, 1), (96, 1), (50, 9), (17, 17), (64, 1), (5, 0), (33, 1),
         (90, 32), (2, 1), (119, 1), (8, 1), (16, 1), (45, 1)]
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Each numeric test runs on every prebuilt level this CPU runs (tests/conftest.py, native_levels).
every_level = pytest.mark.usefixtures("native_level")


def run(case, threads=1, query_dtype=torch.float32):
    query = case.query.to(query_dtype)
    out = torch.full_like(query, float("nan"))
    torch.set_num_threads(threads)
    try:
        paged_attention_cpu(query, case.key_cache, case.value_cache, case.block_tables,
                            case.seq_lens, case.query_start_loc, case.scale, out, native=True)
    finally:
        torch.set_num_threads(1)
    return out


def check(got, case, kcase, atol=2e-5):
    """Against float64 dense attention over the same K/V and query (the test query is
    already rounded to the cache dtype, so widening it to float32 is exact)."""
    assert not torch.isnan(got).any(), "unwritten rows, or a read past a sequence's context"
    torch.testing.assert_close(got.double(), kcase.dense(case), atol=atol, rtol=atol)


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):  # tests/conftest.py
    yield


@every_level
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_mixed_batch_matches_dense_reference(kcase, group, head_dim, cache_dtype):
    """Groups 1, 2, 4 and 8 have a build of their own of the vector path, 3 and 5-7 its build
    with the group known at run time; head sizes 16 and 80 take the generic loop."""
    shapes = MIXED[:]
    rng = random.Random(group * 1000 + head_dim)
    rng.shuffle(shapes)
    block_size = rng.choice([1, 8, 16, 32])
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=2 * group,
                       num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                       dtype=cache_dtype, seed=group + head_dim)
    check(run(case), case, kcase)


@every_level
@pytest.mark.parametrize("head_dim, group", [(31, 17), (63, 18), (126, 34)])
def test_generic_shapes_are_not_taken_for_vector_path_shapes(kcase, head_dim, group):
    """The kernel picks its path by (head size, group): shapes whose old key d * 16 + G equals
    a vector-path shape's (31 * 16 + 17 == 32 * 16 + 1) must still take the generic path."""
    case = kcase.build([37, 20, 64], [1, 1, 1], num_heads=group, num_kv_heads=1, head_dim=head_dim,
                       block_size=16, dtype=torch.float32, seed=head_dim)
    check(run(case), case, kcase)


@every_level
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_decodes_on_threads_match_torch_path(kcase, threads, cache_dtype):
    """64 decodes of 16-700 tokens (enough work for every thread), block size 16, against
    the torch path (grouped SDPA) on the same inputs."""
    rng = random.Random(threads)
    shapes = [(rng.randint(16, 700), 1) for _ in range(64)] + [(200, 40)]
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=8,
                       num_kv_heads=4, head_dim=32, block_size=16, dtype=cache_dtype)
    got = run(case, threads)
    torch_path = paged_attention_cpu(case.query.float(), case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens, case.query_start_loc,
                                     case.scale)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, torch_path, atol=2e-5, rtol=2e-5)


@every_level
@pytest.mark.parametrize("group", [1, 2, 8])
def test_few_decodes_on_two_threads_split_by_head(kcase, group):
    """Fewer decodes than 4 per thread, with enough work for both threads: the work is cut
    per KV head instead of per decode."""
    from tokenlane.kernels import cpu_attention

    lens = [3000, 1500, 2100, 64]
    assert sum(lens[:3]) * 4 >= cpu_attention._NATIVE_PARALLEL_ROWS  # two threads run
    case = kcase.build(lens, [1, 1, 1, 7], num_heads=4 * group, num_kv_heads=4, head_dim=64,
                       block_size=16)
    check(run(case, threads=2), case, kcase)


@every_level
def test_bf16_queries_write_bf16_rows(kcase):
    """A bf16 model computing in bf16: queries are widened, the output rounded back."""
    case = kcase.build([c for c, _ in MIXED], [q for _, q in MIXED], num_heads=4,
                       num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    got = run(case, query_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.query_start_loc, case.scale)
    torch.testing.assert_close(got, paged_attention_ref(*args), atol=1.6e-2, rtol=1.6e-2)


@every_level
def test_large_pool_and_long_tables(kcase):
    """Thousands of blocks and tables with hundreds of entries (block size 1)."""
    rng = random.Random(1)
    shapes = [(rng.randint(200, 700), 1) for _ in range(12)] + [(400, 24)]
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=8,
                       num_kv_heads=2, head_dim=64, block_size=1, num_blocks=12000,
                       spare_blocks=0, poison_cache=False)
    assert case.block_tables.shape[1] > 600
    check(run(case, threads=2), case, kcase)


# (context length, query length) of prefill chunks: fresh ones (equal), chunks with cached
# context, lengths around the kernel's row tile (8 or 16 rows) and its key chunk, two rows.
PREFILL = [(130, 130), (700, 40), (2, 2), (33, 17), (16, 16), (95, 31), (64, 1), (300, 9)]


@every_level
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 7, 8])
def test_prefill_chunks_match_dense_reference(kcase, monkeypatch, group, head_dim, cache_dtype, threads):
    """Prefill chunks of the shapes the C prefill kernel takes go through it in one call (a
    decode in the batch keeps the decode kernel), against float64 dense causal attention."""
    calls = []
    prefill = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *a, **k: calls.append(1) or prefill(*a, **k))
    shapes = PREFILL[:]
    rng = random.Random(group * 100 + head_dim)
    rng.shuffle(shapes)
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=2 * group,
                       num_kv_heads=2, head_dim=head_dim, block_size=rng.choice([1, 8, 16, 32]),
                       dtype=cache_dtype, seed=group + head_dim)
    check(run(case, threads), case, kcase)
    assert calls == [1]


@every_level
def test_prefill_kernel_refuses_what_it_does_not_take(kcase, monkeypatch):
    """Head sizes other than 32 and 64 stay on the torch path (any GQA ratio up to MAX_GROUP
    is taken); the launcher refuses them and bad indices (nothing written)."""
    assert cpu_native.prefill_supported(32, 2) and cpu_native.prefill_supported(64, 8)
    assert cpu_native.prefill_supported(32, 3) and cpu_native.prefill_supported(64, 7)
    assert cpu_native.prefill_supported(64, cpu_native.MAX_GROUP)
    assert not cpu_native.prefill_supported(64, cpu_native.MAX_GROUP + 1)
    assert not cpu_native.prefill_supported(128, 4) and not cpu_native.prefill_supported(16, 2)
    calls = []
    with monkeypatch.context() as patched:
        patched.setattr(cpu_native, "paged_prefill_attention", lambda *a, **k: calls.append(1))
        case = kcase.build([90, 20], [30, 20], num_heads=8, num_kv_heads=2, head_dim=128)
        check(run(case), case, kcase)  # the torch path
    assert calls == []
    case = kcase.build([90, 20], [30, 20], num_heads=4, num_kv_heads=2, head_dim=32)
    out = case.query.new_full(case.query.shape, float("nan"))
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables)
    with pytest.raises(ValueError, match="head sizes 32 and 64"):
        wide = kcase.build([20], [20], num_heads=2, num_kv_heads=2, head_dim=128)
        cpu_native.paged_prefill_attention(wide.query, wide.key_cache, wide.value_cache, wide.block_tables,
                                           i32([0]), i32([20]), i32([20]), i32([0]), 0.1, wide.query.clone())
    bad = [
        (i32([0, 30]), i32([30, 20]), i32([90, 19]), i32([0, 1])),  # context shorter than the chunk
        (i32([0, 40]), i32([30, 20]), i32([90, 20]), i32([0, 1])),  # rows past the batch
        (i32([0, 30]), i32([30, 20]), i32([90, 20]), i32([0, 2])),  # no such block-table row
        (i32([0, 30]), i32([30, 20]), i32([9000, 20]), i32([0, 1])),  # past the table
    ]
    for starts, lens, ctx, seqs in bad:
        with pytest.raises(ValueError, match="out of range"):
            cpu_native.paged_prefill_attention(*args, starts, lens, ctx, seqs, case.scale, out)
        assert torch.isnan(out).all()
    table = case.block_tables.clone()
    table[0, 0] = case.key_cache.shape[0]  # a block past the cache
    with pytest.raises(ValueError, match="out of range"):
        cpu_native.paged_prefill_attention(case.query, case.key_cache, case.value_cache, table, i32([0, 30]),
                                           i32([30, 20]), i32([90, 20]), i32([0, 1]), case.scale, out)
    assert torch.isnan(out).all()


@every_level
def test_api_dispatch_and_backend_resolution(kcase):
    cpu = torch.device("cpu")
    assert api.resolve_backend("auto", cpu) == "native"
    assert api.resolve_backend("native", cpu) == "native"
    with pytest.raises(ValueError, match="CPU only"):
        api.resolve_backend("native", torch.device("cuda"))
    case = kcase.build([40, 7, 90], [1, 1, 5], num_heads=4, num_kv_heads=2, head_dim=32)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.query_start_loc, case.scale)
    got = api.paged_attention(*args, out=kcase.poisoned_out(case), backend="native")
    check(got, case, kcase)


@every_level
def test_launcher_rejects_bad_inputs(kcase):
    case = kcase.build([40, 7], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32)
    q, k, v, tables = case.query, case.key_cache, case.value_cache, case.block_tables
    rows = torch.tensor([0, 1], dtype=torch.int32)
    lens = case.seq_lens.clone()
    out = torch.empty_like(q)

    def launch(**kw):
        a = dict(query=q, key_cache=k, value_cache=v, block_tables=tables, rows=rows, seqs=rows,
                 lens=lens, max_len=40, scale=case.scale, out=out)
        a.update(kw)
        return cpu_native.paged_decode_attention(**a)

    with pytest.raises(ValueError, match="float32"):
        launch(query=q.double(), out=out.double())
    with pytest.raises(ValueError, match="multiple of KV heads"):
        launch(query=q[:, :3].contiguous(), out=out[:, :3].contiguous())
    with pytest.raises(ValueError, match="must match the key cache"):
        launch(value_cache=v[:, :8])
    with pytest.raises(ValueError, match="cache dtype"):
        launch(key_cache=k.double(), value_cache=v.double())
    with pytest.raises(ValueError, match="int32"):
        launch(rows=rows.long())
    with pytest.raises(ValueError, match="one length"):
        launch(lens=lens[:1])
    with pytest.raises(ValueError, match="contiguous last axis"):
        launch(query=q.transpose(1, 2).contiguous().transpose(1, 2))
    # Indices are checked before any is followed: an error, not a read outside the cache.
    bad_tables = tables.clone()
    bad_tables[1, 0] = k.shape[0]  # one past the last block
    for bad in (dict(block_tables=bad_tables), dict(seqs=torch.tensor([0, 2], dtype=torch.int32)),
                dict(rows=torch.tensor([0, q.shape[0]], dtype=torch.int32)),
                dict(lens=torch.tensor([40, 0], dtype=torch.int32))):
        out.fill_(float("nan"))
        with pytest.raises(ValueError, match="out of range"):
            launch(**bad)
        assert torch.isnan(out).all()  # nothing written
    launch()  # the same call with good inputs runs
    torch.testing.assert_close(out, paged_attention_ref(
        q, k, v, tables, case.seq_lens, case.query_start_loc, case.scale))


def fresh_load(monkeypatch, jit: bool) -> None:
    """The next `load()` starts over: the developer build (TOKENLANE_NATIVE_JIT) or the prebuilt
    library; monkeypatch puts the loaded library back afterwards."""
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_loaded", None)
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_load_error", None)
    if jit:
        monkeypatch.setenv(cpu_native.JIT_ENV, "1")
    else:
        monkeypatch.delenv(cpu_native.JIT_ENV, raising=False)


def needs_compiler():
    if native_build.compiler_version(native_build.compiler()) is None:
        pytest.skip(f"no C compiler here ({native_build.compiler()!r}): the developer build needs one")


def test_no_compiler_falls_back_to_torch_with_the_reason(monkeypatch, tmp_path):
    """The developer build without a working compiler: `auto` keeps the torch path and `native`
    is refused with the compiler's reason; a fresh cache directory is used (no stale library
    found)."""
    fresh_load(monkeypatch, jit=True)
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(cpu_native.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not cpu_native.available()
    assert "no C compiler" in cpu_native.load_error()
    cpu = torch.device("cpu")
    assert api.resolve_backend("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="is not available here"):
        api.resolve_backend("native", cpu)


# A compiler that refuses -fopenmp: the developer build falls back to the kernels' own pthreads.
NO_OPENMP = native_build.OPENMP_FLAGS + ("-fno-such-option-here",)


def load_pthread_build(monkeypatch, cache) -> None:
    """The next load is the developer build with a compiler that refuses -fopenmp, from `cache`."""
    needs_compiler()
    monkeypatch.setattr(native_build, "OPENMP_FLAGS", NO_OPENMP)
    fresh_load(monkeypatch, jit=True)
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(cache))


@pytest.fixture(scope="module")
def pthread_build(tmp_path_factory):
    """One developer build (about 20 s of compiling on 2 cores) into a fresh cache directory,
    shared by the tests that read it: (the directory, its libraries just after the build, their
    modification times). The library loaded before is put back at once: each test loads the
    build itself, from the cache."""
    cache = tmp_path_factory.mktemp("jit-cache")
    with pytest.MonkeyPatch.context() as mp:
        load_pthread_build(mp, cache)
        assert cpu_native.available(), cpu_native.load_error()
    built = sorted((cache / "native").iterdir())
    return cache, [p.name for p in built], [p.stat().st_mtime_ns for p in built]


def test_build_is_cached_per_source_and_machine(monkeypatch, pthread_build):
    """The developer build: a fresh cache directory gets one library named by the key; a
    second load reuses it."""
    cache, built, mtimes = pthread_build
    assert len(built) == 1 and built[0].startswith("cpu_native-") and built[0].endswith(".so")
    load_pthread_build(monkeypatch, cache)
    assert cpu_native.available(), cpu_native.load_error()
    assert cpu_native.loaded_library().jit and cpu_native.loaded_library().level == "native"
    assert cpu_native.loaded_library().path == cache / "native" / built[0]
    assert [p.stat().st_mtime_ns for p in sorted((cache / "native").iterdir())] == mtimes
    assert sorted(p.name for p in (cache / "native").iterdir()) == built


@every_level
def test_the_kernel_threads_are_the_callers_openmp_team():
    """Built with OpenMP, the kernel runs on the caller's OpenMP team: with torch in the process,
    torch's own thread pool (one libgomp mapped), not threads of its own that would share the
    cores with torch's spinning workers."""
    library = cpu_native.loaded_library()
    if not library.jit:
        built = native_build.read_manifest()["levels"][library.level]
        if not built["openmp"]:
            pytest.skip(f"{library.level} was built without OpenMP (the kernel uses its pthread fallback): "
                        f"{' '.join(built['flags'])}")
    needed = subprocess.run(["ldd", str(library.path)], capture_output=True, text=True).stdout
    assert "gomp" in needed
    assert cpu_native.available()
    maps = {line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line.split()[-1]}
    assert len(maps) == 1, maps


def test_without_openmp_the_pthread_build_gives_the_same_results(monkeypatch, pthread_build, kcase):
    """A compiler that refuses -fopenmp: the build falls back to the kernel's own pthreads (the
    launcher's other branch), with the same results on two threads."""
    cache, built, _ = pthread_build
    load_pthread_build(monkeypatch, cache)
    assert cpu_native.available(), cpu_native.load_error()
    assert "gomp" not in subprocess.run(["ldd", str(cache / "native" / built[0])], capture_output=True,
                                        text=True).stdout
    rng = random.Random(7)
    shapes = [(rng.randint(16, 300), 1) for _ in range(32)]
    case = kcase.build([c for c, _ in shapes], [q for _, q in shapes], num_heads=8,
                       num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
    check(run(case, threads=2), case, kcase)


@every_level
@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs objdump on x86-64")
def test_the_built_kernel_keeps_its_prefetches():
    """The decode kernel prefetches each next block of the scattered pool. GCC deleted every
    call of the prefetch helper while it was an ordinary inline function (a function whose only
    effect is a prefetch counts as free of side effects), silently."""
    text = subprocess.run(["objdump", "-d", str(cpu_native.loaded_library().path)], capture_output=True, text=True,
                          check=True).stdout
    kept = "prefetch" in text
    assert kept, "the built library has no prefetch instruction"


@every_level
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_matches_torch_including_ties_nan_and_inf(threads):
    torch.set_num_threads(threads)  # [9, 32000] is split over the threads
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32000, generator=gen)
    x[0, [10, 20]] = x[0].max() + 1  # a tie: the first index wins
    x[1, [30000, 5]] = float("nan")  # NaN wins, the first one
    x[2] = float("-inf")  # every value masked (index 0, as torch)
    x[3, 31999] = float("inf")
    x[4] = 0.0  # all equal
    x[5, :-3] = float("-inf")  # only the tail (past the last full 8-lane chunk) is finite
    x[6, 7] = float("nan")
    odd = torch.randn(4, 13, generator=gen)  # a width that is not a multiple of 8
    strided = torch.randn(5, 40, generator=gen)[:, :33]  # a row stride != width
    for batch in (x, odd, strided, x[:0]):
        assert torch.equal(cpu_native.argmax_rows(batch), batch.argmax(dim=-1)), batch.shape
        assert torch.equal(api.argmax_rows(batch), batch.argmax(dim=-1))
    ties = torch.zeros(3, 40)
    ties[0, [10, 18]] = 1.0  # the same 8-lane column: the first
    ties[1, [18, 13]] = 1.0  # the later lane holds the earlier index
    ties[2, [3, 35]] = 1.0  # the vector part and the tail
    # Few distinct values, so every row has ties; every width from 1 to 70.
    small = [torch.randint(-3, 3, (6, w), generator=gen).float() for w in range(1, 71)]
    for batch in (ties, *small):
        assert torch.equal(cpu_native.argmax_rows(batch), batch.argmax(dim=-1)), batch
    bf16 = x.to(torch.bfloat16)  # other dtypes take torch's own argmax
    assert torch.equal(api.argmax_rows(bf16), bf16.argmax(dim=-1))
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        cpu_native.argmax_rows(x.double())


# ------------------------------------------------------------------ the KV cache write

def _kv_write_case(cache_dtype, num_tokens=37, hkv=4, d=64, block_size=16, num_blocks=9, seed=0):
    """K and V as views of one qkv matrix (as the model passes them), shuffled slots with two
    skipped (-1), and caches full of NaN so every untouched element shows."""
    gen = torch.Generator().manual_seed(seed)
    hq = 2 * hkv
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen) * 3
    # Values whose rounding matters: exact ties between two bf16/fp16 neighbours, specials.
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -11 + 2 ** -22,
                            float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, 65520.0])
    qkv[0, hq * d:hq * d + special.numel()] = special
    qkv[1, (hq + hkv) * d:(hq + hkv) * d + special.numel()] = special
    key = qkv[:, hq * d:(hq + hkv) * d].view(num_tokens, hkv, d)
    value = qkv[:, (hq + hkv) * d:].view(num_tokens, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11]] = -1
    shape = (num_blocks, block_size, hkv, d)
    caches = [torch.full(shape, float("nan"), dtype=cache_dtype) for _ in range(2)]
    return key, value, caches, slots


@every_level
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_kv_write_is_bit_exact_with_the_torch_write(cache_dtype):
    from tokenlane.kernels.reference import write_kv_cache_ref

    key, value, (kc, vc), slots = _kv_write_case(cache_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_cache_ref(key, value, want_k, want_v, slots)
    assert cpu_native.can_write_kv(key, value, kc, vc, slots)
    assert cpu_native.write_kv_cache(key, value, kc, vc, slots)
    assert_same_bits(kc, want_k)
    assert_same_bits(vc, want_v)


def assert_same_bits(got, want):
    """Bit patterns equal (the same rounding, nothing else touched), except that NaN may be
    any NaN: torch's own float32 -> bfloat16 gives 0x7fc0 or 0xffff, by code path."""
    bits = {torch.float32: torch.int32}.get(got.dtype, torch.int16)
    same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ"


@every_level
def test_kv_write_copies_rows_already_in_the_cache_dtype():
    from tokenlane.kernels.reference import write_kv_cache_ref

    key, value, (kc, vc), slots = _kv_write_case(torch.bfloat16, seed=1)
    key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)  # contiguous, alike strides
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_cache_ref(key, value, want_k, want_v, slots)
    api.write_kv_cache(key, value, kc, vc, slots, backend="native")
    assert_same_bits(kc, want_k)
    assert_same_bits(vc, want_v)


@every_level
def test_kv_write_dispatch_and_refusals(monkeypatch):
    key, value, (kc, vc), slots = _kv_write_case(torch.float32, seed=2)
    calls = []
    write = cpu_native.write_kv_cache
    monkeypatch.setattr(cpu_native, "write_kv_cache", lambda *a: calls.append(1) or write(*a))
    api.write_kv_cache(key, value, kc, vc, slots, backend="native")
    api.write_kv_cache(key, value, kc, vc, slots, backend="torch")  # the torch path stays torch
    assert calls == [1]
    # Inputs the C write does not take go to the torch write (here: int32 slots, unlike strides).
    assert not cpu_native.can_write_kv(key, value, kc, vc, slots.int())
    assert not cpu_native.can_write_kv(key, value.contiguous(), kc, vc, slots)
    api.write_kv_cache(key, value.contiguous(), kc, vc, slots, backend="native")
    assert calls == [1]
    before = kc.clone()
    bad = slots.clone()
    bad[-1] = kc.shape[0] * kc.shape[1]  # one past the last slot
    with pytest.raises(ValueError, match="past the cache"):
        cpu_native.write_kv_cache(key, value, kc, vc, bad)
    assert_same_bits(kc, before)  # nothing written


def _rope_case(cache_dtype, hq, hkv, d, num_tokens=23, block_size=16, num_blocks=5, seed=0):
    """One layer's qkv rows, cos and signed sin of random positions (as runtime/executor/llama.py's
    RotaryEmbedding and signed_sin make them), slots with one skipped, NaN-filled caches."""
    from tokenlane.runtime.executor.llama import signed_sin

    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen) * 3
    positions = torch.randint(0, 5000, (num_tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * 1.25, emb.sin() * 1.25  # an attention_scaling, as llama3/yarn have
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1
    caches = [torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=cache_dtype) for _ in range(2)]
    return qkv, cos, signed_sin(sin), caches, slots


@every_level
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq, hkv, d", [(8, 4, 32), (4, 4, 64), (32, 8, 128), (6, 2, 10)])
def test_rope_write_kv_is_bitwise_the_torch_ops(cache_dtype, hq, hkv, d):
    """The fused C call gives the bits of runtime/executor/llama.py's apply_rope_ (two products, then
    their sum: no fused multiply-add) and of the torch KV write, for the queries, the keys and
    every cache element."""
    from tokenlane.kernels.reference import write_kv_cache_ref
    from tokenlane.runtime.executor.llama import apply_rope_

    qkv, cos, sin, (kc, vc), slots = _rope_case(cache_dtype, hq, hkv, d)
    want, want_k, want_v = qkv.clone(), kc.clone(), vc.clone()
    t = qkv.shape[0]
    apply_rope_(want[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    write_kv_cache_ref(want[:, hq * d:(hq + hkv) * d].view(t, hkv, d), want[:, (hq + hkv) * d:].view(t, hkv, d),
                       want_k, want_v, slots)
    assert api.rope_write_kv(qkv, hq, hkv, cos, sin, kc, vc, slots, backend="native")
    assert_same_bits(qkv, want)
    assert_same_bits(kc, want_k)
    assert_same_bits(vc, want_v)


@every_level
def test_rope_write_kv_refusals_leave_everything_as_it_was():
    qkv, cos, sin, (kc, vc), slots = _rope_case(torch.float32, 8, 4, 32)
    before = qkv.clone()
    # Not the native backend, or inputs the C call does not take: False, nothing done.
    assert not api.rope_write_kv(qkv, 8, 4, cos, sin, kc, vc, slots, backend="torch")
    assert not api.rope_write_kv(qkv.double(), 8, 4, cos, sin, kc, vc, slots, backend="native")
    assert not api.rope_write_kv(qkv, 8, 4, cos[:, :16], sin[:, :16], kc, vc, slots, backend="native")
    assert not api.rope_write_kv(qkv, 6, 5, cos, sin, kc, vc, slots, backend="native")  # Hkv != cache's
    assert not api.rope_write_kv(qkv, 8, 4, cos, sin, kc, vc, slots.int(), backend="native")
    assert not api.rope_write_kv(qkv[:, :-1], 8, 4, cos, sin, kc, vc, slots, backend="native")
    assert_same_bits(qkv, before)
    assert bool(kc.isnan().all()) and bool(vc.isnan().all())
    bad = slots.clone()
    bad[-1] = kc.shape[0] * kc.shape[1]  # one past the last slot: refused before anything changes
    with pytest.raises(ValueError, match="past the cache"):
        api.rope_write_kv(qkv, 8, 4, cos, sin, kc, vc, bad, backend="native")
    assert_same_bits(qkv, before)
    assert bool(kc.isnan().all())


@every_level
def test_each_level_runs_its_own_library(native_level):
    """The per-level fixture swaps the library itself, not just its name: the level loaded and
    its panel width (four float vectors: 64 columns with AVX-512, 32 with AVX2)."""
    assert cpu_native.loaded_library() == native_level
    if native_level.level.startswith("x86-64"):
        assert cpu_native.panel_width() == (64 if native_level.level.startswith("x86-64-v4") else 32)


# ------------------------------------------------------------------ RMSNorm

def _torch_rms_norm(x, weight, eps):
    """runtime/executor/llama.py's RMSNorm (the torch path of kernels.api.rms_norm)."""
    return api.rms_norm(x, weight, eps, backend="torch")


@every_level
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, cols", [(1, 256), (16, 256), (64, 4096), (2048, 256), (7, 13), (3, 1)])
def test_rms_norm_matches_torch_and_float64(rows, cols, threads):
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=gen) * 3
    weight = torch.randn(cols, generator=gen)
    torch.set_num_threads(threads)  # 2048 x 256 is split over the threads
    try:
        got = cpu_native.rms_norm(x, weight, 1e-5)
        assert torch.equal(api.rms_norm(x, weight, 1e-5, backend="native"), got)
    finally:
        torch.set_num_threads(1)
    want = _torch_rms_norm(x, weight, 1e-5)
    # Only the sum of squares is added in another order: a few ulp of float32 at most.
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-7)
    x64 = x.double()
    exact = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


@every_level
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, cols", [(1, 256), (16, 256), (64, 4096), (2048, 256), (7, 13)])
def test_bf16_rms_norm_rounds_as_transformers(rows, cols, threads):
    """bf16 as LlamaRMSNorm: float32 statistics, the normed row rounded to bf16, then times the
    bf16 weight, rounded again. Where the float32 scale matches torch's to the bit, so does every
    output; a last-bit difference in the sum of squares can move a normed value next to a
    rounding boundary by one bf16 step, and its product with the weight, rounded again, by at
    most two (seen on an AVX-512 Xeon: 5 of [64, 4096] values one step apart, 0.995% relative
    where the product sits at the bottom of its binade)."""
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(torch.bfloat16)
    weight = torch.randn(cols, generator=gen).to(torch.bfloat16)
    torch.set_num_threads(threads)
    try:
        got = cpu_native.rms_norm(x, weight, 1e-6)
    finally:
        torch.set_num_threads(1)
    want = _torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)
    assert (got == want).float().mean() >= 0.99
    # A row whose float32 sum of squares is exact in any order (small integers) is bitwise
    # torch's.
    ints = torch.randint(-8, 9, (rows, cols), generator=gen).to(torch.bfloat16)
    assert torch.equal(cpu_native.rms_norm(ints, weight, 1e-6), _torch_rms_norm(ints, weight, 1e-6))


@every_level
def test_rms_norm_takes_strided_rows_and_refuses_what_it_cannot():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 80, generator=gen)
    rows = base[::2, :64]  # a row stride other than the width
    weight = torch.randn(64, generator=gen)
    torch.testing.assert_close(cpu_native.rms_norm(rows, weight, 1e-6),
                               _torch_rms_norm(rows, weight, 1e-6), rtol=4e-7, atol=1e-7)
    assert cpu_native.rms_norm(base[:0, :64], weight, 1e-6).shape == (0, 64)
    for x, w in [(rows.double(), weight.double()), (rows, weight[:32]), (rows.t(), weight),
                 (rows.to(torch.bfloat16), weight), (rows.half(), weight.half()), (rows[None], weight)]:
        assert not cpu_native.can_rms_norm(x, w)
        with pytest.raises(ValueError, match="rms_norm needs"):
            cpu_native.rms_norm(x, w, 1e-6)
    # kernels.api falls back to torch for inputs the kernel does not take.
    half = rows.half()
    assert torch.equal(api.rms_norm(half, weight.half(), 1e-6, backend="native"),
                       _torch_rms_norm(half, weight.half(), 1e-6))


# ------------------------------------------------------------------ the panel linear (decode-sized products)


@every_level
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, k, n", [
    (1, 512, 1024), (5, 33, 65), (6, 256, 64), (7, 256, 100), (64, 512, 2752), (97, 64, 130),
    (300, 48, 200), (0, 16, 16),
])
def test_panel_linear_matches_float64(rows, k, n, with_bias, threads):
    """Row counts around the pass height (6 or 3 rows) and the 96-row work items, output widths
    around the panel width (a last panel part empty), an odd K; one thread gives the same bits
    as two (each output is summed the same way whichever thread takes its panel)."""
    gen = torch.Generator().manual_seed(rows * 131 + k * 7 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    linear = cpu_native.PanelLinear(weight, bias)
    assert linear.panels.shape == (-(-n // linear.width), k, linear.width)
    torch.set_num_threads(threads)
    try:
        got = linear(x)
    finally:
        torch.set_num_threads(1)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x), got)


@every_level
def test_panel_linear_is_exact_where_every_order_is():
    """Small integers: every partial sum is exact in float32, so the products are F.linear's
    to the bit (and a padded panel column never leaks into the output)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (37, 96), generator=gen).float()
    weight = torch.randint(-4, 5, (70, 96), generator=gen).float()
    bias = torch.randint(-4, 5, (70,), generator=gen).float()
    assert torch.equal(cpu_native.PanelLinear(weight, bias)(x), torch.nn.functional.linear(x, weight, bias))


@every_level
def test_panel_linear_takes_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(80, 64, generator=gen)
    linear = cpu_native.PanelLinear(weight)
    wide = torch.randn(9, 100, generator=gen)
    torch.testing.assert_close(linear(wide[:, :64]), wide[:, :64] @ weight.T, rtol=1e-5, atol=1e-5)
    cube = torch.randn(3, 5, 64, generator=gen)
    torch.testing.assert_close(linear(cube), cube @ weight.T, rtol=1e-5, atol=1e-5)
    columns = torch.randn(64, 7, generator=gen).t()  # last axis not contiguous
    torch.testing.assert_close(linear(columns), columns @ weight.T, rtol=1e-5, atol=1e-5)


@every_level
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, k, n", [
    (1, 64, 100), (5, 33, 257), (6, 256, 64), (7, 48, 65), (64, 256, 32000), (96, 128, 1000), (0, 16, 16),
])
def test_panel_argmax_is_the_argmax_of_the_panel_sums(rows, k, n, with_bias, threads, dtype):
    """The fused argmax picks from the very sums `linear(x)` returns (in bf16, rounded as its
    outputs are, so ties among the rounded values go to the first column): torch.argmax of
    them, bit for bit, across pass heights, partial last panels (whose zero padding never wins)
    and threads (each holding a range of columns)."""
    gen = torch.Generator().manual_seed(rows * 17 + k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    linear = cpu_native.PanelLinear(weight, bias)
    torch.set_num_threads(threads)
    try:
        got = linear.argmax(x)
        want = linear(x).float().argmax(dim=-1)
    finally:
        torch.set_num_threads(1)
    assert got.dtype == torch.int64 and torch.equal(got, want)


@every_level
def test_bf16_panel_argmax_breaks_ties_of_the_rounded_sums():
    """Sums that differ in float32 but round to the same bf16 value tie, as in the bf16 logits
    the unfused path would compare: the first column wins; NaN gives up."""
    weight = torch.zeros(200, 2)
    weight[7] = torch.tensor([1.0, 2 ** -12])  # 1 + 2^-12 rounds to 1.0 in bf16
    weight[150] = torch.tensor([1.0, 0.0])
    x = torch.ones(2, 2).bfloat16()
    linear = cpu_native.PanelLinear(weight.bfloat16())
    assert linear(x)[0, 7] == linear(x)[0, 150] == 1.0
    assert linear.argmax(x).tolist() == [7, 7]
    weight[150] = torch.tensor([1.0, 2 ** -6])  # 1 + 2^-6 is a bf16 value: column 150 wins
    assert cpu_native.PanelLinear(weight.bfloat16()).argmax(x).tolist() == [150, 150]
    nan = x.clone()
    nan[1, 0] = float("nan")
    assert linear.argmax(nan) is None


@every_level
def test_panel_argmax_ties_infinities_and_nans():
    """Ties go to the first column (torch.argmax's rule) wherever they fall: in one vector lane,
    across lanes, panels and threads; a row of -inf is column 0; a NaN sum makes it give up
    (None), so the caller computes the sums."""
    width = cpu_native.panel_width()
    weight = torch.zeros(4 * width + 3, 8)
    linear_ties = [(5, 77, 4 * width + 2), (width + 1, 2 * width + 1), (3, 3 + width // 2)]
    x = torch.ones(3, 8)
    for columns in linear_ties:
        weight.zero_()
        weight[list(columns)] = 1.0
        linear = cpu_native.PanelLinear(weight)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                assert linear.argmax(x).tolist() == [min(columns)] * 3
            finally:
                torch.set_num_threads(1)
    assert cpu_native.PanelLinear(torch.zeros(300, 8)).argmax(x).tolist() == [0] * 3  # all equal
    ones = cpu_native.PanelLinear(torch.ones(300, 8))
    assert ones.argmax(torch.full((2, 8), -float("inf"))).tolist() == [0, 0]
    nan = torch.ones(2, 8)
    nan[1, 3] = float("nan")
    assert ones.argmax(nan) is None
    with pytest.raises(ValueError, match="float32 CPU input"):
        ones.argmax(torch.ones(cpu_native.ARGMAX_MAX_ROWS + 1, 8))


@every_level
def test_panel_linear_refuses_what_it_does_not_take():
    weight = torch.randn(32, 16)
    for bad_weight in (weight.half(), weight.double(), weight[0], torch.empty(0, 16)):
        with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
            cpu_native.PanelLinear(bad_weight)
    with pytest.raises(ValueError, match="bias must be a torch.float32 CPU vector of 32"):
        cpu_native.PanelLinear(weight, torch.zeros(31))
    with pytest.raises(ValueError, match="bias must be a torch.bfloat16 CPU vector of 32"):
        cpu_native.PanelLinear(weight.bfloat16(), torch.zeros(32))  # the weight's dtype, not float32
    linear = cpu_native.PanelLinear(weight)
    for bad_x in (torch.randn(4, 15), torch.randn(4, 16).double(), torch.randn(4, 16).bfloat16()):
        with pytest.raises(ValueError, match=r"torch.float32 CPU input \[\.\.\., 16\]"):
            linear(bad_x)
    with pytest.raises(ValueError, match=r"torch.bfloat16 CPU input \[\.\.\., 16\]"):
        cpu_native.PanelLinear(weight.bfloat16())(torch.randn(4, 16))
    with pytest.raises(ValueError, match="PanelLinear.argmax takes torch.bfloat16"):
        cpu_native.PanelLinear(weight.bfloat16()).argmax(torch.randn(4, 16))


BF16_PANEL_CASES = [(1, 512, 1024), (5, 33, 65), (6, 256, 64), (7, 255, 100), (64, 512, 2752), (97, 64, 130),
                    (300, 47, 200), (0, 16, 16)]


def check_bf16_panels(rows, k, n, with_bias):
    """One bf16 PanelLinear case against float64: every output within bf16 rounding of the exact
    product, nearly all (float32 sums) exactly the exact product rounded to bf16; one thread
    gives the same bits as two."""
    gen = torch.Generator().manual_seed(rows * 131 + k * 7 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    linear = cpu_native.PanelLinear(weight, bias)
    pairs = cpu_native.panel_bf16_pairs()
    assert linear.pairs == pairs
    width = linear.width
    assert linear.panels.shape == ((-(-n // width), (k + 1) // 2, width, 2) if pairs else (-(-n // width), k, width))
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            results.append(linear(x))
        finally:
            torch.set_num_threads(1)
    got = results[0]
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert torch.equal(results[0], results[1])
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5)
    if rows:
        assert (got == want.bfloat16()).double().mean() >= 0.99


@every_level
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, k, n", BF16_PANEL_CASES)
def test_bf16_panel_linear_matches_float64(rows, k, n, with_bias):
    """bf16 x, weight and bias (this build's layout: pairs of k where the CPU has AVX512-BF16,
    odd K included), row counts around the pass height and the 96-row items, partial panels."""
    check_bf16_panels(rows, k, n, with_bias)


def test_bf16_panel_linear_without_native_bf16_widens_the_weights(monkeypatch, tmp_path):
    """The build for a CPU without AVX512-BF16: [K][width] panels widened to float32 as they
    are read, the same results. On such a CPU that is the library loaded already (the prebuilt
    x86-64-v3 and x86-64-v4 libraries are that build: tests/kernels/test_native_build.py runs
    them); where the CPU has AVX512-BF16, a developer build with -mno-avx512bf16."""
    if cpu_native.panel_bf16_pairs():
        needs_compiler()
        probe = subprocess.run([native_build.compiler(), "-mno-avx512bf16", "-x", "c", "-", "-o", "/dev/null"],
                               input="int main(void) { return 0; }", capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"this compiler does not take -mno-avx512bf16: {probe.stderr[-300:]}")
        monkeypatch.setattr(cpu_native, "JIT_FLAGS", cpu_native.JIT_FLAGS + ("-mno-avx512bf16",))
        fresh_load(monkeypatch, jit=True)
        monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path))
        assert cpu_native.available(), cpu_native.load_error()
    assert not cpu_native.panel_bf16_pairs()
    for rows, k, n in BF16_PANEL_CASES:
        check_bf16_panels(rows, k, n, with_bias=True)


@every_level
def test_bf16_panel_linear_is_exact_where_every_order_is():
    """Small integers, exact in bf16 and in every float32 partial sum: F.linear's products to
    the bit, whichever order (pairs or single k) adds them."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 5, (37, 97), generator=gen).bfloat16()
    weight = torch.randint(-4, 5, (70, 97), generator=gen).bfloat16()
    bias = torch.randint(-4, 5, (70,), generator=gen).bfloat16()
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
    assert torch.equal(cpu_native.PanelLinear(weight, bias)(x), want)
