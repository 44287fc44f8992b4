/*
 * attention.cu: attention over a paged KV cache on the GPU (flash-decoding).
 *
 * Same contract as the CPU kernels (kvcore/backends/cpu/csrc/kv_attention.h):
 * sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]-1;
 * query j of its m queries sits at position seq_lens[s] - m + j and attends
 * to positions max(0, pos + 1 - window) .. pos (window 0: from 0).  K/V of
 * position t of kv head g are at
 *     cache + table[t / block_size] * c_block + g * c_head + (t % block_size) * c_tok
 * (elements), head_dim contiguous, of kind KIND (kv_half.cuh's numbering:
 * KV_F32, KV_F16 / KV_BF16 bits, KV_F8E4M3 / KV_F8E5M2 codes, KV_I8 codes),
 * widened to float32 in registers (fp8: kv_fp8.cuh's exact rule, shared
 * with convert_fp8.cu and lowprec.cu).
 *
 * Low precision: each element reads as the pool reads it back, the float32
 * product element * scale (kv_fp8.cuh's exact fp8 widening, or the int8
 * code), formed in registers as the row is loaded; the CPU kernel
 * (kv_attention.c) applies the same scales to the scores and weights
 * instead (equal up to float rounding).  fp8: one scale per layer
 * (k_scale, v_scale); int8: one float32 per (block, kv head, slot) in
 * key_scales / value_scales at
 *     table[t / block_size] * s_block + g * s_head + (t % block_size) * s_tok.
 * A NaN (an int8 NaN row's scale, an fp8 NaN code) makes the outputs of
 * the queries that see it NaN, as on the CPU: warps and splits are merged
 * skipping only the empty ones (l == 0), never a NaN partial.
 *
 * The kernels (attention_kernels.py picks them per call): here
 * kva_attention_split (the tiled float32 kernel, below the scalar one:
 * every kind, pages 16-byte aligned), kva_attention_split_scalar (any
 * pages), kva_attention_prefill (tensor cores, f16 / bf16 pages, sequences
 * of many queries) and kva_attention_merge; kv_attn_decode.cuh's
 * kva_decode_tc (decode and short chunks on tensor cores, v3).  q and out
 * are float32, float16 or bfloat16, read and written where they lie (the
 * kind a run-time argument: kva_load_f / kva_store_f); the primitives the
 * kernels share (the online softmax, the merges, the page lookups among
 * them) are kv_attn.cuh's.
 *
 * kva_attention_split_scalar: one thread block per work item, an item being
 * (query row, kv head, chunk of up to KVA_HEADS query heads of its group,
 * split of the keys).  The host builds the item table (7 int64 per item:
 * seq, query row, kv head, first head of the chunk, heads in the chunk,
 * first key, end key) and the split count per item.  Each warp walks every
 * KVA_WARPS-th key of the item; each lane holds head_dim / 32 dimensions;
 * scores are warp-reduced, the softmax is online in base 2 (the scale
 * carries log2 e), and the warps' (max, sum, acc) are merged in shared
 * memory in warp order.  An item of one split writes the output; otherwise
 * its partial goes to `partials` (slot = item index) and
 * kva_attention_merge combines the splits of each (query row, head) in
 * split order.  No atomics: the result does not depend on scheduling.
 *
 * Host emulation (tests/_cuda_attention_emulation.py): compiled by the host
 * C++ compiler with KVCORE_HOST_EMULATION defined after a shim that runs
 * each block's threads as cooperative fibers (__syncthreads a block
 * barrier, warp shuffles exchanges, cp.async copies landing at their wait,
 * ldmatrix and mma from their fragment layouts), so the tests run this
 * code without a GPU.
 */

#include "kv_attn.cuh"

#define KVA_WARPS 4
#define KVA_HEADS 8

/* The parameters of both split kernels (the host packs the same list for
 * either: attention_kernels / attention.py). */
#define KVA_SPLIT_PARAMS(KIND)                                                          \
    void *out, float *partials, const void *q,                                          \
        const typename KvaStorage<KIND>::type *key_cache,                               \
        const typename KvaStorage<KIND>::type *value_cache, const int *block_tables,    \
        const kva_i64 *seq_lens, const kva_i64 *query_start_loc, const kva_i64 *items,  \
        const int *nsplit, kva_i64 num_heads, kva_i64 table_stride, kva_i64 block_size, \
        kva_i64 c_block, kva_i64 c_head, kva_i64 c_tok, float scale, kva_i64 window,    \
        float soft_cap, kva_i64 chunk, const float *alibi, const float *sinks,          \
        const float *key_scales, const float *value_scales, kva_i64 s_block,            \
        kva_i64 s_head, kva_i64 s_tok, float k_scale, float v_scale, kva_i64 q_kind,    \
        kva_i64 out_kind

/* items: [num_items][7]; nsplit: splits of each item's (row, chunk);
 * partials: per item KVA_HEADS * (D + 2) floats (m, l, acc[D] per head).
 * key_scales / value_scales, s_*: int8 row scales (null otherwise);
 * k_scale / v_scale: fp8 layer scales (1 otherwise; unused for int8);
 * q_kind / out_kind: the element kinds of q and out (KV_F32 / F16 / BF16). */
/* An item's merged result for query head h0 + h, dim d of query row
 * `row`: the output when the item is its row's only split, else its
 * partial slot (KVA_HEADS (D + 2) floats per item, slot = item index). */
template <int D>
__device__ __forceinline__ void kva_item_result(void *out, float *partials, KvaMerged r,
                                                bool single, kva_i64 row, kva_i64 num_heads,
                                                kva_i64 h0, int h, int d, const float *sinks,
                                                KvaUnits un, kva_i64 out_kind)
{
    if (single) {
        kva_store_result(out, out_kind, (row * num_heads + h0 + h) * D + d, r, sinks, h0 + h, un);
    } else {
        float *p = partials + (kva_i64)blockIdx.x * KVA_HEADS * (D + 2) + h * (D + 2);
        p[2 + d] = r.acc;
        if (d == 0) {
            p[0] = r.m;
            p[1] = r.l;
        }
    }
}

template <int KIND, int D>
__global__ void __launch_bounds__(KVA_WARPS * 32, 2) /* registers to spare: no spill */
kva_attention_split_scalar(KVA_SPLIT_PARAMS(KIND))
{
    constexpr int NPL = (D + 31) / 32; /* dims per lane */
    __shared__ float q_s[KVA_HEADS][D];
    __shared__ float part_s[KVA_WARPS][KVA_HEADS][D + 2];

    const kva_i64 *it = items + (kva_i64)blockIdx.x * 7;
    const kva_i64 s = it[0], row = it[1], g = it[2], h0 = it[3];
    const int nh = (int)it[4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool capped = !kva_is_zero(soft_cap); /* 0: off (the host checked it) */
    const KvaUnits un = kva_units(scale, capped);
    const float qscale = un.mult, capl2 = kva_mul(soft_cap, KVA_LOG2E);

    for (int i = threadIdx.x; i < KVA_HEADS * D; i += blockDim.x) {
        int h = i / D, d = i - h * D;
        q_s[h][d] = h < nh ? kva_mul(kva_load_f(q, (int)q_kind, (row * num_heads + h0 + h) * D + d),
                                     qscale)
                           : 0.0f;
    }
    __syncthreads();

    /* this query's visible keys, within the item's range */
    const KvaKeys keys =
        kva_row_keys(seq_lens, query_start_loc, s, row, window, chunk, it[5], it[6]);
    const kva_i64 pos = keys.pos, lo = keys.lo, hi = keys.hi;

    float m[KVA_HEADS], l[KVA_HEADS], acc[KVA_HEADS][NPL];
#pragma unroll
    for (int h = 0; h < KVA_HEADS; h++) {
        m[h] = KVA_NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++)
            acc[h][i] = 0.0f;
    }
    const int *table = block_tables + s * table_stride;
    for (kva_i64 t = lo + warp; t < hi; t += KVA_WARPS) {
        kva_i64 blk = t / block_size, off = t - blk * block_size;
        kva_i64 base = (kva_i64)table[blk] * c_block + g * c_head + off * c_tok;
        float ks = k_scale, vs = v_scale;
        if constexpr (KIND == KV_I8) {
            kva_i64 at = (kva_i64)table[blk] * s_block + g * s_head + off * s_tok;
            ks = key_scales[at];
            vs = value_scales[at];
        }
        float kv[NPL], vv[NPL];
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            int d = lane + 32 * i;
            kv[i] = d < D ? kva_widen<KIND>(key_cache + base + d) : 0.0f;
            vv[i] = d < D ? kva_widen<KIND>(value_cache + base + d) : 0.0f;
            if constexpr (KVA_SCALED(KIND)) {
                if (d < D) { /* the stored value: element * scale */
                    kv[i] = kva_mul(kv[i], ks);
                    vv[i] = kva_mul(vv[i], vs);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < KVA_HEADS; h++) {
            if (h >= nh)
                break;
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; i++) {
                int d = lane + 32 * i;
                if (d < D)
                    part = kva_fma(q_s[h][d], kv[i], part);
            }
            float score = kva_warp_sum(part);
            if (capped)
                score = kva_cap(score, capl2, soft_cap, un);
            if (alibi != nullptr) /* slope * (t - p), in the scores' units */
                score = kva_fma(kva_logit_units(alibi[h0 + h], un), (float)(t - pos), score);
            float alpha;
            const float p = kva_online(score, m[h], l[h], alpha, un);
#pragma unroll
            for (int i = 0; i < NPL; i++)
                acc[h][i] = kva_fma(p, vv[i], kva_mul(acc[h][i], alpha));
        }
    }

    /* merge the warps in warp order (kva_merge: a warp without keys is
     * skipped, a NaN sum kept) */
#pragma unroll
    for (int h = 0; h < KVA_HEADS; h++) {
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            int d = lane + 32 * i;
            if (d < D)
                part_s[warp][h][2 + d] = acc[h][i];
        }
        if (lane == 0) {
            part_s[warp][h][0] = m[h];
            part_s[warp][h][1] = l[h];
        }
    }
    __syncthreads();
    const bool single = nsplit[blockIdx.x] == 1;
    for (int i = threadIdx.x; i < nh * D; i += blockDim.x) {
        int h = i / D, d = i - h * D;
        const KvaMerged mg =
            kva_merge<KVA_HEADS * (D + 2)>(&part_s[0][0][0] + h * (D + 2), 0, KVA_WARPS, d, un);
        kva_item_result<D>(out, partials, mg, single, row, num_heads, h0, h, d, sinks, un,
                           out_kind);
    }
}

/* ------------------------------------------------------------------------
 * kva_attention_split: the tiled kernel (16-byte copies, K/V tiles double
 * buffered through shared memory, the chunk's query heads in parallel).
 * Same items, arguments and partials as kva_attention_split_scalar, which
 * the host runs instead when the pages are not 16-byte aligned (the base
 * pointers and the block / head / token strides in bytes; see
 * attention_kernels.tiled_ok).
 *
 * The item's keys lo .. hi-1 are cut into tiles of KvaTile::KEYS keys
 * (KVA_TILE_BYTES of K and as many of V per tile).  Per tile, the block
 * table is read once per page the tile touches (s_page), then each key's
 * row offset is formed with a 32-bit multiply-high division by block_size
 * (KvaDiv: its magic number is computed once per block; no 64-bit
 * division per key), and the K and V rows are copied 16 bytes at a time
 * into one of two shared buffers: tile i+1 is in flight (cp.async on
 * sm_80+, a plain 16-byte load and store below) while tile i is reduced.
 *
 * The reduction: 8 rows of 16 lanes; each lane holds D / 16 dimensions of
 * one query head; the chunk's heads (nh <= 8) get 8 / NHC rows each (NHC:
 * nh rounded up to a power of two), row r walking the tile's keys
 * r % (8 / NHC), + 8 / NHC, ... with its own online softmax (scores summed
 * over the 16 lanes by 4 shuffles).  The rows of a head are merged in row
 * order at the end, then written as by the scalar kernel: the result does
 * not depend on scheduling (same bits on replay).
 * ---------------------------------------------------------------------- */

#define KVA_TILE_BYTES 8192 /* bytes of K (and of V) per tile and buffer */
#define KVA_ROWS 8          /* rows of 16 lanes per block (KVA_WARPS * 2) */

template <int KIND, int D> struct KvaTile {
    typedef typename KvaStorage<KIND>::type T;
    static constexpr int ROW = D * (int)sizeof(T);  /* bytes of a key's row */
    static constexpr int VPR = ROW / 16;            /* 16-byte vectors per row */
    static constexpr int KEYS = KVA_TILE_BYTES / ROW > 64 ? 64 : KVA_TILE_BYTES / ROW;
    static constexpr int DPL = D / 16;              /* dimensions per lane */
    static_assert(ROW % 16 == 0 && D % 16 == 0, "rows of whole 16-byte vectors");
    struct alignas(16) Smem {
        union {
            struct {
                T k[2][KEYS][D];
                T v[2][KEYS][D];
            } t;
            float part[KVA_ROWS][D + 2]; /* after the last tile */
        } u;
        kva_i64 off[2][KEYS];  /* element offset of each key's row */
        kva_i64 soff[2][KEYS]; /* int8: offset of each key's row scale */
        float ks[2][KEYS], vs[2][KEYS];
        int page[KEYS + 1];    /* block ids of the pages of the tile being planned */
    };
};

template <int KIND, int D>
__global__ void __launch_bounds__(KVA_WARPS * 32)
kva_attention_split(KVA_SPLIT_PARAMS(KIND))
{
    typedef KvaTile<KIND, D> Tl;
    typedef typename Tl::T T;
    constexpr int KEYS = Tl::KEYS, VPR = Tl::VPR, DPL = Tl::DPL;
    __shared__ typename Tl::Smem sm;

    const kva_i64 *it = items + (kva_i64)blockIdx.x * 7;
    const kva_i64 s = it[0], row = it[1], g = it[2], h0 = it[3];
    const int nh = (int)it[4];
    const int tid = threadIdx.x, r = tid >> 4, lane = tid & 15;
    const int nhc = nh <= 1 ? 1 : nh <= 2 ? 2 : nh <= 4 ? 4 : 8;
    const int kr = KVA_ROWS / nhc;       /* rows per head */
    const int hr = r / kr, phase = r - hr * kr;
    const bool active = hr < nh;
    const bool capped = !kva_is_zero(soft_cap); /* 0: off (the host checked it) */
    const KvaUnits un = kva_units(scale, capped);
    const float qscale = un.mult, capl2 = kva_mul(soft_cap, KVA_LOG2E);

    const KvaKeys keys =
        kva_row_keys(seq_lens, query_start_loc, s, row, window, chunk, it[5], it[6]);
    const kva_i64 pos = keys.pos, lo = keys.lo, hi = keys.hi;
    const kva_i64 nkeys = hi > lo ? hi - lo : 0;
    const float slope = alibi != nullptr && active ? kva_logit_units(alibi[h0 + hr], un) : 0.0f;
    const kva_i64 ntiles = (nkeys + KEYS - 1) / KEYS;

    float qv[DPL], acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        qv[i] = active ? kva_mul(kva_load_f(q, (int)q_kind,
                                            (row * num_heads + h0 + hr) * D + lane * DPL + i),
                                 qscale)
                       : 0.0f;
        acc[i] = 0.0f;
    }
    float m = KVA_NEG_INF, l = 0.0f;

    const int *table = block_tables + s * table_stride;
    const KvaDiv bdiv = kva_div_init((unsigned)block_size); /* < 2^31: the host checked */
    /* the page (pblk) and offset in it (poff) of the next tile to plan */
    kva_i64 pblk = lo / block_size; /* once per block */
    unsigned poff = (unsigned)(lo - pblk * block_size);
    kva_i64 planned = 0; /* tiles planned so far */

    auto tile_keys = [&](kva_i64 i) -> int {
        kva_i64 left = nkeys - i * KEYS;
        return left <= 0 ? 0 : left >= KEYS ? KEYS : (int)left;
    };
    /* plan step 1: the block ids of the next tile's pages (one table read
     * per page); step 2 (after a barrier): each key's row offsets */
    auto plan_pages = [&]() {
        const int n = tile_keys(planned);
        if (n > 0) {
            const int npages = (int)kva_udiv(poff + (unsigned)(n - 1), bdiv) + 1;
            for (int j = tid; j < npages; j += blockDim.x)
                sm.page[j] = table[pblk + j];
        }
    };
    auto plan_keys = [&](int b) {
        const int n = tile_keys(planned);
        for (int kk = tid; kk < n; kk += blockDim.x) {
            const unsigned rel = poff + (unsigned)kk;
            const unsigned j = kva_udiv(rel, bdiv);
            const kva_i64 o = rel - j * bdiv.d;
            const kva_i64 pg = sm.page[j];
            sm.off[b][kk] = pg * c_block + g * c_head + o * c_tok;
            if constexpr (KIND == KV_I8)
                sm.soff[b][kk] = pg * s_block + g * s_head + o * s_tok;
        }
        /* every thread advances to the next tile's first key */
        const unsigned next = poff + (unsigned)KEYS;
        const unsigned adv = kva_udiv(next, bdiv);
        pblk += adv;
        poff = next - adv * bdiv.d;
        ++planned;
    };
    auto issue = [&](kva_i64 i, int b) {
        const int n = tile_keys(i);
        for (int v = tid; v < n * VPR; v += blockDim.x) {
            const int kk = v / VPR, c = v - kk * VPR;
            const kva_i64 at = sm.off[b][kk];
            kva_copy16((char *)&sm.u.t.k[b][kk][0] + 16 * c,
                       (const char *)(key_cache + at) + 16 * c);
            kva_copy16((char *)&sm.u.t.v[b][kk][0] + 16 * c,
                       (const char *)(value_cache + at) + 16 * c);
        }
        if constexpr (KIND == KV_I8) {
            for (int kk = tid; kk < n; kk += blockDim.x) {
                sm.ks[b][kk] = key_scales[sm.soff[b][kk]];
                sm.vs[b][kk] = value_scales[sm.soff[b][kk]];
            }
        }
        kva_copy_commit();
    };

    /* prologue: tile 0 in flight, tile 1's offsets ready */
    plan_pages();
    __syncthreads();
    plan_keys(0);
    __syncthreads();
    issue(0, 0);
    plan_pages();
    __syncthreads();
    plan_keys(1);
    __syncthreads();

    for (kva_i64 i = 0; i < ntiles; i++) {
        const int b = (int)(i & 1), n = tile_keys(i);
        issue(i + 1, b ^ 1);   /* reads off[b^1]; writes buffer b^1, free since the last barrier */
        plan_pages();          /* tile i+2's pages (page[] was last read before the last barrier) */
        kva_copy_wait<1>();    /* this thread's copies of tile i have landed */
        __syncthreads();       /* ... and every thread's */
        plan_keys(b);          /* tile i+2's offsets into off[b] (issue(i) read it long ago) */
        float ks = k_scale, vs = v_scale;
        const int iters = (n + kr - 1) / kr; /* the same in every row: the shuffles agree */
        for (int j = 0; j < iters; j++) {
            const int kk = phase + j * kr;
            const bool valid = active && kk < n;
            if constexpr (KIND == KV_I8) {
                if (valid) {
                    ks = sm.ks[b][kk];
                    vs = sm.vs[b][kk];
                }
            }
            float part = 0.0f;
            if (valid) {
                const T *kp = &sm.u.t.k[b][kk][lane * DPL];
#pragma unroll
                for (int d = 0; d < DPL; d++) {
                    float x = kva_widen<KIND>(kp + d);
                    if constexpr (KVA_SCALED(KIND))
                        x = kva_mul(x, ks); /* the stored value: element * scale */
                    part = kva_fma(qv[d], x, part);
                }
            }
            float score = kva_row_sum(part);
            if (valid) {
                if (capped)
                    score = kva_cap(score, capl2, soft_cap, un);
                if (alibi != nullptr) /* slope * (t - p), in the scores' units */
                    score = kva_fma(slope, (float)(lo + i * KEYS + kk - pos), score);
                float alpha;
                const float p = kva_online(score, m, l, alpha, un);
                const T *vp = &sm.u.t.v[b][kk][lane * DPL];
#pragma unroll
                for (int d = 0; d < DPL; d++) {
                    float x = kva_widen<KIND>(vp + d);
                    if constexpr (KVA_SCALED(KIND))
                        x = kva_mul(x, vs);
                    acc[d] = kva_fma(p, x, kva_mul(acc[d], alpha));
                }
            }
        }
        __syncthreads(); /* buffer b and off[b] may be reused */
    }
    kva_copy_wait<0>();
    __syncthreads();

    /* merge the rows of each head in row order (as the warps above) */
    if (active) {
#pragma unroll
        for (int d = 0; d < DPL; d++)
            sm.u.part[r][2 + lane * DPL + d] = acc[d];
        if (lane == 0) {
            sm.u.part[r][0] = m;
            sm.u.part[r][1] = l;
        }
    }
    __syncthreads();
    const bool single = nsplit[blockIdx.x] == 1;
    for (int i = tid; i < nh * D; i += blockDim.x) {
        const int h = i / D, d = i - h * D;
        const KvaMerged mg = kva_merge<D + 2>(&sm.u.part[0][0], h * kr, kr, d, un);
        kva_item_result<D>(out, partials, mg, single, row, num_heads, h0, h, d, sinks, un,
                           out_kind);
    }
}

/* ------------------------------------------------------------------------
 * kva_attention_prefill: tensor cores for prefill and chunked prefill over
 * float16 / bfloat16 pages (mma.sync.m16n8k16, f32 accumulators; sm_80+:
 * the host runs it only there, and only for sequences of at least
 * attention_kernels.PREFILL_MIN_QUERIES queries; head_dim <= 128).
 *
 * One thread block (4 warps) per item (seq, first query row, rows, kv
 * head): its (query row, query head of the group) pairs, pair p = (row
 * first + p / G, head kv * G + p % G), 16 per warp: a warp's pairs are the
 * rows of its m16 tiles.  Keys go in tiles of 16 (K and V rows copied 16
 * bytes at a time into shared memory): S = Q K^T as 2 n8 tiles of D / 16
 * k-steps (tile i+1's copies in flight meanwhile: two buffers, cp.async
 * on sm_80+), masked (causal, window), soft-capped, an online softmax per
 * pair in base 2 (the row max over the 4 lanes of a quad), then O += P V as
 * D / 8 n8 tiles with P's accumulators reused as the A fragments.
 * Precision: q * scale and P enter the mma as f16 / bf16 (rounded to
 * nearest even: kv_half.cuh's conversions), products are summed in f32;
 * see docs/gpu.md for the tolerance.  No split, no atomics: the result
 * does not depend on scheduling.
 *
 * Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"): with
 * g = lane / 4, c = lane % 4: A (16 x 16, row major) a0 = (g, 2c..2c+1),
 * a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..); B (16 x 8,
 * column) b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g); C / D (16 x 8)
 * d0, d1 = (g, 2c..2c+1), d2, d3 = (g+8, 2c..); the lower element of a
 * pair in the lower 16 bits.  The host emulation does the same arithmetic
 * from these layouts (tests/_cuda_attention_emulation.py).
 * ---------------------------------------------------------------------- */

#define KVA_PREFILL_PAIRS 64 /* (query, head) pairs per block: 4 warps x m16 */

template <int D> struct alignas(16) KvaPrefillSmem {
    kva_u16 k[2][16][D], v[2][16][D]; /* two tiles: one in flight, one reduced */
    kva_i64 off[2][16];
};

/* items: [n][4] = (sequence, first query row, rows, kv head). */
template <int KIND, int D>
__global__ void __launch_bounds__(KVA_WARPS * 32)
kva_attention_prefill(void *out, const void *q, const kva_u16 *key_cache,
                      const kva_u16 *value_cache, const int *block_tables,
                      const kva_i64 *seq_lens, const kva_i64 *query_start_loc,
                      const kva_i64 *items, kva_i64 num_heads, kva_i64 group,
                      kva_i64 table_stride, kva_i64 block_size, kva_i64 c_block,
                      kva_i64 c_head, kva_i64 c_tok, float scale, kva_i64 window,
                      float soft_cap, kva_i64 chunk, const float *alibi, const float *sinks,
                      kva_i64 vec16, kva_i64 q_kind, kva_i64 out_kind)
{
    static_assert(KIND == KV_F16 || KIND == KV_BF16, "f16 / bf16 pages");
    constexpr int KS = D / 16, NT = D / 8, VPR = D * 2 / 16;
    __shared__ KvaPrefillSmem<D> sm;

    const kva_i64 *it = items + (kva_i64)blockIdx.x * 4;
    const kva_i64 s = it[0], row0 = it[1], nrows = it[2], g = it[3];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c = lane & 3;
    const bool capped = !kva_is_zero(soft_cap); /* 0: off (the host checked it) */
    const KvaUnits un = kva_units(scale, capped);
    const float qscale = un.mult, capl2 = kva_mul(soft_cap, KVA_LOG2E);
    const kva_i64 q0 = query_start_loc[s], nq = query_start_loc[s + 1] - q0;
    const kva_i64 pos0 = seq_lens[s] - nq + (row0 - q0); /* position of the first row */

    /* this thread's two pairs: rows gq and gq + 8 of its warp's tile */
    kva_i64 prow[2], phead[2], ppos[2], plo[2];
    bool pvalid[2];
    float pslope[2];
    for (int r = 0; r < 2; r++) {
        const kva_i64 p = warp * 16 + gq + 8 * r;
        const kva_i64 j = p / group;
        pvalid[r] = j < nrows;
        prow[r] = row0 + j;
        phead[r] = g * group + (p - j * group);
        ppos[r] = pos0 + j;
        plo[r] = kva_key_lo(ppos[r], window, chunk);
        pslope[r] = alibi != nullptr && pvalid[r] ? kva_logit_units(alibi[phead[r]], un) : 0.0f;
    }
    const kva_i64 klo = kva_key_lo(pos0, window, chunk);
    const kva_i64 khi = pos0 + nrows; /* the last row's position + 1 */

    /* Q as A fragments: k-step ks holds dims 16 ks + 2c, +1 and + 8 */
    unsigned qa[KS][4];
#pragma unroll
    for (int k = 0; k < KS; k++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i & 1, d = 16 * k + 2 * c + (i >> 1) * 8;
            float x0 = 0.0f, x1 = 0.0f;
            if (pvalid[r]) {
                const kva_i64 at = (prow[r] * num_heads + phead[r]) * D + d;
                x0 = kva_mul(kva_load_f(q, (int)q_kind, at), qscale);
                x1 = kva_mul(kva_load_f(q, (int)q_kind, at + 1), qscale);
            }
            qa[k][i] = kva_pack2<KIND>(x0, x1);
        }
    }
    float m[2] = {KVA_NEG_INF, KVA_NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    const int *table = block_tables + s * table_stride;
    const KvaDiv bdiv = kva_div_init((unsigned)block_size);
    kva_i64 pblk = klo / block_size; /* once per block */
    unsigned poff = (unsigned)(klo - pblk * block_size);

    /* tile i's keys: t0 = klo + 16 i; its buffer i & 1 */
    auto tile_n = [&](kva_i64 t0) -> int {
        return t0 >= khi ? 0 : khi - t0 >= 16 ? 16 : (int)(khi - t0);
    };
    auto plan_tile = [&](int bi, kva_i64 t0) { /* each key's row (a table read per key) */
        const int n = tile_n(t0);
        if (tid < n)
            sm.off[bi][tid] = kva_key_row(table, pblk, poff + (unsigned)tid, bdiv, c_block, c_tok) +
                              g * c_head;
        const unsigned next = poff + 16u; /* every thread: the next tile's first key */
        const unsigned adv = kva_udiv(next, bdiv);
        pblk += adv;
        poff = next - adv * bdiv.d;
    };
    auto issue_tile = [&](int bi, kva_i64 t0) {
        const int n = tile_n(t0);
        if (n > 0) {
            for (int v = tid; v < 16 * VPR; v += blockDim.x) {
                const int kk = v / VPR, cc = v - kk * VPR;
                char *dk = (char *)&sm.k[bi][kk][0] + 16 * cc;
                char *dv = (char *)&sm.v[bi][kk][0] + 16 * cc;
                if (kk < n && vec16) {
                    kva_copy16(dk, (const char *)(key_cache + sm.off[bi][kk]) + 16 * cc);
                    kva_copy16(dv, (const char *)(value_cache + sm.off[bi][kk]) + 16 * cc);
                } else if (kk < n) { /* pages off 16 bytes: element by element */
                    for (int e = 0; e < 8; e++) {
                        sm.k[bi][kk][8 * cc + e] = key_cache[sm.off[bi][kk] + 8 * cc + e];
                        sm.v[bi][kk][8 * cc + e] = value_cache[sm.off[bi][kk] + 8 * cc + e];
                    }
                } else { /* zeros past the last key (0 * a stale NaN would be NaN) */
                    *(KvaVec16 *)dk = KvaVec16{0, 0, 0, 0};
                    *(KvaVec16 *)dv = KvaVec16{0, 0, 0, 0};
                }
            }
        }
        kva_copy_commit();
    };

    plan_tile(0, klo);
    __syncthreads();
    issue_tile(0, klo);
    for (kva_i64 t0 = klo; t0 < khi; t0 += 16) {
        const int cur = (int)(((t0 - klo) >> 4) & 1);
        /* tile i+1: its offsets (off[b^1] was last read two barriers ago),
         * then its copies into buffer b^1 (last read by tile i-1's
         * products, before the barrier that ended them) while tile i is
         * reduced */
        plan_tile(cur ^ 1, t0 + 16);
        __syncthreads();
        issue_tile(cur ^ 1, t0 + 16);
        kva_copy_wait<1>(); /* this thread's copies of tile i have landed */
        __syncthreads();    /* ... and every thread's */

        /* S = Q K^T: keys 8 nt + g of the tile as columns */
        float sc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < KS; k++) {
                unsigned b[2];
                const kva_u16 *kr = &sm.k[cur][8 * nt + gq][16 * k + 2 * c];
                b[0] = (unsigned)kr[0] | ((unsigned)kr[1] << 16);
                b[1] = (unsigned)kr[8] | ((unsigned)kr[9] << 16);
                kva_mma16816<KIND>(sc[nt], qa[k], b);
            }
        }
        /* mask, cap, online softmax: element i of tile nt is pair i / 2,
         * key t0 + 8 nt + 2c + i % 2 */
        float p[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const kva_i64 key = t0 + 8 * nt + 2 * c + e;
                    float x = sc[nt][2 * r + e];
                    if (capped)
                        x = kva_cap(x, capl2, soft_cap, un);
                    if (alibi != nullptr) /* slope * (t - p), in the scores' units */
                        x = kva_fma(pslope[r], (float)(key - ppos[r]), x);
                    const bool vis = pvalid[r] && key >= plo[r] && key <= ppos[r];
                    sc[nt][2 * r + e] = vis ? x : KVA_NEG_INF;
                }
            }
            /* this lane's columns only in l (summed over the quad at the end) */
            const float alpha = kva_tile_online<2>(sc, p, r, m[r], l[r], un);
#pragma unroll
            for (int nn = 0; nn < NT; nn++) {
                acc[nn][2 * r] = kva_mul(acc[nn][2 * r], alpha);
                acc[nn][2 * r + 1] = kva_mul(acc[nn][2 * r + 1], alpha);
            }
        }
        /* O += P V: P's accumulators are the A fragment (keys as k) */
        unsigned pa[4];
        pa[0] = kva_pack2<KIND>(p[0][0], p[0][1]);
        pa[1] = kva_pack2<KIND>(p[0][2], p[0][3]);
        pa[2] = kva_pack2<KIND>(p[1][0], p[1][1]);
        pa[3] = kva_pack2<KIND>(p[1][2], p[1][3]);
#pragma unroll
        for (int nn = 0; nn < NT; nn++) {
            const int dim = 8 * nn + gq;
            const kva_u16(*vt)[D] = sm.v[cur];
            unsigned b[2];
            b[0] = (unsigned)vt[2 * c][dim] | ((unsigned)vt[2 * c + 1][dim] << 16);
            b[1] = (unsigned)vt[2 * c + 8][dim] | ((unsigned)vt[2 * c + 9][dim] << 16);
            kva_mma16816<KIND>(acc[nn], pa, b);
        }
        __syncthreads(); /* the tile's buffers may be refilled */
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float total = kva_quad_sum(l[r]);
        if (!pvalid[r])
            continue;
        const KvaNorm n = kva_norm(total, m[r], sinks != nullptr, kva_sink(sinks, phead[r], un),
                                   un);
        kva_tile_store<NT>(out, out_kind, (prow[r] * num_heads + phead[r]) * D, acc, r, c, n);
    }
}

/* rows: [num_rows][4] = (query row, first head, heads, first item); the
 * splits of a row are consecutive items first_item .. first_item + n - 1,
 * n = nsplit[first_item].  One thread block per row, threads over dims. */
template <int D>
__global__ void kva_attention_merge(void *out, const float *partials, const kva_i64 *rows,
                                    const int *nsplit, kva_i64 num_heads, float scale,
                                    float soft_cap, const float *sinks, kva_i64 out_kind)
{
    const KvaUnits un = kva_units(scale, !kva_is_zero(soft_cap));
    const kva_i64 *r = rows + (kva_i64)blockIdx.x * 4;
    const kva_i64 row = r[0], h0 = r[1], nh = r[2], first = r[3];
    const int n = nsplit[first];
    for (kva_i64 i = threadIdx.x; i < nh * D; i += blockDim.x) {
        kva_i64 h = i / D, d = i - h * D;
        /* the splits in split order (one without keys skipped, a NaN sum kept) */
        const KvaMerged mg =
            kva_merge<KVA_HEADS * (D + 2)>(partials + h * (D + 2), first, n, (int)d, un);
        kva_store_result(out, out_kind, (row * num_heads + h0 + h) * D + d, mg, sinks, h0 + h,
                         un);
    }
}

#include "kv_attn_decode.cuh"
#include "kv_attn_prefill.cuh"
