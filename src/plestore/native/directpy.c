/* DirectCore: the direct tier's read (direct.c) as a Python type of the native core, and its
 * read under its lock for code without the GIL (a graph feed's host step). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "core.h"
#include "pybuf.h"

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
    d->by_sets = divisor_of((uint64_t)d->sets);
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

int64_t direct_core_read(void *core, const int64_t *rows, int64_t n, uint8_t *out,
                         int64_t out_stride, int64_t out_len, int streaming, int64_t *miss,
                         direct_result *res, int64_t *bytes) {
    DirectCore *c = core;
    if (out_stride < c->d.row_bytes || (n && (n - 1) * out_stride + c->d.row_bytes > out_len))
        return -2;
    int64_t hits = -1;
    pthread_mutex_lock(&c->mu);
    if (__atomic_load_n(&c->held, __ATOMIC_RELAXED)) { /* (closed meanwhile?) */
        c->d.streaming = streaming;
        hits = direct_read(&c->d, rows, n, out, out_stride, out_len, miss, (uint8_t *)(miss + n),
                           res);
        *bytes = (res->blocks + res->ahead_blocks) * c->d.unit;
    }
    pthread_mutex_unlock(&c->mu);
    return hits;
}

/* read(rows, out, out_stride, streaming=False) -> (hits, blocks read now, blocks read at
 * prefetch, a block that failed its CRC-32 check or -1: nothing admitted then) */
static PyObject *core_read(DirectCore *c, PyObject *args) {
    PyObject *rows_obj, *out_obj;
    long long out_stride;
    int streaming = 0;
    if (!PyArg_ParseTuple(args, "OOL|p", &rows_obj, &out_obj, &out_stride, &streaming))
        return NULL;
    if (!core_open(c)) return NULL;
    Py_buffer rows, out;
    if (get_buf(rows_obj, &rows, 0, 1, "rows") < 0) return NULL;
    if (get_buf(out_obj, &out, 1, 0, "out") < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    int64_t n = rows.len / 8, hits, bytes = 0;
    direct_result res = {0, 0, 0, -1, 0, 0, 0};
    PyObject *result = NULL;
    int64_t *miss = PyMem_RawMalloc((size_t)(n ? n : 1) * (sizeof *miss + 1));
    if (!miss) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    hits = direct_core_read(c, rows.buf, n, out.buf, out_stride, out.len, streaming, miss, &res,
                            &bytes);
    Py_END_ALLOW_THREADS;
    if (hits == -2) {
        PyErr_SetString(PyExc_ValueError, "read: out is too small for the rows");
        goto done;
    }
    if (hits == -1) {
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
    result = Py_BuildValue("LLLL", (long long)hits, (long long)res.blocks,
                           (long long)res.ahead_blocks, (long long)res.bad_block);
done:
    PyMem_RawFree(miss);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

/* clear(): every cached row forgotten */
static PyObject *core_clear(DirectCore *c, PyObject *unused) {
    if (!core_open(c)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&c->mu);
    if (__atomic_load_n(&c->held, __ATOMIC_RELAXED)) {
        const int64_t slots = c->d.sets * c->d.ways;
        for (int64_t i = 0; i < slots; i++) c->d.tags[i] = -1, c->d.stamp[i] = 0;
    }
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
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
     "read(rows, out, out_stride, streaming=False) -> (cache hits, blocks read, blocks read "
     "ahead, a block failing its CRC-32 or -1); streaming: the cache's rows reach out with "
     "non-temporal stores. Hits are stamped and misses admitted by the core's own clock"},
    {"clear", (PyCFunction)core_clear, METH_NOARGS, "forget every cached row"},
    {"prefetch", (PyCFunction)core_prefetch, METH_VARARGS,
     "prefetch(rows) -> block reads submitted for the rows the cache lacks"},
    {"inflight", (PyCFunction)core_inflight, METH_NOARGS, "reads started at prefetch, pending"},
    {"close", (PyCFunction)core_close, METH_NOARGS, "wait for reads in flight; free the rings"},
    {NULL}};

PyTypeObject DirectCoreType = {
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

int is_direct_core(PyObject *obj) { return PyObject_TypeCheck(obj, &DirectCoreType); }
