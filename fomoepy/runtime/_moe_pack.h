/* A decode step's grouped-launch tables (fomoepy.runtime.moe_tables._decode_tables), packed in C: the one
   routine behind _moe_tables.pack_decode (the bytes, for the Python caller to upload) and
   _driver_calls.DecodeLaunch (packed and uploaded in the same call as the step's launches).

   row: the token's k expert ids (a list of distinct ints); weights: their k weights (a list of floats);
   slot_ptr: expert -> its device slot's address; offsets: (gate, up, down) in a slot; first, then:
   collections of experts whose work items lead the table, in that order (the rest by ascending id).
   Pair p is the token's p-th choice by ascending expert id; work item i holds one pair. */

#ifndef FOMOE_MOE_PACK_H
#define FOMOE_MOE_PACK_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MOE_TILE 8 /* pairs per work item (MOE_TILE in hip_kernels/experts.hip) */
#define MAX_K 64   /* choices per token: top-k routers use up to a few dozen */

typedef struct { /* PairInfo, 16 bytes */
    uint64_t down;
    float weight;
    int32_t pad;
} Pair;

typedef struct { /* ExpertWork, 64 bytes */
    uint64_t gate, up, down;
    int32_t n_pairs, pad;
    int32_t pair[MOE_TILE];
} Work;

_Static_assert(sizeof(Pair) == 16 && sizeof(Work) == 64, "the kernels' table records");

static int pack_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* order[0..n) sorted by key[order[i]], ascending and stable, as Python's sorted (insertion: n is ten or so) */
static void sort_by(int *order, Py_ssize_t n, const long long *key) {
    for (Py_ssize_t a = 1; a < n; a++) {
        int j = order[a];
        Py_ssize_t b = a;
        for (; b > 0 && key[order[b - 1]] > key[j]; b--) order[b] = order[b - 1];
        order[b] = j;
    }
}

/* The bytes of a row's tables (k Pair, then k Work: k * 80), as a new bytearray; its experts in table order
   (a new list) and how many of them lead as `first`. NULL with an exception set on bad arguments. */
static PyObject *pack_decode_tables(PyObject *row, PyObject *weights, PyObject *slot_ptr, PyObject *offsets_tuple,
                                    PyObject *first, PyObject *then, int *n_first_out, PyObject **experts_out) {
    if (!PyList_Check(row) || !PyList_Check(weights) || !PyDict_Check(slot_ptr) || !PyTuple_Check(offsets_tuple)) {
        PyErr_SetString(PyExc_TypeError, "tables of (row: list, weights: list, slot_ptr: dict, offsets: tuple, first, then)");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(row);
    if (k > MAX_K || PyList_GET_SIZE(weights) != k || PyTuple_GET_SIZE(offsets_tuple) != 3) {
        PyErr_Format(PyExc_ValueError, "a decode step's tables: %zd choices and %zd weights (at most %d), %zd offsets", k,
                     PyList_GET_SIZE(weights), MAX_K, PyTuple_GET_SIZE(offsets_tuple));
        return NULL;
    }
    uint64_t offsets[3];
    for (int i = 0; i < 3; i++)
        if (pack_u64(PyTuple_GET_ITEM(offsets_tuple, i), &offsets[i])) return NULL;
    long long id[MAX_K] = {0}; /* (zeroed: a compiler cannot see that only the first k are read) */
    long long rank[MAX_K];
    int order[MAX_K], rows[MAX_K];
    uint64_t ptr[MAX_K];
    for (Py_ssize_t j = 0; j < k; j++) {
        id[j] = PyLong_AsLongLong(PyList_GET_ITEM(row, j));
        if (id[j] == -1 && PyErr_Occurred()) return NULL;
        order[j] = (int)j;
    }
    sort_by(order, k, id); /* ascending expert id */
    int n_first = 0;
    for (Py_ssize_t p = 0; p < k; p++) {
        PyObject *e = PyList_GET_ITEM(row, order[p]);
        PyObject *slot = PyDict_GetItemWithError(slot_ptr, e);
        if (!slot) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, e);
            return NULL;
        }
        if (pack_u64(slot, &ptr[p])) return NULL;
        int in_first = PySequence_Contains(first, e);
        if (in_first < 0) return NULL;
        int in_then = in_first ? 0 : PySequence_Contains(then, e);
        if (in_then < 0) return NULL;
        rank[p] = in_first ? 0 : in_then ? 1 : 2;
        n_first += in_first;
        rows[p] = (int)p;
    }
    sort_by(rows, k, rank); /* the work items by rank: ascending ids within each */
    PyObject *out = PyByteArray_FromStringAndSize(NULL, k * (Py_ssize_t)(sizeof(Pair) + sizeof(Work)));
    if (!out) return NULL;
    char *bytes = PyByteArray_AS_STRING(out);
    memset(bytes, 0, PyByteArray_GET_SIZE(out));
    Pair *pairs = (Pair *)bytes;
    Work *work = (Work *)(bytes + k * sizeof(Pair));
    for (Py_ssize_t p = 0; p < k; p++) {
        double w = PyFloat_AsDouble(PyList_GET_ITEM(weights, order[p]));
        if (w == -1.0 && PyErr_Occurred()) goto fail;
        pairs[p].down = ptr[p] + offsets[2];
        pairs[p].weight = (float)w;
    }
    PyObject *experts = PyList_New(k);
    if (!experts) goto fail;
    for (Py_ssize_t i = 0; i < k; i++) {
        int p = rows[i];
        work[i].gate = ptr[p] + offsets[0];
        work[i].up = ptr[p] + offsets[1];
        work[i].down = ptr[p] + offsets[2];
        work[i].n_pairs = 1;
        work[i].pair[0] = p;
        PyObject *e = PyList_GET_ITEM(row, order[p]);
        Py_INCREF(e);
        PyList_SET_ITEM(experts, i, e);
    }
    *n_first_out = n_first;
    *experts_out = experts;
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

#endif
