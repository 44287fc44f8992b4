/*
 * kv_attn_decode.cuh: kva_decode_tc, decode and short chunks on tensor
 * cores (attention.cu includes it; attention_kernels.py plans and picks it).
 *
 * The (query, head) pairs of a sequence's queries and one kv head's group
 * are the rows of an m16 tile: pair p = j * group + h is query j, query head
 * kv_head * group + h.  An item is up to 16 consecutive pairs and a range
 * of keys (a split); each K and V byte of the range is read once for all
 * its pairs, so the time does not grow with the group (nor with a few
 * queries).  Pages: float16, bfloat16, e4m3fn, e5m2; q of the mma's input
 * type MT (the pages' kind for float16 / bfloat16 pages; float16 or
 * bfloat16 for fp8 pages, which widen exactly into either), out of any
 * float kind (out_kind), written where it lies.
 *
 * A block is 4 warps; warp w takes the item's 16-key tiles w, w + 4, ...
 * with its own online softmax.  Each warp streams its tiles through its
 * own two or three buffers of shared memory (K and V rows copied 16 bytes
 * at a time with cp.async, the next tiles in flight while one is reduced;
 * no block barrier in the loop).  Per tile:
 *   S = Q K^T: 2 n8 tiles of keys x D / 16 k-steps of mma.m16n8k16, Q's A
 *     fragments held in registers (D <= 128) or read from shared memory
 *     per tile (D = 256); float16 / bfloat16 K by ldmatrix, fp8 K widened
 *     in registers from 4 / 8 / 16-byte loads (the k index permuted the
 *     same way in Q and K, so the dot products are unchanged);
 *   scores scaled in float32 (q is not rounded: it arrives in MT), masked
 *     only in tiles that need it (causal rows of a chunk, the window, the
 *     item's last keys), soft-capped, an online softmax in base 2 per row
 *     (the row max over a quad's 4 lanes);
 *   O += P V: P split into NP terms of MT (P = P1 + P2 [+ P3], each the
 *     rounding of what the earlier ones leave), one mma per term: the
 *     weights enter at float32-class precision (NP = 2 for float16: 22
 *     bits; 3 for bfloat16: 24 bits) where a single rounding of P to MT
 *     would give 11 / 8; decode is bound by the bytes read, the extra mma
 *     are free.  float16 / bfloat16 V by ldmatrix.trans; fp8 V from 2 / 4 /
 *     8-byte loads of 4 rows per lane, bytes paired by prmt and widened
 *     (keys and output dims permuted consistently: see kvt_key / kvt_odim).
 * fp8 layer scales: k_scale joins the score scale, v_scale multiplies the
 * result.  The warps' (max, sum, acc) are merged in warp order through
 * shared memory.  An item that is its unit's only split writes out; the
 * splits of a unit write partials, and the last of them to finish (an
 * atomic ticket per unit, reset by that block for the next run) merges
 * them in split order: no merge launch, and the same bits whatever the
 * order the blocks ran in.
 *
 * Precision: with q in MT, every product is exact and summed in float32;
 * P enters at 2^-22 (float16) / 2^-24 (bfloat16) relative: the results
 * are within the float32 paths' tolerance of the float64 reference (see
 * docs/gpu.md for the measured error).  A NaN in a V row reaches the rows
 * of the same 16-key tile that do not see its key (0 x NaN); in K it does
 * not.
 */

#define KVT_WARPS 4
#define KVT_KEYS 16 /* keys per warp tile (the PV mma's k) */
#define KVT_ROWS 16 /* (query, head) pairs per item (the mma's m) */
#define KVT_MAX_SPLITS 256 /* splits of a unit (their weights fit the merge area) */

template <int KIND, int D, int MT> struct KvtCfg {
    typedef typename KvaStorage<KIND>::type T;
    static constexpr bool FP8 = KIND == KV_F8E4M3 || KIND == KV_F8E5M2;
    static constexpr int ROW = D * (int)sizeof(T); /* bytes of a K / V row */
    static constexpr int RS = ROW + 16;            /* its shared stride: rows spread over banks */
    static constexpr int VPR = ROW / 16;           /* 16-byte copies per row */
    static constexpr int TILE = KVT_KEYS * RS;     /* bytes of a K (or V) tile */
    static constexpr int STAGE = 2 * TILE;
    /* buffers per warp: 3 for rows of 128 bytes or less (fp8, head_dim 64:
     * two tiles in flight keep enough bytes moving), else 2 */
    static constexpr int STAGES = ROW <= 128 ? 3 : 2;
    static constexpr int PIPE = KVT_WARPS * STAGES * STAGE;
    /* the merges: the warps' partials and per pair their weights, max,
     * sum and norm; the last split's (m, l) per (split, pair) and norms */
    static constexpr int NORMS = (KVT_WARPS + 4) * KVT_ROWS * 4;
    static constexpr int MERGE = KVT_WARPS * KVT_ROWS * (D + 2) * 4 + NORMS;
    static constexpr int WEIGHTS = (2 * KVT_MAX_SPLITS + 2) * KVT_ROWS * 4;
    static constexpr int BODY = PIPE > MERGE ? (PIPE > WEIGHTS ? PIPE : WEIGHTS)
                                             : (MERGE > WEIGHTS ? MERGE : WEIGHTS);
    static constexpr int QS = 2 * D + 16; /* shared stride of a Q row (MT bits) */
    static constexpr int SMEM = BODY + KVT_ROWS * QS + KVT_ROWS * 8 + 16; /* + rows, flag */
    static constexpr int KS = D / 16, NT = D / 8;
    static constexpr bool QREG = D <= 128; /* A fragments in registers for the item */
    static constexpr int NP = MT == KV_BF16 ? 3 : 2;
    /* fp8: bytes a lane reads of a K row per chunk of 4 WK dims (WK / 4
     * k-steps), and of a V row per chunk of 8 WV dims (WV n8 tiles) */
    static constexpr int WK = D % 64 == 0 ? 16 : D % 32 == 0 ? 8 : 4;
    static constexpr int WV = D % 64 == 0 ? 8 : D % 32 == 0 ? 4 : 2;
    static_assert(D % 16 == 0 && ROW % 16 == 0, "whole k-steps and 16-byte rows");
    static_assert(KIND == KV_F16 || KIND == KV_BF16 || FP8, "f16, bf16 or fp8 pages");
    static_assert(FP8 || KIND == MT, "f16 / bf16 pages take q of their own kind");
};

/* The key of tile position (n8 tile nt, column n): in order for float16 /
 * bfloat16 pages; fp8 pages give lane c of a quad keys 4c .. 4c+3 (its V
 * bytes then come from 4 whole rows). */
template <bool FP8> __device__ __forceinline__ int kvt_key(int nt, int n)
{
    return FP8 ? 4 * (n >> 1) + 2 * nt + (n & 1) : 8 * nt + n;
}

/* The head dim of Q's (and K's) fragment column `col` (= 16 k-step + k). */
template <bool FP8, int WK> __device__ __forceinline__ int kvt_qdim(int col)
{
    if (!FP8)
        return col;
    const int ks = col >> 4, k = col & 15, half = k >> 3, c = (k & 7) >> 1, e = k & 1;
    const int j = ks / (WK / 4), s = ks - j * (WK / 4);
    return 4 * WK * j + WK * c + 4 * s + 2 * half + e;
}

/* The head dim of output column n (0..7) of n8 tile nn. */
template <bool FP8, int WV> __device__ __forceinline__ int kvt_odim(int nn, int n)
{
    if (!FP8)
        return 8 * nn + n;
    const int j = nn / WV, i = nn - j * WV;
    return 8 * WV * j + WV * n + i;
}

/* WB bytes (4, 8 or 16) at p as 32-bit words (WB = 2: one word, upper half 0). */
template <int WB> __device__ __forceinline__ void kvt_load(unsigned *w, const unsigned char *p)
{
    if constexpr (WB == 16) {
        const KvaVec16 v = *(const KvaVec16 *)p;
        w[0] = v.a, w[1] = v.b, w[2] = v.c, w[3] = v.d;
    } else if constexpr (WB == 8) {
        const unsigned long long v = *(const unsigned long long *)p;
        w[0] = (unsigned)v, w[1] = (unsigned)(v >> 32);
    } else if constexpr (WB == 4) {
        w[0] = *(const unsigned *)p;
    } else {
        w[0] = *(const kva_u16 *)p;
    }
}

/* items: [n][8] = (sequence, kv head, first pair, pairs, first key, end
 * key, split index, 0); nsplit: splits of each item's unit (the items of
 * a unit are consecutive, split index 0 first).  partials: per item
 * KVT_ROWS * (D + 2) floats (m, l, acc[D] per pair); counters: one int per
 * item, 0 between runs (the first item of a unit holds its ticket). */
template <int KIND, int D, int MT>
__global__ void __launch_bounds__(KVT_WARPS * 32, 2) /* 2 blocks per SM: registers to spare */
kva_decode_tc(void *out, float *partials, int *counters, const kva_u16 *q,
              const typename KvaStorage<KIND>::type *key_cache,
              const typename KvaStorage<KIND>::type *value_cache,
              const int *block_tables, const kva_i64 *seq_lens,
              const kva_i64 *query_start_loc, const kva_i64 *items, const int *nsplit,
              kva_i64 num_heads, kva_i64 group, kva_i64 table_stride, kva_i64 block_size,
              kva_i64 c_block, kva_i64 c_head, kva_i64 c_tok, float scale, kva_i64 window,
              float soft_cap, kva_i64 chunk, const float *alibi, const float *sinks,
              float k_scale, float v_scale, kva_i64 out_kind)
{
    typedef KvtCfg<KIND, D, MT> C;
    constexpr int KS = C::KS, NT = C::NT, NP = C::NP, RS = C::RS;
    constexpr bool FP8 = C::FP8;
    unsigned char *smem = KVA_DYN_SMEM();
    kva_u16 *sq = (kva_u16 *)(smem + C::BODY);
    int *flag = (int *)(smem + C::BODY + KVT_ROWS * C::QS + KVT_ROWS * 8);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c = lane & 3;
    const kva_i64 *it = items + (kva_i64)blockIdx.x * 8;
    const kva_i64 s = it[0], g = it[1], p0 = it[2], k0 = it[4], k1 = it[5];
    const int np = (int)it[3];
    const kva_i64 q0 = query_start_loc[s], nq = query_start_loc[s + 1] - q0;
    const kva_i64 pos0 = seq_lens[s] - nq; /* position of the sequence's query 0 */

    /* Q rows into shared memory, columns in fragment order */
    for (int i = tid; i < KVT_ROWS * D; i += blockDim.x) {
        const int r = i / D, col = i - r * D;
        kva_u16 x = 0;
        if (r < np) {
            const kva_i64 p = p0 + r, j = p / group;
            x = q[((q0 + j) * num_heads + g * group + (p - j * group)) * D +
                  kvt_qdim<FP8, C::WK>(col)];
        }
        sq[r * (C::QS / 2) + col] = x;
    }

    /* each pair's output row (first element) */
    kva_i64 *obase = (kva_i64 *)(smem + C::BODY + KVT_ROWS * C::QS);
    if (tid < KVT_ROWS) {
        const kva_i64 p = p0 + tid, j = p / group;
        obase[tid] = ((q0 + j) * num_heads + g * group + (p - j * group)) * D;
    }

    /* the scores' units: the dots here are of the codes (fp8: k_scale joins the scale) */
    const bool capped = !kva_is_zero(soft_cap);
    const KvaUnits un = kva_units(kva_mul(scale, k_scale), capped);
    const float capl2 = kva_mul(soft_cap, KVA_LOG2E);

    /* this lane's rows gq and gq + 8: position, first visible key, ALiBi slope */
    kva_i64 rpos[2], rlo[2];
    bool rvalid[2];
    float slope[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = gq + 8 * r;
        rvalid[r] = row < np;
        rpos[r] = pos0 + (p0 + row) / group;
        rlo[r] = kva_key_lo(rpos[r], window, chunk);
        slope[r] = alibi != nullptr && rvalid[r]
                       ? kva_logit_units(alibi[g * group + (p0 + row) % group], un) : 0.0f;
    }
    /* tiles inside [max lo, min pos] of every row need no mask */
    const kva_i64 minpos = pos0 + p0 / group, maxpos = pos0 + (p0 + np - 1) / group;
    const kva_i64 maxlo = kva_key_lo(maxpos, window, chunk);

    __syncthreads();
    const int mi = lane >> 3, mr = lane & 7; /* ldmatrix: this lane's matrix and row */
    /* Q's A fragment of k-step ks: rows 0-7 / 8-15 x columns 16 ks + 0-7 / 8-15 */
    auto qload = [&](int ks, unsigned *a) {
        kva_ldmatrix_x4<false>(a, (const unsigned char *)sq + (mr + 8 * (mi & 1)) * C::QS +
                                      2 * (16 * ks + 8 * (mi >> 1)));
    };
    unsigned qa[C::QREG ? KS : 1][4];
    if constexpr (C::QREG) {
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            qload(ks, qa[ks]);
    }
    auto qfrag = [&](int ks, unsigned *tmp) -> const unsigned * {
        if constexpr (C::QREG) {
            return qa[ks];
        } else { /* D = 256: from shared memory, per tile */
            qload(ks, tmp);
            return tmp;
        }
    };

    /* keys k0 .. k1-1 in tiles of 16: this warp's are warp, warp + 4, ... */
    const int ntiles = (int)((k1 - k0 + KVT_KEYS - 1) / KVT_KEYS);
    const int *table = block_tables + s * table_stride;
    const KvaDiv bdiv = kva_div_init((unsigned)block_size);
    const kva_i64 pb0 = k0 / block_size;
    const unsigned poff0 = (unsigned)(k0 - pb0 * block_size);
    unsigned char *wbuf = smem + warp * C::STAGES * C::STAGE;
    const unsigned char *kbase = (const unsigned char *)key_cache;
    const unsigned char *vbase = (const unsigned char *)value_cache;

    auto issue = [&](int tile, int stage) {
        if (tile < ntiles) { /* the same in every lane */
            const int kk = lane & 15;
            const kva_i64 t = k0 + (kva_i64)tile * KVT_KEYS + kk;
            kva_i64 off = -1;
            if (t < k1) {
                off = (kva_key_row(table, pb0, poff0 + (unsigned)(tile * KVT_KEYS + kk), bdiv,
                                   c_block, c_tok) + g * c_head) *
                      (kva_i64)sizeof(typename C::T);
            }
            unsigned char *dst = wbuf + stage * C::STAGE;
#pragma unroll
            for (int base = 0; base < KVT_KEYS * C::VPR; base += 32) {
                const int v = base + lane;
                const int key = v / C::VPR < KVT_KEYS ? v / C::VPR : KVT_KEYS - 1;
                const int cc = v - key * C::VPR;
                const kva_i64 o = kva_shfl64(off, key); /* every lane shuffles */
                if (v < KVT_KEYS * C::VPR) {
                    unsigned char *dk = dst + key * RS + 16 * cc;
                    if (o >= 0) {
                        kva_copy16(dk, kbase + o + 16 * cc);
                        kva_copy16(dk + C::TILE, vbase + o + 16 * cc);
                    } else { /* past the item's last key: zeros (0 x stale NaN is NaN) */
                        kva_zero16(dk, kbase);
                        kva_zero16(dk + C::TILE, vbase);
                    }
                }
            }
        }
        kva_copy_commit();
    };

    float m[2] = {KVA_NEG_INF, KVA_NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[NT][4];
#pragma unroll
    for (int nn = 0; nn < NT; nn++)
        acc[nn][0] = acc[nn][1] = acc[nn][2] = acc[nn][3] = 0.0f;

    /* the first STAGES - 1 tiles in flight; then each tile's turn issues the
     * one STAGES - 1 turns later, into the buffer read the turn before */
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; s++)
        issue(warp + s * KVT_WARPS, s);
    int stage = 0;
    for (int tile = warp; tile < ntiles; tile += KVT_WARPS) {
        const int ahead = stage == 0 ? C::STAGES - 1 : stage - 1; /* (stage + STAGES - 1) % STAGES */
        issue(tile + (C::STAGES - 1) * KVT_WARPS, ahead); /* last read before the __syncwarp below */
        kva_copy_wait<C::STAGES - 1>(); /* this lane's copies of `tile` have landed */
        __syncwarp();                    /* ... and every lane's */
        const unsigned char *kt = wbuf + stage * C::STAGE, *vt = kt + C::TILE;

        /* S = Q K^T */
        float sc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
            if constexpr (!FP8) {
#pragma unroll
                for (int ks = 0; ks < KS; ks += 2) {
                    unsigned b[4], a[4];
                    kva_ldmatrix_x4<false>(b, kt + (8 * nt + mr) * RS +
                                                  2 * (16 * (ks + (mi >> 1)) + 8 * (mi & 1)));
                    kva_mma16816<MT>(sc[nt], qfrag(ks, a), b);
                    if (ks + 1 < KS)
                        kva_mma16816<MT>(sc[nt], qfrag(ks + 1, a), b + 2);
                }
            } else {
                const unsigned char *kr = kt + kvt_key<true>(nt, gq) * RS + C::WK * c;
#pragma unroll
                for (int j = 0; j < D / (4 * C::WK); j++) {
                    unsigned w[C::WK / 4];
                    kvt_load<C::WK>(w, kr + 4 * C::WK * j);
#pragma unroll
                    for (int e = 0; e < C::WK / 4; e++) {
                        const unsigned b[2] = {kva_fp8x2<KIND, MT>(w[e] & 0xffffu),
                                               kva_fp8x2<KIND, MT>(w[e] >> 16)};
                        unsigned a[4];
                        kva_mma16816<MT>(sc[nt], qfrag(j * (C::WK / 4) + e, a), b);
                    }
                }
            }
        }

        /* the scores (element 2r + e of tile nt: row gq + 8r, key t0 +
         * kvt_key(nt, 2c + e)), each feature a pass of its own */
        const kva_i64 t0 = k0 + (kva_i64)tile * KVT_KEYS;
        if (capped) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                sc[i >> 2][i & 3] =
                    kva_cap(kva_mul(sc[i >> 2][i & 3], un.mult), capl2, soft_cap, un);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++)
                sc[i >> 2][i & 3] = kva_mul(sc[i >> 2][i & 3], un.mult);
        }
        if (!(t0 + KVT_KEYS <= k1 && t0 + KVT_KEYS - 1 <= minpos && t0 >= maxlo)) {
#pragma unroll
            for (int i = 0; i < 8; i++) { /* the causal / window / chunk mask, the last keys */
                const int r = (i & 3) >> 1;
                const kva_i64 key = t0 + kvt_key<FP8>(i >> 2, 2 * c + (i & 1));
                const bool vis = rvalid[r] && key >= rlo[r] && key <= rpos[r] && key < k1;
                sc[i >> 2][i & 3] = vis ? sc[i >> 2][i & 3] : KVA_NEG_INF;
            }
        }
        if (alibi != nullptr) {
#pragma unroll
            for (int i = 0; i < 8; i++) { /* slope * (t - p), in the scores' units */
                const int r = (i & 3) >> 1;
                const kva_i64 key = t0 + kvt_key<FP8>(i >> 2, 2 * c + (i & 1));
                sc[i >> 2][i & 3] = kva_fma(slope[r], (float)(key - rpos[r]), sc[i >> 2][i & 3]);
            }
        }
        /* the online softmax, per row */
        float al[2]; /* each row's rescaling of acc */
#pragma unroll
        for (int r = 0; r < 2; r++) /* the weights over the scores; l: this lane's columns */
            al[r] = kva_tile_online<2>(sc, sc, r, m[r], l[r], un);

        /* P as NP A fragments of MT: term t rounds what terms < t left */
        unsigned pa[NP][4];
#pragma unroll
        for (int t = 0; t < NP; t++) {
#pragma unroll
            for (int i = 0; i < 4; i++) { /* a_i: row gq + 8 (i & 1), tile i >> 1 */
                float *pr = &sc[i >> 1][2 * (i & 1)];
                pa[t][i] = kva_pack2_rn<MT>(pr[0], pr[1]);
                if (t + 1 < NP) {
                    pr[0] = kva_sub(pr[0], kva_half_of<MT, 0>(pa[t][i]));
                    pr[1] = kva_sub(pr[1], kva_half_of<MT, 1>(pa[t][i]));
                }
            }
        }

        /* O = O alpha + P V: each tile's P V summed from zero by its own mma
         * (the tensor cores' rounding then applies to one tile's sum, never
         * to O carried over thousands of keys), added in float32 */
        auto accumulate = [&](int nn, const float *pv) {
            acc[nn][0] = kva_fma(acc[nn][0], al[0], pv[0]);
            acc[nn][1] = kva_fma(acc[nn][1], al[0], pv[1]);
            acc[nn][2] = kva_fma(acc[nn][2], al[1], pv[2]);
            acc[nn][3] = kva_fma(acc[nn][3], al[1], pv[3]);
        };
        if constexpr (!FP8) {
#pragma unroll
            for (int nn = 0; nn < NT; nn += 2) {
                unsigned b[4];
                kva_ldmatrix_x4<true>(b, vt + (mr + 8 * (mi & 1)) * RS +
                                             2 * 8 * (nn + (mi >> 1)));
                float pv[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                for (int t = 0; t < NP; t++) {
                    kva_mma16816<MT>(pv[0], pa[t], b);
                    kva_mma16816<MT>(pv[1], pa[t], b + 2);
                }
                accumulate(nn, pv[0]);
                accumulate(nn + 1, pv[1]);
            }
        } else {
            constexpr int WW = C::WV >= 4 ? C::WV / 4 : 1; /* words per row chunk */
#pragma unroll
            for (int j = 0; j < D / (8 * C::WV); j++) {
                unsigned w[4][WW];
#pragma unroll
                for (int r = 0; r < 4; r++)
                    kvt_load<C::WV>(w[r], vt + (4 * c + r) * RS + 8 * C::WV * j + C::WV * gq);
#pragma unroll
                for (int i = 0; i < C::WV; i += 2) {
                    /* bytes i, i+1 of rows 4c .. 4c+3: pairs (row 4c, 4c+1), (4c+2, 4c+3) */
                    const unsigned sel = (i & 3) ? 0x7362u : 0x5140u;
                    const unsigned x01 = kva_prmt(w[0][i >> 2], w[1][i >> 2], sel);
                    const unsigned x23 = kva_prmt(w[2][i >> 2], w[3][i >> 2], sel);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const unsigned b[2] = {kva_fp8x2<KIND, MT>((x01 >> (16 * h)) & 0xffffu),
                                               kva_fp8x2<KIND, MT>((x23 >> (16 * h)) & 0xffffu)};
                        float pv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int t = 0; t < NP; t++)
                            kva_mma16816<MT>(pv, pa[t], b);
                        accumulate(C::WV * j + i + h, pv);
                    }
                }
            }
        }
        __syncwarp(); /* every lane is done with this stage before it is refilled */
        stage = stage + 1 == C::STAGES ? 0 : stage + 1;
    }
    kva_copy_wait<0>(); /* (the last group issued was empty) */

    /* the warps' partials into shared memory (over the pipeline buffers) */
    __syncthreads();
    float *mg = (float *)smem; /* [warp][row][D + 2] = m, l, acc */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float lr = kva_quad_sum(l[r]);
        float *dst = mg + (warp * KVT_ROWS + gq + 8 * r) * (D + 2);
        if (c == 0) {
            dst[0] = m[r];
            dst[1] = lr;
        }
#pragma unroll
        for (int nn = 0; nn < NT; nn++) {
            dst[2 + kvt_odim<FP8, C::WV>(nn, 2 * c)] = acc[nn][2 * r];
            dst[2 + kvt_odim<FP8, C::WV>(nn, 2 * c + 1)] = acc[nn][2 * r + 1];
        }
    }
    /* per pair: the warps' weights exp2((m_w - max) u) (0 for a warp
     * without its keys), the max, the sum, and (one split) the norm */
    float *wts = mg + KVT_WARPS * KVT_ROWS * (D + 2); /* [KVT_WARPS][KVT_ROWS] */
    float *rowm = wts + KVT_WARPS * KVT_ROWS, *rowl = rowm + KVT_ROWS;
    float *den = rowl + KVT_ROWS, *wn = den + KVT_ROWS;
    const int ns = nsplit[blockIdx.x];
    __syncthreads();
    if (tid < np) {
        const float sink = kva_sink(sinks, g * group + (p0 + tid) % group, un);
        float mx = KVA_NEG_INF;
        for (int w = 0; w < KVT_WARPS; w++)
            mx = kva_max(mx, mg[(w * KVT_ROWS + tid) * (D + 2)]);
        float total = 0.0f;
        for (int w = 0; w < KVT_WARPS; w++) {
            const float *src = mg + (w * KVT_ROWS + tid) * (D + 2);
            const float wt = kva_part_weight(src[0], src[1], mx, un); /* (a NaN sum is kept) */
            total = kva_fma(wt, src[1], total);
            wts[w * KVT_ROWS + tid] = wt;
        }
        rowm[tid] = mx;
        rowl[tid] = total;
        const KvaNorm n = kva_norm(total, mx, sinks != nullptr, sink, un);
        den[tid] = n.den;
        wn[tid] = kva_mul(n.w, v_scale);
    }
    __syncthreads();
    float *part = partials + (kva_i64)blockIdx.x * KVT_ROWS * (D + 2);
    for (int i = tid; i < np * D; i += blockDim.x) {
        const int r = i / D, d = i - r * D;
        float a = 0.0f; /* (a warp without keys has acc 0 and weight 0) */
        for (int w = 0; w < KVT_WARPS; w++)
            a = kva_fma(wts[w * KVT_ROWS + r], mg[(w * KVT_ROWS + r) * (D + 2) + 2 + d], a);
        if (ns == 1)
            kva_store_f(out, (int)out_kind, obase[r] + d, kva_mul(kva_div(a, den[r]), wn[r]));
        else
            part[r * (D + 2) + 2 + d] = a;
    }
    if (ns == 1)
        return;
    if (tid < np) {
        part[tid * (D + 2)] = rowm[tid];
        part[tid * (D + 2) + 1] = rowl[tid];
    }

    /* the last split of the unit to finish merges them all, in split order */
    const kva_i64 first = (kva_i64)blockIdx.x - it[6];
    __threadfence(); /* this block's partials are visible before its ticket */
    __syncthreads();
    if (tid == 0)
        *flag = atomicAdd(counters + first, 1) == ns - 1;
    __syncthreads();
    if (!*flag)
        return;
    __threadfence();
    /* each split's (m, l) per pair into shared memory, then each pair's
     * weights exp2((m - max) u) (0 for a split without its keys), total and
     * norm, then the elements: one read of each split's partial */
    float *wm = mg, *wl = mg + KVT_MAX_SPLITS * KVT_ROWS;
    den = wl + KVT_MAX_SPLITS * KVT_ROWS; /* (past wm / wl) */
    wn = den + KVT_ROWS;
    for (int i = tid; i < ns * KVT_ROWS; i += blockDim.x) {
        const int sp = i / KVT_ROWS, r = i - sp * KVT_ROWS;
        if (r < np) {
            const float *src = partials + ((first + sp) * KVT_ROWS + r) * (D + 2);
            wm[i] = kva_load_cg(src);
            wl[i] = kva_load_cg(src + 1);
        }
    }
    __syncthreads();
    if (tid < np) {
        const float sink = kva_sink(sinks, g * group + (p0 + tid) % group, un);
        float mx = KVA_NEG_INF;
        for (int sp = 0; sp < ns; sp++)
            mx = kva_max(mx, wm[sp * KVT_ROWS + tid]);
        float total = 0.0f;
        for (int sp = 0; sp < ns; sp++) {
            const int i = sp * KVT_ROWS + tid;
            const float w = kva_part_weight(wm[i], wl[i], mx, un); /* 0: no keys for this pair */
            total = kva_fma(w, wl[i], total);
            wm[i] = w;
        }
        const KvaNorm n = kva_norm(total, mx, sinks != nullptr, sink, un);
        den[tid] = n.den;
        wn[tid] = kva_mul(n.w, v_scale);
    }
    __syncthreads();
    for (int i = tid; i < np * D; i += blockDim.x) {
        const int r = i / D, d = i - r * D;
        const float *src = partials + (first * KVT_ROWS + r) * (D + 2) + 2 + d;
        float a = 0.0f;
#pragma unroll 4
        for (int sp = 0; sp < ns; sp++) /* (an empty split's acc is 0, its weight 0) */
            a = kva_fma(wm[sp * KVT_ROWS + r], kva_load_cg(src + (kva_i64)sp * KVT_ROWS * (D + 2)), a);
        kva_store_f(out, (int)out_kind, obase[r] + d, kva_mul(kva_div(a, den[r]), wn[r]));
    }
    if (tid == 0)
        counters[first] = 0; /* ready for the next run (a replayed graph included) */
}
