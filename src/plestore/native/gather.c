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

#define AHEAD 8 /* rows prefetched ahead of the copy (a power of two: the ring below) */
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

/* The pieces' done flags, freed by whichever lets go last: the job (gather_end) or a host
 * function of gather_copy_ahead, which the stream may run after the job has ended. */
struct progress {
    atomic_int refs;
    uint8_t done[];
};

static void progress_release(progress_t *p) {
    if (atomic_fetch_sub(&p->refs, 1) == 1) free(p);
}

int gather_begin(gather_job *j, int threads, int64_t grain) {
    gather_t *g = &j->g;
    g->bad = -1;
    g->major = g->minor = g->inblock = 0;
    g->grain = grain < 1 ? 1 : grain > g->count ? (g->count > 0 ? g->count : 1) : grain;
    j->progress = calloc(1, sizeof(progress_t) + (size_t)(g->count / g->grain + 1));
    if (!j->progress) return -1;
    atomic_init(&j->progress->refs, 1);
    g->done = j->progress->done;
    j->cursor = 0;
    pool_start(&j->job, gather_piece, g, g->count, g->grain, threads);
    return 0;
}

/* spin, then yield: a piece may wait on the disk (a page fault) */
static void backoff(unsigned *spins) {
    if (++*spins < 4096) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
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
        } else { /* pool threads have them */
            backoff(&spins);
        }
    }
}

void gather_end(gather_job *j) {
    if (pool_forked(&j->job)) run_undone(j, (j->g.count + j->g.grain - 1) / j->g.grain);
    pool_finish(&j->job);
    progress_release(j->progress);
    j->progress = NULL;
    j->g.done = NULL;
}

typedef struct {
    progress_t *p;
    int64_t from, to; /* the pieces it waits for (those before: the stream's earlier waits) */
} stream_wait;

/* on CUDA's host-function thread: returns once pieces [from, to) are written (no CUDA call) */
static void stream_wait_fn(void *arg) {
    stream_wait *w = arg;
    unsigned spins = 0;
    for (int64_t k = w->from; k < w->to;) {
        if (__atomic_load_n(&w->p->done[k], __ATOMIC_ACQUIRE)) {
            k++, spins = 0;
        } else {
            backoff(&spins);
        }
    }
    progress_release(w->p);
    free(w);
}

int gather_copy_ahead(gather_job *j, int64_t a, int64_t b, unsigned long long dst, void *stream,
                      cuda_h2d_fn h2d, cuda_launch_host_fn launch) {
    const gather_t *g = &j->g;
    stream_wait *w = malloc(sizeof *w);
    if (!w) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *w = (stream_wait){j->progress, a / g->grain, (b + g->grain - 1) / g->grain};
    atomic_fetch_add(&j->progress->refs, 1);
    int err = launch(stream, stream_wait_fn, w);
    if (err) { /* never queued: never run */
        progress_release(j->progress);
        free(w);
        return err;
    }
    return gather_copy(j, a, b, dst, stream, h2d);
}

int gather_copy(const gather_job *j, int64_t a, int64_t b, unsigned long long dst, void *stream,
                cuda_h2d_fn h2d) {
    const gather_t *g = &j->g;
    int64_t bytes = (b - a) * g->out_stride; /* (the last row's padding may lie past out) */
    if (a * g->out_stride + bytes > g->out_len) bytes = g->out_len - a * g->out_stride;
    return h2d(dst + (unsigned long long)(a * g->out_stride), g->out + a * g->out_stride,
               (size_t)bytes, stream);
}
