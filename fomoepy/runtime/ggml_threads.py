"""ggml's threads on a shared CPU: a waiting thread spins only where each thread has a core of its own.

ggml-python's libraries are built with OpenMP. A graph runs on OpenMP's thread team, which stays up
between graphs (no thread is started per graph, and ggml's own thread pool is not used: with OpenMP,
`ggml_threadpool_new` starts no threads), and ggml's barriers between a graph's nodes are OpenMP
barriers. Under OpenMP's default policy (llama.cpp's) a thread that reaches a barrier first spins a
while (libgomp: 300,000 turns) before it sleeps. What that is worth depends on whether the thread it
waits for has a core. Measured on the 2-core machine, bench model (bench/cpu_decode.py's), 2 threads,
decode tok/s, two runs each:

| waiting thread | idle machine | another process busy on one core |
|---|---|---|
| sleeps at once (OMP_WAIT_POLICY=passive) | 84, 105 | 92, 90 |
| spins 1,000 turns | 99, 111 | 78, 73 |
| spins 10,000 | 124, 124 | 36, 35 |
| spins 30,000 | 131, 131 | 32, 27 |
| spins 300,000 (OpenMP's default) | 121, 118 | 35, 47 |

Idle, a decode graph's barriers come every few microseconds and a sleeping thread pays a wake-up at
each one; beside a busy process the thread waited for is often not running, and the spinner burns the
core it needs (earlier, at a load of 6, one layer's experts took 12-98 ms on 2 threads against 2.4-3.8
on 1). No spin count serves both, so the policy follows the machine: when the engine opens the cpu
backend (`choose`), ggml's threads keep OpenMP's default if each has a core that other processes left
free at that moment, and sleep at once otherwise, or when ggml is loaded without a thread count in
hand. With no `-t` the engine's thread count is the free cores, and a decode row's products then run on
1 or all of them as measured (fomoepy.runtime.row_threads), re-measured now and then, so load that comes
later moves them to 1 thread, where nothing waits.

libgomp reads the environment once, when it is loaded (with ggml's CPU library): this module sets the
fallback when it is imported, before the package's first `import ggml`, and `choose` must run before
that import to count. A policy or spin count set by the user is kept.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
SET_HERE = WAIT_POLICY not in os.environ and SPIN_COUNT not in os.environ  # the policy is fomoepy's, not the user's
if SET_HERE:
    os.environ[WAIT_POLICY] = "passive"  # until `choose` finds a core for each thread


def choose(threads: int, free_cores) -> str:
    """Before ggml is loaded: OpenMP's default wait policy (spin, then sleep) if each of `threads` has a
    free core (free_cores(): the cores other processes leave free, asked only when it matters), else
    passive. Returns the policy in force: "passive", "default", or the user's value ("user: ...")."""
    if SET_HERE and not loaded() and threads > 1:
        if threads <= free_cores():
            os.environ.pop(WAIT_POLICY, None)
        else:
            os.environ[WAIT_POLICY] = "passive"
    return in_force()


def loaded() -> bool:
    """Whether ggml, and with it libgomp, is loaded: its reading of the environment is over."""
    return "ggml" in sys.modules


def in_force() -> str:
    if not SET_HERE:
        return "user: " + ", ".join(f"{k}={os.environ[k]}" for k in (WAIT_POLICY, SPIN_COUNT) if k in os.environ)
    return os.environ.get(WAIT_POLICY, "default")


def spins() -> bool:
    """Whether a waiting thread spins a while before it sleeps under the policy in force."""
    spin_count = os.environ.get(SPIN_COUNT)
    if spin_count is not None:
        return spin_count.strip() not in ("0", "")
    return os.environ.get(WAIT_POLICY, "").strip().lower() != "passive"
