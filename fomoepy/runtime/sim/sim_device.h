// sim_device.h: the simulated device's half of a kernel module. hip_kernels/compat.h includes it when
// FOMOE_SIM is defined, and the host C++ compiler then builds the real kernel source into a shared
// library that runs each block's threads as fibers on one CPU thread.
//
// The rules a GPU enforces, and that a wrong kernel must break here too:
//   __syncthreads()   a barrier across the whole block: no thread passes until every thread arrives;
//   warp shuffles     a barrier across the 32 lanes of a warp, over an exchange buffer (double-
//                     buffered, so a lane that races ahead to the next shuffle cannot overwrite a
//                     value a slower lane has still to read);
//   shared memory     dynamic and static (SHARED(...)) alike filled with NaN before each block, so a
//                     read before a write shows and nothing carries over (sim_shared.h); with
//                     FOMOE_SIM_RACECHECK every access is checked for a race within a barrier interval;
//   warp order        with an order seed, each warp runs ahead alone to the next __syncthreads(), the
//                     warps in an order drawn from the seed, the block and the barrier: a result that
//                     depends on the order of the warps changes with the seed (sim_set_order_seed);
//   errors            a deadlock, a barrier reached after some threads exited (or a thread exiting
//                     while others wait), and a shuffle in a warp with an exited lane each stop the
//                     launch with a message naming the kernel and the block.
// Fibers switch only at those barriers, so a block runs with as many context switches as its
// barriers need. On x86-64 the switch is a dozen instructions (swapcontext makes a system call per
// switch); elsewhere, or with FOMOE_SIM_UCONTEXT, ucontext does it.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include <type_traits>
#include <utility>

#if defined(__x86_64__) && !defined(FOMOE_SIM_UCONTEXT)
#define FOMOE_SIM_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

#define FOMOE_SIM_EXPORT extern "C" __attribute__((visibility("default")))

// The simulator's own code stays out of the race detector's instrumentation (sim_shared.h).
#ifdef FOMOE_SIM_RACECHECK
#define FOMOE_SIM_UNCHECKED __attribute__((no_sanitize("thread"), noinline))
#else
#define FOMOE_SIM_UNCHECKED
#endif

namespace fomoe_sim {

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

enum State : int { RUNNABLE, AT_BLOCK, AT_WARP, EXITED };

constexpr int MAX_THREADS = 1024;
constexpr int MAX_WARPS = MAX_THREADS / 32;
constexpr size_t STACK_BYTES = 64 * 1024;

struct Fiber {
    dim3 tid;
    int linear, warp, lane;
    State state;
    char* stack;
#ifdef FOMOE_SIM_ASM_SWITCH
    void* sp;
#else
    ucontext_t ctx;
#endif
};

// What the driver hands a kernel's entry: the launch geometry, the blocks to run (linear indices
// [block_begin, block_end): the driver spreads a launch's blocks over host threads) and where to
// write an error.
struct Launch {
    unsigned grid[3], block[3];
    unsigned shared;
    char* error;
    unsigned error_len;
    unsigned block_begin, block_end;
    unsigned order_seed;  // 0: warps in index order
};

// A kernel as the driver sees it: its launch bound and the C types of its parameters.
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

struct Block {
    const char* kernel;
    dim3 index;
    void (*body)(void*);
    void* closure;
    int n;
    int n_exited, n_at_block;
    int warp_lanes[MAX_WARPS], warp_arrived[MAX_WARPS], warp_exited[MAX_WARPS];
    unsigned warp_gen[MAX_WARPS];
    uint64_t exchange[2][MAX_WARPS][32];
    int order[MAX_THREADS], position[MAX_THREADS];  // the fibers in the order they run, and each one's place
    uint64_t order_state;                           // the seeded draw of warp orders (0: index order)
    bool failed;
    char message[512];
#ifdef FOMOE_SIM_ASM_SWITCH
    void* scheduler_sp;
#else
    ucontext_t scheduler_ctx;
#endif
};

// Per host thread: a stream's worker runs one launch at a time, so one set suffices.
inline thread_local Fiber* current = nullptr;
inline thread_local Block* block = nullptr;
inline thread_local dim3 block_idx, block_dim, grid_dim;
inline thread_local unsigned char* dyn_shared = nullptr;
inline thread_local Fiber* fibers_base = nullptr;

// -- context switch --------------------------------------------------------------------------------
#ifdef FOMOE_SIM_ASM_SWITCH
// fomoe_sim_switch(save, to): push the callee-saved registers and the SSE/x87 control words, store
// the stack pointer in *save, load `to`, pop the same from there and return into that context.
extern "C" void fomoe_sim_switch(void** save, void* to);
asm(R"(
    .text
    .globl fomoe_sim_switch
    .hidden fomoe_sim_switch
    .type fomoe_sim_switch,@function
fomoe_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fomoe_sim_switch, .-fomoe_sim_switch
)");
#endif

inline void to_scheduler() {
#ifdef FOMOE_SIM_ASM_SWITCH
    fomoe_sim_switch(&current->sp, block->scheduler_sp);
#else
    swapcontext(&current->ctx, &block->scheduler_ctx);
#endif
}

inline void to_fiber(Fiber* f) {
    current = f;
#ifdef FOMOE_SIM_ASM_SWITCH
    fomoe_sim_switch(&block->scheduler_sp, f->sp);
#else
    swapcontext(&block->scheduler_ctx, &f->ctx);
#endif
}

inline void switch_fiber(Fiber* from, Fiber* to) {
    current = to;
#ifdef FOMOE_SIM_ASM_SWITCH
    fomoe_sim_switch(&from->sp, to->sp);
#else
    swapcontext(&from->ctx, &to->ctx);
#endif
}

// The current fiber has blocked (or exited): run the next runnable fiber of the block directly, and
// hand control to the scheduler only when there is none (block done, deadlock) - half the switches
// of going through the scheduler every time. In index order the next is the next thread, so the
// warps advance together, shuffle by shuffle; in a seeded order the search starts at the current
// warp's first lane, so one warp runs ahead to the next __syncthreads() before the next warp starts:
// a warp that overwrites what a later warp has still to read then does so before that read.
FOMOE_SIM_UNCHECKED inline void switch_away() {
    Block* b = block;
    Fiber* from = current;
    const int n = b->n;
    const int start = b->order_state ? b->position[from->linear] - from->lane : b->position[from->linear] + 1;
    for (int k = 0, q = start; k < n; k++, q++) {
        if (q == n) q = 0;
        Fiber* to = fibers_base + b->order[q];
        if (to == from || to->state != RUNNABLE) continue;
        switch_fiber(from, to);
        return;
    }
    to_scheduler();
}

// -- the order of warps ----------------------------------------------------------------------------
inline uint64_t splitmix(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Index order, or (seeded) a shuffle of the warps, each warp's lanes in order.
FOMOE_SIM_UNCHECKED inline void draw_order(Block* b) {
    const int n_warps = (b->n + 31) / 32;
    int warps[MAX_WARPS];
    for (int w = 0; w < n_warps; w++) warps[w] = w;
    if (b->order_state)
        for (int w = n_warps - 1; w > 0; w--) {
            const int j = (int)(splitmix(b->order_state) % (uint64_t)(w + 1));
            const int t = warps[w];
            warps[w] = warps[j];
            warps[j] = t;
        }
    int q = 0;
    for (int k = 0; k < n_warps; k++)
        for (int i = warps[k] * 32; i < warps[k] * 32 + b->warp_lanes[warps[k]]; i++) {
            b->order[q] = i;
            b->position[i] = q++;
        }
}

// -- failures: the block stops, the scheduler never resumes its fibers --------------------------------
[[noreturn]] FOMOE_SIM_UNCHECKED inline void fail_with(const char* what) {
    Block* bl = block;
    snprintf(bl->message, sizeof bl->message, "kernel %s, block (%u,%u,%u), thread %d: %s", bl->kernel, bl->index.x,
             bl->index.y, bl->index.z, current ? current->linear : -1, what);
    bl->failed = true;
    to_scheduler();
    __builtin_unreachable();
}

[[noreturn]] inline void fail(const char* fmt, int a = 0, int b = 0, int c = 0) {
    char what[400];
    snprintf(what, sizeof what, fmt, a, b, c);
    fail_with(what);
}

}  // namespace fomoe_sim

#include "sim_shared.h"

namespace fomoe_sim {

// -- barriers --------------------------------------------------------------------------------------
inline thread_local Fiber fibers[MAX_THREADS];

// The last thread to arrive releases the others into a new barrier interval; with an order seed the
// warps then start over in a fresh order (the first of it runs first, not the thread that arrived last).
FOMOE_SIM_UNCHECKED inline void sync_block() {
    Block* b = block;
    if (b->n_exited)
        fail("__syncthreads() reached after %d of the block's %d threads exited", b->n_exited, b->n);
    if (++b->n_at_block == b->n) {
        b->n_at_block = 0;
        for (int i = 0; i < b->n; i++)
            if (fibers[i].state == AT_BLOCK) fibers[i].state = RUNNABLE;
        next_interval(arena);
        if (b->order_state) {
            draw_order(b);
            Fiber* first = fibers_base + b->order[0];
            if (first != current) switch_fiber(current, first);
        }
        return;
    }
    current->state = AT_BLOCK;
    switch_away();
}

FOMOE_SIM_UNCHECKED inline void sync_warp() {
    Block* b = block;
    const int w = current->warp;
    if (b->warp_exited[w])
        fail("a warp shuffle in warp %d, where %d lane(s) have exited (a shuffle must not read an exited lane)", w,
             b->warp_exited[w]);
    if (++b->warp_arrived[w] == b->warp_lanes[w]) {
        b->warp_arrived[w] = 0;
        b->warp_gen[w]++;
        for (int i = w * 32; i < w * 32 + b->warp_lanes[w]; i++)
            if (fibers[i].state == AT_WARP) fibers[i].state = RUNNABLE;
        return;
    }
    current->state = AT_WARP;
    switch_away();
}

// Every lane publishes v, waits for its whole warp, then reads lane `src`'s value.
template <class T>
FOMOE_SIM_UNCHECKED inline T exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles move up to 8 bytes");
    Block* b = block;
    const int w = current->warp;
    const unsigned g = b->warp_gen[w] & 1;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    b->exchange[g][w][current->lane] = bits;
    sync_warp();
    if (src >= b->warp_lanes[w]) fail("a warp shuffle reads lane %d of a warp that has %d lanes", src, b->warp_lanes[w]);
    bits = b->exchange[g][w][src];
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}

inline void full_mask(unsigned mask) {
    if (mask != 0xffffffffu) fail("a shuffle with mask 0x%x: the kernels use full-warp shuffles only", (int)mask);
}

// -- running one block -----------------------------------------------------------------------------
FOMOE_SIM_UNCHECKED inline void fiber_exit() {
    Block* b = block;
    Fiber* f = current;
    f->state = EXITED;
    b->n_exited++;
    b->warp_exited[f->warp]++;
    if (b->n_at_block)
        fail("the thread returned while %d thread(s) wait at __syncthreads() (every thread must reach it)", b->n_at_block);
    if (b->warp_arrived[f->warp])
        fail("the lane returned while %d lane(s) of its warp wait in a shuffle that reads it", b->warp_arrived[f->warp]);
    switch_away();
    __builtin_unreachable();
}

extern "C" inline void fomoe_sim_fiber_main() {
    block->body(block->closure);
    fiber_exit();
}

// One mapping per host thread and module, no guard pages: each would split the mapping, and the
// kernel modules times the stream threads would run into the kernel's limit on mappings. A canary
// at the bottom of each stack is checked after every block instead.
constexpr uint64_t CANARY = 0x5ca1ab1ef00dfaceull;

struct StackPool {
    char* base = nullptr;
    int count = 0;
    ~StackPool() {
        if (base) munmap(base, (size_t)count * STACK_BYTES);
    }
    char* get(int i) {  // the lowest byte of stack i, with the canary written there
        if (i >= count) {
            if (base) munmap(base, (size_t)count * STACK_BYTES);
            count = (i / 256 + 1) * 256;
            base = (char*)mmap(nullptr, (size_t)count * STACK_BYTES, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (base == MAP_FAILED) {
                base = nullptr;
                count = 0;
                return nullptr;
            }
        }
        char* stack = base + (size_t)i * STACK_BYTES;
        memcpy(stack, &CANARY, sizeof CANARY);
        return stack;
    }
};
inline thread_local StackPool stacks;

inline bool prepare(Fiber* f) {
#ifdef FOMOE_SIM_ASM_SWITCH
    // the frame fomoe_sim_switch pops: control words, r15..rbp, then the "return" into fiber_main,
    // placed so that fiber_main starts with the stack aligned as after a call
    uintptr_t top = ((uintptr_t)f->stack + STACK_BYTES) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;
    *--sp = (uint64_t)(uintptr_t)&fomoe_sim_fiber_main;
    for (int r = 0; r < 6; r++) *--sp = 0;
    uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*(uint16_t*)&csr[1]));
    *--sp = ((uint64_t)csr[1] << 32) | csr[0];
    f->sp = sp;
#else
    if (getcontext(&f->ctx) != 0) return false;
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = STACK_BYTES;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, (void (*)())fomoe_sim_fiber_main, 0);
#endif
    return true;
}

// Runs one block to completion; false with b->message set when it fails.
FOMOE_SIM_UNCHECKED inline bool run_block(Block* b, unsigned order_seed) {
    const dim3 d = block_dim;
    b->n = (int)(d.x * d.y * d.z);
    b->n_exited = b->n_at_block = 0;
    b->failed = false;
    const int n_warps = (b->n + 31) / 32;
    for (int w = 0; w < n_warps; w++) {
        b->warp_lanes[w] = w == n_warps - 1 ? b->n - 32 * w : 32;
        b->warp_arrived[w] = b->warp_exited[w] = 0;
        b->warp_gen[w] = 0;
    }
    block = b;
    fibers_base = fibers;
    for (int i = 0; i < b->n; i++) {
        Fiber* f = &fibers[i];
        f->linear = i;
        f->tid.x = i % d.x;
        f->tid.y = (i / d.x) % d.y;
        f->tid.z = i / (d.x * d.y);
        f->warp = i / 32;
        f->lane = i % 32;
        f->state = RUNNABLE;
        f->stack = stacks.get(i);
        if (!f->stack || !prepare(f)) {
            snprintf(b->message, sizeof b->message, "kernel %s: no memory for %d fiber stacks", b->kernel, b->n);
            return false;
        }
    }
    // the seed, the block and the launch's grid pick this block's orders, so a run repeats exactly
    b->order_state = 0;
    if (order_seed) {
        b->order_state = ((uint64_t)order_seed << 32) ^ (((uint64_t)b->index.z << 42) | ((uint64_t)b->index.y << 21) | b->index.x);
        b->order_state = splitmix(b->order_state) | 1;
    }
    draw_order(b);
    begin_block();
    current = nullptr;
    while (b->n_exited < b->n) {
        bool ran = false;
        for (int q = 0; q < b->n; q++) {
            const int i = b->order[q];
            if (fibers[i].state != RUNNABLE) continue;
            to_fiber(&fibers[i]);
            ran = true;
            if (b->failed) return false;
        }
        for (int i = 0; i < b->n; i++)
            if (memcmp(fibers[i].stack, &CANARY, sizeof CANARY) != 0) {
                snprintf(b->message, sizeof b->message, "kernel %s, block (%u,%u,%u), thread %d: stack overflow (more than %zu KiB)",
                         b->kernel, b->index.x, b->index.y, b->index.z, i, STACK_BYTES / 1024);
                return false;
            }
        if (!ran && b->n_exited < b->n) {
            int at_block = 0, at_warp = 0, first_block = -1, first_warp = -1;
            for (int i = 0; i < b->n; i++) {
                if (fibers[i].state == AT_BLOCK && at_block++ == 0) first_block = i;
                if (fibers[i].state == AT_WARP && at_warp++ == 0) first_warp = i;
            }
            snprintf(b->message, sizeof b->message,
                     "kernel %s, block (%u,%u,%u): deadlock: %d thread(s) wait at __syncthreads() (first: thread %d) "
                     "and %d in a warp shuffle (first: thread %d); each waits for threads held by the other",
                     b->kernel, b->index.x, b->index.y, b->index.z, at_block, first_block, at_warp, first_warp);
            return false;
        }
    }
    return true;
}

// -- a kernel's entry: unpack the driver's parameter block into the kernel's own C types ------------
template <class... A>
struct Closure {
    void (*fn)(A...);
    void* const* params;
};

template <class... A, size_t... I>
inline void call_with(const Closure<A...>* c, std::index_sequence<I...>) {
    c->fn(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(c->params[I])...);
}

template <class... A>
inline void invoke(void* closure) {
    call_with(static_cast<const Closure<A...>*>(closure), std::index_sequence_for<A...>{});
}

template <class... A>
FOMOE_SIM_UNCHECKED inline int run_kernel(const char* name, void (*fn)(A...), const Launch* l, void* const* params) {
    if (!begin_launch(l->shared, l->error, l->error_len, name)) return -1;
    dyn_shared = arena.base;
    Closure<A...> closure{fn, params};
    Block b;
    b.kernel = name;
    b.body = &invoke<A...>;
    b.closure = &closure;
    block_dim = dim3{l->block[0], l->block[1], l->block[2]};
    grid_dim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    for (unsigned linear = l->block_begin; linear < l->block_end; linear++) {
        block_idx = dim3{linear % l->grid[0], (linear / l->grid[0]) % l->grid[1], linear / (l->grid[0] * l->grid[1])};
        b.index = block_idx;
        if (!run_block(&b, l->order_seed)) {
            snprintf(l->error, l->error_len, "%s", b.message);
            block = nullptr;
            current = nullptr;
            return -1;
        }
    }
    block = nullptr;
    current = nullptr;
    return 0;
}

template <class... A>
inline KernelInfo describe(const char* name, int max_threads, void (*)(A...), int (*run)(const Launch*, void* const*)) {
    static_assert(sizeof...(A) <= MAX_PARAMS, "too many kernel parameters");
    KernelInfo k{};
    k.name = name;
    k.max_threads = max_threads;
    k.n_params = (int)sizeof...(A);
    const int sizes[] = {(int)sizeof(std::decay_t<A>)..., 0};
    const int aligns[] = {(int)alignof(std::decay_t<A>)..., 0};
    const int pointers[] = {(int)std::is_pointer_v<std::decay_t<A>>..., 0};
    for (int i = 0; i < k.n_params; i++) {
        k.param_size[i] = sizes[i];
        k.param_align[i] = aligns[i];
        k.param_is_pointer[i] = pointers[i];
    }
    k.run = run;
    return k;
}

inline KernelInfo* table() {
    static KernelInfo kernels[512];
    return kernels;
}
inline int& table_size() {
    static int n = 0;
    return n;
}
struct Registrar {
    explicit Registrar(const KernelInfo& k) { table()[table_size()++] = k; }
};

}  // namespace fomoe_sim

// The module's one export (this header is included once per module): every kernel, for the driver's lookup.
FOMOE_SIM_EXPORT const fomoe_sim::KernelInfo* fomoe_sim_kernel_table(int* n) {
    *n = fomoe_sim::table_size();
    return fomoe_sim::table();
}

#define FOMOE_SIM_ENTRY(name, bound)                                                                     \
    static int fomoe_sim_run_##name(const ::fomoe_sim::Launch* l, void* const* p) {                    \
        return ::fomoe_sim::run_kernel(#name, name, l, p);                                              \
    }                                                                                                    \
    static ::fomoe_sim::Registrar fomoe_sim_register_##name(::fomoe_sim::describe(#name, (bound), name, \
                                                                                  fomoe_sim_run_##name));

// what the kernel source sees: threadIdx, __syncthreads(), both vendors' shuffles, ...
#include "sim_intrinsics.h"
