/* ExpertStreamer.start_acquire in C (fomoepy.experts.streamer): a step's reads issued, its plan taken and
   committed, its host hits and the reads made ahead handed over, as one C call.

   The definition is the Python method (streamer.py's `start_acquire`, kept as ExpertStreamer.py_start_acquire):
   this is the same code, statement for statement, for the case every decode step is (all rows, no backfill
   thread); any other call goes to the definition. Everything it asks of the streamer, its cache, source,
   gate and read ahead it looks up as it goes, by name, as the Python does: an attribute a test or a caller
   replaces on an instance is the one used. At the 397B shape the method is some hundred Python lines a
   step (its loops over the plan's ten items, the reads, the evictions) around the calls it makes; here they
   are C's: 3.9-4.8 µs a step less (in one process against the Python, by hand). On the cpu backend nothing
   measurable: there the step's time is the cold memory its objects sit in, which C reaches just the same.

   `install(cls, definition, disk, host)` gives the method descriptor for class `cls` (bound like a Python
   method: `streamer.start_acquire(...)`, no frame of ours), falling back to `definition`; `disk` and
   `host` are Source.DISK and Source.HOST, a plan item's sources compared by identity as the Python does. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static PyObject *definition, *DISK, *HOST, *perf_counter;

enum {
    S_BACKFILL, S_CACHE, S_N_EXPERT, S_UNCACHED, S_GATE, S_GUESSED, S_SCORE, S_READ_AHEAD, S_TAKE, S_DONE, S_EXCEPTION,
    S_RESULT, S_SOURCE, S_SUBMIT, S_READ_BUFFER, S_READS_ISSUED_AT, S_SEQUENCES, S_PLANS_BESIDE, S_PLAN_SOON, S_PLAN,
    S_ISSUE_PREFETCH, S_ITEMS, S_EXPERT, S_HOST_SLOTS, S_COMMIT_SOON, S_COMMIT, S_HOST_EVICTIONS, S_DEMOTIONS, S_DOWNLOAD,
    S_POP, N_NAMES
};
static const char *NAMES[N_NAMES] = {
    "_backfill_thread", "cache", "n_expert", "uncached", "gate", "_guessed", "score", "read_ahead", "take", "done", "exception",
    "result", "source", "submit", "_read_buffer", "reads_issued_at", "_sequences", "plans_beside", "plan_soon", "plan",
    "_issue_prefetch", "items", "expert", "host_slots", "commit_soon", "commit", "host_evictions", "demotions", "_download",
    "pop"};
static PyObject *S[N_NAMES];

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* sorted(set(ids.ravel().tolist())) of an int64 array (any other: -2, nothing set, the definition's case) */
static int distinct_ids(PyObject *ids, PyObject **out, int64_t *lo, int64_t *hi) {
    Py_buffer view;
    if (PyObject_GetBuffer(ids, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)) {
        PyErr_Clear();
        return -2;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view.itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyBuffer_Release(&view);
        return -2;
    }
    Py_ssize_t n = view.len / 8;
    int64_t *v = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
    if (!v) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(v, view.buf, n * sizeof(int64_t));
    PyBuffer_Release(&view);
    qsort(v, n, sizeof(int64_t), cmp_i64);
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!m || v[i] != v[m - 1]) v[m++] = v[i];
    PyObject *list = PyList_New(m);
    for (Py_ssize_t i = 0; list && i < m; i++) {
        PyObject *e = PyLong_FromLongLong(v[i]);
        if (!e) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, e);
    }
    if (m) *lo = v[0], *hi = v[m - 1];
    PyMem_Free(v);
    *out = list;
    return list ? 0 : -1;
}

static PyObject *call_method0(PyObject *obj, int name) { return PyObject_CallMethodNoArgs(obj, S[name]); }

/* obj.name(args...) */
static PyObject *call_method(PyObject *obj, int name, Py_ssize_t n, PyObject *const *args) {
    PyObject *stack[5] = {obj};
    for (Py_ssize_t i = 0; i < n; i++) stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(S[name], stack, (n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static PyObject *fallback(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject **stack = PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (!stack) return PyErr_NoMemory();
    stack[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) stack[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(definition, stack, nargs + 1, kwnames);
    PyMem_Free(stack);
    return r;
}

/* the reads the step's experts need that the read ahead has: those landed whole go to `fetched`, the others
   stay in flight in `reads` (start_acquire's loop over read_ahead.take) */
static int hand_over(PyObject *read_ahead, PyObject *layer, PyObject *reads, PyObject *fetched) {
    PyObject *args[2] = {layer, reads};
    PyObject *taken = call_method(read_ahead, S_TAKE, 2, args);
    if (!taken) return -1;
    PyObject *items = PyMapping_Items(taken);
    Py_DECREF(taken);
    if (!items) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; !rc && i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i), *e = PyTuple_GET_ITEM(pair, 0), *f = PyTuple_GET_ITEM(pair, 1);
        PyObject *done = call_method0(f, S_DONE);
        int landed = done ? PyObject_IsTrue(done) : -1;
        Py_XDECREF(done);
        if (landed == 1) {
            PyObject *error = call_method0(f, S_EXCEPTION);
            landed = error ? error == Py_None : -1;
            Py_XDECREF(error);
        }
        if (landed < 0) rc = -1;
        else if (landed) {
            PyObject *value = call_method0(f, S_RESULT);
            rc = !value || PyDict_SetItem(fetched, e, value) || PyDict_DelItem(reads, e) ? -1 : 0;
            Py_XDECREF(value);
        } else
            rc = PyDict_SetItem(reads, e, f);
    }
    Py_DECREF(items);
    return rc;
}

/* {e: f if f is not None else submit(layer, e[, buffer()])} in the order of `reads` */
static PyObject *issue(PyObject *self, PyObject *layer, long l, PyObject *reads) {
    PyObject *source = PyObject_GetAttr(self, S[S_SOURCE]);
    if (!source) return NULL;
    PyObject *submit = PyObject_GetAttr(source, S[S_SUBMIT]);
    Py_DECREF(source);
    if (!submit) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        return Py_NewRef(reads);
    }
    PyObject *buffers = PyObject_GetAttr(self, S[S_READ_BUFFER]), *buffer = NULL, *out = NULL;
    if (!buffers) goto done;
    if (buffers != Py_None && !(buffer = PySequence_GetItem(buffers, l))) goto done;
    out = PyDict_New();
    PyObject *e, *f;
    Py_ssize_t at = 0;
    while (out && PyDict_Next(reads, &at, &e, &f)) {
        PyObject *read;
        if (f != Py_None)
            read = Py_NewRef(f);
        else if (buffer) {
            PyObject *into = PyObject_CallNoArgs(buffer);
            PyObject *args[3] = {layer, e, into};
            read = into ? PyObject_Vectorcall(submit, args, 3, NULL) : NULL;
            Py_XDECREF(into);
        } else {
            PyObject *args[2] = {layer, e};
            read = PyObject_Vectorcall(submit, args, 2, NULL);
        }
        if (!read || PyDict_SetItem(out, e, read)) Py_CLEAR(out);
        Py_XDECREF(read);
    }
done:
    Py_DECREF(submit);
    Py_XDECREF(buffers);
    Py_XDECREF(buffer);
    return out;
}

/* the plan's disk and host items' experts, in order (start_acquire's one pass over plan.items) */
static int split_items(PyObject *plan, PyObject **disk, PyObject **host) {
    PyObject *items = PyObject_GetAttr(plan, S[S_ITEMS]);
    PyObject *seq = items ? PySequence_Fast(items, "a plan's items are a sequence") : NULL;
    Py_XDECREF(items);
    *disk = seq ? PyList_New(0) : NULL, *host = *disk ? PyList_New(0) : NULL;
    int rc = *host ? 0 : -1;
    for (Py_ssize_t i = 0; !rc && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *source = PyObject_GetAttr(item, S[S_SOURCE]);
        if (!source) {
            rc = -1;
            break;
        }
        PyObject *to = source == DISK ? *disk : source == HOST ? *host : NULL;
        Py_DECREF(source);
        if (to) {
            PyObject *e = PyObject_GetAttr(item, S[S_EXPERT]);
            rc = !e || PyList_Append(to, e) ? -1 : 0;
            Py_XDECREF(e);
        }
    }
    Py_XDECREF(seq);
    return rc;
}

/* disk == sorted([*reads, *fetched]), else the definition's RuntimeError */
static int check_reads(PyObject *layer, PyObject *disk, PyObject *reads, PyObject *fetched) {
    PyObject *read = PyDict_Keys(reads), *more = read ? PyDict_Keys(fetched) : NULL;
    int rc = more && !PyList_SetSlice(read, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, more) ? PyList_Sort(read) : -1;
    int same = rc ? -1 : PyObject_RichCompareBool(disk, read, Py_EQ);
    if (same == 0) PyErr_Format(PyExc_RuntimeError, "layer %S: the plan reads %R, but %R were read", layer, disk, read);
    Py_XDECREF(read);
    Py_XDECREF(more);
    return same == 1 ? 0 : -1;
}

/* fetched[e] = host_slots[(layer, e)] for the host hits; commit; the host tier's evictees dropped; the
   demoted experts' bytes come down into it */
static int settle(PyObject *self, PyObject *layer, PyObject *plan, PyObject *host, PyObject *fetched) {
    PyObject *host_slots = PyObject_GetAttr(self, S[S_HOST_SLOTS]);
    if (!host_slots) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; !rc && i < PyList_GET_SIZE(host); i++) {
        PyObject *e = PyList_GET_ITEM(host, i), *key = PyTuple_Pack(2, layer, e);
        PyObject *bytes = key ? PyObject_GetItem(host_slots, key) : NULL;
        rc = !bytes || PyDict_SetItem(fetched, e, bytes) ? -1 : 0;
        Py_XDECREF(key);
        Py_XDECREF(bytes);
    }
    PyObject *cache = rc ? NULL : PyObject_GetAttr(self, S[S_CACHE]), *beside = cache ? PyObject_GetAttr(self, S[S_PLANS_BESIDE]) : NULL;
    int soon = beside ? PyObject_IsTrue(beside) : -1;
    Py_XDECREF(beside);
    PyObject *r = soon < 0 ? NULL : call_method(cache, soon ? S_COMMIT_SOON : S_COMMIT, 1, &plan);
    Py_XDECREF(cache);
    Py_XDECREF(r);
    if (!r) rc = -1;
    PyObject *evicted = rc ? NULL : PyObject_GetAttr(plan, S[S_HOST_EVICTIONS]);
    PyObject *seq = evicted ? PySequence_Fast(evicted, "a plan's evictions are a sequence") : NULL;
    Py_XDECREF(evicted);
    if (!rc && !seq) rc = -1;
    for (Py_ssize_t i = 0; !rc && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *args[2] = {PySequence_Fast_GET_ITEM(seq, i), Py_None};
        PyObject *gone = call_method(host_slots, S_POP, 2, args); /* (the bytes' last holder, often: dropped here) */
        if (!gone) rc = -1;
        Py_XDECREF(gone);
    }
    Py_XDECREF(seq);
    PyObject *demoted = rc ? NULL : PyObject_GetAttr(plan, S[S_DEMOTIONS]);
    seq = demoted ? PySequence_Fast(demoted, "a plan's demotions are a sequence") : NULL;
    Py_XDECREF(demoted);
    if (!rc && !seq) rc = -1;
    PyObject *download = !rc && PySequence_Fast_GET_SIZE(seq) ? PyObject_GetAttr(self, S[S_DOWNLOAD]) : NULL;
    if (!rc && PySequence_Fast_GET_SIZE(seq) && !download) rc = -1;
    for (Py_ssize_t i = 0; !rc && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i), *bytes = PyObject_CallOneArg(download, key);
        rc = !bytes || PyObject_SetItem(host_slots, key, bytes) ? -1 : 0;
        Py_XDECREF(bytes);
    }
    Py_XDECREF(seq);
    Py_XDECREF(download);
    Py_DECREF(host_slots);
    return rc;
}

static PyObject *start_acquire(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames || nargs < 2 || nargs > 4 || (nargs >= 3 && args[2] != Py_None) || !PyLong_CheckExact(args[0]))
        return fallback(self, args, nargs, kwnames); /* (some rows, or asked by name: the definition's) */
    PyObject *backfill = PyObject_GetAttr(self, S[S_BACKFILL]);
    if (!backfill) return NULL;
    Py_DECREF(backfill);
    if (backfill != Py_None) return fallback(self, args, nargs, kwnames);
    PyObject *layer = args[0], *ids = args[1], *beside = nargs == 4 ? args[3] : Py_None;
    long l = PyLong_AsLong(layer);
    if (l == -1 && PyErr_Occurred()) return NULL;
    PyObject *experts = NULL;
    int64_t lo = 0, hi = 0;
    int got = distinct_ids(ids, &experts, &lo, &hi);
    if (got == -2) return fallback(self, args, nargs, kwnames); /* (not an int64 array: the definition's) */
    if (got) return NULL;

    PyObject *reads = NULL, *fetched = NULL, *cache = NULL, *planned = NULL, *plan = NULL, *disk = NULL, *host = NULL, *out = NULL;
    PyObject *gate = NULL, *read_ahead = NULL, *t = NULL, *o = NULL;
    int valid = 1;
    if (!(cache = PyObject_GetAttr(self, S[S_CACHE]))) goto done;
    if (PyList_GET_SIZE(experts)) {
        PyObject *n = PyObject_GetAttr(cache, S[S_N_EXPERT]);
        long long n_expert = n ? PyLong_AsLongLong(n) : -1;
        Py_XDECREF(n);
        if (n_expert == -1 && PyErr_Occurred()) goto done;
        valid = lo >= 0 && hi < n_expert;
    }
    /* (invalid ids: nothing is read; the plan below says what is wrong) */
    if (!(reads = PyDict_New()) || !(fetched = PyDict_New())) goto done;
    if (valid) {
        PyObject *a[2] = {layer, experts};
        PyObject *uncached = call_method(cache, S_UNCACHED, 2, a);
        PyObject *seq = uncached ? PySequence_Fast(uncached, "uncached gives a list") : NULL;
        Py_XDECREF(uncached);
        if (!seq) goto done;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++)
            if (PyDict_SetItem(reads, PySequence_Fast_GET_ITEM(seq, i), Py_None)) {
                Py_DECREF(seq);
                goto done;
            }
        Py_DECREF(seq);
    }
    if (!(gate = PyObject_GetAttr(self, S[S_GATE]))) goto done;
    if (gate != Py_None) { /* the guesses this step reads from disk were right (read ahead or not) */
        PyObject *guesses = PyObject_GetAttr(self, S[S_GUESSED]);
        PyObject *a[2] = {layer, Py_None};
        PyObject *guessed = guesses ? call_method(guesses, S_POP, 2, a) : NULL;
        Py_XDECREF(guesses);
        if (!guessed) goto done;
        if (guessed != Py_None) {
            PyObject *seq = PySequence_Fast(guessed, "guesses are a sequence");
            Py_ssize_t right = 0;
            for (Py_ssize_t i = 0; seq && i < PySequence_Fast_GET_SIZE(seq); i++) {
                int in = PyDict_Contains(reads, PySequence_Fast_GET_ITEM(seq, i));
                if (in < 0) Py_CLEAR(seq);
                else right += in; /* (guesses are distinct) */
            }
            PyObject *made = seq ? PyLong_FromSsize_t(PySequence_Fast_GET_SIZE(seq)) : NULL, *hit = made ? PyLong_FromSsize_t(right) : NULL;
            PyObject *b[2] = {made, hit};
            PyObject *r = hit ? call_method(gate, S_SCORE, 2, b) : NULL;
            Py_XDECREF(seq);
            Py_XDECREF(made);
            Py_XDECREF(hit);
            Py_XDECREF(r);
            Py_DECREF(guessed);
            if (!r) goto done;
        } else
            Py_DECREF(guessed);
    }
    if (!(read_ahead = PyObject_GetAttr(self, S[S_READ_AHEAD]))) goto done;
    if (read_ahead != Py_None && valid && hand_over(read_ahead, layer, reads, fetched)) goto done;
    if (PyDict_GET_SIZE(reads)) { /* every read issued before any is waited on */
        PyObject *issued = issue(self, layer, l, reads);
        if (!issued) goto done;
        Py_SETREF(reads, issued);
    }
    t = PyObject_CallNoArgs(perf_counter); /* (MoEStep's record of the host time before it) */
    if (!t || PyObject_SetAttr(self, S[S_READS_ISSUED_AT], t)) goto done;
    /* the plan (plans_beside: begun now, made beside `beside`; nothing there changes the cache) */
    PyObject *sequences = PyObject_GetAttr(self, S[S_SEQUENCES]), *soon = sequences ? PyObject_GetAttr(self, S[S_PLANS_BESIDE]) : NULL;
    int plans_beside = soon ? PyObject_IsTrue(soon) : -1;
    Py_XDECREF(soon);
    if (plans_beside < 0) {
        Py_XDECREF(sequences);
        goto done;
    }
    PyObject *a[3] = {layer, ids, sequences};
    if (plans_beside && !(planned = call_method(cache, S_PLAN_SOON, 3, a))) {
        Py_DECREF(sequences);
        goto done;
    }
    if (beside != Py_None) {
        PyObject *b[2] = {fetched, reads};
        if (!(o = PyObject_Vectorcall(beside, b, 2, NULL))) {
            Py_DECREF(sequences);
            goto done;
        }
        Py_CLEAR(o);
    }
    /* the next layer's guesses (predicted in `beside`) go to the drives next, behind this step's reads */
    if (!(o = call_method0(self, S_ISSUE_PREFETCH))) {
        Py_DECREF(sequences);
        goto done;
    }
    Py_CLEAR(o);
    plan = planned ? PyObject_CallNoArgs(planned) : call_method(cache, S_PLAN, 3, a);
    Py_DECREF(sequences);
    if (!plan || split_items(plan, &disk, &host) || check_reads(layer, disk, reads, fetched) || settle(self, layer, plan, host, fetched))
        goto done;
    out = PyTuple_Pack(3, plan, fetched, reads);
done:
    Py_XDECREF(experts);
    Py_XDECREF(reads);
    Py_XDECREF(fetched);
    Py_XDECREF(cache);
    Py_XDECREF(planned);
    Py_XDECREF(plan);
    Py_XDECREF(disk);
    Py_XDECREF(host);
    Py_XDECREF(gate);
    Py_XDECREF(read_ahead);
    Py_XDECREF(t);
    return out;
}

static PyMethodDef start_acquire_def = {
    "start_acquire", (PyCFunction)(void (*)(void))start_acquire, METH_FASTCALL | METH_KEYWORDS,
    "ExpertStreamer.start_acquire(layer, ids, rows=None, beside=None), in C (fomoepy/experts/_acquire.c); "
    "the definition is ExpertStreamer.py_start_acquire"};

static PyObject *install(PyObject *module, PyObject *args) {
    PyTypeObject *cls;
    PyObject *fn, *disk, *host;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyType_Type, &cls, &fn, &disk, &host)) return NULL;
    Py_XSETREF(definition, Py_NewRef(fn));
    Py_XSETREF(DISK, Py_NewRef(disk));
    Py_XSETREF(HOST, Py_NewRef(host));
    return PyDescr_NewMethod(cls, &start_acquire_def);
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS,
     "install(cls, definition, Source.DISK, Source.HOST) -> the method descriptor of start_acquire for cls"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fomoepy.experts._acquire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__acquire(void) {
    for (int i = 0; i < N_NAMES; i++)
        if (!(S[i] = PyUnicode_InternFromString(NAMES[i]))) return NULL;
    PyObject *time = PyImport_ImportModule("time");
    perf_counter = time ? PyObject_GetAttrString(time, "perf_counter") : NULL;
    Py_XDECREF(time);
    if (!perf_counter) return NULL;
    return PyModule_Create(&module);
}
