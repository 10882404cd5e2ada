/* ResidentMap: the device tier's slots by (layer, expert), GpuExperts.resident.

   A dict keyed by (layer, expert) tuples: a lookup makes and hashes a tuple and walks to the stored key's
   objects to compare it, cold memory at the 397B shape's 30 thousand keys. A decode step asks it some thirty
   times (its experts' slots at begin, the plan's held experts at compute, each eviction and copy down). Here
   each layer is an array indexed by expert: one load, from Python or from _decode_experts.c (resident_get).
   It answers what GpuExperts asks of a dict (get, pop, [], in, len, clear, iteration over its keys); a
   key is a (layer, expert) pair of non-negative ints. */

#include "_driver_calls.h"

int resident_key(PyObject *key, Py_ssize_t *layer, Py_ssize_t *expert) {
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_SetString(PyExc_TypeError, "a resident key is (layer, expert)");
        return -1;
    }
    *layer = PyNumber_AsSsize_t(PyTuple_GET_ITEM(key, 0), PyExc_OverflowError);
    if (*layer == -1 && PyErr_Occurred()) return -1;
    *expert = PyNumber_AsSsize_t(PyTuple_GET_ITEM(key, 1), PyExc_OverflowError);
    if (*expert == -1 && PyErr_Occurred()) return -1;
    return 0;
}

PyObject *resident_get(ResidentMap *m, Py_ssize_t layer, Py_ssize_t expert) {
    if (layer < 0 || layer >= m->n_layer || expert < 0 || expert >= m->cap[layer]) return NULL;
    return m->slot[layer][expert];
}

/* the slot of (layer, expert) set (a new reference taken; NULL: cleared); 0, or -1 with an error set */
int resident_set(ResidentMap *m, Py_ssize_t layer, Py_ssize_t expert, PyObject *value) {
    if (layer < 0 || layer >= m->n_layer || expert < 0) {
        if (!value) return 0;
        PyErr_Format(PyExc_KeyError, "(%zd, %zd) is outside %zd layers", layer, expert, m->n_layer);
        return -1;
    }
    if (expert >= m->cap[layer]) {
        if (!value) return 0;
        Py_ssize_t cap = m->cap[layer] ? m->cap[layer] : 64;
        while (cap <= expert) cap *= 2;
        PyObject **grown = PyMem_Realloc(m->slot[layer], cap * sizeof(PyObject *));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        memset(grown + m->cap[layer], 0, (cap - m->cap[layer]) * sizeof(PyObject *));
        m->slot[layer] = grown, m->cap[layer] = cap;
    }
    PyObject *old = m->slot[layer][expert];
    m->slot[layer][expert] = Py_XNewRef(value);
    m->len += (value != NULL) - (old != NULL);
    Py_XDECREF(old);
    return 0;
}

static Py_ssize_t ResidentMap_length(ResidentMap *m) { return m->len; }

static PyObject *ResidentMap_subscript(ResidentMap *m, PyObject *key) {
    Py_ssize_t layer, expert;
    if (resident_key(key, &layer, &expert)) return NULL;
    PyObject *v = resident_get(m, layer, expert);
    if (!v) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(v);
}

static int ResidentMap_ass_subscript(ResidentMap *m, PyObject *key, PyObject *value) {
    Py_ssize_t layer, expert;
    if (resident_key(key, &layer, &expert)) return -1;
    if (!value && !resident_get(m, layer, expert)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    return resident_set(m, layer, expert, value);
}

static int ResidentMap_contains(ResidentMap *m, PyObject *key) {
    Py_ssize_t layer, expert;
    if (resident_key(key, &layer, &expert)) return -1;
    return resident_get(m, layer, expert) != NULL;
}

/* get's and pop's arguments, (key[, default]): the slot held (borrowed) or NULL, in *held; 0, or -1 with an error */
static int key_and_default(ResidentMap *m, PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_ssize_t *layer,
                           Py_ssize_t *expert, PyObject **held) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (resident_key(args[0], layer, expert)) return -1;
    *held = resident_get(m, *layer, *expert);
    return 0;
}

static PyObject *ResidentMap_get(ResidentMap *m, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t layer, expert;
    PyObject *v;
    if (key_and_default(m, args, nargs, "get(key, default=None)", &layer, &expert, &v)) return NULL;
    return Py_NewRef(v ? v : nargs == 2 ? args[1] : Py_None);
}

static PyObject *ResidentMap_pop(ResidentMap *m, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t layer, expert;
    PyObject *v;
    if (key_and_default(m, args, nargs, "pop(key[, default])", &layer, &expert, &v)) return NULL;
    if (!v) {
        if (nargs == 2) return Py_NewRef(args[1]);
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_INCREF(v);
    resident_set(m, layer, expert, NULL); /* (clearing never fails) */
    return v;
}

static PyObject *ResidentMap_clear_all(ResidentMap *m, PyObject *unused) {
    for (Py_ssize_t l = 0; l < m->n_layer; l++)
        for (Py_ssize_t e = 0; e < m->cap[l]; e++) Py_CLEAR(m->slot[l][e]);
    m->len = 0;
    Py_RETURN_NONE;
}

static PyObject *ResidentMap_keys(ResidentMap *m, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (Py_ssize_t l = 0; out && l < m->n_layer; l++)
        for (Py_ssize_t e = 0; out && e < m->cap[l]; e++) {
            if (!m->slot[l][e]) continue;
            PyObject *key = Py_BuildValue("(nn)", l, e);
            if (!key || PyList_Append(out, key)) Py_CLEAR(out);
            Py_XDECREF(key);
        }
    return out;
}

static PyObject *ResidentMap_iter(ResidentMap *m) {
    PyObject *keys = ResidentMap_keys(m, NULL);
    PyObject *it = keys ? PyObject_GetIter(keys) : NULL;
    Py_XDECREF(keys);
    return it;
}

static int ResidentMap_init(ResidentMap *m, PyObject *args, PyObject *kw) {
    Py_ssize_t n_layer;
    if (!PyArg_ParseTuple(args, "n", &n_layer)) return -1;
    if (n_layer < 0 || m->slot) {
        PyErr_SetString(PyExc_ValueError, "ResidentMap(n_layer): n_layer >= 0, made once");
        return -1;
    }
    m->slot = PyMem_Calloc(n_layer ? n_layer : 1, sizeof(PyObject **));
    m->cap = PyMem_Calloc(n_layer ? n_layer : 1, sizeof(Py_ssize_t));
    if (!m->slot || !m->cap) {
        PyErr_NoMemory();
        return -1;
    }
    m->n_layer = n_layer;
    return 0;
}

static int ResidentMap_traverse(ResidentMap *m, visitproc visit, void *arg) {
    for (Py_ssize_t l = 0; l < m->n_layer; l++)
        for (Py_ssize_t e = 0; e < m->cap[l]; e++) Py_VISIT(m->slot[l][e]);
    return 0;
}

static int ResidentMap_clear(ResidentMap *m) {
    PyObject *r = ResidentMap_clear_all(m, NULL);
    Py_XDECREF(r);
    return 0;
}

static void ResidentMap_dealloc(ResidentMap *m) {
    PyObject_GC_UnTrack(m);
    ResidentMap_clear(m);
    for (Py_ssize_t l = 0; l < m->n_layer; l++) PyMem_Free(m->slot[l]);
    PyMem_Free(m->slot);
    PyMem_Free(m->cap);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMappingMethods ResidentMap_mapping = {
    .mp_length = (lenfunc)ResidentMap_length,
    .mp_subscript = (binaryfunc)ResidentMap_subscript,
    .mp_ass_subscript = (objobjargproc)ResidentMap_ass_subscript,
};

static PySequenceMethods ResidentMap_sequence = {.sq_contains = (objobjproc)ResidentMap_contains};

static PyMethodDef ResidentMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))ResidentMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))ResidentMap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)ResidentMap_clear_all, METH_NOARGS, "every slot let go"},
    {"keys", (PyCFunction)ResidentMap_keys, METH_NOARGS, "the (layer, expert) keys held, in layer and expert order"},
    {NULL},
};

PyTypeObject ResidentMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.ResidentMap",
    .tp_basicsize = sizeof(ResidentMap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The device tier's slots by (layer, expert): an array per layer (GpuExperts.resident).",
    .tp_traverse = (traverseproc)ResidentMap_traverse,
    .tp_clear = (inquiry)ResidentMap_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ResidentMap_init,
    .tp_dealloc = (destructor)ResidentMap_dealloc,
    .tp_as_mapping = &ResidentMap_mapping,
    .tp_as_sequence = &ResidentMap_sequence,
    .tp_iter = (getiterfunc)ResidentMap_iter,
    .tp_methods = ResidentMap_methods,
};
