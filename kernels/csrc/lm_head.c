/* Greedy sampling's argmax: of logits rows (tl_argmax_rows), and fused into the LM head's
 * panel product (tl_linear_panels_argmax, panels.c's tl_panels), which never makes the
 * [rows, vocabulary] logits. */
#include "tl_common.h"

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
