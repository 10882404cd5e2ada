/* A decode step's grouped-launch tables (fomoepy.runtime.moe_tables._decode_tables), packed in C.

   Every MoE layer step of a decode packs k PairInfo and k ExpertWork records (hip_kernels/experts.hip)
   for its one token: in Python, list arithmetic and one struct.pack of 7k values, about 15 µs a step at
   k = 10; here about a microsecond. The Python function stays the definition (and serves where this is
   not built); tests/test_moe_tables.py checks that both give the same bytes. The packing itself is
   _moe_pack.h's, which _driver_calls.DecodeLaunch shares.

       pack_decode(row, weights, slot_ptr, offsets, first, then) -> (bytearray, n_first, experts)
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_moe_pack.h"

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
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_moe_tables", "A decode step's grouped-launch tables, packed in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__moe_tables(void) { return PyModule_Create(&module); }
