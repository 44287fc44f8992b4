/*
 * kv_attention.c: the public entry of the attention kernel (see
 * kv_attention.h for the contract and kv_attn_internal.h for how the
 * kernel is split into files): the argument check, the kernel levels, the
 * plan (create once per step: snapshot of the index arrays, work list,
 * thread count, every buffer; run per layer: no allocation), and
 * kva_paged_attention = create + run + free.
 */
/* posix_memalign under a strict -std= */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "kv_attn_internal.h"
#include "kv_simd.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Levels                                                              */
/* ------------------------------------------------------------------ */

/* The attention's levels are levels of the registry (kv_simd.h): names,
 * detection and the KVCORE_SIMD cap come from there.  The registry level
 * each attention level is: */
static const int registry_level[KVA_NUM_LEVELS] = {KVS_SCALAR, KVS_AVX2, KVS_NEON, KVS_AVX512,
                                                   KVS_AMX};
static int current_level = -1; /* -1: not chosen yet (the default is taken) */

int kva_level_supported(int level)
{
    if (level < 0 || level >= KVA_NUM_LEVELS)
        return 0;
    /* the kernels of a level exist only where they were compiled */
    if ((level == KVA_AVX2 && !KVA_HAVE_AVX2) || (level == KVA_NEON && !KVA_HAVE_NEON) ||
        (level == KVA_AVX512 && !KVA_HAVE_AVX512) || (level == KVA_AMX && !KVA_HAVE_AMX))
        return 0;
    return kvs_level_supported(registry_level[level]);
}

int kva_best_level(void)
{
    int best = KVA_SCALAR;
    for (int l = 1; l < KVA_NUM_LEVELS; l++)
        if (kva_level_supported(l))
            best = l;
    return best;
}

int kva_level_at_most(int registry)
{
    /* a registry level without attention kernels (f16c) runs the next
     * lower attention level the CPU has (scalar) */
    int best = KVA_SCALAR;
    for (int l = 1; l < KVA_NUM_LEVELS; l++)
        if (kva_level_supported(l) && registry_level[l] <= registry)
            best = l;
    return best;
}

int kva_default_level(void) { return kva_level_at_most(kvs_default_level()); }

int kva_current_level(void)
{
    int l = __atomic_load_n(&current_level, __ATOMIC_RELAXED);
    return l < 0 ? kva_default_level() : l;
}

int kva_set_level(int level)
{
    if (!kva_level_supported(level))
        return -1;
    __atomic_store_n(&current_level, level, __ATOMIC_RELAXED);
    return 0;
}

const char *kva_level_name(int level)
{
    return level >= 0 && level < KVA_NUM_LEVELS ? kvs_level_name(registry_level[level]) : NULL;
}

static const kva_math *math_for(int level)
{
#if KVA_HAVE_AVX512
    /* the amx level's math is the avx512 level's */
    if (level == KVA_AVX512 || level == KVA_AMX)
        return &kva_math_avx512;
#endif
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return &kva_math_avx2;
#endif
#if KVA_HAVE_NEON
    if (level == KVA_NEON)
        return &kva_math_neon;
#endif
    return &kva_math_scalar;
}

static const kva_kernels *kernels_for(int level, int kind)
{
#if KVA_HAVE_AVX512
    /* the amx level: the AVX-512 kernels for all but its tiles */
    if (level == KVA_AVX512 || level == KVA_AMX)
        return &kva_kernels_avx512[kind];
#endif
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return &kva_kernels_avx2[kind];
#endif
#if KVA_HAVE_NEON
    /* kinds without NEON kernels run the scalar ones */
    if (level == KVA_NEON && kind < KVA_NUM_NEON_KINDS)
        return &kva_kernels_neon[kind];
#endif
    return &kva_kernels_scalar[kind];
}

int kva_exp2_neg(int level, const float *x, float *y, ptrdiff_t n)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    math_for(level)->exp2_neg(x, y, n);
    return 0;
}

int kva_softcap(int level, const float *x, float *y, ptrdiff_t n, float a, float b)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    if (y != x)
        memcpy(y, x, (size_t)n * sizeof(float));
    math_for(level)->softcap(y, n, a, b);
    return 0;
}

/* ------------------------------------------------------------------ */
/* The plan                                                            */
/* ------------------------------------------------------------------ */

struct kva_plan {
    /* The planned shape/index/scalar fields; the index pointers point at
     * the snapshots below, the data fields are unset. */
    kva_args shape;
    kva_item *items; /* in schedule order */
    int64_t num_items, num_groups;
    int num_threads, max_rows, split_rows;
    size_t workspace_bytes, partial_floats;
    int *group_done; /* one counter per merge group, reset by every run */
    float *partials;
    char *workspace; /* num_threads workspaces */
};

static int shape_ok(const kva_args *a)
{
    return a->num_heads > 0 && a->num_kv_heads > 0 && a->num_heads % a->num_kv_heads == 0 &&
           a->head_dim > 0 && a->block_size > 0 && a->kind >= 0 && a->kind <= KVA_I8 &&
           a->num_seqs >= 0;
}

/* Blocks of sequence s the items can read (none without queries). */
static int64_t blocks_read(const kva_args *a, int64_t s)
{
    if (kva_seq_queries(a, s) <= 0)
        return 0;
    return (a->seq_lens[s] + a->block_size - 1) / a->block_size;
}

/* q's and out's kinds: float32, or float16 / bfloat16 with a conversion. */
static int io_kinds_ok(const kva_args *a)
{
    const int q16 = a->q_kind == KVA_F16 || a->q_kind == KVA_BF16;
    const int out16 = a->out_kind == KVA_F16 || a->out_kind == KVA_BF16;
    return (q16 || a->q_kind == KVA_F32) && (out16 || a->out_kind == KVA_F32) &&
           (a->convert != NULL || !(q16 || out16));
}

kva_plan *kva_plan_create(const kva_args *args, int *status)
{
    int dummy;
    if (status == NULL)
        status = &dummy;
    if (!shape_ok(args)) {
        *status = KVA_EINVAL;
        return NULL;
    }
    const int64_t S = args->num_seqs;
    /* the snapshot of the block table keeps only the entries a run reads,
     * as rows of the widest sequence's count */
    int64_t width = 0;
    for (int64_t s = 0; s < S; s++)
        if (blocks_read(args, s) > width)
            width = blocks_read(args, s);
    int64_t ngroups = 0, nslots = 0, split_rows = 0;
    const int64_t n = kva_make_items(args, NULL, &ngroups, &nslots, &split_rows);
    const int64_t G = kva_group_size(args);
    const int max_rows = (int)(kva_most_tokens_per_item(args) * G);
    const int D = args->head_dim;
    int want = args->num_threads < 1 ? 1 : args->num_threads;
    if (want > n)
        want = n > 0 ? (int)n : 1;

    /* One allocation: the plan, the snapshots, items, merge counters,
     * partial slots, workspaces (a thread count is only known once the
     * items are, so the workspaces are sized for `want`). */
    const size_t workspace_bytes = kva_workspace_layout(max_rows, D, NULL, NULL);
    const size_t partial_floats =
        kva_align64(((size_t)2 * split_rows + (size_t)split_rows * D) * 4) / 4;
    size_t off = 0;
    const size_t at_plan = off;
    off += kva_align64(sizeof(kva_plan));
    const size_t at_lens = off;
    off += kva_align64((size_t)S * sizeof(int64_t));
    const size_t at_starts = off;
    off += kva_align64((size_t)(S + 1) * sizeof(int64_t));
    const size_t at_table = off;
    off += kva_align64((size_t)S * (size_t)width * sizeof(int32_t));
    const size_t at_items = off;
    off += kva_align64((size_t)n * sizeof(kva_item));
    const size_t at_counters = off;
    off += kva_align64((size_t)ngroups * sizeof(int));
    const size_t at_partials = off;
    off += (size_t)nslots * partial_floats * sizeof(float);
    const size_t at_workspace = off;
    off += n > 0 ? (size_t)want * workspace_bytes : 0;
    char *mem = NULL;
    if (posix_memalign((void **)&mem, 64, off) != 0) {
        *status = KVA_ENOMEM;
        return NULL;
    }
    kva_plan *p = (kva_plan *)(mem + at_plan);
    memset(p, 0, sizeof *p);
    int64_t *lens = (int64_t *)(mem + at_lens);
    int64_t *starts = (int64_t *)(mem + at_starts);
    int32_t *table = (int32_t *)(mem + at_table);
    if (S > 0)
        memcpy(lens, args->seq_lens, (size_t)S * sizeof(int64_t));
    memcpy(starts, args->query_start_loc, (size_t)(S + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < S; s++) {
        const int64_t nb = blocks_read(args, s);
        if (nb > 0)
            memcpy(table + s * width, args->block_tables + s * args->block_table_stride,
                   (size_t)nb * sizeof(int32_t));
    }
    p->shape.kind = args->kind;
    p->shape.block_size = args->block_size;
    p->shape.num_heads = args->num_heads;
    p->shape.num_kv_heads = args->num_kv_heads;
    p->shape.head_dim = args->head_dim;
    p->shape.block_tables = table;
    p->shape.block_table_stride = (ptrdiff_t)width;
    p->shape.seq_lens = lens;
    p->shape.query_start_loc = starts;
    p->shape.num_seqs = S;
    p->shape.scale = args->scale;
    p->shape.sliding_window = args->sliding_window;
    p->shape.soft_cap = args->soft_cap;
    p->shape.chunk_size = args->chunk_size;
    p->shape.num_threads = want;
    p->items = (kva_item *)(mem + at_items);
    p->num_items = n;
    p->num_groups = ngroups;
    p->max_rows = max_rows;
    p->split_rows = (int)split_rows;
    p->workspace_bytes = workspace_bytes;
    p->partial_floats = partial_floats;
    p->group_done = (int *)(mem + at_counters);
    p->partials = (float *)(mem + at_partials);
    p->workspace = mem + at_workspace;
    kva_make_items(&p->shape, p->items, NULL, NULL, NULL);
    p->num_threads = kva_thread_count(p->items, n, D, want);
    if (p->num_threads > 1)
        kva_schedule(p->items, n);
    *status = KVA_OK;
    return p;
}

int kva_plan_run(const kva_plan *p, const kva_args *args)
{
    const kva_args *s = &p->shape;
    if (args->kind != s->kind || args->block_size != s->block_size ||
        args->num_heads != s->num_heads || args->num_kv_heads != s->num_kv_heads ||
        args->head_dim != s->head_dim ||
        (args->kind == KVA_I8) != (args->key_scales != NULL && args->value_scales != NULL) ||
        !io_kinds_ok(args))
        return KVA_EINVAL;
    if (p->num_items == 0)
        return KVA_OK;
    /* the planned shape, this run's data */
    kva_args a = *s;
    a.q = args->q;
    a.out = args->out;
    a.key_cache = args->key_cache;
    a.value_cache = args->value_cache;
    a.block_stride = args->block_stride;
    a.head_stride = args->head_stride;
    a.row_stride = args->row_stride;
    a.key_scales = args->key_scales;
    a.value_scales = args->value_scales;
    a.k_scale = args->k_scale;
    a.v_scale = args->v_scale;
    a.k_head_scales = args->k_head_scales;
    a.v_head_scales = args->v_head_scales;
    a.alibi_slopes = args->alibi_slopes;
    a.sinks = args->sinks;
    a.q_kind = args->q_kind;
    a.out_kind = args->out_kind;
    a.convert = args->convert;
    int level = kva_current_level();
    /* the AVX2 (NEON) kernels work on whole vectors of 8 (4) dims; the
     * AVX-512 ones on vectors of 16 and one of 8 */
    if (a.head_dim % 8)
        level = KVA_SCALAR;
    kva_job job;
    memset(&job, 0, sizeof job);
    job.a = &a;
    kva_score_units(&a, &job);
    job.kern = kernels_for(level, a.kind);
    job.kern_f32 = kernels_for(level, KVA_F32);
#if KVA_HAVE_AMX
    /* the tiles take 32 dims (64 bytes of bf16) per step */
    if (level == KVA_AMX && a.head_dim % 32 == 0 && a.head_dim <= KVA_AMX_MAX_D &&
        kva_kernels_amx[a.kind].scores != NULL)
        job.kern_tiles = &kva_kernels_amx[a.kind];
#endif
    job.math = math_for(level);
    job.items = p->items;
    job.num_items = p->num_items;
    job.threads = p->num_threads;
    job.group_done = p->group_done;
    job.partials = p->partials;
    job.partial_floats = p->partial_floats;
    job.workspace = p->workspace;
    job.workspace_bytes = p->workspace_bytes;
    job.max_rows = p->max_rows;
    job.split_rows = p->split_rows;
    memset(p->group_done, 0, (size_t)p->num_groups * sizeof(int));
    kva_pool_run(kva_job_thread, &job, p->num_threads);
    return KVA_OK;
}

void kva_plan_free(kva_plan *plan)
{
    free(plan); /* the plan heads its one allocation */
}

int64_t kva_plan_num_items(const kva_plan *plan) { return plan->num_items; }
int kva_plan_num_threads(const kva_plan *plan) { return plan->num_threads; }

int kva_paged_attention(const kva_args *a)
{
    int status;
    if (!shape_ok(a) ||
        (a->kind == KVA_I8) != (a->key_scales != NULL && a->value_scales != NULL))
        return KVA_EINVAL;
    kva_plan *plan = kva_plan_create(a, &status);
    if (plan == NULL)
        return status;
    status = kva_plan_run(plan, a);
    kva_plan_free(plan);
    return status;
}
