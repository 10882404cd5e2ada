/* A read in flight (fomoepy.experts.reads.Read), its state and the asks a step makes of it in C; and the
   reads made ahead (fomoepy.experts.read_ahead.ReadAhead), below.

   A decode step at the 397B shape makes about twenty-five asks of its reads and guesses (issued, landed
   at once from a cached or null store, asked whether done, for the result, for an error): as Python
   methods each is a frame of its own, about a tenth of a microsecond of work behind a third of a
   microsecond of call. Here each is one C call. The semantics are PyRead's (reads.py), the definition:
   settled once, by whichever thread lands it; each callback run once, on that thread (at once, on the
   caller's, when added after); a callback's failure logged (reads._callback_failed), the others still run.
   Everything here runs under the GIL with no Python code between a test and its update, so the lock PyRead
   takes is the GIL's. Waiting for a read that has not landed is Python's (the subclass's _wait). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    int done;
    PyObject *value, *error; /* set once, before `done` */
    PyObject *callbacks;     /* a list while not done and some were added; else NULL */
} ReadObject;

static PyObject *InvalidStateError, *callback_failed, *str_wait;

static PyObject *Read_done(ReadObject *self, PyObject *unused) { return PyBool_FromLong(self->done); }

/* wait (the subclass's _wait(timeout)) unless landed; `timeout` positional or by name: 0, or -1 with an error set */
static int landed_or_wait(ReadObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1 || (nkw && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout"))) {
        PyErr_SetString(PyExc_TypeError, "takes one optional argument, timeout");
        return -1;
    }
    if (self->done) return 0;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_wait, nargs + nkw ? args[0] : Py_None);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

static PyObject *Read_result(ReadObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (landed_or_wait(self, args, nargs, kwnames)) return NULL;
    if (self->error) {
        PyErr_SetObject((PyObject *)Py_TYPE(self->error), self->error);
        return NULL;
    }
    return Py_NewRef(self->value ? self->value : Py_None);
}

static PyObject *Read_exception(ReadObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (landed_or_wait(self, args, nargs, kwnames)) return NULL;
    return Py_NewRef(self->error ? self->error : Py_None);
}

/* fn(self), a failure logged (an Exception: a callback's failure neither stops the others nor the reader) */
static int run_callback(ReadObject *self, PyObject *fn) {
    PyObject *r = PyObject_CallOneArg(fn, (PyObject *)self);
    if (r) {
        Py_DECREF(r);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace) PyException_SetTraceback(value, trace);
    PyObject *logged = PyObject_CallOneArg(callback_failed, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    Py_XDECREF(logged);
    return logged ? 0 : -1;
}

static PyObject *Read_add_done_callback(ReadObject *self, PyObject *fn) {
    if (!self->done) {
        if (!self->callbacks && !(self->callbacks = PyList_New(0))) return NULL;
        if (PyList_Append(self->callbacks, fn)) return NULL;
        Py_RETURN_NONE;
    }
    if (run_callback(self, fn)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *settle(ReadObject *self, PyObject *value, PyObject *error) {
    if (self->done) {
        PyErr_SetString(InvalidStateError, "this read has landed already");
        return NULL;
    }
    Py_XINCREF(value);
    Py_XINCREF(error);
    self->value = value, self->error = error;
    self->done = 1;
    PyObject *callbacks = self->callbacks;
    self->callbacks = NULL;
    int failed = 0;
    for (Py_ssize_t i = 0; callbacks && i < PyList_GET_SIZE(callbacks) && !failed; i++)
        failed = run_callback(self, PyList_GET_ITEM(callbacks, i));
    Py_XDECREF(callbacks);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Read_set_result(ReadObject *self, PyObject *value) { return settle(self, value, NULL); }

static PyObject *Read_set_exception(ReadObject *self, PyObject *error) { return settle(self, NULL, error); }

/* landed(value): a read that completed as it was made */
static PyObject *Read_landed(PyObject *cls, PyObject *value) {
    ReadObject *read = (ReadObject *)PyObject_CallNoArgs(cls);
    if (!read) return NULL;
    read->value = Py_NewRef(value);
    read->done = 1;
    return (PyObject *)read;
}

static int Read_traverse(ReadObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->value);
    Py_VISIT(self->error);
    Py_VISIT(self->callbacks);
    return 0;
}

static int Read_clear(ReadObject *self) {
    Py_CLEAR(self->value);
    Py_CLEAR(self->error);
    Py_CLEAR(self->callbacks);
    return 0;
}

static void Read_dealloc(ReadObject *self) {
    PyObject_GC_UnTrack(self);
    Read_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Read_methods[] = {
    {"done", (PyCFunction)Read_done, METH_NOARGS, "whether it landed"},
    {"result", (PyCFunction)(void (*)(void))Read_result, METH_FASTCALL | METH_KEYWORDS, "result(timeout=None): its value (waited for), or its error raised"},
    {"exception", (PyCFunction)(void (*)(void))Read_exception, METH_FASTCALL | METH_KEYWORDS, "exception(timeout=None): its error or None (waited for)"},
    {"add_done_callback", (PyCFunction)Read_add_done_callback, METH_O, "fn(read) once it has landed"},
    {"set_result", (PyCFunction)Read_set_result, METH_O, "it landed with this value"},
    {"set_exception", (PyCFunction)Read_set_exception, METH_O, "it failed with this error"},
    {"landed", (PyCFunction)Read_landed, METH_O | METH_CLASS, "landed(value): a read that completed as it was made"},
    {NULL},
};

static PyTypeObject ReadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.experts._reads.Read",
    .tp_basicsize = sizeof(ReadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A read in flight: its state and asks in C (fomoepy.experts.reads.Read's base).",
    .tp_traverse = (traverseproc)Read_traverse,
    .tp_clear = (inquiry)Read_clear,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Read_dealloc,
    .tp_methods = Read_methods,
};

/* -- ReadAhead: guesses fed to the drives a few at a time (fomoepy.experts.read_ahead.PyReadAhead) -------

   The same semantics as PyReadAhead, the definition (read its docstring): queue(layer, experts) makes what
   each guess's read needs (prepare, on the calling thread; with prepare_anywhere, as each is issued, on the
   issuing thread) and issues them as the depth allows; a landing
   read (its callback, on whichever thread lands it) issues the next; take(layer, wanted) hands over the
   reads the step chose and drops the other guesses of its layer; close() issues nothing more. Its state
   is changed only under the GIL with no Python code between a test and its update (PyReadAhead's lock);
   `submit` and `prepare` are Python, called with the state whole. A step queues about three guesses and
   takes them back: as Python, some fifteen frames and twenty lock operations. */

typedef struct {
    PyObject *key;      /* (layer, expert) */
    PyObject *prepared; /* what its read needs (prepare's), or None; NULL: made as it is issued (anywhere) */
    long at;            /* its position in its step's reading order */
} Guess;

typedef struct {
    PyObject *key, *future;
    long at;
} Issued;

typedef struct {
    PyObject_HEAD
    PyObject *submit, *prepare, *counts;
    PyObject *submitting;                         /* keys popped from the queue whose read is not yet filed */
    Py_ssize_t depth, in_flight, n_queued, head, n_issued, cap_issued;
    Guess *queued;
    Issued *issued;
    int closed;
    int anywhere; /* prepare may run on any thread: called as a guess is issued, never for one dropped unissued */
} ReadAheadObject;

static PyObject *one, *str__landed, *log_debug, *str_done, *str_add_done_callback, *str_read_at, *str_used_at;
static PyObject *COUNT[6]; /* issued, used, landed, wasted, in_the_way, skipped */
enum { C_ISSUED, C_USED, C_LANDED, C_WASTED, C_IN_THE_WAY, C_SKIPPED };

/* counts.<which> += by */
static int count(ReadAheadObject *self, int which, Py_ssize_t by) {
    if (!by) return 0;
    PyObject *v = PyObject_GetAttr(self->counts, COUNT[which]);
    if (!v) return -1;
    PyObject *by_obj = PyLong_FromSsize_t(by), *sum = by_obj ? PyNumber_Add(v, by_obj) : NULL;
    Py_DECREF(v);
    Py_XDECREF(by_obj);
    int rc = sum ? PyObject_SetAttr(self->counts, COUNT[which], sum) : -1;
    Py_XDECREF(sum);
    return rc;
}

/* ReadAheadCounts.count_read(at, used) */
static int count_read(ReadAheadObject *self, long at, int used) {
    PyObject *lists[2] = {PyObject_GetAttr(self->counts, str_read_at), PyObject_GetAttr(self->counts, str_used_at)};
    int rc = lists[0] && lists[1] && PyList_Check(lists[0]) && PyList_Check(lists[1]) ? 0 : -1;
    if (rc && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "read_at and used_at are lists");
    for (int i = 0; !rc && i < 2; i++) {
        while (!rc && PyList_GET_SIZE(lists[i]) <= at) {
            PyObject *zero = PyLong_FromLong(0);
            rc = zero ? PyList_Append(lists[i], zero) : -1;
            Py_XDECREF(zero);
        }
        if (rc || (i == 1 && !used)) continue;
        PyObject *n = PyNumber_Add(PyList_GET_ITEM(lists[i], at), one);
        rc = n ? PyList_SetItem(lists[i], at, n) : -1; /* (steals n) */
    }
    Py_XDECREF(lists[0]);
    Py_XDECREF(lists[1]);
    return rc;
}

static void clear_queued(ReadAheadObject *self) {
    for (Py_ssize_t i = self->head; i < self->n_queued; i++) {
        Py_DECREF(self->queued[i].key);
        Py_XDECREF(self->queued[i].prepared);
    }
    PyMem_Free(self->queued);
    self->queued = NULL;
    self->n_queued = self->head = 0;
}

static void drop_issued(ReadAheadObject *self, Py_ssize_t i) {
    Py_DECREF(self->issued[i].key);
    Py_DECREF(self->issued[i].future);
    memmove(&self->issued[i], &self->issued[i + 1], (self->n_issued - i - 1) * sizeof(Issued));
    self->n_issued--;
}

static long layer_of_key(PyObject *key) { return PyLong_AsLong(PyTuple_GET_ITEM(key, 0)); }

/* a bool method's answer (future.done()): 1, 0, or -1 with an error set */
static int ask(PyObject *future, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(future, name);
    if (!r) return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* what the read of the guess `key` needs: prepare[layer](), prepare(layer, expert), or None (a new reference;
   NULL with an error set) */
static PyObject *prepared_for(ReadAheadObject *self, PyObject *key) {
    if (PyList_Check(self->prepare)) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(key, 0));
        if (at < 0 || at >= PyList_GET_SIZE(self->prepare)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "ReadAhead: no prepare for this layer");
            return NULL;
        }
        PyObject *take = Py_NewRef(PyList_GET_ITEM(self->prepare, at)); /* (held: a call may change the list) */
        PyObject *prepared = PyObject_CallNoArgs(take);
        Py_DECREF(take);
        return prepared;
    }
    if (self->prepare == Py_None) return Py_NewRef(Py_None);
    return PyObject_CallFunctionObjArgs(self->prepare, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1), NULL);
}

/* PyReadAhead._issue */
static int issue(ReadAheadObject *self) {
    for (;;) {
        if (self->closed || self->in_flight >= self->depth || self->head >= self->n_queued) return 0;
        Guess g = self->queued[self->head++]; /* (its references are g's now) */
        self->in_flight++;
        if (count(self, C_ISSUED, 1) || PySet_Add(self->submitting, g.key)) {
            Py_DECREF(g.key);
            Py_XDECREF(g.prepared);
            return -1;
        }
        /* (prepare_anywhere: made now, here; its failure is the submit's, the guess not issued) */
        PyObject *prepared = g.prepared ? g.prepared : prepared_for(self, g.key);
        PyObject *future = !prepared ? NULL
                           : PyObject_CallFunctionObjArgs(self->submit, PyTuple_GET_ITEM(g.key, 0), PyTuple_GET_ITEM(g.key, 1),
                                                          prepared, NULL);
        Py_XDECREF(prepared);
        PyObject *type = NULL, *value = NULL, *trace = NULL;
        if (!future) {
            if (PyErr_ExceptionMatches(PyExc_RuntimeError)) { /* a closed store's pool: a guess is optional */
                PyErr_Fetch(&type, &value, &trace);
                PyErr_NormalizeException(&type, &value, &trace);
                PyObject *r = PyObject_CallFunction(log_debug, "sOO", "read ahead of %s not issued: %s", g.key, value);
                Py_XDECREF(r);
                Py_CLEAR(type);
                Py_CLEAR(value);
                Py_CLEAR(trace);
                if (!r) PyErr_Clear();
            } else
                PyErr_Fetch(&type, &value, &trace); /* (raised after the guess is filed as refused) */
        }
        int landed = 0, rc = PySet_Discard(self->submitting, g.key) < 0 ? -1 : 0;
        if (!future)
            self->in_flight--;
        else if (!rc) {
            if (self->n_issued == self->cap_issued) {
                Py_ssize_t cap = self->cap_issued ? 2 * self->cap_issued : 16;
                Issued *grown = PyMem_Realloc(self->issued, cap * sizeof(Issued));
                if (!grown) rc = -1, PyErr_NoMemory();
                else self->issued = grown, self->cap_issued = cap;
            }
            Py_ssize_t at = 0; /* (a guess issued again for the same step takes its first's place, as a dict's key does) */
            for (; !rc && at < self->n_issued; at++) {
                int same = PyObject_RichCompareBool(self->issued[at].key, g.key, Py_EQ);
                if (same < 0) rc = -1;
                else if (same) break;
            }
            if (!rc && at < self->n_issued) {
                Py_SETREF(self->issued[at].future, Py_NewRef(future));
                self->issued[at].at = g.at;
            } else if (!rc)
                self->issued[self->n_issued++] = (Issued){Py_NewRef(g.key), Py_NewRef(future), g.at};
            if (!rc) {
                landed = ask(future, str_done); /* landed already (a null or cached read): the drive is free */
                if (landed < 0) rc = -1;
                else self->in_flight -= landed;
            }
        }
        Py_DECREF(g.key);
        if (type) {
            Py_XDECREF(future);
            PyErr_Restore(type, value, trace);
            return -1;
        }
        if (rc || !future) {
            Py_XDECREF(future);
            return rc;
        }
        if (!landed) { /* added after the future is filed: a read that lands meanwhile calls back at once */
            /* (its _landed bound now, as PyReadAhead's: held by the read until it lands, no cycle after) */
            PyObject *landed = PyObject_GetAttr((PyObject *)self, str__landed);
            PyObject *r = landed ? PyObject_CallMethodOneArg(future, str_add_done_callback, landed) : NULL;
            Py_XDECREF(landed);
            Py_XDECREF(r);
            if (!r) {
                Py_DECREF(future);
                return -1;
            }
        }
        Py_DECREF(future);
    }
}

static PyObject *ReadAhead_queue(ReadAheadObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "queue(layer, experts)");
        return NULL;
    }
    PyObject *layer = PyNumber_Long(args[0]);
    PyObject *seq = layer ? PySequence_Fast(args[1], "experts is a sequence") : NULL;
    if (!seq) {
        Py_XDECREF(layer);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Guess *guesses = PyMem_Calloc(n ? n : 1, sizeof(Guess));
    Py_ssize_t made = 0;
    int rc = guesses ? 0 : -1;
    /* a list: one callable per layer; a layer with none refused here, as the guesses are queued (PyReadAhead's) */
    if (!rc && PyList_Check(self->prepare)) {
        Py_ssize_t at = PyLong_AsSsize_t(layer);
        if (at < 0 || at >= PyList_GET_SIZE(self->prepare)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "ReadAhead: no prepare for this layer");
            rc = -1;
        }
    }
    for (; !rc && made < n; made++) { /* (what each read needs, made on this thread, in order; anywhere: as issued) */
        PyObject *e = PyNumber_Long(PySequence_Fast_GET_ITEM(seq, made));
        PyObject *key = e ? PyTuple_Pack(2, layer, e) : NULL;
        PyObject *prepared = !key || self->anywhere ? NULL : prepared_for(self, key);
        Py_XDECREF(e);
        if (!key || (!prepared && !self->anywhere)) {
            Py_XDECREF(key);
            rc = -1;
            break;
        }
        guesses[made] = (Guess){key, prepared, (long)made};
    }
    Py_DECREF(seq);
    if (rc) {
        for (Py_ssize_t i = 0; guesses && i < made; i++) {
            Py_DECREF(guesses[i].key);
            Py_XDECREF(guesses[i].prepared);
        }
        PyMem_Free(guesses);
        Py_DECREF(layer);
        return NULL;
    }
    long l = PyLong_AsLong(layer);
    Py_DECREF(layer);
    if (count(self, C_SKIPPED, self->n_queued - self->head)) rc = -1;
    clear_queued(self);
    self->queued = guesses, self->n_queued = n;
    Py_ssize_t wasted = 0;
    for (Py_ssize_t i = 0; i < self->n_issued;) /* guesses for a step that never came */
        if (layer_of_key(self->issued[i].key) != l) drop_issued(self, i), wasted++;
        else i++;
    if (rc || count(self, C_WASTED, wasted) || issue(self)) return NULL;
    Py_RETURN_NONE;
}

/* whether a guess of `layer` is being issued by another thread now (popped, its read not yet filed): 1, 0,
   or -1 with an error set */
static int submitting_layer(ReadAheadObject *self, long layer) {
    if (!PySet_GET_SIZE(self->submitting)) return 0;
    PyObject *it = PyObject_GetIter(self->submitting), *key;
    if (!it) return -1;
    int found = 0;
    while (!found && (key = PyIter_Next(it))) {
        found = layer_of_key(key) == layer;
        Py_DECREF(key);
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : found;
}

static PyObject *ReadAhead_take(ReadAheadObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(layer, wanted)");
        return NULL;
    }
    long layer = PyLong_AsLong(args[0]);
    if (layer == -1 && PyErr_Occurred()) return NULL;
    PyObject *wanted = PySet_New(args[1]);
    if (!wanted) return NULL;
    /* a guess another thread is issuing right now is filed in a moment: wait for it, not read it twice */
    int busy;
    while ((busy = submitting_layer(self, layer)) == 1) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
        Py_END_ALLOW_THREADS
    }
    if (busy < 0) {
        Py_DECREF(wanted);
        return NULL;
    }
    Py_ssize_t kept = self->head, skipped = 0;
    for (Py_ssize_t i = self->head; i < self->n_queued; i++) {
        Guess g = self->queued[i];
        if (layer_of_key(g.key) == layer) {
            Py_DECREF(g.key);
            Py_XDECREF(g.prepared);
            skipped++;
        } else
            self->queued[kept++] = g;
    }
    self->n_queued = kept;
    PyObject *taken = PyDict_New();
    int rc = taken && !count(self, C_SKIPPED, skipped) ? 0 : -1;
    Py_ssize_t used = 0, landed = 0, wasted = 0, in_the_way = 0;
    for (Py_ssize_t i = 0; !rc && i < self->n_issued;) {
        Issued *it = &self->issued[i];
        if (layer_of_key(it->key) != layer) {
            i++;
            continue;
        }
        PyObject *e = PyTuple_GET_ITEM(it->key, 1);
        int chosen = PySet_Contains(wanted, e), done = chosen < 0 ? -1 : ask(it->future, str_done);
        if (done < 0 || count_read(self, it->at, chosen)) {
            rc = -1;
            break;
        }
        if (chosen) {
            rc = PyDict_SetItem(taken, e, it->future);
            used++, landed += done;
        } else
            wasted++, in_the_way += !done;
        drop_issued(self, i);
    }
    Py_DECREF(wanted);
    if (!rc && (count(self, C_USED, used) || count(self, C_LANDED, landed) || count(self, C_WASTED, wasted) ||
                count(self, C_IN_THE_WAY, in_the_way)))
        rc = -1;
    if (rc) Py_CLEAR(taken);
    return taken;
}

static PyObject *ReadAhead_landed(ReadAheadObject *self, PyObject *unused) {
    self->in_flight--;
    if (issue(self)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ReadAhead_close(ReadAheadObject *self, PyObject *unused) {
    self->closed = 1;
    Py_ssize_t left = self->n_queued - self->head;
    clear_queued(self);
    while (self->n_issued) drop_issued(self, self->n_issued - 1);
    if (count(self, C_SKIPPED, left)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ReadAhead_get_issued(ReadAheadObject *self, void *unused) {
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out && i < self->n_issued; i++) {
        PyObject *v = Py_BuildValue("(Ol)", self->issued[i].future, self->issued[i].at);
        if (!v || PyDict_SetItem(out, self->issued[i].key, v)) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *ReadAhead_get_in_flight(ReadAheadObject *self, void *unused) { return PyLong_FromSsize_t(self->in_flight); }

static PyObject *ReadAhead_get_counts(ReadAheadObject *self, void *unused) { return Py_NewRef(self->counts); }

static int ReadAhead_set_counts(ReadAheadObject *self, PyObject *value, void *unused) {
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "counts cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->counts, Py_NewRef(value));
    return 0;
}

static PyObject *ReadAhead_get_depth(ReadAheadObject *self, void *unused) { return PyLong_FromSsize_t(self->depth); }

static PyObject *ReadAhead_get_submit(ReadAheadObject *self, void *unused) { return Py_NewRef(self->submit); }

static int ReadAhead_set_submit(ReadAheadObject *self, PyObject *value, void *unused) {
    if (!value || !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "submit is a callable");
        return -1;
    }
    Py_XSETREF(self->submit, Py_NewRef(value));
    return 0;
}

static int ReadAhead_set_depth(ReadAheadObject *self, PyObject *value, void *unused) {
    Py_ssize_t depth = value ? PyLong_AsSsize_t(value) : -1;
    if (depth == -1 && PyErr_Occurred()) return -1;
    if (depth < 1) {
        PyErr_Format(PyExc_ValueError, "read-ahead depth must be >= 1, got %zd", depth);
        return -1;
    }
    self->depth = depth;
    return 0;
}

static int ReadAhead_init(ReadAheadObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"submit", "depth", "prepare", "prepare_anywhere", NULL};
    PyObject *submit, *depth, *prepare = Py_None;
    int anywhere = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|Op", names, &submit, &depth, &prepare, &anywhere)) return -1;
    if (ReadAhead_set_depth(self, depth, NULL)) return -1;
    PyObject *module = PyImport_ImportModule("fomoepy.experts.read_ahead");
    PyObject *counts_type = module ? PyObject_GetAttrString(module, "ReadAheadCounts") : NULL;
    Py_XDECREF(module);
    PyObject *counts = counts_type ? PyObject_CallNoArgs(counts_type) : NULL;
    Py_XDECREF(counts_type);
    PyObject *submitting = counts ? PySet_New(NULL) : NULL;
    if (!submitting) {
        Py_XDECREF(counts);
        return -1;
    }
    Py_XSETREF(self->submit, Py_NewRef(submit));
    Py_XSETREF(self->prepare, Py_NewRef(prepare));
    self->anywhere = anywhere;
    Py_XSETREF(self->counts, counts);
    Py_XSETREF(self->submitting, submitting);
    return 0;
}

static int ReadAhead_traverse(ReadAheadObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->submit);
    Py_VISIT(self->prepare);
    Py_VISIT(self->counts);
    Py_VISIT(self->submitting);
    for (Py_ssize_t i = self->head; i < self->n_queued; i++) Py_VISIT(self->queued[i].prepared);
    for (Py_ssize_t i = 0; i < self->n_issued; i++) Py_VISIT(self->issued[i].future);
    return 0;
}

static int ReadAhead_clear(ReadAheadObject *self) {
    Py_CLEAR(self->submit);
    Py_CLEAR(self->prepare);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->submitting);
    clear_queued(self);
    while (self->n_issued) drop_issued(self, self->n_issued - 1);
    return 0;
}

static void ReadAhead_dealloc(ReadAheadObject *self) {
    PyObject_GC_UnTrack(self);
    ReadAhead_clear(self);
    PyMem_Free(self->issued);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ReadAhead_methods[] = {
    {"queue", (PyCFunction)(void (*)(void))ReadAhead_queue, METH_FASTCALL, "queue(layer, experts): read these guesses as the drives free up"},
    {"take", (PyCFunction)(void (*)(void))ReadAhead_take, METH_FASTCALL, "take(layer, wanted) -> {expert: read}: the step's; the rest dropped"},
    {"close", (PyCFunction)ReadAhead_close, METH_NOARGS, "close(): issue nothing more"},
    {"_landed", (PyCFunction)ReadAhead_landed, METH_O, "a read landed (its callback): the next guess goes out"},
    {NULL},
};

static PyGetSetDef ReadAhead_getset[] = {
    {"in_flight", (getter)ReadAhead_get_in_flight, NULL, "reads issued and not landed", NULL},
    {"counts", (getter)ReadAhead_get_counts, (setter)ReadAhead_set_counts, "its ReadAheadCounts", NULL},
    {"depth", (getter)ReadAhead_get_depth, (setter)ReadAhead_set_depth, "reads made ahead in flight at most", NULL},
    {"submit", (getter)ReadAhead_get_submit, (setter)ReadAhead_set_submit, "submit(layer, expert, prepared) -> a read in flight", NULL},
    {"_issued", (getter)ReadAhead_get_issued, NULL, "the guesses issued and not taken: {key: (read, position)}", NULL},
    {NULL},
};

static PyTypeObject ReadAheadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.experts._reads.ReadAhead",
    .tp_basicsize = sizeof(ReadAheadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Guesses fed to the drives a few at a time (read_ahead.PyReadAhead's semantics), in C.",
    .tp_traverse = (traverseproc)ReadAhead_traverse,
    .tp_clear = (inquiry)ReadAhead_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ReadAhead_init,
    .tp_dealloc = (destructor)ReadAhead_dealloc,
    .tp_methods = ReadAhead_methods,
    .tp_getset = ReadAhead_getset,
};

/* the function a failed callback's error is handed to (reads.py's logger) */
static PyObject *set_callback_failed(PyObject *module, PyObject *fn) {
    Py_XSETREF(callback_failed, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_callback_failed", set_callback_failed, METH_O, "set_callback_failed(fn): fn(error) logs a callback's failure"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_reads", "A read in flight, in C.", -1, module_methods};

PyMODINIT_FUNC PyInit__reads(void) {
    PyObject *futures = PyImport_ImportModule("concurrent.futures");
    if (!futures) return NULL;
    InvalidStateError = PyObject_GetAttrString(futures, "InvalidStateError");
    Py_DECREF(futures);
    str_wait = PyUnicode_InternFromString("_wait");
    str_done = PyUnicode_InternFromString("done");
    one = PyLong_FromLong(1);
    str__landed = PyUnicode_InternFromString("_landed");
    str_add_done_callback = PyUnicode_InternFromString("add_done_callback");
    str_read_at = PyUnicode_InternFromString("read_at");
    str_used_at = PyUnicode_InternFromString("used_at");
    const char *counts[6] = {"issued", "used", "landed", "wasted", "in_the_way", "skipped"};
    for (int i = 0; i < 6; i++)
        if (!(COUNT[i] = PyUnicode_InternFromString(counts[i]))) return NULL;
    PyObject *logging = PyImport_ImportModule("logging");
    PyObject *logger = logging ? PyObject_CallMethod(logging, "getLogger", "s", "fomoepy.experts.read_ahead") : NULL;
    Py_XDECREF(logging);
    log_debug = logger ? PyObject_GetAttrString(logger, "debug") : NULL;
    Py_XDECREF(logger);
    if (!InvalidStateError || !str_wait || !str__landed || !str_done || !str_add_done_callback || !str_read_at || !str_used_at || !log_debug)
        return NULL;
    callback_failed = Py_NewRef(Py_None);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &ReadType) < 0 || PyModule_AddType(m, &ReadAheadType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
