/* NVFP4 rows re-encoded through a symbol table: pack's format conversion (tablefile/convert.py).
 * A row's symbols are (block-scale byte << 8 | code byte), two values each; the table holds
 * each symbol's target bytes (w of them: both values' codes), and each symbol seen is counted
 * (the conversion's error sums come from that histogram). One pass at memory speed where numpy
 * needs four (symbols, their indices, a bincount, a take). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "core.h"
#include "pybuf.h"

static inline __attribute__((always_inline)) void recode_w(const uint8_t *raw, int64_t n,
                                                           int64_t dim, const uint8_t *lut,
                                                           const int w, uint8_t *out,
                                                           int64_t *counts) {
    const int64_t half = dim / 2, blocks = dim / 16, row_bytes = half + blocks;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *codes = raw + r * row_bytes, *scales = codes + half;
        for (int64_t b = 0; b < blocks; b++) {
            const uint32_t s = (uint32_t)scales[b] << 8;
            for (int k = 0; k < 8; k++) {
                const uint32_t sym = s | codes[b * 8 + k];
                memcpy(out, lut + (size_t)sym * w, w); /* (w a constant: one move) */
                out += w;
                counts[sym]++;
            }
        }
    }
}

static void recode(const uint8_t *raw, int64_t n, int64_t dim, const uint8_t *lut, int w,
                   uint8_t *out, int64_t *counts) {
    switch (w) { /* one loop per symbol width, each with its move inlined */
    case 1: recode_w(raw, n, dim, lut, 1, out, counts); break;
    case 2: recode_w(raw, n, dim, lut, 2, out, counts); break;
    case 4: recode_w(raw, n, dim, lut, 4, out, counts); break;
    default: recode_w(raw, n, dim, lut, 8, out, counts);
    }
}

/* recode_nvfp4(raw uint8 [n, dim/2 + dim/16], dim, lut [65536 * w bytes], out [n * dim/2 * w
 * bytes], counts int64 [65536]) -> None: out's symbols through lut, counts[symbol] += times
 * seen; a ValueError for buffers of other sizes */
PyObject *py_recode_nvfp4(PyObject *self, PyObject *args) {
    PyObject *raw_obj, *lut_obj, *out_obj, *counts_obj, *ret = NULL;
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OnOOO", &raw_obj, &dim, &lut_obj, &out_obj, &counts_obj))
        return NULL;
    Py_buffer raw, lut, out, counts;
    if (get_buf(raw_obj, &raw, 0, 0, "raw") < 0) return NULL;
    if (get_buf(lut_obj, &lut, 0, 0, "lut") < 0) goto no_lut;
    if (get_buf(out_obj, &out, 1, 0, "out") < 0) goto no_out;
    if (get_buf(counts_obj, &counts, 1, 1, "counts") < 0) goto no_counts;
    const int64_t row_bytes = dim / 2 + dim / 16, w = lut.len / 65536;
    if (dim <= 0 || dim % 16 || raw.len % row_bytes) {
        PyErr_Format(PyExc_ValueError, "raw (%zd B) is not NVFP4 rows of dim %zd", raw.len, dim);
        goto done;
    }
    const int64_t n = raw.len / row_bytes;
    if (lut.len % 65536 || (w != 1 && w != 2 && w != 4 && w != 8) ||
        out.len != n * (dim / 2) * w || counts.len != 65536 * 8) {
        PyErr_Format(PyExc_ValueError,
                     "lut must hold 65536 symbols of 1, 2, 4 or 8 B (%zd B), out %lld x %lld "
                     "symbols of them (%zd B), counts int64 [65536] (%zd B)",
                     lut.len, (long long)n, (long long)(dim / 2), out.len, counts.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS recode(raw.buf, n, dim, lut.buf, (int)w, out.buf, counts.buf);
    Py_END_ALLOW_THREADS ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&counts);
no_counts:
    PyBuffer_Release(&out);
no_out:
    PyBuffer_Release(&lut);
no_lut:
    PyBuffer_Release(&raw);
    return ret;
}
