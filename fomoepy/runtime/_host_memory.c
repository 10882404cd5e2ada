/* Host memory as a MoE step hands it around (fomoepy.runtime.pinned), in C.

   address(buffer) -> int
       The address of a contiguous buffer's first byte (a numpy array, read-only or not): one buffer-protocol
       request. A step asks for a few per expert it copies up or down; through ctypes (c_char.from_buffer,
       addressof, or `.ctypes.data` for a read-only array) each cost about a microsecond.

   Lent(address, size, key, give_back)
       An object exporting [address, address + size) as writable bytes (np.frombuffer makes a uint8 array
       over it) that calls give_back(key) once, when it goes: when the last array over it is dropped, from
       whichever thread drops it. pinned.hand_out's buffer, made in one call instead of a ctypes array, an
       attribute and a Python object with a __del__. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *address(PyObject *module, PyObject *buffer) {
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_ANY_CONTIGUOUS) < 0) return NULL;
    PyObject *out = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return out;
}

typedef struct {
    PyObject_HEAD
    void *address;
    Py_ssize_t size;
    PyObject *key, *give_back;
} Lent;

static int Lent_init(Lent *self, PyObject *args, PyObject *kw) {
    unsigned long long address;
    Py_ssize_t size;
    PyObject *key, *give_back;
    if (!PyArg_ParseTuple(args, "KnOO", &address, &size, &key, &give_back)) return -1;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "Lent: a negative size");
        return -1;
    }
    self->address = (void *)(uintptr_t)address;
    self->size = size;
    Py_INCREF(key);
    Py_XSETREF(self->key, key);
    Py_INCREF(give_back);
    Py_XSETREF(self->give_back, give_back);
    return 0;
}

static int Lent_getbuffer(Lent *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->address, self->size, 0, flags);
}

static void Lent_dealloc(Lent *self) {
    if (self->give_back) {
        /* the buffer goes back; an error there cannot propagate from a deallocation: it is reported */
        PyObject *err_type, *err_value, *err_tb;
        PyErr_Fetch(&err_type, &err_value, &err_tb);
        PyObject *r = PyObject_CallOneArg(self->give_back, self->key);
        if (!r) PyErr_WriteUnraisable(self->give_back);
        Py_XDECREF(r);
        PyErr_Restore(err_type, err_value, err_tb);
    }
    Py_XDECREF(self->key);
    Py_XDECREF(self->give_back);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs Lent_as_buffer = {(getbufferproc)Lent_getbuffer, NULL};

static PyTypeObject LentType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._host_memory.Lent",
    .tp_basicsize = sizeof(Lent),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lent(address, size, key, give_back): [address, address + size) as writable bytes; give_back(key) when it goes.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lent_init,
    .tp_dealloc = (destructor)Lent_dealloc,
    .tp_as_buffer = &Lent_as_buffer,
};

static PyMethodDef methods[] = {
    {"address", (PyCFunction)address, METH_O, "address(buffer) -> the address of its first byte"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_memory", "Host memory handed around by a MoE step.", -1, methods};

PyMODINIT_FUNC PyInit__host_memory(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &LentType) < 0) {  /* (readies the type) */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
