/* DecodeExperts: the device half of a MoE layer step on one GPU (fomoepy.runtime.gpu_experts.GpuExperts's
   begin, compute, download and evict), each in one C call.

   At the 397B shape a decode step's device half took about 60 µs of host time in Python (bench/host_time.py
   with it stubbed out): per expert a dictionary walk, a slot taken, a copy up and its checks, per demotion
   a pinned buffer, a copy down and four books. Most of that is the interpreter's calls, not the work (in C:
   13-18 µs a step less, measured against the Python methods in one process). A DecodeExperts does the same
   work over the same books: GpuExperts's `resident` (a ResidentMap, _resident_map.c, read here directly)
   and `_downloaded`, its DeviceSide's counters, free and dirty slots and held buffers, the pinned pool's
   marks and `written`, all read and written where Python keeps them, so the Python methods (the definition, which serve two devices,
   the binding's Python functions and the first decode step of each layer) and these interleave freely. It
   makes the same driver calls, with the same arguments, in the same order (tests/test_decode_experts.py
   compares the two, call for call and bit for bit):

       de = DecodeExperts(calls, gpu, side, layouts)
       de.begin(layer, h, ids, weights, at_hand)  # GpuExperts.begin: the launch's time (0.0: none), or None:
                                                  # not here (the layer's DecodeLaunch not made yet)
       de.compute(layer, ids, experts)            # GpuExperts.compute of the step begun here; None: none was
       de.download(key)                           # GpuExperts.download
       de.evict(key)                              # GpuExperts.evict
       de.pinned(nbytes)                          # GpuExperts._pinned: a read's pinned buffer
       de.drop_begun(), de.close()

   calls: the binding's Calls (its driver functions); gpu: the GpuExperts; side: its one DeviceSide; layouts:
   per layer (end, nbytes, offsets, spans, F, D) of its SlotLayout and matrices. What a step needs rarely is
   GpuExperts's own, called from here: a slot when none is free (_take_slot: a dirty one, a spare, a new one),
   a copy up through the staging ring (_upload), a pinned buffer the shelf has none of (PinnedPool.take). */

#include "_driver_calls.h"

#include <structmember.h>

#define ALIGN 4096 /* pinned buffers come in sizes of whole pages (fomoepy.runtime.pinned.ALIGN) */

/* the attribute and method names read or written here, interned once */
enum {
    A_PENDING_UPLOADS, A_INSTALLS_UNJOINED, A_JOINS, A_JOINED_AT, A_DOWN_SAW_JOINS, A_DOWNLOADS, A_DOWN_RECORDED,
    A_DOWN_COVERED, A_DIRTY, A_DOWN_BUFFERS, A_LAUNCHES_UNSYNCED, A_LAUNCHED_AT, A_COPIES_WAIT, A_COMPUTED_AT,
    A_N, A_MARKS, A_PASSED, A_UPLOADS, A_DIRECT_UPLOADS, A_TAKE_SLOT, A_UPLOAD, A_PTR, A_NBYTES, A_TAKE,
    A_POPLEFT, A_COMPILED, A_EMPTY, A_ASDEVICE, A_CONTIGUOUS, A_PLAN, A_ITEMS, A_FETCHED, A_AS_THEY_LAND, A_LANDED,
    A_FREE, A_STREAM, A_COPY_STREAM, A_DOWN_STREAM, A_COPIED, A_COMPUTED, A_DOWN_DONE, A_COMPUTE_SYNCS, A_JOINS_PENDING,
    A_DEV, A_RESIDENT, A_DOWNLOADED_, A_POOL, A_SHELF, A_WRITTEN, A_STARTS, A_ENDS, A_TAKE_READY, A_LAUNCHES, A_APPEND, A_POISON, N_NAMES
};
static const char *NAME_TEXT[N_NAMES] = {
    "pending_uploads", "installs_unjoined", "joins", "joined_at", "down_saw_joins", "downloads", "down_recorded",
    "down_covered", "dirty", "down_buffers", "launches_unsynced", "launched_at", "copies_wait", "computed_at",
    "n", "marks", "passed", "uploads", "direct_uploads", "_take_slot", "_upload", "ptr", "nbytes", "take",
    "popleft", "_compiled", "empty", "asdevice", "contiguous", "plan", "items", "fetched", "as_they_land", "landed",
    "free", "stream", "copy_stream", "down_stream", "copied", "computed", "down_done", "compute_syncs", "joins_pending",
    "dev", "resident", "_downloaded", "pool", "shelf", "written", "_starts", "_ends", "_take_ready", "launches", "append", "poison",
};
static PyObject *NM[N_NAMES];

int decode_experts_ready(void) {
    for (int i = 0; i < N_NAMES; i++)
        if (!(NM[i] = PyUnicode_InternFromString(NAME_TEXT[i]))) return -1;
    return 0;
}

typedef struct {
    long long end, nbytes, offsets[3], F, D;
    PyObject *nbytes_obj, *layer_obj, *out_shape, *slices[3];
} Layout;

/* a decode step begun (GpuExperts._Begun): what its compute needs */
typedef struct {
    int active, layer;
    PyObject *ids, *held, *early, *slots, *copied, *order, *out, *h;
    DecodeLaunch *dl;
    long long n_first, n_work;
} Begun;

typedef struct {
    PyObject_HEAD
    Calls *calls;
    ResidentMap *resident;
    PyObject *gpu, *side, *dev, *launches, *downloaded, *pool, *shelf, *written, *starts, *ends, *take_ready,
        *compute_syncs, *joins_pending, *free;
    uint64_t stream, copy_stream, down_stream, copied, computed, down_done;
    int n_layer;
    Layout *layouts;
    Begun begun;
    unsigned long long steps_begun, steps_computed; /* decode steps begun here, and computed (the tests' count) */
} DecodeExperts;

/* 0, or -1 with an error set once close() has let go of the books */
static int is_open(DecodeExperts *self) {
    if (self->side) return 0;
    PyErr_SetString(PyExc_RuntimeError, "DecodeExperts: closed");
    return -1;
}

/* -- the books, where Python keeps them ------------------------------------------------------------------ */

static int get_ll(PyObject *o, int name, long long *out) {
    PyObject *v = PyObject_GetAttr(o, NM[name]);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v); /* (a bool is an int) */
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int set_ll(PyObject *o, int name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (!v) return -1;
    int rc = PyObject_SetAttr(o, NM[name], v);
    Py_DECREF(v);
    return rc;
}

static int add_ll(PyObject *o, int name, long long by) {
    long long v;
    return get_ll(o, name, &v) || set_ll(o, name, v + by) ? -1 : 0;
}

static int set_flag(PyObject *o, int name, int value) { return PyObject_SetAttr(o, NM[name], value ? Py_True : Py_False); }

static int get_flag(PyObject *o, int name) {
    PyObject *v = PyObject_GetAttr(o, NM[name]);
    if (!v) return -1;
    int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth;
}

static int syncs(DecodeExperts *self, long long *now) { return get_ll(self->compute_syncs, A_N, now); }

static int ptr_of(PyObject *buf, long long *ptr) { return get_ll(buf, A_PTR, ptr); }

/* the address of a contiguous buffer's first byte (fomoepy.runtime.pinned.contiguous_address), and its size */
static int address_of(PyObject *a, uint64_t *address, uint64_t *nbytes) {
    Py_buffer view;
    if (PyObject_GetBuffer(a, &view, PyBUF_ANY_CONTIGUOUS) < 0) return -1;
    *address = (uint64_t)(uintptr_t)view.buf;
    if (nbytes) *nbytes = (uint64_t)view.len;
    PyBuffer_Release(&view);
    return 0;
}

/* side.free.setdefault(buf.nbytes, []).append(buf) */
static int file_free(DecodeExperts *self, PyObject *buf) {
    PyObject *nbytes = PyObject_GetAttr(buf, NM[A_NBYTES]);
    if (!nbytes) return -1;
    PyObject *stack = PyDict_GetItemWithError(self->free, nbytes);
    if (!stack) {
        if (PyErr_Occurred() || !(stack = PyList_New(0))) goto fail;
        int rc = PyDict_SetItem(self->free, nbytes, stack);
        Py_DECREF(stack); /* (the dict's now) */
        if (rc) goto fail;
    }
    Py_DECREF(nbytes);
    return PyList_Append(stack, buf);
fail:
    Py_DECREF(nbytes);
    return -1;
}

/* DeviceSide.reuse: each slot of an iterable filed free */
static int reuse(DecodeExperts *self, PyObject *slots) {
    PyObject *it = PyObject_GetIter(slots);
    if (!it) return -1;
    PyObject *buf;
    while ((buf = PyIter_Next(it))) {
        int rc = file_free(self, buf);
        Py_DECREF(buf);
        if (rc) break;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* DeviceSide.launched */
static int launched(DecodeExperts *self) {
    long long now;
    return syncs(self, &now) || set_flag(self->side, A_LAUNCHES_UNSYNCED, 1) || set_ll(self->side, A_LAUNCHED_AT, now) ? -1 : 0;
}

/* DeviceSide.record_downloads */
static int record_downloads(DecodeExperts *self) {
    long long downloads, recorded;
    if (get_ll(self->side, A_DOWNLOADS, &downloads) || get_ll(self->side, A_DOWN_RECORDED, &recorded)) return -1;
    if (downloads <= recorded) return 0;
    if (step_call(self->calls, RECORD, self->down_done, self->down_stream, 0, 0)) return -1;
    return set_ll(self->side, A_DOWN_RECORDED, downloads);
}

/* DeviceSide.cover_downloads(upto); upto < 0: None (those recorded) */
static int cover_downloads(DecodeExperts *self, long long upto) {
    long long recorded, covered;
    if (get_ll(self->side, A_DOWN_RECORDED, &recorded) || get_ll(self->side, A_DOWN_COVERED, &covered)) return -1;
    if (upto < 0) upto = recorded;
    if (upto <= covered) return 0;
    if (upto > recorded && (record_downloads(self) || get_ll(self->side, A_DOWN_RECORDED, &recorded))) return -1;
    if (step_call(self->calls, WAIT, self->copy_stream, self->down_done, 0, 0) || set_ll(self->side, A_DOWN_COVERED, recorded))
        return -1;
    covered = recorded;
    PyObject *dirty = PyObject_GetAttr(self->side, NM[A_DIRTY]);
    if (!dirty) return -1;
    int rc = 0;
    if (PyList_Check(dirty) && PyList_GET_SIZE(dirty)) { /* the slots whose copies down are now waited for: free */
        PyObject *kept = PyList_New(0);
        rc = kept ? 0 : -1;
        for (Py_ssize_t i = 0; !rc && i < PyList_GET_SIZE(dirty); i++) {
            PyObject *entry = PyList_GET_ITEM(dirty, i); /* (seq, buf) */
            long long seq = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
            if (seq == -1 && PyErr_Occurred()) rc = -1;
            else rc = seq <= covered ? file_free(self, PyTuple_GET_ITEM(entry, 1)) : PyList_Append(kept, entry);
        }
        if (!rc) rc = PyObject_SetAttr(self->side, NM[A_DIRTY], kept);
        Py_XDECREF(kept);
    }
    Py_DECREF(dirty);
    if (rc) return -1;
    PyObject *held = PyObject_GetAttr(self->side, NM[A_DOWN_BUFFERS]);
    if (!held) return -1;
    if (PyDict_Check(held) && PyDict_GET_SIZE(held)) { /* the buffers those copies wrote: no longer held */
        PyObject *kept = PyDict_New(), *address, *value;
        Py_ssize_t pos = 0;
        rc = kept ? 0 : -1;
        while (!rc && PyDict_Next(held, &pos, &address, &value)) {
            long long seq = PyLong_AsLongLong(PyTuple_GET_ITEM(value, 0));
            if (seq == -1 && PyErr_Occurred()) rc = -1;
            else if (seq > covered) rc = PyDict_SetItem(kept, address, value);
        }
        if (!rc) rc = PyObject_SetAttr(self->side, NM[A_DOWN_BUFFERS], kept);
        Py_XDECREF(kept);
    }
    Py_DECREF(held);
    return rc;
}

/* GpuExperts._tell_pool: the pinned pool learns which of its join marks a wait for the compute stream has
   passed (DeviceSide.joins_passed, PinnedPool.passed_mark) */
static int tell_pool(DecodeExperts *self) {
    Py_ssize_t n = PyObject_Length(self->joins_pending);
    if (n <= 0) return (int)n;
    long long now, passed = 0;
    if (syncs(self, &now)) return -1;
    int any = 0;
    while (n-- > 0) {
        PyObject *first = PySequence_GetItem(self->joins_pending, 0); /* (mark, the sync count then) */
        if (!first) return -1;
        long long mark = PyLong_AsLongLong(PyTuple_GET_ITEM(first, 0)), at = PyLong_AsLongLong(PyTuple_GET_ITEM(first, 1));
        Py_DECREF(first);
        if (PyErr_Occurred()) return -1;
        if (at >= now) break;
        PyObject *r = PyObject_CallMethodNoArgs(self->joins_pending, NM[A_POPLEFT]);
        if (!r) return -1;
        Py_DECREF(r);
        passed = mark, any = 1;
    }
    if (!any) return 0;
    long long was;
    if (get_ll(self->shelf, A_PASSED, &was)) return -1;
    return passed > was ? set_ll(self->shelf, A_PASSED, passed) : 0;
}

/* GpuExperts._join_copies */
static int join_copies(DecodeExperts *self) {
    long long pending, now, marks;
    if (get_ll(self->side, A_PENDING_UPLOADS, &pending)) return -1;
    if (!pending) return 0;
    if (step_call(self->calls, RECORD, self->copied, self->copy_stream, 0, 0) ||
        step_call(self->calls, WAIT, self->stream, self->copied, 0, 0) || set_ll(self->side, A_PENDING_UPLOADS, 0) ||
        set_flag(self->side, A_INSTALLS_UNJOINED, 0) || add_ll(self->side, A_JOINS, 1) || syncs(self, &now) ||
        set_ll(self->side, A_JOINED_AT, now) || tell_pool(self) || get_ll(self->shelf, A_MARKS, &marks) ||
        set_ll(self->shelf, A_MARKS, marks + 1))
        return -1;
    PyObject *point = Py_BuildValue("(LL)", marks + 1, now);
    if (!point) return -1;
    PyObject *r = PyObject_CallMethodOneArg(self->joins_pending, NM[A_APPEND], point);
    Py_DECREF(point);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* DeviceSide.fence_launches */
static int fence_launches(DecodeExperts *self) {
    int unsynced = get_flag(self->side, A_LAUNCHES_UNSYNCED);
    if (unsynced < 0) return -1;
    if (unsynced) {
        long long now, at;
        if (syncs(self, &now) || get_ll(self->side, A_LAUNCHED_AT, &at)) return -1;
        if (now == at && (step_call(self->calls, RECORD, self->computed, self->stream, 0, 0) ||
                          set_flag(self->side, A_COPIES_WAIT, 1) || set_ll(self->side, A_COMPUTED_AT, at)))
            return -1;
    }
    return set_flag(self->side, A_LAUNCHES_UNSYNCED, 0);
}

/* DeviceSide.copies_must_wait: 1, 0, or -1 with an error set */
static int copies_must_wait(DecodeExperts *self) {
    int wait = get_flag(self->side, A_COPIES_WAIT);
    if (wait <= 0) return wait;
    long long now, at;
    if (syncs(self, &now) || get_ll(self->side, A_COMPUTED_AT, &at)) return -1;
    if (now != at) {
        if (set_flag(self->side, A_COPIES_WAIT, 0)) return -1;
        return 0;
    }
    return 1;
}

/* GpuExperts._open_step */
static int open_step(DecodeExperts *self) {
    long long recorded, covered;
    if (fence_launches(self) || get_ll(self->side, A_DOWN_RECORDED, &recorded) || get_ll(self->side, A_DOWN_COVERED, &covered))
        return -1;
    if (recorded > covered && cover_downloads(self, -1)) return -1;
    return join_copies(self);
}

/* GpuExperts._take_slot (a new reference): a free slot of the layer's size here; where there is none (a
   dirty one's copy down to wait for, a spare, a new slot), GpuExperts._take_slot itself */
static PyObject *take_slot(DecodeExperts *self, int layer) {
    Layout *L = &self->layouts[layer];
    PyObject *stack = PyDict_GetItemWithError(self->free, L->nbytes_obj);
    if (!stack && PyErr_Occurred()) return NULL;
    if (!stack || !PyList_GET_SIZE(stack)) return PyObject_CallMethodOneArg(self->gpu, NM[A_TAKE_SLOT], L->layer_obj);
    Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
    PyObject *buf = Py_NewRef(PyList_GET_ITEM(stack, last));
    if (PyList_SetSlice(stack, last, last + 1, NULL)) {
        Py_DECREF(buf);
        return NULL;
    }
    return buf;
}

/* PinnedPool.pins: whether [address, address + nbytes) lies in one of the pool's pinned spans */
static int pins(DecodeExperts *self, uint64_t address, uint64_t nbytes) {
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(self->starts);
    while (lo < hi) { /* bisect_right */
        Py_ssize_t mid = (lo + hi) / 2;
        uint64_t start = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(self->starts, mid));
        if (PyErr_Occurred()) return -1;
        if (address < start) hi = mid;
        else lo = mid + 1;
    }
    if (lo == 0) return 0;
    uint64_t end = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(self->ends, lo - 1));
    if (PyErr_Occurred()) return -1;
    return address + nbytes <= end;
}

/* GpuExperts._upload into `buf`: a copy straight from a pinned read buffer here; any other (staging) by
   GpuExperts._upload itself */
static int upload(DecodeExperts *self, int layer, PyObject *parts, PyObject *buf) {
    Layout *L = &self->layouts[layer];
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) != 3) {
        PyErr_SetString(PyExc_TypeError, "an expert's bytes are a tuple (gate, up, down)");
        return -1;
    }
    uint64_t a[3], n[3];
    for (int i = 0; i < 3; i++)
        if (address_of(PyTuple_GET_ITEM(parts, i), &a[i], &n[i])) return -1;
    int whole = a[1] == a[0] + (uint64_t)L->offsets[1] && a[2] == a[0] + (uint64_t)L->offsets[2];
    int pinned = whole ? pins(self, a[0], (uint64_t)L->end) : 1;
    for (int i = 0; !whole && pinned == 1 && i < 3; i++) pinned = pins(self, a[i], n[i]);
    if (pinned < 0) return -1;
    if (!pinned) {
        PyObject *r = PyObject_CallMethodObjArgs(self->gpu, NM[A_UPLOAD], L->layer_obj, parts, buf, NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    long long pending, ptr;
    if (get_ll(self->side, A_PENDING_UPLOADS, &pending) || ptr_of(buf, &ptr)) return -1;
    if (!pending) {
        int wait = copies_must_wait(self);
        if (wait < 0 || (wait && (step_call(self->calls, WAIT, self->copy_stream, self->computed, 0, 0) ||
                                  set_flag(self->side, A_COPIES_WAIT, 0))))
            return -1;
    }
    PyObject *held = PyObject_GetAttr(self->side, NM[A_DOWN_BUFFERS]);
    if (!held) return -1;
    PyObject *start = PyLong_FromUnsignedLongLong(a[0]);
    PyObject *written = start ? PyDict_GetItemWithError(held, start) : NULL;
    Py_XINCREF(written);
    Py_XDECREF(start);
    Py_DECREF(held);
    if (PyErr_Occurred()) {
        Py_XDECREF(written);
        return -1;
    }
    if (written) { /* a copy down wrote these bytes: not yet waited for by this stream */
        long long seq = PyLong_AsLongLong(PyTuple_GET_ITEM(written, 0));
        Py_DECREF(written);
        if ((seq == -1 && PyErr_Occurred()) || cover_downloads(self, seq)) return -1;
    }
    if (whole) {
        if (step_call(self->calls, HTOD, (uint64_t)ptr, a[0], (uint64_t)L->end, self->copy_stream)) return -1;
    } else {
        for (int i = 0; i < 3; i++)
            if (n[i] && step_call(self->calls, HTOD, (uint64_t)ptr + (uint64_t)L->offsets[i], a[i], n[i], self->copy_stream))
                return -1;
    }
    return add_ll(self->side, A_PENDING_UPLOADS, 1) || add_ll(self->gpu, A_UPLOADS, 1) || add_ll(self->gpu, A_DIRECT_UPLOADS, 1)
               ? -1 : 0;
}

/* GpuExperts._pinned: a buffer of the pinned pool (the shelf's take first, the pool's where it has none) */
static PyObject *pinned_buffer(DecodeExperts *self, long long nbytes) {
    if (tell_pool(self)) return NULL;
    PyObject *size = PyLong_FromLongLong((nbytes + ALIGN - 1) / ALIGN * ALIGN);
    if (!size) return NULL;
    PyObject *buf = PyObject_CallOneArg(self->take_ready, size);
    Py_DECREF(size);
    if (buf != Py_None) return buf;
    Py_DECREF(buf);
    PyObject *n = PyLong_FromLongLong(nbytes);
    if (!n) return NULL;
    buf = PyObject_CallMethodOneArg(self->pool, NM[A_TAKE], n);
    Py_DECREF(n);
    return buf;
}

/* a key's (layer, expert) (ResidentMap's parse), its layer one of this model's */
static int layer_of(DecodeExperts *self, PyObject *key, int *layer, Py_ssize_t *expert) {
    Py_ssize_t v;
    if (resident_key(key, &v, expert)) return -1;
    if (v < 0 || v >= self->n_layer) {
        PyErr_Format(PyExc_IndexError, "layer %zd of %d", v, self->n_layer);
        return -1;
    }
    *layer = (int)v;
    return 0;
}

/* GpuExperts.download */
static PyObject *DecodeExperts_download(DecodeExperts *self, PyObject *key) {
    int layer;
    Py_ssize_t expert;
    if (is_open(self) || layer_of(self, key, &layer, &expert)) return NULL;
    Layout *L = &self->layouts[layer];
    PyObject *out = pinned_buffer(self, L->end), *result = NULL, *number = NULL, *address_obj = NULL, *slot_obj = NULL;
    if (!out) return NULL;
    int unjoined = get_flag(self->side, A_INSTALLS_UNJOINED);
    if (unjoined < 0 || (unjoined && join_copies(self))) goto done;
    long long joins, saw;
    if (get_ll(self->side, A_JOINS, &joins) || get_ll(self->side, A_DOWN_SAW_JOINS, &saw)) goto done;
    if (joins > saw) { /* the copies up joined so far are done before this reads the slot */
        long long now, joined_at;
        if (syncs(self, &now) || get_ll(self->side, A_JOINED_AT, &joined_at)) goto done;
        if (now <= joined_at && step_call(self->calls, WAIT, self->down_stream, self->copied, 0, 0)) goto done;
        if (set_ll(self->side, A_DOWN_SAW_JOINS, joins)) goto done;
    }
    uint64_t address;
    long long slot, downloads;
    PyObject *buf = resident_get(self->resident, layer, expert);
    if (!buf) {
        PyErr_SetObject(PyExc_KeyError, key);
        goto done;
    }
    if (address_of(out, &address, NULL) || ptr_of(buf, &slot) ||
        step_call(self->calls, DTOH, address, (uint64_t)slot, (uint64_t)L->end, self->down_stream) ||
        get_ll(self->side, A_DOWNLOADS, &downloads) || set_ll(self->side, A_DOWNLOADS, downloads + 1))
        goto done;
    number = PyLong_FromLongLong(downloads + 1);
    address_obj = PyLong_FromUnsignedLongLong(address);
    slot_obj = PyLong_FromLongLong(slot);
    if (!number || !address_obj || !slot_obj || PyDict_SetItem(self->written, address_obj, number) ||
        PyDict_SetItem(self->downloaded, slot_obj, number))
        goto done;
    PyObject *held = PyObject_GetAttr(self->side, NM[A_DOWN_BUFFERS]);
    if (!held) goto done;
    PyObject *entry = PyTuple_Pack(2, number, out); /* held (not handed out again) till covered */
    int rc = entry ? PyDict_SetItem(held, address_obj, entry) : -1;
    Py_XDECREF(entry);
    Py_DECREF(held);
    if (rc || add_ll(self->gpu, A_DOWNLOADS, 1)) goto done;
    result = PyTuple_New(3);
    for (int i = 0; result && i < 3; i++) {
        PyObject *part = PyObject_GetItem(out, L->slices[i]);
        if (!part) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, i, part);
    }
done:
    Py_XDECREF(number);
    Py_XDECREF(address_obj);
    Py_XDECREF(slot_obj);
    Py_DECREF(out);
    return result;
}

/* GpuExperts.evict */
static PyObject *DecodeExperts_evict(DecodeExperts *self, PyObject *key) {
    int layer;
    Py_ssize_t expert;
    if (is_open(self) || layer_of(self, key, &layer, &expert)) return NULL;
    PyObject *buf = resident_get(self->resident, layer, expert);
    if (!buf) Py_RETURN_NONE;
    Py_INCREF(buf);
    PyObject *ptr = NULL, *seq_obj = NULL;
    long long seq = 0, covered;
    int rc = resident_set(self->resident, layer, expert, NULL);
    if (!rc) rc = (ptr = PyObject_GetAttr(buf, NM[A_PTR])) ? 0 : -1;
    if (!rc) {
        seq_obj = PyDict_GetItemWithError(self->downloaded, ptr);
        if (seq_obj) {
            Py_INCREF(seq_obj);
            seq = PyLong_AsLongLong(seq_obj);
            rc = (seq == -1 && PyErr_Occurred()) || PyDict_DelItem(self->downloaded, ptr) ? -1 : 0;
        } else if (PyErr_Occurred()) rc = -1;
    }
    if (!rc) rc = get_ll(self->side, A_DOWN_COVERED, &covered);
    if (!rc) {
        if (seq > covered) { /* its copy down may still be reading it: reused once covered */
            PyObject *dirty = PyObject_GetAttr(self->side, NM[A_DIRTY]);
            PyObject *entry = dirty ? PyTuple_Pack(2, seq_obj, buf) : NULL;
            rc = entry ? PyList_Append(dirty, entry) : -1;
            Py_XDECREF(entry);
            Py_XDECREF(dirty);
        } else
            rc = file_free(self, buf);
    }
    Py_XDECREF(seq_obj);
    Py_XDECREF(ptr);
    Py_DECREF(buf);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* -- a decode step: begun before its plan, computed after it ---------------------------------------------- */

static void clear_begun(Begun *b) {
    b->active = 0;
    Py_CLEAR(b->ids);
    Py_CLEAR(b->held);
    Py_CLEAR(b->early);
    Py_CLEAR(b->slots);
    Py_CLEAR(b->copied);
    Py_CLEAR(b->order);
    Py_CLEAR(b->out);
    Py_CLEAR(b->h);
    Py_CLEAR(b->dl);
}

/* GpuExperts._drop_begun: a step begun and never computed; the slots it took are free again */
static int drop_begun(DecodeExperts *self) {
    if (!self->begun.active) return 0;
    PyObject *slots = Py_NewRef(self->begun.slots);
    clear_begun(&self->begun);
    PyObject *values = PyDict_Values(slots);
    int rc = values ? reuse(self, values) : -1;
    Py_XDECREF(values);
    Py_DECREF(slots);
    return rc;
}

static PyObject *DecodeExperts_drop_begun(DecodeExperts *self, PyObject *unused) {
    if (drop_begun(self)) return NULL;
    Py_RETURN_NONE;
}

/* a step's one row of ids (int32 or int64) and weights (float32) as Python lists; 0 where the arrays are not
   [1, k] of those types (the caller's Python path then), -1 with an error set, 1 done */
static int decode_row(PyObject *ids, PyObject *weights, PyObject **row, PyObject **wrow) {
    Py_buffer iv, wv;
    if (PyObject_GetBuffer(ids, &iv, PyBUF_RECORDS_RO) < 0) return -1;
    if (PyObject_GetBuffer(weights, &wv, PyBUF_RECORDS_RO) < 0) {
        PyBuffer_Release(&iv);
        return -1;
    }
    int rc = 0;
    char ik = iv.format ? iv.format[iv.format[0] == '=' || iv.format[0] == '<' || iv.format[0] == '@'] : 'B';
    char wk = wv.format ? wv.format[wv.format[0] == '=' || wv.format[0] == '<' || wv.format[0] == '@'] : 'B';
    int ints = (ik == 'q' || ik == 'l') && iv.itemsize == 8 ? 8 : (ik == 'i' && iv.itemsize == 4) ? 4 : 0;
    if (iv.ndim == 2 && wv.ndim == 2 && iv.shape[0] == 1 && wv.shape[0] == 1 && iv.shape[1] == wv.shape[1] && ints &&
        wk == 'f' && wv.itemsize == 4 && iv.shape[1] <= MAX_K) {
        Py_ssize_t k = iv.shape[1];
        *row = PyList_New(k);
        *wrow = PyList_New(k);
        rc = *row && *wrow ? 1 : -1;
        for (Py_ssize_t j = 0; rc == 1 && j < k; j++) {
            const char *ip = (const char *)iv.buf + j * iv.strides[1], *wp = (const char *)wv.buf + j * wv.strides[1];
            long long e = ints == 8 ? *(const int64_t *)ip : *(const int32_t *)ip;
            PyObject *eo = PyLong_FromLongLong(e), *wo = PyFloat_FromDouble((double)*(const float *)wp);
            if (!eo || !wo) {
                Py_XDECREF(eo);
                Py_XDECREF(wo);
                rc = -1;
                break;
            }
            PyList_SET_ITEM(*row, j, eo);
            PyList_SET_ITEM(*wrow, j, wo);
        }
        if (rc != 1) {
            Py_CLEAR(*row);
            Py_CLEAR(*wrow);
        }
    }
    PyBuffer_Release(&iv);
    PyBuffer_Release(&wv);
    return rc;
}

/* GpuExperts.begin of a decode step whose layer's DecodeLaunch is made: the experts the tier holds launched,
   those at hand copied up, every other one given its slot, the tables up whole */
static PyObject *DecodeExperts_begin(DecodeExperts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "begin(layer, h, ids, weights, at_hand)");
        return NULL;
    }
    if (is_open(self) || drop_begun(self)) return NULL;
    long lv = PyLong_AsLong(args[0]);
    if (lv == -1 && PyErr_Occurred()) return NULL;
    if (lv < 0 || lv >= self->n_layer) {
        PyErr_Format(PyExc_IndexError, "layer %ld of %d", lv, self->n_layer);
        return NULL;
    }
    int layer = (int)lv;
    Layout *L = &self->layouts[layer];
    PyObject *h = args[1], *ids = args[2], *at_hand = args[4];
    if (!PyDict_Check(at_hand)) {
        PyErr_SetString(PyExc_TypeError, "begin: at_hand is a dict");
        return NULL;
    }
    PyObject *compiled = PyObject_GetAttr(self->launches, NM[A_COMPILED]);
    if (!compiled) return NULL;
    PyObject *dl = PyList_Check(compiled) ? PyList_GetItem(compiled, layer) : NULL;
    if (!dl || !PyObject_TypeCheck(dl, &DecodeLaunchType)) { /* not made yet (at the layer's first decode step): Python's */
        Py_DECREF(compiled);
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_INCREF(dl);
    Py_DECREF(compiled);
    PyObject *row = NULL, *wrow = NULL, *held = NULL, *early = NULL, *ptrs = NULL, *slots = NULL, *copied = NULL,
             *hd = NULL, *out = NULL, *order = NULL, *result = NULL;
    int got = decode_row(ids, args[3], &row, &wrow);
    if (got < 0) goto done;
    if (got == 0) { /* not a decode step's [1, k] (a decode step has one row): nothing begun */
        if (PyObject_Length(ids) != 1 || PyErr_Occurred()) {
            PyErr_Clear();
            result = PyFloat_FromDouble(0.0);
        } else
            result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t k = PyList_GET_SIZE(row);
    if (k != ((DecodeLaunch *)dl)->k) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    held = PyList_New(0), early = PyList_New(0), ptrs = PyDict_New();
    if (!held || !early || !ptrs) goto done;
    for (Py_ssize_t j = 0; j < k; j++) { /* (one pass: a decode step's host time is counted in microseconds) */
        PyObject *e = PyList_GET_ITEM(row, j);
        PyObject *buf = resident_get(self->resident, layer, PyLong_AsSsize_t(e));
        if (buf) {
            PyObject *ptr = PyObject_GetAttr(buf, NM[A_PTR]);
            int rc = ptr ? PyList_Append(held, e) || PyDict_SetItem(ptrs, e, ptr) : -1;
            Py_XDECREF(ptr);
            if (rc) goto done;
        } else {
            int in = PyDict_Contains(at_hand, e);
            if (in < 0 || (in && PyList_Append(early, e))) goto done;
        }
    }
    if (!PyList_GET_SIZE(held) && !PyList_GET_SIZE(early)) {
        result = PyFloat_FromDouble(0.0);
        goto done;
    }
    if (open_step(self) || !(slots = PyDict_New()) || !(copied = PyDict_New())) goto done;
    if (PyList_GET_SIZE(held) < k) /* the slots of the experts the tier does not hold */
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *e = PyList_GET_ITEM(row, j);
            int in = PyDict_Contains(ptrs, e);
            if (in < 0) goto done;
            if (in) continue;
            PyObject *buf = take_slot(self, layer), *ptr = buf ? PyObject_GetAttr(buf, NM[A_PTR]) : NULL;
            int rc = ptr ? PyDict_SetItem(slots, e, buf) || PyDict_SetItem(ptrs, e, ptr) : -1;
            Py_XDECREF(ptr);
            Py_XDECREF(buf);
            if (rc) goto done;
        }
    /* the step's arrays (ExpertLaunches.prepare's decode branch) */
    PyObject *dev_h = PyObject_CallMethodOneArg(self->dev, NM[A_ASDEVICE], h);
    hd = dev_h ? PyObject_CallMethodNoArgs(dev_h, NM[A_CONTIGUOUS]) : NULL;
    Py_XDECREF(dev_h);
    if (!hd) goto done;
    /* the decode arrays exist (the layer's DecodeLaunch was made over them): asked for again only where a
       test poisons fresh arrays (decode_scratch's memsets) */
    PyObject *poison = PyObject_GetAttr(self->dev, NM[A_POISON]);
    if (!poison) goto done;
    int poisoned = poison != Py_None;
    Py_DECREF(poison);
    if (poisoned) {
        PyObject *scratch = PyObject_CallMethod(self->side, "decode_scratch", "nLL", k, L->F, L->D);  /* (tests only) */
        if (!scratch) goto done;
        Py_DECREF(scratch);
    }
    out = PyObject_CallMethodOneArg(self->dev, NM[A_EMPTY], L->out_shape);
    if (!out) goto done;
    long long h_ptr, out_ptr;
    int n_first;
    int some_slots = PyDict_GET_SIZE(slots) > 0; /* (a step split: the held first, then those at hand) */
    if (ptr_of(hd, &h_ptr) || ptr_of(out, &out_ptr)) goto done;
    PyObject *none = PyTuple_New(0);
    if (!none) goto done;
    order = decode_tables((DecodeLaunch *)dl, row, wrow, ptrs, some_slots ? held : none, some_slots ? early : none, &n_first);
    Py_DECREF(none);
    if (!order) goto done;
    double launched_at = 0.0;
    if (PyList_GET_SIZE(held)) {
        launched_at = now_seconds();
        if (some_slots ? decode_stages((DecodeLaunch *)dl, 0, n_first, h_ptr) : decode_grouped((DecodeLaunch *)dl, h_ptr, out_ptr))
            goto done;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(early); j++) { /* (after the launch: the compute stream is busy first) */
        PyObject *e = PyList_GET_ITEM(early, j);
        if (launched_at == 0.0) launched_at = now_seconds();
        PyObject *parts = PyDict_GetItemWithError(at_hand, e), *buf = parts ? PyDict_GetItemWithError(slots, e) : NULL;
        if (!buf) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, e);
            goto done;
        }
        if (upload(self, layer, parts, buf) || PyDict_SetItem(copied, e, buf)) goto done;
    }
    Begun *b = &self->begun;
    b->layer = layer, b->n_first = n_first, b->n_work = k;
    b->ids = Py_NewRef(ids), b->held = Py_NewRef(held), b->early = Py_NewRef(early), b->slots = Py_NewRef(slots);
    b->copied = Py_NewRef(copied), b->order = Py_NewRef(order), b->out = Py_NewRef(out), b->h = Py_NewRef(hd);
    b->dl = (DecodeLaunch *)Py_NewRef(dl);
    b->active = 1;
    self->steps_begun++;
    result = PyFloat_FromDouble(launched_at);
done:
    Py_XDECREF(row);
    Py_XDECREF(wrow);
    Py_XDECREF(held);
    Py_XDECREF(early);
    Py_XDECREF(ptrs);
    Py_XDECREF(slots);
    Py_XDECREF(copied);
    Py_XDECREF(hd);
    Py_XDECREF(out);
    Py_XDECREF(order);
    Py_DECREF(dl);
    return result;
}

/* compute's books of the experts still missing from their slots, in the plan's order */
typedef struct {
    Py_ssize_t n, live;
    PyObject *expert[MAX_K]; /* borrowed from the plan's items */
    long long id[MAX_K];
    int to_device[MAX_K], missing[MAX_K];
} Missing;

static int missing_index(Missing *m, PyObject *expert) {
    long long e = PyLong_AsLongLong(expert);
    if (e == -1 && PyErr_Occurred()) return -1;
    for (Py_ssize_t i = 0; i < m->n; i++)
        if (m->missing[i] && m->id[i] == e) return (int)i;
    PyErr_SetObject(PyExc_KeyError, expert);
    return -1;
}

typedef struct {
    DecodeExperts *self;
    Begun *b;
    Missing *m;
    PyObject *temporary; /* slots streamed through, free again after the layer */
    long long launched, h_ptr;
    int split;
} Placing;

/* compute's place(expert, parts): copied up (unless begin did), then in the tier or a temporary */
static int place(Placing *p, PyObject *expert, PyObject *parts) {
    Begun *b = p->b;
    PyObject *buf = PyDict_GetItemWithError(b->slots, expert);
    if (!buf) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, expert);
        return -1;
    }
    int copied = PyDict_Contains(b->copied, expert);
    if (copied < 0 || (!copied && upload(p->self, b->layer, parts, buf))) return -1;
    int i = missing_index(p->m, expert);
    if (i < 0) return -1;
    p->m->missing[i] = 0;
    p->m->live--;
    if (!p->m->to_device[i]) return PyList_Append(p->temporary, buf);
    return resident_set(p->self->resident, b->layer, (Py_ssize_t)p->m->id[i], buf);
}

/* compute's launch_placed: the work items from `launched` up to the first whose expert is still missing */
static int launch_placed(Placing *p) {
    Begun *b = p->b;
    long long stop = p->launched;
    while (stop < b->n_work) {
        long long e = PyLong_AsLongLong(PyList_GET_ITEM(b->order, stop));
        if (e == -1 && PyErr_Occurred()) return -1;
        int still = 0;
        for (Py_ssize_t i = 0; i < p->m->n && !still; i++) still = p->m->missing[i] && p->m->id[i] == e;
        if (still) break;
        stop++;
    }
    if (stop > p->launched) {
        if (join_copies(p->self) || decode_stages(b->dl, p->launched, stop, p->h_ptr)) return -1;
        p->launched = stop;
    }
    return 0;
}

/* the copies up and launches as the step's bytes come: those at hand, then each read as it lands */
static int place_all(Placing *p, PyObject *experts, PyObject *fetched) {
    Begun *b = p->b;
    Py_ssize_t n_at_hand = 0;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(b->early); j++) { /* those at hand at begin that the plan fetched */
        PyObject *e = PyList_GET_ITEM(b->early, j), *parts = PyDict_GetItemWithError(fetched, e);
        if (!parts) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        Py_INCREF(parts);
        int rc = place(p, e, parts);
        Py_DECREF(parts);
        if (rc) return -1;
        n_at_hand++;
    }
    if (p->split && n_at_hand && launch_placed(p)) return -1;
    PyObject *landing = PyObject_CallMethodNoArgs(experts, NM[A_AS_THEY_LAND]);
    if (!landing) return -1;
    PyObject *it = PyObject_GetIter(landing), *pair;
    Py_DECREF(landing);
    if (!it) return -1;
    while ((pair = PyIter_Next(it))) {
        int rc = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 ? place(p, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) : -1;
        if (rc && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "as_they_land yields (expert, parts)");
        Py_DECREF(pair);
        if (rc || (p->split && p->m->live && launch_placed(p))) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return -1;
    if (p->m->live) { /* read by a source with no pool of its own: the bytes come at landed() */
        PyObject *all = PyObject_CallMethodNoArgs(experts, NM[A_LANDED]);
        if (!all) return -1;
        int rc = 0;
        PyObject *order[MAX_K];
        Py_ssize_t n = 0;
        for (Py_ssize_t i = 0; i < p->m->n; i++)
            if (p->m->missing[i]) order[n++] = p->m->expert[i];
        for (Py_ssize_t i = 0; !rc && i < n; i++) {
            PyObject *parts = PyObject_GetItem(all, order[i]);
            rc = parts ? place(p, order[i], parts) : -1;
            Py_XDECREF(parts);
        }
        Py_DECREF(all);
        if (rc) return -1;
    }
    return 0;
}

/* GpuExperts.compute of the step begun here (None: none was, or another step's, dropped) */
static PyObject *DecodeExperts_compute(DecodeExperts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "compute(layer, ids, experts)");
        return NULL;
    }
    if (is_open(self)) return NULL;
    if (!self->begun.active) Py_RETURN_NONE;
    if (self->begun.ids != args[1]) { /* another step's (one that failed after its begin) */
        if (drop_begun(self)) return NULL;
        Py_RETURN_NONE;
    }
    long layer = PyLong_AsLong(args[0]);
    if (layer == -1 && PyErr_Occurred()) return NULL;
    if (layer != self->begun.layer) {
        PyErr_Format(PyExc_RuntimeError, "layer %ld computes the step begun for layer %d", layer, self->begun.layer);
        return NULL;
    }
    Begun b = self->begun; /* (taken: the references are b's now) */
    memset(&self->begun, 0, sizeof(Begun));
    self->steps_computed++;
    PyObject *experts = args[2], *result = NULL, *plan = NULL, *items = NULL, *fetched = NULL;
    Missing m = {0};
    Placing p = {self, &b, &m, NULL, b.n_first, 0, 0};
    if (open_step(self) || ptr_of(b.h, &p.h_ptr)) goto done;
    plan = PyObject_GetAttr(experts, NM[A_PLAN]);
    items = plan ? PyObject_GetAttr(plan, NM[A_ITEMS]) : NULL;
    if (!items) goto done;
    PyObject *seq = PySequence_Fast(items, "a plan's items");
    if (!seq) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) { /* the plan says which slots join the tier */
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *e = PySequence_GetItem(item, 0);
        if (!e) goto bad_item;
        int in = PyDict_Contains(b.slots, e);
        if (in < 0) goto bad_item_e;
        if (in) {
            PyObject *to_device = PySequence_GetItem(item, 3);
            int flag = to_device ? PyObject_IsTrue(to_device) : -1;
            Py_XDECREF(to_device);
            if (flag < 0 || m.n == MAX_K) goto bad_item_e;
            m.expert[m.n] = e;
            m.to_device[m.n] = flag;
            m.missing[m.n] = 1;
            m.id[m.n] = PyLong_AsLongLong(e);
            Py_DECREF(e); /* (the item holds it) */
            if (m.id[m.n] == -1 && PyErr_Occurred()) goto bad_item;
            m.n++;
            m.live++;
            continue;
        }
        Py_ssize_t id = PyLong_AsSsize_t(e);
        if (id == -1 && PyErr_Occurred()) goto bad_item_e;
        if (!resident_get(self->resident, b.layer, id)) {
            PyErr_Format(PyExc_RuntimeError, "layer %d: expert %S was held before the plan, and is not now", b.layer, e);
            goto bad_item_e;
        }
        Py_DECREF(e);
        continue;
    bad_item_e:
        Py_DECREF(e);
    bad_item:
        Py_DECREF(seq);
        goto done;
    }
    Py_DECREF(seq);
    if (m.n != PyDict_GET_SIZE(b.slots)) {
        PyObject *keys = PyDict_Keys(b.slots);
        PyErr_Format(PyExc_RuntimeError, "layer %d: the experts given slots before the plan %R are not all in it", b.layer, keys);
        Py_XDECREF(keys);
        goto done;
    }
    p.split = PyList_GET_SIZE(b.held) && m.n;
    if (!m.n) { /* the whole step was launched by begin */
        PyObject *r = NULL;
        if (launched(self) || record_downloads(self) || !(r = PyObject_CallMethodNoArgs(experts, NM[A_LANDED]))) goto done;
        Py_DECREF(r);
        result = Py_NewRef(b.out);
        goto done;
    }
    fetched = PyObject_GetAttr(experts, NM[A_FETCHED]);
    if (!fetched || !(p.temporary = PyList_New(0))) goto done;
    if (place_all(&p, experts, fetched)) {
        /* the slots no launch reads are free again; a later copy into a slot the launches above read (one
           evicted next) waits for them */
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyObject *left = PyList_New(0);
        int rc = left && !launched(self) ? 0 : -1;
        for (Py_ssize_t i = 0; !rc && i < m.n; i++)
            if (m.missing[i]) rc = PyList_Append(left, PyDict_GetItem(b.slots, m.expert[i]));
        if (!rc) rc = reuse(self, left);
        if (!rc) rc = reuse(self, p.temporary);
        Py_XDECREF(left);
        if (rc) PyErr_Clear(); /* (the first error is the one to report) */
        PyErr_Restore(type, value, trace);
        goto done;
    }
    if (join_copies(self)) goto done;
    long long out_ptr;
    if (ptr_of(b.out, &out_ptr)) goto done;
    if (p.split) {
        if (decode_stages(b.dl, p.launched, b.n_work, p.h_ptr) || decode_combine(b.dl, out_ptr)) goto done;
    } else {
        PyObject *at = PyObject_GetAttr(experts, NM[A_LAUNCHED_AT]);
        double was = at ? PyFloat_AsDouble(at) : -1.0;
        Py_XDECREF(at);
        if (PyErr_Occurred()) goto done;
        if (was == 0.0) { /* (every expert in a slot, or none was: all at once) */
            PyObject *now = PyFloat_FromDouble(now_seconds());
            int rc = now ? PyObject_SetAttr(experts, NM[A_LAUNCHED_AT], now) : -1;
            Py_XDECREF(now);
            if (rc) goto done;
        }
        if (decode_grouped(b.dl, p.h_ptr, out_ptr)) goto done;
    }
    if (launched(self) || (PyList_GET_SIZE(p.temporary) && reuse(self, p.temporary)) || record_downloads(self)) goto done;
    PyObject *r = PyObject_CallMethodNoArgs(experts, NM[A_LANDED]); /* the reads' bookkeeping, after the launches */
    if (!r) goto done;
    Py_DECREF(r);
    result = Py_NewRef(b.out);
done:
    Py_XDECREF(p.temporary);
    Py_XDECREF(fetched);
    Py_XDECREF(items);
    Py_XDECREF(plan);
    clear_begun(&b);
    return result;
}

/* -- the object ------------------------------------------------------------------------------------------ */

static PyObject *attr(PyObject *o, int name) { return PyObject_GetAttr(o, NM[name]); }

static int handle_of(DecodeExperts *self, PyObject *o, int name, uint64_t *out) {
    PyObject *h = attr(o, name);
    if (!h) return -1;
    int rc = handle_u64(self->calls, h, out);
    Py_DECREF(h);
    return rc;
}

static void free_layouts(DecodeExperts *self) {
    for (int i = 0; self->layouts && i < self->n_layer; i++) {
        Layout *L = &self->layouts[i];
        Py_CLEAR(L->nbytes_obj);
        Py_CLEAR(L->layer_obj);
        Py_CLEAR(L->out_shape);
        for (int j = 0; j < 3; j++) Py_CLEAR(L->slices[j]);
    }
    PyMem_Free(self->layouts);
    self->layouts = NULL;
    self->n_layer = 0;
}

static int read_layout(Layout *L, int layer, PyObject *t) {
    PyObject *offsets, *spans;
    if (!PyArg_ParseTuple(t, "LLO!O!LL", &L->end, &L->nbytes, &PyTuple_Type, &offsets, &PyTuple_Type, &spans, &L->F, &L->D))
        return -1;
    if (PyTuple_GET_SIZE(offsets) != 3 || PyTuple_GET_SIZE(spans) != 3) {
        PyErr_SetString(PyExc_ValueError, "a layout has 3 offsets and 3 spans");
        return -1;
    }
    for (int j = 0; j < 3; j++) {
        long long a, b;
        if (as_ll(PyTuple_GET_ITEM(offsets, j), &L->offsets[j]) ||
            !PyArg_ParseTuple(PyTuple_GET_ITEM(spans, j), "LL", &a, &b))
            return -1;
        PyObject *lo = PyLong_FromLongLong(a), *hi = PyLong_FromLongLong(b);
        L->slices[j] = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (!L->slices[j]) return -1;
    }
    L->nbytes_obj = PyLong_FromLongLong(L->nbytes);
    L->layer_obj = PyLong_FromLong(layer);
    L->out_shape = Py_BuildValue("(iL)", 1, L->D);
    return L->nbytes_obj && L->layer_obj && L->out_shape ? 0 : -1;
}

static int DecodeExperts_clear(DecodeExperts *self) {
    clear_begun(&self->begun);
    Py_CLEAR(self->calls);
    Py_CLEAR(self->gpu);
    Py_CLEAR(self->side);
    Py_CLEAR(self->dev);
    Py_CLEAR(self->launches);
    Py_CLEAR(self->resident);
    Py_CLEAR(self->downloaded);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->shelf);
    Py_CLEAR(self->written);
    Py_CLEAR(self->starts);
    Py_CLEAR(self->ends);
    Py_CLEAR(self->take_ready);
    Py_CLEAR(self->compute_syncs);
    Py_CLEAR(self->joins_pending);
    Py_CLEAR(self->free);
    return 0;
}

static int DecodeExperts_init(DecodeExperts *self, PyObject *args, PyObject *kw) {
    PyObject *calls, *gpu, *side, *layouts;
    if (!PyArg_ParseTuple(args, "O!OOO", &CallsType, &calls, &gpu, &side, &layouts)) return -1;
    DecodeExperts_clear(self);
    free_layouts(self);
    self->calls = (Calls *)Py_NewRef(calls);
    self->gpu = Py_NewRef(gpu);
    self->side = Py_NewRef(side);
    if (!(self->dev = attr(side, A_DEV)) || !(self->launches = attr(gpu, A_LAUNCHES)) ||
        !(self->resident = (ResidentMap *)attr(gpu, A_RESIDENT)) ||
        !(self->downloaded = attr(gpu, A_DOWNLOADED_)) || !(self->pool = attr(gpu, A_POOL)) ||
        !(self->shelf = attr(self->pool, A_SHELF)) || !(self->written = attr(self->pool, A_WRITTEN)) ||
        !(self->starts = attr(self->pool, A_STARTS)) || !(self->ends = attr(self->pool, A_ENDS)) ||
        !(self->take_ready = attr(gpu, A_TAKE_READY)) || !(self->compute_syncs = attr(side, A_COMPUTE_SYNCS)) ||
        !(self->joins_pending = attr(side, A_JOINS_PENDING)) || !(self->free = attr(side, A_FREE)))
        return -1;
    if (!PyObject_TypeCheck((PyObject *)self->resident, &ResidentMapType) || !PyDict_Check(self->downloaded) || !PyDict_Check(self->written) ||
        !PyList_Check(self->starts) || !PyList_Check(self->ends) || !PyDict_Check(self->free)) {
        PyErr_SetString(PyExc_TypeError, "DecodeExperts: GpuExperts's books are a ResidentMap, dicts and lists");
        return -1;
    }
    if (handle_of(self, self->dev, A_STREAM, &self->stream) || handle_of(self, self->dev, A_COPY_STREAM, &self->copy_stream) ||
        handle_of(self, self->dev, A_DOWN_STREAM, &self->down_stream) || handle_of(self, side, A_COPIED, &self->copied) ||
        handle_of(self, side, A_COMPUTED, &self->computed) || handle_of(self, side, A_DOWN_DONE, &self->down_done))
        return -1;
    PyObject *seq = PySequence_Fast(layouts, "DecodeExperts: layouts is a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    self->layouts = PyMem_Calloc(n ? n : 1, sizeof(Layout));
    if (!self->layouts) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    self->n_layer = (int)n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (read_layout(&self->layouts[i], (int)i, PySequence_Fast_GET_ITEM(seq, i))) {
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    return 0;
}

static int DecodeExperts_traverse(DecodeExperts *self, visitproc visit, void *arg) {
    Begun *b = &self->begun;
    Py_VISIT(b->ids);
    Py_VISIT(b->held);
    Py_VISIT(b->early);
    Py_VISIT(b->slots);
    Py_VISIT(b->copied);
    Py_VISIT(b->order);
    Py_VISIT(b->out);
    Py_VISIT(b->h);
    Py_VISIT(b->dl);
    Py_VISIT(self->calls);
    Py_VISIT(self->gpu);
    Py_VISIT(self->side);
    Py_VISIT(self->dev);
    Py_VISIT(self->launches);
    Py_VISIT(self->resident);
    Py_VISIT(self->downloaded);
    Py_VISIT(self->pool);
    Py_VISIT(self->shelf);
    Py_VISIT(self->written);
    Py_VISIT(self->starts);
    Py_VISIT(self->ends);
    Py_VISIT(self->take_ready);
    Py_VISIT(self->compute_syncs);
    Py_VISIT(self->joins_pending);
    Py_VISIT(self->free);
    return 0;
}

static void DecodeExperts_dealloc(DecodeExperts *self) {
    PyObject_GC_UnTrack(self);
    DecodeExperts_clear(self);
    free_layouts(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* pinned(nbytes): GpuExperts._pinned (a read's buffer) */
static PyObject *DecodeExperts_pinned(DecodeExperts *self, PyObject *arg) {
    long long nbytes = PyLong_AsLongLong(arg);
    if ((nbytes == -1 && PyErr_Occurred()) || is_open(self)) return NULL;
    return pinned_buffer(self, nbytes);
}

/* close(): the step begun, if any, forgotten (GpuExperts.close frees every slot), and every reference let go */
static PyObject *DecodeExperts_close(DecodeExperts *self, PyObject *unused) {
    DecodeExperts_clear(self);
    Py_RETURN_NONE;
}

static PyMethodDef DecodeExperts_methods[] = {
    {"begin", (PyCFunction)(void (*)(void))DecodeExperts_begin, METH_FASTCALL,
     "begin(layer, h, ids, weights, at_hand) -> the time of the first launch or copy (0.0: none), or None: not here"},
    {"compute", (PyCFunction)(void (*)(void))DecodeExperts_compute, METH_FASTCALL,
     "compute(layer, ids, experts) -> the step's output, or None: no step of these ids was begun here"},
    {"download", (PyCFunction)DecodeExperts_download, METH_O, "download(key) -> (gate, up, down): a copy down, into pinned memory"},
    {"evict", (PyCFunction)DecodeExperts_evict, METH_O, "evict(key): the expert's slot free (or dirty, while a copy down reads it)"},
    {"pinned", (PyCFunction)DecodeExperts_pinned, METH_O, "pinned(nbytes) -> a buffer of the pinned pool (GpuExperts._pinned)"},
    {"drop_begun", (PyCFunction)DecodeExperts_drop_begun, METH_NOARGS, "drop_begun(): a step begun and not computed; its slots free"},
    {"close", (PyCFunction)DecodeExperts_close, METH_NOARGS, "close(): let every reference go"},
    {NULL},
};

static PyObject *DecodeExperts_begun(DecodeExperts *self, void *unused) { return PyBool_FromLong(self->begun.active); }

static PyGetSetDef DecodeExperts_getset[] = {
    {"begun", (getter)DecodeExperts_begun, NULL, "whether a step was begun here and not yet computed", NULL},
    {NULL},
};

static PyMemberDef DecodeExperts_members[] = {
    {"steps_begun", T_ULONGLONG, offsetof(DecodeExperts, steps_begun), READONLY, "decode steps begun here"},
    {"steps_computed", T_ULONGLONG, offsetof(DecodeExperts, steps_computed), READONLY, "of them, computed here"},
    {NULL},
};

PyTypeObject DecodeExpertsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fomoepy.runtime._driver_calls.DecodeExperts",
    .tp_basicsize = sizeof(DecodeExperts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "GpuExperts's begin, compute, download and evict on one device, each in one C call.",
    .tp_traverse = (traverseproc)DecodeExperts_traverse,
    .tp_clear = (inquiry)DecodeExperts_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DecodeExperts_init,
    .tp_dealloc = (destructor)DecodeExperts_dealloc,
    .tp_methods = DecodeExperts_methods,
    .tp_getset = DecodeExperts_getset,
    .tp_members = DecodeExperts_members,
};
