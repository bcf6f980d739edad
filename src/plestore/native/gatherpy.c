/* Python bindings of the gathers (gather.c): gather(), one call, and gather_start(), a gather
 * begun on the pool whose rows are waited for a prefix at a time (`GatherJob`), so each
 * prefix's copy to the GPU is queued while the pool gathers the rest (by the caller, or by
 * GatherJob.copy in one call). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"
#include "pybuf.h"

/* gathers of at most this many rows run in the calling thread with the GIL held */
#define INLINE_ROWS 256
/* rows per piece of a gather on the pool: a batch-1 prefill chunk's 2,048 rows stay on one
 * thread (waking threads costs more than such a gather: RESULTS.md "e2e: host gathers"),
 * 65,536 rows are 32 pieces */
#define GRAIN 2048

typedef struct {
    Py_buffer src, ids, out;
    int threads, blocking;
    long long grain;
} gather_args;

/* gather(...)'s arguments into g and a (its buffers held: args_release) */
static int parse(PyObject *args, PyObject *kw, gather_t *g, gather_args *a) {
    static char *names[] = {"src", "ids", "out", "out_stride", "row_bytes", "base",
                            "rows_per_block", "block", "stride", "threads", "grain",
                            "count_faults", "src_offset", "blocking", "streaming", NULL};
    PyObject *src_obj, *ids_obj, *out_obj;
    long long out_stride, row_bytes, base, rpb, block, stride, src_offset = 0;
    int count_faults = 0, streaming = 0;
    a->threads = 1, a->blocking = 0, a->grain = GRAIN;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOLLLLLL|iLpLpp", names, &src_obj, &ids_obj,
                                     &out_obj, &out_stride, &row_bytes, &base, &rpb, &block,
                                     &stride, &a->threads, &a->grain, &count_faults,
                                     &src_offset, &a->blocking, &streaming))
        return -1;
    if (!layout_ok(rpb, block, stride, row_bytes) || out_stride < row_bytes || src_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "gather: bad layout or strides");
        return -1;
    }
    if (get_buf(src_obj, &a->src, 0, 0, "src") < 0) return -1;
    if (get_buf(ids_obj, &a->ids, 0, 1, "ids") < 0) {
        PyBuffer_Release(&a->src);
        return -1;
    }
    if (get_buf(out_obj, &a->out, 1, 0, "out") < 0) {
        PyBuffer_Release(&a->src);
        PyBuffer_Release(&a->ids);
        return -1;
    }
    *g = (gather_t){0};
    g->count = a->ids.len / 8;
    if (src_offset > a->src.len ||
        (g->count && (g->count - 1) * out_stride + row_bytes > a->out.len)) {
        PyErr_SetString(PyExc_ValueError, "gather: out is too small for the rows");
        PyBuffer_Release(&a->src);
        PyBuffer_Release(&a->ids);
        PyBuffer_Release(&a->out);
        return -1;
    }
    g->src = (const uint8_t *)a->src.buf + src_offset;
    g->src_bytes = a->src.len - src_offset;
    g->ids = a->ids.buf;
    g->base = base;
    g->layout = (layout_t){rpb, block, stride};
    g->row_bytes = row_bytes;
    g->out = a->out.buf;
    g->out_stride = out_stride;
    g->out_len = a->out.len;
    g->count_faults = count_faults;
    g->streaming = streaming && gather_can_stream(out_stride);
    return 0;
}

static void args_release(gather_args *a) {
    PyBuffer_Release(&a->src);
    PyBuffer_Release(&a->ids);
    PyBuffer_Release(&a->out);
}

static PyObject *results(const gather_t *g) {
    return Py_BuildValue("LLLL", (long long)g->bad, (long long)g->major, (long long)g->minor,
                         (long long)g->inblock * 512);
}

PyObject *py_gather(PyObject *self, PyObject *args, PyObject *kw) {
    gather_t g;
    gather_args a;
    if (parse(args, kw, &g, &a) < 0) return NULL;
    if (!a.blocking && g.count <= INLINE_ROWS && (a.threads <= 1 || g.count <= a.grain)) {
        gather_run(&g, 1, g.count);
    } else {
        Py_BEGIN_ALLOW_THREADS;
        gather_run(&g, a.threads, a.grain);
        Py_END_ALLOW_THREADS;
    }
    args_release(&a);
    return results(&g);
}

/* -- GatherJob ------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD gather_job job;
    gather_args a;
    int live;   /* begun, not yet ended: the buffers held, the pool maybe still writing out */
    int in_use; /* a wait or finish runs without the GIL (set and read under it) */
} GatherJob;

static int enter(GatherJob *j) {
    if (!j->in_use) return j->in_use = 1;
    PyErr_SetString(PyExc_RuntimeError, "a GatherJob is waited for by one thread at a time");
    return 0;
}

static void job_end(GatherJob *j) {
    if (!j->live) return;
    Py_BEGIN_ALLOW_THREADS;
    gather_end(&j->job);
    Py_END_ALLOW_THREADS;
    j->live = 0;
    args_release(&j->a);
}

static PyObject *job_wait(GatherJob *j, PyObject *arg) {
    long long rows = PyLong_AsLongLong(arg);
    if ((rows == -1 && PyErr_Occurred()) || !enter(j)) return NULL;
    if (j->live && rows > 0) {
        Py_BEGIN_ALLOW_THREADS;
        gather_wait(&j->job, rows);
        Py_END_ALLOW_THREADS;
    }
    j->in_use = 0;
    return PyLong_FromLongLong((long long)__atomic_load_n(&j->job.g.bad, __ATOMIC_RELAXED));
}

/* CUDA's cuMemcpyHtoDAsync (its address is handed in: the core links no CUDA library) */
typedef int (*h2d_fn)(unsigned long long dst, const void *src, size_t bytes, void *stream);

/* copy(dst, stream, chunk_rows, h2d) -> (a bad position or -1, the first failed copy's CUDA
 * error or 0): out's rows queued for a copy to device memory at dst on `stream`, `chunk_rows`
 * at a time, each chunk as soon as the pool has written it. Stops at a bad row or a failed
 * copy. The caller's thread must have the stream's CUDA context current. */
static PyObject *job_copy(GatherJob *j, PyObject *args) {
    unsigned long long dst, stream, fn;
    long long chunk;
    if (!PyArg_ParseTuple(args, "KKLK", &dst, &stream, &chunk, &fn)) return NULL;
    if (chunk < 1 || !fn || !dst) {
        PyErr_SetString(PyExc_ValueError, "copy: needs chunk_rows >= 1, a device address, h2d");
        return NULL;
    }
    if (!enter(j)) return NULL;
    int err = 0;
    if (j->live) {
        const gather_t *g = &j->job.g;
        const h2d_fn h2d = (h2d_fn)(uintptr_t)fn;
        const int64_t stride = g->out_stride;
        Py_BEGIN_ALLOW_THREADS;
        for (int64_t a = 0; a < g->count && !err; a += chunk) {
            const int64_t b = a + chunk < g->count ? a + chunk : g->count;
            gather_wait(&j->job, b);
            if (__atomic_load_n(&g->bad, __ATOMIC_RELAXED) >= 0) break;
            int64_t bytes = (b - a) * stride; /* (the last row's padding may lie past out) */
            if (a * stride + bytes > g->out_len) bytes = g->out_len - a * stride;
            err = h2d(dst + (unsigned long long)(a * stride), g->out + a * stride, (size_t)bytes,
                      (void *)(uintptr_t)stream);
        }
        Py_END_ALLOW_THREADS;
    }
    j->in_use = 0;
    return Py_BuildValue("Li", (long long)__atomic_load_n(&j->job.g.bad, __ATOMIC_RELAXED), err);
}

static PyObject *job_finish(GatherJob *j, PyObject *unused) {
    if (!enter(j)) return NULL;
    job_end(j);
    j->in_use = 0;
    return results(&j->job.g);
}

static void job_dealloc(GatherJob *j) {
    job_end(j); /* (never frees what the pool still writes) */
    Py_TYPE(j)->tp_free((PyObject *)j);
}

static PyMethodDef job_methods[] = {
    {"wait", (PyCFunction)job_wait, METH_O,
     "wait(rows) -> a bad position or -1 so far: out's first `rows` rows are written"},
    {"copy", (PyCFunction)job_copy, METH_VARARGS,
     "copy(dst, stream, chunk_rows, h2d) -> (a bad position or -1, a CUDA error or 0): each "
     "chunk of out queued for a copy to device memory at dst as soon as it is written"},
    {"finish", (PyCFunction)job_finish, METH_NOARGS,
     "finish() -> gather()'s result: every row written, the buffers let go"},
    {NULL}};

PyTypeObject GatherJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "plestore.native._core.GatherJob",
    .tp_basicsize = sizeof(GatherJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a gather begun on the pool (gather_start)",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
};

PyObject *py_gather_start(PyObject *self, PyObject *args, PyObject *kw) {
    GatherJob *j = PyObject_New(GatherJob, &GatherJobType);
    if (!j) return NULL;
    j->live = j->in_use = 0;
    if (parse(args, kw, &j->job.g, &j->a) < 0) {
        Py_DECREF(j);
        return NULL;
    }
    if (gather_begin(&j->job, j->a.threads, j->a.grain) < 0) {
        args_release(&j->a);
        Py_DECREF(j);
        return PyErr_NoMemory();
    }
    j->live = 1;
    return (PyObject *)j;
}
