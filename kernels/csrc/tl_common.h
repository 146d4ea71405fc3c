/* What the native CPU kernels (this folder, built by kernels/native_build.py and loaded by
 * kernels/cpu_native.py) share: dtype and error codes, the limits, the work runner of pool.c,
 * the float vector types and the conversions.
 *
 * One library is built from every .c file here, once per instruction-set level (setup.py):
 * the files are compiled with the same flags, so the ISA macros (__AVX512F__,
 * __AVX512BF16__, __FLT16_MAX__, _OPENMP) pick the same paths in all of them.
 *
 *   pool.c              the helper pool, the OpenMP team runner, thread binding
 *   attention_decode.c  paged decode attention
 *   attention_prefill.c paged prefill (chunk) attention
 *   panels.c            float32 / bf16 panel matmuls (PanelLinear)
 *   lm_head.c           greedy sampling: argmax of logits rows, and the panel product's fused argmax
 *   kv_cache.c          the KV cache write, RoPE then that write
 *   norm.c              RMSNorm
 *
 * The library exports its non-static tl_* functions (kernels/cpu_native.py's _bind lists them);
 * TL_INTERNAL ones are shared between these files only. */
#ifndef TL_COMMON_H
#define TL_COMMON_H

#define _GNU_SOURCE /* sched_setaffinity, CPU_SET, pthread_setname_np */
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

/* Shared between the library's files, not exported. */
#define TL_INTERNAL __attribute__((visibility("hidden")))

enum { TL_FLOAT32 = 0, TL_BFLOAT16 = 1, TL_FLOAT16 = 2 };
enum { TL_OK = 0, TL_BAD_DTYPE = 1, TL_NO_MEMORY = 2, TL_BAD_SHAPE = 3, TL_NAN = 4 };

#define TL_MAX_GROUP 64  /* query heads per KV head */
#define TL_MAX_HEADS 256 /* query heads of one work item (the vector path) */
#define TL_MAX_GROUP_FIXED 8 /* the largest G with a compiled vector path (TL_FIXED) */

/* A work item of a kernel: item in [0, items), run by worker 0 (the caller) or a helper. */
typedef void (*tl_item_fn)(void *ctx, int64_t item, int worker);

/* The kernels' runner (pool.c): fn for every item, on the helper pool in a pool step (`pool`:
 * the caller's torch runs on one thread, kernels/cpu_native.py), else on the caller's OpenMP
 * team, as torch's own ops. */
TL_INTERNAL void tl_run(tl_item_fn fn, void *ctx, int64_t items, int num_threads, int pool);

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

static inline float tl_from_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16 as torch rounds it: to nearest, ties to even; NaN -> the quiet NaN. */
static inline uint16_t tl_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Whether this build reads caches of `dtype` (float16 needs the compiler's _Float16). */
static inline int tl_cache_dtype_ok(int dtype) {
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
static inline int tl_table_ok(const int32_t *tables, int64_t table_stride, int64_t table_rows, int seq, int len,
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

/* The widest float vector of the build: TL_VL lanes (prefill rows per item, panel vectors). */
#if defined(__AVX512F__)
#define TL_VL 16 /* rows per work item: the widest float vector of the build */
#else
#define TL_VL 8
#endif
typedef float tl_vf __attribute__((vector_size(4 * TL_VL)));
typedef int32_t tl_vi __attribute__((vector_size(4 * TL_VL)));

/* Rows per item of the panel products (panels.c), and the most rows of a fused argmax. */
#define TL_LINEAR_CHUNK 96

/* panels.c: out = x . W^T (+ bias), or with `argmax` each row's first column of the largest
 * sum, over panels packed by kernels/cpu_native.py's PanelLinear; `bf`: bf16 operands. */
TL_INTERNAL int tl_panels(const void *x, int64_t m, int64_t k, int64_t xs, const void *panels, int64_t n,
                          const void *bias, void *out, int64_t os, int64_t *argmax, int bf, int num_threads,
                          int pool);

#endif /* TL_COMMON_H */
