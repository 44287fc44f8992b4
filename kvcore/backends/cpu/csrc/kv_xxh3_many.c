/* kv_copy_xxh3_many (kv_xxh3.h): every source of a restore copied into the
 * pool's storage and hashed, split over short-lived threads.  A restore is
 * rare and large (MiBs per source), so starting threads per call costs
 * little beside it; small batches stay on the calling thread. */
#include "kv_xxh3.h"

#if !defined(_WIN32)
#include <pthread.h>
#define KV_XXH3_THREADS 1
#else
#define KV_XXH3_THREADS 0
#endif

/* from this many bytes a batch is copied with non-temporal stores: far
 * beyond the caches, a plain store reads each destination line first */
#define STREAM_BYTES (32u << 20)
/* below this many bytes a thread is not worth starting */
#define BYTES_PER_THREAD (1u << 20)
#define MAX_THREADS 64

typedef struct {
    const unsigned char* const* srcs;
    const kv_copy_part* parts;
    size_t n_parts;
    const uint64_t* seeds;
    uint64_t* digests;
    size_t lo, hi;
    int level, stream;
} run;

static void do_run(const run* r) {
    for (size_t j = r->lo; j < r->hi; j++) {
        kv_xxh3_state st;
        const unsigned char* src = r->srcs[j];
        kv_xxh3_init(&st, r->seeds[j], r->level);
        kv_xxh3_set_stream(&st, r->stream);
        for (size_t k = 0; k < r->n_parts; k++) {
            const kv_copy_part* p = &r->parts[k];
            if (p->n_chunks && p->chunk_bytes) {
                kv_copy_xxh3(&st, src, p->dst + p->dst_offsets[j], p->n_chunks, p->chunk_bytes,
                             p->dst_stride);
                src += p->n_chunks * p->chunk_bytes;
            }
        }
        r->digests[j] = kv_xxh3_digest(&st);
    }
    if (r->stream)
        kv_xxh3_stream_fence();
}

#if KV_XXH3_THREADS
static void* thread_main(void* arg) {
    do_run((const run*)arg);
    return NULL;
}
#endif

void kv_copy_xxh3_many(const unsigned char* const* srcs, size_t n_srcs,
                      const kv_copy_part* parts, size_t n_parts, const uint64_t* seeds,
                      uint64_t* digests, int level, int n_threads) {
    size_t bytes = 0;
    /* resolved here, once: the threads then never race on the first read
     * of KVCORE_SIMD */
    level = kv_xxh3_level(level);
    for (size_t k = 0; k < n_parts; k++)
        bytes += parts[k].n_chunks * parts[k].chunk_bytes;
    size_t total = bytes * n_srcs, t = n_threads > 0 ? (size_t)n_threads : 1;
    if (t > MAX_THREADS)
        t = MAX_THREADS;
    if (t > n_srcs)
        t = n_srcs;
    if (t > total / BYTES_PER_THREAD)
        t = total / BYTES_PER_THREAD;
    if (t < 1 || !KV_XXH3_THREADS)
        t = 1;
    run runs[MAX_THREADS];
    for (size_t i = 0; i < t; i++) {
        run r = {srcs, parts, n_parts, seeds, digests, n_srcs * i / t, n_srcs * (i + 1) / t,
                 level, total >= STREAM_BYTES};
        runs[i] = r;
    }
#if KV_XXH3_THREADS
    pthread_t tid[MAX_THREADS];
    size_t started = 1;
    while (started < t && pthread_create(&tid[started], NULL, thread_main, &runs[started]) == 0)
        started++;
    do_run(&runs[0]);
    /* the runs no thread could be started for: on this one (the same bits) */
    for (size_t i = started; i < t; i++)
        do_run(&runs[i]);
    for (size_t i = 1; i < started; i++)
        pthread_join(tid[i], NULL);
#else
    do_run(&runs[0]);
#endif
}
