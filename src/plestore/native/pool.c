/* A process-wide pthread pool: threads made once (grown to the largest count asked for), woken
 * per job, the caller working beside them (or, between pool_start and pool_finish, doing other
 * work). Pieces are taken in order with an atomic counter, so a slow piece (a page fault
 * waiting on the disk) never holds up the others. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "core.h"

#define POOL_MAX 256

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;
static atomic_int busy;      /* one job at a time (a flag: pool_finish may run on any thread) */
static pool_job *current;    /* the job open for joining, or NULL */
static uint64_t generation;  /* bumped per job: a worker joins each job once */
static int seats;            /* workers still wanted by the current job */
static int running;          /* workers inside the current job */
static int nthreads;
static uint64_t forks; /* bumped in a forked child: a job started before it has no pool there */

int pool_take(pool_job *j, int worker) {
    int64_t a = atomic_fetch_add(&j->next, j->grain);
    if (a >= j->n) return 0;
    int64_t b = a + j->grain < j->n ? a + j->grain : j->n;
    j->work(j->ctx, a, b, worker);
    return 1;
}

static void take(pool_job *j, int worker) {
    while (pool_take(j, worker)) {
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (current == NULL || generation == seen || seats == 0) {
            if (current != NULL) seen = generation; /* full: skip this job */
            pthread_cond_wait(&wake, &mu);
        }
        seen = generation;
        seats--;
        running++;
        pool_job *j = current;
        pthread_mutex_unlock(&mu);
        take(j, id);
        pthread_mutex_lock(&mu);
        if (--running == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void grow(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    while (nthreads < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 << 10);
        int err = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(nthreads + 1));
        pthread_attr_destroy(&attr);
        if (err) break; /* fewer threads: the job still completes (the caller takes the rest) */
        nthreads++;
    }
}

int pool_size(void) { return nthreads; }

static void after_fork_child(void) { /* the child has none of the threads: start afresh */
    pthread_mutex_init(&mu, NULL);
    atomic_store(&busy, 0);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
    current = NULL;
    seats = running = nthreads = 0;
    forks++;
}

__attribute__((constructor)) static void pool_atfork(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
}

int pool_start(pool_job *j, pool_work work, void *ctx, int64_t n, int64_t grain, int threads) {
    if (grain > n) grain = n; /* (no piece end past n: a + grain cannot overflow) */
    if (grain < 1) grain = 1;
    *j = (pool_job){work, ctx, n, grain, 0, 0, forks};
    int64_t pieces = n > 0 ? (n + grain - 1) / grain : 0;
    int helpers = threads - 1;
    if (helpers > pieces - 1) helpers = (int)(pieces - 1);
    if (helpers <= 0 || atomic_exchange(&busy, 1)) /* small, or serving another caller */
        return 0;
    j->pooled = 1;
    pthread_mutex_lock(&mu);
    grow(helpers);
    current = j;
    generation++;
    seats = helpers;
    for (int i = 0; i < helpers; i++) pthread_cond_signal(&wake); /* no more than it needs */
    pthread_mutex_unlock(&mu);
    return helpers;
}

int pool_forked(const pool_job *j) { return j->forks != forks; }

void pool_finish(pool_job *j) {
    if (pool_forked(j)) { /* the pool it held is the parent's: its pieces are the caller's */
        j->pooled = 0;
        return;
    }
    take(j, 0);
    if (!j->pooled) return;
    pthread_mutex_lock(&mu);
    current = NULL; /* no more joining; wait for those inside */
    seats = 0;
    while (running > 0) pthread_cond_wait(&done, &mu);
    pthread_mutex_unlock(&mu);
    j->pooled = 0;
    atomic_store(&busy, 0);
}

void pool_run(pool_work work, void *ctx, int64_t n, int64_t grain, int threads) {
    if (n <= 0) return;
    pool_job j;
    if (!pool_start(&j, work, ctx, n, grain, threads)) {
        work(ctx, 0, n, 0); /* small, or the pool serves another caller: this thread alone */
        return;
    }
    pool_finish(&j);
}
