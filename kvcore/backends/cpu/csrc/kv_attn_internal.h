/*
 * kv_attn_internal.h: what the files of the attention kernel share (not
 * part of kvcore's C API; kv_attention.h is).
 *
 * The kernel is split by role (one file, one role):
 *   kv_attention.c      the public entry: argument check, levels, the plan
 *                       (create / run / free), kva_paged_attention
 *   kv_attn_schedule.c  work items, key splits, the thread count, the
 *                       workspace layout and the merge of split partials
 *   kv_attn_tile.c      one work item: the key-tile loop (scores, mask,
 *                       online softmax, P.V), with the software prefetch
 *   kv_attn_threads.c   the worker pool
 *   kv_attn_scalar.c    the portable kernels (every kind)
 *   kv_attn_avx2.c      AVX2 + FMA + F16C kernels (x86-64; every function
 *                       carries __attribute__((target)) and ends in _avx2)
 *   kv_attn_avx512.c    AVX-512 F/BW/VL/DQ kernels (x86-64; every function
 *                       carries KVA_AVX512_TARGET and ends in _avx512)
 *   kv_attn_neon.c      AArch64 Advanced SIMD kernels
 *   kv_attn_amx.c       AMX-BF16 tile kernels for items of many rows, and
 *                       AVX-512 math (functions end in _amx)
 *
 * Build notes: no file is compiled with -m flags, so the wheel runs on every
 * x86-64 (and aarch64) CPU; the AVX2 bodies are reached only after the
 * CPU said it has the instructions (kv_simd.h).
 *
 * Shape of the computation (FlashAttention-2 style, on a CPU):
 *   - An item is (sequence, kv head, tile of query tokens, split of keys).
 *     Its rows are every (query token, query head of the kv head's group):
 *     a GQA group shares each K and V row, which is read once per item.
 *   - Keys are walked in tiles of KVA_KEY_TILE positions (decode-like
 *     items of fewer than KVA_TILE_ROWS rows: KVA_DECODE_KEY_TILE).  Per tile:
 *     scores = Q K^T (register-blocked dot products, K widened in
 *     registers), soft cap, causal / window / chunk mask, ALiBi, online
 *     softmax in base 2 (the scale carries log2(e)), then acc = acc *
 *     alpha + P V; the rows' sinks join their denominators at the end.
 *   - Decode-like items (one query tile) with a long key range are split
 *     into KVA_SPLIT_KEYS-position pieces (flash-decoding); the last piece
 *     to finish merges the partial (max, sum, acc) triples in split order.
 */
#ifndef KV_ATTN_INTERNAL_H
#define KV_ATTN_INTERNAL_H

#include "kv_attention.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#define KVA_X86 1
#else
#define KVA_X86 0
#endif
#if KVA_X86 && defined(__GNUC__)
#define KVA_HAVE_AVX2 1
#else
#define KVA_HAVE_AVX2 0
#endif
/* AVX-512 kernels: x86-64 with GCC or Clang, or any CPU when the test
 * build compiles them against SIMDe (KVA_AVX512_SIMDE). */
#if KVA_HAVE_AVX2 || defined(KVA_AVX512_SIMDE)
#define KVA_HAVE_AVX512 1
#else
#define KVA_HAVE_AVX512 0
#endif
/* The AMX intrinsics and target names: GCC 11, clang 12. */
#if KVA_HAVE_AVX2 && ((defined(__clang__) && __clang_major__ >= 12) || \
                      (!defined(__clang__) && __GNUC__ >= 11))
#define KVA_HAVE_AMX 1
#else
#define KVA_HAVE_AMX 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define KVA_HAVE_NEON 1
#else
#define KVA_HAVE_NEON 0
#endif

/* Query rows per item (query tokens x heads of a group; at least one
 * token), by the keys one query of the item's sequence can see (its
 * length, or a shorter sliding window or chunk): KVA_ROWS, KVA_ROWS_MID
 * from KVA_MID_KEYS keys, KVA_ROWS_LONG from KVA_LONG_KEYS.  Each item packs
 * (AMX) or widens the K and V tiles it reads once for all its rows, so more
 * rows share that work; but the rows of an item's causal diagonal tiles
 * compute scores they mask, and there are fewer items for the threads.
 * Causal prefill of 512 / 2048 tokens (docs/performance.md, "Rows per
 * item"): 128 rows rather than 64 were 1.02-1.17x / 1.08-1.35x at amx and
 * 0.97-1.07x / 0.97-1.14x at avx512 and avx2; 256 rows at 2048 tokens gained
 * more at amx; of 128 tokens, 128 rows lost up to 14%.  From the arguments
 * alone: the same items, hence the same bits, for any thread count. */
#ifndef KVA_ROWS
#define KVA_ROWS 64
#endif
#define KVA_ROWS_MID 128
#define KVA_ROWS_LONG 256
#define KVA_MID_KEYS 512
#define KVA_LONG_KEYS 2048
/* Key positions per tile of an item of KVA_TILE_ROWS rows or more (a
 * prefill's), and the row stride of the scores: a multiple of 32 (the AMX
 * kernels work a tile in runs of 32).  64 rather than 32 halves the
 * per-row softmax work per key (row max, exp sum and rescale run once per
 * tile): causal prefill about 10% faster at head_dim 64 on a Zen 5
 * (docs/performance.md). */
#define KVA_KEY_TILE 64
/* Key positions per tile of a decode-like item (fewer rows) but those of
 * kva_math.wide_tile_row_bytes: memory-bound, its prefetch of the next
 * tile is tuned for this distance (64 made the AVX2 decode up to 1.4x
 * slower on the same Zen 5, and float16 rows of head_dim 128 at avx512
 * 5-8% slower out of the caches); a multiple of 8, at most KVA_KEY_TILE. */
#define KVA_DECODE_KEY_TILE 32
_Static_assert(KVA_KEY_TILE % 32 == 0 && KVA_DECODE_KEY_TILE % 8 == 0 &&
                   KVA_DECODE_KEY_TILE <= KVA_KEY_TILE,
               "key tiles: KVA_KEY_TILE a multiple of 32, the decode tile a multiple of 8 "
               "within it");
/* Key positions per split of a decode-like item. */
#define KVA_SPLIT_KEYS 1024
/* Least work (query rows x keys x head_dim) worth a thread of its own:
 * about 100 us of one core's time, several times what waking a worker
 * costs on a loaded machine. */
#define KVA_WORK_PER_THREAD ((int64_t)1 << 19)
/* Items of more rows than this widen each K/V tile to float32 once (the
 * micro-kernels work on 4 rows at a time, and would widen it per block):
 * the kva_kernels.direct_rows of a level that says no more. */
#define KVA_WIDEN_ROWS 4
/* Items of at least this many rows (a matrix tile's) run the level's tile
 * kernels where it has them (kva_job.kern_tiles). */
#define KVA_TILE_ROWS 16
/* Items of fewer rows than this (one or a few query tokens times a GQA
 * group; a prefill's items have 64 or more: kva_tokens_per_item) have the
 * next tile's rows prefetched by their kernels, spread over their loads
 * (kva_kernels.prefetch), the amx level's tile kernels included. */
#define KVA_SPREAD_ROWS (2 * KVA_TILE_ROWS)
/* The amx level's tiles take head_dims that are multiples of 32 up to
 * this (their scratch: 16 rows of it on the stack); others run avx512. */
#define KVA_AMX_MAX_D 256

#define KVA_LOG2E 1.4426950408889634f

/* No multiplicand the attention makes itself is a subnormal float32: a
 * softmax weight, a weight times its value scale, a rescale factor or an
 * element of q below FLT_MIN (2^-126) in magnitude is 0 (stored float32 and
 * bfloat16 elements are read as stored; a score, only compared with and
 * subtracted from its row's maximum, is kept as it is).  An FMA or a
 * multiply taking a subnormal costs about 128 cycles on an Intel Xeon
 * with AMX (a microcode assist; docs/performance.md, "Subnormal floats")
 * against half a cycle, and the tiny weights of a wide score spread made
 * whole decodes 2.4x slower there; such a term changes an
 * output by less than 2^-126 times a value.  (Subnormal results are
 * free there: only the inputs are flushed.)  NaN passes. */
static inline float kva_flush_tiny(float x)
{
    return x > -0x1p-126f && x < 0x1p-126f ? 0.0f : x;
}

/* ------------------------------------------------------------------ */
/* Kernel tables (one per level, kv_attn_<level>.c)                    */
/* ------------------------------------------------------------------ */

typedef struct {
    /* Every kernel takes `next`: NULL, or the next tile's rows (next[i]
     * valid for every row i the call reads).  The levels whose kernels
     * prefetch (`prefetch` set: avx2, avx512) prefetch each line of next[i]
     * where they load the same line of row i, with the same bits as
     * without; the others ignore it.  A decode item is a short chain of
     * FMAs per line it reads: one burst of a whole tile's prefetches stalls
     * it (the load queue fills) and then leaves the memory idle while it
     * computes; spread this way, a line is in flight per line computed
     * (decode out of the caches 1.2-1.9x faster on a Zen 4: docs/performance.md). */
    /* S[r * KVA_KEY_TILE + i] = Qs[r] . K[i] for r < M, i < ntp (ntp % 8 == 0).
     * tmp: KVA_KEY_TILE * D floats of scratch. */
    void (*scores)(const float *Qs, int M, int D, const char *const *krow, int ntp, float *S,
                   float *tmp, const char *const *next);
    /* acc[r] = acc[r] * alpha[r] + sum_{i < nt} P[r * KVA_KEY_TILE + i] V[i]. */
    void (*pv)(const float *P, int M, int D, const char *const *vrow, int nt, float *acc,
               const float *alpha, float *tmp, const char *const *next);
    /* dst[i * D + d] = row i widened to float32, for i < n. */
    void (*widen)(const char *const *rows, int n, int D, float *dst, const char *const *next);
    /* The elements these kernels read are the stored values divided by
     * unit (a power of two): the caller multiplies q and the P.V weights
     * by it, so every product is exactly the one over the values. */
    float unit;
    /* Whether the kernels prefetch `next` (else the caller prefetches). */
    int prefetch;
    /* Whether scores, for KVA_TILE_ROWS rows or more, transposes the key
     * tile once from the stored rows itself (converting as it loads): an
     * item of that many rows then widens only its values. */
    int transposes;
    /* NULL, or (tile kernels) the item's q (M x D) made once per item
     * into the form the kernels' scores take instead of it (at qt:
     * kva_ws.qt, 3 x M rounded up to 16 x D bf16).  post 0: Qs is the
     * scaled q; else Qs is the q unscaled, every element a bfloat16 (one
     * bf16 term instead of three), and the scores are its dots times post. */
    void (*prepare)(const float *Qs, int M, int D, uint16_t *qt, float post);
    /* Items of up to this many rows (and fewer than KVA_TILE_ROWS) read
     * the stored K and V rows themselves, widening each as they load it
     * for all their rows at once... */
    int direct_rows;
    /* ... and so do items of more rows, up to this many (below
     * KVA_TILE_ROWS), in calls of at most direct_rows rows each (as even
     * as they come; each call after the first finds the tile's rows in
     * L1: kva_row_calls); items of more widen each tile to float32 once
     * (kern_f32).  (Tile kernels, which never widen: unused.) */
    int multi_call_rows;
} kva_kernels;

/* A table entry of a level whose functions are named <verb>_<kind>_<level>. */
#define KVA_KERNELS(kind, level, unit, prefetch, transposes) \
    KVA_KERNELS_ROWS(kind, level, unit, prefetch, transposes, KVA_WIDEN_ROWS, KVA_WIDEN_ROWS)
/* ... whose items of up to `rows` rows read the stored rows in one call
 * (direct_rows), up to `calls` rows in calls of up to `rows` (multi_call_rows). */
#define KVA_KERNELS_ROWS(kind, level, unit, prefetch, transposes, rows, calls) \
    {scores_##kind##_##level, pv_##kind##_##level, widen_##kind##_##level, unit, prefetch, \
     transposes, NULL, rows, calls}

/* How many kernel calls an item of M rows takes over a tile's stored rows:
 * one up to direct_rows (or past multi_call_rows: the widened tile's kernels,
 * or float32 pages, read every row in one call), else calls of at most
 * direct_rows rows. */
static inline int kva_row_calls(const kva_kernels *kern, int M)
{
    if (M <= kern->direct_rows || M > kern->multi_call_rows)
        return 1;
    return (M + kern->direct_rows - 1) / kern->direct_rows;
}

typedef struct {
    float (*row_max)(const float *s, int ntp);
    /* s[i] = exp2(s[i] - mx) for i < ntp; returns the sum. */
    float (*row_exp_sum)(float *s, int ntp, float mx);
    /* s[i] = b * tanh(a * s[i]) for i < n. */
    void (*softcap)(float *s, ptrdiff_t n, float a, float b);
    void (*exp2_neg)(const float *x, float *y, ptrdiff_t n);
    /* s[i] = (s[i] * w[i]) * c for i < n (w NULL: s[i] * c; c 1: the one
     * product): low precision pages' scales on a tile's scores (weights 0)
     * and weights (weights 1: each s[i] * w[i] through kva_flush_tiny, as
     * the weights become P.V's multiplicands), one rounding per product as
     * the scalar loop has it, so every level gives the same bits.  (A score
     * is only compared with and subtracted from its row's maximum, which
     * costs nothing when it is subnormal: it is not flushed.) */
    void (*scale)(float *s, const float *w, float c, ptrdiff_t n, int weights);
    /* The softmax step of a tile (NULL: the level has none, the caller
     * runs the steps above one by one): M rows of scores S[r *
     * KVA_KEY_TILE + i], i < ntp <= KVA_KEY_TILE, that see the keys
     * [first, last) (0 <= first < last <= nt <= ntp), or with rf given
     * the keys [rf[r], rl[r]) each (rl[r] <= rf[r]: none; then the row's
     * scores are made 0, alpha[r] 1 and sum[r] 0, m[r] kept), each taken
     * through every step of kva_run_item's per-row loop with the same
     * operations in the same order (the same bits): times ks[i] for i < nt
     * (ks NULL: not), -inf outside the visible keys, the row maximum m[r]
     * (updated) and alpha[r], the exponentials stored in S and their sum
     * in sum[r] (the caller updates l), the visible weights times vs[i]
     * (vs NULL: not) and unit.  The scores are base-2 logits (no soft cap,
     * ALiBi or wide units). */
    void (*softmax_rows)(float *S, int M, int nt, int ntp, int first, int last, const int *rf,
                        const int *rl, const float *ks, const float *vs, float unit, float *m,
                        float *sum, float *alpha);
    /* A decode-like item whose stored rows are at most this many bytes
     * takes the wide tile (KVA_KEY_TILE: half the per-row softmax steps
     * per key, and a tile's K and V rows, 16 KB at most, leave room in L1
     * for the next one's prefetched rows); 0: every decode-like item takes
     * KVA_DECODE_KEY_TILE.  (avx512: 128, whose fp8 and int8 decode is
     * bound by its arithmetic; docs/performance.md.) */
    int wide_tile_row_bytes;
} kva_math;

/* Tables indexed by kind (KVA_F32 .. KVA_I8). */
#define KVA_NUM_KINDS 6
extern const kva_kernels kva_kernels_scalar[KVA_NUM_KINDS];
extern const kva_math kva_math_scalar;
/* The scalar soft cap (tanhf; the NEON level uses it too). */
void kva_softcap_scalar(float *s, ptrdiff_t n, float a, float b);
void kva_scale_scalar(float *s, const float *w, float c, ptrdiff_t n, int weights);
#if KVA_HAVE_AVX2
extern const kva_kernels kva_kernels_avx2[KVA_NUM_KINDS];
extern const kva_math kva_math_avx2;
#endif
#if KVA_HAVE_AVX512
extern const kva_kernels kva_kernels_avx512[KVA_NUM_KINDS];
extern const kva_math kva_math_avx512;
#endif
#if KVA_HAVE_AMX
/* Tile kernels over the stored rows (unit 1, no widen); the f32 entry is
 * all NULL (float32 pages keep the AVX-512 kernels: bf16 terms of a float32
 * element need three tiles per operand, and the AVX-512 path is exact). */
extern const kva_kernels kva_kernels_amx[KVA_NUM_KINDS];
/* TILERELEASE: the end of a job's use of the tiles on a thread (the tile
 * kernels leave them configured between calls). */
void kva_release_amx(void);
/* Whether this thread's tile kernels met an inf or a NaN in the key or
 * value rows they packed since the last call (and forget it): a term of q
 * or of a weight that is 0 times an infinite element is NaN in a tile
 * product, where a float32 sum of the products has 0 (or the inf), so
 * kva_run_item runs such an item again with the level's other kernels. */
int kva_nonfinite_amx(void);
#endif
#if KVA_HAVE_NEON
/* f32, f16, bf16 only: the other kinds run the scalar kernels */
#define KVA_NUM_NEON_KINDS 3
extern const kva_kernels kva_kernels_neon[KVA_NUM_NEON_KINDS];
extern const kva_math kva_math_neon;
#endif

/* ------------------------------------------------------------------ */
/* Worker pool (kv_attn_threads.c)                                     */
/* ------------------------------------------------------------------ */

typedef void (*kva_job_fn)(void *ctx, int thread_index);
/* Run fn(ctx, 0 .. n-1) on n threads, n <= nthreads (the caller is thread
 * 0; fewer when workers cannot be started). */
void kva_pool_run(kva_job_fn fn, void *ctx, int nthreads);

/* ------------------------------------------------------------------ */
/* Work items and jobs (kv_attn_schedule.c, kv_attn_tile.c)            */
/* ------------------------------------------------------------------ */

typedef struct {
    int64_t seq;
    int64_t q0, q1;      /* query tokens of the sequence, [q0, q1) */
    int64_t k0, k1;      /* key positions, [k0, k1) */
    int64_t cost;        /* rows x keys, for the schedule */
    int64_t group;       /* merge group (nsplit > 1), else -1 */
    int64_t slot;        /* partial slot (nsplit > 1; a group's slots are consecutive), else -1 */
    int64_t order;       /* position in the natural order (ties of the schedule) */
    int32_t kv_head;
    int32_t split, nsplit;
} kva_item;

typedef struct {
    const kva_args *a;
    const kva_kernels *kern;
    const kva_kernels *kern_f32; /* for tiles widened once (items of many rows) */
    const kva_kernels *kern_tiles; /* items of >= KVA_TILE_ROWS rows: matrix
                                      tiles over the stored rows; NULL: none */
    const kva_math *math;
    const kva_item *items;
    int64_t num_items;
    int64_t next;        /* atomic: next item to take */
    int threads;         /* the threads the job asks for (kva_job_thread's claims) */
    int *group_done;     /* atomic counters, one per merge group */
    float *partials;     /* per split item: m[Mmax], l[Mmax], acc[Mmax * D] */
    size_t partial_floats;
    char *workspace;     /* per thread */
    size_t workspace_bytes;
    int max_rows;
    int split_rows;      /* rows of a partial slot: the most rows of a split item */
    /* How the scale is applied (kva_score_units; kv_attention.h's rule):
     * q is multiplied by qscale; with a soft cap, the scores by post_scale
     * (0: not) before the cap.  The scores are base-2 logits, or when
     * `wide` those divided by wide_scale (> 1): the dots q.k themselves
     * (of -q for a negative scale), whose differences to their row
     * maximum wide_scale multiplies before the exponential. */
    float qscale, post_scale, wide_scale;
    int wide;
} kva_job;

/* The scale's fields of a job (kv_attn_tile.c). */
void kva_score_units(const kva_args *a, kva_job *job);
/* A natural-log logit (a sink) in the units of the job's scores. */
static inline float kva_logit_units(const kva_job *job, float x)
{
    return job->wide ? x * KVA_LOG2E / job->wide_scale : x * KVA_LOG2E;
}
/* out[d] = acc[d] / a row's softmax denominator with a sink: l (the sum
 * of the exponentials of its keys' scores less m, their maximum) plus the
 * sink's (`sink` in the scores' units).  out may be acc. */
void kva_finish_sink(const kva_job *job, float *out, const float *acc, int D, float l, float m,
                     float sink);

/* Per-thread workspace layout (floats unless noted). */
typedef struct {
    float *Qs, *S, *acc, *m, *l, *alpha, *tmp;
    uint16_t *qt; /* q made once per item for tile kernels (kva_kernels.prepare) */
    int64_t *lo, *hi;
    int *first, *last;           /* visible keys of each row in this tile */
    float *sum;                  /* each row's sum of exponentials in this tile */
    const char **krow, **vrow;   /* this tile's rows */
    const char **nkrow, **nvrow; /* the next tile's */
    float *kf, *vf;              /* a tile widened to float32 */
    const char **kfrow, **vfrow; /* its rows */
} kva_ws;

static inline int64_t kva_group_size(const kva_args *a) { return a->num_heads / a->num_kv_heads; }

static inline int64_t kva_seq_queries(const kva_args *a, int64_t s)
{
    return a->query_start_loc[s + 1] - a->query_start_loc[s];
}

static inline size_t kva_align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* What a row's scores are taken less before their exp2 when m is its
 * running maximum: m, or 0 while every visible score is -inf (their
 * weights 0, as the reference's, not exp2(-inf - -inf), NaN: a sink then
 * takes the whole weight, and a later tile's finite scores all of it). */
static inline float kva_weight_origin(float m) { return m == -INFINITY ? 0.0f : m; }

/* Row r of an item (its first query token at row0 of q / out, KV head g):
 * the offset, in elements, of its head_dim elements in q and out (query
 * token row0 + r / G, head g * G + r % G). */
static inline size_t kva_row_at(const kva_args *a, int64_t row0, int64_t g, int r)
{
    const int64_t G = kva_group_size(a);
    return ((size_t)(row0 + r / G) * a->num_heads + (size_t)(g * G + r % G)) * a->head_dim;
}

/* An output row o (float32) at element `at` of out: a float32 out holds it
 * there already (the caller wrote it in place); a 16-bit one gets it
 * narrowed by kva_args.convert. */
static inline void kva_put_row(const kva_args *a, size_t at, const float *o)
{
    if (a->out_kind != KVA_F32)
        a->convert(KVA_F32, o, a->out_kind, (uint16_t *)(void *)a->out + at, a->head_dim);
}

/* The first key position a query at position pos sees (kv_attention.h):
 * the later of its window's start and its chunk's. */
static inline int64_t kva_key_lo(const kva_args *a, int64_t pos)
{
    int64_t lo = a->sliding_window > 0 && pos + 1 > a->sliding_window
                     ? pos + 1 - a->sliding_window : 0;
    if (a->chunk_size > 0 && pos - pos % a->chunk_size > lo)
        lo = pos - pos % a->chunk_size;
    return lo;
}

/* Query tokens per item of sequence s. */
int64_t kva_tokens_per_item(const kva_args *a, int64_t s);
/* The most query tokens of any item of the call. */
int64_t kva_most_tokens_per_item(const kva_args *a);
/* Items of the call, in a fixed order (fills `items` when given). */
int64_t kva_make_items(const kva_args *a, kva_item *items, int64_t *num_groups,
                       int64_t *num_slots, int64_t *split_rows);
/* Threads worth waking for these items (at most `want`, at least 1). */
int kva_thread_count(const kva_item *items, int64_t n, int head_dim, int want);
/* Sort the items costliest first (the schedule only: not the bits). */
void kva_schedule(kva_item *items, int64_t n);
/* Bytes of one thread's workspace; fills ws when base is given. */
size_t kva_workspace_layout(int max_rows, int D, char *base, kva_ws *ws);
/* Merge the partials of every split of `it`'s group, in split order. */
void kva_merge_group(const kva_job *job, const kva_item *it, int M, double *scratch);
/* One item (kv_attn_tile.c). */
/* Item `it`; `next` (or NULL) is the item this thread runs after it, whose
 * first tile the last tile of a decode item prefetches. */
void kva_run_item(const kva_job *job, const kva_item *it, const kva_item *next,
                  const kva_ws *ws);
/* A thread of a job: takes items until none is left. */
void kva_job_thread(void *ctx, int thread_index);

#endif
