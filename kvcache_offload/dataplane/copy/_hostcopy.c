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

/* copy_units(src_base, src_stride, src_sub, src_factor, dst_base, dst_stride, dst_sub,
 *            dst_factor, sizes, src_units, dst_units): the fragments of one group of a plan,
 * addresses computed here instead of in a pointer table built in Python first (that table
 * cost more host time per serving-size job than the copy). Per ref r (int64 buffers of R
 * entries) and unit i (int64 buffers of K entries), ref-major like the table:
 *   src = src_base[r] + (su[i] / src_factor) * src_stride[r] + (su[i] % src_factor) * src_sub[r]
 * and the same for the destination; size[r] bytes each. */
static int same_len(Py_buffer *b, Py_ssize_t n, const char *what) {
    if (b->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "copy_units: %s holds %zd bytes, expected %zd", what,
                     b->len, n * 8);
        return 0;
    }
    return 1;
}

static PyObject *copy_units(PyObject *self, PyObject *args) {
    Py_buffer sb, sst, ssub, db, dst, dsub, sizes, su, du;
    Py_ssize_t sf, df;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*y*y*ny*y*y*", &sb, &sst, &ssub, &sf, &db, &dst, &dsub,
                          &df, &sizes, &su, &du)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t refs = sizes.len / 8, units = su.len / 8;
    if (sf < 1 || df < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_units: factors must be >= 1");
        goto done;
    }
    if (!same_len(&sb, refs, "src_base") || !same_len(&sst, refs, "src_stride") ||
        !same_len(&ssub, refs, "src_sub") || !same_len(&db, refs, "dst_base") ||
        !same_len(&dst, refs, "dst_stride") || !same_len(&dsub, refs, "dst_sub") ||
        !same_len(&du, units, "dst_units")) {
        goto done;
    }
    {
        const int64_t *a_b = sb.buf, *a_st = sst.buf, *a_sub = ssub.buf;
        const int64_t *b_b = db.buf, *b_st = dst.buf, *b_sub = dsub.buf;
        const int64_t *n = sizes.buf, *u_s = su.buf, *u_d = du.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < refs; r++) {
            for (Py_ssize_t i = 0; i < units; i++) {
                int64_t s = a_b[r] + (u_s[i] / sf) * a_st[r] + (u_s[i] % sf) * a_sub[r];
                int64_t d = b_b[r] + (u_d[i] / df) * b_st[r] + (u_d[i] % df) * b_sub[r];
                memcpy((void *)(intptr_t)d, (const void *)(intptr_t)s, (size_t)n[r]);
            }
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&sst);
    PyBuffer_Release(&ssub);
    PyBuffer_Release(&db);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&dsub);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&su);
    PyBuffer_Release(&du);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_fragments", copy_fragments, METH_VARARGS,
     "copy_fragments(src, dst, sizes): memcpy each fragment, GIL released."},
    {"copy_units", copy_units, METH_VARARGS,
     "copy_units(...): memcpy every (ref, unit) fragment of one group, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache_offload.dataplane.copy._hostcopy", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void) { return PyModule_Create(&module); }
