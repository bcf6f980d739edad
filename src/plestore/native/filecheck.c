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

/* check_file(fd, size, nlink, ctime_ns) -> 0 as seen, 1 truncated, 2 unlinked, 3 its link count
 * or change time moved, else -errno of fstat */
PyObject *py_check_file(PyObject *self, PyObject *args) {
    int fd;
    long long size, ctime_ns;
    unsigned long long nlink;
    if (!PyArg_ParseTuple(args, "iLKL", &fd, &size, &nlink, &ctime_ns)) return NULL;
    struct stat st;
    int state = 0;
    if (fstat(fd, &st) != 0)
        state = -errno;
    else if ((long long)st.st_size < size)
        state = 1;
    else if (st.st_nlink == 0)
        state = 2;
    else if ((unsigned long long)st.st_nlink != nlink ||
             (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec != ctime_ns)
        state = 3;
    return PyLong_FromLong(state);
}
