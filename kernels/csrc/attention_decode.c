/* Paged decode attention for the CPU.
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
 * helper threads (the helper pool, pool.c) in the caller's order (longest contexts first
 * balances the threads).
 *
 * Built with -O3 and -fopenmp (or -fopenmp-simd -pthread): `#pragma omp simd` lets the float
 * reductions of the generic path vectorize without -ffast-math; the vector path uses GCC
 * vector extensions. */
#include "tl_common.h"

static inline tl_v8 tl_exp8(tl_v8 x) { TL_EXP_BODY(tl_v8, tl_i8) }

/* The same for one value (the tails of the vector loops and the generic path). */
static inline float tl_exp_nonpositive(float x) { return tl_exp8(tl_splat(x))[0]; }

typedef struct {
    const float *q;           /* [T, Hq, D] */
    int64_t q_tok, q_head;    /* strides of q in elements (the D axis is contiguous) */
    const void *k, *v;        /* [num_blocks, block_size, Hkv, D] each, same strides */
    int dtype;                /* TL_FLOAT32 | TL_BFLOAT16 | TL_FLOAT16 | TL_FP8_E4M3 | TL_FP8_E5M2 */
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
    if (tl_is_fp8(dtype)) {
        const uint8_t *src = (const uint8_t *)cache + offset;
        for (int i = 0; i < d; ++i)
            buf[i] = tl_from_fp8(dtype, src[i]);
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
    } else if (tl_is_fp8(dtype)) {
        x = tl_fp8x8((const uint8_t *)cache + offset, dtype);
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
    const int64_t size = tl_dtype_size(dtype);
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
    if (!tl_attention_dtype_ok(dtype))
        return TL_BAD_DTYPE;
    if (tl_is_fp8(dtype))
        tl_fp8_tables();
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


/* Whether the attention kernels (decode and prefill) read caches of this dtype code. */
int tl_attention_reads_dtype(int dtype) { return tl_attention_dtype_ok(dtype); }
