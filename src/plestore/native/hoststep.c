/* A host-fed staged lookup's host step, whole, without the GIL (lookup/graphfeed.py; the numpy
 * reference: native/reference/hoststep.py): the posted ids checked, this rank's ids, the GPU row
 * cache directory's probe (its lock taken, each id's held slot written), the misses split among
 * the tier's parts and read into the feed's staging — a plain gather from host memory (a file's
 * mapping, pinned DRAM: with verify_reads, the blocks its rows came from checked against the
 * table's CRCs) or the direct tier's core (its row cache, io_uring block reads, checks,
 * admission: under its own lock) — and the decode's index: a row in staging (after `base` with
 * a cache), a cache slot, or -1 (another rank's id: zeros). Staging order is the parts' order;
 * the index says where each id's row is, so no row is copied twice. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "pybuf.h"


static void add(int64_t *counters, int i, int64_t v) {
    __atomic_store_n(&counters[i], counters[i] + v, __ATOMIC_RELAXED); /* (Python reads them) */
}

/* The ids a step reads, held in scratch or read in place: rows[j] at position pos[j] of the
 * step's ids, or at j where pos is NULL (every id is this rank's: rows are the ids) */
static inline int64_t pos_of(const int64_t *pos, int64_t j) { return pos ? pos[j] : j; }

/* The directory's probe of in[0:u] (at in_pos) (cache_probe: clock, stamps, counts, aging)
 * under its lock, each id's held slot written; the hits' index set, the misses written to
 * rows and pos (in order; in may be rows) with their index as one part's staging has them
 * (base + j); returns how many. slot: scratch of u. (On one thread: RESULTS.md "vLLM: a decode
 * step's lookup", the GPU row cache's probe on the pool.) */
static int64_t probe_cache(dir_t *c, const int64_t *in, const int64_t *in_pos, int64_t u,
                           int64_t *rows, int64_t *pos, int64_t *restrict slot,
                           const stepbufs_t *b, int64_t *index) {
    const int64_t first_dynamic = c->r1 - c->r0 + c->static_sets * STATIC_WAYS, base = c->base;
    int64_t *held = b->held, m = 0;
    mutex_lock(c->lock);
    cache_probe(c, in, u, slot, 1, 1);
    if (held) memset(held, 0xff, (size_t)b->n * sizeof *held); /* -1: none */
    for (int64_t j = 0; j < u; j++) { /* (no branch on a hit: they come at random) */
        const int64_t at = slot[j], p = pos_of(in_pos, j);
        index[p] = at >= 0 ? at : base + m;
        rows[m] = in[j], pos[m] = p, m += at < 0; /* (m <= j: in[j] already read) */
        if (held && at >= first_dynamic) held[p] = at - first_dynamic;
    }
    c->state[2]++; /* the holds changed (GpuRowCache.held unions them again) */
    mutex_unlock(c->lock);
    return m;
}

/* in[0:m] (at in_pos) written to rows and pos (in may be rows) stably reordered: part p's rows
 * first; returns how many. tmp: 2m */
static int64_t split(const part_t *p, const int64_t *in, const int64_t *in_pos, int64_t m,
                     int64_t *rows, int64_t *pos, int64_t *restrict tmp) {
    const int64_t lo = p->lo, hi = p->hi;
    int64_t k = 0, r = 0, *restrict tpos = tmp + m;
    for (int64_t j = 0; j < m; j++) { /* (no branch: a cascade's rows come mixed) */
        const int64_t row = in[j], at = pos_of(in_pos, j), mine = row >= lo && row < hi;
        rows[k] = row, pos[k] = at, k += mine; /* (k <= j: in[j] already read) */
        tmp[r] = row, tpos[r] = at, r += !mine;
    }
    memcpy(rows + k, tmp, (size_t)r * sizeof *rows);
    memcpy(pos + k, tpos, (size_t)r * sizeof *pos);
    return k;
}

/* the first of rows[0:m] outside [lo, hi), or -1 */
static int64_t first_outside(const int64_t *rows, int64_t m, int64_t lo, int64_t hi) {
    const uint64_t span = (uint64_t)(hi - lo);
    uint64_t top = 0; /* (one unsigned max: a row below lo wraps to the largest) */
    for (int64_t j = 0; j < m; j++) {
        const uint64_t d = (uint64_t)rows[j] - (uint64_t)lo;
        top = d > top ? d : top;
    }
    if (top < span) return -1;
    for (int64_t j = 0; j < m; j++)
        if ((uint64_t)rows[j] - (uint64_t)lo >= span) return j;
    return -1;
}

/* verify_reads: the blocks holding rows[0:m] checked against the part's CRC-32s in src (a
 * block shared by rows in a row checked once): -1, or the first failing block (*row: -1), or
 * (*row: its index) a row whose bytes lie past the checked data */
static int64_t check_blocks(const part_t *p, const int64_t *rows, int64_t m, int64_t *row) {
    const int64_t unit = p->check_unit, data = p->data_bytes;
    int64_t last_checked = -1;
    *row = -1;
    for (int64_t j = 0; j < m; j++) {
        const int64_t off = layout_offset(&p->layout, rows[j] - p->base);
        if (off + p->row_bytes > data) return *row = j, 0;
        for (int64_t u = off / unit; u <= (off + p->row_bytes - 1) / unit; u++) {
            if (u == last_checked) continue;
            const int64_t a = u * unit, len = data - a < unit ? data - a : unit;
            if (crc32_bytes(p->src + a, len) != p->crcs[u]) return u;
            last_checked = u;
        }
    }
    return -1;
}

/* one part's read of rows[0:m] into out (row j at j * stride): 0, or a state with *detail (the
 * row's index in rows for S_BAD_ROW; else constants.h's detail of the state) */
static int read_part(part_t *p, const int64_t *rows, int64_t m, uint8_t *out, int64_t stride,
                     int64_t out_len, int64_t *scratch, int64_t *counters, int64_t *detail) {
    if ((*detail = first_outside(rows, m, p->lo, p->hi)) >= 0) return S_BAD_ROW;
    if (p->direct) {
        direct_result res = {0, 0, 0, -1, 0, 0, 0};
        int64_t bytes = 0;
        const int64_t hits = direct_core_read(p->direct, rows, m, out, stride, out_len,
                                              p->streaming, scratch, &res, &bytes);
        if (hits < 0) return *detail = hits, S_READ_FAILED; /* -1 closed, -2 out too small */
        if (res.err) return *detail = -res.err, S_READ_FAILED;
        if (res.bad_block != -1) return *detail = res.bad_block, S_CORRUPT;
        add(counters, C_HOST_HITS, hits);
        add(counters, C_DIRECT_ROWS, m);
        add(counters, C_BLOCKS, res.blocks + res.ahead_blocks);
        add(counters, C_DISK, bytes);
        return 0;
    }
    int64_t advised = -1; /* a cold mapping: every page's read in flight before the faults */
    if (p->check_file && p->clean < WARM_READS)
        advised = willneed_rows(p->map, p->map_bytes, p->src_offset, rows, m, p->row_bytes,
                                p->base, p->layout, PROBE_ROWS, scratch);
    gather_t g = {0};
    g.src = p->src, g.src_bytes = p->src_bytes;
    g.ids = rows, g.count = m, g.base = p->base, g.layout = p->layout;
    g.row_bytes = p->row_bytes, g.out = out, g.out_stride = stride, g.out_len = out_len;
    g.count_faults = p->check_file;
    g.streaming = p->streaming && gather_can_stream(stride);
    const int cold = p->clean < WARM_READS && m >= COLD_ROWS;
    gather_run(&g, cold ? p->cold_threads : p->warm_threads, cold ? COLD_GRAIN : WARM_GRAIN);
    if (g.bad >= 0) return *detail = g.bad, S_BAD_ROW;
    if (p->crcs) { /* (after the gather: a cold mapping's faults taken on the pool) */
        int64_t row;
        const int64_t block = check_blocks(p, rows, m, &row);
        if (row >= 0) return *detail = row, S_BAD_ROW;
        if (block >= 0) return *detail = block, S_CORRUPT;
    }
    /* (capped: an int counting every step would overflow in a long-lived server) */
    p->clean = g.major > 0 || advised > 0 ? 0 : p->clean < WARM_READS ? p->clean + 1 : WARM_READS;
    if (p->check_file) __atomic_store_n(&counters[C_CLEAN], p->clean, __ATOMIC_RELAXED);
    add(counters, C_MAJOR, g.major);
    add(counters, C_MINOR, g.minor);
    add(counters, C_DISK, g.inblock * 512 + (advised > 0 ? advised : 0));
    return 0;
}

int host_step(hoststep_t *s, const stepbufs_t *b, int64_t *scratch, int64_t *counters,
              int64_t *detail) {
    const int64_t n = b->n, start = s->start, end = s->end, *ids = b->ids;
    int64_t *rows = scratch, *pos = scratch + n, *restrict tmp = scratch + 2 * n;
    int64_t *index = b->index;
    const int64_t bad_id = ids_first_outside(ids, n, s->rows);
    if (bad_id >= 0) return *detail = bad_id, S_BAD_ID;
    for (int i = 0; i < s->nparts; i++) {
        const part_t *p = &s->parts[i];
        if (p->check_file && (*detail = file_state(p->fd, p->size, p->nlink, p->ctime_ns)))
            return S_FILE_CHANGED;
    }
    /* this rank's ids in order, repeats included (Executor.rows_to_read), and the index as
     * one part's staging without a cache has them: row j of staging, -1 (another rank's:
     * zeros); a cache's probe and a split into parts write it again. Where the rank holds
     * every row, the ids as they are. */
    const int64_t *mine = ids, *mine_pos = NULL;
    int64_t u = n;
    if (start > 0 || end < s->rows) {
        u = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t id = ids[i], in = id >= start && id < end;
            index[i] = in ? u : -1;
            rows[u] = id, pos[u] = i, u += in; /* (no branch: another rank's ids come mixed) */
        }
        mine = rows, mine_pos = pos;
    } else if (!s->dir && s->nparts == 1) {
        for (int64_t i = 0; i < n; i++) index[i] = i;
    }
    int64_t m = u, base = 0;
    if (s->dir) { /* hits: their slot; the misses stay to read */
        m = probe_cache(s->dir, mine, mine_pos, u, rows, pos, tmp, b, index);
        mine = rows, mine_pos = pos;
        add(counters, C_GPU_HITS, u - m);
        base = s->dir->base;
    }
    int64_t first = m;
    if (s->nparts > 1) {
        first = split(&s->parts[0], mine, mine_pos, m, rows, pos, tmp);
        mine = rows, mine_pos = pos;
        for (int64_t j = 0; j < m; j++) index[pos[j]] = base + j;
    }
    const int64_t t0 = now_ns();
    int64_t at = 0;
    for (int i = 0; i < s->nparts && at < m; i++) {
        const int64_t k = i + 1 < s->nparts ? first : m - at, offset = at * b->stride;
        int64_t d = 0;
        if (!k) continue;
        const int state = read_part(&s->parts[i], mine + at, k, b->out + offset, b->stride,
                                    b->out_len - offset, tmp, counters, &d);
        if (state) return *detail = state == S_BAD_ROW ? pos_of(mine_pos, at + d) : d, state;
        at += k;
    }
    add(counters, C_GATHER_NS, now_ns() - t0);
    add(counters, C_STEPS, 1);
    add(counters, C_ROWS, n);
    add(counters, C_ABSENT, n - u);
    return 0;
}

/* -- the plan from Python ---------------------------------------------------------------------
 * plan = (rows, start, end, parts, cache)
 *   parts: ((lo, hi, streaming, source), ...), source a DirectCore or a gather: (src,
 *          src_offset, row_bytes, base, rows_per_block, block, stride, warm_threads,
 *          cold_threads, clean, file: None or (fd, size, nlink, ctime_ns), checks: None or
 *          (crcs uint32, check_unit, data_bytes)); clean: reads in a row that needed no disk
 *          (cold below WARM_READS); checks: verify_reads' block CRC-32s of src's rows
 *   cache: None or (lock, static_tags, tags, stamp, sketch, state, resident_start,
 *          resident_end, static_sets, sets, ways, sketch_mask, saturated, age_every, base) */
/* verify_reads' CRC-32s of a gather part (checks: None or (crcs, check_unit, data_bytes)) */
static int parse_checks(PyObject *checks, part_t *p, Py_buffer *crcs) {
    PyObject *obj;
    long long unit, data;
    if (checks == Py_None) return 0;
    if (!PyArg_ParseTuple(checks, "OLL", &obj, &unit, &data)) return -1;
    if (get_buf(obj, crcs, 0, 0, "a part's crcs") < 0) return -1;
    if (crcs->itemsize != 4 || unit < 1 || data < 0 || data > p->src_bytes ||
        crcs->len / 4 < (data + unit - 1) / unit) {
        PyBuffer_Release(crcs);
        crcs->obj = NULL;
        PyErr_SetString(PyExc_ValueError, "host step: a part's crcs (uint32) do not cover it");
        return -1;
    }
    p->crcs = crcs->buf, p->check_unit = unit, p->data_bytes = data;
    return 0;
}

/* native/plans.py's GatherPlan, in its fields' order */
static int parse_gather(PyObject *obj, part_t *p, Py_buffer *src, Py_buffer *crcs) {
    PyObject *buf, *file, *checks;
    long long off, rb, base, rpb, block, stride;
    int clean;
    if (!PyArg_ParseTuple(obj, "OLLLLLLiiiOO", &buf, &off, &rb, &base, &rpb, &block, &stride,
                          &p->warm_threads, &p->cold_threads, &clean, &file, &checks))
        return -1;
    p->clean = clean < 0 ? 0 : clean < WARM_READS ? clean : WARM_READS;
    if (!layout_ok(rpb, block, stride, rb) || off < 0) {
        PyErr_SetString(PyExc_ValueError, "host step: a part's layout is not one RowLayout makes");
        return -1;
    }
    p->check_file = file != Py_None;
    if (p->check_file &&
        !PyArg_ParseTuple(file, "iLKL", &p->fd, &p->size, &p->nlink, &p->ctime_ns))
        return -1;
    if (get_buf(buf, src, 0, 0, "a part's src") < 0) return -1;
    if (off > src->len) {
        PyBuffer_Release(src);
        PyErr_SetString(PyExc_ValueError, "host step: src_offset past src");
        return -1;
    }
    p->map = src->buf, p->map_bytes = src->len, p->src_offset = off;
    p->src = (const uint8_t *)src->buf + off, p->src_bytes = src->len - off;
    p->row_bytes = rb, p->base = base, p->layout = (layout_t){rpb, block, stride};
    if (parse_checks(checks, p, crcs) < 0) {
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

static const char *const dir_names[] = {"static_tags", "tags", "stamp", "sketch", "state"};

/* native/plans.py's CachePlan, in its fields' order */
static int parse_cache(PyObject *obj, dir_t *c, Py_buffer v[5], int *taken) {
    PyObject *lock, *o[5];
    long long r0, r1, static_sets, sets, ways, mask, saturated, age_every, base;
    if (!PyArg_ParseTuple(obj, "OOOOOOLLLLLLLLL", &lock, &o[0], &o[1], &o[2], &o[3], &o[4], &r0,
                          &r1, &static_sets, &sets, &ways, &mask, &saturated, &age_every, &base))
        return -1;
    if (!is_mutex(lock)) {
        PyErr_SetString(PyExc_TypeError, "host step: the cache's lock must be the core's Mutex");
        return -1;
    }
    static const int writable[] = {0, 0, 1, 1, 1};
    for (*taken = 0; *taken < 5; ++*taken) {
        const int i = *taken, sketch = i == 3;
        if (get_buf(o[i], &v[i], writable[i], !sketch, dir_names[i]) < 0) return -1;
        if (sketch && v[i].itemsize != 4) {
            ++*taken;
            PyErr_SetString(PyExc_ValueError, "host step: the sketch must hold int32");
            return -1;
        }
    }
    if (v[0].len / 8 < static_sets * STATIC_WAYS || v[1].len / 8 < sets * ways ||
        v[2].len / 8 < sets * ways || (sets && v[3].len / 4 < mask + 1) || v[4].len / 8 < 3 ||
        static_sets < 0 || sets < 0 || ways < 1 || r0 < 0 || r1 < r0 || mask < 0 || base < 0 ||
        age_every < 1) {
        PyErr_SetString(PyExc_ValueError, "host step: the cache's arrays or geometry disagree");
        return -1;
    }
    *c = (dir_t){lock, v[0].buf, v[1].buf, v[2].buf, v[4].buf, v[3].buf, v[3].len / 4, r0, r1,
                 static_sets, sets, ways, mask, saturated, age_every, base};
    return 0;
}

int host_step_parse(PyObject *plan, hoststep_hold *h) {
    PyObject *parts, *cache;
    long long rows, start, end;
    memset(h, 0, sizeof *h);
    if (!PyArg_ParseTuple(plan, "LLLO!O", &rows, &start, &end, &PyTuple_Type, &parts, &cache))
        return -1;
    hoststep_t *s = &h->step;
    const Py_ssize_t k = PyTuple_GET_SIZE(parts);
    if (k < 1 || k > 2 || start < 0 || end < start || rows < end) {
        PyErr_SetString(PyExc_ValueError, "host step: 1 or 2 parts and a row range in the table");
        return -1;
    }
    s->rows = rows, s->start = start, s->end = end;
    for (; s->nparts < k; s->nparts++) {
        part_t *p = &s->parts[s->nparts];
        PyObject *source;
        long long lo, hi;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts, s->nparts), "LLpO", &lo, &hi,
                              &p->streaming, &source))
            goto fail;
        p->lo = lo, p->hi = hi;
        if (is_direct_core(source)) {
            p->direct = source;
        } else if (!PyTuple_Check(source) ||
                   parse_gather(source, p, &h->src[s->nparts], &h->crcs[s->nparts]) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "host step: a part reads by a gather or a "
                                                 "DirectCore");
            goto fail;
        } else {
            h->srcs = s->nparts + 1;
        }
    }
    if (cache != Py_None) {
        if (parse_cache(cache, &h->dir, h->arrays, &h->taken) < 0) goto fail;
        s->dir = &h->dir;
    }
    return 0;
fail:
    host_step_release(h);
    return -1;
}

void host_step_release(hoststep_hold *h) {
    for (int i = 0; i < h->srcs; i++)
        if (h->src[i].obj) PyBuffer_Release(&h->src[i]);
    for (int i = 0; i < 2; i++)
        if (h->crcs[i].obj) PyBuffer_Release(&h->crcs[i]), h->crcs[i].obj = NULL;
    while (h->taken) PyBuffer_Release(&h->arrays[--h->taken]);
    h->srcs = 0;
}
