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
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h> /* tl_fp8x8 */
#endif

/* Shared between the library's files, not exported. */
#define TL_INTERNAL __attribute__((visibility("hidden")))

enum { TL_FLOAT32 = 0, TL_BFLOAT16 = 1, TL_FLOAT16 = 2, TL_FP8_E4M3 = 3, TL_FP8_E5M2 = 4 };
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

/* fp8 caches (float8_e4m3fn, float8_e5m2; read by the attention kernels only, their scales
 * applied by the caller): every byte's float32 value, one 256-entry table per format ([0]:
 * e4m3, [1]: e5m2), filled by tl_fp8_tables() (pool.c) before a kernel reads them. */
TL_INTERNAL extern float tl_fp8_lut[2][256];
TL_INTERNAL void tl_fp8_tables(void);

static inline int tl_is_fp8(int dtype) { return dtype == TL_FP8_E4M3 || dtype == TL_FP8_E5M2; }

static inline float tl_from_fp8(int dtype, uint8_t b) { return tl_fp8_lut[dtype - TL_FP8_E4M3][b]; }

/* 8 fp8 bytes widened to float32 in registers (the table's values, without its 8 loads). With
 * F16C (or the compiler's _Float16 elsewhere): e5m2 is the high byte of an fp16, and e4m3 with its
 * bits moved into fp16's place is its value / 2^8 (subnormals included), so one fp16 -> float32
 * conversion does it; e4m3fn's NaN (exponent and mantissa all ones) is the one special to mend.
 * Elsewhere: a normal number's exponent and mantissa bits move up into float32's place and the
 * exponent is rebiased by one add, a subnormal is its mantissa times 2^(1 - bias - M), and
 * exponent all ones is e4m3fn's NaN or e5m2's inf / NaN. */
static inline tl_v8 tl_fp8x8(const uint8_t *src, int dtype) {
    const int e4m3 = dtype == TL_FP8_E4M3;
#if defined(__AVX2__) && defined(__F16C__)
    /* The same fp16 route in SSE/AVX intrinsics: GCC widens an 8-byte vector lane by lane. */
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src));
    __m128i bits16;
    if (!e4m3) {
        bits16 = _mm_slli_epi16(w, 8);
    } else {
        const __m128i em = _mm_and_si128(w, _mm_set1_epi16(0x7f));
        const __m128i nan = _mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f));
        bits16 = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                           _mm_slli_epi16(em, 7)), nan);
    }
    const __m256 f = _mm256_cvtph_ps(bits16);
    tl_v8 x;
    memcpy(&x, &f, sizeof x);
    return e4m3 ? x * 256.0f : x;
#else
    typedef uint8_t tl_u8x8 __attribute__((vector_size(8)));
    tl_u8x8 raw;
    memcpy(&raw, src, sizeof raw);
#ifdef __FLT16_MAX__
    typedef uint16_t tl_h8u __attribute__((vector_size(16)));
    typedef _Float16 tl_h8f __attribute__((vector_size(16)));
    const tl_h8u w = __builtin_convertvector(raw, tl_h8u);
    if (!e4m3) {
        const tl_h8u bits16 = w << 8;
        tl_h8f h;
        memcpy(&h, &bits16, sizeof h);
        return __builtin_convertvector(h, tl_v8);
    }
    const tl_h8u em = w & 0x7f;
    const tl_h8u nan = (tl_h8u)(em == 0x7f); /* all ones where NaN: fp16 0xffff is a NaN too */
    const tl_h8u bits16 = ((w & 0x80) << 8) | (em << 7) | nan;
    tl_h8f h;
    memcpy(&h, &bits16, sizeof h);
    return __builtin_convertvector(h, tl_v8) * 256.0f;
#else
    const tl_i8 b = __builtin_convertvector(raw, tl_i8);
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const tl_i8 em = b & 0x7f, sign = (b & 0x80) << 24;
    const tl_i8 normal_bits = (em << (23 - mbits)) + ((127 - bias) << 23);
    tl_v8 normal, x;
    memcpy(&normal, &normal_bits, sizeof normal);
    const tl_v8 sub = __builtin_convertvector(em, tl_v8) * (e4m3 ? 0x1p-9f : 0x1p-16f);
    x = tl_select(em < (1 << mbits), sub, normal);
    if (e4m3) {
        x = tl_select(em == 0x7f, tl_splat(__builtin_nanf("")), x);
    } else {
        const tl_i8 special = em >= (31 << 2);
        x = tl_select(special, tl_select(em == (31 << 2), tl_splat(__builtin_inff()), tl_splat(__builtin_nanf(""))), x);
    }
    tl_i8 bits;
    memcpy(&bits, &x, sizeof bits);
    bits |= sign;
    memcpy(&x, &bits, sizeof x);
    return x;
#endif /* __FLT16_MAX__ */
#endif /* AVX2 + F16C */
}

/* Bytes of one cache element. */
static inline int64_t tl_dtype_size(int dtype) { return dtype == TL_FLOAT32 ? 4 : tl_is_fp8(dtype) ? 1 : 2; }

/* Whether the attention kernels of this build read caches of `dtype`: the write's dtypes and fp8. */
static inline int tl_attention_dtype_ok(int dtype) { return tl_is_fp8(dtype) || tl_cache_dtype_ok(dtype); }

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
