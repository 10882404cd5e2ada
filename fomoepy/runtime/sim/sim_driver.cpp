// sim_driver.cpp: the simulated device's driver: memory, streams, events, modules and launches, with
// the calls of a GPU driver API (fomoepy/runtime/shim_sim.py calls it through ctypes).
//
// Device memory is host memory: a device pointer is the address of a host allocation, so a kernel
// module built by the host compiler (sim_device.h) reads it directly. What a device would refuse is
// refused here: a copy outside an allocation, a launch whose pointer argument is not memory of the
// launching device, a block larger than the kernel's launch bound.
//
// Streams and events are sim_streams.h's. In deferred mode (there), freeing memory runs no stream
// either: the block is kept until the work queued before the free has run, where a driver's free
// would drain the device.
//
// In null mode (sim_set_null, for measuring the host's own time through the real bindings) the device
// does no work: device memory is address space only (reserved, never backed), copies, memsets and
// launches are checked as always and then complete at once (a read-back leaves the host bytes as they
// were; pinned host memory is demand-zero pages), and events are ready at once. Its timed variant
// (sim_set_timing, sim_timing.h) gives copies and launches the time stated rates give them.
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// sim_device.h's structs, as the driver sees them (kept in step by the module's own entry)
struct Launch {
    unsigned grid[3], block[3];
    unsigned shared;
    char* error;
    unsigned error_len;
    unsigned block_begin, block_end;
    unsigned order_seed;
};
constexpr int MAX_PARAMS = 24;
struct KernelInfo {
    const char* name;
    int max_threads;
    int n_params;
    int param_size[MAX_PARAMS];
    int param_align[MAX_PARAMS];
    int param_is_pointer[MAX_PARAMS];
    int (*run)(const Launch*, void* const* params);
};

enum Status : int {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    LAUNCH_FAILED = 719,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    NOT_SUPPORTED = 801,
};

thread_local std::string last_error;

int fail(int status, const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    last_error = buf;
    return status;
}

// -- memory ------------------------------------------------------------------------------------------
enum Kind { DEVICE, HOST };
struct Allocation {
    size_t size;
    int device;  // -1 for host memory
    Kind kind;
};

struct Config {
    int n_devices = 2;
    size_t memory_per_device = size_t(16) << 30;
    bool deferred = false;
    unsigned order_seed = 0;  // the warp order of every block (sim_device.h); 0: index order
    bool null_device = false;  // sim_set_null: nothing runs, memory is address space only
};

// Null mode's device memory: one reservation of address space, handed out in order and never reused
// (a bench allocates far less than this over its life; nothing is ever backed by memory).
const size_t NULL_ARENA_BYTES = size_t(1) << 42;
char* null_arena = nullptr;
size_t null_arena_used = 0;

std::mutex memory_mutex;
std::map<uintptr_t, Allocation> allocations;
std::vector<size_t> used;  // bytes allocated per device
Config config;

// the allocation containing [p, p + n), or null
const Allocation* find(uintptr_t p, size_t n, uintptr_t* base = nullptr) {
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return nullptr;
    --it;
    if (p + n > it->first + it->second.size) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

struct Module {
    void* handle;
    const KernelInfo* kernels;
    int n_kernels;
    int device;
};

}  // namespace

#include "sim_streams.h"
#include "sim_timing.h"

// -- the API -------------------------------------------------------------------------------------------
EXPORT const char* sim_last_error() { return last_error.c_str(); }

EXPORT int sim_configure(int n_devices, unsigned long long memory_per_device, int deferred) {
    std::lock_guard<std::mutex> g(memory_mutex);
    if (n_devices < 1 || n_devices > 16) return fail(INVALID_VALUE, "the simulator has 1 to 16 devices, not %d", n_devices);
    for (size_t d = 0; d < used.size(); d++)
        if (used[d] && (int)d >= n_devices) return fail(INVALID_VALUE, "device %zu still holds memory", d);
    config.n_devices = n_devices;
    config.memory_per_device = memory_per_device;
    config.deferred = deferred != 0;
    used.resize(n_devices, 0);
    return OK;
}

// The warp order of the launches submitted from now on: 0 runs each block's warps in index order,
// any other seed in an order drawn from it, the block's index and the barrier (sim_device.h).
EXPORT int sim_set_order_seed(unsigned seed) {
    config.order_seed = seed;
    return OK;
}

EXPORT int sim_set_null(int on) {
    std::lock_guard<std::mutex> g(memory_mutex);
    for (auto& [p, a] : allocations)
        if (a.kind == DEVICE) return fail(INVALID_VALUE, "null mode is set before any device memory is allocated");
    if (on && config.deferred) return fail(INVALID_VALUE, "null mode and deferred streams do not mix");
    config.null_device = on != 0;
    return OK;
}

// Timed null mode (sim_timing.h): kernels read at `kernel_bandwidth`, copies cross at `link_bandwidth`
// (bytes per second), and synchronisations wait for the device's time. 0, 0: untimed.
EXPORT int sim_set_timing(double kernel_bandwidth, double link_bandwidth) {
    if (!config.null_device) return fail(INVALID_VALUE, "timing is a mode of the null device: set null mode first");
    if (kernel_bandwidth < 0 || link_bandwidth < 0 || (kernel_bandwidth > 0) != (link_bandwidth > 0))
        return fail(INVALID_VALUE, "timed null mode needs both rates > 0 (or both 0 to turn it off), got %g and %g",
                    kernel_bandwidth, link_bandwidth);
    std::lock_guard<std::mutex> g(timing.m);
    timing.on = kernel_bandwidth > 0;
    timing.kernel_bandwidth = kernel_bandwidth;
    timing.link_bandwidth = link_bandwidth;
    return OK;
}

// Nanoseconds the host has spent waiting for the timed device in synchronisations, so far.
EXPORT long long sim_timed_waited_ns() { return timing.waited_ns.load(); }
// Of that, nanoseconds past the time the device was done: the emulation's own error.
EXPORT long long sim_timed_late_ns() { return timing.late_ns.load(); }

EXPORT int sim_device_count(int* n) {
    *n = config.n_devices;
    return OK;
}

EXPORT int sim_mem_info(int device, size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(memory_mutex);
    if (!valid_device(device)) return fail(INVALID_DEVICE, "no simulated device %d", device);
    used.resize(config.n_devices, 0);
    *total = config.memory_per_device;
    *free_bytes = config.memory_per_device - used[device];
    return OK;
}

namespace {

// Deferred mode: freed blocks that queued work may still use, with where each stream of their device
// had got to; a block goes back to the host once every such stream has run past that point.
struct Freed {
    void* p;
    std::vector<std::pair<Stream*, uint64_t>> until;
};
std::vector<Freed> freed;  // under memory_mutex

void reclaim_freed() {  // with memory_mutex held
    for (size_t i = 0; i < freed.size();) {
        bool done = true;
        for (auto& [s, position] : freed[i].until) {
            std::lock_guard<std::mutex> g(s->m);
            done = done && s->completed >= position;
        }
        if (done) {
            free(freed[i].p);
            freed[i] = std::move(freed.back());
            freed.pop_back();
        } else {
            ++i;
        }
    }
}

}  // namespace

static int allocate(int device, Kind kind, void** out, size_t n) {
    std::lock_guard<std::mutex> g(memory_mutex);
    reclaim_freed();
    used.resize(config.n_devices, 0);
    if (kind == DEVICE) {
        if (!valid_device(device)) return fail(INVALID_DEVICE, "no simulated device %d", device);
        if (used[device] + n > config.memory_per_device)
            return fail(OUT_OF_MEMORY, "out of memory on simulated device %d: %zu bytes asked, %zu of %zu free", device, n,
                        config.memory_per_device - used[device], config.memory_per_device);
    }
    void* p = nullptr;
    if (kind == DEVICE && config.null_device) {
        if (!null_arena) {
            void* a = mmap(nullptr, NULL_ARENA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (a == MAP_FAILED) return fail(OUT_OF_MEMORY, "null device: reserving %zu bytes of address space failed", NULL_ARENA_BYTES);
            null_arena = static_cast<char*>(a);
        }
        const size_t size = ((n ? n : 1) + 255) / 256 * 256;
        if (null_arena_used + size > NULL_ARENA_BYTES) return fail(OUT_OF_MEMORY, "null device: address space exhausted");
        p = null_arena + null_arena_used;
        null_arena_used += size;
    } else if (kind == HOST && config.null_device) {
        // demand-zero pages: a null store's reads never touch them, so a host tier of a model far larger
        // than this machine's memory costs only address space; and a read-back of nothing reads zeros
        void* a = mmap(nullptr, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (a == MAP_FAILED) return fail(OUT_OF_MEMORY, "null device: mapping %zu bytes of host memory failed", n);
        p = a;
    } else if (posix_memalign(&p, 256, n ? n : 1) != 0) {
        return fail(OUT_OF_MEMORY, "host allocation of %zu bytes failed", n);
    }
    allocations[(uintptr_t)p] = Allocation{n, kind == DEVICE ? device : -1, kind};
    if (kind == DEVICE) used[device] += n;
    *out = p;
    return OK;
}

// The allocation a free names, with the table locked by the caller; null (and the error set) if p is not
// one of `kind`'s.
static const Allocation* to_free(void* p, Kind kind) {
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second.kind != kind) {
        fail(INVALID_VALUE, "free of %p: not a %s allocation of the simulator", p, kind == DEVICE ? "device" : "pinned host");
        return nullptr;
    }
    return &it->second;
}

// A free in deferred mode: the block leaves the allocation table now (a later use of it is refused as
// outside every allocation) and goes back to the host later, without running any stream.
static int release_deferred(void* p, Kind kind) {
    Freed f{p, {}};
    int device;
    {
        std::lock_guard<std::mutex> g(memory_mutex);
        const Allocation* a = to_free(p, kind);
        if (!a) return INVALID_VALUE;
        device = a->device;
        if (kind == DEVICE) used[device] -= a->size;
        allocations.erase((uintptr_t)p);
    }
    {
        std::lock_guard<std::mutex> g(registry_mutex);
        for (auto& s : streams)
            if (device < 0 || s->device == device) {
                std::lock_guard<std::mutex> gs(s->m);
                f.until.emplace_back(s.get(), s->submitted);
            }
    }
    std::lock_guard<std::mutex> g(memory_mutex);
    freed.push_back(std::move(f));
    reclaim_freed();
    return OK;
}

static int release(void* p, Kind kind) {
    if (config.deferred) return release_deferred(p, kind);
    int device;
    {
        std::lock_guard<std::mutex> g(memory_mutex);
        const Allocation* a = to_free(p, kind);
        if (!a) return INVALID_VALUE;
        device = a->device;
    }
    drain(device);  // as cuMemFree: queued work that may still use the memory finishes first
    std::lock_guard<std::mutex> g(memory_mutex);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end()) return fail(INVALID_VALUE, "double free of %p", p);
    if (kind == DEVICE) used[it->second.device] -= it->second.size;
    const size_t size = it->second.size;
    allocations.erase(it);
    const bool in_arena = null_arena && (char*)p >= null_arena && (char*)p < null_arena + NULL_ARENA_BYTES;
    if (kind == HOST && config.null_device) munmap(p, size ? size : 1);
    else if (!in_arena) free(p);
    return OK;
}

EXPORT int sim_malloc(int device, void** out, size_t n) { return allocate(device, DEVICE, out, n); }
EXPORT int sim_free(void* p) { return release(p, DEVICE); }
EXPORT int sim_host_alloc(void** out, size_t n) { return allocate(-1, HOST, out, n); }
EXPORT int sim_host_free(void* p) { return release(p, HOST); }
EXPORT int sim_host_register(void*, size_t) {
    // the null device's host memory is address space only (a host tier larger than the machine): a caller
    // that would fault pages in to register them takes the driver's own allocation instead, as where a
    // real driver registers no host memory
    if (config.null_device) return fail(NOT_SUPPORTED, "null device: host memory is not registered, only allocated");
    return OK;
}
EXPORT int sim_host_unregister(void*) { return OK; }

EXPORT int sim_allocation_count(int device, size_t* count, size_t* bytes) {
    std::lock_guard<std::mutex> g(memory_mutex);
    *count = 0;
    *bytes = 0;
    for (auto& [p, a] : allocations)
        if (a.kind == DEVICE && a.device == device) {
            ++*count;
            *bytes += a.size;
        }
    return OK;
}

EXPORT int sim_stream_create(int device, void** out) {
    if (!valid_device(device)) return fail(INVALID_DEVICE, "no simulated device %d", device);
    std::lock_guard<std::mutex> g(registry_mutex);
    streams.push_back(std::make_unique<Stream>(device));
    *out = streams.back().get();
    return OK;
}

EXPORT int sim_stream_sync(void* s) {
    if (timing.on) host_wait_until(timed_end(static_cast<Stream*>(s)));
    return static_cast<Stream*>(s)->sync();
}

EXPORT int sim_event_create(int device, void** out) {
    if (!valid_device(device)) return fail(INVALID_DEVICE, "no simulated device %d", device);
    std::lock_guard<std::mutex> g(registry_mutex);
    events.push_back(std::make_unique<Event>());
    events.back()->device = device;
    *out = events.back().get();
    return OK;
}

EXPORT int sim_event_record(void* e, void* s) {
    Event* ev = static_cast<Event*>(e);
    Stream* st = static_cast<Stream*>(s);
    if (config.null_device) {  // nothing is ever in flight: the event is reached at once
        std::lock_guard<std::mutex> g(ev->m);
        ev->done = ++ev->issued;
        ev->stream = nullptr;
        ev->when = timing.on ? timed_submit(st, 0.0, 'E') : std::chrono::steady_clock::now();
        return OK;
    }
    Op op;
    op.type = Op::RECORD;
    op.event = ev;
    std::lock_guard<std::mutex> g(ev->m);
    op.target = ++ev->issued;
    ev->stream = st;
    ev->position = st->submit(std::move(op));
    return OK;
}

EXPORT int sim_stream_wait_event(void* s, void* e) {
    Event* ev = static_cast<Event*>(e);
    if (config.null_device) {  // every event is already reached; on the timed device, at its time
        if (timing.on) {
            std::lock_guard<std::mutex> g(ev->m);
            if (ev->issued) timed_wait(static_cast<Stream*>(s), ev->when);
        }
        return OK;
    }
    Op op;
    op.type = Op::WAIT;
    op.event = ev;
    {
        std::lock_guard<std::mutex> g(ev->m);
        if (ev->issued == 0) return OK;  // never recorded: nothing to wait for (as CUDA)
        op.target = ev->issued;
        op.source = ev->stream;
        op.source_position = ev->position;
    }
    static_cast<Stream*>(s)->submit(std::move(op));
    return OK;
}

EXPORT int sim_event_sync(void* e) {
    Event* ev = static_cast<Event*>(e);
    Stream* source;
    uint64_t target, position;
    {
        std::lock_guard<std::mutex> g(ev->m);
        target = ev->issued;
        source = ev->stream;
        position = ev->position;
    }
    if (timing.on && target) {
        std::chrono::steady_clock::time_point when;
        {
            std::lock_guard<std::mutex> g(ev->m);
            when = ev->when;
        }
        host_wait_until(when);
    }
    if (!source) return OK;
    demand(source, position);
    std::unique_lock<std::mutex> g(ev->m);
    ev->cv.wait(g, [&] { return ev->done >= target; });
    std::unique_lock<std::mutex> gs(source->m);
    source->show_host(position, gs);
    if (!source->error.empty()) return fail(LAUNCH_FAILED, "%s", source->error.c_str());
    return OK;
}

EXPORT int sim_event_elapsed(float* ms, void* a, void* b) {
    Event *ea = static_cast<Event*>(a), *eb = static_cast<Event*>(b);
    std::scoped_lock g(ea->m, eb->m);
    if (ea->done == 0 || eb->done == 0 || ea->done < ea->issued || eb->done < eb->issued)
        return fail(INVALID_VALUE, "event elapsed time: an event has not completed");
    *ms = std::chrono::duration<float, std::milli>(eb->when - ea->when).count();
    return OK;
}

// kind: 1 host to device, 2 device to host, 3 device to device
EXPORT int sim_memcpy_async(void* dst, const void* src, size_t n, void* s, int kind) {
    {
        std::lock_guard<std::mutex> g(memory_mutex);
        if ((kind == 1 || kind == 3) && !find((uintptr_t)dst, n))
            return fail(ILLEGAL_ADDRESS, "copy of %zu bytes to %p: outside every device allocation", n, dst);
        if ((kind == 2 || kind == 3) && !find((uintptr_t)src, n))
            return fail(ILLEGAL_ADDRESS, "copy of %zu bytes from %p: outside every device allocation", n, src);
    }
    if (config.null_device) {  // a read-back leaves the host bytes as they were
        if (timing.on) timed_submit(static_cast<Stream*>(s), n / (kind == 3 ? timing.kernel_bandwidth : timing.link_bandwidth), "?UDK"[kind & 3]);
        return OK;
    }
    Op op;
    op.type = Op::COPY;
    op.dst = dst;
    op.src = src;
    op.n = n;
    op.hold = kind == 2 && config.deferred;
    static_cast<Stream*>(s)->submit(std::move(op));
    return OK;
}

EXPORT int sim_memset_d32_async(void* dst, unsigned value, size_t count, void* s) {
    {
        std::lock_guard<std::mutex> g(memory_mutex);
        if (!find((uintptr_t)dst, count * 4))
            return fail(ILLEGAL_ADDRESS, "memset of %zu words at %p: outside every device allocation", count, dst);
    }
    if (config.null_device) {
        if (timing.on) timed_submit(static_cast<Stream*>(s), 4.0 * count / timing.kernel_bandwidth, 'M');
        return OK;
    }
    Op op;
    op.type = Op::MEMSET32;
    op.dst = dst;
    op.n = count;
    op.value = value;
    static_cast<Stream*>(s)->submit(std::move(op));
    return OK;
}

// A module image is the shared library the host compiler built from one kernel source.
EXPORT int sim_module_load(int device, const void* image, size_t n, void** out) {
    if (!valid_device(device)) return fail(INVALID_DEVICE, "no simulated device %d", device);
    if (n < 4 || memcmp(image, "\x7f" "ELF", 4) != 0)
        return fail(INVALID_IMAGE, "module image of %zu bytes is not a simulator build (a cubin or code object?)", n);
    int fd = memfd_create("fomoe-sim-module", MFD_CLOEXEC);
    if (fd < 0) return fail(INVALID_IMAGE, "memfd_create failed");
    size_t written = 0;
    while (written < n) {
        ssize_t w = write(fd, (const char*)image + written, n - written);
        if (w <= 0) {
            close(fd);
            return fail(INVALID_IMAGE, "writing the module image failed");
        }
        written += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    // the descriptor stays open: dlopen knows a library by its path, and a reused descriptor number
    // would hand back the module loaded before
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        close(fd);
        return fail(INVALID_IMAGE, "module does not load: %s", dlerror());
    }
    auto table = (const KernelInfo* (*)(int*))dlsym(handle, "fomoe_sim_kernel_table");
    if (!table) return fail(INVALID_IMAGE, "module has no kernel table (not built with sim_device.h)");
    auto m = std::make_unique<Module>();
    m->handle = handle;
    m->kernels = table(&m->n_kernels);
    m->device = device;
    std::lock_guard<std::mutex> g(registry_mutex);
    modules.push_back(std::move(m));
    *out = modules.back().get();
    return OK;
}

EXPORT int sim_module_function(void** out, void* module, const char* name) {
    Module* m = static_cast<Module*>(module);
    for (int i = 0; i < m->n_kernels; i++)
        if (strcmp(m->kernels[i].name, name) == 0) {
            *out = (void*)&m->kernels[i];
            return OK;
        }
    return fail(NOT_FOUND, "kernel %s is not in this module", name);
}

EXPORT int sim_kernel_params(void* fn, int* n, int* sizes, int* is_pointer, int* max_threads) {
    const KernelInfo* k = static_cast<const KernelInfo*>(fn);
    *n = k->n_params;
    *max_threads = k->max_threads;
    for (int i = 0; i < k->n_params; i++) {
        sizes[i] = k->param_size[i];
        is_pointer[i] = k->param_is_pointer[i];
    }
    return OK;
}

EXPORT int sim_launch(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                      void* s, void** params) {
    const KernelInfo* k = static_cast<const KernelInfo*>(fn);
    Stream* st = static_cast<Stream*>(s);
    const unsigned long threads = (unsigned long)bx * by * bz;
    if (!gx || !gy || !gz || !threads) return fail(INVALID_VALUE, "kernel %s: an empty grid or block", k->name);
    if (threads > (unsigned long)k->max_threads)
        return fail(LAUNCH_OUT_OF_RESOURCES, "kernel %s: a block of %lu threads exceeds its launch bound of %d", k->name, threads,
                    k->max_threads);
    if (gy > 65535 || gz > 65535) return fail(INVALID_VALUE, "kernel %s: grid (%u,%u,%u) exceeds 65535 in y or z", k->name, gx, gy, gz);
    if (shared > 65536) return fail(LAUNCH_OUT_OF_RESOURCES, "kernel %s: %u bytes of dynamic shared memory (at most 64 KiB)", k->name, shared);
    if (!params && k->n_params) return fail(INVALID_VALUE, "kernel %s: no parameters given", k->name);
    Op op;
    op.type = Op::LAUNCH;
    op.kernel = k;
    op.launch.grid[0] = gx, op.launch.grid[1] = gy, op.launch.grid[2] = gz;
    op.launch.block[0] = bx, op.launch.block[1] = by, op.launch.block[2] = bz;
    op.launch.shared = shared;
    op.launch.order_seed = config.order_seed;
    size_t words = 0;
    std::vector<size_t> offsets(k->n_params);
    for (int i = 0; i < k->n_params; i++) {
        offsets[i] = words;
        words += (k->param_size[i] + 7) / 8;
    }
    op.param_storage.resize(words ? words : 1);
    op.params.resize(k->n_params);
    std::lock_guard<std::mutex> g(memory_mutex);
    for (int i = 0; i < k->n_params; i++) {
        memcpy(&op.param_storage[offsets[i]], params[i], k->param_size[i]);
        op.params[i] = &op.param_storage[offsets[i]];
        if (!k->param_is_pointer[i]) continue;
        uintptr_t p;
        memcpy(&p, params[i], sizeof p);
        if (!p) continue;
        const Allocation* a = find(p, 1);
        if (!a || a->kind != DEVICE)
            return fail(ILLEGAL_ADDRESS, "kernel %s: argument %d (%p) is not device memory", k->name, i, (void*)p);
        if (a->device != st->device)
            return fail(ILLEGAL_ADDRESS, "kernel %s on device %d: argument %d (%p) is memory of device %d", k->name, st->device, i,
                        (void*)p, a->device);
    }
    if (config.null_device) {  // checked like a real launch; runs nothing (on the timed device, for a time)
        if (timing.on) {
            const unsigned grid[3] = {gx, gy, gz};
            timed_submit(st, launch_bytes(k, grid, params) / timing.kernel_bandwidth, 'L');
        }
        return OK;
    }
    st->submit(std::move(op));
    return OK;
}
