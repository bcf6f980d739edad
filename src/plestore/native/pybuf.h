/* A C-contiguous buffer of a Python object (module.c): writable if asked, int64 if asked (its
 * format checked, not only its item size); a ValueError naming `name` otherwise. */
#ifndef PLESTORE_PYBUF_H
#define PLESTORE_PYBUF_H

#include <Python.h>

#include "core.h"

int get_buf(PyObject *obj, Py_buffer *v, int writable, int int64, const char *name);
/* whether obj is the core's DirectCore / Mutex (module.c) */
int is_direct_core(PyObject *obj);
int is_mutex(PyObject *obj);

/* a host step's plan parsed from Python (hoststep.c), its buffers held until released */
typedef struct {
    hoststep_t step;
    dir_t dir;
    Py_buffer src[2], crcs[2], arrays[5]; /* crcs[i].obj NULL: part i unchecked */
    int srcs, taken;
} hoststep_hold;
int host_step_parse(PyObject *plan, hoststep_hold *h);
void host_step_release(hoststep_hold *h);

#endif
