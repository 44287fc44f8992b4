/*
 * kv_attn_prefill.cuh: kva_prefill_tc, prefill and chunked prefill on
 * tensor cores, FlashAttention-2 style (attention.cu includes it;
 * attention_kernels.py plans and picks it).
 *
 * Float16 / bfloat16 pages (the mma's input type MT is the pages' kind), q
 * of any float kind (rounded to MT unless it is MT), out of any float kind.
 * The rows of a block are KvpCfg::ROWS consecutive (query, head) pairs of
 * one sequence and kv head (pair p = j * group + h: query j, query head
 * kv_head * group + h), 16 * MTR per warp (MTR m16 tiles); the keys go in
 * tiles of KvpCfg::KEYS, K and V rows copied 16 bytes at a time with
 * cp.async into one of two shared buffers while the other is reduced (the
 * next tile's loads overlap this tile's products and softmax; pages off
 * 16 bytes, vec16 = 0, are copied element by element).  Per tile
 * and warp:
 *   S = Q K^T: Q's A fragments by ldmatrix from shared memory (Q is staged
 *     once per block), K's B fragments by ldmatrix (each used by the warp's
 *     MTR m tiles), float32 accumulators; scaled in float32 (q is not
 *     pre-scaled), soft-capped, masked only in tiles that need it (the
 *     causal diagonal, the window's edge, the last keys);
 *   an online softmax in base 2 per row (max over a quad's 4 lanes);
 *   O = O alpha + P V: P rounded once to MT as the A fragments, V's B
 *     fragments by ldmatrix.trans.
 * Blocks whose rows see more keys are planned first (the causal triangle
 * balanced over the GPU).  No split, no atomics: the result does not
 * depend on scheduling.  Precision: P enters the mma rounded to MT (11 /
 * 8 bits): docs/gpu.md states the tolerance.  A NaN in a V row reaches the
 * rows of the same key tile that do not see its key (0 x NaN).
 */

#define KVP_WARPS 4

template <int KIND, int D> struct KvpCfg {
    static constexpr int MTR = D <= 128 ? 2 : 1;    /* m16 tiles per warp */
    static constexpr int ROWS = KVP_WARPS * 16 * MTR; /* pairs per block */
    static constexpr int KEYS = D <= 64 ? 64 : 32;  /* keys per tile */
    static constexpr int RS = 2 * D + 16;           /* shared row stride (bytes) */
    static constexpr int VPR = 2 * D / 16;          /* 16-byte copies per row */
    static constexpr int KS = D / 16, NT = D / 8, NK = KEYS / 8, KK = KEYS / 16;
    static constexpr int TILE = KEYS * RS;          /* K (or V) of one tile */
    static constexpr int SMEM = ROWS * RS + 2 * 2 * TILE + ROWS * 8; /* + the rows' bases */
    static_assert(KIND == KV_F16 || KIND == KV_BF16, "f16 / bf16 pages");
    static_assert(D % 16 == 0, "whole k-steps");
};

/* items: [n][4] = (sequence, kv head, first pair, pairs). */
template <int KIND, int D>
__global__ void __launch_bounds__(KVP_WARPS * 32, 1)
kva_prefill_tc(void *out, const void *q, const kva_u16 *key_cache, const kva_u16 *value_cache,
               const int *block_tables, const kva_i64 *seq_lens, const kva_i64 *query_start_loc,
               const kva_i64 *items, kva_i64 num_heads, kva_i64 group, kva_i64 table_stride,
               kva_i64 block_size, kva_i64 c_block, kva_i64 c_head, kva_i64 c_tok, float scale,
               kva_i64 window, float soft_cap, kva_i64 chunk, const float *alibi,
               const float *sinks, kva_i64 vec16, kva_i64 q_kind, kva_i64 out_kind)
{
    typedef KvpCfg<KIND, D> C;
    constexpr int MTR = C::MTR, KEYS = C::KEYS, RS = C::RS, KS = C::KS, NT = C::NT;
    constexpr int NK = C::NK, KK = C::KK;
    unsigned char *smem = KVA_DYN_SMEM();
    unsigned char *sq = smem; /* [ROWS][RS]: Q rows (MT bits) */
    unsigned char *skv = smem + C::ROWS * RS; /* [2 buffers][K, V][KEYS][RS] */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c = lane & 3, mi = lane >> 3, mr = lane & 7;
    const kva_i64 *it = items + (kva_i64)blockIdx.x * 4;
    const kva_i64 s = it[0], g = it[1], p0 = it[2];
    const int np = (int)it[3];
    const kva_i64 q0 = query_start_loc[s], nq = query_start_loc[s + 1] - q0;
    const kva_i64 pos0 = seq_lens[s] - nq;

    /* each pair's q / out row (its first element) */
    kva_i64 *obase = (kva_i64 *)(skv + 2 * 2 * C::TILE);
    for (int r = tid; r < C::ROWS; r += blockDim.x) {
        const kva_i64 p = p0 + r, j = p / group;
        obase[r] = ((q0 + j) * num_heads + g * group + (p - j * group)) * D;
    }
    __syncthreads();
    /* Q rows into shared memory as MT */
    for (int i = tid; i < C::ROWS * D; i += blockDim.x) {
        const int r = i / D, d = i - r * D;
        const float x = r < np ? kva_load_f(q, (int)q_kind, obase[r] + d) : 0.0f;
        kva_u16 h;
        if constexpr (KIND == KV_BF16)
            h = kv_f32_to_bf16(__float_as_uint(x));
        else
            h = kv_f32_to_f16(__float_as_uint(x));
        *(kva_u16 *)(sq + r * RS + 2 * d) = h;
    }

    const bool capped = !kva_is_zero(soft_cap);
    const KvaUnits un = kva_units(scale, capped);
    const float capl2 = kva_mul(soft_cap, KVA_LOG2E);

    /* the block's keys: from the first row's first visible key to the last row's position */
    const kva_i64 firstpos = pos0 + p0 / group, lastpos = pos0 + (p0 + np - 1) / group;
    const kva_i64 klo = kva_key_lo(firstpos, window, chunk);
    const kva_i64 khi = lastpos + 1;
    /* this warp's rows (row w * 16 * MTR + 16 m + gq + 8 r): their first
     * visible key and position, relative to klo (32 bits: an item's keys
     * are fewer than 2^31); an invalid row sees nothing (lo > pos) */
    int rpos[MTR][2], rlo[MTR][2];
    float slope[MTR][2]; /* ALiBi, in the scores' units */
#pragma unroll
    for (int m = 0; m < MTR; m++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = warp * 16 * MTR + 16 * m + gq + 8 * r;
            const kva_i64 pos = pos0 + (p0 + row) / group;
            const kva_i64 lo = kva_key_lo(pos, window, chunk);
            rpos[m][r] = row < np ? (int)(pos - klo) : -1;
            rlo[m][r] = row < np ? (int)(lo - klo) : 0;
            slope[m][r] = alibi != nullptr && row < np
                              ? kva_logit_units(alibi[g * group + (p0 + row) % group], un) : 0.0f;
        }
    }
    /* the warp's rows see keys [wminlo, wmaxpos] at most, every row every key
     * of [wmaxlo, wminpos] (relative to klo, as every key below) */
    const int wrow0 = warp * 16 * MTR, wrow1 = (wrow0 + 16 * MTR < np ? wrow0 + 16 * MTR : np) - 1;
    const bool wrows = wrow1 >= wrow0;
    const kva_i64 wfirst = pos0 + (p0 + wrow0) / group, wlast = pos0 + (p0 + wrow1) / group;
    const int wminpos = wrows ? (int)(wfirst - klo) : -1;
    const int wmaxpos = wrows ? (int)(wlast - klo) : -1;
    const int wminlo = (int)(kva_key_lo(wfirst, window, chunk) - klo);
    const int wmaxlo = (int)(kva_key_lo(wlast, window, chunk) - klo);
    const int nkeys = (int)(khi - klo);


    const int *table = block_tables + s * table_stride;
    const KvaDiv bdiv = kva_div_init((unsigned)block_size);
    const kva_i64 pb0 = klo / block_size;
    const unsigned poff0 = (unsigned)(klo - pb0 * block_size);
    const int ntiles = (nkeys + KEYS - 1) / KEYS;
    const unsigned short *kbase = key_cache + g * c_head, *vbase = value_cache + g * c_head;

    /* tile t's K and V rows into buffer t & 1 (every thread a share of the copies) */
    auto issue = [&](int tile) {
        if (tile < ntiles) {
            unsigned char *dk = skv + (tile & 1) * 2 * C::TILE, *dv = dk + C::TILE;
            for (int v = tid; v < KEYS * C::VPR; v += blockDim.x) {
                const int key = v / C::VPR, cc = v - key * C::VPR;
                if (tile * KEYS + key < nkeys) {
                    const unsigned rel = poff0 + (unsigned)(tile * KEYS + key);
                    const kva_i64 off = kva_key_row(table, pb0, rel, bdiv, c_block, c_tok) + 8 * cc;
                    if (vec16) {
                        kva_copy16(dk + key * RS + 16 * cc, kbase + off);
                        kva_copy16(dv + key * RS + 16 * cc, vbase + off);
                    } else { /* pages off 16 bytes: element by element */
                        for (int e = 0; e < 8; e++) {
                            ((kva_u16 *)(dk + key * RS + 16 * cc))[e] = kbase[off + e];
                            ((kva_u16 *)(dv + key * RS + 16 * cc))[e] = vbase[off + e];
                        }
                    }
                } else { /* past the last key: zeros (0 x stale NaN is NaN) */
                    kva_zero16(dk + key * RS + 16 * cc, key_cache);
                    kva_zero16(dv + key * RS + 16 * cc, value_cache);
                }
            }
        }
        kva_copy_commit();
    };

    float m[MTR][2], l[MTR][2], acc[MTR][NT][4];
#pragma unroll
    for (int mt = 0; mt < MTR; mt++) {
        m[mt][0] = m[mt][1] = KVA_NEG_INF;
        l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
        for (int nn = 0; nn < NT; nn++)
            acc[mt][nn][0] = acc[mt][nn][1] = acc[mt][nn][2] = acc[mt][nn][3] = 0.0f;
    }

    issue(0);
    for (int tile = 0; tile < ntiles; tile++) {
        issue(tile + 1);      /* buffer (tile+1) & 1 was last read before the last barrier */
        kva_copy_wait<1>();   /* this thread's copies of `tile` have landed */
        __syncthreads();      /* ... and every thread's (and Q, the first time) */
        const int trel = tile * KEYS; /* the tile's first key - klo */
        /* a warp whose rows see none of the tile's keys skips it */
        if (trel <= wmaxpos && trel + KEYS > wminlo) {
            const unsigned char *kt = skv + (tile & 1) * 2 * C::TILE, *vt = kt + C::TILE;
            float sc[MTR][NK][4];
#pragma unroll
            for (int mt = 0; mt < MTR; mt++)
#pragma unroll
                for (int n = 0; n < NK; n++)
                    sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.0f;
            /* S = Q K^T: per k-step, Q's A fragments of the warp's m tiles, and
             * K's B fragments two n8 tiles of keys at a time */
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                unsigned a[MTR][4];
#pragma unroll
                for (int mt = 0; mt < MTR; mt++)
                    kva_ldmatrix_x4<false>(a[mt], sq + (wrow0 + 16 * mt + mr + 8 * (mi & 1)) * RS +
                                                      2 * (16 * ks + 8 * (mi >> 1)));
#pragma unroll
                for (int n = 0; n < NK; n += 2) {
                    unsigned b[4];
                    kva_ldmatrix_x4<false>(b, kt + (8 * (n + (mi >> 1)) + mr) * RS +
                                                  2 * (16 * ks + 8 * (mi & 1)));
#pragma unroll
                    for (int mt = 0; mt < MTR; mt++) {
                        kva_mma16816<KIND>(sc[mt][n], a[mt], b);
                        kva_mma16816<KIND>(sc[mt][n + 1], a[mt], b + 2);
                    }
                }
            }
            /* the scores, each feature a pass of its own */
            if (capped) {
#pragma unroll
                for (int mt = 0; mt < MTR; mt++)
#pragma unroll
                    for (int i = 0; i < 4 * NK; i++)
                        sc[mt][i >> 2][i & 3] =
                            kva_cap(kva_mul(sc[mt][i >> 2][i & 3], un.mult), capl2, soft_cap, un);
            } else {
#pragma unroll
                for (int mt = 0; mt < MTR; mt++)
#pragma unroll
                    for (int i = 0; i < 4 * NK; i++)
                        sc[mt][i >> 2][i & 3] = kva_mul(sc[mt][i >> 2][i & 3], un.mult);
            }
            /* element 2r + e of tile n: row 16 mt + gq + 8r, key trel + 8n + 2c + e */
            if (!(trel + KEYS <= nkeys && trel + KEYS - 1 <= wminpos && trel >= wmaxlo)) {
#pragma unroll
                for (int mt = 0; mt < MTR; mt++)
#pragma unroll
                    for (int i = 0; i < 4 * NK; i++) { /* (keys past khi are past every pos) */
                        const int r = (i & 3) >> 1, key = trel + 8 * (i >> 2) + 2 * c + (i & 1);
                        if (!(key >= rlo[mt][r] && key <= rpos[mt][r]))
                            sc[mt][i >> 2][i & 3] = KVA_NEG_INF;
                    }
            }
            if (alibi != nullptr) {
#pragma unroll
                for (int mt = 0; mt < MTR; mt++)
#pragma unroll
                    for (int i = 0; i < 4 * NK; i++) { /* slope * (t - p), the scores' units */
                        const int r = (i & 3) >> 1, key = trel + 8 * (i >> 2) + 2 * c + (i & 1);
                        sc[mt][i >> 2][i & 3] = kva_fma(slope[mt][r], (float)(key - rpos[mt][r]),
                                                        sc[mt][i >> 2][i & 3]);
                    }
            }
            /* the online softmax, per row */
            float al[MTR][2];
#pragma unroll
            for (int mt = 0; mt < MTR; mt++) {
#pragma unroll
                for (int r = 0; r < 2; r++) /* the weights over the scores */
                    al[mt][r] = kva_tile_online<NK>(sc[mt], sc[mt], r, m[mt][r], l[mt][r], un);
#pragma unroll
                for (int nn = 0; nn < NT; nn++) {
                    acc[mt][nn][0] = kva_mul(acc[mt][nn][0], al[mt][0]);
                    acc[mt][nn][1] = kva_mul(acc[mt][nn][1], al[mt][0]);
                    acc[mt][nn][2] = kva_mul(acc[mt][nn][2], al[mt][1]);
                    acc[mt][nn][3] = kva_mul(acc[mt][nn][3], al[mt][1]);
                }
            }
            /* O += P V, 16 keys per k-step: P's accumulators are the A fragments */
#pragma unroll
            for (int kk = 0; kk < KK; kk++) {
                unsigned pa[MTR][4];
#pragma unroll
                for (int mt = 0; mt < MTR; mt++) {
                    pa[mt][0] = kva_pack2_rn<KIND>(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
                    pa[mt][1] = kva_pack2_rn<KIND>(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
                    pa[mt][2] = kva_pack2_rn<KIND>(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
                    pa[mt][3] = kva_pack2_rn<KIND>(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int nn = 0; nn < NT; nn += 2) {
                    unsigned b[4];
                    kva_ldmatrix_x4<true>(b, vt + (16 * kk + mr + 8 * (mi & 1)) * RS +
                                                 2 * 8 * (nn + (mi >> 1)));
#pragma unroll
                    for (int mt = 0; mt < MTR; mt++) {
                        kva_mma16816<KIND>(acc[mt][nn], pa[mt], b);
                        kva_mma16816<KIND>(acc[mt][nn + 1], pa[mt], b + 2);
                    }
                }
            }
        }
        __syncthreads(); /* the tile's buffer may be refilled */
    }
    kva_copy_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MTR; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float total = kva_quad_sum(l[mt][r]);
            if (rpos[mt][r] < 0)
                continue;
            const int row = wrow0 + 16 * mt + gq + 8 * r;
            const float sink = kva_sink(sinks, g * group + (p0 + row) % group, un);
            const KvaNorm n = kva_norm(total, m[mt][r], sinks != nullptr, sink, un);
            kva_tile_store<NT>(out, out_kind, obase[row], acc[mt], r, c, n);
        }
    }
}
