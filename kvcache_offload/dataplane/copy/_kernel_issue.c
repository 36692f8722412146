/* One kernel copy enqueued in one call: the job table's upload, the waits that order it, its
 * start event, the copy kernel's launch and its end event; for a lone one-group job also its
 * units, planned from the block ids in the same call (issue_units).
 *
 * A serving engine's lone 1- or 8-block job spends as much host time issuing its copy as the
 * copy itself takes on the link. Issued from Python, each of those steps is a ctypes or torch
 * call (2-3 us each on the H200 host) and the launch goes through Triton's Python launcher
 * (about 10 us with our binding around it). Here they are five to seven driver calls from C,
 * with the GIL released once around them. A staged job of one chunk (the staged path's
 * serving-size jobs: a gather or scatter through a ring buffer plus its DMA pieces) goes out
 * the same way (issue_staged).
 *
 * The CUDA functions come as addresses from the libraries torch and Triton already loaded
 * (kernel_issue.py takes them from ctypes), so this file needs no CUDA headers and builds
 * wherever the host-copy extension builds; nothing here runs unless a GPU handler binds it.
 *
 * Kernel parameters: the driver reads each parameter's own size from the address in the
 * parameter array, so every value is kept as a little-endian int64 and a 4-byte parameter
 * reads its low half. The sizes (from cuFuncGetParamInfo at bind time) are only used to
 * refuse a value that a 4-byte parameter cannot hold: the caller then launches through
 * Triton, which compiles a kernel for it. Parameters past the copy kernel's own arguments
 * (Triton's scratch pointers) are passed as null.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_units.h"

typedef int (*memcpy_fn)(void *, const void *, size_t, int, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);
typedef int (*launch_fn)(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                         unsigned int, unsigned int, unsigned int, void *, void **, void **);
typedef int (*get_device_fn)(int *);
typedef int (*set_device_fn)(int);
typedef int (*sync_fn)(void *);

/* The copy kernel's own arguments: two table pointers, seven ints, then ref_row and
 * INLINE_UNITS units per side, the one-group job whose units travel as parameters. */
enum { INLINE_UNITS = 8, KERNEL_ARGS = 10 + 2 * INLINE_UNITS, MAX_PARAMS = 32 };
enum { GROUP_ROW = 4, MEMCPY_DEFAULT = 4 };

/* Where a failed job stopped: issue() returns (stage << 16) | code. */
enum {
    STAGE_UPLOAD = 1,
    STAGE_ORDER = 2,
    STAGE_PREV = 3,
    STAGE_START = 4,
    STAGE_LAUNCH = 5,
    STAGE_END = 6,
    STAGE_RANGE = 7, /* nothing was issued: a value does not fit its parameter */
    STAGE_READY = 8,
    STAGE_RING = 9,
    STAGE_PIECE = 10,
    STAGE_DEVICE = 11,
    STAGE_WAIT = 12,
};

enum { MAX_PIECES = 16 };

typedef struct {
    PyObject_HEAD
    memcpy_fn memcpy_async;
    record_fn event_record;
    wait_fn stream_wait;
    launch_fn launch;
    void *function;
    unsigned int shared;
    unsigned int threads;
    int64_t grid;
    int64_t block_bytes;
    int64_t ref_ptr;
    int64_t src_factor;
    int64_t dst_factor;
    int n_params;
    int param_size[MAX_PARAMS];
    /* The one group's geometry for issue_units (set_units; units_ready until then 0). */
    int units_ready;
    int device;
    get_device_fn get_device;
    set_device_fn set_device;
    int64_t src_rows, dst_rows, ref_row, pairs_per_unit, max_size;
} KernelIssuer;

static PyObject *issuer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"memcpy_async", "event_record", "stream_wait", "launch",
                             "function", "shared", "threads", "grid", "block_bytes",
                             "ref_ptr", "src_factor", "dst_factor", "param_sizes", NULL};
    unsigned long long fns[5];
    unsigned int shared, threads;
    long long grid, block_bytes, ref_ptr, src_factor, dst_factor;
    PyObject *sizes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKKKKIILLLLLO", kwlist, &fns[0], &fns[1],
                                     &fns[2], &fns[3], &fns[4], &shared, &threads, &grid,
                                     &block_bytes, &ref_ptr, &src_factor, &dst_factor, &sizes)) {
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        if (fns[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "KernelIssuer needs every function address");
            return NULL;
        }
    }
    if (threads == 0 || grid < 0 || block_bytes <= 0 || src_factor < 1 || dst_factor < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "KernelIssuer needs threads > 0, grid >= 0, block_bytes > 0 and factors "
                        ">= 1");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(sizes, "param_sizes must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < KERNEL_ARGS || n > MAX_PARAMS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError,
                     "the copy kernel has %d arguments; got %zd parameter sizes (at most %d)",
                     KERNEL_ARGS, n, MAX_PARAMS);
        return NULL;
    }
    KernelIssuer *self = (KernelIssuer *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long size = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (size == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            Py_DECREF(self);
            return NULL;
        }
        if (size != 4 && size != 8) {
            Py_DECREF(seq);
            Py_DECREF(self);
            PyErr_Format(PyExc_ValueError, "parameter %zd has %ld bytes; only 4 and 8 are known",
                         i, size);
            return NULL;
        }
        self->param_size[i] = (int)size;
    }
    Py_DECREF(seq);
    self->n_params = (int)n;
    self->memcpy_async = (memcpy_fn)(uintptr_t)fns[0];
    self->event_record = (record_fn)(uintptr_t)fns[1];
    self->stream_wait = (wait_fn)(uintptr_t)fns[2];
    self->launch = (launch_fn)(uintptr_t)fns[3];
    self->function = (void *)(uintptr_t)fns[4];
    self->shared = shared;
    self->threads = threads;
    self->grid = grid;
    self->block_bytes = block_bytes;
    self->ref_ptr = ref_ptr;
    self->src_factor = src_factor;
    self->dst_factor = dst_factor;
    return (PyObject *)self;
}

static int as_u64(PyObject *obj, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *out = v;
    return 1;
}

static int as_i64(PyObject *obj, int64_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return 0;
    *out = v;
    return 1;
}

/* The copy kernel's parameters for a job table at job_ptr (device) of n_groups groups,
 * n_units units and pairs fragments of at most max_size bytes: values and the parameter
 * array pointing at them. With units (n_units sources then n_units destinations, at most
 * INLINE_UNITS each) the job has no table: one group at ref_row, n_groups 0 and the units in
 * the parameters. Returns the programs to launch (0: nothing to copy), or -1 when a value
 * does not fit its parameter. */
static int64_t kernel_params(const KernelIssuer *self, uint64_t job_ptr, int64_t n_groups,
                             int64_t n_units, int64_t pairs, int64_t max_size, int64_t ref_row,
                             const int64_t *units, int64_t values[MAX_PARAMS],
                             void *params[MAX_PARAMS]) {
    int64_t chunks = (max_size + self->block_bytes - 1) / self->block_bytes;
    int64_t total_work = pairs * chunks;
    int64_t programs = self->grid > 0 && total_work > self->grid ? self->grid : total_work;
    int64_t iters = programs > 0 ? (total_work + programs - 1) / programs : 0;
    memset(values, 0, sizeof(int64_t) * MAX_PARAMS);
    values[0] = (int64_t)self->ref_ptr;
    values[1] = (int64_t)job_ptr;
    values[2] = n_groups;
    values[3] = n_units;
    values[4] = total_work;
    values[5] = iters;
    values[6] = chunks;
    values[7] = self->src_factor;
    values[8] = self->dst_factor;
    if (units != NULL) {
        values[1] = 0;
        values[2] = 0;
        values[9] = ref_row;
        for (int64_t u = 0; u < n_units; u++) {
            values[10 + u] = units[u];
            values[10 + INLINE_UNITS + u] = units[n_units + u];
        }
    }
    for (int i = 0; i < self->n_params; i++) {
        if (self->param_size[i] == 4 && (values[i] < INT32_MIN || values[i] > INT32_MAX)) {
            return -1;
        }
        params[i] = &values[i];
    }
    return programs > UINT32_MAX ? -1 : programs;
}

/* The calls of one kernel copy on stream s; see issue(). With host set, first writes the
 * group row of the job table at host (pinned; its units written after the row) and uploads
 * it to dev; with host 0 the job's units are in params and nothing is uploaded.
 * Returns 0, or (stage << 16) | the failing call's code. Called with the GIL released. */
static long enqueue(const KernelIssuer *self, uint64_t host, uint64_t dev, int64_t n_units,
                    int64_t ref_row, int64_t programs, void **params, void *s, uint64_t before,
                    uint64_t mark, uint64_t prev_end, uint64_t start, uint64_t end) {
    int code = 0, stage = 0;
    do {
        if (host != 0) {
            int64_t *row = (int64_t *)(uintptr_t)host;
            row[0] = 0;
            row[1] = n_units;
            row[2] = ref_row;
            row[3] = 0;
            size_t table_bytes = (size_t)(GROUP_ROW + 2 * n_units) * 8;
            stage = STAGE_UPLOAD;
            code = self->memcpy_async((void *)(uintptr_t)dev, (const void *)(uintptr_t)host,
                                      table_bytes, MEMCPY_DEFAULT, s);
            if (code) break;
        }
        if (mark != 0) { /* a store: before is the model's stream, 0 the default one */
            stage = STAGE_ORDER;
            code = self->event_record((void *)(uintptr_t)mark, (void *)(uintptr_t)before);
            if (code) break;
            code = self->stream_wait(s, (void *)(uintptr_t)mark, 0);
            if (code) break;
        }
        if (prev_end != 0) {
            stage = STAGE_PREV;
            code = self->stream_wait(s, (void *)(uintptr_t)prev_end, 0);
            if (code) break;
        }
        stage = STAGE_START;
        code = self->event_record((void *)(uintptr_t)start, s);
        if (code) break;
        if (programs > 0) {
            stage = STAGE_LAUNCH;
            code = self->launch(self->function, (unsigned int)programs, 1, 1, self->threads, 1, 1,
                                self->shared, s, params, NULL);
            if (code) break;
        }
        stage = STAGE_END;
        code = self->event_record((void *)(uintptr_t)end, s);
    } while (0);
    return code ? ((long)stage << 16) | (long)(code & 0xFFFF) : 0;
}

/* issue(host, dev, n_units, ref_row, pairs, max_size, stream, before, mark, prev_end, start,
 *       end) -> 0, or (stage << 16) | the failing call's code
 *
 * host/dev: the job table (pinned host and its device copy); its units (n_units sources then
 * n_units destinations after the group row) are already written at host. Writes the one
 * group row (0, n_units, ref_row, 0), then on stream: uploads the 4 + 2 * n_units entries;
 * if mark: records mark on before and waits for it (a store copies what the model wrote;
 * before may be 0, the legacy default stream, where the model runs by default);
 * if prev_end: waits for it (the previous copy of this direction); records start; launches
 * the kernel over pairs fragments of at most max_size bytes (nothing when pairs is 0);
 * records end. Stops at the first call that fails. */
static PyObject *issuer_issue(KernelIssuer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "issue() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t host, dev, stream, before, mark, prev_end, start, end;
    int64_t n_units, ref_row, pairs, max_size;
    if (!as_u64(args[0], &host) || !as_u64(args[1], &dev) || !as_i64(args[2], &n_units) ||
        !as_i64(args[3], &ref_row) || !as_i64(args[4], &pairs) || !as_i64(args[5], &max_size) ||
        !as_u64(args[6], &stream) || !as_u64(args[7], &before) || !as_u64(args[8], &mark) ||
        !as_u64(args[9], &prev_end) || !as_u64(args[10], &start) || !as_u64(args[11], &end)) {
        return NULL;
    }
    if (host == 0 || dev == 0 || n_units < 0 || pairs < 0 || max_size < 0 ||
        (pairs > 0 && max_size == 0) || (before != 0 && mark == 0) || start == 0 || end == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "issue() needs both tables, events, counts >= 0 and a mark with before");
        return NULL;
    }
    int64_t values[MAX_PARAMS];
    void *params[MAX_PARAMS];
    int64_t programs =
        kernel_params(self, dev, 1, n_units, pairs, max_size, 0, NULL, values, params);
    if (programs < 0) return PyLong_FromLong((long)STAGE_RANGE << 16);
    long result;
    /* Released as ctypes and Triton's launcher release it: an enqueue blocks while the
     * stream's queue is full. Holding it measured the same on the H200 host. */
    Py_BEGIN_ALLOW_THREADS
    result = enqueue(self, host, dev, n_units, ref_row, programs, params, (void *)(uintptr_t)stream,
                     before, mark, prev_end, start, end);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

/* set_units(src_rows, dst_rows, ref_row, pairs_per_unit, max_size, device, get_device,
 *           set_device) -> None
 *
 * The one KV-cache group's geometry, for issue_units: each side's rows (its block ids must
 * lie below), the group's row in the ref table, its fragments per unit and their largest
 * size; and the device the kernel was compiled for, made current around each issue_units
 * (cudaGetDevice / cudaSetDevice addresses) where another one is. */
static PyObject *issuer_set_units(KernelIssuer *self, PyObject *args) {
    long long src_rows, dst_rows, ref_row, pairs_per_unit, max_size;
    int device;
    unsigned long long get_device, set_device;
    if (!PyArg_ParseTuple(args, "LLLLLiKK", &src_rows, &dst_rows, &ref_row, &pairs_per_unit,
                          &max_size, &device, &get_device, &set_device)) {
        return NULL;
    }
    if (src_rows < 0 || dst_rows < 0 || ref_row < 0 || pairs_per_unit < 1 || max_size < 1 ||
        device < 0 || get_device == 0 || set_device == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "set_units needs rows >= 0, a ref row >= 0, fragments and a size >= 1, "
                        "a device >= 0 and both device functions");
        return NULL;
    }
    self->src_rows = src_rows;
    self->dst_rows = dst_rows;
    self->ref_row = ref_row;
    self->pairs_per_unit = pairs_per_unit;
    self->max_size = max_size;
    self->device = device;
    self->get_device = (get_device_fn)(uintptr_t)get_device;
    self->set_device = (set_device_fn)(uintptr_t)set_device;
    self->units_ready = 1;
    Py_RETURN_NONE;
}

static int int64_view(PyObject *obj, Py_buffer *view);

/* int64_view without an error: ids the lane does not take go to the caller's general path. */
static int int64_ids(PyObject *obj, Py_buffer *view) {
    if (int64_view(obj, view)) return 1;
    PyErr_Clear();
    return 0;
}

/* issue_units(host, dev, capacity, src_ids, dst_ids, size, start, stream, before, mark,
 *             prev_end, start_event, end_event) -> 0, -1, or (stage << 16) | code
 *
 * A one-group job planned and issued in one call (the lone lane): the units of size pieces
 * starting start pieces into the request (units_of_side on each side's ids, int64), then
 * issue()'s calls. A job of at most INLINE_UNITS units passes them as kernel parameters and
 * uploads no table; a larger one writes them after the
 * group row of the job table at host, which is uploaded. -1, with nothing enqueued, where the
 * job is not one this call takes: set_units not called, ids that are not C-contiguous int64
 * or do not name the job's blocks within the rows, or a job of more units than a table of
 * capacity entries holds; the caller's general path then plans it and names any error (the
 * table may hold some units by then: it is the caller's scratch until a copy reads it).
 * STAGE_RANGE, with nothing enqueued, as issue(). The device of set_units is made current
 * around the calls where another one is. */
static PyObject *issuer_issue_units(KernelIssuer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "issue_units() takes 13 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t host, dev, stream, before, mark, prev_end, start, end;
    int64_t capacity, size, first;
    if (!as_u64(args[0], &host) || !as_u64(args[1], &dev) || !as_i64(args[2], &capacity) ||
        !as_i64(args[5], &size) || !as_i64(args[6], &first) || !as_u64(args[7], &stream) ||
        !as_u64(args[8], &before) || !as_u64(args[9], &mark) || !as_u64(args[10], &prev_end) ||
        !as_u64(args[11], &start) || !as_u64(args[12], &end)) {
        return NULL;
    }
    if (host == 0 || dev == 0 || (before != 0 && mark == 0) || start == 0 || end == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "issue_units() needs both tables, both events and a mark with before");
        return NULL;
    }
    int inline_job = size <= INLINE_UNITS;
    if (!self->units_ready || size <= 0 || first < 0 ||
        (!inline_job && GROUP_ROW + 2 * size > capacity)) {
        return PyLong_FromLong(-1);
    }
    int64_t values[MAX_PARAMS];
    void *params[MAX_PARAMS];
    int64_t pairs = self->pairs_per_unit * size, programs = 0;
    if (!inline_job) { /* before its units are written: a job refused here leaves its table */
        programs =
            kernel_params(self, dev, 1, size, pairs, self->max_size, 0, NULL, values, params);
        if (programs < 0) return PyLong_FromLong((long)STAGE_RANGE << 16);
    }
    Py_buffer src, dst;
    if (!int64_ids(args[3], &src)) return PyLong_FromLong(-1);
    if (!int64_ids(args[4], &dst)) {
        PyBuffer_Release(&src);
        return PyLong_FromLong(-1);
    }
    int64_t in_params[2 * INLINE_UNITS];
    int64_t *units = inline_job ? in_params : (int64_t *)(uintptr_t)host + GROUP_ROW;
    int ok = units_of_side(src.buf, src.len / 8, size, first, self->src_factor, self->src_rows,
                           units) &&
             units_of_side(dst.buf, dst.len / 8, size, first, self->dst_factor, self->dst_rows,
                           units + size);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!ok) return PyLong_FromLong(-1);
    if (inline_job) { /* the units are parameters too: each must fit its own */
        programs = kernel_params(self, dev, 1, size, pairs, self->max_size, self->ref_row, units,
                                 values, params);
        if (programs < 0) return PyLong_FromLong((long)STAGE_RANGE << 16);
    }
    uint64_t table = inline_job ? 0 : host;
    long result = 0;
    Py_BEGIN_ALLOW_THREADS
    int current = -1, code = self->get_device(&current);
    if (code == 0 && current != self->device) code = self->set_device(self->device);
    if (code) {
        result = ((long)STAGE_DEVICE << 16) | (long)(code & 0xFFFF);
    } else {
        result = enqueue(self, table, dev, size, self->ref_row, programs, params,
                         (void *)(uintptr_t)stream, before, mark, prev_end, start, end);
        if (current >= 0 && current != self->device) self->set_device(current);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (view->itemsize != 8 || (f[0] != 'l' && f[0] != 'q') || f[1] != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "issue_staged: pieces must be C-contiguous int64");
        return 0;
    }
    return 1;
}

/* issue_staged(gpu_to_cpu, kernel_stream, dma_stream, ready, prev_end, start, end, host, dev,
 *              table_entries, job_offset, n_groups, n_units, pairs, max_size, freed,
 *              freed_used, filled, dst, src, size, lo, hi) -> 0 or (stage << 16) | code
 *
 * A staged job of one chunk through ring buffer s (this issuer's ref table points into it),
 * the calls StagedCopier._issue makes, in its order. "first" is the kernel stream for a
 * store and the DMA stream for a load, "last" the other one. On first: waits for ready (a
 * store's model work) and prev_end (0: none), records start; uploads the first
 * table_entries of the job table on the kernel stream. Store: waits for freed (the slot's
 * last DMA, when freed_used), gathers (the kernel over the table at job_offset), records
 * filled; the DMA stream waits for filled, copies pieces [lo, hi), records freed. Load: the
 * DMA stream waits for freed (when freed_used), copies the pieces, records filled; the
 * kernel stream waits for filled, scatters, records freed. Then records end on last. A
 * piece is one cudaMemcpyAsync (dst[i], src[i], size[i]); at most MAX_PIECES of them. */
static PyObject *issuer_issue_staged(KernelIssuer *self, PyObject *const *args,
                                     Py_ssize_t nargs) {
    if (nargs != 23) {
        PyErr_Format(PyExc_TypeError, "issue_staged() takes 23 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t ks, ds, ready, prev_end, start, end, host, dev, freed, filled;
    int64_t entries, offset, n_groups, n_units, pairs, max_size, lo, hi;
    int gpu_to_cpu = PyObject_IsTrue(args[0]);
    int freed_used = PyObject_IsTrue(args[16]);
    if (gpu_to_cpu < 0 || freed_used < 0 || !as_u64(args[1], &ks) || !as_u64(args[2], &ds) ||
        !as_u64(args[3], &ready) || !as_u64(args[4], &prev_end) || !as_u64(args[5], &start) ||
        !as_u64(args[6], &end) || !as_u64(args[7], &host) || !as_u64(args[8], &dev) ||
        !as_i64(args[9], &entries) || !as_i64(args[10], &offset) ||
        !as_i64(args[11], &n_groups) || !as_i64(args[12], &n_units) ||
        !as_i64(args[13], &pairs) || !as_i64(args[14], &max_size) ||
        !as_u64(args[15], &freed) || !as_u64(args[17], &filled) || !as_i64(args[21], &lo) ||
        !as_i64(args[22], &hi)) {
        return NULL;
    }
    if (ks == 0 || ds == 0 || start == 0 || end == 0 || freed == 0 || filled == 0 ||
        host == 0 || dev == 0 || entries < 0 || offset < 0 || n_groups < 1 || n_units < 0 ||
        pairs < 0 || max_size < 0 || (pairs > 0 && max_size == 0) || lo < 0 || hi < lo ||
        hi - lo > MAX_PIECES) {
        PyErr_Format(PyExc_ValueError,
                     "issue_staged() needs both streams and tables, four events, counts >= 0 "
                     "and at most %d pieces", (int)MAX_PIECES);
        return NULL;
    }
    Py_buffer dst, src, size;
    if (!int64_view(args[18], &dst)) return NULL;
    if (!int64_view(args[19], &src)) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (!int64_view(args[20], &size)) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (dst.len != size.len || src.len != size.len || hi > size.len / 8) {
        PyErr_SetString(PyExc_ValueError, "issue_staged: pieces of one length, covering [lo, hi)");
        goto done;
    }
    {
        int64_t values[MAX_PARAMS];
        void *params[MAX_PARAMS];
        int64_t programs = kernel_params(self, dev + 8 * (uint64_t)offset, n_groups, n_units,
                                         pairs, max_size, 0, NULL, values, params);
        if (programs < 0) {
            result = PyLong_FromLong((long)STAGE_RANGE << 16);
            goto done;
        }
        const int64_t *d = dst.buf, *sr = src.buf, *n = size.buf;
        void *kstream = (void *)(uintptr_t)ks, *dstream = (void *)(uintptr_t)ds;
        void *first = gpu_to_cpu ? kstream : dstream, *last = gpu_to_cpu ? dstream : kstream;
        void *freed_ev = (void *)(uintptr_t)freed, *filled_ev = (void *)(uintptr_t)filled;
        int code = 0, stage = 0;
        Py_BEGIN_ALLOW_THREADS
        do {
            if (ready != 0) {
                stage = STAGE_READY;
                if ((code = self->stream_wait(first, (void *)(uintptr_t)ready, 0))) break;
            }
            if (prev_end != 0) {
                stage = STAGE_PREV;
                if ((code = self->stream_wait(first, (void *)(uintptr_t)prev_end, 0))) break;
            }
            stage = STAGE_START;
            if ((code = self->event_record((void *)(uintptr_t)start, first))) break;
            if (entries > 0) {
                stage = STAGE_UPLOAD;
                code = self->memcpy_async((void *)(uintptr_t)dev, (const void *)(uintptr_t)host,
                                          (size_t)entries * 8, MEMCPY_DEFAULT, kstream);
                if (code) break;
            }
            for (int step = 0; step < 2; step++) {
                /* A store gathers, then copies; a load copies, then scatters. */
                int kernel = gpu_to_cpu ? step == 0 : step == 1;
                void *on = kernel ? kstream : dstream;
                stage = STAGE_RING;
                if (step == 0 && freed_used) {
                    if ((code = self->stream_wait(on, freed_ev, 0))) break;
                } else if (step == 1) {
                    if ((code = self->stream_wait(on, filled_ev, 0))) break;
                }
                if (kernel) {
                    if (programs > 0) {
                        stage = STAGE_LAUNCH;
                        code = self->launch(self->function, (unsigned int)programs, 1, 1,
                                            self->threads, 1, 1, self->shared, kstream, params,
                                            NULL);
                        if (code) break;
                    }
                } else {
                    stage = STAGE_PIECE;
                    for (int64_t i = lo; i < hi; i++) {
                        code = self->memcpy_async((void *)(intptr_t)d[i],
                                                  (const void *)(intptr_t)sr[i], (size_t)n[i],
                                                  MEMCPY_DEFAULT, dstream);
                        if (code) break;
                    }
                    if (code) break;
                }
                stage = STAGE_RING;
                if ((code = self->event_record(step == 0 ? filled_ev : freed_ev, on))) break;
            }
            if (code) break;
            stage = STAGE_END;
            code = self->event_record((void *)(uintptr_t)end, last);
        } while (0);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(code ? ((long)stage << 16) | (long)(code & 0xFFFF) : 0);
    }
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    return result;
}

static PyMethodDef issuer_methods[] = {
    {"issue", (PyCFunction)(void (*)(void))issuer_issue, METH_FASTCALL,
     "issue(host, dev, n_units, ref_row, pairs, max_size, stream, before, mark, prev_end, "
     "start, end) -> 0 or (stage << 16) | code"},
    {"set_units", (PyCFunction)issuer_set_units, METH_VARARGS,
     "set_units(src_rows, dst_rows, ref_row, pairs_per_unit, max_size, device, get_device, "
     "set_device) -> None"},
    {"issue_units", (PyCFunction)(void (*)(void))issuer_issue_units, METH_FASTCALL,
     "issue_units(host, dev, capacity, src_ids, dst_ids, size, start, stream, before, mark, "
     "prev_end, start_event, end_event) -> 0, -1 (not taken) or (stage << 16) | code"},
    {"issue_staged", (PyCFunction)(void (*)(void))issuer_issue_staged, METH_FASTCALL,
     "issue_staged(gpu_to_cpu, kernel_stream, dma_stream, ready, prev_end, start, end, host, "
     "dev, table_entries, job_offset, n_groups, n_units, pairs, max_size, freed, freed_used, "
     "filled, dst, src, size, lo, hi) -> 0 or (stage << 16) | code"},
    {NULL, NULL, 0, NULL},
};

/* wait_through(stream_wait, event_record, event_sync, end, stream, proxy) -> 0 or
 * (stage << 16) | code: sleep until the copy event `end` has fired, through `proxy`, a
 * blocking-sync event recorded on the waiter's own `stream` after that stream waits on `end`.
 *
 * With cudaEventBlockingSync the driver arms an interrupt for every record of the event, and
 * its event thread (cuda-EvtHandlr) spent 0.03-0.14 of a core on the copies' end events in
 * the H200 streams, also where the poller found every end itself and nobody slept on one.
 * So the copies' events spin (no interrupt), and only a copy that the watcher thread really
 * waits for gets the interrupt, on the proxy. Three driver calls, the GIL released once. */
static PyObject *wait_through(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "wait_through(stream_wait, event_record, event_sync, end, stream, proxy)");
        return NULL;
    }
    void *ptrs[6];
    for (int i = 0; i < 6; i++) {
        ptrs[i] = PyLong_AsVoidPtr(args[i]);
        if (ptrs[i] == NULL && PyErr_Occurred()) return NULL;
    }
    if (ptrs[0] == NULL || ptrs[1] == NULL || ptrs[2] == NULL || ptrs[3] == NULL ||
        ptrs[5] == NULL) {
        PyErr_SetString(PyExc_ValueError, "wait_through: a function, the end or the proxy is 0");
        return NULL;
    }
    wait_fn stream_wait = (wait_fn)ptrs[0];
    record_fn event_record = (record_fn)ptrs[1];
    sync_fn event_sync = (sync_fn)ptrs[2];
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = stream_wait(ptrs[4], ptrs[3], 0);
    if (code == 0) code = event_record(ptrs[5], ptrs[4]);
    if (code == 0) code = event_sync(ptrs[5]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code == 0 ? 0 : (STAGE_WAIT << 16) | code);
}

/* copy_seconds(event_query, event_elapsed, start, end) -> seconds, or -1.0 while `end` has
 * not fired: the end and the GPU time of a kernel copy issued from C in one call, for the
 * poller's looks. Through torch this takes Event.query() and Event.elapsed_time() (itself two
 * more queries and a device guard), on the path from a copy's end to its caller; in-engine
 * A/Bs on the H200 host measured single jobs 4-7 us faster this way (docs/transfers.md,
 * "The C issuers"). Any other CUDA error raises RuntimeError, as torch's calls do. */
typedef int (*query_fn)(void *);
typedef int (*elapsed_fn)(float *, void *, void *);
enum { CUDA_NOT_READY = 600 };

static PyObject *copy_seconds(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_seconds(event_query, event_elapsed, start, end)");
        return NULL;
    }
    void *ptrs[4];
    for (int i = 0; i < 4; i++) {
        ptrs[i] = PyLong_AsVoidPtr(args[i]);
        if (ptrs[i] == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "copy_seconds: a function or an event is 0");
            }
            return NULL;
        }
    }
    int code = ((query_fn)ptrs[0])(ptrs[3]);
    if (code == CUDA_NOT_READY) return PyFloat_FromDouble(-1.0);
    float ms = 0.0f;
    if (code == 0) code = ((elapsed_fn)ptrs[1])(&ms, ptrs[2], ptrs[3]);
    if (code != 0) {
        PyErr_Format(PyExc_RuntimeError, "CUDA error %d reading a copy's events", code);
        return NULL;
    }
    return PyFloat_FromDouble((double)ms * 1e-3);
}

static PyMethodDef module_methods[] = {
    {"copy_seconds", (PyCFunction)(void (*)(void))copy_seconds, METH_FASTCALL,
     "copy_seconds(event_query, event_elapsed, start, end) -> seconds, or -1.0 while end "
     "has not fired"},
    {"wait_through", (PyCFunction)(void (*)(void))wait_through, METH_FASTCALL,
     "wait_through(stream_wait, event_record, event_sync, end, stream, proxy) -> 0 or "
     "(stage << 16) | code"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KernelIssuerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcache_offload.dataplane.copy._kernel_issue."
                                             "KernelIssuer",
    .tp_basicsize = sizeof(KernelIssuer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The copy kernel of one handler direction, bound to its CUDA calls.",
    .tp_new = issuer_new,
    .tp_methods = issuer_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernel_issue",
    "One kernel copy (upload, ordering, events, launch) enqueued in one call.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__kernel_issue(void) {
    if (PyType_Ready(&KernelIssuerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&KernelIssuerType);
    if (PyModule_AddObject(m, "KernelIssuer", (PyObject *)&KernelIssuerType) < 0) {
        Py_DECREF(&KernelIssuerType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "STAGE_RANGE", STAGE_RANGE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PIECES", MAX_PIECES) < 0 ||
        PyModule_AddIntConstant(m, "INLINE_UNITS", INLINE_UNITS) < 0 ||
        PyModule_AddIntConstant(m, "KERNEL_ARGS", KERNEL_ARGS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PARAMS", MAX_PARAMS) < 0 ||
        PyModule_AddIntConstant(m, "STAGE_WAIT", STAGE_WAIT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
