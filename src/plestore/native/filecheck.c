/* The mapped tier's check before a read, in one system call: the file under the mapping still
 * holds the mapped bytes (a read past a truncated end would SIGBUS the process), and its link
 * count and change time are those last seen (a rename, a link or an unlink of the file changes
 * them; the tier then stats its path to tell a replaced or removed file from a touched one).
 * fstat alone: a stat of the path every read costs a decode lookup (RESULTS.md "host time, part
 * by part"). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/stat.h>

#include "core.h"

int file_state(int fd, int64_t size, uint64_t nlink, int64_t ctime_ns) {
    struct stat st;
    if (fstat(fd, &st) != 0) return -errno;
    if ((long long)st.st_size < size) return 1;
    if (st.st_nlink == 0) return 2;
    if ((uint64_t)st.st_nlink != nlink ||
        (int64_t)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec != ctime_ns)
        return 3;
    return 0;
}

/* check_file(fd, size, nlink, ctime_ns) -> file_state's */
PyObject *py_check_file(PyObject *self, PyObject *args) {
    int fd;
    long long size, ctime_ns;
    unsigned long long nlink;
    if (!PyArg_ParseTuple(args, "iLKL", &fd, &size, &nlink, &ctime_ns)) return NULL;
    return PyLong_FromLong(file_state(fd, size, nlink, ctime_ns));
}
