/*
 * kv_attention: attention over a paged KV cache, read where it lies.
 *
 * For each sequence s the queries are rows query_start_loc[s] ..
 * query_start_loc[s+1]-1 of q; query j of a sequence with m queries sits at
 * position p = seq_lens[s] - m + j and attends (causally) to positions
 * lo(p)..p, lo(p) = max(p + 1 - sliding_window (with a window), the start
 * of p's chunk of chunk_size positions (with chunks), 0).  The score of
 * key t of query head h is x = scale * q.k, capped (cap * tanh(x / cap))
 * with a soft cap, plus alibi_slopes[h] * (t - p) with ALiBi slopes; the
 * softmax's denominator gains exp(sinks[h]) with sinks.  Keys and values of
 * position t of kv head g live at
 *     cache + block_tables[s][t / block_size] * block_stride
 *           + g * head_stride + (t % block_size) * row_stride   (bytes)
 * as head_dim contiguous elements of `kind` (float32, float16 or bfloat16
 * bits), and are widened to float32 in registers.  Scores, the online
 * softmax (running max, rescaled sum) and the output accumulate in float32.
 *
 * Any scale (0, or a |scale| * log2(e) that is a finite normal float32)
 * gives a finite result wherever the float32 dots q.k are finite: the
 * scores are base-2 logits (scale * log2(e) folded into q) when |scale| *
 * log2(e) <= 1, where that cannot overflow; above, they are the dots
 * themselves and the scale multiplies their differences to the row's
 * maximum before the exponential (an overflow is -inf, a weight of 0: a
 * huge scale gives the softmax's one-hot limit, exact ties shared).  With
 * a soft cap and |scale| > 1 the dots are scaled before the cap (an
 * overflow caps to +-cap).
 *
 * The caller has validated every argument (kvcore/attention.py): shapes,
 * that block ids and positions are in range, seq_lens >= query counts.
 * Nothing here touches the Python API: the call runs without the GIL.
 *
 * Work is split into items (sequence x kv head x query tile x key split);
 * how a call is split depends only on its arguments, never on the thread
 * count, and every item is computed and merged in a fixed order, so the
 * result has the same bits for any number of threads.
 */
#ifndef KV_ATTENTION_H
#define KV_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element kinds (the numbering of kvcore._dtypes and kv_half.h). */
enum { KVA_F32 = 0, KVA_F16 = 1, KVA_BF16 = 2 };
/* Low-precision storage: fp8 bits (a per-layer scale) and int8 codes (a
 * float32 scale per token and kv head). */
enum { KVA_F8E4M3 = 3, KVA_F8E5M2 = 4, KVA_I8 = 5 };

/* Instruction-set levels of the kernels. */
/* KVA_AMX: AMX-BF16 tiles for the items of many query rows (prefill) of
 * float16 / bfloat16 / fp8 / int8 pages whose head_dim is a multiple of 32;
 * everything else at that level runs the AVX-512 kernels. */
enum { KVA_SCALAR = 0, KVA_AVX2 = 1, KVA_NEON = 2, KVA_AVX512 = 3, KVA_AMX = 4,
       KVA_NUM_LEVELS = 5 };

/* Status codes. */
enum { KVA_OK = 0, KVA_ENOMEM = -1, KVA_EINVAL = -2 };

typedef struct {
    const float *q;              /* (num_tokens, num_heads, head_dim), C-contiguous */
    float *out;                  /* same shape, C-contiguous; must not overlap q or the caches */
    const char *key_cache;
    const char *value_cache;
    int kind;                    /* KVA_F32 / KVA_F16 / KVA_BF16 / KVA_F8E4M3 / KVA_F8E5M2 / KVA_I8 */
    ptrdiff_t block_stride;      /* bytes between blocks */
    ptrdiff_t head_stride;       /* bytes between kv heads of a block */
    ptrdiff_t row_stride;        /* bytes between positions of a block (rows contiguous) */
    int64_t block_size;
    int num_heads, num_kv_heads, head_dim;
    const int32_t *block_tables; /* row s at block_tables + s * block_table_stride */
    ptrdiff_t block_table_stride;
    const int64_t *seq_lens;     /* (num_seqs,) */
    const int64_t *query_start_loc; /* (num_seqs + 1,) */
    int64_t num_seqs;
    float scale;                 /* multiplies q.k */
    int64_t sliding_window;      /* 0: none */
    float soft_cap;              /* 0: none; else cap * tanh(score / cap) */
    int num_threads;             /* >= 1 */
    /* Low-precision kinds.  A stored row reads as its elements times its
     * scale: int8, the row's scale in key_scales / value_scales (float32
     * planes (num_blocks, num_kv_heads, block_size), C-contiguous; NULL for
     * other kinds); fp8, k_scale / v_scale (the layer's; 1 or 0 -- "none" --
     * for other kinds, so a zero-initialised kva_args needs no change).
     * fp8 with one scale per kv head: k_head_scales / v_head_scales
     * (num_kv_heads floats each; NULL: k_scale / v_scale for every head). */
    const float *key_scales;
    const float *value_scales;
    float k_scale, v_scale;
    const float *k_head_scales;
    const float *v_head_scales;
    /* Attention features (0 / NULL: off; last, so a positional initialiser
     * of the fields above leaves them off).  chunk_size: a shape field (read
     * at plan create); query p sees no key before (p / chunk_size) *
     * chunk_size.  alibi_slopes, sinks: data fields (read at run),
     * num_heads floats each, finite: slope[h] * (t - p) added to the
     * scores of query head h after the soft cap; sink[h] a logit (the
     * scores' natural-log units) joining each row's softmax denominator. */
    int64_t chunk_size;
    const float *alibi_slopes;
    const float *sinks;
    /* q's and out's element kinds (data fields): KVA_F32 (0, so a
     * zero-initialised kva_args reads and writes float32), or KVA_F16 /
     * KVA_BF16, whose elements q / out then point at (cast): each item
     * widens its q rows and narrows its output rows with `convert`
     * (kvcore's conversions, kv_half.h's kvh_convert: the bits of
     * converting the whole array before / after the run).  Needed with a
     * 16-bit kind, unused otherwise. */
    int q_kind, out_kind;
    int (*convert)(int src_kind, const void *src, int dst_kind, void *dst, ptrdiff_t n);
} kva_args;

/* Bytes per stored element of a kind. */
static inline int kva_isz(int kind)
{
    return kind == KVA_F32 ? 4 : kind >= KVA_F8E4M3 ? 1 : 2;
}

/* A kva_args, zero but for q, out, the caches and the shape of dense pages
 * of `kind` laid out (block, kv head, position, dim): kind, the three
 * strides, block_size, the head counts and head_dim (for C callers: tests,
 * benchmarks). */
static inline kva_args kva_args_dense(const float *q, float *out, const void *key_cache,
                                      const void *value_cache, int kind, int block_size,
                                      int num_heads, int num_kv_heads, int head_dim)
{
    kva_args a = {0};
    const ptrdiff_t row = (ptrdiff_t)head_dim * kva_isz(kind);
    a.q = q;
    a.out = out;
    a.key_cache = (const char *)key_cache;
    a.value_cache = (const char *)value_cache;
    a.kind = kind;
    a.block_stride = (ptrdiff_t)num_kv_heads * block_size * row;
    a.head_stride = (ptrdiff_t)block_size * row;
    a.row_stride = row;
    a.block_size = block_size;
    a.num_heads = num_heads;
    a.num_kv_heads = num_kv_heads;
    a.head_dim = head_dim;
    return a;
}

/* Run attention; returns KVA_OK, KVA_ENOMEM (nothing written) or KVA_EINVAL.
 * The same as kva_plan_create + kva_plan_run + kva_plan_free. */
int kva_paged_attention(const kva_args *args);

/* Plan once, run many (one plan per step, one run per layer).
 *
 * kva_plan_create: validate-free (the caller already checked every index
 * argument).  Reads from args ONLY the shape/index/scalar fields: kind,
 * block_size, num_heads, num_kv_heads, head_dim, block_tables,
 * block_table_stride, seq_lens, query_start_loc, num_seqs, scale,
 * sliding_window, soft_cap, chunk_size, num_threads.  Copies the index arrays (the
 * caller may change or free its arrays afterwards), builds the work list
 * (the split of the work into items, the thread count) and allocates every
 * work buffer a run needs.  Returns NULL with *status set (KVA_ENOMEM, or
 * KVA_EINVAL for inconsistent shape fields) on failure.
 *
 * kva_plan_run: reads from args ONLY the data fields: q, out, key_cache,
 * value_cache, block_stride, head_stride, row_stride, key_scales,
 * value_scales, k_scale, v_scale, k_head_scales, v_head_scales,
 * alibi_slopes, sinks (the shape fields must equal the planned
 * ones, else KVA_EINVAL; the plan's snapshot of the index arrays is used,
 * never args' pointers).  Allocates nothing.  Same bits as
 * kva_paged_attention(args) for every thread count.  One run at a time per
 * plan (the work buffers belong to the plan); different plans may run
 * concurrently.
 *
 * kva_plan_free: NULL is a no-op. */
typedef struct kva_plan kva_plan;
kva_plan *kva_plan_create(const kva_args *args, int *status);
int kva_plan_run(const kva_plan *plan, const kva_args *args);
void kva_plan_free(kva_plan *plan);
/* Work items and threads of a plan (tests, the benchmark's notes). */
int64_t kva_plan_num_items(const kva_plan *plan);
int kva_plan_num_threads(const kva_plan *plan);

/* Kernel level: the default (the best this CPU supports at or under the
 * KVCORE_SIMD cap, kv_simd.h; amx only when KVCORE_SIMD names it) unless
 * set.  The names are the registry's. */
int kva_best_level(void);    /* the best this CPU supports (no cap) */
int kva_default_level(void); /* the best under the KVCORE_SIMD cap */
/* the best this CPU runs at or under registry level `registry` (kv_simd.h):
 * the one rule by which the attention follows a level named for all */
int kva_level_at_most(int registry);
int kva_level_supported(int level);
int kva_current_level(void);
int kva_set_level(int level);          /* 0, or -1 (unchanged) if unsupported */
const char *kva_level_name(int level); /* "scalar", "avx2", "neon", "avx512", "amx"; NULL if out of range */

/* exp2 of x <= 0 as the SIMD kernels compute it, for the accuracy test
 * (level KVA_AVX2 needs the CPU to support it; returns -1 otherwise). */
int kva_exp2_neg(int level, const float *x, float *y, ptrdiff_t n);
/* b * tanh(a * x), the soft cap, as the kernels compute it. */
int kva_softcap(int level, const float *x, float *y, ptrdiff_t n, float a, float b);

/* Work items a call is split into (for tests and the benchmark's notes). */
int64_t kva_num_items(const kva_args *args);

#ifdef __cplusplus
}
#endif
#endif
