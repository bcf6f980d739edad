/* The mapped tier's check before a read, in one system call: the file under the mapping still
 * holds the mapped bytes (a read past a truncated end would SIGBUS the process) and still has
 * a name (a link count of 0: removed, or replaced by a rename over its path). fstat alone: a
 * stat of the path as well cost ~1 us a decode lookup on the H200 (its path walk). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/stat.h>

/* check_file(fd, size) -> 0 ok, 1 truncated, 2 unlinked, else -errno of fstat */
PyObject *py_check_file(PyObject *self, PyObject *args) {
    int fd;
    long long size;
    if (!PyArg_ParseTuple(args, "iL", &fd, &size)) return NULL;
    struct stat st;
    int state = 0;
    if (fstat(fd, &st) != 0)
        state = -errno;
    else if ((long long)st.st_size < size)
        state = 1;
    else if (st.st_nlink == 0)
        state = 2;
    return PyLong_FromLong(state);
}
