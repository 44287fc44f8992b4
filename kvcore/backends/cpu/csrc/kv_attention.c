/*
 * kv_attention.c: the public entry of the attention kernel (see
 * kv_attention.h for the contract and kv_attn_internal.h for how the
 * kernel is split into files): the argument check, the kernel levels, and
 * kva_paged_attention.
 */
/* posix_memalign under a strict -std= */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "kv_attn_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Levels                                                              */
/* ------------------------------------------------------------------ */

static const char *const level_names[KVA_NUM_LEVELS] = {"scalar", "avx2", "neon"};
static int current_level = -1; /* -1: not chosen yet (the best is taken) */

int kva_level_supported(int level)
{
    if (level == KVA_SCALAR)
        return 1;
#if KVA_HAVE_AVX2
    if (level == KVA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#endif
#if KVA_HAVE_NEON
    if (level == KVA_NEON)
        return 1;
#endif
    return 0;
}

int kva_best_level(void)
{
    static int best = -1;
    if (best < 0) {
        int b = KVA_SCALAR;
        for (int l = 1; l < KVA_NUM_LEVELS; l++)
            if (kva_level_supported(l))
                b = l;
        best = b;
    }
    return best;
}

int kva_current_level(void)
{
    int l = __atomic_load_n(&current_level, __ATOMIC_RELAXED);
    return l < 0 ? kva_best_level() : l;
}

int kva_set_level(int level)
{
    if (level < 0 || level >= KVA_NUM_LEVELS || !kva_level_supported(level))
        return -1;
    __atomic_store_n(&current_level, level, __ATOMIC_RELAXED);
    return 0;
}

const char *kva_level_name(int level)
{
    return level >= 0 && level < KVA_NUM_LEVELS ? level_names[level] : NULL;
}

static const kva_math *math_for(int level)
{
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


int kva_paged_attention(const kva_args *a)
{
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads ||
        a->head_dim <= 0 || a->block_size <= 0 || a->kind < 0 || a->kind > KVA_I8 ||
        (a->kind == KVA_I8) != (a->key_scales != NULL && a->value_scales != NULL))
        return KVA_EINVAL;
    int level = kva_current_level();
    /* the AVX2 (NEON) kernels work on whole vectors of 8 (4) dims */
    if (a->head_dim % 8)
        level = KVA_SCALAR;
    int64_t ngroups = 0, nslots = 0, split_rows = 0;
    int64_t n = kva_make_items(a, NULL, &ngroups, &nslots, &split_rows);
    if (n == 0)
        return KVA_OK;
    kva_job job;
    memset(&job, 0, sizeof job);
    job.a = a;
    job.kern = kernels_for(level, a->kind);
    job.kern_f32 = kernels_for(level, KVA_F32);
    job.math = math_for(level);
    job.num_items = n;
    job.tokens_per_tile = (int)kva_tokens_per_tile(a);
    job.max_rows = (int)(job.tokens_per_tile * kva_group_size(a));
    job.split_rows = (int)split_rows;
    int nthreads = a->num_threads < 1 ? 1 : a->num_threads;
    if (nthreads > n)
        nthreads = (int)n;

    /* One allocation: items, merge counters, partial slots, workspaces. */
    const int D = a->head_dim;
    job.workspace_bytes = kva_workspace_layout(job.max_rows, D, NULL, NULL);
    job.partial_floats =
        kva_align64(((size_t)2 * job.split_rows + (size_t)job.split_rows * D) * 4) / 4;
    size_t items_bytes = kva_align64((size_t)n * sizeof(kva_item));
    size_t counters_bytes = kva_align64((size_t)ngroups * sizeof(int));
    size_t partial_bytes = (size_t)nslots * job.partial_floats * sizeof(float);
    size_t total = items_bytes + counters_bytes + partial_bytes +
                   (size_t)nthreads * job.workspace_bytes;
    char *mem = NULL;
    if (posix_memalign((void **)&mem, 64, total) != 0)
        return KVA_ENOMEM;
    kva_item *items = (kva_item *)mem;
    job.items = items;
    job.group_done = (int *)(mem + items_bytes);
    job.partials = (float *)(mem + items_bytes + counters_bytes);
    job.workspace = mem + items_bytes + counters_bytes + partial_bytes;
    kva_make_items(a, items, NULL, NULL, NULL);
    memset(job.group_done, 0, counters_bytes);
    nthreads = kva_thread_count(items, n, D, nthreads);
    if (nthreads > 1)
        kva_schedule(items, n);
    kva_pool_run(kva_job_thread, &job, nthreads);
    free(mem);
    return KVA_OK;
}
