/* What the files of the _driver_calls extension share: the driver calls' kinds and the binding's C
   signatures (_driver_calls.c), the Calls, Launcher and DecodeLaunch objects, and the routines a compiled
   step makes its calls and launches with. _decode_experts.c's DecodeExperts makes a decode step's device
   work through them. */

#ifndef FOMOE_DRIVER_CALLS_H
#define FOMOE_DRIVER_CALLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_K 64 /* choices per token (as _moe_pack.h) */

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

#define HANDLES_KEPT 256 /* handle objects whose integers are remembered (streams, events: a few dozen) */

typedef struct {
    PyObject_HEAD
    void *fn[N_CALLS];
    PyObject *capsules; /* kept alive: the functions live in the modules that exported them */
    /* the shim whose device a call makes current (through `current`, DriverShim's record of each thread's)
       and whose _failed(name, status) raises a failed call's error, with `names` the driver's names of the
       calls; `address` turns a binding's handle object into its integer, remembered per object */
    PyObject *shim, *current, *address, *names;
    PyObject *handle_obj[HANDLES_KEPT];
    uint64_t handle_raw[HANDLES_KEPT];
    int n_handles;
    /* the calls a compiled step makes itself (DecodeLaunch's tables copy, DecodeRoute's read-back): counted
       and timed by kind while `timed` is set (bench/host_time.py's count of binding calls; the calls made
       through the methods below are counted by whoever calls them) */
    int timed;
    unsigned long long made[N_CALLS];
    double made_seconds[N_CALLS];
    /* a list each call made through this Calls is appended to, as (name, argument, ...), integers (a launch:
       its function, grid x y z, block, shared bytes, stream, then its packed arguments. slots); None: not
       kept (tests/test_decode_experts.py compares two paths' calls with it) */
    PyObject *log;
} Calls;

#define MAX_ARGS 24

typedef struct {
    PyObject_HEAD
    Calls *calls; /* whose launch function, shim and names this uses (kept alive) */
    void *function, *stream;
    int n_args;
    char codes[MAX_ARGS];
    uint64_t slots[MAX_ARGS];
    void *params[MAX_ARGS];
    int timed;
    unsigned long long count;
    double seconds;
} Launcher;

typedef struct {
    PyObject_HEAD
    Launcher *gate_up, *down, *down_sum, *combine;
    uint64_t tables, act, part;
    PyObject *offsets; /* (gate, up, down) in a slot: a tuple, as the packer takes it */
    long long F, D, k, gate_row, down_row;
    PyObject *keepalive;
} DecodeLaunch;

#define WORK_BYTES 64 /* sizeof(Work), _moe_pack.h's */
#define PAIR_BYTES 16

/* the device tier's slots by (layer, expert): per layer an array indexed by expert (_resident_map.c) */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n_layer, len;
    PyObject ***slot; /* [layer][expert]: the slot's DeviceBuffer, or NULL */
    Py_ssize_t *cap;  /* [layer]: its array's length */
} ResidentMap;

/* a key's (layer, expert), parsed: 0, or -1 with an error set (not a pair of ints) */
int resident_key(PyObject *key, Py_ssize_t *layer, Py_ssize_t *expert);
/* a slot held (borrowed), or NULL; and set (value: a new reference taken; NULL clears): 0, or -1 with an error */
PyObject *resident_get(ResidentMap *m, Py_ssize_t layer, Py_ssize_t expert);
int resident_set(ResidentMap *m, Py_ssize_t layer, Py_ssize_t expert, PyObject *value);

extern PyTypeObject CallsType, LauncherType, DecodeLaunchType, DecodeExpertsType, ResidentMapType;

double now_seconds(void);
int as_u64(PyObject *o, uint64_t *out);
int as_ll(PyObject *o, long long *out);
int handle_u64(Calls *self, PyObject *o, uint64_t *out);
/* a call a compiled step makes itself, counted while its Calls is timed; 0, or -1 with the call's error set */
int step_call(Calls *calls, int which, uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3);
/* the call's entry in calls->log, where one is kept: 0, or -1 with an error set */
int log_call(Calls *calls, const char *name, const uint64_t *a, int n);

/* DecodeLaunch's calls from C (its methods' bodies): the tables packed and copied up (the experts in table
   order, a new list, or NULL), the stages over work items [start, stop), the combine, the grouped launch;
   0, or -1 with an error set */
PyObject *decode_tables(DecodeLaunch *dl, PyObject *row, PyObject *weights, PyObject *slot_ptr, PyObject *first,
                        PyObject *then, int *n_first);
int decode_stages(DecodeLaunch *dl, long long start, long long stop, long long h);
int decode_combine(DecodeLaunch *dl, long long out);
int decode_grouped(DecodeLaunch *dl, long long h, long long out);

int decode_experts_ready(void); /* _decode_experts.c's names interned: 0, or -1 with an error set */

#endif
