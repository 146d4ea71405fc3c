/* The KV cache write of a layer (tl_write_kv), and RoPE on its queries and keys followed by
 * that write (tl_rope_write_kv). */
#include "tl_common.h"

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
