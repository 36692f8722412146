/* The host side of a job in C: copies without the GIL, a copy thread that never takes it,
 * and the units of a one-group job.
 *
 *  - copy_fragments / copy_units: one job's fragments in one call, GIL released;
 *  - plan_units: the ids checked and both sides' units written for a one-group job;
 *  - hold_units: the same, for a job held for a batch, its destination blocks marked;
 *  - staged_small_tables: the staged path's kernel tables and DMA pieces of a serving job;
 *  - issue_copies: a few DMA pieces enqueued through cudaMemcpyAsync's address in one call;
 *  - CopyQueue: a direction's copies in order on a native thread (see its section).
 *
 * copy_fragments(src, dst, sizes): three C-contiguous int64 buffers of equal length holding
 * source addresses, destination addresses and byte counts. The caller (host_copy.py) builds
 * them from a validated transfer plan over tensors it keeps alive; nothing here checks
 * addresses. Releasing the GIL for the whole job is the point: a per-fragment call from
 * Python would take the GIL back after every fragment and queue behind the event loop.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "_units.h"
#ifdef __linux__
#include <sys/eventfd.h>
#endif
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define HOSTCOPY_STREAM 1
#else
#define HOSTCOPY_STREAM 0
#endif

/* Copies into the CPU tier bypass the cache (non-temporal stores): an offloaded block is
 * read again, if ever, by a later load, while ordinary stores first read every destination
 * line into the cache (a read for ownership) and evict lines the engine is using. Below
 * STREAM_MIN_BYTES the plain memcpy is as fast, and what it leaves in the cache is small. */
#define STREAM_MIN_BYTES 4096

static void copy_streaming(char *d, const char *s, size_t n) {
#if HOSTCOPY_STREAM
    if (n >= STREAM_MIN_BYTES) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* stream stores need 16-byte aligned d */
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t blocks = n / 64;
        for (size_t i = 0; i < blocks; i++, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, n % 64);
        return;
    }
#endif
    memcpy(d, s, n);
}

/* Streaming stores are weakly ordered: fence them before a job is reported done, so that a
 * reader told "finished" sees every byte. */
static void stream_fence(int streamed) {
#if HOSTCOPY_STREAM
    if (streamed) _mm_sfence();
#else
    (void)streamed;
#endif
}

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
/* The copy of copy_units and of the queue's jobs; runs without the GIL. */
static void copy_unit_run(const int64_t *a_b, const int64_t *a_st, const int64_t *a_sub,
                          int64_t sf, const int64_t *b_b, const int64_t *b_st,
                          const int64_t *b_sub, int64_t df, const int64_t *n, Py_ssize_t refs,
                          const int64_t *u_s, const int64_t *u_d, Py_ssize_t units,
                          int streaming) {
    for (Py_ssize_t r = 0; r < refs; r++) {
        for (Py_ssize_t i = 0; i < units; i++) {
            int64_t s = a_b[r] + (u_s[i] / sf) * a_st[r] + (u_s[i] % sf) * a_sub[r];
            int64_t d = b_b[r] + (u_d[i] / df) * b_st[r] + (u_d[i] % df) * b_sub[r];
            if (streaming) {
                copy_streaming((char *)(intptr_t)d, (const char *)(intptr_t)s, (size_t)n[r]);
            } else {
                memcpy((void *)(intptr_t)d, (const void *)(intptr_t)s, (size_t)n[r]);
            }
        }
    }
}

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
    int streaming = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*y*y*ny*y*y*|p", &sb, &sst, &ssub, &sf, &db, &dst, &dsub,
                          &df, &sizes, &su, &du, &streaming)) {
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
        copy_unit_run(a_b, a_st, a_sub, sf, b_b, b_st, b_sub, df, n, refs, u_s, u_d, units,
                      streaming);
        stream_fence(streaming);
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

/* plan_units(src_ids, dst_ids, size, start, src_factor, dst_factor, src_rows, dst_rows, out)
 * -> bool: the units of a one-group job of ``size`` pieces starting ``start`` pieces into the
 * request, written to ``out`` (int64, source units then destination units), when the job is
 * well formed: every id in its side's rows, and each side naming exactly the blocks the
 * pieces need (units_of_side, _units.h). False otherwise, and the caller's general planner
 * then says what is wrong. */
static PyObject *plan_units(PyObject *self, PyObject *args) {
    Py_buffer src, dst, out;
    Py_ssize_t size, start, sf, df, src_rows, dst_rows;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnw*", &src, &dst, &size, &start, &sf, &df, &src_rows,
                          &dst_rows, &out)) {
        return NULL;
    }
    int ok = size > 0 && start >= 0 && sf >= 1 && df >= 1 && src.len % 8 == 0 &&
             dst.len % 8 == 0 && out.len >= 2 * size * 8;
    if (ok) {
        int64_t *o = (int64_t *)out.buf;
        ok = units_of_side(src.buf, src.len / 8, size, start, sf, src_rows, o) &&
             units_of_side(dst.buf, dst.len / 8, size, start, df, dst_rows, o + size);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&out);
    return PyBool_FromLong(ok);
}

/* hold_units(src_ids, dst_ids, size, start, src_factor, dst_factor, src_rows, dst_rows,
 *            src_units, dst_units, used, marks, mark) -> int: a one-group job held for a
 * batch, in one call (the CUDA handlers' _hold_units). Writes the job's source units to
 * src_units[used:] and its destination units to dst_units[used:] (plan_units' check and
 * units), then marks its destination blocks: marks[id] == mark means a job of the batch
 * being held writes block id. The held jobs' units thus lie back to back on each side, and
 * the batch's kernel table takes two copies however many jobs it holds.
 *
 *  1: held (units written, blocks marked);
 *  0: a held job already writes one of its destination blocks: nothing is marked (the units
 *     written are scratch, overwritten later), and the caller issues the batch first;
 * -1: the job is malformed (the general planner then names what is wrong);
 * -2: a units buffer has no room for it from ``used``: nothing is written.
 *
 * ValueError when ``marks`` has fewer than ``dst_rows`` entries (every checked id indexes
 * it); a buffer that is not C-contiguous is refused by the buffer protocol (numpy raises
 * ValueError, others BufferError). The GIL is kept: a serving job takes well under a
 * microsecond here. */
static PyObject *hold_units(PyObject *self, PyObject *args) {
    Py_buffer src, dst, src_units, dst_units, marks;
    Py_ssize_t size, start, sf, df, src_rows, dst_rows, used;
    long long mark;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnw*w*nw*L", &src, &dst, &size, &start, &sf, &df,
                          &src_rows, &dst_rows, &src_units, &dst_units, &used, &marks,
                          &mark)) {
        return NULL;
    }
    long rc = -1;
    if (marks.len / 8 < dst_rows) {
        PyErr_Format(PyExc_ValueError, "marks has %zd entries, fewer than the %zd rows",
                     marks.len / 8, dst_rows);
        rc = -3;
    } else if (size > 0 && start >= 0 && sf >= 1 && df >= 1 && used >= 0 && src.len % 8 == 0 &&
               dst.len % 8 == 0) {
        if (src_units.len / 8 - used < size || dst_units.len / 8 - used < size) {
            rc = -2;
        } else {
            const int64_t *ids = (const int64_t *)dst.buf;
            Py_ssize_t n_ids = dst.len / 8;
            int64_t *m = (int64_t *)marks.buf;
            if (units_of_side(src.buf, src.len / 8, size, start, sf, src_rows,
                              (int64_t *)src_units.buf + used) &&
                units_of_side(ids, n_ids, size, start, df, dst_rows,
                              (int64_t *)dst_units.buf + used)) {
                rc = 1;
                for (Py_ssize_t j = 0; j < n_ids; j++) {
                    if (m[ids[j]] == mark) {
                        rc = 0;
                        break;
                    }
                }
                if (rc == 1) {
                    for (Py_ssize_t j = 0; j < n_ids; j++) m[ids[j]] = mark;
                }
            }
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src_units);
    PyBuffer_Release(&dst_units);
    PyBuffer_Release(&marks);
    if (rc == -3) return NULL;
    return PyLong_FromLong(rc);
}

/* staged_small_tables(gpu_units, cpu_units, host, pieces, ring_base, k, depth, first_slot,
 *                     group_row, ref_row, refs, length, stride, cpu_start, cpu_stride,
 *                     stage_off, gpu_to_cpu) -> (n_pieces, ((offset, 1, m, pairs, lo, hi), ...))
 *
 * The staged path's tables for a job of whole blocks of one group whose CPU cell is one run
 * (StagedTables._prepare_small; its numpy body is the reference and the fallback): what a
 * serving engine submits, where a dozen numpy calls cost more host time than the copy takes
 * on the link. Block i (units of n = len(gpu_units) blocks, int64) goes through chunk
 * c = i / k, in ring buffer (first_slot + c) mod depth, at slot i - c * k of that buffer.
 *
 *  - host (int64, written): chunk c's kernel job table at c * per_chunk (per_chunk =
 *    group_row + 2k, rounded up to even): the group row (0, m, ref_row, 0), then m source
 *    units and m destination units (the GPU units on the GPU side, 0..m-1 on the staging
 *    side). Nothing else is written: padding keeps its value, as in the numpy version.
 *  - pieces (int64, written): three rows of n entries, DMA destination, source and size;
 *    the first n_pieces of each row are the pieces. Block i's CPU run is
 *    cpu_start + cpu_units[i] * cpu_stride, its staging run ring_base[buffer] + stage_off +
 *    slot * stride, length bytes each. When length == stride == cpu_stride, blocks of one
 *    chunk whose CPU runs follow one another are one piece.
 *  - returns the pieces' count and per chunk its table offset, one group, its units, its
 *    pairs (m * refs) and its pieces [lo, hi).
 *
 * Every length is checked before anything is written (ValueError; units that are not
 * C-contiguous int64: TypeError); addresses are not (the caller derives them from its own
 * tensors). Address arithmetic wraps like numpy's int64.
 * The GIL is kept: a job's tables take well under a microsecond here. */
static int64_t floor_mod(int64_t a, int64_t d) {
    int64_t r = a % d;
    return r < 0 ? r + d : r;
}

/* The C-contiguous signed 8-byte integers of obj (a plan's units as they come: the caller then
 * needs no per-job conversion), or TypeError naming what, so the caller can convert. */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *f = view->format ? view->format : "B";
        if (*f == '@' || *f == '=') f++;
        if (view->itemsize == 8 && (f[0] == 'l' || f[0] == 'q') && f[1] == 0) return 1;
        PyBuffer_Release(view);
    }
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "staged_small_tables: %s must be C-contiguous int64", what);
    return 0;
}

static PyObject *staged_small_tables(PyObject *self, PyObject *args) {
    PyObject *gpu_obj, *cpu_obj;
    Py_buffer gpu, cpu, host, pieces, ring;
    Py_ssize_t k, depth, group_row;
    long long first_slot, ref_row, refs, length, stride, cpu_start, cpu_stride, stage_off;
    int gpu_to_cpu;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOw*w*y*nnLnLLLLLLLp", &gpu_obj, &cpu_obj, &host, &pieces, &ring,
                          &k, &depth, &first_slot, &group_row, &ref_row, &refs, &length, &stride,
                          &cpu_start, &cpu_stride, &stage_off, &gpu_to_cpu)) {
        return NULL;
    }
    if (!int64_buffer(gpu_obj, &gpu, "gpu_units")) {
        PyBuffer_Release(&host);
        PyBuffer_Release(&pieces);
        PyBuffer_Release(&ring);
        return NULL;
    }
    if (!int64_buffer(cpu_obj, &cpu, "cpu_units")) {
        PyBuffer_Release(&gpu);
        PyBuffer_Release(&host);
        PyBuffer_Release(&pieces);
        PyBuffer_Release(&ring);
        return NULL;
    }
    PyObject *result = NULL, *info = NULL;
    Py_ssize_t n = gpu.len / 8;
    if (gpu.len % 8 != 0 || cpu.len != gpu.len || n < 1) {
        PyErr_Format(PyExc_ValueError,
                     "staged_small_tables needs int64 GPU and CPU units of one length >= 1, got "
                     "%zd and %zd bytes", gpu.len, cpu.len);
        goto done;
    }
    if (k < 1 || depth < 1 || group_row < 4 || group_row > 1024 || group_row % 2 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "staged_small_tables needs k >= 1, depth >= 1 and an even group_row in "
                     "[4, 1024], got %zd, %zd and %zd", k, depth, group_row);
        goto done;
    }
    if (ring.len / 8 < depth) {
        PyErr_Format(PyExc_ValueError,
                     "staged_small_tables: ring_base holds %zd entries, depth is %zd",
                     ring.len / 8, depth);
        goto done;
    }
    /* With k >= n the job is one chunk and per_chunk is never used: clamping k keeps 2k in
     * range whatever the caller's chunk size. */
    Py_ssize_t kk = k < n ? k : n;
    Py_ssize_t n_chunks = (n - 1) / kk + 1;
    Py_ssize_t per_chunk = group_row + 2 * kk;
    per_chunk += per_chunk & 1;
    Py_ssize_t last = n - (n_chunks - 1) * kk;
    Py_ssize_t entries = (n_chunks - 1) * per_chunk + group_row + 2 * last;
    entries += entries & 1;
    if (host.len / 8 < entries) {
        PyErr_Format(PyExc_ValueError,
                     "staged_small_tables: the job table holds %zd entries, this job needs %zd",
                     host.len / 8, entries);
        goto done;
    }
    if (pieces.len / 8 < 3 * n) {
        PyErr_Format(PyExc_ValueError,
                     "staged_small_tables: the piece buffer holds %zd entries, %zd blocks need "
                     "%zd", pieces.len / 8, n, 3 * n);
        goto done;
    }
    info = PyTuple_New(n_chunks);
    if (!info) goto done;
    {
        const int64_t *gu = gpu.buf, *cu = cpu.buf, *base = ring.buf;
        int64_t *table = host.buf;
        int64_t *p_dst = pieces.buf, *p_src = p_dst + n, *p_size = p_dst + 2 * n;
        int64_t *p_cpu = gpu_to_cpu ? p_dst : p_src, *p_stage = gpu_to_cpu ? p_src : p_dst;
        int coalesce = n > 1 && length == stride && stride == cpu_stride;
        Py_ssize_t p = 0, slot0 = (Py_ssize_t)floor_mod(first_slot, depth);
        for (Py_ssize_t c = 0; c < n_chunks; c++) {
            Py_ssize_t lo = c * kk, m = c + 1 < n_chunks ? kk : last, off = c * per_chunk;
            int64_t *row = table + off, *src = row + group_row, *dst = src + m;
            row[0] = 0;
            row[1] = m;
            row[2] = ref_row;
            row[3] = 0;
            for (Py_ssize_t j = 0; j < m; j++) {
                if (gpu_to_cpu) {
                    src[j] = gu[lo + j];
                    dst[j] = j;
                } else {
                    src[j] = j;
                    dst[j] = gu[lo + j];
                }
            }
            uint64_t stage = (uint64_t)base[(slot0 + c % depth) % depth] + (uint64_t)stage_off;
            uint64_t prev = 0;
            Py_ssize_t piece_lo = p, run = 0;
            for (Py_ssize_t j = 0; j < m; j++, stage += (uint64_t)stride) {
                uint64_t addr = (uint64_t)cpu_start + (uint64_t)cu[lo + j] * (uint64_t)cpu_stride;
                if (coalesce && j > 0 && addr == prev + (uint64_t)length) {
                    run++;
                } else {
                    if (p > piece_lo) p_size[p - 1] = (int64_t)((uint64_t)run * (uint64_t)length);
                    p_cpu[p] = (int64_t)addr;
                    p_stage[p] = (int64_t)stage;
                    p++;
                    run = 1;
                }
                prev = addr;
            }
            p_size[p - 1] = (int64_t)((uint64_t)run * (uint64_t)length);
            PyObject *item = Py_BuildValue("(nnnLnn)", off, (Py_ssize_t)1, m,
                                           (long long)m * refs, piece_lo, p);
            if (!item) goto done;
            PyTuple_SET_ITEM(info, c, item);
        }
        result = Py_BuildValue("(nO)", p, info);
    }
done:
    Py_XDECREF(info);
    PyBuffer_Release(&gpu);
    PyBuffer_Release(&cpu);
    PyBuffer_Release(&host);
    PyBuffer_Release(&pieces);
    PyBuffer_Release(&ring);
    return result;
}

/* issue_copies(fn, dst, src, size, kind, stream) -> (issued, code): for each piece i in order,
 * fn(dst[i], src[i], size[i], kind, stream), stopping at the first call that returns nonzero
 * (code; issued: the pieces before it). fn is the address of cudaMemcpyAsync in the CUDA
 * runtime torch loaded (dma.py takes it from its ctypes prototype), so these are the calls
 * its ctypes loop made, in the same order, without building ctypes arguments per piece
 * (~1 us each on the staged path's per-job host time). The GIL is released around the loop,
 * as ctypes released it around each call: an enqueue can block while the stream's queue is
 * full. dst, src, size: int64 buffers of one length; nothing here checks the addresses. */
typedef int (*copy_call)(void *, const void *, size_t, int, void *);

static PyObject *issue_copies(PyObject *self, PyObject *args) {
    unsigned long long fn, stream;
    Py_buffer dst, src, size;
    int kind;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*y*y*iK", &fn, &dst, &src, &size, &kind, &stream)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (fn == 0 || src.len != size.len || dst.len != size.len || size.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "issue_copies needs a function and three int64 buffers of one length, got "
                     "%zd, %zd and %zd bytes", dst.len, src.len, size.len);
        goto done;
    }
    {
        const int64_t *d = dst.buf, *s = src.buf, *n = size.buf;
        Py_ssize_t count = size.len / 8, i = 0;
        int code = 0;
        copy_call call = (copy_call)(uintptr_t)fn;
        Py_BEGIN_ALLOW_THREADS
        for (; i < count; i++) {
            code = call((void *)(intptr_t)d[i], (const void *)(intptr_t)s[i], (size_t)n[i], kind,
                        (void *)(uintptr_t)stream);
            if (code != 0) break;
        }
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(ni)", i, code);
    }
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    return result;
}

/* ---- CopyQueue: a direction's copies run in order by a thread that never takes the GIL ----
 *
 * A Python copy thread has to take the GIL back after every copy (to mark it done and to wake
 * the event loop), and while the loop thread runs Python it gets it only at the next switch
 * interval: the copies of a busy engine then wait on the loop instead of overlapping it. This
 * thread only touches memory: jobs are plain structs (units copied in at submit), a finished
 * job goes to a list the loop takes with take_finished(), and each completion is announced on
 * a file descriptor (an eventfd; a pipe elsewhere) that the loop watches with add_reader.
 *
 * CopyQueue(name=None, batch_policy=True)  the thread's name (Linux: shown by top -H), at
 *                  most 15 bytes; batch_policy: the thread runs SCHED_BATCH (Linux)
 * add_group(src_base, src_stride, src_sub, src_factor, dst_base, dst_stride, dst_sub,
 *           dst_factor, sizes) -> group id   (the buffers are held until the queue is freed)
 * submit([(group id, src_units, dst_units), ...]) -> sequence number (1, 2, ...)
 * take_finished() -> [(seq, seconds, cancelled), ...] in order
 * wait(seq)        blocks (GIL released) until job seq finished or was cancelled
 * fileno()         readable after a job finished
 * close()          cancels the jobs not started, lets the running one end, joins the thread
 */

typedef struct {
    Py_buffer bufs[7]; /* src base, stride, sub; dst base, stride, sub; sizes */
    int64_t sf, df;
    Py_ssize_t refs;
    int streaming; /* destination written with non-temporal stores (see copy_streaming) */
} QGroup;

typedef struct {
    QGroup *group;
    Py_ssize_t units;
    int64_t *su, *du;
} QPart;

typedef struct QJob {
    struct QJob *next;
    uint64_t seq;
    int cancelled;
    double seconds;
    Py_ssize_t nparts;
    QPart *parts;
} QJob;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;
    pthread_cond_t finished;
    pthread_t thread;
    int running, closing, idle, waiters, batch_policy;
    QJob *head, *tail, *fin_head, *fin_tail;
    uint64_t next_seq, done_seq;
    int fd_read, fd_write;
    QGroup **groups;
    Py_ssize_t ngroups, cap;
} CopyQueue;

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void queue_announce(CopyQueue *q) {
    if (q->fd_write < 0) return;
#ifdef __linux__
    uint64_t one = 1;
    ssize_t r = write(q->fd_write, &one, sizeof one);
#else
    char one = 1;
    ssize_t r = write(q->fd_write, &one, 1);
#endif
    (void)r; /* EAGAIN: a wake is already pending, which is all the reader needs */
}

static void queue_finish_locked(CopyQueue *q, QJob *job) {
    job->next = NULL;
    if (q->fin_tail) q->fin_tail->next = job; else q->fin_head = job;
    q->fin_tail = job;
    q->done_seq = job->seq;
    if (q->waiters) pthread_cond_broadcast(&q->finished);
}

static void *queue_thread(void *arg) {
    CopyQueue *q = (CopyQueue *)arg;
#if defined(__linux__) && defined(SCHED_BATCH)
    if (q->batch_policy) {
        /* A batch thread does not preempt the thread that woke it: the loop thread's
         * submit, which signals this thread when idle, then returns at once instead of
         * waiting out this thread's copy on a shared core (development VM, 2 busy cores:
         * submit p90 570-670 us -> 11-17 us). Best effort: refused, nothing changes. */
        struct sched_param sp;
        memset(&sp, 0, sizeof(sp));
        (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
    }
#endif
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->closing) {
            q->idle = 1;
            pthread_cond_wait(&q->work, &q->mu);
        }
        q->idle = 0;
        QJob *job = q->head;
        if (!job) break; /* closing, nothing queued */
        q->head = job->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->mu);
        double start = monotonic_s();
        int streamed = 0;
        for (Py_ssize_t p = 0; p < job->nparts; p++) {
            QPart *part = &job->parts[p];
            QGroup *g = part->group;
            copy_unit_run(g->bufs[0].buf, g->bufs[1].buf, g->bufs[2].buf, g->sf, g->bufs[3].buf,
                          g->bufs[4].buf, g->bufs[5].buf, g->df, g->bufs[6].buf, g->refs,
                          part->su, part->du, part->units, g->streaming);
            streamed |= g->streaming;
        }
        stream_fence(streamed);
        job->seconds = monotonic_s() - start;
        pthread_mutex_lock(&q->mu);
        queue_finish_locked(q, job);
        /* Announce with the lock released: the woken loop thread's next submit must not
         * find it held (and sleep on it) while this thread is in the write. */
        pthread_mutex_unlock(&q->mu);
        queue_announce(q);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    CopyQueue *q = (CopyQueue *)type->tp_alloc(type, 0);
    if (q) q->fd_read = q->fd_write = -1; /* never fd 0: dealloc closes these */
    return (PyObject *)q;
}

static int queue_init(CopyQueue *q, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "batch_policy", NULL};
    const char *name = NULL;
    int batch_policy = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zp", kwlist, &name, &batch_policy)) return -1;
    if (q->running || q->fd_read >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "CopyQueue is already initialised");
        return -1;
    }
#ifdef __linux__
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    q->fd_read = q->fd_write = fd;
#else
    int fds[2];
    if (pipe(fds) != 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    for (int i = 0; i < 2; i++) {
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK);
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    q->fd_read = fds[0];
    q->fd_write = fds[1];
#endif
    q->batch_policy = batch_policy;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->finished, NULL);
    int rc = pthread_create(&q->thread, NULL, queue_thread, q);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->running = 1;
#ifdef __linux__
    if (name) { /* shown by top -H and /proc/<pid>/task/<tid>/comm; at most 15 bytes */
        char short_name[16];
        strncpy(short_name, name, 15);
        short_name[15] = 0;
        pthread_setname_np(q->thread, short_name);
    }
#endif
    return 0;
}

/* Cancel what is queued, let the running copy end, join the thread. Idempotent. */
static void queue_stop(CopyQueue *q) {
    if (!q->running) return;
    pthread_mutex_lock(&q->mu);
    q->closing = 1;
    while (q->head) {
        QJob *job = q->head;
        q->head = job->next;
        job->cancelled = 1;
        queue_finish_locked(q, job);
    }
    q->tail = NULL;
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(q->thread, NULL);
    Py_END_ALLOW_THREADS
    q->running = 0;
    queue_announce(q);
}

static PyObject *queue_close(CopyQueue *q, PyObject *unused) {
    (void)unused;
    queue_stop(q);
    Py_RETURN_NONE;
}

static void queue_dealloc(CopyQueue *q) {
    queue_stop(q);
    QJob *lists[2] = {q->head, q->fin_head};
    for (int l = 0; l < 2; l++) {
        for (QJob *job = lists[l]; job;) {
            QJob *next = job->next;
            PyMem_RawFree(job);
            job = next;
        }
    }
    for (Py_ssize_t i = 0; i < q->ngroups; i++) {
        for (int b = 0; b < 7; b++) PyBuffer_Release(&q->groups[i]->bufs[b]);
        PyMem_RawFree(q->groups[i]);
    }
    PyMem_RawFree(q->groups);
    if (q->fd_read >= 0) close(q->fd_read);
    if (q->fd_write >= 0 && q->fd_write != q->fd_read) close(q->fd_write);
    if (q->fd_read >= 0 || q->running) {
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->work);
        pthread_cond_destroy(&q->finished);
    }
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *queue_add_group(CopyQueue *q, PyObject *args) {
    QGroup *g = PyMem_RawCalloc(1, sizeof(QGroup));
    if (!g) return PyErr_NoMemory();
    Py_buffer *b = g->bufs;
    Py_ssize_t sf, df;
    int streaming = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*y*y*ny*|p", &b[0], &b[1], &b[2], &sf, &b[3], &b[4],
                          &b[5], &df, &b[6], &streaming)) {
        PyMem_RawFree(g);
        return NULL;
    }
    g->streaming = streaming;
    g->refs = b[6].len / 8;
    g->sf = sf;
    g->df = df;
    const char *names[6] = {"src_base", "src_stride", "src_sub", "dst_base", "dst_stride",
                            "dst_sub"};
    int ok = sf >= 1 && df >= 1;
    if (!ok) PyErr_SetString(PyExc_ValueError, "CopyQueue.add_group: factors must be >= 1");
    for (int i = 0; ok && i < 6; i++) ok = same_len(&b[i], g->refs, names[i]);
    if (ok && q->ngroups == q->cap) {
        Py_ssize_t cap = q->cap ? 2 * q->cap : 4;
        QGroup **grown = PyMem_RawRealloc(q->groups, (size_t)cap * sizeof(QGroup *));
        if (!grown) { PyErr_NoMemory(); ok = 0; }
        else { q->groups = grown; q->cap = cap; }
    }
    if (!ok) {
        for (int i = 0; i < 7; i++) PyBuffer_Release(&b[i]);
        PyMem_RawFree(g);
        return NULL;
    }
    q->groups[q->ngroups] = g;
    return PyLong_FromSsize_t(q->ngroups++);
}

static PyObject *queue_submit(CopyQueue *q, PyObject *parts_arg) {
    PyObject *parts = PySequence_Fast(parts_arg, "CopyQueue.submit needs a sequence of parts");
    if (!parts) return NULL;
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(parts);
    PyObject **items = PySequence_Fast_ITEMS(parts);
    Py_buffer *bufs = PyMem_Calloc((size_t)(2 * nparts + 1), sizeof(Py_buffer));
    Py_ssize_t *groups = PyMem_Calloc((size_t)(nparts + 1), sizeof(Py_ssize_t));
    Py_ssize_t parsed = 0, total_units = 0;
    PyObject *result = NULL;
    QJob *job = NULL;
    if (!bufs || !groups) { PyErr_NoMemory(); goto done; }
    for (; parsed < nparts; parsed++) {
        if (!PyArg_ParseTuple(items[parsed], "ny*y*", &groups[parsed], &bufs[2 * parsed],
                              &bufs[2 * parsed + 1])) {
            goto done;
        }
        Py_buffer *su = &bufs[2 * parsed], *du = &bufs[2 * parsed + 1];
        if (groups[parsed] < 0 || groups[parsed] >= q->ngroups) {
            PyErr_Format(PyExc_ValueError, "CopyQueue.submit: no group %zd", groups[parsed]);
            parsed++;
            goto done;
        }
        if (su->len != du->len || su->len % 8 != 0) {
            PyErr_Format(PyExc_ValueError,
                         "CopyQueue.submit: unit buffers of %zd and %zd bytes (int64, one length)",
                         su->len, du->len);
            parsed++;
            goto done;
        }
        total_units += su->len / 8;
    }
    size_t size = sizeof(QJob) + (size_t)nparts * sizeof(QPart) + (size_t)total_units * 16;
    job = PyMem_RawMalloc(size);
    if (!job) { PyErr_NoMemory(); goto done; }
    memset(job, 0, sizeof(QJob));
    job->nparts = nparts;
    job->parts = (QPart *)(job + 1);
    int64_t *units = (int64_t *)(job->parts + nparts);
    for (Py_ssize_t p = 0; p < nparts; p++) {
        Py_ssize_t n = bufs[2 * p].len / 8;
        QPart *part = &job->parts[p];
        part->group = q->groups[groups[p]];
        part->units = n;
        part->su = units;
        part->du = units + n;
        memcpy(part->su, bufs[2 * p].buf, (size_t)n * 8);
        memcpy(part->du, bufs[2 * p + 1].buf, (size_t)n * 8);
        units += 2 * n;
    }
    pthread_mutex_lock(&q->mu);
    if (!q->running || q->closing) {
        pthread_mutex_unlock(&q->mu);
        PyErr_SetString(PyExc_RuntimeError, "the copy queue is closed");
        goto done;
    }
    job->seq = ++q->next_seq;
    if (q->tail) q->tail->next = job; else q->head = job;
    q->tail = job;
    int wake = q->idle;
    q->idle = 0; /* one signal per idle spell: later submits find it busy */
    pthread_mutex_unlock(&q->mu);
    if (wake) pthread_cond_signal(&q->work); /* after unlocking: the woken thread can run */
    result = PyLong_FromUnsignedLongLong(job->seq);
    job = NULL;
done:
    if (job) PyMem_RawFree(job);
    for (Py_ssize_t i = 0; i < 2 * parsed; i++) {
        if (bufs[i].obj || bufs[i].buf) PyBuffer_Release(&bufs[i]);
    }
    PyMem_Free(bufs);
    PyMem_Free(groups);
    Py_DECREF(parts);
    return result;
}

/* run_now(group, src_units, dst_units): copy one part of a registered group on the calling
 * thread (GIL released) and return when the bytes are in place. For a small job that finds
 * the queue idle: the group's columns were parsed once by add_group, so the call parses two
 * buffers instead of copy_units' nine. */
static PyObject *queue_run_now(CopyQueue *q, PyObject *args) {
    Py_ssize_t gid;
    Py_buffer su, du;
    if (!PyArg_ParseTuple(args, "ny*y*", &gid, &su, &du)) return NULL;
    PyObject *result = NULL;
    if (gid < 0 || gid >= q->ngroups) {
        PyErr_Format(PyExc_ValueError, "CopyQueue.run_now: no group %zd", gid);
        goto done;
    }
    if (su.len != du.len || su.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "CopyQueue.run_now: unit buffers of %zd and %zd bytes (int64, one length)",
                     su.len, du.len);
        goto done;
    }
    {
        QGroup *g = q->groups[gid];
        const int64_t *u_s = su.buf, *u_d = du.buf;
        Py_ssize_t units = su.len / 8;
        Py_BEGIN_ALLOW_THREADS
        copy_unit_run(g->bufs[0].buf, g->bufs[1].buf, g->bufs[2].buf, g->sf, g->bufs[3].buf,
                      g->bufs[4].buf, g->bufs[5].buf, g->df, g->bufs[6].buf, g->refs, u_s, u_d,
                      units, g->streaming);
        stream_fence(g->streaming);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&su);
    PyBuffer_Release(&du);
    return result;
}

static PyObject *queue_take_finished(CopyQueue *q, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&q->mu);
    QJob *job = q->fin_head;
    q->fin_head = q->fin_tail = NULL;
    pthread_mutex_unlock(&q->mu);
    PyObject *out = PyList_New(0);
    while (job) {
        QJob *next = job->next;
        if (out) {
            PyObject *item = Py_BuildValue("(KdO)", (unsigned long long)job->seq, job->seconds,
                                           job->cancelled ? Py_True : Py_False);
            if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
            Py_XDECREF(item);
        }
        PyMem_RawFree(job);
        job = next;
    }
    return out;
}

static PyObject *queue_wait(CopyQueue *q, PyObject *arg) {
    unsigned long long seq = PyLong_AsUnsignedLongLong(arg);
    if (seq == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    q->waiters++;
    while (q->done_seq < seq && q->running && seq <= q->next_seq) {
        pthread_cond_wait(&q->finished, &q->mu);
    }
    q->waiters--;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *queue_fileno(CopyQueue *q, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(q->fd_read);
}

static PyMethodDef queue_methods[] = {
    {"add_group", (PyCFunction)queue_add_group, METH_VARARGS,
     "add_group(src_base, src_stride, src_sub, src_factor, dst_base, dst_stride, dst_sub, "
     "dst_factor, sizes, streaming=False) -> group id"},
    {"submit", (PyCFunction)queue_submit, METH_O,
     "submit([(group, src_units, dst_units), ...]) -> sequence number"},
    {"run_now", (PyCFunction)queue_run_now, METH_VARARGS,
     "run_now(group, src_units, dst_units): copy one part now on this thread (GIL released)"},
    {"take_finished", (PyCFunction)queue_take_finished, METH_NOARGS,
     "take_finished() -> [(seq, seconds, cancelled), ...]"},
    {"wait", (PyCFunction)queue_wait, METH_O, "wait(seq): block until job seq ended"},
    {"fileno", (PyCFunction)queue_fileno, METH_NOARGS, "readable after a job finished"},
    {"close", (PyCFunction)queue_close, METH_NOARGS, "cancel queued jobs, join the thread"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcache_offload.dataplane.copy._hostcopy.CopyQueue",
    .tp_basicsize = sizeof(CopyQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A direction's host copies, run in order by a thread that never takes the GIL.",
    .tp_new = queue_new,
    .tp_init = (initproc)queue_init,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_methods = queue_methods,
};

static PyMethodDef methods[] = {
    {"copy_fragments", copy_fragments, METH_VARARGS,
     "copy_fragments(src, dst, sizes): memcpy each fragment, GIL released."},
    {"plan_units", plan_units, METH_VARARGS,
     "plan_units(src_ids, dst_ids, size, start, sf, df, src_rows, dst_rows, out) -> bool"},
    {"hold_units", hold_units, METH_VARARGS,
     "hold_units(src, dst, size, start, sf, df, src_rows, dst_rows, src_units, dst_units, used,"
     " marks, mark)"
     " -> 1 held, 0 a held job writes its blocks, -1 malformed, -2 no room"},
    {"staged_small_tables", staged_small_tables, METH_VARARGS,
     "staged_small_tables(gpu_units, cpu_units, host, pieces, ring_base, k, depth, first_slot, "
     "group_row, ref_row, refs, length, stride, cpu_start, cpu_stride, stage_off, gpu_to_cpu) "
     "-> (n_pieces, chunks): a one-group whole-block staged job's kernel tables and DMA pieces"},
    {"issue_copies", issue_copies, METH_VARARGS,
     "issue_copies(fn, dst, src, size, kind, stream) -> (issued, code): fn(dst[i], src[i], "
     "size[i], kind, stream) per piece until one returns nonzero, GIL released"},
    {"copy_units", copy_units, METH_VARARGS,
     "copy_units(..., streaming=False): copy every (ref, unit) fragment of one group, GIL "
     "released; streaming: non-temporal stores to the destination."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache_offload.dataplane.copy._hostcopy", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void) {
    if (PyType_Ready(&CopyQueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CopyQueueType);
    if (PyModule_AddObject(m, "CopyQueue", (PyObject *)&CopyQueueType) < 0) {
        Py_DECREF(&CopyQueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
