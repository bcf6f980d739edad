/* feed_serve: the host side of captured host-fed lookups (lookup/graphfeed.py), its whole step
 * in C without the GIL where the tier's read is a plain gather from host memory (a file's
 * mapping, pinned DRAM): wait for the header's POSTED word, check the posted ids, this rank's
 * index and rows (as lookup/sources.py's stage_staging), the rows' gather into the feed's fixed
 * staging (gather.c), READY = seq. The engine's Python holding the GIL no longer delays a step.
 * The wait spins while steps keep coming (spin_s after the last post), then polls with sleeps
 * from sleep_s doubling up to sleep_max_s (an idle engine costs ~no core: RESULTS.md). It returns to Python for what only Python does: a bad
 * id or row (Python writes FAILED after keeping the error), a moved file, a TIMED_OUT the GPU
 * wrote, a feed not yet known, a post to stage in Python (no plan), stop, or a quiet spell. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#include "core.h"
#include "pybuf.h"

/* the header's words (kernels/feed.py) and the counters' (graphfeed.py: FEED_COUNTERS) */
enum { W_POSTED = 0, W_READY = 8, W_TIMED_OUT = 24, W_KEY = 32, HEADER_WORDS = 40 };
enum { C_STOP, C_STEPS, C_ROWS, C_ABSENT, C_MAJOR, C_MINOR, C_DISK, C_GATHER_NS, C_WORDS };
/* what a return says */
enum { S_QUIET, S_STOP, S_POSTED, S_BAD_ID, S_BAD_ROW, S_FILE, S_TIMED_OUT, S_NO_FEED };
#define MAX_FEEDS 64
#define COLD_ROWS 64 /* a cold step of this many rows or more faults on cold_threads (mapped) */

typedef struct {
    Py_buffer src;
    int64_t src_offset, row_bytes, base, rows, start, end;
    layout_t layout;
    int warm_threads, cold_threads, streaming, check_file, cold;
    int fd;
    long long size, ctime_ns;
    unsigned long long nlink;
} plan_t;

typedef struct {
    Py_buffer box, out, index;
} feed_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put(int64_t *w, int i, int64_t v) { __atomic_store_n(&w[i], v, __ATOMIC_RELAXED); }
static int64_t get(const int64_t *w, int i) { return __atomic_load_n(&w[i], __ATOMIC_ACQUIRE); }

/* one posted step of feed f served: 0 (READY written), or a state with *detail */
static int serve_step(plan_t *p, const feed_t *f, int64_t *words, int64_t *counters,
                      int64_t *scratch, int64_t seq, int64_t *detail) {
    const int64_t *ids = f->box.buf, n = f->box.len / 8;
    int64_t *index = f->index.buf;
    const int64_t bad = ids_first_outside(ids, n, p->rows);
    if (bad >= 0) return *detail = bad, S_BAD_ID;
    if (p->check_file) {
        const int state = file_state(p->fd, p->size, p->nlink, p->ctime_ns);
        if (state) return *detail = state, S_FILE;
    }
    int64_t u = 0; /* this rank's ids in order, repeats included (Executor.rows_to_read) */
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (id >= p->start && id < p->end)
            index[i] = u, scratch[u++] = id;
        else
            index[i] = -1; /* another rank's: zeros */
    }
    const int cold = p->cold && u >= COLD_ROWS;
    gather_t g = {0};
    g.src = (const uint8_t *)p->src.buf + p->src_offset;
    g.src_bytes = p->src.len - p->src_offset;
    g.ids = scratch, g.count = u, g.base = p->base, g.layout = p->layout;
    g.row_bytes = p->row_bytes, g.out = f->out.buf, g.out_stride = f->out.len / n;
    g.out_len = f->out.len, g.count_faults = p->check_file;
    g.streaming = p->streaming && gather_can_stream(g.out_stride);
    const int64_t t0 = now_ns();
    if (u) gather_run(&g, cold ? p->cold_threads : p->warm_threads, cold ? 16 : 2048);
    if (g.bad >= 0) {
        for (int64_t i = 0, k = 0; i < n; i++) /* the position of the bad row's id */
            if (index[i] >= 0 && k++ == g.bad) return *detail = i, S_BAD_ROW;
        return *detail = 0, S_BAD_ROW;
    }
    p->cold = g.major > 0; /* (the next step faults on cold_threads) */
    put(counters, C_STEPS, counters[C_STEPS] + 1);
    put(counters, C_ROWS, counters[C_ROWS] + n);
    put(counters, C_ABSENT, counters[C_ABSENT] + n - u);
    put(counters, C_MAJOR, counters[C_MAJOR] + g.major);
    put(counters, C_MINOR, counters[C_MINOR] + g.minor);
    put(counters, C_DISK, counters[C_DISK] + g.inblock * 512);
    put(counters, C_GATHER_NS, counters[C_GATHER_NS] + now_ns() - t0);
    /* the rows and index before READY (a streamed gather ended with its own fence) */
    __atomic_store_n(&words[W_READY], seq, __ATOMIC_RELEASE);
    return 0;
}

/* wait for a post (or a reason to return); serve it where there is a plan */
static int serve(plan_t *p, const feed_t *feeds, int nfeeds, int64_t *words,
                 int64_t *counters, int64_t *scratch, int64_t *last, int64_t timed_out,
                 int64_t *posted_ns, int64_t spin_ns, int64_t sleep_ns, int64_t sleep_max_ns,
                 int64_t return_ns, int64_t *detail) {
    const int64_t entered = now_ns();
    int64_t nap_ns = sleep_ns;
    for (unsigned spins = 0;; spins++) {
        const int64_t seq = get(words, W_POSTED);
        if (seq != *last) {
            *posted_ns = now_ns();
            if (!p) return *last = seq, S_POSTED;
            const int64_t key = get(words, W_KEY);
            if (key < 0 || key >= nfeeds) return *detail = key, S_NO_FEED;
            const int state = serve_step(p, &feeds[key], words, counters, scratch, seq, detail);
            *last = seq;
            if (state) return state;
            spins = 0, nap_ns = sleep_ns;
            continue;
        }
        if (spins & 255) {
            RELAX();
            continue;
        }
        if (get(counters, C_STOP)) return S_STOP;
        if (get(words, W_TIMED_OUT) != timed_out) return *detail = 0, S_TIMED_OUT;
        const int64_t t = now_ns();
        if (t - *posted_ns < spin_ns) {
            RELAX();
            continue;
        }
        if (t - entered > return_ns) return S_QUIET;
        const struct timespec nap = {nap_ns / 1000000000LL, nap_ns % 1000000000LL};
        nanosleep(&nap, NULL);
        nap_ns = nap_ns * 2 < sleep_max_ns ? nap_ns * 2 : sleep_max_ns;
        spins = 0; /* (each poll after a sleep looks at the words again) */
    }
}

static int parse_plan(PyObject *obj, plan_t *p) {
    PyObject *src, *file;
    long long off, rb, base, rpb, block, stride, rows, start, end;
    if (!PyArg_ParseTuple(obj, "OLLLLLLLLLiipO", &src, &off, &rb, &base, &rpb, &block, &stride,
                          &rows, &start, &end, &p->warm_threads, &p->cold_threads,
                          &p->streaming, &file))
        return -1;
    if (!layout_ok(rpb, block, stride, rb) || off < 0 || start < 0 || end < start) {
        PyErr_SetString(PyExc_ValueError, "feed_serve: bad layout or row range");
        return -1;
    }
    p->check_file = file != Py_None;
    if (p->check_file && !PyArg_ParseTuple(file, "iLKL", &p->fd, &p->size, &p->nlink,
                                           &p->ctime_ns))
        return -1;
    if (get_buf(src, &p->src, 0, 0, "src") < 0) return -1;
    if (off > p->src.len) {
        PyBuffer_Release(&p->src);
        PyErr_SetString(PyExc_ValueError, "feed_serve: src_offset past src");
        return -1;
    }
    p->src_offset = off, p->row_bytes = rb, p->base = base, p->rows = rows;
    p->start = start, p->end = end, p->layout = (layout_t){rpb, block, stride};
    return 0;
}

static void release_feeds(feed_t *feeds, int k) {
    for (int i = 0; i < k; i++) {
        PyBuffer_Release(&feeds[i].box);
        PyBuffer_Release(&feeds[i].out);
        PyBuffer_Release(&feeds[i].index);
    }
}

/* the feeds' buffers held; the largest feed's id count in *most; -1 on error (none held) */
static int parse_feeds(PyObject *seq, feed_t *feeds, int64_t row_bytes, int64_t *most) {
    const Py_ssize_t k = PyTuple_Size(seq);
    if (k < 0 || k > MAX_FEEDS) {
        if (k > MAX_FEEDS) PyErr_SetString(PyExc_ValueError, "feed_serve: too many feeds");
        return -1;
    }
    *most = 1;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *box, *out, *index;
        feed_t *f = &feeds[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "OOO", &box, &out, &index) ||
            get_buf(box, &f->box, 0, 1, "box") < 0) {
            release_feeds(feeds, (int)i);
            return -1;
        }
        if (get_buf(out, &f->out, 1, 0, "out") < 0) {
            PyBuffer_Release(&f->box);
            release_feeds(feeds, (int)i);
            return -1;
        }
        if (get_buf(index, &f->index, 1, 1, "index") < 0) {
            PyBuffer_Release(&f->box);
            PyBuffer_Release(&f->out);
            release_feeds(feeds, (int)i);
            return -1;
        }
        const int64_t n = f->box.len / 8;
        if (!n || f->index.len != f->box.len || f->out.len % n || f->out.len / n < row_bytes) {
            release_feeds(feeds, (int)i + 1);
            PyErr_SetString(PyExc_ValueError, "feed_serve: a feed's staging does not fit its ids");
            return -1;
        }
        if (n > *most) *most = n;
    }
    return (int)k;
}

/* feed_serve(words, counters, feeds, plan, last, timed_out, posted_ns, spin_s, sleep_s,
 * sleep_max_s, return_s) -> (state, last seq seen, detail, posted_ns) */
PyObject *py_feed_serve(PyObject *self, PyObject *args) {
    PyObject *words_obj, *counters_obj, *feeds_obj, *plan_obj;
    long long last, timed_out, posted_ns;
    double spin_s, sleep_s, sleep_max_s, return_s;
    if (!PyArg_ParseTuple(args, "OOO!OLLLdddd", &words_obj, &counters_obj, &PyTuple_Type,
                          &feeds_obj, &plan_obj, &last, &timed_out, &posted_ns, &spin_s,
                          &sleep_s, &sleep_max_s, &return_s))
        return NULL;
    Py_buffer words, counters;
    if (get_buf(words_obj, &words, 1, 1, "words") < 0) return NULL;
    if (get_buf(counters_obj, &counters, 1, 1, "counters") < 0) {
        PyBuffer_Release(&words);
        return NULL;
    }
    plan_t plan = {0}, *p = NULL;
    feed_t feeds[MAX_FEEDS];
    int nfeeds = 0;
    int64_t *scratch = NULL, most = 1, detail = 0, seen = last, at = posted_ns;
    int state = -1;
    if (words.len < HEADER_WORDS * 8 || counters.len < C_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "feed_serve: words or counters too short");
        goto out;
    }
    if (plan_obj != Py_None) {
        if (parse_plan(plan_obj, &plan) < 0) goto out;
        p = &plan;
        nfeeds = parse_feeds(feeds_obj, feeds, plan.row_bytes, &most);
        if (nfeeds < 0 || !(scratch = malloc((size_t)most * sizeof *scratch))) {
            if (nfeeds >= 0) PyErr_NoMemory();
            nfeeds = 0;
            goto out;
        }
    }
    Py_BEGIN_ALLOW_THREADS;
    prctl(PR_SET_TIMERSLACK, 1000UL); /* this thread's sleeps end within ~1 us of asked */
    state = serve(p, feeds, nfeeds, words.buf, counters.buf, scratch, &seen, timed_out, &at,
                  (int64_t)(spin_s * 1e9), (int64_t)(sleep_s * 1e9), (int64_t)(sleep_max_s * 1e9),
                  (int64_t)(return_s * 1e9), &detail);
    Py_END_ALLOW_THREADS;
out:
    free(scratch);
    release_feeds(feeds, nfeeds);
    if (p) PyBuffer_Release(&plan.src);
    PyBuffer_Release(&words);
    PyBuffer_Release(&counters);
    if (state < 0) return NULL;
    return Py_BuildValue("iLLL", state, (long long)seen, (long long)detail, (long long)at);
}
