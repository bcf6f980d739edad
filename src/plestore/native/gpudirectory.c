/* The GPU row cache directory's probe (GpuCacheDirectory.locate, lookup/gpudirectory.py) in one
 * call: each row's slot (resident range, static STATIC_WAYS-way set, dynamic set), the dynamic hits'
 * recency stamps and every row's frequency counter, in one pass where the numpy reference
 * (native/reference/gpudirectory.py) takes ~20 array operations. The same arithmetic (the
 * uint64 hashes wrap alike), so both give the same slots, stamps and counts
 * (tests/test_native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "core.h"
#include "pybuf.h"

/* ids ahead whose sets and counter are prefetched: each id's probe is ~2 random reads of
 * arrays of hundreds of MB, so a prefill chunk's probe waits on memory, not arithmetic */
#define AHEAD 8 /* (a power of two: cache_locate_piece's rings) */
/* admissions of more ids release the GIL */
#define ADMIT_INLINE_IDS 4096
/* ids per piece of a locate on the pool: a batch-8 decode step's 128 stay on the caller, a
 * 16,384-id prefill chunk is 8 pieces */
#define LOCATE_GRAIN 2048

/* The six arrays of a directory call, the int32 counters last: v[:*taken] to release. */
static int take_arrays(PyObject *const o[6], Py_buffer v[6], const int writable[6],
                       const char *const names[6], int *taken) {
    for (*taken = 0; *taken < 6; ++*taken) {
        const int i = *taken, counters = i == 5;
        if (get_buf(o[i], &v[i], writable[i], !counters, names[i]) < 0) return -1;
        if (counters && (v[i].itemsize != 4 || v[i].len % 4)) {
            ++*taken;
            PyErr_Format(PyExc_ValueError, "cache directory: %s must hold int32", names[i]);
            return -1;
        }
    }
    return 0;
}

static void release(Py_buffer v[6], int taken) {
    while (taken) PyBuffer_Release(&v[--taken]);
}

#if defined(__x86_64__) && defined(__GLIBC__)
#define WIDE_WAYS /* AVX2 where the CPU has it: 4 ways a compare */
typedef int64_t lanes_t __attribute__((vector_size(32), aligned(8), may_alias));
#endif

/* the first of a set's ways t[0:ways] holding row, or -1. wide (a constant where it is
 * inlined): the ways 4 at a time first, with one test for a match among them all (measured:
 * RESULTS.md "host step alone") */
static inline __attribute__((always_inline)) int64_t way_of(const int64_t *t, int64_t ways,
                                                            int64_t row, int wide) {
    int64_t w = 0;
#ifdef WIDE_WAYS
    if (wide) {
        lanes_t any = {0, 0, 0, 0};
        for (; w + 4 <= ways; w += 4) any |= *(const lanes_t *)(t + w) == row;
        if (any[0] | any[1] | any[2] | any[3]) w = 0; /* one of them: the first, below */
    }
#else
    (void)wide;
#endif
    for (; w < ways; w++)
        if (t[w] == row) return w;
    return -1;
}

/* One locate call's arrays and geometry (core.h's locate_t), shared by the pool's threads: each
 * id's slot is its own; the counters and stamps they share are written with relaxed atomics (a
 * counter's increments all land; a stamp is the one clock), so threads give the same arrays as
 * one thread. Each id's sets are worked out once, AHEAD ids before its probe, as their lines
 * are prefetched. */
static inline __attribute__((always_inline)) void locate_rows(const locate_t *c, int64_t a,
                                                             int64_t b, int wide) {
    const int64_t *rows = c->rows, *stags = c->stags, *tags = c->tags;
    const int64_t static_sets = c->static_sets, sets = c->sets, ways = c->ways;
    const int64_t r0 = c->r0, r1 = c->r1, clock = c->clock;
    const int64_t saturated = c->saturated;
    const uint64_t mask = (uint64_t)c->mask;
    const int64_t resident = c->r1 - c->r0, first_dynamic = resident + static_sets * STATIC_WAYS;
    const int touch = c->touch, shared = c->shared;
    int64_t *slot = c->slot, *stamp = c->stamp;
    int32_t *sketch = c->sketch;
    int64_t sring[AHEAD], dring[AHEAD]; /* the next AHEAD ids' sets: their first slots */
    for (int64_t i = a; i < b + AHEAD; i++) {
        const int64_t j = i - AHEAD; /* the id probed now (its ring slot then is i's) */
        if (j >= a) {
            const int64_t row = rows[j];
            int64_t s_ = -1;
            if (row >= r0 && row < r1) s_ = row - r0;
            if (s_ < 0 && static_sets) {
                const int64_t at = sring[j & (AHEAD - 1)];
                const int64_t w = way_of(stags + at, STATIC_WAYS, row, wide);
                if (w >= 0) s_ = resident + at + w;
            }
            if (s_ < 0 && sets) {
                const int64_t at = dring[j & (AHEAD - 1)];
                const int64_t w = way_of(tags + at, ways, row, wide);
                if (w >= 0) {
                    s_ = first_dynamic + at + w;
                    if (touch) __atomic_store_n(&stamp[at + w], clock, __ATOMIC_RELAXED);
                }
            }
            slot[j] = s_;
            if (touch) {
                int32_t *k = sketch + sketch_at(row, mask);
                if (!shared) { /* (a locked add would stall the loads in flight) */
                    const int32_t n = *k + 1;
                    *k = n > saturated ? (int32_t)saturated : n;
                } else if (__atomic_add_fetch(k, 1, __ATOMIC_RELAXED) > saturated) {
                    __atomic_store_n(k, (int32_t)saturated, __ATOMIC_RELAXED);
                }
            }
        }
        if (i < b) { /* id i's sets worked out, their lines (and its counter's) fetched */
            const uint64_t row = (uint64_t)rows[i];
            if (static_sets) {
                const int64_t at = sring[i & (AHEAD - 1)] = row_set(row, c->sdiv) * STATIC_WAYS;
                __builtin_prefetch(stags + at);
                __builtin_prefetch(stags + at + STATIC_WAYS - 1);
            }
            if (sets) {
                const int64_t at = dring[i & (AHEAD - 1)] = row_set(row, c->ddiv) * ways;
                __builtin_prefetch(tags + at);
                __builtin_prefetch(tags + at + ways - 1);
                /* (not the stamps': a miss never writes them, and a hit's store waits on
                 * nothing) */
                if (touch) __builtin_prefetch(sketch + sketch_at(row, mask), 1);
            }
        }
    }
}

#ifdef WIDE_WAYS
__attribute__((target("avx2"))) static void locate_wide(const locate_t *c, int64_t a, int64_t b) {
    locate_rows(c, a, b, 1);
}
#endif

void cache_locate_piece(void *ctx, int64_t a, int64_t b, int worker) {
    (void)worker;
#ifdef WIDE_WAYS
    if (__builtin_cpu_supports("avx2")) {
        locate_wide(ctx, a, b);
        return;
    }
#endif
    locate_rows(ctx, a, b, 0);
}

void cache_probe(const dir_t *c, const int64_t *rows, int64_t n, int64_t *slot, int touch,
                 int threads) {
    touch = touch && c->sets > 0;
    if (touch) c->state[0]++;
    locate_t l = {rows, c->static_tags, c->tags, slot, c->stamp, c->sketch, c->r0, c->r1,
                  c->static_sets, c->sets, c->ways, touch ? c->state[0] : -1, c->mask,
                  c->saturated, divisor_of(c->static_sets), divisor_of(c->sets), touch, 0};
    if (threads <= 1 || n <= LOCATE_GRAIN) {
        cache_locate_piece(&l, 0, n, 0);
    } else {
        l.shared = touch;
        pool_run(cache_locate_piece, &l, n, LOCATE_GRAIN, threads);
    }
    if (touch && (c->state[1] += n) >= c->age_every) { /* old popularity fades */
        for (int64_t i = 0; i < c->sketch_len; i++) c->sketch[i] >>= 1;
        c->state[1] = 0;
    }
}

/* cache_locate(rows, slot_out, static_tags, tags, stamp, sketch, state, resident_start,
 *              resident_end, static_sets, sets, ways, touch, sketch_mask, saturated, age_every,
 *              threads=1) -> None: cache_probe (the caller holds the directory's lock)
 * rows int64 [n] (>= 0); slot_out int64 [n]; static_tags int64 [static_sets * STATIC_WAYS]; tags and
 * stamp int64 [sets * ways]; sketch int32 [sketch_mask + 1] or empty; state int64 [>= 2]
 * (cache_probe's). Past LOCATE_GRAIN ids, on the pool (touching: without the GIL; not touching,
 * the GIL kept: a probe without the host lock, Table's hint of misses, then never reads tags
 * an admission is writing). */
PyObject *py_cache_locate(PyObject *self, PyObject *args) {
    PyObject *o[6], *state_obj;
    long long r0, r1, static_sets, sets, ways, mask, saturated, age_every;
    int touch, threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOOLLLLLpLLL|i", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &state_obj, &r0, &r1, &static_sets, &sets, &ways, &touch, &mask,
                          &saturated, &age_every, &threads))
        return NULL;
    static const char *const names[] = {"rows", "slot", "static_tags", "tags", "stamp", "sketch"};
    static const int writable[] = {0, 1, 0, 0, 1, 1};
    Py_buffer v[6], state;
    PyObject *result = NULL;
    int taken;
    if (get_buf(state_obj, &state, 1, 1, "state") < 0) return NULL;
    if (take_arrays(o, v, writable, names, &taken) < 0) goto done;
    Py_ssize_t n = v[0].len / 8;
    touch = touch && sets > 0;
    if (v[1].len / 8 < n || v[2].len / 8 < static_sets * STATIC_WAYS ||
        v[3].len / 8 < sets * ways || v[4].len / 8 < sets * ways ||
        (touch && v[5].len / 4 < mask + 1) || state.len / 8 < 2 || static_sets < 0 ||
        sets < 0 || ways < 1 || r0 < 0 || r1 < r0 || mask < 0 || age_every < 1) {
        PyErr_SetString(PyExc_ValueError, "cache_locate: arrays or geometry do not agree");
        goto done;
    }
    {
        const dir_t c = {NULL, v[2].buf, v[3].buf, v[4].buf, state.buf, v[5].buf, v[5].len / 4,
                         r0, r1, static_sets, sets, ways, mask, saturated, age_every, 0};
        if (touch && threads > 1 && n > LOCATE_GRAIN) {
            Py_BEGIN_ALLOW_THREADS;
            cache_probe(&c, v[0].buf, n, v[1].buf, touch, threads);
            Py_END_ALLOW_THREADS;
        } else {
            cache_probe(&c, v[0].buf, n, v[1].buf, touch, threads);
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release(v, taken);
    PyBuffer_Release(&state);
    return result;
}

/* -- admission -------------------------------------------------------------------------------
 * GpuCacheDirectory.admit: candidates (counter >= admit_min; a repeated row once, at its first
 * position) grouped by set, most frequent first (ties: lower row id first), at most `ways` a
 * set; the r-th of a set goes to its set's r-th least recently used way (ties: lower way) if
 * that way is empty or its row is counted less often. */
typedef struct {
    int64_t set, freq, row, pos;
} cand_t;

static inline int before(const cand_t *x, const cand_t *y) { /* within a set (rows distinct) */
    return x->freq != y->freq ? x->freq > y->freq : x->row < y->row;
}

/* Order candidates by set, then most frequent first, then lower row: a stable radix sort by set
 * (11 bits a pass; qsort's comparisons were half of admitting a prefill chunk's misses), then
 * an insertion sort inside each set's few. tmp: scratch of m. */
static void sort_by_set(cand_t *c, cand_t *tmp, Py_ssize_t m, int64_t sets) {
    size_t count[1 << 11];
    for (int shift = 0; shift == 0 || (shift < 64 && (sets - 1) >> shift); shift += 11) {
        memset(count, 0, sizeof count);
        for (Py_ssize_t i = 0; i < m; i++) count[(c[i].set >> shift) & 2047]++;
        size_t at = 0;
        for (int d = 0; d < 2048; d++) {
            const size_t k = count[d];
            count[d] = at;
            at += k;
        }
        for (Py_ssize_t i = 0; i < m; i++) tmp[count[(c[i].set >> shift) & 2047]++] = c[i];
        memcpy(c, tmp, (size_t)m * sizeof *c);
    }
    for (Py_ssize_t i = 1; i < m; i++) {
        const cand_t x = c[i];
        Py_ssize_t j = i;
        for (; j > 0 && c[j - 1].set == x.set && before(&x, &c[j - 1]); j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

static inline int64_t counter(const int32_t *sketch, int64_t mask, int64_t row) {
    return sketch[sketch_at(row, mask)];
}

/* The sorted candidates c[0..m) into their sets' least recently used ways: slots[i] (a set's
 * way) for candidate position which[i]; returns how many. Reads the tags as they were. */
static Py_ssize_t admit(cand_t *c, cand_t *tmp, Py_ssize_t m, int64_t *lru, const int64_t *tags,
                        const int64_t *stamp, const int32_t *sketch, int64_t sets, int64_t ways,
                        int64_t mask, int64_t *slots, int64_t *which) {
    sort_by_set(c, tmp, m, sets);
    Py_ssize_t k = 0;
    for (Py_ssize_t a = 0; a < m;) {
        Py_ssize_t b = a;
        while (b < m && c[b].set == c[a].set) b++;
        if (b + AHEAD < m) {  /* a later set's stamps and tags: random lines of large arrays */
            __builtin_prefetch(stamp + c[b + AHEAD].set * ways);
            __builtin_prefetch(tags + c[b + AHEAD].set * ways);
        }
        const int64_t set = c[a].set, *st = stamp + set * ways;
        for (int64_t w = 0; w < ways; w++) {  /* ways oldest first, a stable insertion sort */
            int64_t j = w;
            while (j > 0 && st[lru[j - 1]] > st[w]) {
                lru[j] = lru[j - 1];
                j--;
            }
            lru[j] = w;
        }
        for (Py_ssize_t r = 0; r < b - a && r < ways; r++) {
            const int64_t at = set * ways + lru[r], old = tags[at];
            if (old < 0 || c[a + r].freq > counter(sketch, mask, old)) {
                slots[k] = at;  /* written below: every candidate saw the tags as they were */
                which[k++] = c[a + r].pos;
            }
        }
        a = b;
    }
    return k;
}

/* cache_admit(rows, slots_out, which_out, tags, stamp, sketch, sets, ways, first_dynamic,
 *             clock, sketch_mask, admit_min) -> (k admitted: slots_out[:k], which_out[:k];
 *             candidates, admitted or not: the directory's clock moves when there were any) */
PyObject *py_cache_admit(PyObject *self, PyObject *args) {
    PyObject *o[6];
    long long sets, ways, first_dynamic, clock, mask, admit_min;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLLL", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &sets,
                          &ways, &first_dynamic, &clock, &mask, &admit_min))
        return NULL;
    static const char *const names[] = {"rows", "slots", "which", "tags", "stamp", "sketch"};
    static const int writable[] = {0, 1, 1, 1, 1, 0};
    Py_buffer v[6];
    PyObject *result = NULL;
    int taken;
    Py_ssize_t m = 0;
    cand_t *c = NULL, *tmp = NULL;
    int64_t *lru = NULL, *seen = NULL;
    if (take_arrays(o, v, writable, names, &taken) < 0) goto done;
    const Py_ssize_t n = v[0].len / 8;
    if (v[1].len / 8 < n || v[2].len / 8 < n || sets < 1 || ways < 1 || mask < 0 ||
        v[3].len / 8 < sets * ways || v[4].len / 8 < sets * ways ||
        v[5].len / 4 < mask + 1) {
        PyErr_SetString(PyExc_ValueError, "cache_admit: arrays or geometry do not agree");
        goto done;
    }
    const int64_t *rows = v[0].buf;
    int64_t *slots = v[1].buf, *which = v[2].buf, *tags = v[3].buf, *stamp = v[4].buf;
    const int32_t *sketch = v[5].buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0) {
            PyErr_Format(PyExc_ValueError, "cache_admit: row %lld is negative",
                         (long long)rows[i]);
            goto done;
        }
    c = PyMem_RawMalloc((n ? n : 1) * sizeof *c);
    tmp = PyMem_RawMalloc((n ? n : 1) * sizeof *tmp);
    lru = PyMem_RawMalloc(ways * sizeof *lru);
    if (!c || !tmp || !lru) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0;
    /* a prefill chunk's admission is long: other Python threads go on meanwhile */
    PyThreadState *save = n > ADMIT_INLINE_IDS ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) { /* the candidates, repeats and all, in order */
        if (i + AHEAD < n) __builtin_prefetch(sketch + sketch_at(rows[i + AHEAD], mask));
        const int64_t f = counter(sketch, mask, rows[i]);
        if (f >= admit_min) c[m++] = (cand_t){0, f, rows[i], i};
    }
    int bits = 1; /* an open-addressing set of the candidate rows, at most half full */
    while (((int64_t)1 << bits) < 2 * m) bits++;
    const uint64_t seen_mask = ((uint64_t)1 << bits) - 1;
    const divisor_t by_sets = divisor_of((uint64_t)sets);
    seen = PyMem_RawMalloc((seen_mask + 1) * sizeof *seen); /* (the raw allocator: no GIL) */
    if (seen) {
        memset(seen, 0xff, (seen_mask + 1) * sizeof *seen); /* -1: empty (rows are >= 0) */
        Py_ssize_t distinct = 0;
        for (Py_ssize_t i = 0; i < m; i++) { /* a repeat is dropped: its first position stands */
            const int64_t row = c[i].row;
            uint64_t at = (uint64_t)row * HASH_GOLDEN >> (64 - bits);
            while (seen[at] >= 0 && seen[at] != row) at = (at + 1) & seen_mask;
            if (seen[at] == row) continue;
            seen[at] = row;
            c[distinct] = c[i];
            c[distinct++].set = row_set(row, by_sets);
        }
        m = distinct;
        k = admit(c, tmp, m, lru, tags, stamp, sketch, sets, ways, mask, slots, which);
    }
    if (save) PyEval_RestoreThread(save);
    if (!seen) {
        PyErr_NoMemory();
        goto done;
    }
    /* written with the GIL held: a probe without the host lock (GpuRowCache.misses) keeps it,
     * so it sees an admission whole or not at all */
    for (Py_ssize_t i = 0; i < k; i++) {
        tags[slots[i]] = rows[which[i]];
        stamp[slots[i]] = clock;
        slots[i] += first_dynamic;
    }
    result = Py_BuildValue("nn", k, m);
done:
    PyMem_RawFree(c);
    PyMem_RawFree(tmp);
    PyMem_RawFree(lru);
    PyMem_RawFree(seen);
    release(v, taken);
    return result;
}
