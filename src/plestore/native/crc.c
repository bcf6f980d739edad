/* CRC-32 of many blocks in one call, on the pool: a table's block checks. zlib's CRC-32
 * (reflected polynomial 0xEDB88320, initial and final value ~0), eight bytes a step through
 * eight tables ("slicing by 8"). A table's load streams every block through its check: 56 M
 * 512-B blocks for the full-size table, one zlib.crc32 call each from Python was the load's
 * limit (RESULTS.md "GPU row cache: its start"). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <string.h>

#include "core.h"
#include "pybuf.h"

/* blocks per piece on the pool (1 MiB of 512-B blocks) */
#define CRC_GRAIN 2048

static uint32_t tab[8][256];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void make_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        tab[0][i] = c;
    }
    for (int s = 1; s < 8; s++)
        for (uint32_t i = 0; i < 256; i++)
            tab[s][i] = (tab[s - 1][i] >> 8) ^ tab[0][tab[s - 1][i] & 0xFF];
}

uint32_t crc32_bytes(const uint8_t *p, int64_t n) {
    pthread_once(&tab_once, make_tables);
    uint32_t c = 0xFFFFFFFFu;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = tab[7][lo & 0xFF] ^ tab[6][(lo >> 8) & 0xFF] ^ tab[5][(lo >> 16) & 0xFF] ^
            tab[4][lo >> 24] ^ tab[3][hi & 0xFF] ^ tab[2][(hi >> 8) & 0xFF] ^
            tab[1][(hi >> 16) & 0xFF] ^ tab[0][hi >> 24];
    }
#endif
    for (; n > 0; p++, n--) c = tab[0][(c ^ *p) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

typedef struct {
    const uint8_t *buf;
    const int64_t *starts, *sizes;
    uint32_t *out;
} crc_job;

static void crc_work(void *ctx, int64_t a, int64_t b, int worker) {
    const crc_job *j = ctx;
    (void)worker;
    for (int64_t i = a; i < b; i++) j->out[i] = crc32_bytes(j->buf + j->starts[i], j->sizes[i]);
}

/* crc32_blocks(buf, starts int64, sizes int64, out uint32, threads) -> None: out[i] = the
 * CRC-32 of buf[starts[i] : starts[i] + sizes[i]]; a ValueError for a block outside buf */
PyObject *py_crc32_blocks(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *starts_obj, *sizes_obj, *out_obj, *ret = NULL;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi", &buf_obj, &starts_obj, &sizes_obj, &out_obj, &threads))
        return NULL;
    Py_buffer buf, st, sz, out;
    if (get_buf(buf_obj, &buf, 0, 0, "buf") < 0) return NULL;
    if (get_buf(starts_obj, &st, 0, 1, "starts") < 0) goto no_st;
    if (get_buf(sizes_obj, &sz, 0, 1, "sizes") < 0) goto no_sz;
    if (get_buf(out_obj, &out, 1, 0, "out") < 0) goto no_out;
    const int64_t n = st.len / 8, *starts = st.buf, *sizes = sz.buf;
    const char *f = out.format ? out.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (sz.len != st.len || out.itemsize != 4 || out.len != n * 4 ||
        (strcmp(f, "I") && strcmp(f, "L"))) {
        PyErr_SetString(PyExc_ValueError, "starts, sizes and out (uint32) must be of one length");
        goto done;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (starts[i] < 0 || sizes[i] < 0 || starts[i] > buf.len - sizes[i]) {
            PyErr_Format(PyExc_ValueError,
                         "block %lld [%lld, +%lld) lies outside the buffer (%zd B)", (long long)i,
                         (long long)starts[i], (long long)sizes[i], buf.len);
            goto done;
        }
        if (total <= (64 << 10)) total += sizes[i]; /* (only whether it passes 64 KiB matters) */
    }
    crc_job j = {buf.buf, starts, sizes, out.buf};
    if (total <= (64 << 10)) {
        crc_work(&j, 0, n, 0);
    } else {
        Py_BEGIN_ALLOW_THREADS pool_run(crc_work, &j, n, CRC_GRAIN, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&out);
no_out:
    PyBuffer_Release(&sz);
no_sz:
    PyBuffer_Release(&st);
no_st:
    PyBuffer_Release(&buf);
    return ret;
}
