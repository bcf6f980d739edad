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

/* -- Mutex ------------------------------------------------------------------------------------
 * A lock Python holds with `with` and C code without the GIL takes too (a graph feed's host step
 * and GpuRowCache share the GPU row cache directory under one). Waiting releases the GIL. */
typedef struct {
    PyObject_HEAD pthread_mutex_t mu;
} Mutex;

static int mutex_init(Mutex *m, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Mutex() takes no arguments");
        return -1;
    }
    pthread_mutex_init(&m->mu, NULL);
    return 0;
}

static void mutex_dealloc(Mutex *m) {
    pthread_mutex_destroy(&m->mu);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

void mutex_lock(void *mutex) { pthread_mutex_lock(&((Mutex *)mutex)->mu); }
void mutex_unlock(void *mutex) { pthread_mutex_unlock(&((Mutex *)mutex)->mu); }
int is_mutex(PyObject *obj);

static PyObject *mutex_acquire(Mutex *m, PyObject *unused) {
    if (pthread_mutex_trylock(&m->mu)) { /* held: wait without the GIL */
        Py_BEGIN_ALLOW_THREADS;
        pthread_mutex_lock(&m->mu);
        Py_END_ALLOW_THREADS;
    }
    Py_RETURN_TRUE;
}

static PyObject *mutex_release(Mutex *m, PyObject *unused) {
    pthread_mutex_unlock(&m->mu);
    Py_RETURN_NONE;
}

static PyObject *mutex_exit(Mutex *m, PyObject *args) { return mutex_release(m, NULL); }

static PyMethodDef mutex_methods[] = {
    {"acquire", (PyCFunction)mutex_acquire, METH_NOARGS, "wait for the lock (the GIL released)"},
    {"release", (PyCFunction)mutex_release, METH_NOARGS, "let the lock go"},
    {"__enter__", (PyCFunction)mutex_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)mutex_exit, METH_VARARGS, NULL},
    {NULL}};

static PyTypeObject MutexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "plestore.native._core.Mutex",
    .tp_basicsize = sizeof(Mutex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A lock shared by Python (with) and the core's code that runs without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mutex_init,
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_methods = mutex_methods,
};

int is_mutex(PyObject *obj) { return PyObject_TypeCheck(obj, &MutexType); }

PyObject *py_check_ids(PyObject *self, PyObject *args);    /* ids.c */
PyObject *py_gather(PyObject *self, PyObject *args, PyObject *kw);       /* gatherpy.c */
PyObject *py_gather_start(PyObject *self, PyObject *args, PyObject *kw); /* gatherpy.c */
extern PyTypeObject GatherJobType;                                       /* gatherpy.c */
extern PyTypeObject DirectCoreType;                                      /* directpy.c */
PyObject *py_crc32_blocks(PyObject *self, PyObject *args); /* crc.c */
PyObject *py_check_file(PyObject *self, PyObject *args);   /* filecheck.c */
PyObject *py_cache_locate(PyObject *self, PyObject *args); /* gpudirectory.c */
PyObject *py_cache_admit(PyObject *self, PyObject *args);  /* gpudirectory.c */
PyObject *py_willneed(PyObject *self, PyObject *args);     /* willneed.c */
PyObject *py_recode_nvfp4(PyObject *self, PyObject *args); /* recode.c */
PyObject *py_feed_serve(PyObject *self, PyObject *args);   /* feedserve.c */
PyObject *py_publish(PyObject *self, PyObject *args);      /* feedserve.c */
PyObject *py_feed_wake(PyObject *self, PyObject *args);    /* feedserve.c */
PyObject *py_clear_if(PyObject *self, PyObject *args);     /* feedserve.c */
PyObject *py_host_step(PyObject *self, PyObject *args);    /* feedserve.c */

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
     "cache_locate(rows, slot_out, static_tags, tags, stamp, sketch, state, resident_start, "
     "resident_end, static_sets, sets, ways, touch, sketch_mask, saturated, age_every, "
     "threads=1): the GPU row cache directory's probe (GpuCacheDirectory.locate): touching, its "
     "clock (state[0]) advanced, hits stamped, rows counted, counters halved every age_every "
     "ids counted (state[1])"},
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
    {"publish", py_publish, METH_VARARGS,
     "publish(words int64, i, value): words[i] = value by a release store (every store before "
     "it visible first, on weakly ordered hosts too): a feed's READY after rows staged in Python"},
    {"clear_if", py_clear_if, METH_VARARGS,
     "clear_if(words int64, i, expected) -> bool: words[i] = 0 where it still holds expected "
     "(compare-and-swap): a feed's error word cleared without erasing a later step's"},
    {"feed_wake", py_feed_wake, METH_VARARGS,
     "feed_wake(words int64): a graph feed's host side woken from its sleep between polls (a "
     "step is coming): it spins again as after a post"},
    {"host_step", py_host_step, METH_VARARGS,
     "host_step(plan, (box, out, index, held), counters int64) -> (state, detail): one host "
     "step without the GIL (hoststep.c: feed_serve's, for a staged lookup's stage())"},
    {"pool_size", py_pool_size, METH_NOARGS, "threads the pool has started"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core",
                                    "plestore's native host core (see plestore.native)", -1,
                                    methods};

/* constants.h's values: CONSTANTS {name: value}, STATES and COUNTERS (their names, in order) */
static int add_constants(PyObject *m) {
    PyObject *numbers = PyDict_New(), *states = NULL, *counters = NULL, *v;
    if (!numbers) return -1;
#define ADD_NUMBER(name)                                                                         \
    if (!(v = PyLong_FromUnsignedLongLong((unsigned long long)(name))) ||                        \
        PyDict_SetItemString(numbers, #name, v) < 0)                                             \
        goto fail;                                                                               \
    Py_DECREF(v);
    SHARED_NUMBERS(ADD_NUMBER)
#define STATE_NAME(name) #name,
#define COUNTER_NAME(name, py) #name, #py,
    static const char *const state_names[] = {SHARED_STATES(STATE_NAME)};
    static const char *const counter_names[] = {SHARED_COUNTERS(COUNTER_NAME)};
    v = NULL;
    if (!(states = PyTuple_New(S_COUNT)) || !(counters = PyTuple_New(C_WORDS))) goto fail;
    for (int i = 0; i < S_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(state_names[i]);
        if (!name) goto fail;
        PyTuple_SET_ITEM(states, i, name);
    }
    for (int i = 0; i < C_WORDS; i++) {
        PyObject *pair = Py_BuildValue("(ss)", counter_names[2 * i], counter_names[2 * i + 1]);
        if (!pair) goto fail;
        PyTuple_SET_ITEM(counters, i, pair);
    }
    if (PyModule_AddObject(m, "CONSTANTS", numbers) < 0) goto fail;
    numbers = NULL;
    if (PyModule_AddObject(m, "STATES", states) < 0) goto fail;
    states = NULL;
    if (PyModule_AddObject(m, "COUNTERS", counters) < 0) goto fail;
    return 0;
fail:
    Py_XDECREF(v);
    Py_XDECREF(numbers);
    Py_XDECREF(states);
    Py_XDECREF(counters);
    return -1;
}

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&DirectCoreType) < 0 || PyType_Ready(&GatherJobType) < 0 ||
        PyType_Ready(&MutexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0 || add_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&DirectCoreType);
    if (PyModule_AddObject(m, "DirectCore", (PyObject *)&DirectCoreType) < 0) {
        Py_DECREF(&DirectCoreType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&MutexType);
    if (PyModule_AddObject(m, "Mutex", (PyObject *)&MutexType) < 0) {
        Py_DECREF(&MutexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
