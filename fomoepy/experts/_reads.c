/* A read in flight (fomoepy.experts.reads.Read), its state and the asks a step makes of it in C.

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
    if (!InvalidStateError || !str_wait) return NULL;
    callback_failed = Py_NewRef(Py_None);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &ReadType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
