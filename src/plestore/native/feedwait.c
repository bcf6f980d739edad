/* wait_word: spin, without the GIL, until a 64-bit word that another agent writes (the GPU,
 * through mapped pinned memory) differs from `last`, or the time is up. The host side of a
 * captured host-fed lookup (lookup/graphfeed.py) waits here for each step's ids. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#include "pybuf.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

PyObject *py_wait_word(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    long long last;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "OnLd", &obj, &index, &last, &timeout_s)) return NULL;
    Py_buffer buf;
    if (get_buf(obj, &buf, 0, 1, "words") < 0) return NULL;
    if (index < 0 || (index + 1) * 8 > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_IndexError, "wait_word: index outside the buffer");
        return NULL;
    }
    volatile const int64_t *word = (volatile const int64_t *)buf.buf + index;
    int64_t value, deadline;
    Py_BEGIN_ALLOW_THREADS;
    deadline = now_ns() + (int64_t)(timeout_s * 1e9);
    for (unsigned spins = 0;; spins++) {
        value = *word;
        if (value != last) break;
        if ((spins & 1023) == 0 && now_ns() > deadline) break;
        RELAX();
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* what was written before the word, read after */
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&buf);
    return PyLong_FromLongLong(value);
}
