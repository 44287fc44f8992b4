/*
 * kv_attn_threads.c: the worker pool of the attention.  Workers sleep on a
 * condition variable between calls; one job runs at a time (concurrent
 * callers take turns); after fork() the child starts from no workers.
 */
/* pthread_sigmask under a strict -std= */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "kv_attn_internal.h"

#if !defined(_WIN32)
#include <pthread.h>
#include <signal.h>
#define KVA_THREADS 1
#else
#define KVA_THREADS 0
#endif

#if KVA_THREADS
#define KVA_MAX_WORKERS 1023

static pthread_mutex_t pool_call_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done_cv = PTHREAD_COND_INITIALIZER;
static int pool_workers;          /* started */
static unsigned long pool_generation;
static int pool_job_threads;      /* threads in the current job, caller included */
static int pool_pending;          /* workers of the current job still running */
static kva_job_fn pool_fn;
static void *pool_ctx;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_before_fork(void) { pthread_mutex_lock(&pool_call_lock); }
static void pool_after_fork_parent(void) { pthread_mutex_unlock(&pool_call_lock); }
static void pool_after_fork_child(void)
{
    /* The workers do not exist in the child: start again from nothing. */
    pthread_mutex_init(&pool_call_lock, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_work_cv, NULL);
    pthread_cond_init(&pool_done_cv, NULL);
    pool_workers = 0;
    pool_pending = 0;
    pool_job_threads = 0;
}
static void pool_init(void)
{
    pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork_child);
}

/* The generation each worker has seen when it starts (set before it is created). */
static unsigned long pool_start_generation[KVA_MAX_WORKERS + 1];

static void *pool_worker(void *arg)
{
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    unsigned long seen = pool_start_generation[index];
    for (;;) {
        while (pool_generation == seen)
            pthread_cond_wait(&pool_work_cv, &pool_mu);
        seen = pool_generation;
        if (index >= pool_job_threads)
            continue; /* not part of this job */
        kva_job_fn fn = pool_fn;
        void *ctx = pool_ctx;
        pthread_mutex_unlock(&pool_mu);
        fn(ctx, index);
        pthread_mutex_lock(&pool_mu);
        if (--pool_pending == 0)
            pthread_cond_signal(&pool_done_cv);
    }
    return NULL;
}

/* Start workers up to `want` (caller holds pool_call_lock); returns how many exist. */
static int pool_grow(int want)
{
    if (want > KVA_MAX_WORKERS)
        want = KVA_MAX_WORKERS;
    while (pool_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        int index = pool_workers + 1, rc;
        if (pthread_attr_init(&attr) != 0)
            break;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* Workers block every signal: signals go to the application's threads. */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        /* The worker waits for the first generation after this one, so the
         * job published right after it starts cannot be missed. */
        pthread_mutex_lock(&pool_mu);
        pool_start_generation[index] = pool_generation;
        pthread_mutex_unlock(&pool_mu);
        rc = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)index);
        if (rc == 0)
            pool_workers++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
    }
    return pool_workers;
}

void kva_pool_run(kva_job_fn fn, void *ctx, int nthreads)
{
    if (nthreads <= 1) {
        fn(ctx, 0);
        return;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool_call_lock);
    int workers = pool_grow(nthreads - 1);
    if (nthreads - 1 > workers)
        nthreads = workers + 1;
    pthread_mutex_lock(&pool_mu);
    pool_fn = fn;
    pool_ctx = ctx;
    pool_job_threads = nthreads;
    pool_pending = nthreads - 1;
    pool_generation++;
    pthread_cond_broadcast(&pool_work_cv);
    pthread_mutex_unlock(&pool_mu);
    fn(ctx, 0);
    pthread_mutex_lock(&pool_mu);
    while (pool_pending > 0)
        pthread_cond_wait(&pool_done_cv, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_call_lock);
}
#else
void kva_pool_run(kva_job_fn fn, void *ctx, int nthreads)
{
    (void)nthreads;
    fn(ctx, 0);
}
#endif
