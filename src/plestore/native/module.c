/* Python bindings of the native host core: `plestore.native._core`.
 *
 * The C API rather than ctypes: a decode step's lookup is tens of microseconds, and ctypes'
 * argument conversion (plus numpy's .ctypes per array) costs several per call. Buffers come in
 * through the buffer protocol (dtype and size checked here); the GIL is released around work
 * that can take long (I/O, large gathers, pool jobs) and kept for tiny ones, where handing it
 * back and forth costs more than the work (another thread may keep it a switch interval). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "core.h"
#include "pybuf.h"

int get_buf(PyObject *obj, Py_buffer *v, int writable, int int64, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", name,
                     writable ? " writable" : "");
        return -1;
    }
    if (int64) {
        const char *f = v->format ? v->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (v->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
            PyErr_Format(PyExc_ValueError, "%s must hold int64, got format '%s'", name,
                         v->format ? v->format : "B");
            PyBuffer_Release(v);
            return -1;
        }
    }
    return 0;
}

/* -- DirectCore ----------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD direct_t d;
    Py_buffer staging, ahead, tags, stamp, data, crcs; /* crcs: .obj NULL without checks */
    int held; /* buffers held (until close) */
    pthread_mutex_t mu;
} DirectCore;

static void core_release(DirectCore *c) {
    if (!c->held) return;
    __atomic_store_n(&c->held, 0, __ATOMIC_RELAXED); /* (read without the GIL under mu) */
    /* under the lock: a read or prefetch that passed core_open before this finds held = 0 once
     * it has the lock, and never a freed ring */
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&c->mu);
    direct_drop_ahead(&c->d);
    ring_close(c->d.ring);
    ring_close(c->d.ring_ahead);
    c->d.ring = c->d.ring_ahead = NULL;
    PyMem_RawFree(c->d.ahead_offs);
    c->d.ahead_offs = NULL;
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&c->staging);
    PyBuffer_Release(&c->ahead);
    PyBuffer_Release(&c->tags);
    PyBuffer_Release(&c->stamp);
    PyBuffer_Release(&c->data);
    if (c->crcs.obj) PyBuffer_Release(&c->crcs);
}

static void core_dealloc(DirectCore *c) {
    core_release(c);
    pthread_mutex_destroy(&c->mu);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static unsigned pow2_at_least(unsigned x) {
    unsigned p = 64;
    while (p < x) p <<= 1;
    return p;
}

static int core_init(DirectCore *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "file_size", "data_offset", "unit", "step", "row_bytes",
                            "rows_per_block", "block", "stride", "staging", "ahead",
                            "queue_depth", "tags", "stamp", "data", "threads", "crcs",
                            "check_unit", "data_bytes", "check_fd", NULL};
    direct_t *d = &c->d;
    PyObject *staging, *ahead, *tags, *stamp, *data, *crcs = Py_None;
    long long file_size, data_offset, unit, step, row_bytes, rpb, block, stride;
    long long check_unit = 0, data_bytes = 0;
    int fd, qd, threads = 1, check_fd = -1;
    if (c->held) {
        PyErr_SetString(PyExc_RuntimeError, "DirectCore is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLLLLLLLLOOiOOO|iOLLi", names, &fd, &file_size,
                                     &data_offset, &unit, &step, &row_bytes, &rpb, &block,
                                     &stride, &staging, &ahead, &qd, &tags, &stamp, &data,
                                     &threads, &crcs, &check_unit, &data_bytes, &check_fd))
        return -1;
    if (unit < 1 || step < 1 || rpb < 1 || block < 1 || row_bytes < 1 || qd < 1) {
        PyErr_SetString(PyExc_ValueError, "DirectCore: bad geometry");
        return -1;
    }
    memset(d, 0, sizeof *d);
    memset(&c->crcs, 0, sizeof c->crcs);
    if (crcs != Py_None) { /* verify_reads: every block read is checked before it is used */
        if (get_buf(crcs, &c->crcs, 0, 0, "crcs") < 0) return -1;
        if (c->crcs.itemsize != 4 || check_unit < 1 || data_bytes < 0 || check_fd < 0 ||
            c->crcs.len / 4 < (data_bytes + check_unit - 1) / check_unit) {
            PyBuffer_Release(&c->crcs);
            memset(&c->crcs, 0, sizeof c->crcs);
            PyErr_SetString(PyExc_ValueError, "DirectCore: crcs (uint32) do not cover the data");
            return -1;
        }
        d->crcs = c->crcs.buf;
        d->check_unit = check_unit;
        d->data_bytes = data_bytes;
        d->check_fd = check_fd;
    }
    if (get_buf(staging, &c->staging, 1, 0, "staging") < 0) goto fail0;
    if (get_buf(ahead, &c->ahead, 1, 0, "ahead") < 0) goto fail1;
    if (get_buf(tags, &c->tags, 1, 1, "tags") < 0) goto fail2;
    if (get_buf(stamp, &c->stamp, 1, 1, "stamp") < 0) goto fail3;
    if (get_buf(data, &c->data, 1, 0, "data") < 0) goto fail4;
    if (c->tags.ndim != 2 || c->stamp.len != c->tags.len ||
        c->data.len != (c->tags.len / 8) * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "DirectCore: cache arrays disagree in size");
        goto fail5;
    }
    d->fd = fd;
    d->file_size = file_size;
    d->data_offset = data_offset;
    d->unit = unit;
    d->step = step;
    d->row_bytes = row_bytes;
    d->layout = (layout_t){rpb, block, stride};
    d->staging = c->staging.buf;
    d->staging_units = c->staging.len / unit;
    d->ahead = c->ahead.buf;
    d->ahead_units = c->ahead.len / unit;
    d->qd = (unsigned)qd;
    d->threads = threads < 1 ? 1 : threads;
    d->tags = c->tags.buf;
    d->stamp = c->stamp.buf;
    d->data = c->data.buf;
    d->sets = c->tags.shape[0];
    d->ways = c->tags.shape[1];
    if (d->staging_units < 1) {
        PyErr_SetString(PyExc_ValueError, "DirectCore: staging holds no read unit");
        goto fail5;
    }
    int err = 0;
    d->ring = ring_open(pow2_at_least((unsigned)qd), &err);
    if (d->ring && d->ahead_units) {
        d->ring_ahead = ring_open(pow2_at_least((unsigned)d->ahead_units), &err);
        d->ahead_offs = PyMem_RawMalloc((size_t)d->ahead_units * sizeof(int64_t));
        if (!d->ring_ahead || !d->ahead_offs) {
            ring_close(d->ring);
            ring_close(d->ring_ahead);
            d->ring = d->ring_ahead = NULL;
            PyMem_RawFree(d->ahead_offs);
            d->ahead_offs = NULL;
            if (!err) err = ENOMEM;
        }
    }
    if (!d->ring) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail5;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->held = 1;
    return 0;
fail5:
    PyBuffer_Release(&c->data);
fail4:
    PyBuffer_Release(&c->stamp);
fail3:
    PyBuffer_Release(&c->tags);
fail2:
    PyBuffer_Release(&c->ahead);
fail1:
    PyBuffer_Release(&c->staging);
fail0:
    if (c->crcs.obj) PyBuffer_Release(&c->crcs);
    memset(&c->crcs, 0, sizeof c->crcs);
    return -1;
}

static int core_open(DirectCore *c) {
    if (!c->held) PyErr_SetString(PyExc_RuntimeError, "DirectCore is closed");
    return c->held;
}

/* read(rows, out, out_stride, clock) -> (hits, blocks read now, blocks read at prefetch, a block
 * that failed its CRC-32 check or -1: nothing admitted then) */
static PyObject *core_read(DirectCore *c, PyObject *args) {
    PyObject *rows_obj, *out_obj;
    long long out_stride, clock;
    int streaming = 0;
    if (!PyArg_ParseTuple(args, "OOLL|p", &rows_obj, &out_obj, &out_stride, &clock, &streaming))
        return NULL;
    if (!core_open(c)) return NULL;
    Py_buffer rows, out;
    if (get_buf(rows_obj, &rows, 0, 1, "rows") < 0) return NULL;
    if (get_buf(out_obj, &out, 1, 0, "out") < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    int64_t n = rows.len / 8;
    direct_result res = {0, 0, 0, -1, 0, 0, 0};
    PyObject *result = NULL;
    int64_t *miss = PyMem_RawMalloc((size_t)(n ? n : 1) * (sizeof *miss + 1));
    if (!miss) {
        PyErr_NoMemory();
        goto done;
    }
    if (out_stride < c->d.row_bytes || (n && (n - 1) * out_stride + c->d.row_bytes > out.len)) {
        PyErr_SetString(PyExc_ValueError, "read: out is too small for the rows");
        goto done;
    }
    const int64_t *r = rows.buf;
    uint8_t *o = out.buf;
    int64_t k = 0;
    int was_open;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&c->mu);
    was_open = __atomic_load_n(&c->held, __ATOMIC_RELAXED); /* (closed meanwhile?) */
    if (was_open) {
        c->d.streaming = streaming;
        k = direct_probe(&c->d, r, n, o, out_stride, out.len, clock, miss,
                         (uint8_t *)(miss + n), c->d.threads);
        direct_fill(&c->d, r, miss, k, o, out_stride, clock + 1, &res);
    }
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS;
    if (!was_open) {
        PyErr_SetString(PyExc_RuntimeError, "DirectCore is closed");
        goto done;
    }
    if (res.err) {
        PyObject *msg;
        /* the bytes expected: a unit, or up to the end of the file opened */
        int64_t want = c->d.file_size - res.bad_off < c->d.unit ? c->d.file_size - res.bad_off
                                                                 : c->d.unit;
        if (res.err == -EIO && res.got >= 0)
            msg = PyUnicode_FromFormat("short read at offset %lld: %lld of %lld bytes (file "
                                       "truncated?)", (long long)res.bad_off,
                                       (long long)res.got, (long long)want);
        else
            msg = PyUnicode_FromFormat("read at offset %lld failed: %s", (long long)res.bad_off,
                                       strerror(-res.err));
        if (msg) {
            PyObject *e = PyObject_CallFunction(PyExc_OSError, "iO", -res.err, msg);
            if (e) {
                PyErr_SetObject(PyExc_OSError, e);
                Py_DECREF(e);
            }
            Py_DECREF(msg);
        }
        goto done;
    }
    result = Py_BuildValue("LLLL", (long long)(n - k), (long long)res.blocks,
                           (long long)res.ahead_blocks, (long long)res.bad_block);
done:
    PyMem_RawFree(miss);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

/* prefetch(rows) -> the block reads submitted (0: none, or they could not be) */
static PyObject *core_prefetch(DirectCore *c, PyObject *args) {
    PyObject *rows_obj;
    if (!PyArg_ParseTuple(args, "O", &rows_obj)) return NULL;
    if (!core_open(c)) return NULL;
    Py_buffer rows;
    if (get_buf(rows_obj, &rows, 0, 1, "rows") < 0) return NULL;
    int64_t k = 0;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&c->mu);
    if (__atomic_load_n(&c->held, __ATOMIC_RELAXED)) k = direct_prefetch(&c->d, rows.buf, rows.len / 8);
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&rows);
    return PyLong_FromLongLong(k < 0 ? 0 : k);
}

static PyObject *core_inflight(DirectCore *c, PyObject *unused) {
    return PyBool_FromLong(c->held && c->d.ahead_live);
}

static PyObject *core_close(DirectCore *c, PyObject *unused) {
    core_release(c);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"read", (PyCFunction)core_read, METH_VARARGS,
     "read(rows, out, out_stride, clock, streaming=False) -> (cache hits, blocks read, blocks "
     "read ahead, a block failing its CRC-32 or -1); streaming: the cache's rows reach out with "
     "non-temporal stores"},
    {"prefetch", (PyCFunction)core_prefetch, METH_VARARGS,
     "prefetch(rows) -> block reads submitted for the rows the cache lacks"},
    {"inflight", (PyCFunction)core_inflight, METH_NOARGS, "reads started at prefetch, pending"},
    {"close", (PyCFunction)core_close, METH_NOARGS, "wait for reads in flight; free the rings"},
    {NULL}};

static PyTypeObject DirectCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "plestore.native._core.DirectCore",
    .tp_basicsize = sizeof(DirectCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The direct tier's read: cache probe, io_uring block reads, their checks, "
              "placing, admission.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
};

PyObject *py_check_ids(PyObject *self, PyObject *args);    /* ids.c */
PyObject *py_gather(PyObject *self, PyObject *args, PyObject *kw);       /* gatherpy.c */
PyObject *py_gather_start(PyObject *self, PyObject *args, PyObject *kw); /* gatherpy.c */
extern PyTypeObject GatherJobType;                                       /* gatherpy.c */
PyObject *py_crc32_blocks(PyObject *self, PyObject *args); /* crc.c */
PyObject *py_check_file(PyObject *self, PyObject *args);   /* filecheck.c */
PyObject *py_cache_locate(PyObject *self, PyObject *args); /* gpudirectory.c */
PyObject *py_cache_admit(PyObject *self, PyObject *args);  /* gpudirectory.c */
PyObject *py_willneed(PyObject *self, PyObject *args);     /* willneed.c */
PyObject *py_recode_nvfp4(PyObject *self, PyObject *args); /* recode.c */
PyObject *py_feed_serve(PyObject *self, PyObject *args);   /* feedserve.c */

static PyObject *py_pool_size(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(pool_size());
}

static PyMethodDef methods[] = {
    {"check_ids", py_check_ids, METH_VARARGS,
     "check_ids(ids int64, rows) -> the first position outside [0, rows), or -1"},
    {"gather", (PyCFunction)(void (*)(void))py_gather, METH_VARARGS | METH_KEYWORDS,
     "gather(src, ids, out, out_stride, row_bytes, base, rows_per_block, block, stride, "
     "threads=1, grain=2048, count_faults=False, src_offset=0, blocking=False, streaming=False) "
     "-> (bad position or -1, major faults, minor faults, bytes read from storage: the "
     "gathering threads' own, counted with count_faults); blocking: reads may wait on the disk "
     "(page faults), so the GIL is released whatever the size; streaming: non-temporal stores "
     "(out bound for a DMA copy, not the CPU; the rows' padding in out zeroed)"},
    {"gather_start", (PyCFunction)(void (*)(void))py_gather_start, METH_VARARGS | METH_KEYWORDS,
     "gather_start(the arguments of gather; blocking ignored) -> GatherJob: the gather begun on "
     "the pool; job.wait(rows) returns once out's first rows are written (the caller taking "
     "untaken pieces meanwhile), job.finish() gives gather()'s result"},
    {"check_file", py_check_file, METH_VARARGS,
     "check_file(fd, size, nlink, ctime_ns) -> 0: as seen (size bytes at least, that link count "
     "and change time); 1: truncated; 2: unlinked; 3: link count or change time moved; else "
     "-errno of fstat"},
    {"cache_locate", py_cache_locate, METH_VARARGS,
     "cache_locate(rows, slot_out, static_tags, tags, stamp, sketch, resident_start, "
     "resident_end, static_sets, sets, ways, clock, sketch_mask, saturated, threads=1): the GPU "
     "row cache directory's probe (GpuCacheDirectory.locate); clock < 0: no touch"},
    {"cache_admit", py_cache_admit, METH_VARARGS,
     "cache_admit(rows, slots_out, which_out, tags, stamp, sketch, sets, ways, first_dynamic, "
     "clock, sketch_mask, admit_min) -> (admitted, candidates): GpuCacheDirectory.admit (a "
     "repeated row once)"},
    {"willneed", py_willneed, METH_VARARGS,
     "willneed(src, ids, row_bytes, base, rows_per_block, block, stride, src_offset, probe) -> "
     "-1 (the first `probe` rows' pages are resident), else the bytes WILLNEED read"},
    {"crc32_blocks", py_crc32_blocks, METH_VARARGS,
     "crc32_blocks(buf, starts int64, sizes int64, out uint32, threads): out[i] = zlib's CRC-32 "
     "of buf[starts[i] : starts[i] + sizes[i]]"},
    {"recode_nvfp4", py_recode_nvfp4, METH_VARARGS,
     "recode_nvfp4(raw uint8 [n, dim/2 + dim/16], dim, lut [65536 symbols of w B], out [n * "
     "dim/2 symbols of w B], counts int64 [65536]): NVFP4 rows' symbols (block-scale byte << 8 "
     "| code byte) through lut into out, counts[symbol] += times seen"},
    {"feed_serve", py_feed_serve, METH_VARARGS,
     "feed_serve(words, counters, feeds, plan, last, timed_out, posted_ns, spin_s, sleep_s, "
     "sleep_max_s, "
     "return_s) -> (state, last seq, detail, posted_ns): a graph feed's host side without the "
     "GIL (feedserve.c; plan None: wait for a post only)"},
    {"pool_size", py_pool_size, METH_NOARGS, "threads the pool has started"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core",
                                    "plestore's native host core (see plestore.native)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&DirectCoreType) < 0 || PyType_Ready(&GatherJobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    /* the interface version plestore.native checks (2: check_file; gather's disk bytes;
     * 3: cache_locate, cache_admit; 4: admit takes repeats, locate threads; 5: willneed;
     * 6: crc32_blocks; 7: streaming gathers and direct reads, gather_start; 8: check_file
     * by one fstat; 9: GatherJob.copy; 10: DirectCore checks blocks, read's bad block;
     * 11: recode_nvfp4; 12: wait_word; 13: feed_serve, no wait_word) */
    if (PyModule_AddIntConstant(m, "ABI_VERSION", 13) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&DirectCoreType);
    if (PyModule_AddObject(m, "DirectCore", (PyObject *)&DirectCoreType) < 0) {
        Py_DECREF(&DirectCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
