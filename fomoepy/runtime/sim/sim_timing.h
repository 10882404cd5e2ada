// sim_timing.h: the null device's timed mode (sim_set_timing), an emulated-cost device. Included by
// sim_driver.cpp after sim_streams.h, not on its own.
//
// Nothing runs, as in null mode, but every stream is a timeline in real (steady-clock) time: an op
// submitted at host time `now` starts at max(now, the end of the stream's previous op) and takes
//     a copy host <-> device     bytes / link bandwidth
//     a launch                   bytes it reads / kernel bandwidth
//     a device copy, a memset    bytes (copied, written) / kernel bandwidth
// An event is reached when its stream's timeline reaches the record; a wait on it moves the waiting
// stream's timeline to at least that point; streams otherwise overlap freely (no shared bandwidth).
// A synchronisation (stream, event) makes the host sleep until the time the device would be done, so
// the host's wall clock lives through the device's time, and a read-back returns then.
//
// The bytes a launch reads: every allocation its pointer arguments lie in, once each (a weight, an
// activation), plus what a kernel reads through addresses stored in device memory, which a null
// device cannot look at: the grouped expert kernels (hip_kernels/experts.hip) read each work item's
// expert matrices, whose sizes their scalar arguments give (INDIRECT below). A kernel that reads only
// part of an allocation it names (attention over a KV cache) is charged all of it.
#pragma once

#include <atomic>
#include <map>

namespace {

using Clock = std::chrono::steady_clock;

struct Timing {
    bool on = false;
    double kernel_bandwidth = 0.0;  // bytes per second a kernel reads
    double link_bandwidth = 0.0;    // bytes per second of a host <-> device copy
    std::mutex m;
    std::map<const Stream*, Clock::time_point> end;  // each stream's timeline: when its last op is done
    std::atomic<long long> waited_ns{0};             // host time spent in synchronisations
    std::atomic<long long> late_ns{0};               // of which after the device was done (the machine was busy)
};
Timing timing;

Clock::duration seconds(double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

long long ns(Clock::time_point t) { return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count(); }

// FOMOE_STANDIN_TIMELINE=path: every timed op is written there as it is placed, one line each,
//     <stream> <kind> <submitted ns> <start ns> <end ns>      (kind: L launch, U/D/K copy up/down/on the
//                                                             device, M memset, E event record)
//     host W <waiting from ns> <device done ns> <returned ns> (a synchronisation)
// in steady-clock nanoseconds (Python's time.perf_counter_ns() on Linux), to see what lay on the
// critical path of a run (who waited for whom).
FILE* timeline() {
    static FILE* f = [] {
        const char* v = getenv("FOMOE_STANDIN_TIMELINE");
        return v && *v ? fopen(v, "w") : nullptr;
    }();
    return f;
}

// Places an op of `cost` seconds on the stream's timeline; returns when it is done.
Clock::time_point timed_submit(const Stream* s, double cost, char kind) {
    std::lock_guard<std::mutex> g(timing.m);
    Clock::time_point& end = timing.end[s];
    const Clock::time_point now = Clock::now(), start = std::max(now, end);
    end = start + seconds(cost);
    if (FILE* f = timeline()) fprintf(f, "%p %c %lld %lld %lld\n", (const void*)s, kind, ns(now), ns(start), ns(end));
    return end;
}

// A wait for an event reached at `when`: nothing later on the stream starts before then.
void timed_wait(const Stream* s, Clock::time_point when) {
    std::lock_guard<std::mutex> g(timing.m);
    Clock::time_point& end = timing.end[s];
    end = std::max(end, when);
}

Clock::time_point timed_end(const Stream* s) {
    std::lock_guard<std::mutex> g(timing.m);
    auto it = timing.end.find(s);
    return it == timing.end.end() ? Clock::time_point{} : it->second;
}

// The host waits for the device until `when`: it sleeps, and spins the last stretch (a sleep wakes late,
// by a few hundred microseconds on a busy machine, which would add to every read-back). The stretch is
// short by default (150 µs, FOMOE_STANDIN_SPIN_US): on a machine with few cores a longer spin takes the
// core that the engine's other threads (the store's) need to hand over a read on time.
void host_wait_until(Clock::time_point when) {
    const Clock::time_point start = Clock::now();
    if (when <= start) return;
    static const Clock::duration spin = std::chrono::microseconds([] {
        const char* v = getenv("FOMOE_STANDIN_SPIN_US");  // how long before the device's time the host spins
        return v && *v ? atoll(v) : 150LL;
    }());
    if (when - start > spin) std::this_thread::sleep_until(when - spin);
    Clock::time_point now;
    while ((now = Clock::now()) < when) {
    }
    if (FILE* f = timeline()) fprintf(f, "host W %lld %lld %lld\n", ns(start), ns(when), ns(now));
    timing.waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count();
    timing.late_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - when).count();
}

// Kernels that read device memory through addresses held in device memory: the bytes they read,
// from the grid and their scalar arguments (hip_kernels/experts.hip; signatures in kernels.py).
struct Indirect {
    const char* prefix;
    double (*bytes)(const unsigned grid[3], void* const* params);
};
template <class T>
T arg(void* const* params, int i) {
    T v;
    memcpy(&v, params[i], sizeof v);
    return v;
}
const Indirect INDIRECT[] = {
    // (work, X, D, F, k, row_bytes, act): gate and up, F rows each, of every work item (grid y)
    {"moe_gate_up_", [](const unsigned g[3], void* const* p) { return 2.0 * g[1] * arg<int>(p, 3) * (double)arg<long long>(p, 5); }},
    // (pairs, act, D, F, k, row_bytes, out): each token's (grid y) k down matrices of D rows
    {"moe_down_sum_", [](const unsigned g[3], void* const* p) { return (double)g[1] * arg<int>(p, 4) * arg<int>(p, 2) * (double)arg<long long>(p, 5); }},
    // (work, act, D, F, row_bytes, part): the down matrix of every work item
    {"moe_down_", [](const unsigned g[3], void* const* p) { return (double)g[1] * arg<int>(p, 2) * (double)arg<long long>(p, 4); }},
};

// The bytes a launch reads (see the top of this file); memory_mutex held by the caller.
double launch_bytes(const KernelInfo* k, const unsigned grid[3], void* const* params) {
    double bytes = 0.0;
    std::vector<uintptr_t> seen;
    for (int i = 0; i < k->n_params; i++) {
        if (!k->param_is_pointer[i]) continue;
        uintptr_t p, base;
        memcpy(&p, params[i], sizeof p);
        const Allocation* a = p ? find(p, 1, &base) : nullptr;
        if (!a || std::find(seen.begin(), seen.end(), base) != seen.end()) continue;
        seen.push_back(base);
        bytes += (double)a->size;
    }
    for (const Indirect& ind : INDIRECT)  // the first prefix that matches (moe_down_sum_ before moe_down_)
        if (strncmp(k->name, ind.prefix, strlen(ind.prefix)) == 0) return bytes + ind.bytes(grid, params);
    return bytes;
}

}  // namespace
