/* Paged prefill attention for the CPU.
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
#include "tl_common.h"

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
    if (tl_is_fp8(dtype))
        return tl_from_fp8(dtype, ((const uint8_t *)cache)[offset]);
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
    if (!tl_attention_dtype_ok(dtype))
        return TL_BAD_DTYPE;
    if (tl_is_fp8(dtype))
        tl_fp8_tables();
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
