/*
 * kv_attn_tile.c: one work item of the attention.  Its query rows are
 * loaded once (times the scale, in base 2); its keys are walked in tiles of
 * KVA_KEY_TILE positions (decode-like items: KVA_DECODE_KEY_TILE): scores
 * through the level's kernels, soft cap, causal / window / chunk mask,
 * ALiBi, online softmax, then acc = acc * alpha + P V; sinks join the
 * denominators when the rows are written.  Each feature costs a branch per
 * row and tile when it is off, never one per score.
 * The rows of a tile are gathered from the block table (scattered 4 KB
 * pages), and the next tile's rows are prefetched while this one runs.
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <string.h>

/* Row addresses of positions t0 .. min(t0 + tile, k1) - 1, padded to a
 * multiple of 8 with the last row (its scores are masked); returns the
 * number of real rows. */
static int tile_rows(const kva_args *a, const int32_t *table, const char *kbase,
                     const char *vbase, int64_t t0, int64_t k1, int tile, const char **krow,
                     const char **vrow)
{
    const int nt = (int)(k1 - t0 < tile ? k1 - t0 : tile);
    const int ntp = (nt + 7) & ~7;
    int64_t blk = t0 / a->block_size, off = t0 - blk * a->block_size;
    /* a block's run of rows at a time (no test per row) */
    for (int i = 0; i < nt; blk++, off = 0) {
        const int run = (int)(a->block_size - off < nt - i ? a->block_size - off : nt - i);
        const ptrdiff_t o = (ptrdiff_t)table[blk] * a->block_stride + (ptrdiff_t)off * a->row_stride;
        const char *k = kbase + o, *v = vbase + o;
        for (int j = 0; j < run; j++) {
            krow[i + j] = k + (ptrdiff_t)j * a->row_stride;
            vrow[i + j] = v + (ptrdiff_t)j * a->row_stride;
        }
        i += run;
    }
    for (int i = nt; i < ntp; i++) {
        krow[i] = krow[nt - 1];
        vrow[i] = vrow[nt - 1];
    }
    return nt;
}

#ifndef KVA_PREFETCH_AHEAD
/* Key positions ahead of the tile in use whose K and V rows are prefetched
 * whole: past the caches the rows come from scattered 4 KB pages (a block
 * of one kv head), and the hardware prefetchers stop at page boundaries. */
#define KVA_PREFETCH_AHEAD 64
#endif

/* Every line of the K and V rows of positions [from, to) of the item's kv
 * head, a block's run of rows at a time. */
static void prefetch_positions(const kva_args *a, const int32_t *table, const char *kbase,
                               const char *vbase, int64_t from, int64_t to, size_t row_bytes)
{
    int64_t blk = from / a->block_size, off = from - blk * a->block_size;
    while (from < to) {
        const int64_t n = a->block_size - off < to - from ? a->block_size - off : to - from;
        const ptrdiff_t o = (ptrdiff_t)table[blk] * a->block_stride + (ptrdiff_t)off * a->row_stride;
        const char *k = kbase + o, *v = vbase + o;
        if ((size_t)a->row_stride == row_bytes) { /* the run is contiguous */
            const size_t bytes = (size_t)n * row_bytes;
            for (size_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(k + b, 0, 3);
                __builtin_prefetch(v + b, 0, 3);
            }
        } else {
            for (int64_t i = 0; i < n; i++)
                for (size_t b = 0; b < row_bytes; b += 64) {
                    __builtin_prefetch(k + i * a->row_stride + b, 0, 3);
                    __builtin_prefetch(v + i * a->row_stride + b, 0, 3);
                }
        }
        from += n;
        blk++;
        off = 0;
    }
}

#if KVA_PREFETCH_AHEAD <= 0
/* Touch the first two rows of every contiguous run of rows (a block's
 * positions): the hardware prefetcher follows a run once it has started,
 * but not the jump from one block to the next. */
static inline void prefetch_rows(const char *const *rows, int n, size_t row_bytes)
{
    for (int i = 0; i < n; i++) {
        if (i == 0 || rows[i] != rows[i - 1] + row_bytes) {
            const char *end = rows[i] + 2 * row_bytes;
            for (const char *p = rows[i]; p < end; p += 64)
                __builtin_prefetch(p, 0, 3);
        }
    }
}
#endif

/* The keys of a tile (positions t0 .. t0 + nt - 1) row r sees: [*first,
 * *last), empty when *last <= *first. */
static inline void visible_keys(const kva_ws *ws, int r, int64_t t0, int nt, int64_t *first,
                                int64_t *last)
{
    *first = ws->lo[r] - t0 < 0 ? 0 : ws->lo[r] - t0;
    *last = ws->hi[r] - t0 > nt ? nt : ws->hi[r] - t0;
}

/* An fp8 layer scale; 0 (a zero-initialised kva_args) means none. */
static inline float layer_scale(float s)
{
    return s == 0.0f ? 1.0f : s;
}

/* Low precision: the scales of keys t0..t0+nt-1 of kv head g (ks, vs),
 * and the scores of the tile's M rows times the keys' scales. */
static void tile_scales(const kva_args *a, const kva_math *math, const int32_t *table, int g,
                        int64_t t0, int nt, float *ks, float *vs, float *S, int M)
{
    if (a->key_scales != NULL) {
        /* position t0 + i: block blk, offset off (one division per tile);
         * a block's run of scales at a time (they lie together) */
        int64_t blk = t0 / a->block_size, off = t0 - blk * a->block_size;
        for (int i = 0; i < nt; blk++, off = 0) {
            const int run = (int)(a->block_size - off < nt - i ? a->block_size - off : nt - i);
            const size_t at =
                ((size_t)table[blk] * a->num_kv_heads + g) * a->block_size + (size_t)off;
            memcpy(ks + i, a->key_scales + at, (size_t)run * sizeof(float));
            memcpy(vs + i, a->value_scales + at, (size_t)run * sizeof(float));
            i += run;
        }
    } else {
        /* fp8: the kv head's scales (an item is one kv head: one pair) */
        const float k = a->k_head_scales != NULL ? a->k_head_scales[g] : layer_scale(a->k_scale);
        const float v = a->v_head_scales != NULL ? a->v_head_scales[g] : layer_scale(a->v_scale);
        for (int i = 0; i < nt; i++) {
            ks[i] = k;
            vs[i] = v;
        }
    }
    for (int r = 0; r < M; r++)
        math->scale(S + (size_t)r * KVA_KEY_TILE, ks, 1.0f, nt, 0);
}

/* Every line of the `bytes` bytes at p. */
static inline void prefetch_span(const void *p, size_t bytes)
{
    const uintptr_t first = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + bytes;
    for (uintptr_t l = first; l < end; l += 64)
        __builtin_prefetch((const void *)l, 0, 3);
}

/* Per-position scales (int8 pages): the lines of key_scales and
 * value_scales of kv head g for positions [from, to), a block's run at a
 * time.  They sit apart from the pages (one short run per block, the
 * blocks scattered): neither the rows' prefetch nor the hardware's reaches
 * them, and a tile's scale loads waited on memory (a fifth of an int8
 * decode at head_dim 64 on a Zen 5). */
static void prefetch_scales(const kva_args *a, const int32_t *table, int g, int64_t from,
                            int64_t to)
{
    int64_t blk = from / a->block_size, off = from - blk * a->block_size;
    while (from < to) {
        const int64_t n = a->block_size - off < to - from ? a->block_size - off : to - from;
        const size_t at = ((size_t)table[blk] * a->num_kv_heads + g) * a->block_size + (size_t)off;
        prefetch_span(a->key_scales + at, (size_t)n * 4);
        prefetch_span(a->value_scales + at, (size_t)n * 4);
        from += n;
        blk++;
        off = 0;
    }
}

void kva_score_units(const kva_args *a, kva_job *job)
{
    job->post_scale = 0.0f;
    job->wide_scale = 1.0f;
    job->wide = 0;
    if (a->soft_cap > 0.0f) {
        /* the cap takes the natural score: a |scale| <= 1 rides on q (it
         * cannot overflow there), a larger one multiplies the dots (an
         * overflow to +-inf is capped to +-cap) */
        const int big = fabsf(a->scale) > 1.0f;
        job->qscale = big ? 1.0f : a->scale;
        job->post_scale = big ? a->scale : 0.0f;
        return;
    }
    /* base-2 softmax: log2(e) rides on q when that cannot overflow */
    const float c = a->scale * KVA_LOG2E;
    if (!(fabsf(c) > 1.0f) || !isfinite(c)) {
        job->qscale = c;
        return;
    }
    /* else the scores are the dots (exact ties stay ties), and c multiplies
     * their differences to the row maximum (an overflow is -inf: weight 0) */
    job->qscale = c < 0.0f ? -1.0f : 1.0f;
    job->wide = 1;
    job->wide_scale = fabsf(c);
}

void kva_finish_sink(const kva_job *job, float *out, const float *acc, int D, float l, float m,
                     float sink)
{
    /* 2^d: the sink's term over the keys' largest one */
    const float d = job->wide ? (sink - m) * job->wide_scale : sink - m;
    if (d <= 0.0f) {
        const float den = l + exp2f(d);
        for (int i = 0; i < D; i++)
            out[i] = acc[i] / den;
    } else {
        /* the sink's term is the largest: the keys' terms are scaled down
         * by it instead (nothing overflows; they vanish in the limit) */
        const float f = exp2f(-d), w = f / (l * f + 1.0f);
        for (int i = 0; i < D; i++)
            out[i] = acc[i] * w;
    }
}

/* A tile's scores and P.V for M rows in kva_row_calls(kern, M) calls, rows
 * r0 .. r1 - 1 each (as even as they come); the first call prefetches
 * `next`, the others the tile's own rows (already in L1). */
static void scores_calls(const kva_kernels *kern, const float *q, int M, int D,
                         const char *const *krow, int ntp, float *S, float *tmp,
                         const char *const *next)
{
    const int calls = kva_row_calls(kern, M);
    for (int c = 0, r0 = 0; c < calls; c++) {
        const int r1 = M * (c + 1) / calls;
        kern->scores(q + (size_t)r0 * D, r1 - r0, D, krow, ntp, S + (size_t)r0 * KVA_KEY_TILE,
                     tmp, c == 0 ? next : NULL);
        r0 = r1;
    }
}

static void pv_calls(const kva_kernels *kern, const float *P, int M, int D,
                     const char *const *vrow, int nt, float *acc, const float *alpha, float *tmp,
                     const char *const *next)
{
    const int calls = kva_row_calls(kern, M);
    for (int c = 0, r0 = 0; c < calls; c++) {
        const int r1 = M * (c + 1) / calls;
        kern->pv(P + (size_t)r0 * KVA_KEY_TILE, r1 - r0, D, vrow, nt, acc + (size_t)r0 * D,
                 alpha + r0, tmp, c == 0 ? next : NULL);
        r0 = r1;
    }
}

void kva_run_item(const kva_job *job, const kva_item *it, const kva_item *next,
                  const kva_ws *ws)
{
    const kva_args *a = job->a;
    const int D = a->head_dim, G = (int)kva_group_size(a), g = it->kv_head;
    const int64_t s = it->seq, nq = kva_seq_queries(a, s), len = a->seq_lens[s];
    const int64_t row0 = a->query_start_loc[s] + it->q0;
    const int M = (int)((it->q1 - it->q0) * G);
    const int capped = a->soft_cap > 0.0f, alibi = a->alibi_slopes != NULL;
    /* (kva_score_units) */
    const float qscale = job->qscale, post = job->post_scale;
    const int32_t *table = a->block_tables + (size_t)s * a->block_table_stride;
    const char *kbase = a->key_cache + (ptrdiff_t)g * a->head_stride;
    const char *vbase = a->value_cache + (ptrdiff_t)g * a->head_stride;
    const kva_kernels *kern = job->kern, *kern_f32 = job->kern_f32;
    const kva_math *math = job->math;
    /* a prefill-like item: a matrix tile's rows or more */
    const int prefill = M >= KVA_TILE_ROWS;
    /* its level's tile kernels, where it has them, read the stored rows
     * themselves (no widening); but a float16 item of one query token and
     * fewer than 32 rows (a decode of 16-31 heads a KV head) keeps the
     * other kernels: the amx tiles were 0.91x them out of the caches there
     * (docs/performance.md, "AMX tiles") */
    int tiles = prefill && job->kern_tiles != NULL &&
                !(a->kind == KVA_F16 && it->q1 - it->q0 == 1 && M < 32);
    /* (an item whose tiles meet an inf or a NaN in its pages runs again
     * from here without them: kva_nonfinite_amx) */
#if KVA_HAVE_AMX
restart:
#endif
    kern = tiles ? job->kern_tiles : job->kern;
    /* the kernels read the elements divided by unit: q carries it */
    const float unit = kern->unit;
    const int widen = M > kern->multi_call_rows && a->kind != KVA_F32 && !tiles;
    /* keys too, unless the level's scores transpose the stored key tile
     * themselves for this many rows (converting as they load it once) */
    const int widen_keys = widen && !(prefill && kern->transposes);
    if (widen) {
        for (int i = 0; i < KVA_KEY_TILE; i++) {
            ws->kfrow[i] = (const char *)(ws->kf + (size_t)i * D);
            ws->vfrow[i] = (const char *)(ws->vf + (size_t)i * D);
        }
    }

    /* the item's q rows, float32: a float16 / bfloat16 q's widened into Qs
     * (and read from there: each row is scaled in place below) */
#define KVA_QROW(r) \
    (a->q_kind == KVA_F32 ? a->q + kva_row_at(a, row0, g, r) : ws->Qs + (size_t)(r) * D)
    if (a->q_kind != KVA_F32)
        for (int r = 0; r < M; r++)
            a->convert(a->q_kind, (const uint16_t *)(const void *)a->q + kva_row_at(a, row0, g, r),
                       KVA_F32, ws->Qs + (size_t)r * D, D);
    /* tile kernels: a q whose elements are all bfloat16 values (a bfloat16
     * model's) goes to them unscaled, as one bf16 term instead of three,
     * and its exact dots are multiplied by qscale (one rounding, where the
     * scaled q had its own); none may be inf, NaN or near overflow */
    int exact = kern->prepare != NULL && qscale != 0.0f && unit == 1.0f;
    for (int r = 0; r < M && exact; r++) {
        const float *src = KVA_QROW(r);
        uint32_t low = 0, top = 0;
        for (int d = 0; d < D; d++) {
            uint32_t u;
            memcpy(&u, src + d, sizeof u);
            low |= u;
            top = (u & 0x7F800000u) > top ? (u & 0x7F800000u) : top;
        }
        exact = (low & 0xFFFFu) == 0 && top < (127u + 64u) << 23;
    }
    for (int r = 0; r < M; r++) {
        int64_t j = it->q0 + r / G;
        const float *src = KVA_QROW(r);
        float *dst = ws->Qs + (size_t)r * D;
        if (exact) {
            if (dst != src)
                memcpy(dst, src, (size_t)D * sizeof(float));
        } else
            for (int d = 0; d < D; d++) /* (times unit, a power of two: exact) */
                dst[d] = kva_flush_tiny(src[d] * qscale) * unit;
        int64_t pos = len - nq + j;
        ws->hi[r] = pos + 1;
        ws->lo[r] = kva_key_lo(a, pos);
        ws->m[r] = -INFINITY;
        ws->l[r] = 0.0f;
    }
#undef KVA_QROW
    memset(ws->acc, 0, (size_t)M * D * sizeof(float));
    /* the q the scores take: the tile kernels' own form of it, made once */
    const float *q = ws->Qs;
    if (kern->prepare != NULL) {
        kern->prepare(ws->Qs, M, D, ws->qt, exact ? qscale : 0.0f);
        q = (const float *)(const void *)ws->qt;
    }

    const size_t row_bytes = (size_t)D * kva_isz(a->kind);
    /* low precision: row i of a tile reads as its elements times ks[i]
     * (keys) / vs[i] (values), applied to its scores and its weights */
    const int scaled = a->key_scales != NULL || layer_scale(a->k_scale) != 1.0f ||
                       layer_scale(a->v_scale) != 1.0f || a->k_head_scales != NULL ||
                       a->v_head_scales != NULL;
    float ks[KVA_KEY_TILE], vs[KVA_KEY_TILE];
    /* prefill items take the wide key tile: their per-row softmax runs once
     * per tile; decode-like items read memory and keep the narrow one,
     * which their prefetch distance is tuned for, unless their rows are
     * short enough for the level's wide tile (kva_math.wide_tile_row_bytes).
     * (So fp8 and int8 pages of float16 values give float16's bits where
     * their tiles agree: at avx512 every head_dim but 65-128, where only
     * the 1-byte rows take the wide tile; at the other levels every one.) */
    const int tile = prefill || row_bytes <= (size_t)math->wide_tile_row_bytes
                         ? KVA_KEY_TILE
                         : KVA_DECODE_KEY_TILE;
    const char **krow = ws->krow, **vrow = ws->vrow, **nkrow = ws->nkrow, **nvrow = ws->nvrow;
    if (it->k0 < it->k1)
        tile_rows(a, table, kbase, vbase, it->k0, it->k1, tile, krow, vrow);
    /* decode-like items (fewer rows than a matrix tile's: a short chain
     * of FMAs per line read), and items of fewer than KVA_SPREAD_ROWS
     * rows whose kernels read the stored keys (the amx tiles, the avx512
     * transposes: a short chunk's), with kernels that prefetch the next
     * tile themselves, spread over their loads (kva_kernels.prefetch): no
     * bursts then but the first tile's.  Prefill items (64 rows or more)
     * are compute-bound and keep the bursts, and so do the avx2 level's
     * items of 16-31 rows (their tiles widened first: spread, 0.92-0.97x) */
    const int spread =
        kern->prefetch && (!prefill || (M < KVA_SPREAD_ROWS && !widen_keys));
    if (spread && it->k0 < it->k1)
        prefetch_positions(a, table, kbase, vbase, it->k0,
                           it->k1 - it->k0 < tile ? it->k1 : it->k0 + tile,
                           row_bytes);
    /* (decode-like items only: a prefill's are compute-bound, and an int8
     * prefill of 512 tokens was 5% slower with them) */
    const int pf_scales = a->key_scales != NULL && !prefill;
    if (pf_scales && it->k0 < it->k1)
        prefetch_scales(a, table, g, it->k0,
                        it->k1 - it->k0 < 2 * tile ? it->k1 : it->k0 + 2 * tile);
    /* a decode item (one query token: its rows see the same keys) whose
     * level has the fused softmax step (kva_math.softmax_rows) and whose
     * scores are plain base-2 logits takes it for every tile that shows
     * it a key */
    const int fused = math->softmax_rows != NULL && !prefill &&
                      it->q1 - it->q0 == 1 && !capped && !alibi && !job->wide;
    /* other items whose scores are plain base-2 logits take it row by row
     * (each row its own visible keys): one call a tile, not three a row */
    const int rows_fused =
        math->softmax_rows != NULL && !fused && !capped && !alibi && !job->wide;
    int64_t prefetched = it->k0; /* the rows before this position are prefetched */
    (void)prefetched;
    for (int64_t t0 = it->k0; t0 < it->k1; t0 += tile) {
        const int nt = (int)(it->k1 - t0 < tile ? it->k1 - t0 : tile);
        const int ntp = (nt + 7) & ~7;
        const int64_t t1 = t0 + tile;
        int nnext =
            t1 < it->k1 ? tile_rows(a, table, kbase, vbase, t1, it->k1, tile, nkrow, nvrow) : 0;
        /* the last tile of a decode item: the next one's first tile (the
         * item this thread runs next, a decode item too), prefetched as a
         * tile of this item's would be; its start then finds its rows on
         * the way instead of stalling on them */
        if (t1 >= it->k1 && spread && next != NULL && next->k0 < next->k1 &&
            (next->q1 - next->q0) * G < (widen_keys ? KVA_TILE_ROWS : KVA_SPREAD_ROWS)) {
            const int32_t *ntable = a->block_tables + (size_t)next->seq * a->block_table_stride;
            const ptrdiff_t nh = (ptrdiff_t)next->kv_head * a->head_stride;
            nnext = tile_rows(a, ntable, a->key_cache + nh, a->value_cache + nh, next->k0,
                              next->k1, tile, nkrow, nvrow);
            if (pf_scales)
                prefetch_scales(a, ntable, next->kv_head, next->k0,
                                next->k1 - next->k0 < tile ? next->k1 : next->k0 + tile);
        }
        /* the spread prefetch's next rows: the next tile's, padded to a
         * whole tile with its last (NULL after the last tile) */
        const char *const *next_k = NULL, *const *next_v = NULL;
        if (spread && nnext > 0) {
            for (int i = (nnext + 7) & ~7; i < tile; i++) {
                nkrow[i] = nkrow[nnext - 1];
                nvrow[i] = nvrow[nnext - 1];
            }
            next_k = nkrow;
            next_v = nvrow;
        }
        /* the scales of the tile after the next (the next one's were
         * started a tile ago, the first two before the loop) */
        if (pf_scales && t1 + tile < it->k1)
            prefetch_scales(a, table, g, t1 + tile,
                            it->k1 - (t1 + tile) < tile ? it->k1 : t1 + 2 * tile);
        if (!spread) { /* (spread: the kernels prefetch) */
#if KVA_PREFETCH_AHEAD > 0
            /* The rows of a tile are scattered over blocks: start the rows of
             * the next KVA_PREFETCH_AHEAD positions (whole blocks' runs) while
             * this tile is computed. */
            (void)nnext;
            {
                const int64_t want =
                    t1 + KVA_PREFETCH_AHEAD < it->k1 ? t1 + KVA_PREFETCH_AHEAD : it->k1;
                if (prefetched < want) {
                    prefetch_positions(a, table, kbase, vbase, prefetched, want, row_bytes);
                    prefetched = want;
                }
            }
#else
            /* The rows of a tile are scattered over blocks: start this tile's V
             * and the next tile's K and V while this tile's scores are computed. */
            prefetch_rows(vrow, nt, row_bytes);
            prefetch_rows(nkrow, nnext, row_bytes);
            prefetch_rows(nvrow, nnext, row_bytes);
#endif
        }
        if (widen_keys) {
            kern->widen(krow, ntp, D, ws->kf, next_k); /* padding rows included */
            kern_f32->scores(ws->Qs, M, D, ws->kfrow, ntp, ws->S, ws->tmp, NULL);
        } else {
            scores_calls(kern, q, M, D, krow, ntp, ws->S, ws->tmp, next_k);
        }
        /* (fused: the rows' visible keys, the same for every row) */
        int64_t f0, f1;
        visible_keys(ws, 0, t0, nt, &f0, &f1);
        const int fuse = fused && f1 > f0;
        if (scaled)
            tile_scales(a, math, table, g, t0, nt, ks, vs, ws->S, fuse || rows_fused ? 0 : M);
        if (fuse) {
            math->softmax_rows(ws->S, M, nt, ntp, (int)f0, (int)f1, NULL, NULL,
                              scaled ? ks : NULL, scaled ? vs : NULL, unit, ws->m, ws->sum,
                              ws->alpha);
            for (int r = 0; r < M; r++) {
                ws->first[r] = (int)f0;
                ws->last[r] = (int)f1;
                ws->l[r] = ws->l[r] * ws->alpha[r] + ws->sum[r];
            }
        } else if (rows_fused) {
            for (int r = 0; r < M; r++) {
                int64_t first, last;
                visible_keys(ws, r, t0, nt, &first, &last);
                ws->first[r] = last <= first ? 0 : (int)first;
                ws->last[r] = last <= first ? 0 : (int)last;
            }
            math->softmax_rows(ws->S, M, nt, ntp, 0, 0, ws->first, ws->last,
                              scaled ? ks : NULL, scaled ? vs : NULL, unit, ws->m, ws->sum,
                              ws->alpha);
            for (int r = 0; r < M; r++)
                ws->l[r] = ws->l[r] * ws->alpha[r] + ws->sum[r];
        }
        for (int r = 0; r < M && !fuse && !rows_fused; r++) {
            float *srow = ws->S + r * KVA_KEY_TILE;
            if (capped) {
                if (post != 0.0f) /* |scale| > 1 (kva_score_units) */
                    for (int i = 0; i < ntp; i++)
                        srow[i] *= post;
                math->softcap(srow, ntp, 1.0f / a->soft_cap, a->soft_cap * KVA_LOG2E);
            }
            int64_t first, last;
            visible_keys(ws, r, t0, nt, &first, &last);
            if (last <= first) { /* nothing visible: no change to this row */
                ws->first[r] = ws->last[r] = 0;
                ws->alpha[r] = 1.0f;
                memset(srow, 0, (size_t)ntp * sizeof(float));
                continue;
            }
            ws->first[r] = (int)first;
            ws->last[r] = (int)last;
            for (int64_t i = 0; i < first; i++)
                srow[i] = -INFINITY;
            for (int64_t i = last; i < ntp; i++)
                srow[i] = -INFINITY;
            if (alibi) { /* slope * (t - p), in base 2 and the scores' units */
                const float slope = a->alibi_slopes[(size_t)g * G + r % G] * KVA_LOG2E;
                const int64_t d0 = t0 - (ws->hi[r] - 1);
                if (job->wide)
                    for (int64_t i = first; i < last; i++)
                        srow[i] += slope * (float)(d0 + i) / job->wide_scale;
                else
                    for (int64_t i = first; i < last; i++)
                        srow[i] += slope * (float)(d0 + i);
            }
            float mx = math->row_max(srow, ntp);
            float mnew = ws->m[r] > mx ? ws->m[r] : mx;
            /* (a finite maximum that did not move, as in most of a long
             * row's tiles, rescales by exp2f(0) = 1: no call; an infinite
             * one keeps exp2f(inf - inf), NaN, as the reference has it) */
            /* (wide: the scores are dots, whose differences the scale
             * multiplies: kva_score_units) */
            const float drop = ws->m[r] - mnew;
            ws->alpha[r] = ws->m[r] == -INFINITY                 ? 0.0f
                           : ws->m[r] == mnew && mnew != INFINITY ? 1.0f
                           : kva_flush_tiny(exp2f(job->wide ? drop * job->wide_scale : drop));
            const float mu = kva_weight_origin(mnew);
            float sum;
            if (job->wide) {
                for (int64_t i = first; i < last; i++)
                    srow[i] = (srow[i] - mu) * job->wide_scale;
                sum = math->row_exp_sum(srow, ntp, 0.0f);
            } else {
                sum = math->row_exp_sum(srow, ntp, mu);
            }
            ws->l[r] = ws->l[r] * ws->alpha[r] + sum;
            ws->m[r] = mnew;
            /* the visible keys' weights times their values' scales; the
             * values are read divided by unit: the weights carry it, so each
             * product is the exact p * v (subnormal ones included); one
             * pass over the weights for both */
            if (scaled || unit != 1.0f)
                math->scale(srow + first, scaled ? vs + first : NULL, unit, last - first, 1);
        }
        /* P V over each row's visible keys only (a masked key's weight is
         * 0, but 0 * a stored NaN or inf is NaN): runs of rows with the same
         * visible keys (every row of a decode item) in one call. */
        const kva_kernels *pk = kern;
        const char *const *prow = vrow;
        if (widen) {
            kern->widen(vrow, nt, D, ws->vf, next_v);
            next_v = NULL;
            pk = kern_f32;
            prow = ws->vfrow;
        }
        /* tile kernels (a prefill's rows): every row in one call over the
         * union of their visible keys, where that gives the same sums (the
         * weights of a row's hidden keys are 0 once its maximum is finite,
         * and 0 times a value adds nothing: a tile kernel's values are
         * finite, or the item runs again without them below): a
         * causal diagonal tile would take a call per query token, each
         * repacking the values */
        int union_run = 0;
        if (tiles) {
            int f0 = ntp, l1 = 0, runs = 0, finite = 1;
            for (int r = 0; r < M; r++) {
                if (ws->last[r] <= ws->first[r])
                    continue;
                f0 = ws->first[r] < f0 ? ws->first[r] : f0;
                l1 = ws->last[r] > l1 ? ws->last[r] : l1;
                finite &= isfinite(ws->m[r]) != 0;
                runs += r == 0 || ws->first[r] != ws->first[r - 1] ||
                        ws->last[r] != ws->last[r - 1];
            }
            if (runs > 1 && finite) {
                pk->pv(ws->S + f0, M, D, prow + f0, l1 - f0, ws->acc, ws->alpha, ws->tmp, NULL);
                union_run = 1;
            }
        }
        for (int r = 0, r1; r < M && !union_run; r = r1) {
            const int first = ws->first[r], last = ws->last[r];
            for (r1 = r + 1; r1 < M && ws->first[r1] == first && ws->last[r1] == last; r1++)
                ;
            if (last <= first)
                continue;
            /* the first run of rows prefetches the next values */
            pv_calls(pk, ws->S + (size_t)r * KVA_KEY_TILE + first, r1 - r, D, prow + first,
                     last - first, ws->acc + (size_t)r * D, ws->alpha + r, ws->tmp,
                     next_v != NULL ? next_v + first : NULL);
            next_v = NULL;
        }
#if KVA_HAVE_AMX
        if (tiles && kva_nonfinite_amx()) {
            tiles = 0;
            goto restart;
        }
#endif
        const char **swap = krow;
        krow = nkrow;
        nkrow = swap;
        swap = vrow;
        vrow = nvrow;
        nvrow = swap;
    }

    if (it->nsplit == 1) {
        for (int r = 0; r < M; r++) {
            const size_t at = kva_row_at(a, row0, g, r);
            float *acc = ws->acc + (size_t)r * D;
            /* (a 16-bit out: the row in place in acc, then narrowed) */
            float *o = a->out_kind == KVA_F32 ? a->out + at : acc;
            const float l = ws->l[r];
            if (a->sinks != NULL)
                kva_finish_sink(job, o, acc, D, l, ws->m[r],
                                kva_logit_units(job, a->sinks[(size_t)g * G + r % G]));
            else
                for (int d = 0; d < D; d++)
                    o[d] = acc[d] / l;
            kva_put_row(a, at, o);
        }
        return;
    }
    float *p = job->partials + (size_t)it->slot * job->partial_floats;
    memcpy(p, ws->m, (size_t)M * sizeof(float));
    memcpy(p + job->split_rows, ws->l, (size_t)M * sizeof(float));
    memcpy(p + 2 * (size_t)job->split_rows, ws->acc, (size_t)M * D * sizeof(float));
    /* The split that finishes last merges, in split order (acq_rel: every
     * other split's partial is visible to it). */
    if (__atomic_add_fetch(&job->group_done[it->group], 1, __ATOMIC_ACQ_REL) == it->nsplit)
        kva_merge_group(job, it, M, (double *)(void *)ws->kf); /* (KVA_KEY_TILE * D floats) */
}

void kva_job_thread(void *ctx, int thread_index)
{
    kva_job *job = (kva_job *)ctx;
    kva_ws ws;
    kva_workspace_layout(job->max_rows, job->a->head_dim,
                     job->workspace + (size_t)thread_index * job->workspace_bytes, &ws);
    const int64_t n = job->num_items;
    int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
    while (i < n) {
        /* the item after this one, claimed before this one runs (its first
         * tile is then prefetched during this one's last) while more than
         * two items per thread remain; near the end, claims wait, so no
         * thread holds an item another could be running.  Which thread runs
         * an item never changes a bit (the merges run in split order). */
        int64_t j = n;
        if (n - __atomic_load_n(&job->next, __ATOMIC_RELAXED) > 2 * (int64_t)job->threads)
            j = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        kva_run_item(job, &job->items[i], j < n ? &job->items[j] : NULL, &ws);
        i = j < n ? j : __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
    }
#if KVA_HAVE_AMX
    if (job->kern_tiles == kva_kernels_amx + job->a->kind) /* (left configured) */
        kva_release_amx();
#endif
}
