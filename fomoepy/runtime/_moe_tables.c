/* The grouped-launch tables of a decode step (fomoepy.runtime.moe_tables._decode_tables) and of several
   rows (build_tables's whole-array numpy: pack_rows), packed in C.

   Every MoE layer step of a decode packs k PairInfo and k ExpertWork records (hip_kernels/experts.hip)
   for its one token: in Python, list arithmetic and one struct.pack of 7k values, about 15 µs a step at
   k = 10; here about a microsecond. The Python function stays the definition (and serves where this is
   not built); tests/test_moe_tables.py checks that both give the same bytes. The packing itself is
   _moe_pack.h's, which _driver_calls.DecodeLaunch shares.

       pack_decode(row, weights, slot_ptr, offsets, first, then) -> (bytearray, n_first, experts)
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "_moe_pack.h"

static int compare_ids(const void *a, const void *b) {
    const long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* The tables of T > 1 tokens (a batched decode step, a prefill chunk): moe_tables.build_tables's definition
   in whole-array numpy (~40 µs for 8 rows of 8 picks) packed in C, the same bytes.

       pack_rows(ids, weights, k, slot_ptr, offsets, first, then) -> (bytearray, n_first, experts, tile)

   ids: T*k int64 expert ids, token-major; weights: T*k float32 (any contiguous buffers). */
static PyObject *pack_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "pack_rows(ids, weights, k: int, slot_ptr: dict, offsets: tuple, first, then)");
        return NULL;
    }
    Py_buffer ids_buf, w_buf;
    if (PyObject_GetBuffer(args[0], &ids_buf, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &w_buf, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ids_buf);
        return NULL;
    }
    PyObject *out = NULL, *experts = NULL, *result = NULL;
    long long *flat = NULL, *uniq = NULL;
    float *wsorted = NULL;
    int *rank = NULL, *order_e = NULL, *place = NULL, *count = NULL, *start = NULL, *fill = NULL, *place_of = NULL;
    uint64_t *ptr = NULL;
    PyObject *slot_ptr = args[3], *offsets_tuple = args[4], *first = args[5], *then = args[6];
    const Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    const Py_ssize_t P = ids_buf.len / 8;
    if (k == -1 && PyErr_Occurred()) goto done;
    if (k < 1 || k > MAX_K || ids_buf.len % 8 || P % k || w_buf.len != P * 4 || !PyDict_Check(slot_ptr) ||
        !PyTuple_Check(offsets_tuple) || PyTuple_GET_SIZE(offsets_tuple) != 3) {
        PyErr_Format(PyExc_ValueError, "rows' tables: %zd bytes of ids, %zd of weights, k %zd (at most %d), three offsets",
                     ids_buf.len, w_buf.len, k, MAX_K);
        goto done;
    }
    uint64_t offsets[3];
    for (int i = 0; i < 3; i++)
        if (pack_u64(PyTuple_GET_ITEM(offsets_tuple, i), &offsets[i])) goto done;
    const long long *ids = (const long long *)ids_buf.buf;
    const float *weights = (const float *)w_buf.buf;
    flat = PyMem_Malloc(P * sizeof *flat + 1);
    uniq = PyMem_Malloc(P * sizeof *uniq + 1);
    wsorted = PyMem_Malloc(P * sizeof *wsorted + 1);
    place_of = PyMem_Malloc(P * sizeof *place_of + 1);
    if (!flat || !uniq || !wsorted || !place_of) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t t = 0; t < P / k; t++) { /* each token's choices by ascending expert id: pair p = t*k + j */
        int order[MAX_K];
        for (Py_ssize_t j = 0; j < k; j++) order[j] = (int)j;
        sort_by(order, k, ids + t * k);
        for (Py_ssize_t j = 0; j < k; j++) {
            flat[t * k + j] = ids[t * k + order[j]];
            wsorted[t * k + j] = weights[t * k + order[j]];
        }
    }
    memcpy(uniq, flat, P * sizeof *uniq); /* the distinct experts, ascending */
    qsort(uniq, P, sizeof *uniq, compare_ids);
    Py_ssize_t U = 0;
    for (Py_ssize_t p = 0; p < P; p++)
        if (U == 0 || uniq[U - 1] != uniq[p]) uniq[U++] = uniq[p];
    rank = PyMem_Malloc(U * sizeof *rank + 1);
    order_e = PyMem_Malloc(U * sizeof *order_e + 1);
    place = PyMem_Malloc(U * sizeof *place + 1);
    count = PyMem_Calloc(U + 1, sizeof *count);
    start = PyMem_Malloc((U + 1) * sizeof *start);
    fill = PyMem_Calloc(U + 1, sizeof *fill);
    ptr = PyMem_Malloc(U * sizeof *ptr + 1);
    if (!rank || !order_e || !place || !count || !start || !fill || !ptr) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t u = 0; u < U; u++) { /* each expert's slot and rank: first 0, then 1, the rest 2 */
        PyObject *e = PyLong_FromLongLong(uniq[u]);
        if (!e) goto done;
        PyObject *slot = PyDict_GetItemWithError(slot_ptr, e);
        int in_first = slot ? PySequence_Contains(first, e) : -1;
        int in_then = in_first == 0 ? PySequence_Contains(then, e) : 0;
        if (!slot && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, e);
        Py_DECREF(e);
        if (!slot || in_first < 0 || in_then < 0 || pack_u64(slot, &ptr[u])) goto done;
        rank[u] = in_first ? 0 : in_then ? 1 : 2;
    }
    Py_ssize_t n = 0; /* the experts' order in the table: by rank, ascending ids within each */
    for (int r = 0; r < 3; r++)
        for (Py_ssize_t u = 0; u < U; u++)
            if (rank[u] == r) order_e[n++] = (int)u;
    for (Py_ssize_t i = 0; i < U; i++) place[order_e[i]] = (int)i;
    for (Py_ssize_t p = 0; p < P; p++) { /* each pair's expert's place in the table (a binary search in uniq) */
        Py_ssize_t lo = 0, hi = U - 1;
        while (lo < hi) {
            const Py_ssize_t mid = (lo + hi) / 2;
            if (uniq[mid] < flat[p]) lo = mid + 1;
            else hi = mid;
        }
        place_of[p] = place[lo];
        count[place[lo]]++;
    }
    int n_first = 0; /* each expert's work items: its pairs in ascending order, MOE_TILE an item */
    start[0] = 0;
    for (Py_ssize_t i = 0; i < U; i++) {
        const int items = (count[i] + MOE_TILE - 1) / MOE_TILE;
        start[i + 1] = start[i] + items;
        if (rank[order_e[i]] == 0) n_first += items;
    }
    const Py_ssize_t n_items = start[U];
    out = PyByteArray_FromStringAndSize(NULL, P * (Py_ssize_t)sizeof(Pair) + n_items * (Py_ssize_t)sizeof(Work));
    experts = PyList_New(n_items);
    if (!out || !experts) goto done;
    char *bytes = PyByteArray_AS_STRING(out);
    memset(bytes, 0, PyByteArray_GET_SIZE(out));
    Pair *pairs = (Pair *)bytes;
    Work *work = (Work *)(bytes + P * sizeof(Pair));
    int tile = 1;
    for (Py_ssize_t p = 0; p < P; p++) {
        const int i = place_of[p];
        pairs[p].down = ptr[order_e[i]] + offsets[2];
        pairs[p].weight = wsorted[p];
        Work *w = &work[start[i] + fill[i] / MOE_TILE];
        w->pair[fill[i] % MOE_TILE] = (int32_t)p;
        if (++w->n_pairs > 1) tile = MOE_TILE;
        fill[i]++;
    }
    for (Py_ssize_t i = 0; i < U; i++) {
        const uint64_t base = ptr[order_e[i]];
        for (int r = start[i]; r < start[i + 1]; r++) {
            work[r].gate = base + offsets[0];
            work[r].up = base + offsets[1];
            work[r].down = base + offsets[2];
            PyObject *e = PyLong_FromLongLong(uniq[order_e[i]]);
            if (!e) goto done;
            PyList_SET_ITEM(experts, r, e);
        }
    }
    result = Py_BuildValue("(OiOi)", out, n_first, experts, tile);
done:
    Py_XDECREF(out);
    Py_XDECREF(experts);
    PyMem_Free(flat);
    PyMem_Free(uniq);
    PyMem_Free(wsorted);
    PyMem_Free(place_of);
    PyMem_Free(rank);
    PyMem_Free(order_e);
    PyMem_Free(place);
    PyMem_Free(count);
    PyMem_Free(start);
    PyMem_Free(fill);
    PyMem_Free(ptr);
    PyBuffer_Release(&ids_buf);
    PyBuffer_Release(&w_buf);
    return result;
}

static PyObject *pack_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "pack_decode(row: list, weights: list, slot_ptr: dict, offsets: tuple, first, then)");
        return NULL;
    }
    int n_first;
    PyObject *experts;
    PyObject *bytes = pack_decode_tables(args[0], args[1], args[2], args[3], args[4], args[5], &n_first, &experts);
    if (!bytes) return NULL;
    return Py_BuildValue("(NiN)", bytes, n_first, experts);
}

static PyMethodDef methods[] = {
    {"pack_decode", (PyCFunction)(void (*)(void))pack_decode, METH_FASTCALL,
     "pack_decode(row, weights, slot_ptr, offsets, first, then) -> (bytearray, n_first, experts)"},
    {"pack_rows", (PyCFunction)(void (*)(void))pack_rows, METH_FASTCALL,
     "pack_rows(ids, weights, k, slot_ptr, offsets, first, then) -> (bytearray, n_first, experts, tile)"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_moe_tables", "Grouped-launch tables (a decode step's, several rows'), packed in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__moe_tables(void) { return PyModule_Create(&module); }
