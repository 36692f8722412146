/* Copy a job's fragments between host addresses in one call, without the GIL.
 *
 * copy_fragments(src, dst, sizes): three C-contiguous int64 buffers of equal length holding
 * source addresses, destination addresses and byte counts. The caller (host_copy.py) builds
 * them from a validated transfer plan over tensors it keeps alive; nothing here checks
 * addresses. Releasing the GIL for the whole job is the point: a per-fragment call from
 * Python would take the GIL back after every fragment and queue behind the event loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *copy_fragments(PyObject *self, PyObject *args) {
    Py_buffer src, dst, sizes;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*", &src, &dst, &sizes)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len != sizes.len || dst.len != sizes.len || sizes.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "copy_fragments needs three int64 buffers of one length, got %zd, %zd "
                     "and %zd bytes",
                     src.len, dst.len, sizes.len);
        goto done;
    }
    const int64_t *s = (const int64_t *)src.buf;
    const int64_t *d = (const int64_t *)dst.buf;
    const int64_t *n = (const int64_t *)sizes.buf;
    Py_ssize_t count = sizes.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy((void *)(intptr_t)d[i], (const void *)(intptr_t)s[i], (size_t)n[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_fragments", copy_fragments, METH_VARARGS,
     "copy_fragments(src, dst, sizes): memcpy each fragment, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache_offload.dataplane.copy._hostcopy", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void) { return PyModule_Create(&module); }
