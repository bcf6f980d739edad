/* Gathers of rows from host memory (pinned DRAM, a file mapping) into staging, on the pool.
 * A random gather is bound by memory latency, not bandwidth: each thread keeps the next rows'
 * loads in flight with software prefetches, and threads add up. From a mapping, a row not in
 * memory is a page fault served while the other threads go on. Staging bound for the GPU
 * is written `streaming` (sink.h). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <stdatomic.h>

#include "core.h"
#include "sink.h"

#define AHEAD 16 /* rows prefetched ahead of the copy (a power of two: the ring below); 16: ~5%
                  * off 8 at 1,024 and 4,096 warm rows (RESULTS.md "host time, part by part") */
_Static_assert((AHEAD & (AHEAD - 1)) == 0, "AHEAD indexes a ring by its low bits");

int gather_can_stream(int64_t out_stride) { return sink_can_stream(out_stride); }

static void gather_piece(void *ctx, int64_t a, int64_t b, int worker) {
    gather_t *g = ctx;
    (void)worker;
    struct rusage r0, r1;
    if (g->count_faults) getrusage(RUSAGE_THREAD, &r0);
    const int64_t rb = g->row_bytes;
    row_sink sink;
    sink_open(&sink, g->out, g->out_stride, g->out_len, g->streaming, a);
    const bounds_t k = {g->layout, g->base, g->src_bytes / g->layout.block, g->src_bytes - rb};
    int64_t ring[AHEAD]; /* the offsets of rows i .. i + AHEAD - 1, worked out at prefetch */
    for (int64_t i = a; i < b && i < a + AHEAD; i++) {
        const int64_t off = ring[i & (AHEAD - 1)] = offset_of(&k, g->ids[i]);
        if (off >= 0) __builtin_prefetch(g->src + off);
    }
    for (int64_t i = a; i < b; i++) {
        const int64_t off = ring[i & (AHEAD - 1)];
        if (i + AHEAD < b) {
            const int64_t ahead = ring[i & (AHEAD - 1)] = offset_of(&k, g->ids[i + AHEAD]);
            if (ahead >= 0) {
                __builtin_prefetch(g->src + ahead);
                __builtin_prefetch(g->src + ahead + rb - 1);
            }
        }
        uint8_t *dst = sink_row(&sink, i);
        if (off >= 0)
            memcpy(dst, g->src + off, (size_t)rb);
        else /* any one of them: the caller raises naming it (read while others write) */
            __atomic_store_n(&g->bad, i, __ATOMIC_RELAXED);
    }
    sink_close(&sink); /* (streamed: in memory before the pool says done) */
    if (g->count_faults) {
        getrusage(RUSAGE_THREAD, &r1);
        __atomic_fetch_add(&g->major, r1.ru_majflt - r0.ru_majflt, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->minor, r1.ru_minflt - r0.ru_minflt, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->inblock, r1.ru_inblock - r0.ru_inblock, __ATOMIC_RELAXED);
    }
    if (g->done) __atomic_store_n(&g->done[a / g->grain], 1, __ATOMIC_RELEASE);
}

void gather_run(gather_t *g, int threads, int64_t grain) {
    g->bad = -1;
    g->major = g->minor = g->inblock = 0;
    pool_run(gather_piece, g, g->count, grain, threads);
}

int gather_begin(gather_job *j, int threads, int64_t grain) {
    gather_t *g = &j->g;
    g->bad = -1;
    g->major = g->minor = g->inblock = 0;
    g->grain = grain < 1 ? 1 : grain > g->count ? (g->count > 0 ? g->count : 1) : grain;
    g->done = calloc((size_t)(g->count / g->grain + 1), 1);
    if (!g->done) return -1;
    j->cursor = 0;
    pool_start(&j->job, gather_piece, g, g->count, g->grain, threads);
    return 0;
}

/* in a child forked since gather_begin: the pieces [cursor, need) not seen done, in the caller
 * (a piece the parent's threads had begun is written again: the same bytes) */
static void run_undone(gather_job *j, int64_t need) {
    const int64_t grain = j->g.grain;
    for (; j->cursor < need; j->cursor++) {
        if (__atomic_load_n(&j->g.done[j->cursor], __ATOMIC_ACQUIRE)) continue;
        const int64_t a = j->cursor * grain, b = a + grain < j->g.count ? a + grain : j->g.count;
        gather_piece(&j->g, a, b, 0);
    }
}

void gather_wait(gather_job *j, int64_t rows) {
    const int64_t grain = j->g.grain;
    if (rows > j->g.count) rows = j->g.count;
    const int64_t need = (rows + grain - 1) / grain; /* the pieces holding rows [0, rows) */
    for (unsigned spins = 0; j->cursor < need;) {
        if (pool_forked(&j->job)) {
            run_undone(j, need);
        } else if (__atomic_load_n(&j->g.done[j->cursor], __ATOMIC_ACQUIRE)) {
            j->cursor++, spins = 0;
        } else if (atomic_load(&j->job.next) < need * grain) { /* one of them untaken: run it */
            pool_take(&j->job, 0);
        } else if (++spins < 4096) { /* pool threads have them */
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield(); /* (a piece waiting on the disk: a page fault) */
        }
    }
}

void gather_end(gather_job *j) {
    if (pool_forked(&j->job)) run_undone(j, (j->g.count + j->g.grain - 1) / j->g.grain);
    pool_finish(&j->job);
    free(j->g.done);
    j->g.done = NULL;
}
