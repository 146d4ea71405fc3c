/* The helper pool and the OpenMP team runner (tl_run), and thread binding (tl_bind_threads,
 * engine.cpuBind): the threads every kernel of this library shares its work items out to. */
#include "tl_common.h"

/* ------------------------------------------------------------------ fp8 -> float32 tables */

float tl_fp8_lut[2][256];
static pthread_once_t tl_fp8_once = PTHREAD_ONCE_INIT;

/* Bits of the float32 of each byte: sign, then exponent and mantissa rebiased (normal
 * numbers), subnormals as mantissa * 2^(1 - bias - mantissa bits), and the formats' specials
 * (e4m3fn: S.1111.111 is NaN, no infinity; e5m2: exponent 31 is inf / NaN as IEEE). */
static void tl_fp8_build(void) {
    for (int f = 0; f < 2; ++f) {
        const int mbits = f == 0 ? 3 : 2, bias = f == 0 ? 7 : 15, emax = f == 0 ? 15 : 31;
        for (int b = 0; b < 256; ++b) {
            const int e = (b & 0x7f) >> mbits, m = b & ((1 << mbits) - 1);
            float x;
            if (e == 0) {
                x = (float)m;
                for (int i = 0; i < bias - 1 + mbits; ++i)
                    x *= 0.5f; /* exact: powers of two */
            } else if (f == 0 && e == emax && m == (1 << mbits) - 1) {
                x = __builtin_nanf("");
            } else if (f == 1 && e == emax) {
                x = m ? __builtin_nanf("") : __builtin_inff();
            } else {
                const uint32_t bits = (uint32_t)(e - bias + 127) << 23 | (uint32_t)m << (23 - mbits);
                memcpy(&x, &bits, sizeof x);
            }
            tl_fp8_lut[f][b] = b & 0x80 ? -x : x;
        }
    }
}

void tl_fp8_tables(void) { pthread_once(&tl_fp8_once, tl_fp8_build); }

/* ------------------------------------------------------------------ the helper pool
 *
 * In a pool step (a decode step whose every product is a panel product, torch on one thread:
 * kernels/cpu_native.py's pool_step) the kernels here (attention, the panel products and the
 * fused greedy head: tens of microseconds each) share their items out through this pool
 * instead of an OpenMP team (tl_run). An OpenMP region ends in a barrier that waits for every
 * team thread, so a team thread that another process (the HTTP server's threads, the load
 * generator) has preempted stalls the whole region until it runs again: on a 2-core host
 * serving 16 streams the second thread then bought nothing over one (served output tokens/s
 * equal at 1 and 2 threads). Here items are claimed one at a time from one atomic word, the
 * caller claims too, and the caller waits only for items a helper has claimed and not
 * finished: a helper that has not shown up by the time the items run out takes none, and the
 * caller does them all.
 *
 * The word holds (epoch 16 bits | items 24 | next 24): a claim is one compare-and-swap of it,
 * valid only while next < items of the task it names, so a helper late from an earlier task
 * can never claim into the next one. The task's function and context are published before the
 * word (release) and read after a successful claim (acquire): the caller cannot change them
 * while a claimed item is unfinished. Helpers wait for a new task spinning for a while
 * (TOKENLANE_POOL_SPIN_US, default 1000 microseconds: the gaps between the kernels of a step
 * and between decode steps; waking a sleeping helper costs tens of microseconds, an idle vCPU
 * more), yielding the core to any other runnable thread every TL_POOL_YIELD_SPINS spins,
 * then sleep on a futex; `tl_pool_park` sends them to sleep at once (before a step that runs
 * on torch's OpenMP threads, which need the cores). One caller at a time: a second
 * concurrent caller (another engine in the process) runs its items alone. A forked child starts
 * with no helpers. */
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>


/* A waiting helper yields its core every this many spins (a few microseconds): while the step
 * thread runs its Python, the server and the clients want that core, and the call returns at
 * once when nothing else is runnable. Served bf16 and fp32, 16 and 64 clients on 2 cores:
 * 1.03-1.16x output tokens/s, TTFT p50 0.70-0.99x against pure spinning (docs/benchmarks.md);
 * offline steps unchanged. */
#define TL_POOL_YIELD_SPINS 64

#define TL_POOL_MAX 255          /* helpers */
#define TL_POOL_ITEMS (1 << 24)  /* items of one task: more run on the caller alone */

static struct {
    pthread_mutex_t lock;        /* held by the caller of the current task */
    uint64_t word;               /* epoch << 48 | items << 24 | next (atomic) */
    uint32_t seq;                /* bumped per task: the helpers' futex word (atomic) */
    int sleepers;                /* helpers asleep on seq (atomic) */
    int parked;                  /* 1: helpers sleep now instead of spinning (atomic) */
    int64_t done;                /* items of the current task finished (atomic) */
    int64_t helper_items;        /* items the helpers ran, ever (atomic; tests, diagnostics) */
    tl_item_fn fn;
    void *ctx;
    int active;                  /* threads of the current task, the caller included */
    int helpers;                 /* helper threads started */
    int spin_us;
    int32_t cpus[TL_POOL_MAX + 1]; /* engine.cpuBind: CPU of worker i, or -1 */
    pthread_t threads[TL_POOL_MAX];
} tl_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_us = -1};

static inline void tl_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t tl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The set of one CPU; 0 for a CPU number out of range. */
static int tl_one_cpu(int cpu, cpu_set_t *set) {
    if (cpu < 0 || cpu >= CPU_SETSIZE)
        return 0;
    CPU_ZERO(set);
    CPU_SET(cpu, set);
    return 1;
}

/* Pins the calling thread to `cpu`; whether it took. */
static int tl_pin_self(int cpu) {
    cpu_set_t set;
    return tl_one_cpu(cpu, &set) && sched_setaffinity(0, sizeof(set), &set) == 0;
}

/* Claims and runs items of the current task until none is left. */
static void tl_pool_claim(int worker) {
    for (;;) {
        uint64_t w = __atomic_load_n(&tl_pool.word, __ATOMIC_ACQUIRE);
        const int64_t next = (int64_t)(w & 0xffffff), items = (int64_t)(w >> 24 & 0xffffff);
        if (next >= items)
            return;
        if (!__atomic_compare_exchange_n(&tl_pool.word, &w, w + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        tl_pool.fn(tl_pool.ctx, next, worker);
        if (worker)
            __atomic_add_fetch(&tl_pool.helper_items, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&tl_pool.done, 1, __ATOMIC_RELEASE);
    }
}

static void *tl_pool_helper(void *arg) {
    const int worker = (int)(intptr_t)arg;
    char name[16];
    snprintf(name, sizeof name, "tl-pool-%d", worker); /* as top -H and /proc show it */
    pthread_setname_np(pthread_self(), name);
    tl_pin_self(tl_pool.cpus[worker]);
    uint32_t seen = __atomic_load_n(&tl_pool.seq, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t s;
        int64_t since = tl_now_ns();
        for (int spins = 1; (s = __atomic_load_n(&tl_pool.seq, __ATOMIC_ACQUIRE)) == seen; ++spins) {
            if (spins % 64 == 0 && (__atomic_load_n(&tl_pool.parked, __ATOMIC_RELAXED)
                                    || tl_now_ns() - since > (int64_t)tl_pool.spin_us * 1000)) {
                __atomic_add_fetch(&tl_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&tl_pool.seq, __ATOMIC_SEQ_CST) == seen)
                    syscall(SYS_futex, &tl_pool.seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                __atomic_sub_fetch(&tl_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                since = tl_now_ns();
            }
            if (spins % TL_POOL_YIELD_SPINS == 0)
                sched_yield();
            tl_pause();
        }
        seen = s;
        if (worker < __atomic_load_n(&tl_pool.active, __ATOMIC_RELAXED))
            tl_pool_claim(worker);
    }
    return NULL;
}

static void tl_pool_after_fork(void) {
    pthread_mutex_init(&tl_pool.lock, NULL);
    tl_pool.helpers = 0;
    tl_pool.sleepers = 0;
}

/* Starts helpers up to `n` (fewer if a thread cannot be started). Called with the lock. */
static void tl_pool_grow(int n) {
    if (tl_pool.spin_us < 0) {
        const char *env = getenv("TOKENLANE_POOL_SPIN_US");
        tl_pool.spin_us = env && *env ? atoi(env) : 1000;
        if (tl_pool.spin_us < 0)
            tl_pool.spin_us = 0;
        for (int i = 0; i <= TL_POOL_MAX; ++i)
            tl_pool.cpus[i] = -1;
        pthread_atfork(NULL, NULL, tl_pool_after_fork);
    }
    if (n > TL_POOL_MAX)
        n = TL_POOL_MAX;
    while (tl_pool.helpers < n) {
        const int worker = tl_pool.helpers + 1;
        if (pthread_create(&tl_pool.threads[tl_pool.helpers], NULL, tl_pool_helper, (void *)(intptr_t)worker))
            break;
        pthread_detach(tl_pool.threads[tl_pool.helpers]);
        ++tl_pool.helpers;
    }
}

/* fn(ctx, item, worker) for every item in [0, items), on the caller (worker 0) and up to
 * num_threads - 1 helpers (workers 1, 2, ...); returns when every item is done. */
static void tl_pool_run(tl_item_fn fn, void *ctx, int64_t items, int num_threads) {
    if (num_threads > TL_POOL_MAX + 1)
        num_threads = TL_POOL_MAX + 1;
    if (num_threads <= 1 || items <= 1 || items >= TL_POOL_ITEMS || pthread_mutex_trylock(&tl_pool.lock)) {
        for (int64_t i = 0; i < items; ++i)
            fn(ctx, i, 0);
        return;
    }
    tl_pool_grow(num_threads - 1);
    static uint64_t epoch;
    epoch = (epoch + 1) & 0xffff;
    tl_pool.fn = fn;
    tl_pool.ctx = ctx;
    __atomic_store_n(&tl_pool.active, num_threads, __ATOMIC_RELAXED);
    __atomic_store_n(&tl_pool.parked, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tl_pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tl_pool.word, epoch << 48 | (uint64_t)items << 24, __ATOMIC_RELEASE);
    __atomic_add_fetch(&tl_pool.seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&tl_pool.sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &tl_pool.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    tl_pool_claim(0);
    /* Only items a helper claimed and has not finished are left: it is running them (or was
     * preempted in one), so yield the core now and then rather than spin it away. */
    for (int spins = 1; __atomic_load_n(&tl_pool.done, __ATOMIC_ACQUIRE) < items; ++spins) {
        if (spins % 256 == 0)
            sched_yield();
        else
            tl_pause();
    }
    pthread_mutex_unlock(&tl_pool.lock);
}

/* How many items the helpers have run since the library was loaded. */
int64_t tl_pool_helper_items(void) { return __atomic_load_n(&tl_pool.helper_items, __ATOMIC_RELAXED); }

/* Helpers stop spinning and sleep until the next task. */
void tl_pool_park(void) { __atomic_store_n(&tl_pool.parked, 1, __ATOMIC_RELAXED); }

/* The same on the caller's OpenMP team (torch's pool), the items claimed from one counter. */
static void tl_team_run(tl_item_fn fn, void *ctx, int64_t items, int num_threads) {
    int64_t next = 0;
    if (num_threads > items)
        num_threads = (int)items;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads)
#endif
    {
#ifdef _OPENMP
        const int worker = omp_get_thread_num();
#else
        const int worker = 0;
#endif
        for (;;) {
            const int64_t item = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (item >= items)
                break;
            fn(ctx, item, worker);
        }
    }
}

/* The kernels' runner (tl_common.h). */
TL_INTERNAL void tl_run(tl_item_fn fn, void *ctx, int64_t items, int num_threads, int pool) {
    if (items <= 0)
        return;
    if (num_threads < 1)
        num_threads = 1;
    if (pool)
        tl_pool_run(fn, ctx, items, num_threads);
    else
        tl_team_run(fn, ctx, items, num_threads);
}

/* engine.cpuBind: worker i of the pool on cpus[i] (the caller pins itself: tl_bind_threads),
 * helpers started before now moved at once. */
static void tl_pool_bind(const int32_t *cpus, int n) {
    pthread_mutex_lock(&tl_pool.lock);
    tl_pool_grow(0);
    for (int i = 0; i <= TL_POOL_MAX; ++i)
        tl_pool.cpus[i] = i < n ? cpus[i] : -1;
    for (int h = 0; h < tl_pool.helpers; ++h) {
        cpu_set_t set;
        if (tl_one_cpu(tl_pool.cpus[h + 1], &set))
            pthread_setaffinity_np(tl_pool.threads[h], sizeof(set), &set);
    }
    pthread_mutex_unlock(&tl_pool.lock);
}

/* Pins the caller's OpenMP team of n threads, thread i to cpus[i] (engine.cpuBind), and the
 * helper pool's workers the same way (helper i to cpus[i]; the caller is thread 0 of both).
 * libgomp keeps one pool per calling thread and reuses its threads for every later team of the
 * same size, so torch's parallel regions, all run by this caller with n threads, stay on these
 * CPUs. Returns the number of OpenMP threads pinned (n on success; fewer when the team came out
 * smaller or a CPU was refused), or -1 when built without OpenMP (then only the pool's helpers
 * are pinned). */
int tl_bind_threads(const int32_t *cpus /* [n] */, int n) {
    if (n < 1 || n > CPU_SETSIZE || n > TL_POOL_MAX + 1)
        return 0;
    tl_pool_bind(cpus, n);
#ifdef _OPENMP
    int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
    {
        if (omp_get_num_threads() == n)
            pinned += tl_pin_self(cpus[omp_get_thread_num()]);
    }
    return pinned;
#else
    return -1;
#endif
}
