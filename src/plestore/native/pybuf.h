/* A C-contiguous buffer of a Python object (module.c): writable if asked, int64 if asked (its
 * format checked, not only its item size); a ValueError naming `name` otherwise. */
#ifndef PLESTORE_PYBUF_H
#define PLESTORE_PYBUF_H

#include <Python.h>

int get_buf(PyObject *obj, Py_buffer *v, int writable, int int64, const char *name);

#endif
