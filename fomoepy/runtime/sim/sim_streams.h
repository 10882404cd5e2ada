// sim_streams.h: the simulated device's streams and events, and the host threads that run a
// launch's blocks. Included by sim_driver.cpp (after its memory table and Config), not on its own.
//
// Each stream is a host thread that runs its work in submission order; an event records a point in
// a stream's work and other streams (or the host) wait for it. In deferred mode a stream runs its
// work only when something needs it: a sync of the stream, a sync of an event recorded on it, or
// another stream reaching a wait on such an event. A missing wait then reads stale memory every
// time, instead of whenever the host threads happen to interleave badly. The host's view is held
// back as well: a device-to-host copy lands in host memory only when the host syncs that copy's own
// stream (or an event recorded on it after the copy), not when a sync of another stream that waited
// for it happened to run it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Stream;

struct Event {
    int device;
    std::mutex m;
    std::condition_variable cv;
    uint64_t issued = 0, done = 0;  // records issued / completed
    Stream* stream = nullptr;       // where the latest record was issued
    uint64_t position = 0;          // its place in that stream's work
    std::chrono::steady_clock::time_point when;
};


struct Op {
    enum Type { COPY, MEMSET32, LAUNCH, RECORD, WAIT } type;
    void* dst = nullptr;
    const void* src = nullptr;
    size_t n = 0;
    uint32_t value = 0;
    const KernelInfo* kernel = nullptr;
    Launch launch{};
    std::vector<uint64_t> param_storage;  // the argument values, copied at launch time as a driver does
    std::vector<void*> params;
    Event* event = nullptr;
    uint64_t target = 0;
    Stream* source = nullptr;  // WAIT: the stream the awaited record was issued on, and where
    uint64_t source_position = 0;
    bool hold = false;      // COPY to the host in deferred mode: held until the host syncs this stream
    uint64_t position = 0;  // its place in the stream's work
};

// A device-to-host copy that has run but that the host has not synced yet (deferred mode).
struct HeldCopy {
    void* dst;
    std::vector<char> bytes;
    uint64_t position;
};

void demand(Stream* s, uint64_t position);

// Host threads that run parts of a launch: a launch's blocks are independent, so its stream's thread
// runs one share and these the others (FOMOE_SIM_THREADS, default: the machine's cores, at most 8).
class BlockPool {
  public:
    static BlockPool& get() {
        static BlockPool* pool = new BlockPool;  // never destroyed, as the streams (below)
        return *pool;
    }
    int size() const { return (int)workers.size() + 1; }

    // runs every task, one on the calling thread; returns when all are done
    // The count is changed only under the mutex the caller waits with: a worker that counted down
    // outside it could still be about to notify when the caller, seeing zero, returns and destroys
    // what the worker is touching (two shares of equal size finish together, so this happens).
    void run_all(std::vector<std::function<void()>>& tasks) {
        struct Done {
            std::mutex m;
            std::condition_variable cv;
            size_t left;
        };
        auto done = std::make_shared<Done>();
        done->left = tasks.size() - 1;
        {
            std::lock_guard<std::mutex> g(m);
            for (size_t i = 1; i < tasks.size(); i++)
                queue.push_back([&tasks, done, i] {
                    tasks[i]();
                    std::lock_guard<std::mutex> d(done->m);
                    if (--done->left == 0) done->cv.notify_all();
                });
        }
        cv.notify_all();
        tasks[0]();
        std::unique_lock<std::mutex> d(done->m);
        done->cv.wait(d, [&] { return done->left == 0; });
    }

  private:
    BlockPool() {
        const char* env = getenv("FOMOE_SIM_THREADS");
        int n = env && *env ? atoi(env) : (int)std::thread::hardware_concurrency();
        n = n < 1 ? 1 : (n > 8 ? 8 : n);
        for (int i = 1; i < n; i++) workers.emplace_back([this] { work(); });
    }
    ~BlockPool() {
        {
            std::lock_guard<std::mutex> g(m);
            stopping = true;
        }
        cv.notify_all();
        for (auto& w : workers) w.join();
    }
    void work() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> g(m);
                cv.wait(g, [&] { return stopping || !queue.empty(); });
                if (queue.empty()) return;
                task = std::move(queue.front());
                queue.pop_front();
            }
            task();
        }
    }
    std::vector<std::thread> workers;
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    bool stopping = false;
};

struct Stream {
    int device;
    std::mutex m;
    std::condition_variable cv;
    std::deque<Op> queue;
    uint64_t submitted = 0, completed = 0, demanded = 0;
    std::deque<HeldCopy> held;  // in position order
    // deferred mode: how far into each other stream this one's work has waited (its WAITs' records), so
    // a copy up ordered after another stream's copy down reads what it wrote, as a device's DMA does
    std::vector<std::pair<Stream*, uint64_t>> waited_for;  // touched by this stream's thread only
    bool stopping = false;
    std::string error;  // sticky: the first failure, reported by every later sync
    std::thread worker;

    explicit Stream(int d) : device(d) { worker = std::thread([this] { run(); }); }

    ~Stream() {
        {
            std::lock_guard<std::mutex> g(m);
            stopping = true;
            demanded = submitted;
        }
        cv.notify_all();
        worker.join();
    }

    uint64_t submit(Op&& op) {
        std::lock_guard<std::mutex> g(m);
        op.position = submitted + 1;
        queue.push_back(std::move(op));
        ++submitted;
        if (!config.deferred) demanded = submitted;
        cv.notify_all();
        return submitted;
    }

    void run() {
        for (;;) {
            Op op;
            {
                std::unique_lock<std::mutex> g(m);
                cv.wait(g, [&] { return (!queue.empty() && completed < demanded) || (stopping && queue.empty()); });
                if (queue.empty()) return;
                op = std::move(queue.front());
                queue.pop_front();
            }
            execute(op);
            {
                std::lock_guard<std::mutex> g(m);
                ++completed;
            }
            cv.notify_all();
        }
    }

    void execute(Op& op) {
        bool failed;
        {
            std::lock_guard<std::mutex> g(m);
            failed = !error.empty();
        }
        switch (op.type) {
            case Op::COPY:
                if (failed) break;
                if (op.hold) {
                    const char* src = static_cast<const char*>(op.src);
                    HeldCopy h{op.dst, std::vector<char>(src, src + op.n), op.position};
                    std::lock_guard<std::mutex> g(m);
                    held.push_back(std::move(h));
                } else {
                    // a later copy on this stream that reads host memory a held copy wrote: stream order
                    // has landed that copy for it (a demoted expert's bytes copied down, then up again);
                    // so has an event this stream waited for, recorded on another stream after its copy
                    land_held_under(op.src, op.n);
                    for (auto& [other, position] : waited_for) other->land_held_under(op.src, op.n, position);
                    memmove(op.dst, op.src, op.n);
                }
                break;
            case Op::MEMSET32: {
                if (failed) break;
                uint32_t* p = static_cast<uint32_t*>(op.dst);
                for (size_t i = 0; i < op.n; i++) p[i] = op.value;
                break;
            }
            case Op::LAUNCH: {
                if (failed) break;
                const unsigned blocks = op.launch.grid[0] * op.launch.grid[1] * op.launch.grid[2];
                const unsigned parts = std::min<unsigned>(blocks, (unsigned)BlockPool::get().size());
                std::vector<Launch> shares(parts, op.launch);
                std::vector<std::vector<char>> messages(parts, std::vector<char>(1024, 0));
                std::vector<int> status(parts, 0);
                std::vector<std::function<void()>> tasks;
                for (unsigned i = 0; i < parts; i++) {
                    shares[i].block_begin = (unsigned)((uint64_t)blocks * i / parts);
                    shares[i].block_end = (unsigned)((uint64_t)blocks * (i + 1) / parts);
                    shares[i].error = messages[i].data();
                    shares[i].error_len = 1024;
                    tasks.push_back([&, i] { status[i] = op.kernel->run(&shares[i], op.params.data()); });
                }
                if (parts == 1) tasks[0]();
                else BlockPool::get().run_all(tasks);
                for (unsigned i = 0; i < parts; i++)
                    if (status[i] != 0) {  // the first failing share in block order
                        std::lock_guard<std::mutex> g(m);
                        error = messages[i].data();
                        break;
                    }
                break;
            }
            case Op::RECORD: {  // completes even after a failure, so nobody waits forever
                std::lock_guard<std::mutex> g(op.event->m);
                if (op.target > op.event->done) op.event->done = op.target;
                op.event->when = std::chrono::steady_clock::now();
                op.event->cv.notify_all();
                break;
            }
            case Op::WAIT: {
                if (config.deferred && op.source) {
                    demand(op.source, op.source_position);
                    auto seen = std::find_if(waited_for.begin(), waited_for.end(), [&](auto& w) { return w.first == op.source; });
                    if (seen == waited_for.end()) waited_for.emplace_back(op.source, op.source_position);
                    else seen->second = std::max(seen->second, op.source_position);
                }
                std::unique_lock<std::mutex> g(op.event->m);
                op.event->cv.wait(g, [&] { return op.event->done >= op.target; });
                break;
            }
        }
    }

    // blocks until the work submitted so far is done; the sticky error, if any
    int sync() {
        uint64_t until;
        {
            std::lock_guard<std::mutex> g(m);
            until = submitted;
        }
        demand(this, until);
        std::unique_lock<std::mutex> g(m);
        cv.wait(g, [&] { return completed >= until; });
        show_host(until, g);
        if (!error.empty()) return fail(LAUNCH_FAILED, "%s", error.c_str());
        return OK;
    }

    // held copies of this stream (up to `upto`) until the last one whose destination overlaps [p, p + n), landed
    void land_held_under(const void* p, size_t n, uint64_t upto = UINT64_MAX) {
        std::lock_guard<std::mutex> g(m);
        const char* lo = static_cast<const char*>(p);
        size_t last = 0;
        for (size_t i = 0; i < held.size() && held[i].position <= upto; i++) {
            const char* d = static_cast<const char*>(held[i].dst);
            if (d < lo + n && lo < d + held[i].bytes.size()) last = i + 1;
        }
        for (; last > 0; last--) {
            memcpy(held.front().dst, held.front().bytes.data(), held.front().bytes.size());
            held.pop_front();
        }
    }

    // the host has synced this stream up to `position`: the copies to it until there land
    void show_host(uint64_t position, std::unique_lock<std::mutex>&) {
        while (!held.empty() && held.front().position <= position) {
            memcpy(held.front().dst, held.front().bytes.data(), held.front().bytes.size());
            held.pop_front();
        }
    }
};

void demand(Stream* s, uint64_t position) {
    {
        std::lock_guard<std::mutex> g(s->m);
        if (position <= s->demanded) return;
        s->demanded = position;
    }
    s->cv.notify_all();
}

std::mutex registry_mutex;
// Never destroyed, not even at exit: handles stay valid, and a stream may hold work nobody will ever
// demand (deferred mode), a launch of which would wait at exit for a block pool already destroyed, or
// a wait for a stream destroyed before it. The process's end stops the threads instead.
std::vector<std::unique_ptr<Stream>>& streams = *new std::vector<std::unique_ptr<Stream>>;
std::vector<std::unique_ptr<Event>>& events = *new std::vector<std::unique_ptr<Event>>;
std::vector<std::unique_ptr<Module>>& modules = *new std::vector<std::unique_ptr<Module>>;

bool valid_device(int d) { return d >= 0 && d < config.n_devices; }

// every stream of `device` (all devices: -1) has finished what was submitted so far
void drain(int device) {
    std::vector<Stream*> todo;
    {
        std::lock_guard<std::mutex> g(registry_mutex);
        for (auto& s : streams)
            if (device < 0 || s->device == device) todo.push_back(s.get());
    }
    for (Stream* s : todo) {
        uint64_t until;
        {
            std::lock_guard<std::mutex> g(s->m);
            until = s->submitted;
        }
        demand(s, until);
        std::unique_lock<std::mutex> g(s->m);
        s->cv.wait(g, [&] { return s->completed >= until; });
    }
}

}  // namespace
