/* check_ids: the first id outside a table's rows, in one pass with no temporaries. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"
#include "pybuf.h"

/* whether any id lies outside [0, rows), as one unsigned max (negative ids are the largest);
 * on x86-64 also compiled for AVX-512 and AVX2, picked at load time as numpy picks its loops
 * (the baseline has no 64-bit vector compare. measured: RESULTS.md "native host core") */
#if defined(__x86_64__) && defined(__GLIBC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static int any_outside(const int64_t *v, int64_t n, int64_t rows) {
    uint64_t top = 0;
    for (int64_t i = 0; i < n; i++) top = (uint64_t)v[i] > top ? (uint64_t)v[i] : top;
    return top >= (uint64_t)rows;
}

int64_t ids_first_outside(const int64_t *v, int64_t n, int64_t rows) {
    if (any_outside(v, n, rows))
        for (int64_t i = 0; i < n; i++)
            if (v[i] < 0 || v[i] >= rows) return i;
    return -1;
}

PyObject *py_check_ids(PyObject *self, PyObject *args) {
    PyObject *ids_obj;
    long long rows;
    if (!PyArg_ParseTuple(args, "OL", &ids_obj, &rows)) return NULL;
    Py_buffer ids;
    if (get_buf(ids_obj, &ids, 0, 1, "ids") < 0) return NULL;
    const int64_t *v = ids.buf;
    int64_t n = ids.len / 8;
    PyThreadState *save = n > (1 << 16) ? PyEval_SaveThread() : NULL;
    const int64_t bad = ids_first_outside(v, n, rows);
    if (save) PyEval_RestoreThread(save);
    PyBuffer_Release(&ids);
    return PyLong_FromLongLong(bad);
}
