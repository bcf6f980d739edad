/* The mapped tier's cold-read hint in one call: the pages of a lookup's rows handed to the
 * kernel at once (MADV_WILLNEED, one call per run of adjacent pages), so the read's faults wait
 * on reads already in flight; skipped when a sample of them is in the page cache (mincore). In
 * numpy and ctypes (the reference) it takes a decode step's rows longer than the kernel's own
 * work (RESULTS.md "host time, part by part"). */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core.h"
#include "pybuf.h"

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Advise the pages of rows at offs[0..n) (bytes from map + start): -1 if probe > 0 and the
 * pages of the first `probe` rows are all resident (nothing advised), else the bytes the kernel
 * read from storage in this thread doing it. pages: scratch of 2n. */
static int64_t advise(uint8_t *map, int64_t start, const int64_t *offs, int64_t n,
                      int64_t row_bytes, int64_t probe, int64_t *pages) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    int cold = probe <= 0;
    for (int64_t i = 0; i < n && i < probe && !cold; i++) {
        unsigned char vec = 0;
        const int64_t p = (start + offs[i]) / page;
        cold = mincore(map + p * page, (size_t)page, &vec) != 0 || !(vec & 1);
    }
    if (!cold) return -1;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        pages[k++] = (start + offs[i]) / page;
        pages[k++] = (start + offs[i] + row_bytes - 1) / page;
    }
    qsort(pages, (size_t)k, sizeof *pages, cmp_i64);
    struct rusage r0, r1;
    getrusage(RUSAGE_THREAD, &r0);
    for (int64_t i = 0; i < k;) { /* one call per run of adjacent pages */
        int64_t j = i + 1;
        while (j < k && pages[j] <= pages[j - 1] + 1) j++;
        madvise(map + pages[i] * page, (size_t)((pages[j - 1] - pages[i] + 1) * page),
                MADV_WILLNEED);
        i = j;
    }
    getrusage(RUSAGE_THREAD, &r1);
    return (int64_t)(r1.ru_inblock - r0.ru_inblock) * 512;
}

int64_t willneed_rows(const uint8_t *map, int64_t map_bytes, int64_t src_offset,
                      const int64_t *ids, int64_t n, int64_t row_bytes, int64_t base,
                      layout_t layout, int64_t probe, int64_t *scratch) {
    const int64_t bytes = map_bytes - src_offset;
    const bounds_t lim = {layout, base, bytes / layout.block, bytes - row_bytes};
    int64_t k = 0;
    for (int64_t i = 0; i < n && bytes > 0; i++) {
        const int64_t off = offset_of(&lim, ids[i]);
        if (off >= 0) scratch[k++] = off;
    }
    return advise((uint8_t *)map, src_offset, scratch, k, row_bytes, probe, scratch + n);
}

/* willneed(src, ids, row_bytes, base, rows_per_block, block, stride, src_offset, probe) -> see
 * advise(); rows outside src are left out (the read that follows raises for them) */
PyObject *py_willneed(PyObject *self, PyObject *args) {
    PyObject *src_obj, *ids_obj;
    long long row_bytes, base, rpb, block, stride, src_offset, probe;
    if (!PyArg_ParseTuple(args, "OOLLLLLLL", &src_obj, &ids_obj, &row_bytes, &base, &rpb, &block,
                          &stride, &src_offset, &probe))
        return NULL;
    if (!layout_ok(rpb, block, stride, row_bytes) || src_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "willneed: bad layout");
        return NULL;
    }
    Py_buffer src, ids;
    if (get_buf(src_obj, &src, 0, 0, "src") < 0) return NULL;
    if (get_buf(ids_obj, &ids, 0, 1, "ids") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const int64_t n = ids.len / 8;
    int64_t *offs = malloc((size_t)(3 * n + 1) * sizeof *offs); /* offsets, then pages [2n] */
    PyObject *result = NULL;
    if (!offs) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t got;
    Py_BEGIN_ALLOW_THREADS;
    got = willneed_rows(src.buf, src.len, src_offset, ids.buf, n, row_bytes, base,
                        (layout_t){rpb, block, stride}, probe, offs);
    Py_END_ALLOW_THREADS;
    result = PyLong_FromLongLong(got);
    free(offs);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&ids);
    return result;
}
