/* Gathers of rows from host memory (pinned DRAM, a file mapping) into staging, on the pool.
 * A random gather is bound by memory latency, not bandwidth: each thread keeps the next rows'
 * loads in flight with software prefetches, and threads add up. From a mapping, a row not in
 * memory is a page fault served while the other threads go on. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/resource.h>
#include <stdatomic.h>

#include "core.h"

#define AHEAD 8 /* rows prefetched ahead of the copy */

static void gather_piece(void *ctx, int64_t a, int64_t b, int worker) {
    gather_t *g = ctx;
    (void)worker;
    struct rusage r0, r1;
    if (g->count_faults) getrusage(RUSAGE_THREAD, &r0);
    const int64_t rb = g->row_bytes, limit = g->src_bytes - rb;
    for (int64_t i = a; i < b && i < a + AHEAD; i++) {
        int64_t off = layout_offset(&g->layout, g->ids[i] - g->base);
        if (off >= 0 && off <= limit) __builtin_prefetch(g->src + off);
    }
    for (int64_t i = a; i < b; i++) {
        if (i + AHEAD < b) {
            int64_t ahead = layout_offset(&g->layout, g->ids[i + AHEAD] - g->base);
            if (ahead >= 0 && ahead <= limit) {
                __builtin_prefetch(g->src + ahead);
                __builtin_prefetch(g->src + ahead + rb - 1);
            }
        }
        int64_t off = layout_offset(&g->layout, g->ids[i] - g->base);
        if (off < 0 || off > limit) {
            g->bad = i; /* any one of them: the caller raises naming it */
            continue;
        }
        memcpy(g->out + i * g->out_stride, g->src + off, (size_t)rb);
    }
    if (g->count_faults) {
        getrusage(RUSAGE_THREAD, &r1);
        __atomic_fetch_add(&g->major, r1.ru_majflt - r0.ru_majflt, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->minor, r1.ru_minflt - r0.ru_minflt, __ATOMIC_RELAXED);
    }
}

void gather_run(gather_t *g, int threads, int64_t grain) {
    g->bad = -1;
    g->major = g->minor = 0;
    pool_run(gather_piece, g, g->count, grain, threads);
}
