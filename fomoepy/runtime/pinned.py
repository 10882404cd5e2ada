"""Pinned host buffers that expert reads land in, so an expert's copy up to the device is a DMA straight
from where its bytes already are: no memcpy into a staging buffer, which for a 7 MiB expert costs the
host about a millisecond, ten times the whole step's budget.

A buffer is a numpy array over page-locked memory (4 KiB-aligned, as O_DIRECT reads need). It goes back
to the pool when the last view of it is dropped (the host tier evicted it, or the step that streamed it
is over), from whichever thread drops it. It is handed out again only after the copies queued on the
device's copy streams by then have completed: a copy may still be reading it.
"""

from __future__ import annotations

import bisect
import ctypes
from collections import deque
from typing import Any

import numpy as np

ALIGN = 4096


def host_address(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte: through the buffer protocol where the array is
    writable (a fifth of what `a.ctypes.data` costs, and a copy up asks for a few addresses per expert)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty
        return a.ctypes.data


class _Return:
    """Hung on a buffer's memory object: when the last view of it goes, so does this, which gives the
    buffer back (cheaper than a weakref.finalize per buffer handed out)."""

    __slots__ = ("key", "sink")

    def __init__(self, key: tuple[int, int], sink: Any):
        self.key = key
        self.sink = sink

    def __del__(self) -> None:
        self.sink(self.key)
CHUNK_BYTES = 64 << 20  # pinned memory is taken from the driver this much at a time (its calls are slow)


class _Fence:
    """The events recorded on the copy streams when a batch of buffers came back: once one buffer of the
    batch has waited for them, the others need not (a wait is a driver call, and a step takes several
    buffers returned together)."""

    __slots__ = ("done", "events")

    def __init__(self, events: list[Any]):
        self.events = events
        self.done = False


class PinnedPool:
    def __init__(self, rt: Any, copy_streams: list[Any], chunk_bytes: int = CHUNK_BYTES):
        self.rt = rt
        self.chunk_bytes = chunk_bytes
        self.copy_streams = copy_streams
        self.free: dict[int, deque[tuple[int, _Fence | None]]] = {}  # size → (address, fence)
        self.returned: deque[tuple[int, int]] = deque()  # (address, size), appended by any thread
        self.blocks: list[int] = []  # what the driver gave, freed at close
        self.addresses: set[int] = set()  # every buffer's start (close counts them back)
        self.events: list[Any] = []  # fences no longer needed, for reuse
        self._starts: list[int] = []  # the blocks' usable spans, sorted by start: what `pins` searches
        self._ends: list[int] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A pinned uint8 buffer of at least `nbytes`, free of any copy still reading it."""
        size = -(-nbytes // ALIGN) * ALIGN
        self._collect()
        queue = self.free.get(size)
        if not queue:
            self._grow(size)
            queue = self.free[size]
        address, fence = queue.popleft()
        if fence is not None and not fence.done:
            for event in fence.events:
                self.rt.event_sync(event)  # the copies that may have read it: done, almost always already
            fence.done = True
            self.events.extend(fence.events)  # free to record again: no buffer of this batch waits on them now
        memory = (ctypes.c_uint8 * size).from_address(address)
        memory._fomoe_return = _Return((address, size), self.returned.append)
        return np.frombuffer(memory, np.uint8)

    def pins(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in this pool's page-locked memory (a copy may read it in
        place)."""
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + nbytes <= self._ends[i]

    def _collect(self) -> None:
        """Buffers given back since the last take: fenced by one event per copy stream, recorded now (a
        later record waits for more copies than needed, never fewer)."""
        if not self.returned:
            return
        events = []
        for stream in self.copy_streams:
            event = self.events.pop() if self.events else self.rt.event()
            self.rt.record(event, stream)
            events.append(event)
        fence = _Fence(events)
        while self.returned:
            address, size = self.returned.popleft()
            self.free.setdefault(size, deque()).append((address, fence))

    def _grow(self, size: int) -> None:
        count = max(1, self.chunk_bytes // size)
        base = self.rt.host_alloc(count * size + ALIGN)
        self.blocks.append(base)
        start = -(-base // ALIGN) * ALIGN
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + count * size)
        queue = self.free.setdefault(size, deque())
        for i in range(count):
            self.addresses.add(start + i * size)
            queue.append((start + i * size, None))

    def close(self) -> None:
        """Give the pinned memory back once every buffer is back and every copy done; while one is still
        held (a read in flight at a reset) the memory stays with the process instead of under its feet."""
        self._collect()
        if sum(len(q) for q in self.free.values()) < len(self.addresses):
            return
        for stream in self.copy_streams:
            self.rt.sync(stream)
        for base in self.blocks:
            self.rt.host_free(base)
        self.blocks.clear()
        self.free.clear()
        self.addresses.clear()
        self._starts.clear()
        self._ends.clear()
