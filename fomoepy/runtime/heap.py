"""Freed memory back to the OS at once, for a process whose model is larger than the memory it is given.

glibc's malloc serves a large block from its heap once a block that large has been freed (its mmap
threshold rises to the largest block freed, up to 32 MiB), and a freed heap block stays with the
process. A prefill's temporaries (graph contexts, activations: megabytes each) then stay resident after
it: on the bench model's 9 layers about 60 MB more than with the threshold held (RssAnon after a 16-token
prefill and 16 decode steps, measured by hand). Where the experts
stream from a store because the model does not fit, that memory comes out of the page cache that holds
the mapped dense weights and the store's reads: `bench/over_memory.py` at twice a 320 MiB cap decoded at
5.52 tok/s reading 123 MiB a token, and at 13.45 reading 61 with the threshold held (bench/RESULTS.md,
both recorded). Holding it at glibc's starting 128 KiB maps each large block on its own and unmaps it
when it is freed.

Not done for a model held in memory: re-faulting a prefill's temporaries page by page cost a 128-token
prompt about a fifth of its speed at 2 threads (decode unchanged; an A/B by hand, not recorded).
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h); setting it also stops its dynamic rise
THRESHOLD = 128 * 1024


@functools.cache
def return_freed_memory() -> bool:
    """Hold glibc's mmap threshold at 128 KiB for this process; False where the C library is not glibc
    (no mallopt) or refuses. Process-wide, and once: every engine in the process shares the heap."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
