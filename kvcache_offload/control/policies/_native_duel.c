/* The adaptive LRU's weight miniatures (_mini_sim.WeightDuel) in C.
 *
 * The same simulation as the Python/mypyc WeightDuel, decision for decision: one small copy
 * of the adaptive LRU per candidate weight, all fed the same sampled keys, scored by the
 * hits before the first miss of each request, the weight re-chosen every ``decay_every``
 * sampled keys. Compiled with mypyc, a copy's step still costs list appends of boxed
 * objects, reference counting and bounds checks (about 1,800 instructions per copy and key
 * on the conversation trace at 1 %, a fifth of the adaptive LRU's manager time there); here
 * a copy keeps its state in byte and integer arrays indexed by a small id per key.
 *
 * Keys get ids from one dict shared by the copies; an id goes back to a free list once no
 * copy holds its key (cached or ghost) and no request in progress uses it, so the arrays stay
 * as small as the copies. A queue is a log of (id, stamp) entries, oldest first; an entry is
 * live while its id is still in that queue and its stamp is still the id's last access
 * (every access has a time of its own), so moves and evictions leave dead entries behind,
 * skipped at the head and dropped when they outnumber the live ones.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { ABSENT = 0, PROBATION = 1, MAIN = 2, GHOST = 3, MAIN_GHOST = 4 };

typedef struct {
    int64_t stamp;
    int32_t id;
} Entry;

typedef struct {
    Entry *items;
    Py_ssize_t head, len, cap;
    Py_ssize_t size; /* live entries */
    uint8_t tag;
} Log;

typedef struct {
    double weight;
    double hits;
    Py_ssize_t run;
    uint8_t *state; /* id -> where the key is in this copy */
    Log probation, main, ghost, main_ghost;
} Copy;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity; /* of each copy, and of each of its ghost lists */
    Py_ssize_t ncopies;
    Copy *copies;
    PyObject *ids;   /* key -> id (int) */
    PyObject **keys; /* id -> key (a reference) or NULL while free */
    int32_t *refs;   /* copies holding the id, plus requests using it */
    int64_t *last;   /* id -> time of its last access */
    int32_t *free_ids;
    Py_ssize_t nfree, nids, ids_cap;
    int64_t now;
    Py_ssize_t steps, decay_every;
    double weight;
    int32_t *held;
    Py_ssize_t held_cap;
} Duel;

/* -- logs ------------------------------------------------------------------------------ */

static inline int entry_live(const Entry *e, uint8_t tag, const uint8_t *state,
                             const int64_t *last) {
    return state[e->id] == tag && last[e->id] == e->stamp;
}

static void log_compact(Log *log, const uint8_t *state, const int64_t *last) {
    Py_ssize_t out = 0;
    for (Py_ssize_t i = log->head; i < log->len; i++) {
        if (entry_live(&log->items[i], log->tag, state, last)) {
            log->items[out++] = log->items[i];
        }
    }
    log->head = 0;
    log->len = out;
}

static int log_append(Log *log, int32_t id, int64_t stamp, const uint8_t *state,
                      const int64_t *last) {
    if (log->len == log->cap) {
        if (log->head > 0 && log->head * 2 >= log->len) {
            memmove(log->items, log->items + log->head,
                    (size_t)(log->len - log->head) * sizeof(Entry));
            log->len -= log->head;
            log->head = 0;
        } else {
            Py_ssize_t cap = log->cap ? 2 * log->cap : 64;
            Entry *items = PyMem_Realloc(log->items, (size_t)cap * sizeof(Entry));
            if (items == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            log->items = items;
            log->cap = cap;
        }
    }
    log->items[log->len].id = id;
    log->items[log->len].stamp = stamp;
    log->len++;
    if (log->len - log->head > 2 * log->size + 64) {
        log_compact(log, state, last);
    }
    return 0;
}

/* The position of the oldest live entry (the head moves past dead ones), or -1. */
static inline Py_ssize_t log_oldest(Log *log, const uint8_t *state, const int64_t *last) {
    if (log->size == 0) {
        return -1;
    }
    Py_ssize_t head = log->head;
    while (!entry_live(&log->items[head], log->tag, state, last)) {
        head++;
    }
    log->head = head;
    return head;
}

/* -- ids ------------------------------------------------------------------------------- */

/* Resizes the array ``field`` to ``cap`` items of its own type, or returns -1 from the
 * function it stands in, leaving the array as it was. */
#define GROW_OR_FAIL(field, cap)                                                   \
    do {                                                                           \
        void *grown = PyMem_Realloc((field), (size_t)(cap) * sizeof(*(field)));    \
        if (grown == NULL) {                                                       \
            return -1;                                                             \
        }                                                                          \
        (field) = grown;                                                           \
    } while (0)

static int grow_ids(Duel *d) {
    Py_ssize_t cap = d->ids_cap ? 2 * d->ids_cap : 256;
    GROW_OR_FAIL(d->keys, cap);
    GROW_OR_FAIL(d->refs, cap);
    GROW_OR_FAIL(d->last, cap);
    GROW_OR_FAIL(d->free_ids, cap);
    for (Py_ssize_t c = 0; c < d->ncopies; c++) {
        GROW_OR_FAIL(d->copies[c].state, cap);
        memset(d->copies[c].state + d->ids_cap, ABSENT, (size_t)(cap - d->ids_cap));
    }
    d->ids_cap = cap;
    return 0;
}

/* The id of ``key`` (a new one if no copy holds it), held until release(); -1 on error. */
static int32_t pin(Duel *d, PyObject *key) {
    PyObject *found = PyDict_GetItemWithError(d->ids, key);
    int32_t id;
    if (found != NULL) {
        id = (int32_t)PyLong_AsLong(found);
    } else {
        if (PyErr_Occurred()) {
            return -1;
        }
        if (d->nfree > 0) {
            id = d->free_ids[--d->nfree];
        } else {
            if (d->nids == d->ids_cap && grow_ids(d) < 0) {
                PyErr_NoMemory();
                return -1;
            }
            id = (int32_t)d->nids++;
            d->refs[id] = 0;
            d->last[id] = -1;
        }
        PyObject *boxed = PyLong_FromLong(id);
        if (boxed == NULL) {
            d->free_ids[d->nfree++] = id;
            return -1;
        }
        int failed = PyDict_SetItem(d->ids, key, boxed);
        Py_DECREF(boxed);
        if (failed) {
            d->free_ids[d->nfree++] = id;
            return -1;
        }
        Py_INCREF(key);
        d->keys[id] = key;
    }
    d->refs[id]++;
    return id;
}

/* One holder fewer for ``id``; the last one frees it. */
static int release(Duel *d, int32_t id) {
    if (--d->refs[id] > 0) {
        return 0;
    }
    PyObject *key = d->keys[id];
    d->keys[id] = NULL;
    d->free_ids[d->nfree++] = id;
    int failed = PyDict_DelItem(d->ids, key);
    Py_DECREF(key);
    return failed ? -1 : 0;
}

/* -- one copy -------------------------------------------------------------------------- */

/* Evict the entry at ``pos`` (a queue's oldest) into ``ghosts``, forgetting the oldest ghost
 * beyond the capacity. */
static int copy_remember(Duel *d, Copy *c, Log *queue, Py_ssize_t pos, Log *ghosts) {
    int32_t id = queue->items[pos].id;
    int64_t stamp = queue->items[pos].stamp;
    queue->size--;
    c->state[id] = ghosts->tag;
    queue->head = pos + 1; /* every entry up to it is dead now */
    ghosts->size++;
    if (log_append(ghosts, id, stamp, c->state, d->last) < 0) {
        return -1;
    }
    if (ghosts->size > d->capacity) {
        Py_ssize_t oldest = log_oldest(ghosts, c->state, d->last);
        int32_t gone = ghosts->items[oldest].id;
        c->state[gone] = ABSENT;
        ghosts->head = oldest + 1;
        ghosts->size--;
        return release(d, gone);
    }
    return 0;
}

/* Use the key of ``id`` at time ``now`` (already its last access): 1 on a hit, 0 on a miss
 * (it is stored, evicting one key if full), -1 on error. */
static int copy_access(Duel *d, Copy *c, int32_t id, int64_t now) {
    uint8_t *state = c->state;
    const int64_t *last = d->last;
    uint8_t where = state[id];
    if (where == MAIN) {
        return log_append(&c->main, id, now, state, last) < 0 ? -1 : 1;
    }
    if (where == PROBATION) {
        c->probation.size--;
        state[id] = MAIN;
        c->main.size++;
        return log_append(&c->main, id, now, state, last) < 0 ? -1 : 1;
    }
    if (where == ABSENT) {
        d->refs[id]++;
        state[id] = PROBATION;
        c->probation.size++;
        if (log_append(&c->probation, id, now, state, last) < 0) {
            return -1;
        }
    } else { /* a ghost of either queue: stored again soon after leaving */
        if (where == GHOST) {
            c->ghost.size--;
        } else {
            c->main_ghost.size--;
        }
        state[id] = MAIN;
        c->main.size++;
        if (log_append(&c->main, id, now, state, last) < 0) {
            return -1;
        }
    }
    if (c->probation.size + c->main.size <= d->capacity) {
        return 0;
    }
    Py_ssize_t oldest = log_oldest(&c->probation, state, last);
    Py_ssize_t main_oldest = log_oldest(&c->main, state, last);
    if (oldest >= 0 &&
        (main_oldest < 0 ||
         (double)(now - c->probation.items[oldest].stamp) * c->weight >=
             (double)(now - c->main.items[main_oldest].stamp))) {
        return copy_remember(d, c, &c->probation, oldest, &c->ghost) < 0 ? -1 : 0;
    }
    if (main_oldest >= 0) {
        return copy_remember(d, c, &c->main, main_oldest, &c->main_ghost) < 0 ? -1 : 0;
    }
    return 0;
}

/* -- the type -------------------------------------------------------------------------- */

static void Duel_dealloc(Duel *d) {
    for (Py_ssize_t i = 0; i < d->nids; i++) {
        Py_XDECREF(d->keys[i]);
    }
    for (Py_ssize_t c = 0; c < d->ncopies; c++) {
        Copy *copy = &d->copies[c];
        PyMem_Free(copy->state);
        PyMem_Free(copy->probation.items);
        PyMem_Free(copy->main.items);
        PyMem_Free(copy->ghost.items);
        PyMem_Free(copy->main_ghost.items);
    }
    PyMem_Free(d->copies);
    PyMem_Free(d->keys);
    PyMem_Free(d->refs);
    PyMem_Free(d->last);
    PyMem_Free(d->free_ids);
    PyMem_Free(d->held);
    Py_XDECREF(d->ids);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static int Duel_init(Duel *d, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "weights", "decay_every", "initial_weight", NULL};
    Py_ssize_t capacity, decay_every;
    PyObject *weights;
    double initial_weight;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOnd", kwlist, &capacity, &weights,
                                     &decay_every, &initial_weight)) {
        return -1;
    }
    if (d->copies != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "NativeDuel is initialised once");
        return -1;
    }
    if (capacity < 1 || decay_every < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity and decay_every must be at least 1");
        return -1;
    }
    PyObject *seq = PySequence_Fast(weights, "weights must be a sequence of floats");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "at least one weight");
        return -1;
    }
    d->copies = PyMem_Calloc((size_t)n, sizeof(Copy));
    if (d->copies == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    d->ncopies = n;
    static const uint8_t tags[4] = {PROBATION, MAIN, GHOST, MAIN_GHOST};
    for (Py_ssize_t c = 0; c < n; c++) {
        double w = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, c));
        if (w == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        Copy *copy = &d->copies[c];
        copy->weight = w;
        Log *logs[4] = {&copy->probation, &copy->main, &copy->ghost, &copy->main_ghost};
        for (int i = 0; i < 4; i++) {
            logs[i]->tag = tags[i];
        }
    }
    Py_DECREF(seq);
    d->ids = PyDict_New();
    if (d->ids == NULL) {
        return -1;
    }
    d->capacity = capacity;
    d->decay_every = decay_every;
    d->weight = initial_weight;
    return 0;
}

static PyObject *Duel_access(Duel *d, PyObject *keys) {
    if (d->copies == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "NativeDuel is not initialised");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > d->held_cap) {
        int32_t *held = PyMem_Realloc(d->held, (size_t)n * sizeof(int32_t));
        if (held == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        d->held = held;
        d->held_cap = n;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t pinned = 0;
    int failed = 0;
    for (; pinned < n; pinned++) {
        int32_t id = pin(d, items[pinned]);
        if (id < 0) {
            failed = 1;
            break;
        }
        d->held[pinned] = id;
    }
    Py_DECREF(seq);
    if (!failed) {
        Copy *copies = d->copies;
        Py_ssize_t ncopies = d->ncopies;
        for (Py_ssize_t c = 0; c < ncopies; c++) {
            copies[c].run = 0;
        }
        int64_t now = d->now;
        /* Tail first, as touch uses them; each copy scores the hits up to its first miss in
         * prefix order (past a miss the real lookup would stop too). */
        for (Py_ssize_t i = n - 1; i >= 0 && !failed; i--) {
            int32_t id = d->held[i];
            now++;
            d->last[id] = now;
            for (Py_ssize_t c = 0; c < ncopies; c++) {
                int hit = copy_access(d, &copies[c], id, now);
                if (hit < 0) {
                    failed = 1;
                    break;
                }
                copies[c].run = hit ? copies[c].run + 1 : 0;
            }
        }
        d->now = now;
        if (!failed) {
            for (Py_ssize_t c = 0; c < ncopies; c++) {
                copies[c].hits += (double)copies[c].run;
            }
        }
    }
    for (Py_ssize_t i = 0; i < pinned; i++) {
        if (release(d, d->held[i]) < 0) {
            failed = 1;
        }
    }
    if (failed) {
        return NULL;
    }
    d->steps += n;
    if (d->steps >= d->decay_every) {
        d->steps = 0;
        Copy *best = &d->copies[0];
        for (Py_ssize_t c = 0; c < d->ncopies; c++) {
            if (d->copies[c].hits > best->hits) {
                best = &d->copies[c];
            }
        }
        d->weight = best->weight;
        for (Py_ssize_t c = 0; c < d->ncopies; c++) {
            d->copies[c].hits *= 0.5;
        }
    }
    return PyFloat_FromDouble(d->weight);
}

/* One Python object per copy, as a list (NULL with an exception set when one fails). */
static PyObject *per_copy(Duel *d, PyObject *(*item)(const Copy *)) {
    PyObject *out = PyList_New(d->ncopies);
    for (Py_ssize_t c = 0; out != NULL && c < d->ncopies; c++) {
        PyObject *value = item(&d->copies[c]);
        if (value == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, c, value);
    }
    return out;
}

static PyObject *copy_size(const Copy *copy) {
    return PyLong_FromSsize_t(copy->probation.size + copy->main.size);
}

static PyObject *copy_hits(const Copy *copy) { return PyFloat_FromDouble(copy->hits); }

static PyObject *Duel_sizes(Duel *d, PyObject *Py_UNUSED(ignored)) {
    return per_copy(d, copy_size);
}

static PyObject *Duel_hits(Duel *d, PyObject *Py_UNUSED(ignored)) {
    return per_copy(d, copy_hits);
}

static PyObject *Duel_id_slots(Duel *d, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(d->nids);
}

static PyObject *Duel_get_weight(Duel *d, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble(d->weight);
}

static PyMethodDef Duel_methods[] = {
    {"access", (PyCFunction)Duel_access, METH_O,
     "access(keys) -> weight: the sampled keys of one request, in prefix order"},
    {"sizes", (PyCFunction)Duel_sizes, METH_NOARGS, "each copy's cached keys"},
    {"hits", (PyCFunction)Duel_hits, METH_NOARGS, "each copy's decayed hit count"},
    {"id_slots", (PyCFunction)Duel_id_slots, METH_NOARGS, "ids ever allocated"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Duel_getset[] = {
    {"weight", (getter)Duel_get_weight, NULL, "the weight chosen last", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DuelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcache_offload.control.policies._native_duel.NativeDuel",
    .tp_basicsize = sizeof(Duel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NativeDuel(capacity, weights, decay_every, initial_weight): see _mini_sim.WeightDuel",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Duel_init,
    .tp_dealloc = (destructor)Duel_dealloc,
    .tp_methods = Duel_methods,
    .tp_getset = Duel_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_duel", "The adaptive LRU's weight miniatures in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__native_duel(void) {
    if (PyType_Ready(&DuelType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&DuelType);
    if (PyModule_AddObject(m, "NativeDuel", (PyObject *)&DuelType) < 0) {
        Py_DECREF(&DuelType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
