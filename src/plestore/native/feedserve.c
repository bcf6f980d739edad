/* feed_serve: the host side of captured host-fed lookups (lookup/graphfeed.py): wait for the
 * header's POSTED word, run the posted step's host step (hoststep.c: the ids checked, this
 * rank's ids, the GPU row cache's probe, the tier's parts read into the feed's fixed staging)
 * without the GIL, READY = seq. The engine's Python holding the GIL delays no step.
 * The wait spins while steps keep coming (spin_s after the last post), then polls with sleeps
 * from sleep_s doubling up to sleep_max_s (an idle engine costs ~no core: RESULTS.md), each a
 * futex wait on the header's WAKE word: `feed_wake` (the engine's Python, as a step begins)
 * ends the sleep at once and the wait spins again, as after a post. It
 * returns to Python for what only Python does: a refused step (a bad id or row, a failed read,
 * a corrupt block: Python builds the error from the step's state and writes FAILED), a mapped
 * file that changed (its tier judges it; the step is staged again), a TIMED_OUT the GPU wrote,
 * a feed not yet known, a post with no plan (the tier closed), stop, or a quiet spell. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#include "core.h"
#include "pybuf.h"

/* the header's words (W_*), the counters' (C_*) and the states (S_*): constants.h */
#define MAX_FEEDS 64

typedef struct {
    Py_buffer box, out, index, held; /* held: .obj NULL without a GPU row cache */
} feed_t;

static int64_t get(const int64_t *w, int i) { return __atomic_load_n(&w[i], __ATOMIC_ACQUIRE); }

/* the futex of the header's WAKE word: its low 32 bits (x86-64 and aarch64 are little-endian) */
static uint32_t *wake_word(int64_t *words) { return (uint32_t *)&words[W_WAKE]; }

/* a wake not yet acted on: 1, and now it is */
static int take_wake(int64_t *words) {
    const int64_t wake = get(words, W_WAKE);
    if (wake == get(words, W_WOKEN)) return 0;
    __atomic_store_n(&words[W_WOKEN], wake, __ATOMIC_RELAXED);
    return 1;
}

/* sleep up to nap_ns, or until feed_wake or a post; 1 if a wake came (now acted on) */
static int nap_or_wake(int64_t *words, int64_t last, int64_t nap_ns) {
    const int64_t wake = get(words, W_WAKE); /* (the futex sleeps only while WAKE holds it) */
    if (wake != get(words, W_WOKEN)) {
        __atomic_store_n(&words[W_WOKEN], wake, __ATOMIC_RELAXED);
        return 1;
    }
    /* ASLEEP before the last look at POSTED and WAKE; feed_wake bumps WAKE before it reads
     * ASLEEP (both sequentially consistent): a wake is never missed, a post at worst waits out
     * this nap (the GPU cannot call futex) */
    __atomic_store_n(&words[W_ASLEEP], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&words[W_POSTED], __ATOMIC_SEQ_CST) == last) {
        const struct timespec nap = {nap_ns / 1000000000LL, nap_ns % 1000000000LL};
        syscall(SYS_futex, wake_word(words), FUTEX_WAIT_PRIVATE, (uint32_t)wake, &nap, NULL, 0);
    }
    __atomic_store_n(&words[W_ASLEEP], 0, __ATOMIC_RELAXED);
    return take_wake(words); /* (one that ended the nap: acted on now, not after a return) */
}

/* feed f's buffers as a host step takes them */
static stepbufs_t step_bufs(const feed_t *f) {
    const int64_t n = f->box.len / 8;
    return (stepbufs_t){f->box.buf, n, f->out.len / n, f->out.len, f->out.buf, f->index.buf,
                        f->held.obj ? f->held.buf : NULL};
}

/* one posted step of feed f served: 0 (READY written), or a state with *detail */
static int serve_step(hoststep_t *p, const feed_t *f, int64_t *words, int64_t *counters,
                      int64_t *scratch, int64_t seq, int64_t *detail) {
    const stepbufs_t b = step_bufs(f);
    const int state = host_step(p, &b, scratch, counters, detail);
    if (state) return state;
    /* the rows and index before READY (a streamed gather ended with its own fence) */
    __atomic_store_n(&words[W_READY], seq, __ATOMIC_RELEASE);
    return 0;
}

/* wait for a post (or a reason to return); serve it where there is a plan */
static int serve(hoststep_t *p, const feed_t *feeds, int nfeeds, int64_t *words,
                 int64_t *counters, int64_t *scratch, int64_t *last, int64_t timed_out,
                 int64_t *posted_ns, int64_t spin_ns, int64_t sleep_ns, int64_t sleep_max_ns,
                 int64_t return_ns, int64_t *detail) {
    const int64_t entered = now_ns();
    int64_t nap_ns = sleep_ns;
    for (unsigned spins = 0;; spins++) {
        const int64_t seq = get(words, W_POSTED);
        if (seq != *last) {
            *posted_ns = now_ns();
            /* the wakes before this post are spent: the spin after it waits for the next */
            __atomic_store_n(&words[W_WOKEN], get(words, W_WAKE), __ATOMIC_RELAXED);
            if (!p) return *last = seq, S_POSTED;
            const int64_t key = get(words, W_KEY);
            if (key < 0 || key >= nfeeds) return *detail = key, S_NO_FEED;
            const int state = serve_step(p, &feeds[key], words, counters, scratch, seq, detail);
            *last = seq;
            if (state) return state;
            __atomic_store_n(&counters[C_STEP_NS], counters[C_STEP_NS] + now_ns() - *posted_ns,
                             __ATOMIC_RELAXED);
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
        if (nap_or_wake(words, *last, nap_ns)) { /* a step is coming: spin as after a post */
            *posted_ns = now_ns(), nap_ns = sleep_ns;
            continue;
        }
        nap_ns = nap_ns * 2 < sleep_max_ns ? nap_ns * 2 : sleep_max_ns;
        spins = 255; /* (a poll after a sleep looks at the words once, then sleeps again) */
    }
}

/* words[i] of an int64 buffer, held in *w (released by the caller); NULL, the error set, if i
 * lies outside it (fn: the caller's name) */
static int64_t *word_at(PyObject *obj, Py_ssize_t i, Py_buffer *w, const char *fn) {
    if (get_buf(obj, w, 1, 1, "words") < 0) return NULL;
    if (i >= 0 && i < w->len / 8) return (int64_t *)w->buf + i;
    PyBuffer_Release(w);
    PyErr_Format(PyExc_IndexError, "%s: word index outside words", fn);
    return NULL;
}

/* publish(words, i, value): words[i] = value by a release store, so every store before it (rows
 * staged by Python, the index) is visible first on any host, weakly ordered ones included */
PyObject *py_publish(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t i;
    long long value;
    if (!PyArg_ParseTuple(args, "OnL", &obj, &i, &value)) return NULL;
    Py_buffer w;
    int64_t *word = word_at(obj, i, &w, "publish");
    if (!word) return NULL;
    __atomic_store_n(word, (int64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&w);
    Py_RETURN_NONE;
}

/* clear_if(words, i, expected) -> bool: words[i] = 0 where it still holds expected (a
 * compare-and-swap: a later step's FAILED or TIMED_OUT written meanwhile is never erased) */
PyObject *py_clear_if(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t i;
    long long expected;
    if (!PyArg_ParseTuple(args, "OnL", &obj, &i, &expected)) return NULL;
    Py_buffer w;
    int64_t *word = word_at(obj, i, &w, "clear_if");
    if (!word) return NULL;
    int64_t want = (int64_t)expected;
    const int done =
        __atomic_compare_exchange_n(word, &want, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&w);
    return PyBool_FromLong(done);
}

/* feed_wake(words): a step is coming — the host side's sleep ended now (a futex wake where it
 * sleeps), its wait spinning again as after a post */
PyObject *py_feed_wake(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    Py_buffer w;
    if (get_buf(obj, &w, 1, 1, "words") < 0) return NULL;
    if (w.len < HEADER_WORDS * 8) {
        PyBuffer_Release(&w);
        PyErr_SetString(PyExc_ValueError, "feed_wake: words too short");
        return NULL;
    }
    int64_t *words = w.buf;
    __atomic_add_fetch(&words[W_WAKE], 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&words[W_ASLEEP], __ATOMIC_SEQ_CST))
        syscall(SYS_futex, wake_word(words), FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    PyBuffer_Release(&w);
    Py_RETURN_NONE;
}

static void release_feeds(feed_t *feeds, int k) {
    for (int i = 0; i < k; i++) {
        PyBuffer_Release(&feeds[i].box);
        PyBuffer_Release(&feeds[i].out);
        PyBuffer_Release(&feeds[i].index);
        if (feeds[i].held.obj) PyBuffer_Release(&feeds[i].held);
    }
}

/* f's buffers: box (int64 ids [n]), out (staging), index (int64 [n]), held (int64 [n] or None) */
static int parse_feed(PyObject *obj, feed_t *f) {
    PyObject *o[4];
    memset(f, 0, sizeof *f);
    if (!PyArg_ParseTuple(obj, "OOOO", &o[0], &o[1], &o[2], &o[3])) return -1;
    if (get_buf(o[0], &f->box, 0, 1, "box") < 0) return -1;
    if (get_buf(o[1], &f->out, 1, 0, "out") < 0) goto fail1;
    if (get_buf(o[2], &f->index, 1, 1, "index") < 0) goto fail2;
    if (o[3] != Py_None && get_buf(o[3], &f->held, 1, 1, "held") < 0) goto fail3;
    return 0;
fail3:
    PyBuffer_Release(&f->index);
fail2:
    PyBuffer_Release(&f->out);
fail1:
    PyBuffer_Release(&f->box);
    return -1;
}

/* the feeds' buffers held (each staging's rows at least `row_bytes` apart); the largest feed's
 * id count in *most; -1 on error (none held) */
static int parse_feeds(PyObject *seq, feed_t *feeds, int64_t row_bytes, int64_t *most) {
    const Py_ssize_t k = PyTuple_Size(seq);
    if (k < 0 || k > MAX_FEEDS) {
        if (k > MAX_FEEDS) PyErr_SetString(PyExc_ValueError, "feed_serve: too many feeds");
        return -1;
    }
    *most = 1;
    for (Py_ssize_t i = 0; i < k; i++) {
        feed_t *f = &feeds[i];
        if (parse_feed(PyTuple_GET_ITEM(seq, i), f) < 0) {
            release_feeds(feeds, (int)i);
            return -1;
        }
        const int64_t n = f->box.len / 8;
        if (!n || f->index.len != f->box.len || f->out.len % n || f->out.len / n < row_bytes ||
            (f->held.obj && f->held.len != f->box.len)) {
            release_feeds(feeds, (int)i + 1);
            PyErr_SetString(PyExc_ValueError, "feed_serve: a feed's staging does not fit its ids");
            return -1;
        }
        if (n > *most) *most = n;
    }
    return (int)k;
}

/* the widest row a plan's gathers copy (a feed's staging holds at least that a row) */
static int64_t plan_row_bytes(const hoststep_t *p) {
    int64_t row_bytes = 1;
    for (int i = 0; i < p->nparts; i++)
        if (!p->parts[i].direct && p->parts[i].row_bytes > row_bytes)
            row_bytes = p->parts[i].row_bytes;
    return row_bytes;
}

/* host_step(plan, feed, counters) -> (state, detail): one host step of feed (box, out, index,
 * held) by plan, without the GIL (a staged lookup's stage(), lookup/executor.py); the counters
 * as feed_serve's (the plan's parts' clean state reaches counters[C_CLEAN] only) */
PyObject *py_host_step(PyObject *self, PyObject *args) {
    PyObject *plan_obj, *feed_obj, *counters_obj;
    if (!PyArg_ParseTuple(args, "OO!O", &plan_obj, &PyTuple_Type, &feed_obj, &counters_obj))
        return NULL;
    Py_buffer counters;
    if (get_buf(counters_obj, &counters, 1, 1, "counters") < 0) return NULL;
    if (counters.len < C_WORDS * 8) {
        PyBuffer_Release(&counters);
        PyErr_SetString(PyExc_ValueError, "host_step: counters too short");
        return NULL;
    }
    hoststep_hold plan;
    if (host_step_parse(plan_obj, &plan) < 0) {
        PyBuffer_Release(&counters);
        return NULL;
    }
    feed_t feed;
    int64_t most = 1, detail = 0, *scratch = NULL;
    int state = -1;
    PyObject *one = PyTuple_Pack(1, feed_obj);
    const int nfeeds = one ? parse_feeds(one, &feed, plan_row_bytes(&plan.step), &most) : -1;
    Py_XDECREF(one);
    if (nfeeds == 1 && !(scratch = malloc((size_t)most * STEP_SCRATCH * sizeof *scratch)))
        PyErr_NoMemory();
    if (scratch) {
        const stepbufs_t b = step_bufs(&feed);
        Py_BEGIN_ALLOW_THREADS;
        state = host_step(&plan.step, &b, scratch, counters.buf, &detail);
        Py_END_ALLOW_THREADS;
    }
    free(scratch);
    if (nfeeds == 1) release_feeds(&feed, 1);
    host_step_release(&plan);
    PyBuffer_Release(&counters);
    if (state < 0) return NULL;
    return Py_BuildValue("iL", state, (long long)detail);
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
    hoststep_hold plan;
    hoststep_t *p = NULL;
    feed_t feeds[MAX_FEEDS];
    int nfeeds = 0;
    int64_t *scratch = NULL, most = 1, detail = 0, seen = last, at = posted_ns;
    int state = -1;
    if (words.len < HEADER_WORDS * 8 || counters.len < C_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "feed_serve: words or counters too short");
        goto out;
    }
    if (plan_obj != Py_None) {
        if (host_step_parse(plan_obj, &plan) < 0) goto out;
        p = &plan.step;
        nfeeds = parse_feeds(feeds_obj, feeds, plan_row_bytes(p), &most);
        if (nfeeds < 0 || !(scratch = malloc((size_t)most * STEP_SCRATCH * sizeof *scratch))) {
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
    if (p) host_step_release(&plan);
    PyBuffer_Release(&words);
    PyBuffer_Release(&counters);
    if (state < 0) return NULL;
    return Py_BuildValue("iLLL", state, (long long)seen, (long long)detail, (long long)at);
}
