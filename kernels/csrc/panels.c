/* Panel matmuls for the few rows of a decode step (tl_linear_panels, _bf16), and their
 * fused argmax (tl_panels, which lm_head.c's tl_linear_panels_argmax calls).
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
#include "tl_common.h"
#ifdef __AVX512BF16__
#include <immintrin.h> /* _mm512_dpbf16_ps: the bf16 panels' pair products */
#endif

#define TL_NR (4 * TL_VL)                  /* output columns per panel: four vectors */
/* tl_vf that may sit anywhere: a panel need not start on a vector boundary. */
typedef float tl_vf_u __attribute__((vector_size(4 * TL_VL), aligned(4)));
/* TL_VL bf16 values, anywhere; and the unsigned lanes they widen through. */
typedef uint16_t tl_vh_u __attribute__((vector_size(2 * TL_VL), aligned(2)));
typedef uint16_t tl_vh __attribute__((vector_size(2 * TL_VL)));
typedef uint32_t tl_vu __attribute__((vector_size(4 * TL_VL)));
#define TL_MR (TL_VL == 16 ? 6 : 3)        /* rows per pass: TL_MR x 4 sums, 4 weights in registers */
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
TL_INTERNAL int tl_panels(const void *x, int64_t m, int64_t k, int64_t xs, const void *panels, int64_t n,
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
