// sim_shared.h: a block's shared memory on the simulated device, and the race detector over it.
// Included by sim_device.h (after the fibers and fail()); not a header of its own.
//
// Shared memory is one arena per host thread and module, a 64 KiB slice of a region the module maps
// once (RDNA's LDS per workgroup, and the most a CUDA block may use):
//
//     | dynamic shared (the launch's bytes) | static arrays (SHARED(...)), placed as first reached |
//
// Every byte of it is NaN (0x7fc00000 per word) at the start of each block, so a read before a write
// shows, and nothing carries over from the block before.
//
// The race detector (FOMOE_SIM_RACECHECK) is compute-sanitizer's racecheck: the module is compiled
// with the compiler's thread-sanitizer instrumentation, which calls __tsan_read4(addr) and friends
// before every load and store; this file defines those calls (no sanitizer runtime is linked). An
// access outside the region returns at once; one inside is recorded per byte against the current
// barrier interval (one epoch, advanced by every completed __syncthreads and at each block start):
//   a write to a byte another thread read or wrote in the same interval, or a read of a byte another
//   thread wrote in it, is a race: the launch fails naming the kernel, block, address and both threads.
// Only __syncthreads() orders shared memory here: a shuffle orders nothing (on Volta and later, and
// with RDNA's LDS queue, lanes of one warp may reach a shared access apart).
#pragma once

#include <sched.h>

#include <vector>

namespace fomoe_sim {

constexpr unsigned SHARED_LIMIT = 64 * 1024;
constexpr unsigned MAX_ARENAS = 1024;  // host threads running this module's blocks at once
constexpr uint32_t NAN_BITS = 0x7fc00000u;
constexpr uint16_t NOBODY = 0xffff;

// what the detector knows of one byte: the interval and thread of its last write, and up to two
// distinct threads that read it in the current interval (enough to name a reader other than anyone)
struct Cell {
    uint32_t write_epoch, read_epoch;
    uint16_t writer, reader1, reader2, unused;
};

struct SharedVar {
    const void* key;  // the declaration (a static object per SHARED(...) site)
    unsigned offset, size;
    const char* name;
};

struct Arena {
    unsigned char* base = nullptr;  // SHARED_LIMIT bytes in the module's region
    int index = -1;
    unsigned dynamic = 0, top = 0;  // [0, dynamic): the launch's dynamic memory; [dynamic, top): statics
    SharedVar vars[32];
    int n_vars = 0;
    std::vector<Cell> cells;  // race detector: one per byte of [0, top)
    uint32_t epoch = 0;
    ~Arena();
};

// The region, mapped once per module; its bounds are plain globals, so the detector's test of an
// address (most are device memory, not shared) needs no thread-local lookup. Everything here is
// plain data without destructors: the driver's stream threads end (and hand their slices back) at
// exit, after the module's own static objects would have been destroyed.
inline unsigned char* region_base = nullptr;
inline uintptr_t region_bytes = 0;
inline int region_lock = 0;
inline int free_arenas[MAX_ARENAS];
inline int n_free_arenas = 0, arenas_handed = 0;

struct RegionLock {
    FOMOE_SIM_UNCHECKED RegionLock() {
        while (__atomic_exchange_n(&region_lock, 1, __ATOMIC_ACQUIRE)) sched_yield();
    }
    FOMOE_SIM_UNCHECKED ~RegionLock() { __atomic_store_n(&region_lock, 0, __ATOMIC_RELEASE); }
};

inline thread_local Arena arena;

FOMOE_SIM_UNCHECKED inline bool claim_arena(Arena& a) {
    RegionLock g;
    if (!region_base) {
        void* p = mmap(nullptr, (size_t)MAX_ARENAS * SHARED_LIMIT, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return false;
        region_base = (unsigned char*)p;
        __atomic_store_n(&region_bytes, (uintptr_t)MAX_ARENAS * SHARED_LIMIT, __ATOMIC_RELEASE);
    }
    if (n_free_arenas) {
        a.index = free_arenas[--n_free_arenas];
    } else if (arenas_handed < (int)MAX_ARENAS) {
        a.index = arenas_handed++;
    } else {
        return false;
    }
    a.base = region_base + (size_t)a.index * SHARED_LIMIT;
    return true;
}

FOMOE_SIM_UNCHECKED inline Arena::~Arena() {  // a host thread that ends hands its slice to the next one
    if (index < 0) return;
    RegionLock g;
    free_arenas[n_free_arenas++] = index;
}

FOMOE_SIM_UNCHECKED inline void poison(unsigned char* p, unsigned n) {
    for (unsigned i = 0; i + 4 <= n; i += 4) memcpy(p + i, &NAN_BITS, 4);
}

FOMOE_SIM_UNCHECKED inline void grow_cells(Arena& a) {
#ifdef FOMOE_SIM_RACECHECK
    if (a.cells.size() < a.top) a.cells.resize(a.top, Cell{0, 0, NOBODY, NOBODY, NOBODY, 0});
#endif
}

// A new barrier interval: every earlier access is ordered before every later one.
FOMOE_SIM_UNCHECKED inline void next_interval(Arena& a) {
#ifdef FOMOE_SIM_RACECHECK
    if (++a.epoch == 0) {  // 2^32 intervals on this thread: forget them all and start again
        for (Cell& c : a.cells) c = Cell{0, 0, NOBODY, NOBODY, NOBODY, 0};
        a.epoch = 1;
    }
#endif
}

// A launch: false (and a message) when its shared memory does not fit.
FOMOE_SIM_UNCHECKED inline bool begin_launch(unsigned dynamic, char* message, unsigned len, const char* kernel) {
    Arena& a = arena;
    if (a.index < 0 && !claim_arena(a)) {
        snprintf(message, len, "kernel %s: no shared-memory arena for this host thread (more than %u threads run blocks)", kernel, MAX_ARENAS);
        return false;
    }
    if (dynamic > SHARED_LIMIT) {
        snprintf(message, len, "kernel %s: %u bytes of dynamic shared memory (at most %u)", kernel, dynamic, SHARED_LIMIT);
        return false;
    }
    a.dynamic = a.top = (dynamic + 15) & ~15u;
    a.n_vars = 0;
    grow_cells(a);
    return true;
}

// A block starts: all of its shared memory NaN, no access recorded.
FOMOE_SIM_UNCHECKED inline void begin_block() {
    Arena& a = arena;
    poison(a.base, a.top);
    next_interval(a);
}

// The storage of one static SHARED(...) array: placed when a launch first reaches its declaration,
// the same place for every block of the launch.

FOMOE_SIM_UNCHECKED inline void* shared_static(const void* key, unsigned size, unsigned align, const char* name) {
    Arena& a = arena;
    for (int i = 0; i < a.n_vars; i++)
        if (a.vars[i].key == key) return a.base + a.vars[i].offset;
    const unsigned offset = (a.top + align - 1) & ~(align - 1);
    if (offset + size > SHARED_LIMIT || a.n_vars == (int)(sizeof a.vars / sizeof a.vars[0]))
        fail("static shared arrays of %d bytes past %d bytes of dynamic shared memory exceed 64 KiB (or 32 arrays)",
             (int)(offset + size - a.dynamic), (int)a.dynamic, 0);
    a.vars[a.n_vars++] = SharedVar{key, offset, size, name};
    poison(a.base + offset, size);
    a.top = offset + size;
    grow_cells(a);
    return a.base + offset;
}

}  // namespace fomoe_sim

// The sim's spelling of a static shared array (compat.h gives GPUs `__shared__ T name dims`): a
// reference to the array's place in the arena. The key is one static byte per declaration.
#define FOMOE_SIM_SHARED(T, name, dims)                  \
    static const char fomoe_sim_key_##name = 0;          \
    T(&name) dims = *reinterpret_cast<T(*) dims>(::fomoe_sim::shared_static(&fomoe_sim_key_##name, sizeof(T dims), alignof(T), #name))

#ifdef FOMOE_SIM_RACECHECK
namespace fomoe_sim {

// "scratch + 4" or "dynamic shared memory + 1020": the byte at `offset` of the arena, by its array
FOMOE_SIM_UNCHECKED inline void describe_byte(const Arena& a, unsigned offset, char* out, size_t len) {
    for (int i = 0; i < a.n_vars; i++)
        if (offset >= a.vars[i].offset && offset < a.vars[i].offset + a.vars[i].size) {
            snprintf(out, len, "%s + %u", a.vars[i].name, offset - a.vars[i].offset);
            return;
        }
    snprintf(out, len, "dynamic shared memory + %u", offset);
}

[[noreturn]] FOMOE_SIM_UNCHECKED inline void race(const Arena& a, unsigned offset, bool write, int other, bool other_wrote) {
    char where[128], what[400];
    describe_byte(a, offset, where, sizeof where);
    snprintf(what, sizeof what,
             "shared-memory race at shared address 0x%x (%s): thread %d %s it and thread %d %s it in the same barrier "
             "interval (no __syncthreads() between them)",
             offset, where, current->linear, write ? "writes" : "reads", other, other_wrote ? "wrote" : "read");
    fail_with(what);
}

FOMOE_SIM_UNCHECKED inline void record(uintptr_t addr, unsigned n, bool write) {
    Arena& a = arena;
    Fiber* f = current;
    if (!f || !block) return;  // not inside a block (the scheduler's own poisoning)
    const uintptr_t offset = addr - (uintptr_t)a.base;
    if (addr < (uintptr_t)a.base || offset + n > a.top)
        fail_with("a shared-memory access outside this block's shared memory (another block's, or past the arrays)");
    const uint16_t me = (uint16_t)f->linear;
    const uint32_t e = a.epoch;
    for (unsigned i = 0; i < n; i++) {
        Cell& c = a.cells[offset + i];
        if (c.write_epoch == e && c.writer != me) race(a, (unsigned)(offset + i), write, c.writer, true);
        if (write) {
            if (c.read_epoch == e) {
                const uint16_t other = c.reader1 != me ? c.reader1 : c.reader2;
                if (other != NOBODY) race(a, (unsigned)(offset + i), true, other, false);
            }
            c.write_epoch = e;
            c.writer = me;
        } else if (c.read_epoch != e) {
            c.read_epoch = e;
            c.reader1 = me;
            c.reader2 = NOBODY;
        } else if (c.reader1 != me && c.reader2 == NOBODY) {
            c.reader2 = me;
        }
    }
}

__attribute__((always_inline, no_sanitize("thread"))) inline void access(const void* p, unsigned n, bool write) {
    const uintptr_t bytes = __atomic_load_n(&region_bytes, __ATOMIC_ACQUIRE);  // 0 until region_base is set
    if ((uintptr_t)p - (uintptr_t)region_base < bytes) record((uintptr_t)p, n, write);
}

}  // namespace fomoe_sim

// The instrumentation's calls (GCC's and Clang's -fsanitize=thread name them alike).
#define FOMOE_SIM_TSAN_ACCESS(n)                                                                                                      \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_read##n(void* p) { ::fomoe_sim::access(p, n, false); }                                       \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_write##n(void* p) { ::fomoe_sim::access(p, n, true); }                                       \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_unaligned_read##n(void* p) { ::fomoe_sim::access(p, n, false); }                             \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_unaligned_write##n(void* p) { ::fomoe_sim::access(p, n, true); }                             \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_volatile_read##n(void* p) { ::fomoe_sim::access(p, n, false); }                              \
    FOMOE_SIM_EXPORT_HIDDEN void __tsan_volatile_write##n(void* p) { ::fomoe_sim::access(p, n, true); }
#define FOMOE_SIM_EXPORT_HIDDEN extern "C" __attribute__((visibility("hidden"), no_sanitize("thread")))
FOMOE_SIM_TSAN_ACCESS(1)
FOMOE_SIM_TSAN_ACCESS(2)
FOMOE_SIM_TSAN_ACCESS(4)
FOMOE_SIM_TSAN_ACCESS(8)
FOMOE_SIM_TSAN_ACCESS(16)
FOMOE_SIM_EXPORT_HIDDEN void __tsan_read_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; i += 16) ::fomoe_sim::access((char*)p + i, n - i < 16 ? (unsigned)(n - i) : 16, false);
}
FOMOE_SIM_EXPORT_HIDDEN void __tsan_write_range(void* p, unsigned long n) {
    for (unsigned long i = 0; i < n; i += 16) ::fomoe_sim::access((char*)p + i, n - i < 16 ? (unsigned)(n - i) : 16, true);
}
FOMOE_SIM_EXPORT_HIDDEN void __tsan_init() {}
FOMOE_SIM_EXPORT_HIDDEN void __tsan_func_entry(void*) {}
FOMOE_SIM_EXPORT_HIDDEN void __tsan_func_exit() {}
// atomics (the kernels' atomicOr / atomicAdd on global error flags): done, not recorded
FOMOE_SIM_EXPORT_HIDDEN int __tsan_atomic32_fetch_or(volatile int* p, int v, int) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN int __tsan_atomic32_fetch_add(volatile int* p, int v, int) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN int __tsan_atomic32_load(const volatile int* p, int) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN void __tsan_atomic32_store(volatile int* p, int v, int) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN long __tsan_atomic64_load(const volatile long* p, int) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN void __tsan_atomic64_store(volatile long* p, long v, int) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
FOMOE_SIM_EXPORT_HIDDEN void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif
