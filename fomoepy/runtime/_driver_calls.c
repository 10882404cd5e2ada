/* The driver calls a decode step makes by the dozen (launches, async copies, event records and waits,
   stream and event synchronisations), made through the bindings' own C layer.

   hip-python (hip.chip) and cuda-python (cuda.bindings.cydriver) export every driver function they wrap
   as a C function pointer in their Cython modules' __pyx_capi__ table: the same function their Python
   wrappers call, which loads the same library (libamdhip64 / libcuda, or the stand-ins). Through the
   Python wrappers a call costs 0.6-2.3 µs (each argument converted to a handle object, a status enum
   object made per call); from here it costs a tenth of that. The arguments are the same: handles and
   pointers as integers, as fomoepy.runtime.shim holds them.

   Calls(capsules, signatures) takes the nine functions' capsules in the order of the enum below, and
   the C signature each must have: Cython names a capsule by its function's signature, and a binding
   whose function changed is refused (TypeError) rather than called with the wrong arguments. Each method
   returns the driver's status as an int (0: success), and fomoepy.runtime.shim raises with the driver's
   message otherwise. The GIL is released around each call: a synchronisation blocks, and a simulated
   device may run a kernel inside a launch. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { LAUNCH, HTOD, DTOH, DTOD, RECORD, WAIT, SYNC, EVENT_SYNC, MEMSET32, N_CALLS };

/* Both APIs pass every handle and pointer in one 64-bit integer register (hipStream_t, CUstream: pointers;
   CUdeviceptr: unsigned long long), so one type per call serves both; a 32-bit memset pattern is an int
   in HIP and an unsigned int in CUDA, the same register either way. */
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                         void **);
typedef int (*copy_fn)(uint64_t, uint64_t, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned);
typedef int (*one_fn)(void *);
typedef int (*memset_fn)(uint64_t, uint32_t, size_t, void *);

typedef struct {
    PyObject_HEAD
    void *fn[N_CALLS];
    PyObject *capsules; /* kept alive: the functions live in the modules that exported them */
} Calls;

static int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* n integer arguments, exactly */
static int args_u64(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, uint64_t *out, const char *name) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_u64(args[i], &out[i])) return -1;
    return 0;
}

/* the status, or the exception a binding's function raised (cydriver's lazy loading raises, for one) */
static PyObject *status(int rc) {
    if (rc && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(rc);
}

static PyObject *Calls_launch(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[10]; /* function, grid x y z, block x y z, shared bytes, stream, params */
    if (args_u64(args, nargs, 10, a, "launch")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((launch_fn)self->fn[LAUNCH])((void *)(uintptr_t)a[0], (unsigned)a[1], (unsigned)a[2], (unsigned)a[3],
                                       (unsigned)a[4], (unsigned)a[5], (unsigned)a[6], (unsigned)a[7],
                                       (void *)(uintptr_t)a[8], (void **)(uintptr_t)a[9], NULL);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static PyObject *copy(Calls *self, int which, PyObject *const *args, Py_ssize_t nargs, const char *name) {
    uint64_t a[4]; /* dst, src, bytes, stream */
    if (args_u64(args, nargs, 4, a, name)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((copy_fn)self->fn[which])(a[0], a[1], (size_t)a[2], (void *)(uintptr_t)a[3]);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static PyObject *Calls_htod(Calls *self, PyObject *const *args, Py_ssize_t nargs) { return copy(self, HTOD, args, nargs, "htod"); }
static PyObject *Calls_dtoh(Calls *self, PyObject *const *args, Py_ssize_t nargs) { return copy(self, DTOH, args, nargs, "dtoh"); }
static PyObject *Calls_dtod(Calls *self, PyObject *const *args, Py_ssize_t nargs) { return copy(self, DTOD, args, nargs, "dtod"); }

static PyObject *Calls_record(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[2]; /* event, stream */
    if (args_u64(args, nargs, 2, a, "record")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((record_fn)self->fn[RECORD])((void *)(uintptr_t)a[0], (void *)(uintptr_t)a[1]);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static PyObject *Calls_wait(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[2]; /* stream, event */
    if (args_u64(args, nargs, 2, a, "wait")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((wait_fn)self->fn[WAIT])((void *)(uintptr_t)a[0], (void *)(uintptr_t)a[1], 0);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static PyObject *one(Calls *self, int which, PyObject *const *args, Py_ssize_t nargs, const char *name) {
    uint64_t a[1]; /* a stream or an event */
    if (args_u64(args, nargs, 1, a, name)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((one_fn)self->fn[which])((void *)(uintptr_t)a[0]);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static PyObject *Calls_sync(Calls *self, PyObject *const *args, Py_ssize_t nargs) { return one(self, SYNC, args, nargs, "sync"); }
static PyObject *Calls_event_sync(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    return one(self, EVENT_SYNC, args, nargs, "event_sync");
}

static PyObject *Calls_memset32(Calls *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[4]; /* dst, 32-bit pattern, count of words, stream */
    if (args_u64(args, nargs, 4, a, "memset32")) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((memset_fn)self->fn[MEMSET32])(a[0], (uint32_t)a[1], (size_t)a[2], (void *)(uintptr_t)a[3]);
    Py_END_ALLOW_THREADS
    return status(rc);
}

static int Calls_init(Calls *self, PyObject *args, PyObject *kw) {
    PyObject *capsules, *signatures;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &capsules, &PyTuple_Type, &signatures)) return -1;
    if (PyTuple_GET_SIZE(capsules) != N_CALLS || PyTuple_GET_SIZE(signatures) != N_CALLS) {
        PyErr_Format(PyExc_ValueError, "Calls takes %d capsules and %d signatures", N_CALLS, N_CALLS);
        return -1;
    }
    for (int i = 0; i < N_CALLS; i++) {
        PyObject *cap = PyTuple_GET_ITEM(capsules, i);
        if (!PyCapsule_CheckExact(cap)) {
            PyErr_Format(PyExc_TypeError, "Calls: argument %d is not a capsule", i);
            return -1;
        }
        /* Cython names each capsule by its function's C signature: the one this file's types assume */
        const char *name = PyCapsule_GetName(cap);
        const char *want = PyUnicode_AsUTF8(PyTuple_GET_ITEM(signatures, i));
        if (!want) return -1;
        if (!name || strcmp(name, want) != 0) {
            PyErr_Format(PyExc_TypeError, "the binding's function %d is \"%s\", expected \"%s\"", i, name ? name : "(unnamed)", want);
            return -1;
        }
        void *fn = PyCapsule_GetPointer(cap, name);
        if (!fn) return -1;
        self->fn[i] = fn;
    }
    Py_INCREF(capsules);
    Py_XSETREF(self->capsules, capsules);
    return 0;
}

static void Calls_dealloc(Calls *self) {
    Py_XDECREF(self->capsules);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Calls_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Calls_launch, METH_FASTCALL,
     "launch(function, gx, gy, gz, bx, by, bz, shared, stream, params) -> status"},
    {"htod", (PyCFunction)(void (*)(void))Calls_htod, METH_FASTCALL, "htod(dst, src, nbytes, stream) -> status"},
    {"dtoh", (PyCFunction)(void (*)(void))Calls_dtoh, METH_FASTCALL, "dtoh(dst, src, nbytes, stream) -> status"},
    {"dtod", (PyCFunction)(void (*)(void))Calls_dtod, METH_FASTCALL, "dtod(dst, src, nbytes, stream) -> status"},
    {"record", (PyCFunction)(void (*)(void))Calls_record, METH_FASTCALL, "record(event, stream) -> status"},
    {"wait", (PyCFunction)(void (*)(void))Calls_wait, METH_FASTCALL, "wait(stream, event) -> status"},
    {"sync", (PyCFunction)(void (*)(void))Calls_sync, METH_FASTCALL, "sync(stream) -> status"},
    {"event_sync", (PyCFunction)(void (*)(void))Calls_event_sync, METH_FASTCALL, "event_sync(event) -> status"},
    {"memset32", (PyCFunction)(void (*)(void))Calls_memset32, METH_FASTCALL,
     "memset32(dst, pattern, count, stream) -> status"},
    {NULL},
};

static PyTypeObject CallsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.Calls",
    .tp_basicsize = sizeof(Calls),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The hot driver calls through a binding's C function pointers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Calls_init,
    .tp_dealloc = (destructor)Calls_dealloc,
    .tp_methods = Calls_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_driver_calls",
                                    "The hot driver calls through the bindings' C layer.", -1, NULL};

PyMODINIT_FUNC PyInit__driver_calls(void) {
    if (PyType_Ready(&CallsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CallsType);
    if (PyModule_AddObject(m, "Calls", (PyObject *)&CallsType) < 0) {
        Py_DECREF(&CallsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
