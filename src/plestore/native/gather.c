/* Gathers of rows from host memory (pinned DRAM, a file mapping) into staging, on the pool.
 * A random gather is bound by memory latency, not bandwidth: each thread keeps the next rows'
 * loads in flight with software prefetches, and threads add up. From a mapping, a row not in
 * memory is a page fault served while the other threads go on. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/resource.h>
#include <stdatomic.h>

#include "core.h"

#define AHEAD 8 /* rows prefetched ahead of the copy (a power of two: the ring below) */
_Static_assert((AHEAD & (AHEAD - 1)) == 0, "AHEAD indexes a ring by its low bits");

static void gather_piece(void *ctx, int64_t a, int64_t b, int worker) {
    gather_t *g = ctx;
    (void)worker;
    struct rusage r0, r1;
    if (g->count_faults) getrusage(RUSAGE_THREAD, &r0);
    const int64_t rb = g->row_bytes;
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
        if (off < 0) {
            g->bad = i; /* any one of them: the caller raises naming it */
            continue;
        }
        memcpy(g->out + i * g->out_stride, g->src + off, (size_t)rb);
    }
    if (g->count_faults) {
        getrusage(RUSAGE_THREAD, &r1);
        __atomic_fetch_add(&g->major, r1.ru_majflt - r0.ru_majflt, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->minor, r1.ru_minflt - r0.ru_minflt, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g->inblock, r1.ru_inblock - r0.ru_inblock, __ATOMIC_RELAXED);
    }
}

void gather_run(gather_t *g, int threads, int64_t grain) {
    g->bad = -1;
    g->major = g->minor = g->inblock = 0;
    pool_run(gather_piece, g, g->count, grain, threads);
}
