"""Buffers that expert reads land in, reused from read to read where no device gives pinned ones.

An engine whose memory is bounded (a store, a --ram-cache) holds glibc's mmap threshold at 128 KiB
(fomoepy.runtime.heap), so each expert-sized buffer allocated for a read is mapped on its own, its pages
faulted in by the read, and unmapped when the step drops it (a read made ahead that its layer did not
choose, a miss once it is in its slot). At the bench model's 0.9 MB experts, handing a step its reads
made ahead, which drops the unchosen ones (1.4 a step), took 80-90 µs of the inference thread's CPU a
step, and 15-18 with buffers reused; with the threshold free to rise instead, the cpu backend's host
time per MoE layer step at a 25 % tier fell from about 910 to 740 µs (bench/host_time.py's cpu path;
all by hand, not recorded). A buffer here goes back to
its pool when the last view of it is dropped (the host tier evicted it, its step is over), from whichever
thread drops it, and is handed out again as it is: its pages stay mapped.

The pool keeps at most `max_idle` buffers that nobody holds (the rest are freed), so what it adds to a
bounded engine's memory is that many experts' bytes; buffers in use are the reads' own, as before.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from fomoepy.runtime.pinned import ALIGN, hand_out

MAX_IDLE = 16  # about what is in flight at once: the store's reads, reads made ahead, a step's misses


class ReadBuffers:
    """`take(nbytes)` from any thread (a read made ahead takes its buffer as it is issued, on whichever
    thread issues it); buffers come back from any thread."""

    def __init__(self, max_idle: int = MAX_IDLE):
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._owners: dict[int, np.ndarray] = {}  # address -> the allocation a buffer views (kept alive here)
        self._idle: dict[int, list[int]] = {}  # size -> addresses nobody holds
        self._n_idle = 0
        self._returned: deque[tuple[int, int]] = deque()  # (address, size), appended by any thread
        self.allocated = 0  # buffers allocated so far (each reuse is one allocation fewer)

    def take(self, nbytes: int) -> np.ndarray:
        """A 4 KiB-aligned uint8 buffer of exactly `nbytes` (as O_DIRECT reads need), not held by anyone."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._collect()
            free = self._idle.get(size)
            if free:
                address = free.pop()
                self._n_idle -= 1
            else:
                owner = np.empty(size + ALIGN, np.uint8)
                address = owner.ctypes.data + (-owner.ctypes.data % ALIGN)
                self._owners[address] = owner
                self.allocated += 1
        return hand_out(address, size, self._returned.append)[:nbytes]

    @property
    def idle(self) -> int:
        """Buffers nobody holds, kept for the next reads (those given back since the last take counted)."""
        with self._lock:
            self._collect()
            return self._n_idle

    def _collect(self) -> None:
        while self._returned:
            address, size = self._returned.popleft()
            if self._n_idle >= self.max_idle:
                del self._owners[address]  # beyond what is kept: freed
                continue
            self._idle.setdefault(size, []).append(address)
            self._n_idle += 1
