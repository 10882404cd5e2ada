/* The driver calls a decode step makes by the dozen (launches, async copies, event records and waits,
   stream and event synchronisations), made through the bindings' own C layer.

   hip-python (hip.chip) and cuda-python (cuda.bindings.cydriver) export every driver function they wrap
   as a C function pointer in their Cython modules' __pyx_capi__ table: the same function their Python
   wrappers call, which loads the same library (libamdhip64 / libcuda, or the stand-ins). Through the
   Python wrappers a call costs 0.6-2.3 µs (each argument converted to a handle object, a status enum
   object made per call); from here it costs a tenth of that. The arguments are the same: handles and
   pointers as integers, as fomoepy.runtime.shim holds them.

   Calls(capsules, signatures, shim, address, names) takes the nine functions' capsules in the order of
   the enum below, and the C signature each must have: Cython names a capsule by its function's
   signature, and a binding whose function changed is refused (TypeError) rather than called with the
   wrong arguments. Each call is whole, as DriverShim's own: the shim's device made current first (when
   another shim's is: shim._current_here), a stream's or event's handle object turned into its integer
   (address(handle), remembered per object), and a failed status raised as the shim's GpuError naming
   the call (shim._failed(names[call], status)); a call returns None. The GIL is released around each
   call: a synchronisation blocks, and a simulated device may run a kernel inside a launch. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <time.h>
#include <structmember.h>

#include "_driver_calls.h"
#include "_moe_pack.h"


double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static PyObject *str_shim, *str_current_here, *str_failed;

int as_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* a handle as the driver takes it: an int as it is, a binding's object through `address`, remembered */
int handle_u64(Calls *self, PyObject *o, uint64_t *out) {
    if (PyLong_Check(o)) return as_u64(o, out);
    for (int i = 0; i < self->n_handles; i++)
        if (self->handle_obj[i] == o) {
            *out = self->handle_raw[i];
            return 0;
        }
    PyObject *v = PyObject_CallOneArg(self->address, o);
    if (!v) return -1;
    int rc = as_u64(v, out);
    Py_DECREF(v);
    if (rc) return -1;
    if (self->n_handles == HANDLES_KEPT) { /* more than a process keeps: start over */
        for (int i = 0; i < self->n_handles; i++) Py_CLEAR(self->handle_obj[i]);
        self->n_handles = 0;
    }
    Py_INCREF(o);
    self->handle_obj[self->n_handles] = o;
    self->handle_raw[self->n_handles++] = *out;
    return 0;
}

/* the shim's device is the calling thread's current one (shim._current_here, when another's is) */
static int make_current(Calls *self) {
    PyObject *cur = PyObject_GetAttr(self->current, str_shim);
    if (!cur) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
    } else {
        int same = cur == self->shim;
        Py_DECREF(cur);
        if (same) return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(self->shim, str_current_here);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* None, or the exception a binding's function raised (cydriver's lazy loading raises, for one), or the
   shim's error for call `which`'s status */
static PyObject *status(Calls *self, int which, int rc) {
    if (!rc) Py_RETURN_NONE;
    if (PyErr_Occurred()) return NULL;
    PyObject *code = PyLong_FromLong(rc);
    if (!code) return NULL;
    PyObject *r = PyObject_CallMethodObjArgs(self->shim, str_failed, PyTuple_GET_ITEM(self->names, which), code, NULL);
    Py_DECREF(code);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "a driver call failed with status %d", rc);
    return NULL;
}

/* each call's Python name and arguments: integers (i), and handles (h) that may be binding objects */
static const struct {
    const char *name, *kinds;
} CALLS[N_CALLS] = {
    [LAUNCH] = {"launch", "hiiiiiiihi"}, /* function, grid x y z, block x y z, shared bytes, stream, params */
    [HTOD] = {"htod", "iiih"},           /* dst, src, bytes, stream */
    [DTOH] = {"dtoh", "iiih"},
    [DTOD] = {"dtod", "iiih"},
    [RECORD] = {"record", "hh"},         /* event, stream */
    [WAIT] = {"wait", "hh"},             /* stream, event */
    [SYNC] = {"sync", "h"},              /* stream */
    [EVENT_SYNC] = {"event_sync", "h"},  /* event */
    [MEMSET32] = {"memset32", "iiih"},   /* dst, 32-bit pattern, count of words, stream */
};

#define P(x) ((void *)(uintptr_t)(x))


/* call `which` with its arguments as integers (the GIL released around it), as DriverShim's own methods
   make it: none where there is nothing to copy or set (so the shim can hand these methods out as its
   own), the shim's device made current first; None, or NULL with the call's error set */
int log_call(Calls *calls, const char *name, const uint64_t *a, int n) {
    if (!calls->log || calls->log == Py_None) return 0;
    PyObject *entry = PyTuple_New(n + 1), *v;
    if (!entry) return -1;
    PyTuple_SET_ITEM(entry, 0, PyUnicode_FromString(name));
    for (int i = 0; i < n; i++) {
        PyTuple_SET_ITEM(entry, i + 1, v = PyLong_FromUnsignedLongLong(a[i]));
        if (!v) break;
    }
    int rc = PyErr_Occurred() ? -1 : PyList_Append(calls->log, entry);
    Py_DECREF(entry);
    return rc;
}

static PyObject *driver_call(Calls *self, int which, const uint64_t a[]) {
    if ((which == HTOD || which == DTOH || which == DTOD || which == MEMSET32) && a[2] == 0) Py_RETURN_NONE;
    if (log_call(self, CALLS[which].name, a, (int)strlen(CALLS[which].kinds)) || make_current(self)) return NULL;
    void *f = self->fn[which];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    switch (which) {
    case LAUNCH:
        rc = ((launch_fn)f)(P(a[0]), (unsigned)a[1], (unsigned)a[2], (unsigned)a[3], (unsigned)a[4], (unsigned)a[5],
                            (unsigned)a[6], (unsigned)a[7], P(a[8]), (void **)P(a[9]), NULL);
        break;
    case HTOD: case DTOH: case DTOD: rc = ((copy_fn)f)(a[0], a[1], (size_t)a[2], P(a[3])); break;
    case RECORD: rc = ((record_fn)f)(P(a[0]), P(a[1])); break;
    case WAIT: rc = ((wait_fn)f)(P(a[0]), P(a[1]), 0); break;
    case SYNC: case EVENT_SYNC: rc = ((one_fn)f)(P(a[0])); break;
    default: rc = ((memset_fn)f)(a[0], (uint32_t)a[1], (size_t)a[2], P(a[3])); break; /* MEMSET32 */
    }
    Py_END_ALLOW_THREADS
    return status(self, which, rc);
}

static PyObject *direct(Calls *self, int which, PyObject *const *args, Py_ssize_t nargs) {
    const char *kinds = CALLS[which].kinds;
    Py_ssize_t n = (Py_ssize_t)strlen(kinds);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", CALLS[which].name, n, nargs);
        return NULL;
    }
    uint64_t a[10];
    for (Py_ssize_t i = 0; i < n; i++)
        if (kinds[i] == 'h' ? handle_u64(self, args[i], &a[i]) : as_u64(args[i], &a[i])) return NULL;
    return driver_call(self, which, a);
}

/* a call a compiled step makes itself (driver_call's), counted and timed by kind while `timed` is set
   (made_calls); 0, or -1 with the call's error set */
int step_call(Calls *calls, int which, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3) {
    const uint64_t a[4] = {a0, a1, a2, a3};
    double t0 = calls->timed ? now_seconds() : 0.0;
    PyObject *r = driver_call(calls, which, a);
    if (calls->timed) {
        calls->made[which]++;
        calls->made_seconds[which] += now_seconds() - t0;
    }
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

#define DIRECT(method, which) \
    static PyObject *method(Calls *self, PyObject *const *args, Py_ssize_t nargs) { return direct(self, which, args, nargs); }
DIRECT(Calls_launch, LAUNCH)
DIRECT(Calls_htod, HTOD)
DIRECT(Calls_dtoh, DTOH)
DIRECT(Calls_dtod, DTOD)
DIRECT(Calls_record, RECORD)
DIRECT(Calls_wait, WAIT)
DIRECT(Calls_sync, SYNC)
DIRECT(Calls_event_sync, EVENT_SYNC)
DIRECT(Calls_memset32, MEMSET32)

static int Calls_init(Calls *self, PyObject *args, PyObject *kw) {
    PyObject *capsules, *signatures, *shim, *address, *names;
    if (!PyArg_ParseTuple(args, "O!O!OOO!", &PyTuple_Type, &capsules, &PyTuple_Type, &signatures, &shim, &address,
                          &PyTuple_Type, &names))
        return -1;
    if (PyTuple_GET_SIZE(capsules) != N_CALLS || PyTuple_GET_SIZE(signatures) != N_CALLS || PyTuple_GET_SIZE(names) != N_CALLS) {
        PyErr_Format(PyExc_ValueError, "Calls takes %d capsules, signatures and names", N_CALLS);
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
    PyObject *current = PyObject_GetAttrString((PyObject *)Py_TYPE(shim), "_current");
    if (!current) return -1;
    Py_XSETREF(self->current, current);
    Py_XSETREF(self->capsules, Py_NewRef(capsules));
    Py_XSETREF(self->shim, Py_NewRef(shim));
    Py_XSETREF(self->address, Py_NewRef(address));
    Py_XSETREF(self->names, Py_NewRef(names));
    return 0;
}

static int Calls_traverse(Calls *self, visitproc visit, void *arg) {
    Py_VISIT(self->capsules);
    Py_VISIT(self->shim);
    Py_VISIT(self->current);
    Py_VISIT(self->address);
    Py_VISIT(self->names);
    Py_VISIT(self->log);
    for (int i = 0; i < self->n_handles; i++) Py_VISIT(self->handle_obj[i]);
    return 0;
}

static int Calls_clear(Calls *self) {
    Py_CLEAR(self->capsules);
    Py_CLEAR(self->shim);
    Py_CLEAR(self->current);
    Py_CLEAR(self->address);
    Py_CLEAR(self->names);
    Py_CLEAR(self->log);
    for (int i = 0; i < self->n_handles; i++) Py_CLEAR(self->handle_obj[i]);
    self->n_handles = 0;
    return 0;
}

static void Calls_dealloc(Calls *self) {
    PyObject_GC_UnTrack(self);
    Calls_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* made_calls() -> {call: (count, seconds)}: the calls compiled steps made themselves while `timed` was set */
static PyObject *Calls_made_calls(Calls *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < N_CALLS; i++) {
        if (!self->made[i]) continue;
        PyObject *v = Py_BuildValue("(Kd)", self->made[i], self->made_seconds[i]);
        if (!v || PyDict_SetItemString(out, CALLS[i].name, v)) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static PyMemberDef Calls_members[] = {
    {"timed", T_INT, offsetof(Calls, timed), 0, "count and time the calls compiled steps make themselves (made_calls)"},
    {"log", T_OBJECT, offsetof(Calls, log), 0, "a list every call is appended to, as (name, integer arguments...); None: none kept"},
    {NULL},
};

static PyMethodDef Calls_methods[] = {
    {"made_calls", (PyCFunction)Calls_made_calls, METH_NOARGS, "made_calls() -> {call: (count, seconds)} made by compiled steps while timed"},
    {"launch", (PyCFunction)(void (*)(void))Calls_launch, METH_FASTCALL, "launch(function, gx, gy, gz, bx, by, bz, shared, stream, params)"},
    {"htod", (PyCFunction)(void (*)(void))Calls_htod, METH_FASTCALL, "htod(dst, src, nbytes, stream)"},
    {"dtoh", (PyCFunction)(void (*)(void))Calls_dtoh, METH_FASTCALL, "dtoh(dst, src, nbytes, stream)"},
    {"dtod", (PyCFunction)(void (*)(void))Calls_dtod, METH_FASTCALL, "dtod(dst, src, nbytes, stream)"},
    {"record", (PyCFunction)(void (*)(void))Calls_record, METH_FASTCALL, "record(event, stream)"},
    {"wait", (PyCFunction)(void (*)(void))Calls_wait, METH_FASTCALL, "wait(stream, event)"},
    {"sync", (PyCFunction)(void (*)(void))Calls_sync, METH_FASTCALL, "sync(stream)"},
    {"event_sync", (PyCFunction)(void (*)(void))Calls_event_sync, METH_FASTCALL, "event_sync(event)"},
    {"memset32", (PyCFunction)(void (*)(void))Calls_memset32, METH_FASTCALL, "memset32(dst, pattern, count, stream)"},
    {NULL},
};

PyTypeObject CallsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.Calls",
    .tp_basicsize = sizeof(Calls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot driver calls through a binding's C function pointers.",
    .tp_traverse = (traverseproc)Calls_traverse,
    .tp_clear = (inquiry)Calls_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Calls_init,
    .tp_dealloc = (destructor)Calls_dealloc,
    .tp_methods = Calls_methods,
    .tp_members = Calls_members,
};

/* -- Launcher: one kernel's launches, its arguments packed here ------------------------------------------

   A kernel launch through Python costs more than the call itself: GpuBackend.launch finds the kernel's
   reusable parameter block, packs the arguments into it (struct.pack_into), the shim splits the grid into
   three dimensions, turns the function and stream handles into integers and checks that its device is the
   thread's current one. Launcher(calls, function, stream, signature) does all of it in one C call,
   for a kernel whose arguments are scalars and pointers (fomoepy.runtime.kernels' signature codes: p
   pointer, i int32, l int64, f float32, d float64, each in an 8-byte slot, as shim.ParamBlock packs them):

       launcher.launch(grid, block, shared, args)    # grid: 1 to 3 ints; args: the kernel's, a tuple

   The driver copies the argument values during the launch call, so the one block of slots is refilled by
   the next launch at once (the inference thread alone launches). The launch is made as its Calls makes
   its own: the shim's device made current if another shim's is, a failed status raised as the shim's
   GpuError. With `timed` set,
   each launch's driver call is timed (bench/host_time.py's count of binding calls): `count`, `seconds`. */


/* argument i, an integer of code 'i' (checked to fit an int32) or 'l', into its slot */
static int pack_integer(Launcher *self, int i, long long x) {
    uint64_t slot = 0;
    if (self->codes[i] == 'i') {
        if (x < INT32_MIN || x > INT32_MAX) {
            PyErr_Format(PyExc_TypeError, "kernel argument %d: %lld does not fit an int32", i, x);
            return -1;
        }
        int32_t y = (int32_t)x;
        memcpy(&slot, &y, 4);
    } else {
        memcpy(&slot, &x, 8);
    }
    self->slots[i] = slot;
    return 0;
}

static int pack_argument(Launcher *self, int i, PyObject *v) {
    uint64_t slot = 0;
    switch (self->codes[i]) {
    case 'p':
        if (as_u64(v, &slot)) return -1;
        break;
    case 'i': case 'l': {
        long long x = PyLong_AsLongLong(v);
        return x == -1 && PyErr_Occurred() ? -1 : pack_integer(self, i, x);
    }
    case 'f': {
        double x = PyFloat_AsDouble(v);
        if (x == -1.0 && PyErr_Occurred()) return -1;
        if (isfinite(x) && fabs(x) > FLT_MAX) {
            PyErr_Format(PyExc_TypeError, "kernel argument %d: %g does not fit a float32", i, x);
            return -1;
        }
        float y = (float)x;
        memcpy(&slot, &y, 4);
        break;
    }
    default: { /* 'd' */
        double x = PyFloat_AsDouble(v);
        if (x == -1.0 && PyErr_Occurred()) return -1;
        memcpy(&slot, &x, 8);
    }
    }
    self->slots[i] = slot;
    return 0;
}

/* the launch of the arguments packed in self->slots (the shim's device made current first) */
static PyObject *launch_packed(Launcher *self, const uint64_t g[3], uint64_t block, uint64_t shared) {
    if (self->calls->log && self->calls->log != Py_None) {
        uint64_t a[7 + MAX_ARGS] = {(uint64_t)(uintptr_t)self->function, g[0], g[1], g[2], block, shared, (uint64_t)(uintptr_t)self->stream};
        memcpy(a + 7, self->slots, self->n_args * sizeof(uint64_t));
        if (log_call(self->calls, "kernel", a, 7 + self->n_args)) return NULL;
    }
    if (make_current(self->calls)) return NULL;
    int rc;
    double t0 = self->timed ? now_seconds() : 0.0;
    launch_fn launch = (launch_fn)self->calls->fn[LAUNCH];
    Py_BEGIN_ALLOW_THREADS
    rc = launch(self->function, (unsigned)g[0], (unsigned)g[1], (unsigned)g[2], (unsigned)block, 1, 1,
                                   (unsigned)shared, self->stream, self->params, NULL);
    Py_END_ALLOW_THREADS
    if (self->timed) {
        self->seconds += now_seconds() - t0;
        self->count++;
    }
    return status(self->calls, LAUNCH, rc);
}

static PyObject *Launcher_launch(Launcher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "launch(grid: tuple, block, shared, args: tuple)");
        return NULL;
    }
    PyObject *grid = args[0], *kernel_args = args[3];
    Py_ssize_t n_grid = PyTuple_GET_SIZE(grid);
    if (n_grid < 1 || n_grid > 3) {
        PyErr_Format(PyExc_TypeError, "a grid has 1 to 3 dimensions, got %zd", n_grid);
        return NULL;
    }
    if (PyTuple_GET_SIZE(kernel_args) != self->n_args) {
        PyErr_Format(PyExc_TypeError, "the kernel takes %d arguments, got %zd", self->n_args, PyTuple_GET_SIZE(kernel_args));
        return NULL;
    }
    uint64_t g[3] = {1, 1, 1}, block, shared;
    for (Py_ssize_t i = 0; i < n_grid; i++)
        if (as_u64(PyTuple_GET_ITEM(grid, i), &g[i])) return NULL;
    if (as_u64(args[1], &block) || as_u64(args[2], &shared)) return NULL;
    for (int i = 0; i < self->n_args; i++)
        if (pack_argument(self, i, PyTuple_GET_ITEM(kernel_args, i))) return NULL;
    return launch_packed(self, g, block, shared);
}

static int Launcher_init(Launcher *self, PyObject *args, PyObject *kw) {
    PyObject *calls;
    unsigned long long function, stream;
    const char *signature;
    if (!PyArg_ParseTuple(args, "O!KKs", &CallsType, &calls, &function, &stream, &signature)) return -1;
    size_t n = strlen(signature);
    if (n > MAX_ARGS) {
        PyErr_Format(PyExc_ValueError, "Launcher: %zu arguments, at most %d", n, MAX_ARGS);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        if (!strchr("pilfd", signature[i])) {
            PyErr_Format(PyExc_TypeError, "Launcher packs scalars and pointers only, got signature \"%s\"", signature);
            return -1;
        }
    memcpy(self->codes, signature, n);
    self->n_args = (int)n;
    for (int i = 0; i < MAX_ARGS; i++) self->params[i] = &self->slots[i];
    self->function = (void *)(uintptr_t)function;
    self->stream = (void *)(uintptr_t)stream;
    Py_XSETREF(self->calls, (Calls *)Py_NewRef(calls));
    return 0;
}

static void Launcher_dealloc(Launcher *self) {
    Py_XDECREF(self->calls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Launcher_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Launcher_launch, METH_FASTCALL, "launch(grid, block, shared, args)"},
    {NULL},
};

static PyMemberDef Launcher_members[] = {
    {"calls", T_OBJECT, offsetof(Launcher, calls), READONLY, "the Calls whose launch function this uses"},
    {"timed", T_INT, offsetof(Launcher, timed), 0, "time each launch's driver call (count, seconds)"},
    {"count", T_ULONGLONG, offsetof(Launcher, count), 0, "launches timed"},
    {"seconds", T_DOUBLE, offsetof(Launcher, seconds), 0, "their driver calls' time"},
    {NULL},
};

PyTypeObject LauncherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.Launcher",
    .tp_basicsize = sizeof(Launcher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One kernel's launches, its arguments packed in C: launch(grid, block, shared, args).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Launcher_init,
    .tp_dealloc = (destructor)Launcher_dealloc,
    .tp_methods = Launcher_methods,
    .tp_members = Launcher_members,
};

/* -- DecodeLaunch: one layer's decode-step tables and grouped launches, each in one call ---------------

   A decode step (one token) of GpuExperts uploads its tables and launches its stages through Python: the
   tables object, the upload, and per stage the grid and arguments worked out and GpuBackend.launch, about
   a sixth of the step's host time at the 397B shape. A DecodeLaunch holds what those work out from the
   layer alone (its kernels' Launchers, the device side's decode arrays, the layer's sizes and slot
   offsets) and makes each in one C call: the same driver calls, with the same arguments, in the same
   order as fomoepy.runtime.gpu_experts' own path, which stays the definition and serves where this is not
   built or the direct calls are off (tests/test_decode_launch.py compares the two).

       DecodeLaunch(gate_up, down, down_sum, combine, tables, act, part, offsets, F, D, k, gate_row, down_row,
                    keepalive)
       n_first, experts = dl.tables(row, weights, slot_ptr, first, then)  # packed (_moe_pack.h), copied up
       dl.stages(start, stop, h)    # gate/up, then down, over work items [start, stop): act and part rows
       dl.combine(out)              # out = sum_j weight_j part_j, j ascending
       dl.grouped(h, out)           # every work item's gate/up, then down fused with the weighted sum

   gate_up, down, down_sum, combine: the layer's kernels' Launchers (one stream: the device's compute
   stream, which the tables' copy is queued on too); tables, act, part: device addresses of the side's
   decode arrays (fomoepy.runtime.gpu_sides.DeviceSide.decode_scratch); h, out: device addresses. The
   packed tables' bytes are appended to `keepalive` (GpuBackend._keepalive, emptied when the host next
   waits for the stream: the copy may read them until then, as the Python path keeps its own). */


/* a launch of `L` with the kernel arguments `values`, all integers (pointers as 'l'); 0, or -1 with an error set */
int launch_values(Launcher *L, uint64_t gx, uint64_t gy, uint64_t block, uint64_t shared, const long long *values, int n) {
    if (n != L->n_args) {
        PyErr_Format(PyExc_TypeError, "the kernel takes %d arguments, got %d", L->n_args, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!strchr("pil", L->codes[i])) {
            PyErr_Format(PyExc_TypeError, "kernel argument %d is a float: a decode launch passes integers", i);
            return -1;
        }
        if (pack_integer(L, i, values[i])) return -1;
    }
    const uint64_t g[3] = {gx, gy, 1};
    PyObject *r = launch_packed(L, g, block, shared);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static long long cdiv(long long a, long long b) { return (a + b - 1) / b; }

int as_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

PyObject *decode_tables(DecodeLaunch *self, PyObject *row, PyObject *weights, PyObject *slot_ptr, PyObject *first,
                        PyObject *then, int *n_first) {
    if (PyList_Check(row) && PyList_GET_SIZE(row) != self->k) {
        PyErr_Format(PyExc_ValueError, "this layer's decode step takes %lld choices, got %zd", self->k, PyList_GET_SIZE(row));
        return NULL;
    }
    PyObject *experts;
    PyObject *bytes = pack_decode_tables(row, weights, slot_ptr, self->offsets, first, then, n_first, &experts);
    if (!bytes) return NULL;
    int failed = PyList_Append(self->keepalive, bytes) ||
                 step_call(self->gate_up->calls, HTOD, self->tables, (uint64_t)(uintptr_t)PyByteArray_AS_STRING(bytes),
                           (uint64_t)PyByteArray_GET_SIZE(bytes), (uint64_t)(uintptr_t)self->gate_up->stream);
    Py_DECREF(bytes);
    if (failed) Py_CLEAR(experts);
    return experts;
}

static PyObject *DecodeLaunch_tables(DecodeLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "tables(row, weights, slot_ptr, first, then)");
        return NULL;
    }
    int n_first;
    PyObject *experts = decode_tables(self, args[0], args[1], args[2], args[3], args[4], &n_first);
    if (!experts) return NULL;
    PyObject *r = Py_BuildValue("(iO)", n_first, experts);
    Py_DECREF(experts);
    return r;
}

int decode_stages(DecodeLaunch *self, long long start, long long stop, long long h) {
    if (start < 0 || stop > self->k) {
        PyErr_Format(PyExc_ValueError, "work items [%lld, %lld) of %lld", start, stop, self->k);
        return -1;
    }
    if (stop <= start) return 0;
    long long work = (long long)self->tables + self->k * PAIR_BYTES + start * WORK_BYTES;
    long long act = (long long)self->act, part = (long long)self->part;
    const long long gate_up[] = {work, h, self->D, self->F, self->k, self->gate_row, act};
    const long long down[] = {work, act, self->D, self->F, self->down_row, part};
    if (launch_values(self->gate_up, cdiv(self->F, 4), stop - start, 128, 0, gate_up, 7) ||
        launch_values(self->down, cdiv(self->D, 4), stop - start, 128, 0, down, 6))
        return -1;
    return 0;
}

static PyObject *DecodeLaunch_stages(DecodeLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    long long start, stop, h;
    if (nargs != 3 || as_ll(args[0], &start) || as_ll(args[1], &stop) || as_ll(args[2], &h)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stages(start, stop, h)");
        return NULL;
    }
    if (decode_stages(self, start, stop, h)) return NULL;
    Py_RETURN_NONE;
}

int decode_combine(DecodeLaunch *self, long long o) {
    const long long values[] = {(long long)self->tables, (long long)self->part, 1, self->D, self->k, o};
    return launch_values(self->combine, cdiv(self->D, 256), 1, 256, 0, values, 6);
}

static PyObject *DecodeLaunch_combine(DecodeLaunch *self, PyObject *out) {
    long long o;
    if (as_ll(out, &o) || decode_combine(self, o)) return NULL;
    Py_RETURN_NONE;
}

int decode_grouped(DecodeLaunch *self, long long h, long long o) {
    long long act = (long long)self->act;
    const long long gate_up[] = {(long long)self->tables + self->k * PAIR_BYTES, h, self->D, self->F, self->k, self->gate_row, act};
    const long long down_sum[] = {(long long)self->tables, act, self->D, self->F, self->k, self->down_row, o};
    if (launch_values(self->gate_up, cdiv(self->F, 4), self->k, 128, 0, gate_up, 7) ||
        launch_values(self->down_sum, cdiv(self->D, 4), 1, 128, 0, down_sum, 7))
        return -1;
    return 0;
}

static PyObject *DecodeLaunch_grouped(DecodeLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    long long h, o;
    if (nargs != 2 || as_ll(args[0], &h) || as_ll(args[1], &o)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "grouped(h, out)");
        return NULL;
    }
    if (decode_grouped(self, h, o)) return NULL;
    Py_RETURN_NONE;
}

int DecodeLaunch_init(DecodeLaunch *self, PyObject *args, PyObject *kw) {
    PyObject *gate_up, *down, *down_sum, *combine, *offsets, *keepalive;
    unsigned long long tables, act, part;
    long long F, D, k, gate_row, down_row;
    if (!PyArg_ParseTuple(args, "O!O!O!O!KKKO!LLLLLO!", &LauncherType, &gate_up, &LauncherType, &down, &LauncherType, &down_sum,
                          &LauncherType, &combine, &tables, &act, &part, &PyTuple_Type, &offsets, &F, &D, &k, &gate_row,
                          &down_row, &PyList_Type, &keepalive))
        return -1;
    if (PyTuple_GET_SIZE(offsets) != 3 || k < 1 || k > MAX_K || F < 1 || D < 1) {
        PyErr_Format(PyExc_ValueError, "DecodeLaunch: 3 offsets, 1 <= k <= %d, F and D >= 1", MAX_K);
        return -1;
    }
    Launcher *all[4] = {(Launcher *)gate_up, (Launcher *)down, (Launcher *)down_sum, (Launcher *)combine};
    for (int i = 1; i < 4; i++)
        if (all[i]->calls != all[0]->calls || all[i]->stream != all[0]->stream) {
            PyErr_SetString(PyExc_ValueError, "DecodeLaunch: the four kernels launch through one Calls on one stream");
            return -1;
        }
    Py_XSETREF(self->gate_up, (Launcher *)Py_NewRef(gate_up));
    Py_XSETREF(self->down, (Launcher *)Py_NewRef(down));
    Py_XSETREF(self->down_sum, (Launcher *)Py_NewRef(down_sum));
    Py_XSETREF(self->combine, (Launcher *)Py_NewRef(combine));
    Py_XSETREF(self->offsets, Py_NewRef(offsets));
    Py_XSETREF(self->keepalive, Py_NewRef(keepalive));
    self->tables = tables, self->act = act, self->part = part;
    self->F = F, self->D = D, self->k = k, self->gate_row = gate_row, self->down_row = down_row;
    return 0;
}

static void DecodeLaunch_dealloc(DecodeLaunch *self) {
    Py_XDECREF(self->gate_up);
    Py_XDECREF(self->down);
    Py_XDECREF(self->down_sum);
    Py_XDECREF(self->combine);
    Py_XDECREF(self->offsets);
    Py_XDECREF(self->keepalive);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef DecodeLaunch_methods[] = {
    {"tables", (PyCFunction)(void (*)(void))DecodeLaunch_tables, METH_FASTCALL,
     "tables(row, weights, slot_ptr, first, then) -> (n_first, experts): packed and copied up on the stream"},
    {"stages", (PyCFunction)(void (*)(void))DecodeLaunch_stages, METH_FASTCALL, "stages(start, stop, h): gate/up then down over work items [start, stop)"},
    {"combine", (PyCFunction)DecodeLaunch_combine, METH_O, "combine(out): the weighted sum of the pairs' outputs"},
    {"grouped", (PyCFunction)(void (*)(void))DecodeLaunch_grouped, METH_FASTCALL, "grouped(h, out): every work item, down fused with the sum"},
    {NULL},
};

PyTypeObject DecodeLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.DecodeLaunch",
    .tp_basicsize = sizeof(DecodeLaunch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One layer's decode-step tables and grouped launches, each in one C call.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DecodeLaunch_init,
    .tp_dealloc = (destructor)DecodeLaunch_dealloc,
    .tp_methods = DecodeLaunch_methods,
};

/* -- DecodeRoute: a decode step's routing read back in one call -----------------------------------------

   A decode step routes its one token on the device and reads the choice back (GpuBackend.route_many): a
   top-k launch per request (the layer's own logits; where the step predicts the next layer's experts, that
   layer's router product of the same hidden state and its top-k too), then one copy of the read-back area
   and a wait for the stream (GpuBackend.synchronize). Through Python that is a product's and two launches'
   argument work, the copy, the shim's sync and its count, about a tenth of the step at the 397B shape. A
   DecodeRoute makes the same driver calls, with the same arguments, in the same order, in one C call; the
   Python path stays the definition and serves everywhere else (tests/test_decode_launch.py compares them):

       DecodeRoute(route, mv, weight, row_bytes, predicted, E, K, k, err, err_host, readback_at, keepalive,
                   sync_count[, own, own_weight, own_row_bytes, logits])
       n = r.route(logits, h)   # read back: n floats at err_host + readback_at, probabilities then ids
                                # then weights of each request; the error flag at err_host
       n = r.route_from(h)      # the same, the layer's own router product of h into `logits` made first

   route: the top-k kernel's Launcher (its stream is the one waited for); mv: the next layer's router
   product's Launcher (None: no prediction), over `weight` (rows of `row_bytes`) into `predicted` [1, E]
   from h [1, K]; E experts, top k; err: the device's error flag (its read-back area follows it from
   readback_at). After the wait, `sync_count.n` is counted up and `keepalive` emptied, as the shim's sync
   and GpuBackend.synchronize do; the caller reads the flag. own: the layer's own router product's Launcher
   (over `own_weight`, rows of `own_row_bytes`, into `logits` [1, E]), which route_from launches first, as
   the model makes the router's product before the MoE step routes (fomoepy.model.moe). */

typedef struct {
    PyObject_HEAD
    Launcher *route, *mv, *own;
    long long weight, row_bytes, predicted, E, K, k, err, readback_at, own_weight, own_row_bytes, logits;
    uint64_t err_host;
    PyObject *keepalive, *sync_count;
} DecodeRoute;

static PyObject *str_n;

static PyObject *route_read_back(DecodeRoute *self, long long logits, long long h) {
    const long long E = self->E, k = self->k, per = E + 2 * k; /* one request's floats: probabilities, ids, weights */
    long long base = self->err + self->readback_at, total = per;
    if (self->mv) { /* the next layer's router product first, as route_ahead makes it before the top-k */
        const long long mv[] = {self->weight, self->row_bytes, h, self->K, self->predicted, E, E, self->K, 1};
        if (launch_values(self->mv, cdiv(E, 4), 1, 128, 0, mv, 9)) return NULL;
    }
    const long long own[] = {logits, 1, E, k, base, base + 4 * E, base + 4 * (E + k), self->err};
    if (launch_values(self->route, 1, 1, 256, 4 * E, own, 8)) return NULL;
    if (self->mv) {
        long long at = base + 4 * per;
        const long long ahead[] = {self->predicted, 1, E, k, at, at + 4 * E, at + 4 * (E + k), self->err};
        if (launch_values(self->route, 1, 1, 256, 4 * E, ahead, 8)) return NULL;
        total += per;
    }
    Calls *calls = self->route->calls;
    uint64_t stream = (uint64_t)(uintptr_t)self->route->stream;
    if (step_call(calls, DTOH, self->err_host, (uint64_t)self->err, (uint64_t)(self->readback_at + 4 * total), stream) ||
        step_call(calls, SYNC, stream, 0, 0, 0))
        return NULL;
    PyObject *n = PyObject_GetAttr(self->sync_count, str_n); /* the shim's count of waits for this stream */
    if (!n) return NULL;
    long long waits = PyLong_AsLongLong(n);
    Py_DECREF(n);
    if (waits == -1 && PyErr_Occurred()) return NULL;
    PyObject *n1 = PyLong_FromLongLong(waits + 1);
    if (!n1 || PyObject_SetAttr(self->sync_count, str_n, n1)) {
        Py_XDECREF(n1);
        return NULL;
    }
    Py_DECREF(n1);
    if (PyList_SetSlice(self->keepalive, 0, PyList_GET_SIZE(self->keepalive), NULL)) return NULL;
    return PyLong_FromLongLong(total);
}

static PyObject *DecodeRoute_route(DecodeRoute *self, PyObject *const *args, Py_ssize_t nargs) {
    long long logits, h;
    if (nargs != 2 || as_ll(args[0], &logits) || as_ll(args[1], &h)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "route(logits, h)");
        return NULL;
    }
    return route_read_back(self, logits, h);
}

static PyObject *DecodeRoute_route_from(DecodeRoute *self, PyObject *arg) {
    long long h;
    if (as_ll(arg, &h)) return NULL;
    if (!self->own) {
        PyErr_SetString(PyExc_TypeError, "route_from: this DecodeRoute was made with no router product of its own");
        return NULL;
    }
    const long long own[] = {self->own_weight, self->own_row_bytes, h, self->K, self->logits, self->E, self->E, self->K, 1};
    if (launch_values(self->own, cdiv(self->E, 4), 1, 128, 0, own, 9)) return NULL;
    return route_read_back(self, self->logits, h);
}

static int DecodeRoute_init(DecodeRoute *self, PyObject *args, PyObject *kw) {
    PyObject *route, *mv, *keepalive, *sync_count, *own = Py_None;
    long long weight, row_bytes, predicted, E, K, k, err, readback_at, own_weight = 0, own_row_bytes = 0, logits = 0;
    unsigned long long err_host;
    if (!PyArg_ParseTuple(args, "O!OLLLLLLLKLO!O|OLLL", &LauncherType, &route, &mv, &weight, &row_bytes, &predicted, &E, &K, &k,
                          &err, &err_host, &readback_at, &PyList_Type, &keepalive, &sync_count, &own, &own_weight,
                          &own_row_bytes, &logits))
        return -1;
    if (own != Py_None && (!PyObject_TypeCheck(own, &LauncherType) || ((Launcher *)own)->calls != ((Launcher *)route)->calls ||
                           ((Launcher *)own)->stream != ((Launcher *)route)->stream || !logits)) {
        PyErr_SetString(PyExc_TypeError, "DecodeRoute: own is None or a Launcher through the route's Calls, on its stream, with logits");
        return -1;
    }
    if (mv != Py_None && (!PyObject_TypeCheck(mv, &LauncherType) || ((Launcher *)mv)->calls != ((Launcher *)route)->calls ||
                          ((Launcher *)mv)->stream != ((Launcher *)route)->stream)) {
        PyErr_SetString(PyExc_TypeError, "DecodeRoute: mv is None or a Launcher through the route's Calls, on its stream");
        return -1;
    }
    if (E < 1 || k < 1 || k > E || K < 1 || readback_at < 4) {
        PyErr_SetString(PyExc_ValueError, "DecodeRoute: 1 <= k <= E, K >= 1, the read-back area after the flag");
        return -1;
    }
    Py_XSETREF(self->route, (Launcher *)Py_NewRef(route));
    if (mv != Py_None) Py_INCREF(mv);
    Py_XSETREF(self->mv, mv != Py_None ? (Launcher *)mv : NULL);
    if (own != Py_None) Py_INCREF(own);
    Py_XSETREF(self->own, own != Py_None ? (Launcher *)own : NULL);
    self->own_weight = own_weight, self->own_row_bytes = own_row_bytes, self->logits = logits;
    Py_XSETREF(self->keepalive, Py_NewRef(keepalive));
    Py_XSETREF(self->sync_count, Py_NewRef(sync_count));
    self->weight = weight, self->row_bytes = row_bytes, self->predicted = predicted, self->E = E, self->K = K, self->k = k;
    self->err = err, self->err_host = err_host, self->readback_at = readback_at;
    return 0;
}

static void DecodeRoute_dealloc(DecodeRoute *self) {
    Py_XDECREF(self->route);
    Py_XDECREF(self->mv);
    Py_XDECREF(self->own);
    Py_XDECREF(self->keepalive);
    Py_XDECREF(self->sync_count);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef DecodeRoute_methods[] = {
    {"route", (PyCFunction)(void (*)(void))DecodeRoute_route, METH_FASTCALL,
     "route(logits, h) -> floats read back: the top-k of each request, copied down after a wait for the stream"},
    {"route_from", (PyCFunction)DecodeRoute_route_from, METH_O, "route_from(h) -> route(logits, h) with the layer's own router product of h first"},
    {NULL},
};

static PyTypeObject DecodeRouteType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.DecodeRoute",
    .tp_basicsize = sizeof(DecodeRoute),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A decode step's routing (and the next layer's prediction) launched and read back in one C call.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DecodeRoute_init,
    .tp_dealloc = (destructor)DecodeRoute_dealloc,
    .tp_methods = DecodeRoute_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_driver_calls",
                                    "The hot driver calls through the bindings' C layer.", -1, NULL};

PyMODINIT_FUNC PyInit__driver_calls(void) {
    str_shim = PyUnicode_InternFromString("shim");
    str_current_here = PyUnicode_InternFromString("_current_here");
    str_failed = PyUnicode_InternFromString("_failed");
    str_n = PyUnicode_InternFromString("n");
    if (!str_shim || !str_current_here || !str_failed || !str_n || decode_experts_ready()) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &CallsType) < 0 || PyModule_AddType(m, &LauncherType) < 0 ||
        PyModule_AddType(m, &DecodeLaunchType) < 0 || PyModule_AddType(m, &DecodeRouteType) < 0 ||
        PyModule_AddType(m, &DecodeExpertsType) < 0 || PyModule_AddType(m, &ResidentMapType) < 0) {  /* (each readied) */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
