/*
 * kv_attn_schedule.c: how a call is split into work items (sequence x kv
 * head x query tile x key split), how many threads it is worth, each
 * thread's workspace, and the merge of the partials of split items.
 *
 * How a call is split depends only on its arguments, never on the thread
 * count, and every item is computed and merged in a fixed order, so the
 * result has the same bits for any number of threads.
 */
#include "kv_attn_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int64_t kva_tokens_per_item(const kva_args *a, int64_t s)
{
    /* the keys one query can see: a window or chunk bounds them (the rows
     * of an item walk the keys of all its queries, and mask the rest) */
    int64_t keys = a->seq_lens[s];
    if (a->sliding_window > 0 && a->sliding_window < keys)
        keys = a->sliding_window;
    if (a->chunk_size > 0 && a->chunk_size < keys)
        keys = a->chunk_size;
    const int64_t g = kva_group_size(a);
    const int64_t rows = keys >= KVA_LONG_KEYS  ? KVA_ROWS_LONG
                         : keys >= KVA_MID_KEYS ? KVA_ROWS_MID
                                                : KVA_ROWS;
    return g >= rows ? 1 : rows / g;
}

int64_t kva_most_tokens_per_item(const kva_args *a)
{
    int64_t most = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t nq = kva_seq_queries(a, s);
        if (nq > 0) {
            const int64_t t = kva_tokens_per_item(a, s);
            if (t > most)
                most = t;
        }
    }
    return most > 0 ? most : 1;
}

/* Key range of query tokens [q0, q1) of sequence s: [*lo, *hi) (the
 * first query's first key: kva_key_lo never decreases with the position). */
static void key_range(const kva_args *a, int64_t s, int64_t q0, int64_t q1, int64_t *lo,
                      int64_t *hi)
{
    int64_t nq = kva_seq_queries(a, s), len = a->seq_lens[s];
    int64_t first = len - nq + q0, last = len - nq + q1 - 1;
    *hi = last + 1;
    *lo = kva_key_lo(a, first);
}

int64_t kva_make_items(const kva_args *a, kva_item *items, int64_t *num_groups,
                       int64_t *num_slots, int64_t *split_rows)
{
    int64_t n = 0, groups = 0, slots = 0, rows = 0;
    const int64_t G = kva_group_size(a);
    for (int64_t s = 0; s < a->num_seqs; s++) {
        int64_t nq = kva_seq_queries(a, s);
        if (nq <= 0)
            continue;
        const int64_t tq = kva_tokens_per_item(a, s);
        int64_t ntiles = (nq + tq - 1) / tq;
        for (int64_t t = 0; t < ntiles; t++) {
            int64_t q0 = t * tq, q1 = q0 + tq < nq ? q0 + tq : nq, lo, hi;
            key_range(a, s, q0, q1, &lo, &hi);
            int64_t nsplit = 1;
            if (ntiles == 1 && hi - lo > KVA_SPLIT_KEYS)
                nsplit = (hi - lo + KVA_SPLIT_KEYS - 1) / KVA_SPLIT_KEYS;
            /* split-major: the KV heads of one key split run one after
             * another, so the heads' rows of each block (side by side in
             * the block) are read together, not one head's pass over the
             * whole sequence after another's (a pass over a long sequence
             * left nothing of the block in the caches for the next head:
             * one float16 sequence of 65536 positions at 32/8 d128 read its
             * pages at 0.5-0.6 of the stream, 8 x 16384 at 0.8-0.9).
             * Group g's partials: slots [slots + g * nsplit, + nsplit). */
            for (int64_t sp = 0; sp < nsplit; sp++) {
                for (int g = 0; g < a->num_kv_heads; g++) {
                    if (items) {
                        kva_item *it = &items[n];
                        it->seq = s;
                        it->q0 = q0;
                        it->q1 = q1;
                        it->k0 = lo + sp * KVA_SPLIT_KEYS;
                        it->k1 = nsplit == 1 || sp == nsplit - 1 ? hi : it->k0 + KVA_SPLIT_KEYS;
                        it->cost = (q1 - q0) * G * (it->k1 - it->k0);
                        it->group = nsplit > 1 ? groups + g : -1;
                        it->slot = nsplit > 1 ? slots + g * nsplit + sp : -1;
                        it->order = n;
                        it->kv_head = g;
                        it->split = (int32_t)sp;
                        it->nsplit = (int32_t)nsplit;
                    }
                    n++;
                }
            }
            if (nsplit > 1) {
                groups += a->num_kv_heads;
                slots += (int64_t)a->num_kv_heads * nsplit;
                if ((q1 - q0) * G > rows)
                    rows = (q1 - q0) * G;
            }
        }
    }
    if (num_groups)
        *num_groups = groups;
    if (num_slots)
        *num_slots = slots;
    if (split_rows)
        *split_rows = rows;
    return n;
}

int64_t kva_num_items(const kva_args *a) { return kva_make_items(a, NULL, NULL, NULL, NULL); }

size_t kva_workspace_layout(int max_rows, int D, char *base, kva_ws *ws)
{
    size_t off = 0;
    /* S and acc to whole tiles of 16 rows (the AMX tiles store them whole) */
    const size_t rows16 = ((size_t)max_rows + 15) & ~(size_t)15;
#define KVA_TAKE(field, type, count)                                  \
    do {                                                              \
        if (ws)                                                       \
            ws->field = (type *)(base + off);                         \
        off += kva_align64((size_t)(count) * sizeof(type));               \
    } while (0)
    KVA_TAKE(Qs, float, (size_t)max_rows * D);
    KVA_TAKE(S, float, rows16 * KVA_KEY_TILE);
    KVA_TAKE(acc, float, rows16 * D);
    KVA_TAKE(m, float, max_rows);
    KVA_TAKE(l, float, max_rows);
    KVA_TAKE(alpha, float, max_rows);
    KVA_TAKE(tmp, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(qt, uint16_t, 3 * rows16 * D);
    KVA_TAKE(lo, int64_t, max_rows);
    KVA_TAKE(hi, int64_t, max_rows);
    KVA_TAKE(first, int, max_rows);
    KVA_TAKE(last, int, max_rows);
    KVA_TAKE(krow, const char *, KVA_KEY_TILE);
    KVA_TAKE(vrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(nkrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(nvrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(kf, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(vf, float, (size_t)KVA_KEY_TILE * D);
    KVA_TAKE(kfrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(vfrow, const char *, KVA_KEY_TILE);
    KVA_TAKE(sum, float, max_rows);
#undef KVA_TAKE
    return off;
}

/* The partial (max, sum, acc) triples of the splits, in split order,
 * summed in double (scratch: D doubles): a float32 sum of a long
 * sequence's many splits (one per KVA_SPLIT_KEYS positions) loses about
 * one rounding per split, 3e-5 relative over 4096 of them.  (scratch:
 * D doubles and D floats.) */
void kva_merge_group(const kva_job *job, const kva_item *it, int M, double *scratch)
{
    const kva_args *a = job->a;
    const int D = a->head_dim, G = (int)kva_group_size(a);
    const int64_t nsplit = it->nsplit;
    const int64_t base = it->slot - it->split;
    const int64_t row0 = a->query_start_loc[it->seq] + it->q0;
    for (int r = 0; r < M; r++) {
        float mx = -INFINITY;
        double total = 0.0;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *p = job->partials + (size_t)(base + sp) * job->partial_floats;
            if (p[r] > mx)
                mx = p[r];
        }
        const int64_t h = r % G;
        const size_t at = kva_row_at(a, row0, it->kv_head, r);
        /* (a 16-bit out: the row after the sums in scratch, then narrowed) */
        float *o = a->out_kind == KVA_F32 ? a->out + at : (float *)(void *)(scratch + D);
        for (int d = 0; d < D; d++)
            scratch[d] = 0.0;
        for (int64_t sp = 0; sp < nsplit; sp++) {
            const float *p = job->partials + (size_t)(base + sp) * job->partial_floats;
            const float m = p[r], l = p[job->split_rows + r];
            if (m == -INFINITY && l == 0.0f)
                continue; /* no key of this split weighs anything for this row */
            /* (a NaN sum is kept: a NaN score's key, alone in its split,
             * leaves the split's maximum at -inf but its sum NaN, and the
             * row's output is NaN, as the reference's) */
            const double w = kva_flush_tiny(job->wide ? exp2f((m - mx) * job->wide_scale)
                                                      : exp2f(m - mx));
            const float *acc = p + 2 * (size_t)job->split_rows + (size_t)r * D;
            total += w * l; /* (a float times a float: exact in double) */
            for (int d = 0; d < D; d++)
                scratch[d] += w * acc[d];
        }
        if (a->sinks != NULL) {
            for (int d = 0; d < D; d++)
                o[d] = (float)scratch[d];
            kva_finish_sink(job, o, o, D, (float)total, mx,
                            kva_logit_units(job, a->sinks[(size_t)it->kv_head * G + h]));
        } else {
            for (int d = 0; d < D; d++)
                o[d] = (float)(scratch[d] / total);
        }
        kva_put_row(a, at, o);
    }
}

/* Costliest first (this is only the schedule: each item's result, and
 * every merge, is the same in any order); ties in the natural order. */
static int by_cost(const void *x, const void *y)
{
    const kva_item *a = (const kva_item *)x, *b = (const kva_item *)y;
    if (a->cost != b->cost)
        return a->cost < b->cost ? 1 : -1;
    return a->order < b->order ? -1 : a->order > b->order;
}

void kva_schedule(kva_item *items, int64_t n)
{
    qsort(items, (size_t)n, sizeof(kva_item), by_cost);
}

/* Waking a worker costs microseconds: a call too small to repay it (a short
 * decode) runs on fewer threads.  The bits do not depend on the count. */
int kva_thread_count(const kva_item *items, int64_t n, int head_dim, int want)
{
    if (want > n)
        want = (int)n;
    if (want <= 1)
        return 1;
    int64_t work = 0;
    for (int64_t i = 0; i < n; i++)
        work += items[i].cost;
    work *= head_dim;
    if (work / KVA_WORK_PER_THREAD < want)
        want = work / KVA_WORK_PER_THREAD > 1 ? (int)(work / KVA_WORK_PER_THREAD) : 1;
    return want;
}
