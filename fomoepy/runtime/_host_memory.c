/* Host memory as a MoE step hands it around (fomoepy.runtime.pinned), in C.

   address(buffer) -> int
       The address of a contiguous buffer's first byte (a numpy array, read-only or not): one buffer-protocol
       request. A step asks for a few per expert it copies up or down; through ctypes (c_char.from_buffer,
       addressof, or `.ctypes.data` for a read-only array) each cost about a microsecond.

   record_index(parts, sizes, base, stride, count) -> int
       The i of the buffer at base + i * stride (0 <= i < count) that `parts` fill from its start, one right
       after the other, part j sizes[j] bytes; -1 where they lie elsewhere (fomoepy.runtime.ggml_reads: the
       read arena's buffer an expert's record landed in, which a decode round computes from in place). A
       step asks it of each miss the tier does not keep; through Python it was two frames and nine calls.

   Lent(address, size, key, give_back)
       An object exporting [address, address + size) as writable bytes (np.frombuffer makes a uint8 array
       over it) that calls give_back(key) once, when it goes: when the last array over it is dropped, from
       whichever thread drops it. pinned.hand_out's buffer, made in one call instead of a ctypes array, an
       attribute and a Python object with a __del__.

   Arena(stride, count)
       The cpu device's read arena (fomoepy.runtime.ggml_reads.PyReadArena is the definition, and serves where
       this is not built; tests/test_ggml_reads.py holds the two to the same answers): `count` buffers of
       `stride` bytes (whole 4 KiB pages) at base + i * stride, in one allocation whose pages are touched
       only where reads land. take(nbytes=stride) hands out the buffer given back last (a stack: the arena
       touches the pages of as many buffers as were ever held at once) as a uint8 array of its first nbytes,
       whose memory object puts it back here when it goes, from whichever thread drops it; None when all
       are held. Any thread may take: the stack changes under the GIL only. A step takes one a read it
       issues (2.6 a step on the bench model at a 25 % tier): through Python each took three frames, a
       lock and its give-back's queue.

   Shelf(written, settle)
       A pinned pool's buffers by size (fomoepy.runtime.pinned.PyShelf is the definition, and serves where
       this is not built; tests/test_pinned_pool.py holds the two to the same answers): those never handed
       out (a stack per size), those given back (a queue per size, each with the count of points marked
       when it came back) and those given back since the last take, by any thread. A step takes about
       seven buffers (its reads, the next layer's guesses, its copies down), and each comes back once:
       through Python, the take and its give-back were about 30 calls and 4 µs a buffer in the step.
       take(size) hands out a buffer of `size` bytes that no copy may still read (one never handed out,
       else the longest given back whose mark has passed), as a uint8 array whose memory object puts it
       back here when it goes; None when there is none (the pool then grows or waits). Taking a buffer
       that a copy down wrote (`written`: address -> that copy's number) calls settle(number) first. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

static PyObject *address(PyObject *module, PyObject *buffer) {
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_ANY_CONTIGUOUS) < 0) return NULL;
    PyObject *out = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return out;
}

/* the i of the buffer at base + i * stride (0 <= i < count) that starts at `address`; -1 where none does */
static Py_ssize_t buffer_at(uintptr_t base, Py_ssize_t stride, Py_ssize_t count, uintptr_t address) {
    if (address < base || (address - base) % (uintptr_t)stride || (address - base) / (uintptr_t)stride >= (uintptr_t)count) return -1;
    return (Py_ssize_t)((address - base) / (uintptr_t)stride);
}

static PyObject *record_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long base;
    Py_ssize_t stride, count;
    if (nargs != 5 || (base = PyLong_AsUnsignedLongLong(args[2])) == (unsigned long long)-1 ||
        (stride = PyLong_AsSsize_t(args[3])) <= 0 || (count = PyLong_AsSsize_t(args[4])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "record_index(parts, sizes, base, stride > 0, count >= 0)");
        return NULL;
    }
    PyObject *parts = PySequence_Fast(args[0], "record_index: parts is a sequence");
    PyObject *sizes = parts ? PySequence_Fast(args[1], "record_index: sizes is a sequence") : NULL;
    PyObject *out = NULL;
    if (!sizes) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
    if (n != PySequence_Fast_GET_SIZE(sizes) || !n) {
        PyErr_SetString(PyExc_ValueError, "record_index: one size per part, and at least one part");
        goto done;
    }
    uintptr_t start = 0, at = 0;
    long long index = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, j));
        if (size == -1 && PyErr_Occurred()) goto done;
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, j), &view, PyBUF_ANY_CONTIGUOUS) < 0) goto done;
        uintptr_t buf = (uintptr_t)view.buf;
        Py_ssize_t len = view.len;
        PyBuffer_Release(&view);
        if (!j) start = at = buf;
        if (len != size || buf != at) goto answer;
        at += (uintptr_t)size;
    }
    index = buffer_at(base, stride, count, start);
answer:
    out = PyLong_FromLongLong(index);
done:
    Py_XDECREF(parts);
    Py_XDECREF(sizes);
    return out;
}

struct Shelf;
struct Arena;

typedef struct {
    PyObject_HEAD
    void *address;
    Py_ssize_t size;
    PyObject *key, *give_back;
    struct Shelf *shelf; /* or: the shelf it goes back to (a reference), with no key and no give_back */
    struct Arena *arena; /* or: the arena it goes back to (a reference), as its buffer `index` */
    Py_ssize_t index;
} Lent;

static void arena_give_back(struct Arena *arena, Py_ssize_t index);

static int shelf_give_back(struct Shelf *shelf, uint64_t address, Py_ssize_t size);

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
    if (self->arena) { /* (a push onto a stack sized for every buffer: nothing to fail) */
        arena_give_back(self->arena, self->index);
        Py_DECREF((PyObject *)self->arena);
    }
    if (self->shelf || self->give_back) {
        /* the buffer goes back; an error there cannot propagate from a deallocation: it is reported */
        PyObject *err_type, *err_value, *err_tb;
        PyErr_Fetch(&err_type, &err_value, &err_tb);
        if (self->shelf) {
            if (shelf_give_back(self->shelf, (uint64_t)(uintptr_t)self->address, self->size) < 0)
                PyErr_WriteUnraisable((PyObject *)self->shelf); /* out of memory: the buffer is lost to the pool */
            Py_DECREF((PyObject *)self->shelf);
        } else {
            PyObject *r = PyObject_CallOneArg(self->give_back, self->key);
            if (!r) PyErr_WriteUnraisable(self->give_back);
            Py_XDECREF(r);
        }
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

/* A pool's buffer [address, address + size) as a numpy uint8 array (frombuffer(lent, uint8)) whose Lent goes
   back, when the last array over it goes, to `shelf` (at its address) or `arena` (as its buffer `index`):
   the one form Shelf.take and Arena.take hand out. */
static PyObject *lent_array(void *address, Py_ssize_t size, struct Shelf *shelf, struct Arena *arena, Py_ssize_t index,
                            PyObject *frombuffer, PyObject *uint8) {
    Lent *lent = PyObject_New(Lent, &LentType);
    if (!lent) {
        if (arena) arena_give_back(arena, index);
        return NULL;
    }
    lent->address = address, lent->size = size;
    lent->key = lent->give_back = NULL;
    lent->shelf = shelf, lent->arena = arena, lent->index = index;
    Py_INCREF(shelf ? (PyObject *)shelf : (PyObject *)arena);
    PyObject *out = PyObject_CallFunctionObjArgs(frombuffer, (PyObject *)lent, uint8, NULL);
    Py_DECREF(lent); /* (a failed array drops the last reference: the buffer comes back) */
    return out;
}


/* -- Shelf ------------------------------------------------------------------------------------------ */
typedef struct { uint64_t address; long long mark; } Given;
typedef struct { uint64_t address; Py_ssize_t size; long long mark; } Returned;

typedef struct {
    Py_ssize_t size;
    uint64_t *fresh;         /* a stack: the last pushed goes out first */
    size_t n_fresh, cap_fresh;
    Given *ring;             /* given back, oldest at head */
    size_t head, n, cap;
} SizeClass;

typedef struct Shelf {
    PyObject_HEAD
    SizeClass *classes;
    size_t n_classes, cap_classes;
    Returned *returned;
    size_t n_returned, cap_returned;
    long long marks, passed;
    PyObject *written, *settle, *frombuffer, *uint8;
} Shelf;

static int grow_array(void **a, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 16;
    while (cap2 < need) cap2 *= 2;
    void *p = realloc(*a, cap2 * item);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *a = p, *cap = cap2;
    return 0;
}

static SizeClass *size_class(Shelf *s, Py_ssize_t size, int make) {
    for (size_t i = 0; i < s->n_classes; i++)
        if (s->classes[i].size == size) return &s->classes[i];
    if (!make) return NULL;
    if (grow_array((void **)&s->classes, &s->cap_classes, s->n_classes + 1, sizeof(SizeClass))) return NULL;
    SizeClass *c = &s->classes[s->n_classes++];
    memset(c, 0, sizeof *c);
    c->size = size;
    return c;
}

static int ring_push(SizeClass *c, uint64_t address, long long mark) {
    if (c->n == c->cap) { /* unroll into a larger ring, oldest first */
        size_t cap = c->cap ? 2 * c->cap : 16;
        Given *r = malloc(cap * sizeof(Given));
        if (!r) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < c->n; i++) r[i] = c->ring[(c->head + i) % c->cap];
        free(c->ring);
        c->ring = r, c->cap = cap, c->head = 0;
    }
    c->ring[(c->head + c->n++) % c->cap] = (Given){address, mark};
    return 0;
}

static uint64_t ring_pop(SizeClass *c) {
    uint64_t a = c->ring[c->head].address;
    c->head = (c->head + 1) % c->cap, c->n--;
    return a;
}

static int shelf_give_back(Shelf *s, uint64_t address, Py_ssize_t size) {
    if (grow_array((void **)&s->returned, &s->cap_returned, s->n_returned + 1, sizeof(Returned))) return -1;
    s->returned[s->n_returned++] = (Returned){address, size, s->marks};
    return 0;
}

/* the buffers given back since the last take, into their sizes' queues, in the order they came */
static int collect(Shelf *s) {
    size_t i = 0;
    for (; i < s->n_returned; i++) {
        Returned r = s->returned[i];
        SizeClass *c = size_class(s, r.size, 1);
        if (!c || ring_push(c, r.address, r.mark)) break;
    }
    memmove(s->returned, s->returned + i, (s->n_returned - i) * sizeof(Returned));
    s->n_returned -= i;
    return s->n_returned ? -1 : 0;
}

static PyObject *lend(Shelf *s, uint64_t address, Py_ssize_t size) {
    if (s->written && PyDict_GET_SIZE(s->written)) {
        PyObject *key = PyLong_FromUnsignedLongLong(address);
        if (!key) return NULL;
        PyObject *number = PyDict_GetItemWithError(s->written, key);
        if (number) {
            Py_INCREF(number);
            int rc = PyDict_DelItem(s->written, key);
            int settles = s->settle && s->settle != Py_None;
            PyObject *r = rc < 0 || !settles ? NULL : PyObject_CallOneArg(s->settle, number);
            Py_DECREF(number);
            if (rc < 0 || (settles && !r)) {
                Py_DECREF(key);
                return NULL;
            }
            Py_XDECREF(r);
        }
        Py_DECREF(key);
        if (PyErr_Occurred()) return NULL;
    }
    return lent_array((void *)(uintptr_t)address, size, s, NULL, 0, s->frombuffer, s->uint8);
}

/* the size a method was asked about, and its class (NULL: none yet), the buffers given back collected first */
static int asked(Shelf *s, PyObject *arg, Py_ssize_t *size, SizeClass **c) {
    *size = PyLong_AsSsize_t(arg);
    if ((*size == -1 && PyErr_Occurred()) || (s->n_returned && collect(s))) return -1;
    *c = size_class(s, *size, 0);
    return 0;
}

static PyObject *Shelf_take(Shelf *s, PyObject *arg) {
    Py_ssize_t size;
    SizeClass *c;
    if (asked(s, arg, &size, &c)) return NULL;
    if (c && c->n_fresh) return lend(s, c->fresh[--c->n_fresh], size);
    if (c && c->n && c->ring[c->head].mark < s->passed) return lend(s, ring_pop(c), size);
    Py_RETURN_NONE;
}

static PyObject *Shelf_take_waiting(Shelf *s, PyObject *arg) {
    Py_ssize_t size;
    SizeClass *c;
    if (asked(s, arg, &size, &c)) return NULL;
    if (!c || !c->n) {
        PyErr_SetString(PyExc_LookupError, "no buffer of this size was given back");
        return NULL;
    }
    return lend(s, ring_pop(c), size);
}

static PyObject *Shelf_add_fresh(Shelf *s, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t size, count;
    unsigned long long start;
    if (nargs != 3 || (size = PyLong_AsSsize_t(args[0])) < 0 || (start = PyLong_AsUnsignedLongLong(args[1])) == (unsigned long long)-1 ||
        (count = PyLong_AsSsize_t(args[2])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "add_fresh(size, start, count): sizes and counts are >= 0");
        return NULL;
    }
    SizeClass *c = size_class(s, size, 1);
    if (!c || grow_array((void **)&c->fresh, &c->cap_fresh, c->n_fresh + (size_t)count, sizeof(uint64_t))) return NULL;
    for (Py_ssize_t i = count - 1; i >= 0; i--) c->fresh[c->n_fresh++] = start + (uint64_t)i * (uint64_t)size;
    Py_RETURN_NONE;
}

static PyObject *Shelf_waiting(Shelf *s, PyObject *arg) {
    Py_ssize_t size;
    SizeClass *c;
    if (asked(s, arg, &size, &c)) return NULL;
    return PyLong_FromSize_t(c ? c->n : 0);
}

static PyObject *Shelf_held(Shelf *s, PyObject *unused) {
    if (s->n_returned && collect(s)) return NULL;
    size_t n = 0;
    for (size_t i = 0; i < s->n_classes; i++) n += s->classes[i].n_fresh + s->classes[i].n;
    return PyLong_FromSize_t(n);
}

static PyObject *Shelf_returned(Shelf *s, PyObject *unused) {
    PyObject *out = PyList_New((Py_ssize_t)s->n_returned);
    for (size_t i = 0; out && i < s->n_returned; i++) {
        PyObject *a = PyLong_FromUnsignedLongLong(s->returned[i].address);
        if (!a) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, a);
    }
    return out;
}

static PyObject *Shelf_clear(Shelf *s, PyObject *unused) {
    for (size_t i = 0; i < s->n_classes; i++) free(s->classes[i].fresh), free(s->classes[i].ring);
    free(s->classes);
    s->classes = NULL, s->n_classes = s->cap_classes = 0;
    s->n_returned = 0;
    Py_RETURN_NONE;
}

static int Shelf_init(Shelf *s, PyObject *args, PyObject *kw) {
    PyObject *written, *settle;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &written, &settle)) return -1;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy) return -1;
    PyObject *frombuffer = PyObject_GetAttrString(numpy, "frombuffer"), *uint8 = PyObject_GetAttrString(numpy, "uint8");
    Py_DECREF(numpy);
    if (!frombuffer || !uint8) {
        Py_XDECREF(frombuffer), Py_XDECREF(uint8);
        return -1;
    }
    Py_INCREF(written), Py_INCREF(settle);
    Py_XSETREF(s->written, written);
    Py_XSETREF(s->settle, settle);
    Py_XSETREF(s->frombuffer, frombuffer);
    Py_XSETREF(s->uint8, uint8);
    return 0;
}

static void Shelf_dealloc(Shelf *s) {
    Shelf_clear(s, NULL);
    free(s->returned);
    Py_XDECREF(s->written), Py_XDECREF(s->settle), Py_XDECREF(s->frombuffer), Py_XDECREF(s->uint8);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Shelf_methods[] = {
    {"take", (PyCFunction)Shelf_take, METH_O, "take(size) -> a buffer no copy may read (fresh, else the longest given back and passed), or None"},
    {"take_waiting", (PyCFunction)Shelf_take_waiting, METH_O, "take_waiting(size) -> the longest given back, passed or not (after a wait for every copy)"},
    {"add_fresh", (PyCFunction)(void (*)(void))Shelf_add_fresh, METH_FASTCALL, "add_fresh(size, start, count): a chunk's buffers, handed out from its start"},
    {"waiting", (PyCFunction)Shelf_waiting, METH_O, "waiting(size) -> buffers of that size given back and not taken again"},
    {"held", (PyCFunction)Shelf_held, METH_NOARGS, "held() -> buffers on the shelf (fresh and given back)"},
    {"returned", (PyCFunction)Shelf_returned, METH_NOARGS, "returned() -> addresses given back since the last take"},
    {"clear", (PyCFunction)Shelf_clear, METH_NOARGS, "clear(): forget every buffer"},
    {NULL},
};

static PyMemberDef Shelf_members[] = {
    {"marks", T_LONGLONG, offsetof(Shelf, marks), 0, "points marked on the copy streams so far"},
    {"passed", T_LONGLONG, offsetof(Shelf, passed), 0, "the newest of them known complete"},
    {"settle", T_OBJECT, offsetof(Shelf, settle), 0, "settle(number): the host waits for the copies down up to that one"},
    {NULL},
};

static PyTypeObject ShelfType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._host_memory.Shelf",
    .tp_basicsize = sizeof(Shelf),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Shelf(written, settle): a pinned pool's buffers by size (fomoepy.runtime.pinned.PyShelf).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Shelf_init,
    .tp_dealloc = (destructor)Shelf_dealloc,
    .tp_methods = Shelf_methods,
    .tp_members = Shelf_members,
};

/* -- Arena ------------------------------------------------------------------------------------------ */
typedef struct Arena {
    PyObject_HEAD
    char *memory;            /* count * stride bytes, 4 KiB-aligned, in `owner` */
    PyObject *owner;         /* the numpy array the memory is (numpy's allocation: its large ones are advised
                                huge pages; with posix_memalign's the step's reads waited three times as long) */
    Py_ssize_t stride, count;
    Py_ssize_t *free;        /* a stack of the buffers nobody holds: the last given back goes out first */
    Py_ssize_t n_free;
    PyObject *frombuffer, *uint8;
} Arena;

static void arena_give_back(Arena *a, Py_ssize_t index) { a->free[a->n_free++] = index; }

static int Arena_init(Arena *a, PyObject *args, PyObject *kw) {
    static char *names[] = {"stride", "count", NULL};
    Py_ssize_t stride, count = 16;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|n", names, &stride, &count)) return -1;
    if (a->memory) {
        PyErr_SetString(PyExc_RuntimeError, "Arena: initialised once");
        return -1;
    }
    if (stride <= 0 || stride % 4096 || count < 1 || stride > PY_SSIZE_T_MAX / count) {
        PyErr_Format(PyExc_ValueError, "expected a stride of whole 4 KiB pages and a count >= 1, got %zd and %zd", stride, count);
        return -1;
    }
    if (stride * count > PY_SSIZE_T_MAX - 4096) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy) return -1;
    a->frombuffer = PyObject_GetAttrString(numpy, "frombuffer");
    a->uint8 = PyObject_GetAttrString(numpy, "uint8");
    PyObject *empty = PyObject_GetAttrString(numpy, "empty");
    Py_DECREF(numpy);
    /* (pages touched only where reads land) */
    a->owner = a->frombuffer && a->uint8 && empty ? PyObject_CallFunction(empty, "nO", stride * count + 4096, a->uint8) : NULL;
    Py_XDECREF(empty);
    if (!a->owner) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(a->owner, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    char *memory = (char *)view.buf + (-(uintptr_t)view.buf % 4096);
    PyBuffer_Release(&view); /* (the array's memory stays where it is while the array lives: held here) */
    a->free = PyMem_Malloc(count * sizeof(Py_ssize_t));
    if (!a->free) {
        PyErr_NoMemory();
        return -1;
    }
    a->memory = memory, a->stride = stride, a->count = count;
    for (Py_ssize_t i = 0; i < count; i++) a->free[i] = count - 1 - i; /* buffer 0 out first */
    a->n_free = count;
    return 0;
}

static PyObject *Arena_take(Arena *a, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t nbytes = a->stride;
    if (nargs > 1 || (nargs == 1 && (nbytes = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "take(nbytes=stride)");
        return NULL;
    }
    if (!a->memory || nbytes < 0 || nbytes > a->stride) {
        PyErr_Format(PyExc_ValueError, "expected 0 <= nbytes <= %zd, got %zd", a->stride, nbytes);
        return NULL;
    }
    if (!a->n_free) Py_RETURN_NONE;
    Py_ssize_t index = a->free[--a->n_free]; /* (taken before any Python code can run: another thread's take finds it gone) */
    return lent_array(a->memory + index * a->stride, nbytes, NULL, a, index, a->frombuffer, a->uint8);
}

static PyObject *Arena_index_of(Arena *a, PyObject *arg) {
    unsigned long long address = PyLong_AsUnsignedLongLong(arg);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* (a negative address is no buffer's) */
        Py_RETURN_NONE;
    }
    Py_ssize_t index = a->memory ? buffer_at((uintptr_t)a->memory, a->stride, a->count, (uintptr_t)address) : -1;
    if (index < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(index);
}

static PyObject *Arena_get_base(Arena *a, void *unused) { return PyLong_FromVoidPtr(a->memory); }
static PyObject *Arena_get_free(Arena *a, void *unused) { return PyLong_FromSsize_t(a->n_free); }

static void Arena_dealloc(Arena *a) { /* (no buffer is out: each held a reference) */
    Py_XDECREF(a->owner);
    PyMem_Free(a->free);
    Py_XDECREF(a->frombuffer), Py_XDECREF(a->uint8);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyMethodDef Arena_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Arena_take, METH_FASTCALL, "take(nbytes=stride) -> the first nbytes of a buffer nobody holds, or None"},
    {"index_of", (PyCFunction)Arena_index_of, METH_O, "index_of(address) -> the buffer that starts there, or None"},
    {NULL},
};

static PyMemberDef Arena_members[] = {
    {"stride", T_PYSSIZET, offsetof(Arena, stride), READONLY, "bytes from one buffer to the next (whole 4 KiB pages)"},
    {"count", T_PYSSIZET, offsetof(Arena, count), READONLY, "its buffers"},
    {NULL},
};

static PyGetSetDef Arena_getset[] = {
    {"base", (getter)Arena_get_base, NULL, "the address of buffer 0", NULL},
    {"free", (getter)Arena_get_free, NULL, "buffers nobody holds", NULL},
    {NULL},
};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._host_memory.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Arena(stride, count=16): a read arena's buffers (fomoepy.runtime.ggml_reads.PyReadArena).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Arena_init,
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_methods = Arena_methods,
    .tp_members = Arena_members,
    .tp_getset = Arena_getset,
};

static PyMethodDef methods[] = {
    {"address", (PyCFunction)address, METH_O, "address(buffer) -> the address of its first byte"},
    {"record_index", (PyCFunction)(void (*)(void))record_index, METH_FASTCALL,
     "record_index(parts, sizes, base, stride, count) -> the buffer the parts fill from its start, or -1"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_memory", "Host memory handed around by a MoE step.", -1, methods};

PyMODINIT_FUNC PyInit__host_memory(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &LentType) < 0 || PyModule_AddType(m, &ShelfType) < 0 || PyModule_AddType(m, &ArenaType) < 0) {  /* (readies the types) */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
