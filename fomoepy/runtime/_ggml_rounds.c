/* A decode round of the cpu backend's routed experts in one C call (fomoepy.runtime.ggml_slots' one-row
   round graphs and ggml_reads' in-place ones: RoundCall), and a step's weighted sum of its picks' outputs
   (weighted_sum; and as a decode graph's node, op_weighted_sum).

   A round is: the token's row copied into the graph's input, its picks' slots (and read buffers) set
   into the graph's id arrays, ggml's graph computation, and each pick's output copied into the step's
   [k, K] array at its place among the token's picks. In numpy that is four to six calls, each the first
   use of its code after ggml's products have streamed megabytes of weights through the caches: by hand,
   on the bench model at a 25 % tier, the row's 4 KB copy took 10.8 µs where the same copy right after
   took 0.4, and any numpy call first paid it instead. Here the round's copies are memcpy's and its id
   stores a loop, in one call whose code is small. The graph, its plan and the arrays it reads and
   writes are the Python object's (their addresses given once, at construction); ggml computes with the
   GIL let go, as ctypes' call does. The weighted sum, two numpy calls and a temporary the size of the
   outputs, took ~19 µs of a step there; here one loop, ~6. bench/host_time.py's cpu step (the same
   bench model and tier), by hand, this code against the one before in alternating processes: 205-214
   against 228-244 µs with the rounds, 187-203 against 207-240 with the sum as well. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_ggml_fields.h"
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*graph_compute)(void *graph, void *plan);

#define MAX_SETS 2

typedef struct {
    PyObject_HEAD
    graph_compute compute;
    void *graph, *plan;
    float *h;
    Py_ssize_t K, n_sets, picks[MAX_SETS];
    int32_t *ids[MAX_SETS];
    float *outs[MAX_SETS];
    PyObject *keep; /* what owns the memory above (the Python round object): kept alive with it */
} RoundCallObject;

static PyObject *round_failed; /* fomoepy.errors.FomoeError */

/* RoundCall(compute, graph, plan, h, K, sets, keep): sets a tuple of (ids address, picks, outputs address) */
static int RoundCall_init(RoundCallObject *self, PyObject *args, PyObject *kwargs) {
    unsigned long long compute, graph, plan, h;
    Py_ssize_t K;
    PyObject *sets, *keep;
    if (!PyArg_ParseTuple(args, "KKKKnO!O", &compute, &graph, &plan, &h, &K, &PyTuple_Type, &sets, &keep)) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(sets);
    if (!compute || !graph || !plan || !h || K < 1 || n < 1 || n > MAX_SETS) {
        PyErr_SetString(PyExc_ValueError, "RoundCall: a graph, its plan, an input row of K >= 1 floats and 1 or 2 sets of picks");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long ids, out;
        Py_ssize_t picks;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(sets, i), "KnK", &ids, &picks, &out)) return -1;
        if (!ids || !out || picks < 1) {
            PyErr_SetString(PyExc_ValueError, "RoundCall: each set has its ids, picks >= 1 and its outputs");
            return -1;
        }
        self->ids[i] = (int32_t *)(uintptr_t)ids, self->picks[i] = picks, self->outs[i] = (float *)(uintptr_t)out;
    }
    self->compute = (graph_compute)(uintptr_t)compute;
    self->graph = (void *)(uintptr_t)graph, self->plan = (void *)(uintptr_t)plan, self->h = (float *)(uintptr_t)h;
    self->K = K, self->n_sets = n;
    Py_XSETREF(self->keep, Py_NewRef(keep));
    return 0;
}

/* a float32 C-contiguous buffer of at least `floats` floats (writable if asked): 0; 1 where it is not one
   (no error set: the caller's Python path takes it); -1 with an error set */
static int floats_of(PyObject *obj, Py_buffer *view, Py_ssize_t floats, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0))) {
        /* (numpy refuses a strided array with a ValueError) */
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError) &&
            !PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    if (view->itemsize != 4 || !view->format || strcmp(view->format, "f") || view->len < floats * 4) {
        PyBuffer_Release(view);
        return 1;
    }
    return 0;
}

/* round(row, slots, into, at) -> seconds in ggml, or None where row or into is not float32 and C-contiguous
   (nothing computed): row [1, K] (the token's), slots a tuple of one list of ints per set (its picks' slots
   or buffers), into [k, K] float32, at a tuple of one list per set (each pick's row in `into`) */
static PyObject *RoundCall_call(RoundCallObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *row, *slots, *into, *at;
    if (!PyArg_ParseTuple(args, "OO!OO!", &row, &PyTuple_Type, &slots, &into, &PyTuple_Type, &at)) return NULL;
    if (PyTuple_GET_SIZE(slots) != self->n_sets || PyTuple_GET_SIZE(at) != self->n_sets) {
        PyErr_Format(PyExc_ValueError, "RoundCall: %zd sets of slots and places expected", self->n_sets);
        return NULL;
    }
    const Py_ssize_t K = self->K;
    Py_buffer r, out;
    int rc = floats_of(row, &r, K, 0);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_None);
    if ((rc = floats_of(into, &out, K, 1))) {
        PyBuffer_Release(&r);
        return rc < 0 ? NULL : Py_NewRef(Py_None);
    }
    Py_ssize_t rows = out.len / (4 * K);
    for (Py_ssize_t i = 0; i < self->n_sets && !rc; i++) { /* every check before anything is written */
        PyObject *s = PyTuple_GET_ITEM(slots, i), *a = PyTuple_GET_ITEM(at, i);
        if (!PyList_Check(s) || !PyList_Check(a) || PyList_GET_SIZE(s) != self->picks[i] || PyList_GET_SIZE(a) != self->picks[i]) {
            PyErr_Format(PyExc_ValueError, "RoundCall: set %zd takes lists of %zd slots and places", i, self->picks[i]);
            rc = -1;
        }
        for (Py_ssize_t p = 0; !rc && p < self->picks[i]; p++) {
            long v = PyLong_AsLong(PyList_GET_ITEM(s, p));
            Py_ssize_t j = PyLong_AsSsize_t(PyList_GET_ITEM(a, p));
            if (PyErr_Occurred()) rc = -1;
            else if (v < INT32_MIN || v > INT32_MAX || j < 0 || j >= rows) {
                PyErr_Format(PyExc_IndexError, "RoundCall: slot %ld or place %zd out of range (%zd rows)", v, j, rows);
                rc = -1;
            }
        }
    }
    if (!rc) {
        for (Py_ssize_t i = 0; i < self->n_sets; i++)
            for (Py_ssize_t p = 0; p < self->picks[i]; p++) self->ids[i][p] = (int32_t)PyLong_AsLong(PyList_GET_ITEM(PyTuple_GET_ITEM(slots, i), p));
        memcpy(self->h, r.buf, (size_t)K * 4);
    }
    PyBuffer_Release(&r);
    struct timespec t0, t1;
    int status = 0;
    if (!rc) {
        Py_BEGIN_ALLOW_THREADS
        clock_gettime(CLOCK_MONOTONIC, &t0);
        status = self->compute(self->graph, self->plan);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        Py_END_ALLOW_THREADS
        if (status != 0) {
            PyErr_SetString(round_failed, "ggml graph computation failed");
            rc = -1;
        }
    }
    for (Py_ssize_t i = 0; i < self->n_sets && !rc; i++) {
        PyObject *a = PyTuple_GET_ITEM(at, i);
        for (Py_ssize_t p = 0; p < self->picks[i]; p++)
            memcpy((float *)out.buf + PyLong_AsSsize_t(PyList_GET_ITEM(a, p)) * K, self->outs[i] + p * K, (size_t)K * 4);
    }
    PyBuffer_Release(&out);
    if (rc) return NULL;
    return PyFloat_FromDouble((double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
}

static int RoundCall_traverse(RoundCallObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->keep);
    return 0;
}

static int RoundCall_clear(RoundCallObject *self) {
    Py_CLEAR(self->keep);
    return 0;
}

static void RoundCall_dealloc(RoundCallObject *self) {
    PyObject_GC_UnTrack(self);
    RoundCall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject RoundCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._ggml_rounds.RoundCall",
    .tp_basicsize = sizeof(RoundCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "RoundCall(compute, graph, plan, h, K, sets, keep): a decode round's copies, ids and ggml computation in one call.",
    .tp_traverse = (traverseproc)RoundCall_traverse,
    .tp_clear = (inquiry)RoundCall_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RoundCall_init,
    .tp_dealloc = (destructor)RoundCall_dealloc,
    .tp_call = (ternaryfunc)RoundCall_call,
};

/* weighted_sum(y, w, out) -> True, out [T, K] = Σ_j y[:, j] · w[:, j] of y [T, k, K] and w [T, k], each product
   rounded to float32, then pick j added after picks 0..j-1: numpy's `np.add.reduce(y * w[:, :, None], axis=1)`
   (fomoepy.runtime.ggml_slots.weighted_sum, the definition; built with -ffp-contract=off, so no product is
   fused into its sum), without its two calls and their temporaries. False where an argument is not float32
   and C-contiguous of those shapes (nothing written: the caller's numpy serves). */
static PyObject *weighted_sum(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "weighted_sum(y, w, out)");
        return NULL;
    }
    Py_buffer y, w, out;
    int rc = floats_of(args[0], &y, 0, 0);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_False);
    if ((rc = floats_of(args[1], &w, 0, 0))) {
        PyBuffer_Release(&y);
        return rc < 0 ? NULL : Py_NewRef(Py_False);
    }
    if ((rc = floats_of(args[2], &out, 0, 1))) {
        PyBuffer_Release(&y), PyBuffer_Release(&w);
        return rc < 0 ? NULL : Py_NewRef(Py_False);
    }
    int fits = y.ndim == 3 && w.ndim == 2 && out.ndim == 2;
    Py_ssize_t T = fits ? y.shape[0] : 0, k = fits ? y.shape[1] : 0, K = fits ? y.shape[2] : 0;
    fits = fits && k >= 1 && w.shape[0] == T && w.shape[1] == k && out.shape[0] == T && out.shape[1] == K;
    if (fits) {
        const float *yt = y.buf, *wt = w.buf;
        float *o = out.buf;
        for (Py_ssize_t t = 0; t < T; t++, yt += k * K, wt += k, o += K) {
            for (Py_ssize_t i = 0; i < K; i++) o[i] = yt[i] * wt[0];
            for (Py_ssize_t j = 1; j < k; j++) {
                const float *yj = yt + j * K, wj = wt[j];
                for (Py_ssize_t i = 0; i < K; i++) {
                    float p = yj[i] * wj; /* (rounded here, as numpy's product array holds it) */
                    o[i] = o[i] + p;
                }
            }
        }
    }
    PyBuffer_Release(&y), PyBuffer_Release(&w), PyBuffer_Release(&out);
    return Py_NewRef(fits ? Py_True : Py_False);
}

/* The same sum as a node of a decode graph (ggml_slots.weighted_sum_added_node), the residual added after it:
   dst [K, T] = x + (((y_0·w_0 + y_1·w_1) + y_2·w_2) + …) for y [K, k, T] (pick j of row t at y[:, j, t]),
   w [k, T], x [K, T]: ggml's MUL then its k-1 ADDs and the residual's ADD, each rounded to float32 as those
   nodes round it (products unfused: -ffp-contract=off), so a row gets their bits. Those k+1 nodes were
   k+1 of the graph's barriers, and the MUL broadcast a weight per element (ggml takes a source row of one
   element a call at a time): by hand, bench model, 8 rows on 2 threads, its 8 MULs were ~0.5 ms of a
   17 ms step. Each thread takes a share of every row's elements (each element one thread's: the same
   bits on any count). The tensors' rows are contiguous (ggml_slots checks); their strides are read from
   the tensors (_ggml_fields.h, at the offsets of ggml_tensor's fields the userdata gives). */
typedef struct {
    int64_t data_offset, src_offset, ne_offset, nb_offset;
} OpInfo;


/* (elementwise only: any vector width gives the same bits; the clones let the compiler use the CPU's) */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void weighted_rows(const float *const *y, const float *w, int64_t k,
                                                                                      const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float acc = y[0][i] * w[0];
        for (int64_t j = 1; j < k; j++) {
            float p = y[j][i] * w[j];
            acc = acc + p;
        }
        out[i] = x[i] + acc;
    }
}

#define MAX_K 64 /* picks a row at most (ggml_slots refuses more) */

static void op_weighted_sum(void *dst, int ith, int nth, void *userdata) {
    const OpInfo *o = userdata;
    const void *yt = src_of(o, dst, 0), *wt = src_of(o, dst, 1), *xt = src_of(o, dst, 2);
    const int64_t K = ne_of(o, yt, 0), k = ne_of(o, yt, 1), T = ne_of(o, yt, 2);
    const int64_t i0 = K * ith / nth, i1 = K * (ith + 1) / nth;
    if (i0 >= i1) return;
    for (int64_t t = 0; t < T; t++) {
        const float *y[MAX_K];
        for (int64_t j = 0; j < k; j++) y[j] = (const float *)((const char *)data_of(o, yt) + j * nb_of(o, yt, 1) + t * nb_of(o, yt, 2)) + i0;
        float w[MAX_K];
        for (int64_t j = 0; j < k; j++) w[j] = ((const float *)((const char *)data_of(o, wt) + t * nb_of(o, wt, 1)))[j];
        weighted_rows(y, w, k, (const float *)((const char *)data_of(o, xt) + t * nb_of(o, xt, 1)) + i0,
                      (float *)((char *)data_of(o, dst) + t * nb_of(o, dst, 1)) + i0, i1 - i0);
    }
}

/* weighted_sum_op() → the node's function (a ggml_custom_op_t), as an address */
static PyObject *weighted_sum_op(PyObject *module, PyObject *args) {
    (void)module, (void)args;
    return PyLong_FromVoidPtr((void *)op_weighted_sum);
}

static PyMethodDef functions[] = {
    {"weighted_sum", (PyCFunction)(void (*)(void))weighted_sum, METH_FASTCALL, "weighted_sum(y, w, out) -> whether it wrote out"},
    {"weighted_sum_op", weighted_sum_op, METH_NOARGS, "the weighted sum's graph node function, as an address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ggml_rounds", "A decode round of ggml slot products in one C call.", -1, functions};

PyMODINIT_FUNC PyInit__ggml_rounds(void) {
    PyObject *errors = PyImport_ImportModule("fomoepy.errors");
    round_failed = errors ? PyObject_GetAttrString(errors, "FomoeError") : NULL;
    Py_XDECREF(errors);
    if (!round_failed) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddType(m, &RoundCallType) < 0 || PyModule_AddIntConstant(m, "MAX_K", MAX_K) < 0)) Py_CLEAR(m);
    return m;
}
