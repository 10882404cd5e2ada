"""ggml's threads on a shared CPU: a thread waiting for the others sleeps rather than spins.

ggml-python's libraries are built with OpenMP. A graph runs on OpenMP's thread team, which stays up
between graphs (no thread is started per graph, and ggml's own thread pool is not used: with OpenMP,
`ggml_threadpool_new` starts no threads), and ggml's barriers between a graph's nodes are OpenMP
barriers. Under OpenMP's default policy a thread that reaches a barrier first spins until the others
arrive. When another process holds one of the cores, the thread it waits for is not running while it
spins, and every node of every graph pays for that: on the 2-core machine, beside other work, one
layer's routed experts took 12-98 ms on 2 threads against 2.4-3.8 ms on 1 (bench/moe_layer.py), a
decode step 1.9-2.6 tok/s against 28-60. With OMP_WAIT_POLICY=passive a waiting thread sleeps at once
and the same layer took 0.7-6.4 ms on 2 threads, the decode step 11-39 tok/s. At a lighter load (6 on
2 cores), three interleaved runs each (64-token prefill, 32 decoded, tok/s): 1 thread 156-160 / 62-67,
2 threads passive 142-150 / 40-50, 2 threads with OpenMP's default 116-159 / 37-45, GOMP_SPINCOUNT=3000
119-121 / 23-31. No policy makes 2 threads beat 1 while another process holds a core; passive avoids
the collapse.

libgomp reads the variable once, when it is loaded (with ggml's CPU library), so this module sets it
before the first `import ggml` of the package; a value set by the user is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
SET_HERE = WAIT_POLICY not in os.environ  # whether the policy below is fomoepy's, not the user's
os.environ.setdefault(WAIT_POLICY, "passive")
