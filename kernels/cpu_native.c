/* Paged decode attention for the CPU, in C (built and loaded by kernels/cpu_native.py).
 *
 * One decode = one query token per sequence that attends to its whole context, straight from
 * the paged cache through the block table (no gather into a buffer, no padding, no mask). A
 * work item is one decode's KV heads (all of them, or one when there are few decodes for the
 * threads); each KV head's G = Hq / Hkv query heads read its cached K and V rows once. Per
 * item, three passes over the context:
 *   1. scores s[h][t] = scale * q[h] . K[t], and their max per query head;
 *   2. p[h][t] = exp(s[h][t] - max[h]) and their sum (a vectorizable exp, below);
 *   3. out[h] = sum_t p[h][t] V[t] / sum.
 * The cache may be float32, bfloat16 or float16; rows are widened to float32 as they are read,
 * and every sum is in float32. Items are handed out to the caller and up to `num_threads` - 1
 * helper threads (the helper pool, below) in the caller's order (longest contexts first
 * balances the threads).
 *
 * Built with -O3 -march=native -fopenmp (or -fopenmp-simd -pthread): `#pragma omp simd` lets
 * the float reductions of the generic path vectorize without -ffast-math; the vector path uses
 * GCC vector extensions.
 *
 * Also here: `tl_argmax_rows`, greedy sampling's argmax, `tl_write_kv`, the KV cache
 * write (a scatter of K/V rows to their cache slots), `tl_rope_write_kv`, RoPE on a layer's
 * queries and keys then that write, `tl_rms_norm`, RMSNorm (float32, bf16), and
 * `tl_bind_threads`, which pins the caller's OpenMP team and the helper pool's threads one per
 * CPU (engine.cpuBind).
 */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512BF16__
#include <immintrin.h> /* _mm512_dpbf16_ps: the bf16 panels' pair products */
#endif

enum { TL_FLOAT32 = 0, TL_BFLOAT16 = 1, TL_FLOAT16 = 2 };
enum { TL_OK = 0, TL_BAD_DTYPE = 1, TL_NO_MEMORY = 2, TL_BAD_SHAPE = 3, TL_NAN = 4 };

#define TL_MAX_GROUP 64  /* query heads per KV head */
#define TL_MAX_HEADS 256 /* query heads of one work item (the vector path) */
#define TL_MAX_GROUP_FIXED 8 /* the largest G with a compiled vector path (TL_FIXED) */

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

typedef void (*tl_item_fn)(void *ctx, int64_t item, int worker);

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

/* The kernels' runner: the helper pool in a pool step (`pool`: the caller's torch runs on one
 * thread, kernels/cpu_native.py), else the OpenMP team, as torch's own ops. */
static void tl_run(tl_item_fn fn, void *ctx, int64_t items, int num_threads, int pool) {
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

typedef struct {
    const float *q;           /* [T, Hq, D] */
    int64_t q_tok, q_head;    /* strides of q in elements (the D axis is contiguous) */
    const void *k, *v;        /* [num_blocks, block_size, Hkv, D] each, same strides */
    int dtype;                /* TL_FLOAT32 | TL_BFLOAT16 | TL_FLOAT16 */
    int64_t c_block, c_tok, c_head;
    const int32_t *tables;    /* [S, max_blocks] */
    int64_t table_stride;
    const int32_t *rows;      /* [n] query (and output) row of each decode */
    const int32_t *seqs;      /* [n] block-table row of each decode */
    const int32_t *lens;      /* [n] context length of each decode (>= 1) */
    int n, hq, hkv, d, block_size, max_len;
    int heads_per_item;       /* KV heads of one work item: hkv, or 1 for few decodes */
    float scale;
    float *out;               /* [T, Hq, D] */
    int64_t o_tok, o_head;
} tl_job;

/* 8-lane vectors (GCC vector extensions: AVX on x86, NEON pairs on Arm). */
typedef float tl_v8 __attribute__((vector_size(32)));
typedef int32_t tl_i8 __attribute__((vector_size(32)));

static inline tl_v8 tl_splat(float x) { return (tl_v8){x, x, x, x, x, x, x, x}; }

/* Lane-wise mask ? a : b (C has no vector ?: operator); compiles to one blend. */
static inline tl_v8 tl_select(tl_i8 mask, tl_v8 a, tl_v8 b) {
    return (tl_v8)(((tl_i8)a & mask) | ((tl_i8)b & ~mask));
}

static inline tl_v8 tl_max8(tl_v8 a, tl_v8 b) { return tl_select(a > b, a, b); }

/* exp(x) for x <= 0 (scores minus their max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
 * degree-7 polynomial for exp(r), 2^n built in the exponent bits. About 1 ulp; plain vector
 * arithmetic, written once for any float vector type V (with I its int32 vector). */
#define TL_EXP_BODY(V, I)                                                                  \
    const V zero = {0};                                                                    \
    x = (V)(((I)x & (I)(x > -87.0f)) | ((I)(zero - 87.0f) & ~(I)(x > -87.0f)));           \
    V y = x * 1.44269504088896341f + 0.5f;                                                 \
    I ni = __builtin_convertvector(y, I); /* truncates toward zero... */                   \
    V n = __builtin_convertvector(ni, V);                                                  \
    ni += (I)(n > y);                     /* ...so step down where that rounded up */      \
    n = __builtin_convertvector(ni, V);                                                    \
    V r = x - n * 0.693359375f + n * 2.12194440e-4f;                                       \
    V p = zero + 1.9875691500e-4f;                                                         \
    p = p * r + 1.3981999507e-3f;                                                          \
    p = p * r + 8.3334519073e-3f;                                                          \
    p = p * r + 4.1665795894e-2f;                                                          \
    p = p * r + 1.6666665459e-1f;                                                          \
    p = p * r + 5.0000001201e-1f;                                                          \
    p = p * r * r + r + 1.0f;                                                              \
    I bits = (ni + 127) << 23;                                                             \
    V two_n;                                                                               \
    memcpy(&two_n, &bits, sizeof two_n);                                                   \
    return p * two_n;

static inline tl_v8 tl_exp8(tl_v8 x) { TL_EXP_BODY(tl_v8, tl_i8) }

/* The same for one value (the tails of the vector loops and the generic path). */
static inline float tl_exp_nonpositive(float x) { return tl_exp8(tl_splat(x))[0]; }

/* Row `offset` (elements) of a cache as float32: the row itself for a float32 cache, else
 * widened into `buf` [d]. */
static inline const float *tl_row(const void *cache, int dtype, int64_t offset, int d, float *buf) {
    if (dtype == TL_FLOAT32)
        return (const float *)cache + offset;
    if (dtype == TL_BFLOAT16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
        for (int i = 0; i < d; ++i) {
            uint32_t bits = (uint32_t)src[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            buf[i] = f;
        }
        return buf;
    }
#ifdef __FLT16_MAX__
    const _Float16 *src = (const _Float16 *)cache + offset;
#pragma omp simd
    for (int i = 0; i < d; ++i)
        buf[i] = (float)src[i];
#endif
    return buf;
}

/* scores[g][t] <- exp(scores[g][t] - max[g]); max[g] <- 1 / sum_t (the store's scale). */
static inline void tl_softmax(float *scores, int len, int group, float *max) {
    for (int g = 0; g < group; ++g) {
        float *sg = scores + (int64_t)g * len, mg = max[g], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            float e = tl_exp_nonpositive(sg[t] - mg);
            sg[t] = e;
            sum += e;
        }
        max[g] = 1.0f / sum; /* sum >= 1: the max's own term is exp(0) */
    }
}

/* out[row][head * G + g] = acc[g] * inv_sum[g]. */
static inline void tl_store(const tl_job *j, int decode, int head, const float *acc,
                            const float *inv_sum) {
    const int group = j->hq / j->hkv, d = j->d;
    for (int g = 0; g < group; ++g) {
        float *o = j->out + (int64_t)j->rows[decode] * j->o_tok + (int64_t)(head * group + g) * j->o_head;
        const float *ag = acc + (int64_t)g * d;
        const float s = inv_sum[g];
#pragma omp simd
        for (int i = 0; i < d; ++i)
            o[i] = ag[i] * s;
    }
}

/* The generic path: any head size. */
static void tl_attend_any(const tl_job *j, int decode, int head, float *scores, float *row,
                          float *acc) {
    const int group = j->hq / j->hkv, d = j->d, bs = j->block_size;
    const int len = j->lens[decode];
    const int32_t *table = j->tables + (int64_t)j->seqs[decode] * j->table_stride;
    const float *q = j->q + (int64_t)j->rows[decode] * j->q_tok + (int64_t)head * group * j->q_head;
    float max[TL_MAX_GROUP];

    for (int g = 0; g < group; ++g)
        max[g] = -FLT_MAX;
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int64_t base = (int64_t)table[b] * j->c_block + (int64_t)head * j->c_head;
        const int m = len - t0 < bs ? len - t0 : bs;
        for (int t = 0; t < m; ++t) {
            const float *k = tl_row(j->k, j->dtype, base + (int64_t)t * j->c_tok, d, row);
            for (int g = 0; g < group; ++g) {
                const float *qg = q + (int64_t)g * j->q_head;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int i = 0; i < d; ++i)
                    s += qg[i] * k[i];
                s *= j->scale;
                scores[(int64_t)g * len + t0 + t] = s;
                max[g] = s > max[g] ? s : max[g];
            }
        }
    }
    tl_softmax(scores, len, group, max);
    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)d);
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int64_t base = (int64_t)table[b] * j->c_block + (int64_t)head * j->c_head;
        const int m = len - t0 < bs ? len - t0 : bs;
        for (int t = 0; t < m; ++t) {
            const float *v = tl_row(j->v, j->dtype, base + (int64_t)t * j->c_tok, d, row);
            for (int g = 0; g < group; ++g) {
                const float p = scores[(int64_t)g * len + t0 + t];
                float *ag = acc + (int64_t)g * d;
#pragma omp simd
                for (int i = 0; i < d; ++i)
                    ag[i] += p * v[i];
            }
        }
    }
    tl_store(j, decode, head, acc, max);
}

/* The vector path (below): 8 elements of a cache row at `offset`, widened to float32 in
 * registers. */
typedef uint16_t tl_u16x8 __attribute__((vector_size(16)));
typedef uint32_t tl_u32x8 __attribute__((vector_size(32)));

static inline tl_v8 tl_load8(const void *cache, int dtype, int64_t offset) {
    tl_v8 x;
    if (dtype == TL_FLOAT32) {
        memcpy(&x, (const float *)cache + offset, sizeof x);
    } else if (dtype == TL_BFLOAT16) {
        tl_u16x8 h;
        memcpy(&h, (const uint16_t *)cache + offset, sizeof h);
        tl_u32x8 w = __builtin_convertvector(h, tl_u32x8) << 16;
        memcpy(&x, &w, sizeof x);
    } else {
#ifdef __FLT16_MAX__
        typedef _Float16 tl_h8 __attribute__((vector_size(16)));
        tl_h8 h;
        memcpy(&h, (const _Float16 *)cache + offset, sizeof h);
        x = __builtin_convertvector(h, tl_v8);
#else
        memset(&x, 0, sizeof x); /* unreachable: the launcher refuses float16 then */
#endif
    }
    return x;
}

/* [sum(a[0]), sum(a[1]), ..., sum(a[7])]: eight horizontal sums in 7 adds. */
static inline tl_v8 tl_sum8x8(const tl_v8 a[8]) {
    tl_v8 h[4], q[2];
    for (int i = 0; i < 4; ++i) {
        const tl_v8 x = a[2 * i], y = a[2 * i + 1];
        h[i] = __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14)
             + __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
    }
    for (int i = 0; i < 2; ++i) {
        const tl_v8 x = h[2 * i], y = h[2 * i + 1];
        q[i] = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float tl_hsum8(tl_v8 x) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i)
        s += x[i];
    return s;
}

/* Asks for `count` elements of a cache from `offset` to be brought into L2, one 64-byte line at
 * a time. The decode passes call it for the row (this KV head's part) of the next block that
 * matches the row they are reading, so the next block arrives one block ahead, a little with
 * every row: blocks sit at random places in the pool, and the hardware prefetcher, which
 * follows a stream within a 4 KiB page, misses the start of every block and page. Issued in
 * a burst at each block (or one line in two, counting on the core to fetch a line's pair) the
 * same prefetches were slower than none at all on a 2-core Xeon; spread like this, decode
 * attention reads K/V at 19-21 GB/s there against 12-14 before, about what a plain read of the
 * same blocks gets. Forced inline: GCC deems a function whose only effect is a prefetch free
 * of side effects and deletes its calls. */
static inline __attribute__((always_inline)) void tl_prefetch_span(const void *cache, int dtype,
                                                                   int64_t offset, int64_t count) {
    const int64_t size = dtype == TL_FLOAT32 ? 4 : 2;
    const char *start = (const char *)cache + offset * size;
    for (int64_t byte = 0; byte < count * size; byte += 64)
        __builtin_prefetch(start + byte, 0, 1);
}

/* One work item with the head size D (a multiple of 8) and the group size G known at compile
 * time: the KV heads [h0, h1) of one decode. A block's rows are swept in order, 8 tokens at a
 * time and every head of the item per token chunk, so the cache is read as contiguous memory
 * (a block's rows hold all KV heads side by side) and each chunk is used while in L1. Dot
 * products end in eight horizontal sums at once; exp runs on 8 lanes. `scores` holds
 * [(h1 - h0) * G][len], `acc_mem` [(h1 - h0) * G][D] (32-byte aligned). */
static inline __attribute__((always_inline)) void tl_attend_fixed(
    const tl_job *j, int decode, int h0, int h1, float *scores, float *acc_mem, const int D,
    const int G) {
    enum { MAXC = 16 }; /* D <= 128 */
    const int C = D / 8, heads = (h1 - h0) * G;
    const int bs = j->block_size, dtype = j->dtype, len = j->lens[decode];
    const int64_t c_tok = j->c_tok, c_head = j->c_head;
    const int32_t *table = j->tables + (int64_t)j->seqs[decode] * j->table_stride;
    const float *q = j->q + (int64_t)j->rows[decode] * j->q_tok + (int64_t)h0 * G * j->q_head;
    tl_v8 *qv = (tl_v8 *)acc_mem; /* [heads][C] pre-scaled queries, until pass 3 needs acc */
    tl_v8 maxv[TL_MAX_HEADS];
    float max[TL_MAX_HEADS], inv_sum[TL_MAX_HEADS];

    for (int x = 0; x < heads; ++x) {
        for (int c = 0; c < C; ++c) {
            memcpy(&qv[x * C + c], q + (int64_t)x * j->q_head + 8 * c, sizeof(tl_v8));
            qv[x * C + c] *= j->scale; /* the reference scales q . k: 1 ulp apart */
        }
        maxv[x] = tl_splat(-FLT_MAX);
        max[x] = -FLT_MAX;
    }
    /* Pass 1: scores and their max. */
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int64_t base = (int64_t)table[b] * j->c_block + (int64_t)h0 * c_head;
        const int m = len - t0 < bs ? len - t0 : bs;
        const int next_m = len - t0 - bs < bs ? len - t0 - bs : bs; /* <= 0: last block */
        const int64_t next = next_m > 0 ? (int64_t)table[b + 1] * j->c_block + (int64_t)h0 * c_head : 0;
        int t = 0;
        for (; t + 8 <= m; t += 8) {
            for (int h = 0; h < h1 - h0; ++h) {
                /* Each K row is read (and widened) once for the G query heads that share it. */
                tl_v8 dots[TL_MAX_GROUP_FIXED][8];
                for (int u = 0; u < 8; ++u) {
                    const int64_t off = base + (int64_t)(t + u) * c_tok + h * c_head;
                    if (t + u < next_m) /* the same row of the next block */
                        tl_prefetch_span(j->k, dtype, next + (int64_t)(t + u) * c_tok + h * c_head, D);
                    tl_v8 k[MAXC];
                    for (int c = 0; c < C; ++c)
                        k[c] = tl_load8(j->k, dtype, off + 8 * c);
                    for (int g = 0; g < G; ++g) {
                        const tl_v8 *qx = qv + (h * G + g) * C;
                        tl_v8 sum = qx[0] * k[0];
                        for (int c = 1; c < C; ++c)
                            sum += qx[c] * k[c];
                        dots[g][u] = sum;
                    }
                }
                for (int g = 0; g < G; ++g) {
                    const int x = h * G + g;
                    const tl_v8 sc = tl_sum8x8(dots[g]);
                    memcpy(scores + (int64_t)x * len + t0 + t, &sc, sizeof sc);
                    maxv[x] = tl_max8(sc, maxv[x]);
                }
            }
        }
        for (; t < m; ++t) {
            for (int h = 0; h < h1 - h0; ++h) {
                const int64_t off = base + (int64_t)t * c_tok + h * c_head;
                for (int g = 0; g < G; ++g) {
                    const int x = h * G + g;
                    const tl_v8 *qx = qv + x * C;
                    tl_v8 sum = qx[0] * tl_load8(j->k, dtype, off);
                    for (int c = 1; c < C; ++c)
                        sum += qx[c] * tl_load8(j->k, dtype, off + 8 * c);
                    const float sc = tl_hsum8(sum);
                    scores[(int64_t)x * len + t0 + t] = sc;
                    max[x] = sc > max[x] ? sc : max[x];
                }
            }
        }
    }
    /* Pass 2: probabilities (unnormalized) and their sums. */
    for (int x = 0; x < heads; ++x) {
        float mx = max[x];
        for (int i = 0; i < 8; ++i)
            mx = maxv[x][i] > mx ? maxv[x][i] : mx;
        float *sx = scores + (int64_t)x * len;
        tl_v8 sumv = tl_splat(0.0f);
        int t = 0;
        for (; t + 8 <= len; t += 8) {
            tl_v8 e;
            memcpy(&e, sx + t, sizeof e);
            e = tl_exp8(e - mx);
            memcpy(sx + t, &e, sizeof e);
            sumv += e;
        }
        float sum = tl_hsum8(sumv);
        for (; t < len; ++t) {
            sx[t] = tl_exp_nonpositive(sx[t] - mx);
            sum += sx[t];
        }
        inv_sum[x] = 1.0f / sum; /* sum >= 1: the max's own term is exp(0) */
    }
    /* Pass 3: the weighted sum of V rows. */
    tl_v8 *acc = (tl_v8 *)acc_mem; /* [heads][C] */
    for (int i = 0; i < heads * C; ++i)
        acc[i] = tl_splat(0.0f);
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int64_t base = (int64_t)table[b] * j->c_block + (int64_t)h0 * c_head;
        const int m = len - t0 < bs ? len - t0 : bs;
        const int next_m = len - t0 - bs < bs ? len - t0 - bs : bs;
        const int64_t next = next_m > 0 ? (int64_t)table[b + 1] * j->c_block + (int64_t)h0 * c_head : 0;
        /* One head at a time over the block (in L1 after the first head): its G x C sums
         * stay in registers for the block's rows instead of a load and a store per row and
         * vector. Each sum still adds the rows in order, so the result is unchanged. */
        for (int h = 0; h < h1 - h0; ++h) {
            tl_v8 a[TL_MAX_GROUP_FIXED * MAXC];
            tl_v8 *acc_h = acc + h * G * C;
            for (int x = 0; x < G * C; ++x)
                a[x] = acc_h[x];
            const float *sh = scores + (int64_t)h * G * len + t0;
            for (int t = 0; t < m; ++t) {
                const int64_t off = base + (int64_t)t * c_tok + h * c_head;
                if (t < next_m)
                    tl_prefetch_span(j->v, dtype, next + (int64_t)t * c_tok + h * c_head, D);
                float p[G];
                for (int g = 0; g < G; ++g)
                    p[g] = sh[(int64_t)g * len + t];
                for (int c = 0; c < C; ++c) {
                    const tl_v8 v = tl_load8(j->v, dtype, off + 8 * c);
                    for (int g = 0; g < G; ++g)
                        a[g * C + c] += p[g] * v;
                }
            }
            for (int x = 0; x < G * C; ++x)
                acc_h[x] = a[x];
        }
    }
    for (int x = 0; x < heads; ++x) {
        float *o = j->out + (int64_t)j->rows[decode] * j->o_tok + (int64_t)(h0 * G + x) * j->o_head;
        for (int c = 0; c < C; ++c) {
            const tl_v8 y = acc[x * C + c] * inv_sum[x];
            memcpy(o + 8 * c, &y, sizeof y);
        }
    }
}

#define TL_FIXED(D, G) \
    case (D) * 128 + (G): tl_attend_fixed(j, decode, h0, h1, scores, acc, (D), (G)); return

/* Work item `item`: KV heads [h0, h0 + heads_per_item) of decode item / items_per_decode. */
static void tl_attend(const tl_job *j, int item, float *scores, float *row, float *acc) {
    const int per_decode = j->hkv / j->heads_per_item;
    const int decode = item / per_decode, h0 = item % per_decode * j->heads_per_item;
    const int h1 = h0 + j->heads_per_item;
    const int group = j->hq / j->hkv;
    switch (j->d * 128 + group) { /* G <= TL_MAX_GROUP < 128: one key per shape */
    TL_FIXED(32, 1); TL_FIXED(32, 2); TL_FIXED(32, 4); TL_FIXED(32, 8);
    TL_FIXED(64, 1); TL_FIXED(64, 2); TL_FIXED(64, 4); TL_FIXED(64, 8);
    TL_FIXED(128, 1); TL_FIXED(128, 2); TL_FIXED(128, 4); TL_FIXED(128, 8);
    }
    /* The other groups up to TL_MAX_GROUP_FIXED (3, 5, 6, 7: SmolLM, Qwen2.5 and Llama-3.2
     * shapes) take the vector path with G known only at run time: one more build of it per head
     * size instead of one per shape (each costs seconds of compile time). It reads K/V at
     * 12-16 GB/s as the compiled groups do, 2.2-3.4x the generic loop (2-core Xeon). */
    if (group <= TL_MAX_GROUP_FIXED)
        switch (j->d) {
        case 32: tl_attend_fixed(j, decode, h0, h1, scores, acc, 32, group); return;
        case 64: tl_attend_fixed(j, decode, h0, h1, scores, acc, 64, group); return;
        case 128: tl_attend_fixed(j, decode, h0, h1, scores, acc, 128, group); return;
        }
    for (int h = h0; h < h1; ++h)
        tl_attend_any(j, decode, h, scores, row, acc);
}

/* Floats of one worker's scratch: acc [heads][d] first (64-byte aligned for the vector path),
 * then row [d], scores [heads][max_len]; rounded up to whole cache lines. */
static size_t tl_scratch_floats(const tl_job *j) {
    const size_t heads = (size_t)j->heads_per_item * (size_t)(j->hq / j->hkv);
    const size_t n = heads * (size_t)j->d + (size_t)j->d + heads * (size_t)j->max_len;
    return (n + 15) / 16 * 16;
}

typedef struct {
    const tl_job *job;
    float *scratch; /* [workers][tl_scratch_floats] */
    size_t per_worker;
} tl_decode_task;

static void tl_decode_item(void *ctx, int64_t item, int worker) {
    const tl_decode_task *t = (const tl_decode_task *)ctx;
    const tl_job *j = t->job;
    float *acc = t->scratch + (size_t)worker * t->per_worker;
    float *row = acc + (size_t)j->heads_per_item * (size_t)(j->hq / j->hkv) * (size_t)j->d;
    tl_attend(j, (int)item, row + j->d, row, acc);
}

/* Whether this build reads caches of `dtype` (float16 needs the compiler's _Float16). */
static int tl_cache_dtype_ok(int dtype) {
    if (dtype == TL_FLOAT32 || dtype == TL_BFLOAT16)
        return 1;
#ifdef __FLT16_MAX__
    return dtype == TL_FLOAT16;
#else
    return 0;
#endif
}

/* Whether block-table row `seq` exists and covers `len` tokens with blocks of the cache: every
 * index a kernel will follow is checked before any is, so a bad table fails the call instead
 * of reading outside the cache. */
static int tl_table_ok(const int32_t *tables, int64_t table_stride, int64_t table_rows, int seq, int len,
                       int block_size, int64_t num_blocks) {
    const int blocks = (len + block_size - 1) / block_size;
    if (seq < 0 || seq >= table_rows || blocks > table_stride)
        return 0;
    const int32_t *table = tables + (int64_t)seq * table_stride;
    for (int b = 0; b < blocks; ++b)
        if (table[b] < 0 || table[b] >= num_blocks)
            return 0;
    return 1;
}

/* Returns TL_OK, or an error code with nothing guaranteed written (TL_BAD_SHAPE, nothing read
 * or written, when a row, table row, length or block number is out of range: `q_rows` rows of
 * q and out, `table_rows` block tables, `num_blocks` cache blocks, lengths in [1, max_len]).
 * A thread that cannot be started leaves its share to the others. */
int tl_paged_decode_attention(
    const float *q, int64_t q_tok, int64_t q_head,
    const void *k_cache, const void *v_cache, int dtype,
    int64_t c_block, int64_t c_tok, int64_t c_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *rows, const int32_t *seqs, const int32_t *lens, int n,
    int hq, int hkv, int d, int block_size, int max_len, float scale,
    float *out, int64_t o_tok, int64_t o_head, int num_threads, int pool, int64_t q_rows,
    int64_t table_rows, int64_t num_blocks) {
    if (!tl_cache_dtype_ok(dtype))
        return TL_BAD_DTYPE;
    if (n < 0 || hkv <= 0 || hq % hkv || hq / hkv > TL_MAX_GROUP || d <= 0 || block_size <= 0
        || max_len <= 0)
        return TL_BAD_SHAPE;
    if (n == 0)
        return TL_OK;
    for (int i = 0; i < n; ++i)
        if (rows[i] < 0 || rows[i] >= q_rows || lens[i] < 1 || lens[i] > max_len
            || !tl_table_ok(tables, table_stride, table_rows, seqs[i], lens[i], block_size, num_blocks))
            return TL_BAD_SHAPE;
    tl_job job = {.q = q, .q_tok = q_tok, .q_head = q_head, .k = k_cache, .v = v_cache,
                  .dtype = dtype, .c_block = c_block, .c_tok = c_tok, .c_head = c_head,
                  .tables = tables, .table_stride = table_stride, .rows = rows, .seqs = seqs,
                  .lens = lens, .n = n, .hq = hq, .hkv = hkv, .d = d, .block_size = block_size,
                  .max_len = max_len, .scale = scale, .out = out, .o_tok = o_tok,
                  .o_head = o_head};
    /* Whole block rows (every KV head of a decode) per item read the cache contiguously;
     * with few decodes for the threads, one KV head per item spreads the work instead. */
    job.heads_per_item = (num_threads == 1 || n >= 4 * num_threads) && hq <= TL_MAX_HEADS ? hkv : 1;
    const int items = n * (hkv / job.heads_per_item);
    if (num_threads > items)
        num_threads = items;
    if (num_threads > 256)
        num_threads = 256;
    tl_decode_task task = {.job = &job, .per_worker = tl_scratch_floats(&job)};
    void *scratch = NULL;
    if (posix_memalign(&scratch, 64, sizeof(float) * task.per_worker * (size_t)num_threads))
        return TL_NO_MEMORY;
    task.scratch = scratch;
    tl_run(tl_decode_item, &task, items, num_threads, pool);
    free(scratch);
    return TL_OK;
}

static inline float tl_from_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ prefill chunks
 *
 * Attention of prefill chunks (two or more query tokens) over their paged context, causal:
 * query row r of chunk c (flat batch row q_starts[c] + r) sits at position p = ctx_lens[c] -
 * q_lens[c] + r and attends to keys 0..p of block-table row seqs[c] (the chunk's own keys are
 * in the cache already: the model writes them first). A work item is up to TL_VL consecutive
 * query rows of one chunk, for `gh` query heads of one KV head (up to four, as many as fit in
 * L1: TL_PREFILL_HEADS). The rows are the vector lanes: each query is transposed once per item
 * into D vectors of TL_VL rows, and every score and weighted value is then a vector times one
 * element of a cache row, broadcast, so K and V are read as they lie in the cache, with no
 * transposes. Keys go by in chunks of TL_VL: the chunk's scores, keys past a row's position
 * masked, the running max and sum of exp per row, then the weighted V rows into the
 * accumulators (rescaled as loaded when the max grew). Scores and weighted values are computed
 * for all the item's heads at once, KB keys or columns a pass (GH * KB sums held in
 * registers): a cache element read once serves GH heads, and a query or weight vector KB keys
 * or columns: with the query rows located once per item, 1.5-1.7x the speed of one head and
 * eight keys a pass for G = 2 and 4, 1.1x for G = 1 (300-token prompt, 2-core Xeon). Sums in
 * float32 (widened as read for bf16 / fp16 caches), in the same order whatever the blocking.
 * Items go to the caller's OpenMP team through one atomic counter (one thread in a build
 * without OpenMP), or in a pool step to the helper pool (tl_run). */

#if defined(__AVX512F__)
#define TL_VL 16 /* rows per work item: the widest float vector of the build */
#else
#define TL_VL 8
#endif
typedef float tl_vf __attribute__((vector_size(4 * TL_VL)));
typedef int32_t tl_vi __attribute__((vector_size(4 * TL_VL)));

static inline tl_vf tl_vexp(tl_vf x) { TL_EXP_BODY(tl_vf, tl_vi) }

static inline tl_vf tl_vselect(tl_vi mask, tl_vf a, tl_vf b) {
    return (tl_vf)(((tl_vi)a & mask) | ((tl_vi)b & ~mask));
}

/* Element `offset` of a cache as float32. */
static inline float tl_elem(const void *cache, int dtype, int64_t offset) {
    if (dtype == TL_FLOAT32)
        return ((const float *)cache)[offset];
    if (dtype == TL_BFLOAT16)
        return tl_from_bf16(((const uint16_t *)cache)[offset]);
#ifdef __FLT16_MAX__
    return (float)((const _Float16 *)cache)[offset];
#else
    return 0.0f; /* unreachable: the launcher refuses float16 then */
#endif
}

typedef struct {
    const float *q;            /* [T, Hq, D] */
    int64_t q_tok, q_head;
    const void *k, *v;         /* [num_blocks, block_size, Hkv, D] each, same strides */
    int dtype;
    int64_t c_block, c_tok, c_head;
    const int32_t *tables;     /* [S, max_blocks] */
    int64_t table_stride;
    const int32_t *q_starts;   /* [n] first flat row of each chunk */
    const int32_t *q_lens;     /* [n] query rows of each chunk (>= 1) */
    const int32_t *ctx_lens;   /* [n] context length of each chunk, its own rows included */
    const int32_t *seqs;       /* [n] block-table row of each chunk */
    const int32_t *first_item; /* [n + 1] the chunks' first work items, then their count */
    int n, hq, hkv, d, block_size;
    int gh;                    /* query heads per work item (TL_PREFILL_HEADS) */
    float scale;
    float *out;                /* [T, Hq, D] */
    int64_t o_tok, o_head;
} tl_prefill_job;

/* Rows [r0, r0 + TL_VL) of chunk c (fewer at its end) for query heads [h0, h0 + GH) of KV head
 * h0 / G, with D and GH known at compile time. */
static inline __attribute__((always_inline)) void tl_prefill_item(
    const tl_prefill_job *j, int c, int r0, int h0, const int D, const int GH) {
    const int G = j->hq / j->hkv, kv = h0 / G, bs = j->block_size, dtype = j->dtype;
    const int q_len = j->q_lens[c], rows = q_len - r0 < TL_VL ? q_len - r0 : TL_VL;
    const int first_pos = j->ctx_lens[c] - q_len + r0, last_pos = first_pos + rows - 1;
    const int32_t *table = j->tables + (int64_t)j->seqs[c] * j->table_stride;
    const int64_t kv_off = (int64_t)kv * j->c_head;
    const int KB = GH >= 3 ? 4 : GH == 2 || TL_VL == 8 ? 8 : 16; /* keys (columns) a pass: GH * KB <= 16 */
    tl_vf qt[GH][D], acc[GH][D], max[GH], sum[GH];
    tl_vi pos; /* each lane's position; lanes past the chunk repeat its last row */
    for (int i = 0; i < TL_VL; ++i)
        pos[i] = first_pos + (i < rows ? i : rows - 1);
    const float *q0 = j->q + (int64_t)(j->q_starts[c] + r0) * j->q_tok + (int64_t)h0 * j->q_head;
    float *out0 = j->out + (int64_t)(j->q_starts[c] + r0) * j->o_tok + (int64_t)h0 * j->o_head;
    for (int g = 0; g < GH; ++g) {
        for (int x = 0; x < D; ++x) {
            tl_vf v;
            for (int i = 0; i < TL_VL; ++i)
                v[i] = q0[(int64_t)(i < rows ? i : rows - 1) * j->q_tok + (int64_t)g * j->q_head + x];
            qt[g][x] = v * j->scale; /* the reference scales q . k: 1 ulp apart */
            acc[g][x] = v * 0.0f;
        }
        max[g] = qt[g][0] * 0.0f - FLT_MAX;
        sum[g] = qt[g][0] * 0.0f;
    }
    for (int k0 = 0; k0 <= last_pos; k0 += TL_VL) {
        const int kn = last_pos + 1 - k0 < TL_VL ? last_pos + 1 - k0 : TL_VL;
        const int masked = k0 + kn - 1 > first_pos; /* a key past some row's position */
        int64_t row[TL_VL]; /* cache offset of each key's row; past kn, the last key's again */
        for (int u = 0, b = k0 / bs, t = k0 % bs; u < TL_VL; ++u) {
            row[u] = (int64_t)table[b] * j->c_block + (int64_t)t * j->c_tok + kv_off;
            if (u + 1 < kn && ++t == bs) {
                t = 0;
                ++b;
            }
        }
        /* Scores of all GH heads at once, KB keys a pass: each key element read is used GH
         * times, each query vector KB times (GH * KB <= 16 sums in registers). */
        tl_vf s[4][TL_VL];
        for (int u0 = 0; u0 < kn; u0 += KB) {
            tl_vf a[4][16]; /* [GH][KB], fixed size so that it stays in registers */
            for (int i = 0; i < KB; ++i) {
                const float k0x = tl_elem(j->k, dtype, row[u0 + i]);
                for (int g = 0; g < GH; ++g)
                    a[g][i] = qt[g][0] * k0x;
            }
            for (int x = 1; x < D; ++x)
                for (int i = 0; i < KB; ++i) {
                    const float kx = tl_elem(j->k, dtype, row[u0 + i] + x);
                    for (int g = 0; g < GH; ++g)
                        a[g][i] += qt[g][x] * kx;
                }
            for (int g = 0; g < GH; ++g)
                for (int i = 0; i < KB && u0 + i < kn; ++i)
                    s[g][u0 + i] = masked ? tl_vselect(pos >= k0 + u0 + i, a[g][i], a[g][i] * 0.0f - FLT_MAX)
                                          : a[g][i];
        }
        tl_vf alpha[4];
        for (int g = 0; g < GH; ++g) {
            tl_vf chunk_max = s[g][0];
            for (int u = 1; u < kn; ++u)
                chunk_max = tl_vselect(s[g][u] > chunk_max, s[g][u], chunk_max);
            const tl_vf new_max = tl_vselect(chunk_max > max[g], chunk_max, max[g]);
            alpha[g] = tl_vexp(max[g] - new_max);
            max[g] = new_max;
            sum[g] *= alpha[g];
            for (int u = 0; u < kn; ++u) {
                tl_vf e = tl_vexp(s[g][u] - new_max);
                if (masked)
                    e = tl_vselect(pos >= k0 + u, e, e * 0.0f);
                sum[g] += e;
                s[g][u] = e;
            }
        }
        /* The accumulators, rescaled as loaded, then the weighted V rows of all GH heads, KB
         * columns a pass. */
        for (int x0 = 0; x0 < D; x0 += KB) {
            tl_vf a[4][16]; /* [GH][KB], fixed size so that it stays in registers */
            for (int g = 0; g < GH; ++g)
                for (int i = 0; i < KB; ++i)
                    a[g][i] = acc[g][x0 + i] * alpha[g];
            for (int u = 0; u < kn; ++u)
                for (int i = 0; i < KB; ++i) {
                    const float vx = tl_elem(j->v, dtype, row[u] + x0 + i);
                    for (int g = 0; g < GH; ++g)
                        a[g][i] += s[g][u] * vx;
                }
            for (int g = 0; g < GH; ++g)
                for (int i = 0; i < KB; ++i)
                    acc[g][x0 + i] = a[g][i];
        }
    }
    for (int g = 0; g < GH; ++g) {
        const tl_vf inv = 1.0f / sum[g];
        for (int x = 0; x < D; ++x) {
            const tl_vf y = acc[g][x] * inv;
            for (int i = 0; i < rows; ++i)
                out0[(int64_t)i * j->o_tok + (int64_t)g * j->o_head + x] = y[i];
        }
    }
}

/* The query heads of one item: the most, of 4, 3, 2 and 1, that divides G (an item's heads
 * share one KV head) and whose queries and accumulators stay in L1 (GH * D <= 192 vectors
 * each: 24 KiB of each with AVX-512). So the kernel is built once per head size and heads per
 * item (seven builds), and any G takes it. Three heads a pass instead of one: G = 3 and 6
 * with head size 64 ran 1.4-1.7x faster (SmolLM's and Qwen2.5-1.5B's groups). */
#define TL_PREFILL_FITS(D, G, GH) ((G) % (GH) == 0 && (D) * (GH) <= 192)
#define TL_PREFILL_HEADS(D, G)                                                                   \
    (TL_PREFILL_FITS(D, G, 4) ? 4 : TL_PREFILL_FITS(D, G, 3) ? 3 : TL_PREFILL_FITS(D, G, 2) ? 2 : 1)
#define TL_PREFILL(D, GH) \
    case (D) * 128 + (GH): tl_prefill_item(j, c, r0, h0, (D), (GH)); return

/* Work item `item`: the chunk it falls in, its row tile (the chunk's last tile first: it has
 * the most keys) and its heads. */
static void tl_prefill_attend(const tl_prefill_job *j, int item) {
    int c = 0;
    while (item >= j->first_item[c + 1])
        ++c;
    const int groups = j->hq / j->gh, local = item - j->first_item[c];
    const int tiles = (j->q_lens[c] + TL_VL - 1) / TL_VL;
    const int r0 = (tiles - 1 - local / groups) * TL_VL, h0 = local % groups * j->gh;
    switch (j->d * 128 + j->gh) {
    TL_PREFILL(32, 1); TL_PREFILL(32, 2); TL_PREFILL(32, 3); TL_PREFILL(32, 4);
    TL_PREFILL(64, 1); TL_PREFILL(64, 2); TL_PREFILL(64, 3);
    }
}

static void tl_prefill_item_of(void *job, int64_t item, int worker) {
    (void)worker;
    tl_prefill_attend((const tl_prefill_job *)job, (int)item);
}

/* Whether tl_paged_prefill_attention takes this head size and query heads per KV head. Head
 * size 128 is left to torch's SDPA, whose flash kernel multiplies such heads as GEMMs: built
 * for it (one head an item), this kernel ran 1.2-2.5x SDPA's speed on 100-300-token prompts of
 * Llama-3 shapes but 0.6-0.75x on 1024 tokens, against 1.3-3.5x for head sizes 32 and 64 with
 * two or more heads an item (2-core Xeon). */
int tl_prefill_supported(int d, int group) {
    return (d == 32 || d == 64) && group >= 1 && group <= TL_MAX_GROUP;
}

/* Returns TL_OK, or an error code with nothing written (TL_BAD_SHAPE when a shape is not
 * supported or a row, table row, length or block number is out of range: `q_rows` rows of q
 * and out, `table_rows` block tables, `num_blocks` cache blocks; TL_NO_MEMORY). `pool`: the
 * items go to the helper pool (a pool step), else to the caller's OpenMP team. */
int tl_paged_prefill_attention(
    const float *q, int64_t q_tok, int64_t q_head,
    const void *k_cache, const void *v_cache, int dtype,
    int64_t c_block, int64_t c_tok, int64_t c_head,
    const int32_t *tables, int64_t table_stride,
    const int32_t *q_starts, const int32_t *q_lens, const int32_t *ctx_lens, const int32_t *seqs,
    int n, int hq, int hkv, int d, int block_size, float scale,
    float *out, int64_t o_tok, int64_t o_head, int num_threads, int pool, int64_t q_rows,
    int64_t table_rows, int64_t num_blocks) {
    if (!tl_cache_dtype_ok(dtype))
        return TL_BAD_DTYPE;
    if (n < 0 || hkv <= 0 || hq % hkv || !tl_prefill_supported(d, hq / hkv) || block_size <= 0)
        return TL_BAD_SHAPE;
    for (int i = 0; i < n; ++i)
        if (q_lens[i] < 1 || ctx_lens[i] < q_lens[i] || q_starts[i] < 0
            || (int64_t)q_starts[i] + q_lens[i] > q_rows
            || !tl_table_ok(tables, table_stride, table_rows, seqs[i], ctx_lens[i], block_size, num_blocks))
            return TL_BAD_SHAPE;
    if (n == 0)
        return TL_OK;
    const int gh = TL_PREFILL_HEADS(d, hq / hkv);
    int32_t *first_item = malloc(sizeof(int32_t) * ((size_t)n + 1));
    if (!first_item)
        return TL_NO_MEMORY;
    first_item[0] = 0;
    for (int i = 0; i < n; ++i)
        first_item[i + 1] = first_item[i] + (q_lens[i] + TL_VL - 1) / TL_VL * (hq / gh);
    tl_prefill_job job = {.q = q, .q_tok = q_tok, .q_head = q_head, .k = k_cache, .v = v_cache,
                          .dtype = dtype, .c_block = c_block, .c_tok = c_tok, .c_head = c_head,
                          .tables = tables, .table_stride = table_stride, .q_starts = q_starts,
                          .q_lens = q_lens, .ctx_lens = ctx_lens, .seqs = seqs,
                          .first_item = first_item, .n = n, .hq = hq, .hkv = hkv, .d = d,
                          .block_size = block_size, .gh = gh, .scale = scale, .out = out,
                          .o_tok = o_tok, .o_head = o_head};
    const int items = first_item[n];
    if (num_threads > items)
        num_threads = items;
    tl_run(tl_prefill_item_of, &job, items, num_threads, pool);
    free(first_item);
    return TL_OK;
}

/* Greedy sampling's argmax of each row of a float32 [rows, cols] matrix (row stride `stride`
 * elements), as torch.argmax: the first index of the largest value, and the first NaN if a
 * row has one (NaN compares above everything). One vector pass per row; a row with a NaN
 * is scanned again for its first one. A large batch splits its rows over `num_threads` of the
 * caller's OpenMP team (each row is found the same way whichever thread takes it). */
int tl_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                   int num_threads) {
    if (rows < 0 || cols <= 0)
        return TL_BAD_SHAPE;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows > 1 && rows * cols >= (1 << 18))
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        float best = row[0];
        int64_t index = 0, c = 0;
        int has_nan = 0;
        if (cols >= 32) {
            /* One pass: each of 4 x 8 lanes keeps its largest value and where it first saw it
             * (a strict > keeps the first of equal values); then the lanes' best, the lowest
             * index among lanes that hold it. Four independent lane sets, so the compare and
             * select chains overlap. (A max pass, then a scalar search for its first index,
             * took 3.4x as long on [16, 32000].) */
            tl_v8 maxv[4];
            tl_i8 at[4], where[4], nan = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int u = 0; u < 4; ++u) {
                memcpy(&maxv[u], row + 8 * u, sizeof maxv[u]);
                for (int i = 0; i < 8; ++i)
                    at[u][i] = 8 * u + i;
                where[u] = at[u];
                nan |= (tl_i8)(maxv[u] != maxv[u]);
            }
            for (c = 32; c + 32 <= cols; c += 32) {
                for (int u = 0; u < 4; ++u) {
                    tl_v8 v;
                    memcpy(&v, row + c + 8 * u, sizeof v);
                    at[u] += 32;
                    nan |= (tl_i8)(v != v);
                    const tl_i8 greater = (tl_i8)(v > maxv[u]);
                    maxv[u] = tl_select(greater, v, maxv[u]);
                    where[u] = (where[u] & ~greater) | (at[u] & greater);
                }
            }
            for (int i = 0; i < 8; ++i)
                has_nan |= nan[i] != 0;
            best = maxv[0][0];
            index = where[0][0];
            for (int u = 0; u < 4; ++u) {
                for (int i = 0; i < 8; ++i) {
                    if (maxv[u][i] > best || (maxv[u][i] == best && where[u][i] < index)) {
                        best = maxv[u][i];
                        index = where[u][i];
                    }
                }
            }
        } else {
            c = 1;
            has_nan = best != best;
        }
        for (int64_t t = c; t < cols; ++t) { /* the tail: later than every index above */
            has_nan |= row[t] != row[t];
            if (row[t] > best) {
                best = row[t];
                index = t;
            }
        }
        if (has_nan) { /* torch: the first NaN */
            for (int64_t t = 0; t < cols; ++t) {
                if (row[t] != row[t]) {
                    index = t;
                    break;
                }
            }
        }
        out[r] = index;
    }
    (void)num_threads;
    return TL_OK;
}

/* float32 -> bfloat16 as torch rounds it: to nearest, ties to even; NaN -> the quiet NaN. */
static inline uint16_t tl_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The KV cache write of one layer: the rows [Hkv, D] of K and V of token t go to cache slot
 * slots[t] (block slots[t] / block_size, row slots[t] % block_size); a negative slot is
 * skipped. The source is float32 (rounded to the cache dtype as torch's `.to()` rounds) or
 * already the cache dtype (copied as it is). K and V share their strides (views of one qkv
 * matrix or two alike tensors), and so do the caches. Returns TL_BAD_SHAPE with nothing
 * written when a slot is past the cache (`num_slots`). One thread: a step writes a few MiB at
 * most, less than a thread start would save. */
int tl_write_kv(const void *k, const void *v, int src_dtype, int64_t s_tok, int64_t s_head,
                void *k_cache, void *v_cache, int dtype, int64_t c_block, int64_t c_tok,
                int64_t c_head, const int64_t *slots, int64_t n, int hkv, int d, int block_size,
                int64_t num_slots) {
    if (dtype != TL_FLOAT32 && dtype != TL_BFLOAT16 && dtype != TL_FLOAT16)
        return TL_BAD_DTYPE;
#ifndef __FLT16_MAX__
    if (dtype == TL_FLOAT16 && src_dtype != TL_FLOAT16)
        return TL_BAD_DTYPE;
#endif
    if (src_dtype != TL_FLOAT32 && src_dtype != dtype)
        return TL_BAD_DTYPE;
    if (n < 0 || hkv <= 0 || d <= 0 || block_size <= 0)
        return TL_BAD_SHAPE;
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= num_slots)
            return TL_BAD_SHAPE;
    const size_t size = dtype == TL_FLOAT32 ? 4 : 2, src_size = src_dtype == TL_FLOAT32 ? 4 : 2;
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0)
            continue;
        const int64_t dst = slot / block_size * c_block + slot % block_size * c_tok;
        for (int pass = 0; pass < 2; ++pass) {
            const char *src_row = (const char *)(pass ? v : k) + (size_t)(t * s_tok) * src_size;
            char *dst_row = (char *)(pass ? v_cache : k_cache) + (size_t)dst * size;
            for (int h = 0; h < hkv; ++h) {
                const char *s = src_row + (size_t)(h * s_head) * src_size;
                char *o = dst_row + (size_t)(h * c_head) * size;
                if (src_dtype == dtype) {
                    memcpy(o, s, (size_t)d * size);
                } else if (dtype == TL_BFLOAT16) {
                    const float *f = (const float *)s;
                    uint16_t *b = (uint16_t *)o;
                    for (int i = 0; i < d; ++i)
                        b[i] = tl_to_bf16(f[i]);
                } else {
#ifdef __FLT16_MAX__
                    const float *f = (const float *)s;
                    _Float16 *b = (_Float16 *)o;
                    for (int i = 0; i < d; ++i)
                        b[i] = (_Float16)f[i];
#endif
                }
            }
        }
    }
    return TL_OK;
}

/* runtime/executor/llama.py's `apply_rope_` on the query and key heads of one layer's qkv rows, in
 * place, then the KV cache write of the rotated keys and the values (tl_write_kv): one call
 * instead of five torch ops and a second call per layer. Row t of `qkv` (float32, row stride
 * `s_tok` elements) holds hq query heads, then hkv key heads, then hkv value heads, of `d`
 * elements each. `cos` and `sin` are float32 [n, d] (row stride `cs_tok`), `sin` with its first
 * half negated (runtime/executor/llama.py's `signed_sin`), so that for each head x:
 *   x[i] <- x[i] * cos[i] + x[(i + d/2) % d] * sin[i]
 * computed as the torch ops compute it: both products rounded, then their sum (no fused
 * multiply-add: the pragmas below keep GCC and clang from contracting), so the result is
 * bitwise torch's. Returns TL_BAD_SHAPE with nothing changed when `d` is odd or a slot is past
 * the cache, TL_BAD_DTYPE as tl_write_kv. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
int tl_rope_write_kv(float *qkv, int64_t n, int64_t s_tok, const float *cos, const float *sin,
                     int64_t cs_tok, int hq, int hkv, int d, void *k_cache, void *v_cache,
                     int dtype, int64_t c_block, int64_t c_tok, int64_t c_head,
                     const int64_t *slots, int block_size, int64_t num_slots) {
    if (n < 0 || hq <= 0 || hkv <= 0 || d <= 0 || d % 2 || d > 1024 || block_size <= 0)
        return TL_BAD_SHAPE;
    if (!tl_cache_dtype_ok(dtype))
        return TL_BAD_DTYPE;
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] >= num_slots)
            return TL_BAD_SHAPE;
    const int half = d / 2;
    for (int64_t t = 0; t < n; ++t) {
        const float *c = cos + t * cs_tok, *sn = sin + t * cs_tok;
        for (int h = 0; h < hq + hkv; ++h) {
            float *x = qkv + t * s_tok + (int64_t)h * d;
            float rotated[1024];
            memcpy(rotated, x + half, sizeof(float) * (size_t)half);
            memcpy(rotated + half, x, sizeof(float) * (size_t)half);
#pragma omp simd
            for (int i = 0; i < d; ++i) {
                const float a = x[i] * c[i];
                const float b = rotated[i] * sn[i];
                x[i] = a + b;
            }
        }
    }
    return tl_write_kv(qkv + (int64_t)hq * d, qkv + (int64_t)(hq + hkv) * d, TL_FLOAT32, s_tok, d,
                       k_cache, v_cache, dtype, c_block, c_tok, c_head, slots, n, hkv, d,
                       block_size, num_slots);
}
#pragma GCC pop_options

/* RMSNorm of each row of a [rows, cols] matrix, as runtime/executor/llama.py's RMSNorm computes it.
 * float32 (dtype TL_FLOAT32): out = (x * (1 / sqrt(mean(x^2) + eps))) * w, in that order.
 * bfloat16 (TL_BFLOAT16; x, w and out bf16), as transformers' LlamaRMSNorm: the row widened to
 * float32, n = bf16(x * (1 / sqrt(mean(x^2) + eps))), out = bf16(w * n), each rounding to
 * nearest even as torch's `.to()` and bf16 multiply do. Only the sum of squares is added in
 * another order than torch's reduction (so the result may differ from torch's in the last
 * bit); the rest is the same float operations. One call instead of six to nine torch ops per
 * norm, 2L + 1 norms per step. `out` may be `x` (same strides). Large batches (prefill) split
 * their rows over the caller's OpenMP team; each row is computed the same way whichever thread
 * takes it. */
int tl_rms_norm(const void *x, int64_t rows, int64_t cols, int64_t x_stride, const void *w,
                int dtype, float eps, void *out, int64_t out_stride, int num_threads) {
    if (rows < 0 || cols <= 0)
        return TL_BAD_SHAPE;
    if (dtype != TL_FLOAT32 && dtype != TL_BFLOAT16)
        return TL_BAD_DTYPE;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows * cols >= (1 << 17))
#endif
    for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.0f;
        if (dtype == TL_FLOAT32) {
            const float *xr = (const float *)x + r * x_stride, *wf = (const float *)w;
            float *o = (float *)out + r * out_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < cols; ++i)
                sum += xr[i] * xr[i];
            const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
            for (int64_t i = 0; i < cols; ++i)
                o[i] = (xr[i] * inv) * wf[i];
        } else {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride, *wb = (const uint16_t *)w;
            uint16_t *o = (uint16_t *)out + r * out_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < cols; ++i) {
                const float f = tl_from_bf16(xr[i]);
                sum += f * f;
            }
            const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
            for (int64_t i = 0; i < cols; ++i) {
                const float n = tl_from_bf16(tl_to_bf16(tl_from_bf16(xr[i]) * inv));
                o[i] = tl_to_bf16(tl_from_bf16(wb[i]) * n);
            }
        }
    }
    (void)num_threads;
    return TL_OK;
}

/* ------------------------------------------------------------------ small-batch linear
 *
 * out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]), for the few rows of a decode step, in float32
 * or in bfloat16 (x, W, bias and out bf16; every product and sum in float32, each output
 * rounded to bf16 once, to nearest even, as torch's bf16 linear does).
 * W is packed once into panels of TL_NR output columns (tl_panel_width): panel p is
 * W[p * NR : (p + 1) * NR, :] transposed, [K][NR] contiguous, zero past N, so a panel is one
 * stream of memory (half as long in bf16, widened to float32 in registers as it is read). A
 * work item is one panel for up to 96 rows (all of a decode batch): the
 * rows go by TL_MR at a time, each pass keeping TL_MR x NR sums in registers over the panel's
 * K rows (4 vector loads and TL_MR broadcasts per 4 * TL_MR multiply-adds), the panel in L2
 * after the first pass. While a thread multiplies one panel it prefetches its next one, a
 * share with every pass, so the weights arrive from memory during the passes instead of
 * stalling the first pass of every panel. Each sum adds x[r][k] * W[n][k] for k in order, then
 * the bias. Items go to the helper pool in slices of consecutive items (tl_panels). */

#define TL_NR (4 * TL_VL)                  /* output columns per panel: four vectors */
/* tl_vf that may sit anywhere: a panel need not start on a vector boundary. */
typedef float tl_vf_u __attribute__((vector_size(4 * TL_VL), aligned(4)));
/* TL_VL bf16 values, anywhere; and the unsigned lanes they widen through. */
typedef uint16_t tl_vh_u __attribute__((vector_size(2 * TL_VL), aligned(2)));
typedef uint16_t tl_vh __attribute__((vector_size(2 * TL_VL)));
typedef uint32_t tl_vu __attribute__((vector_size(4 * TL_VL)));
#define TL_MR (TL_VL == 16 ? 6 : 3)        /* rows per pass: TL_MR x 4 sums, 4 weights in registers */
#define TL_LINEAR_CHUNK 96                 /* rows per work item (at most) */
/* bf16 panels hold pairs of k ([ceil(K / 2)][NR][2], the last pair zero-padded for an odd K)
 * where the CPU multiplies bf16 pairs natively (AVX512-BF16: one vdpbf16ps adds
 * x[2j] * W[n][2j] + x[2j + 1] * W[n][2j + 1] to 16 float32 sums), else [K][NR] like float32. */
#if defined(__AVX512BF16__) && TL_VL == 16
#define TL_BF16_PAIRS 1
#else
#define TL_BF16_PAIRS 0
#endif

int tl_panel_width(void) { return TL_NR; }
int tl_panel_bf16_pairs(void) { return TL_BF16_PAIRS; }

/* bf16 -> float32 of a vector: the 16 bits become the high half. */
static inline __attribute__((always_inline)) tl_vf tl_widen_bf16(tl_vh_u h) {
    return (tl_vf)(__builtin_convertvector(h, tl_vu) << 16);
}

/* float32 -> bf16 of a vector, to nearest even (NaN -> 0x7fc0), as tl_to_bf16. */
static inline __attribute__((always_inline)) tl_vh tl_narrow_bf16(tl_vf y) {
    const tl_vu u = (tl_vu)y;
    const tl_vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const tl_vu nan = (tl_vu)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & 0x7fc0u) | (~nan & rounded), tl_vh);
}

/* Per-row state of a fused argmax (tl_linear_panels_argmax): for each row, one vector of the
 * largest sum each lane has seen and its column. A lane sees its columns in increasing order,
 * so a strict > keeps the first of equal maxima. */
typedef struct {
    float *best;     /* [rows][TL_VL] */
    int32_t *column; /* [rows][TL_VL] */
    int64_t col0;    /* the panel's first output column */
    int nan;         /* set when a sum is NaN (the caller falls back to the logits) */
} tl_argmax_state;

/* Rows [0, MR) of x (row stride xs elements) times one panel [k][NR]; `ncols` (<= NR) columns
 * of out written, or with `am` the rows' argmax state updated instead (rows of am->best and
 * am->column from this pass's first row on). BF: x, the panel, bias and out are bf16 (else
 * float32). Meanwhile `pf_lines` 64-byte lines from `pf` are prefetched, spread over the k
 * loop. */
static inline __attribute__((always_inline)) void tl_linear_pass(
    const void *x, int64_t xs, const void *panel, int64_t k, const void *bias, void *out,
    int64_t os, int ncols, const char *pf, int64_t pf_lines, const int MR, const int BF, tl_argmax_state *am) {
    tl_vf acc[TL_MR][4];
    for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 4; ++v)
            acc[i][v] = (tl_vf){0};
#if TL_BF16_PAIRS
    if (BF) {
        /* Pairs of k: x's pair broadcast to every lane, one vdpbf16ps per weight vector
         * (which adds the pair's second product, then its first; denormals count as zero). */
        const uint16_t *xh = (const uint16_t *)x;
        const int64_t pairs = (k + 1) / 2, per_pair = (pf_lines + pairs - 1) / pairs;
        for (int64_t kp = 0; kp < pairs; ++kp) {
            for (int64_t l = kp * per_pair; l < (kp + 1) * per_pair && l < pf_lines; ++l)
                __builtin_prefetch(pf + l * 64, 0, 2);
            const uint16_t *wp = (const uint16_t *)panel + kp * 2 * TL_NR;
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
#define TL_DP_ROWS(PAIR)                                                                          \
            for (int i = 0; i < MR; ++i) {                                                        \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)(PAIR));                     \
                acc[i][0] = (tl_vf)_mm512_dpbf16_ps((__m512)acc[i][0], xv, w0);                   \
                acc[i][1] = (tl_vf)_mm512_dpbf16_ps((__m512)acc[i][1], xv, w1);                   \
                acc[i][2] = (tl_vf)_mm512_dpbf16_ps((__m512)acc[i][2], xv, w2);                   \
                acc[i][3] = (tl_vf)_mm512_dpbf16_ps((__m512)acc[i][3], xv, w3);                   \
            }
            if (__builtin_expect(2 * kp + 1 < k, 1)) {
                /* x's pair read as one 32-bit broadcast from memory */
                TL_DP_ROWS(*(const int32_t __attribute__((aligned(2), may_alias)) *)(xh + i * xs + 2 * kp))
            } else { /* an odd K's last pair: x[k - 1] alone */
                TL_DP_ROWS(xh[i * xs + 2 * kp])
            }
#undef TL_DP_ROWS
        }
    }
#endif
    const int64_t per_k = (pf_lines + k - 1) / k; /* lines to prefetch per k */
    for (int64_t kk = 0; kk < k && !(BF && TL_BF16_PAIRS); ++kk) {
        for (int64_t l = kk * per_k; l < (kk + 1) * per_k && l < pf_lines; ++l)
            __builtin_prefetch(pf + l * 64, 0, 2);
        /* Read in place through tl_vf_u / tl_vh_u (a memcpy into a tl_vf array here kept the
         * sums in memory: 3-4x slower). */
        if (BF) {
            const tl_vh_u *w = (const tl_vh_u *)((const uint16_t *)panel + kk * TL_NR);
            const tl_vf w0 = tl_widen_bf16(w[0]), w1 = tl_widen_bf16(w[1]);
            const tl_vf w2 = tl_widen_bf16(w[2]), w3 = tl_widen_bf16(w[3]);
            for (int i = 0; i < MR; ++i) {
                const float xv = tl_from_bf16(((const uint16_t *)x)[i * xs + kk]);
                acc[i][0] += xv * w0;
                acc[i][1] += xv * w1;
                acc[i][2] += xv * w2;
                acc[i][3] += xv * w3;
            }
        } else {
            const tl_vf_u *w = (const tl_vf_u *)((const float *)panel + kk * TL_NR);
            for (int i = 0; i < MR; ++i) {
                const float xv = ((const float *)x)[i * xs + kk];
                for (int v = 0; v < 4; ++v)
                    acc[i][v] += xv * w[v];
            }
        }
    }
    if (bias) {
        tl_vf b[4] = {{0}};
        if (BF) {
            float *bf = (float *)b;
            for (int c = 0; c < ncols; ++c)
                bf[c] = tl_from_bf16(((const uint16_t *)bias)[c]);
        } else {
            memcpy(b, bias, sizeof(float) * (size_t)ncols);
        }
        for (int i = 0; i < MR; ++i)
            for (int v = 0; v < 4; ++v)
                acc[i][v] += b[v];
    }
    if (am) {
        tl_vi lane;
        for (int l = 0; l < TL_VL; ++l)
            lane[l] = l;
        for (int i = 0; i < MR; ++i) {
            tl_vf best;
            tl_vi column, nan = {0};
            memcpy(&best, am->best + i * TL_VL, sizeof best);
            memcpy(&column, am->column + i * TL_VL, sizeof column);
            for (int v = 0; v < 4; ++v) {
                const tl_vi col = lane + (int32_t)(am->col0 + v * TL_VL);
                /* bf16: compare the sums rounded as the outputs would be (ties as torch sees them) */
                const tl_vf y = BF ? (tl_vf)(__builtin_convertvector(tl_narrow_bf16(acc[i][v]), tl_vu) << 16)
                                   : acc[i][v];
                /* Columns past n (the zero padding of the last panel) never win. */
                const tl_vi valid = col < (int32_t)(am->col0 + ncols);
                nan |= (y != y) & valid;
                const tl_vi take = (y > best) & valid;
                best = (tl_vf)((take & (tl_vi)y) | (~take & (tl_vi)best));
                column = (take & col) | (~take & column);
            }
            for (int l = 0; l < TL_VL; ++l)
                am->nan |= nan[l] != 0;
            memcpy(am->best + i * TL_VL, &best, sizeof best);
            memcpy(am->column + i * TL_VL, &column, sizeof column);
        }
        return;
    }
    /* Stores by value (a copy of acc's address would keep the sums in memory, not registers). */
    for (int i = 0; i < MR; ++i) {
        if (BF) {
            uint16_t *o = (uint16_t *)out + i * os;
            if (ncols == TL_NR) {
                for (int v = 0; v < 4; ++v) {
                    const tl_vh y = tl_narrow_bf16(acc[i][v]);
                    memcpy(o + v * TL_VL, &y, sizeof y);
                }
            } else {
                tl_vh y[4];
                for (int v = 0; v < 4; ++v)
                    y[v] = tl_narrow_bf16(acc[i][v]);
                memcpy(o, y, sizeof(uint16_t) * (size_t)ncols);
            }
        } else if (ncols == TL_NR) {
            for (int v = 0; v < 4; ++v) {
                const tl_vf y = acc[i][v];
                memcpy((float *)out + i * os + v * TL_VL, &y, sizeof y);
            }
        } else {
            tl_vf y[4];
            for (int v = 0; v < 4; ++v)
                y[v] = acc[i][v];
            memcpy((float *)out + i * os, y, sizeof(float) * (size_t)ncols);
        }
    }
}

#define TL_LINEAR_PASS(MR, BF)                                                                    \
    tl_linear_pass(xb + r * xs * es, xs, pb + p * panel_bytes, k, b,                              \
                   out ? ob + (r * os + p * TL_NR) * es : NULL, os, ncols, pf_at, pf_n, (MR), (BF), am)

#if TL_MR > 5
#define TL_LINEAR_PASSES(BF)                                                                      \
    switch (m1 - r < TL_MR ? m1 - r : TL_MR) {                                                    \
    case TL_MR: TL_LINEAR_PASS(TL_MR, BF); break;                                                 \
    case 5: TL_LINEAR_PASS(5, BF); break;                                                         \
    case 4: TL_LINEAR_PASS(4, BF); break;                                                         \
    case 3: TL_LINEAR_PASS(3, BF); break;                                                         \
    case 2: TL_LINEAR_PASS(2, BF); break;                                                         \
    case 1: TL_LINEAR_PASS(1, BF); break;                                                         \
    }
#else
#define TL_LINEAR_PASSES(BF)                                                                      \
    switch (m1 - r < TL_MR ? m1 - r : TL_MR) {                                                    \
    case TL_MR: TL_LINEAR_PASS(TL_MR, BF); break;                                                 \
    case 2: TL_LINEAR_PASS(2, BF); break;                                                         \
    case 1: TL_LINEAR_PASS(1, BF); break;                                                         \
    }
#endif

/* One call of tl_panels: its operands, and the slices of its items that workers claim. */
typedef struct {
    const char *xb, *pb;
    const void *bias;
    void *out;
    int64_t m, k, xs, n, os, es, num_panels, rows_per_chunk, panel_bytes, panel_lines, items, slices;
    int bf;
    float *slice_best;       /* with argmax: [slices][m * TL_VL + m] */
    int32_t *slice_column;   /* the same shape */
    int nan;                 /* a NaN met (atomic or) */
} tl_panels_task;

/* Slice `slice`: items [items * slice / slices, items * (slice + 1) / slices), in order, the
 * next panel's lines prefetched a share per pass; with argmax, the slice's best (value, first
 * column) per row after it. */
static void tl_panels_slice(void *ctx, int64_t slice, int worker) {
    (void)worker;
    const tl_panels_task *t = (const tl_panels_task *)ctx;
    const char *xb = t->xb, *pb = t->pb;
    void *out = t->out;
    char *ob = (char *)out;
    const int64_t m = t->m, k = t->k, xs = t->xs, n = t->n, os = t->os, es = t->es;
    const int64_t num_panels = t->num_panels, panel_bytes = t->panel_bytes, panel_lines = t->panel_lines;
    const int64_t first = t->items * slice / t->slices, last = t->items * (slice + 1) / t->slices;
    const int argmax = t->slice_best != NULL;
    float *best = argmax ? t->slice_best + slice * m * (TL_VL + 1) : NULL;
    int32_t *column = argmax ? t->slice_column + slice * m * (TL_VL + 1) : NULL;
    int nan = 0;
    for (int64_t i = 0; argmax && i < m * TL_VL; ++i) {
        best[i] = -INFINITY;
        column[i] = (int32_t)(first % num_panels * TL_NR); /* a row of -inf: its first column */
    }
    for (int64_t it = first; it < last; ++it) {
        const int64_t p = it % num_panels, m0 = it / num_panels * t->rows_per_chunk;
        const int64_t m1 = m0 + t->rows_per_chunk < m ? m0 + t->rows_per_chunk : m;
        const int ncols = n - p * TL_NR < TL_NR ? (int)(n - p * TL_NR) : TL_NR;
        const void *b = t->bias ? (const char *)t->bias + p * TL_NR * es : NULL;
        /* The slice's next panel, in shares of one per pass (none if it is this one). */
        const int64_t next_p = (it + 1) % num_panels;
        const int64_t passes = (m1 - m0 + TL_MR - 1) / TL_MR;
        const int64_t share = it + 1 < last && next_p != p ? (panel_lines + passes - 1) / passes : 0;
        const char *next = pb + next_p * panel_bytes;
        int64_t r = m0, done = 0;
        for (; r < m1; r += TL_MR) {
            const char *pf_at = next + done * 64;
            const int64_t pf_n = share < panel_lines - done ? share : panel_lines - done;
            done += pf_n;
            tl_argmax_state state, *am = NULL;
            if (argmax) {
                state = (tl_argmax_state){best + r * TL_VL, column + r * TL_VL, p * TL_NR, 0};
                am = &state;
            }
            if (t->bf) {
                TL_LINEAR_PASSES(1)
            } else {
                TL_LINEAR_PASSES(0)
            }
            if (am)
                nan |= state.nan;
        }
    }
    /* The slice's lanes to one (value, first column) per row, after its lanes' values. */
    for (int64_t i = 0; argmax && i < m; ++i) {
        float v = -INFINITY;
        int32_t c = INT32_MAX;
        for (int l = 0; l < TL_VL; ++l) {
            const float lv = best[i * TL_VL + l];
            const int32_t lc = column[i * TL_VL + l];
            if (lv > v || (lv == v && lc < c)) {
                v = lv;
                c = lc;
            }
        }
        best[m * TL_VL + i] = v;
        column[m * TL_VL + i] = c;
    }
    if (nan)
        __atomic_or_fetch(&((tl_panels_task *)ctx)->nan, 1, __ATOMIC_RELAXED);
}

/* tl_linear_panels(_bf16), or with `argmax` (m <= TL_LINEAR_CHUNK) the first column of each
 * row's largest sum (in bf16, of the sums rounded to bf16) instead of the sums. `bf`: every
 * operand is bf16. The items (panel x row chunk) are cut into slices of consecutive items, four
 * per thread, that the helper pool hands out: a slice reads its panels in order (each
 * prefetched during the one before) and holds increasing columns. */
static int tl_panels(const void *x, int64_t m, int64_t k, int64_t xs, const void *panels, int64_t n,
                     const void *bias, void *out, int64_t os, int64_t *argmax, int bf, int num_threads,
                     int pool) {
    const int64_t num_panels = (n + TL_NR - 1) / TL_NR, chunks = (m + TL_LINEAR_CHUNK - 1) / TL_LINEAR_CHUNK;
    const int64_t items = num_panels * chunks;
    if (items == 0)
        return TL_OK;
    /* Chunks of equal size, a multiple of TL_MR rows (but the last). */
    int64_t rows_per_chunk = (m + chunks - 1) / chunks;
    rows_per_chunk = (rows_per_chunk + TL_MR - 1) / TL_MR * TL_MR;
    const int64_t es = bf ? 2 : 4; /* bytes per element of every operand */
    const int64_t panel_k = bf && TL_BF16_PAIRS ? (k + 1) / 2 * 2 : k; /* an odd K padded to pairs */
    const int64_t panel_bytes = panel_k * TL_NR * es;
    if (num_threads < 1)
        num_threads = 1;
    int64_t slices = num_threads == 1 ? 1 : 4 * (int64_t)num_threads;
    if (slices > items)
        slices = items;
    tl_panels_task task = {.xb = (const char *)x, .pb = (const char *)panels, .bias = bias, .out = out, .m = m, .k = k, .xs = xs, .n = n, .os = os,
                           .es = es, .num_panels = num_panels, .rows_per_chunk = rows_per_chunk,
                           .panel_bytes = panel_bytes, .panel_lines = panel_bytes / 64,
                           .items = items, .slices = slices, .bf = bf};
    if (argmax) {
        task.slice_best = malloc(sizeof(float) * (size_t)(slices * m * (TL_VL + 1)));
        task.slice_column = malloc(sizeof(int32_t) * (size_t)(slices * m * (TL_VL + 1)));
        if (!task.slice_best || !task.slice_column) {
            free(task.slice_best);
            free(task.slice_column);
            return TL_NO_MEMORY;
        }
    }
    tl_run(tl_panels_slice, &task, slices, num_threads, pool);
    if (argmax) {
        /* Slices hold increasing column ranges: the first slice with the row's maximum. */
        for (int64_t i = 0; i < m; ++i) {
            float v = -INFINITY;
            int64_t c = -1;
            for (int64_t sl = 0; sl < slices; ++sl) {
                const float tv = task.slice_best[sl * m * (TL_VL + 1) + m * TL_VL + i];
                const int32_t tc = task.slice_column[sl * m * (TL_VL + 1) + m * TL_VL + i];
                if (c < 0 || tv > v || (tv == v && tc < c)) {
                    v = tv;
                    c = tc;
                }
            }
            argmax[i] = c;
        }
        free(task.slice_best);
        free(task.slice_column);
    }
    return task.nan ? TL_NAN : TL_OK;
}

/* `pool` (here and below): the items go to the helper pool (a pool step), else to the caller's
 * OpenMP team. Returns TL_OK, or TL_BAD_SHAPE with nothing written (m < 0, k or n < 1, a row stride
 * shorter than its row). `panels` holds ceil(n / tl_panel_width()) panels of [k][width]. */
int tl_linear_panels(const float *x, int64_t m, int64_t k, int64_t xs, const float *panels, int64_t n,
                     const float *bias, float *out, int64_t os, int num_threads, int pool) {
    if (m < 0 || k < 1 || n < 1 || xs < k || os < n)
        return TL_BAD_SHAPE;
    return tl_panels(x, m, k, xs, panels, n, bias, out, os, NULL, 0, num_threads, pool);
}

/* tl_linear_panels with bf16 x, panels, bias and out (uint16_t bit patterns); sums in float32,
 * each output rounded to bf16 once. The panels are laid out as tl_panel_bf16_pairs() says. */
int tl_linear_panels_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t xs, const uint16_t *panels,
                          int64_t n, const uint16_t *bias, uint16_t *out, int64_t os, int num_threads, int pool) {
    if (m < 0 || k < 1 || n < 1 || xs < k || os < n)
        return TL_BAD_SHAPE;
    return tl_panels(x, m, k, xs, panels, n, bias, out, os, NULL, 1, num_threads, pool);
}

/* out[i] = argmax over n of (x[i] . W^T + bias)[n] without the [m, n] sums: the first column
 * of the largest, as torch.argmax. TL_BAD_SHAPE as tl_linear_panels, and for m above
 * TL_LINEAR_CHUNK; TL_NAN when a sum is NaN (out is then not the first NaN torch would pick:
 * the caller computes the sums instead); TL_NO_MEMORY. */
int tl_linear_panels_argmax(const float *x, int64_t m, int64_t k, int64_t xs, const float *panels, int64_t n,
                            const float *bias, int64_t *out, int num_threads, int pool) {
    if (m < 0 || m > TL_LINEAR_CHUNK || k < 1 || n < 1 || xs < k || n > INT32_MAX)
        return TL_BAD_SHAPE;
    return tl_panels(x, m, k, xs, panels, n, bias, NULL, 0, out, 0, num_threads, pool);
}

/* tl_linear_panels_argmax of bf16 operands: the argmax of the sums each rounded to bf16, as
 * torch.argmax of tl_linear_panels_bf16's outputs (equal roundings: the first column). */
int tl_linear_panels_argmax_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t xs, const uint16_t *panels,
                                 int64_t n, const uint16_t *bias, int64_t *out, int num_threads, int pool) {
    if (m < 0 || m > TL_LINEAR_CHUNK || k < 1 || n < 1 || xs < k || n > INT32_MAX)
        return TL_BAD_SHAPE;
    return tl_panels(x, m, k, xs, panels, n, bias, NULL, 0, out, 1, num_threads, pool);
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
