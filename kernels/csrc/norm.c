/* RMSNorm (tl_rms_norm), float32 and bf16. */
#include "tl_common.h"

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
