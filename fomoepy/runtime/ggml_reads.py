"""Where the cpu backend's expert reads land: an arena per record size, whose buffers a decode round
computes from where they lie.

A step's misses that the cache does not keep were each copied into a staging slot of the tier's pool,
computed once and dropped: a memcpy of the whole expert in series after the step's last read (bench
model at a 25 % tier: 3.1 such copies a layer step, of 4.5 slot fills taking ~400 µs in all;
bench/host_time.py's cpu path). Reads that land in an arena (`count` record-sized buffers in one
allocation, each 4 KiB-aligned as O_DIRECT needs) are instead read by the round's products in place: the
arena is also three strided ggml tensors, gate, up and down at their offsets in each record
(ggml_slots.SlotLayer.read_tensors), so `mul_mat_id` picks a buffer of it as it picks a slot. Only where
the tier's slots are plain: the products' kernels are then the same, and so are their bits. A read
beyond the arena's buffers lands in a buffer of its own (fomoepy.experts.read_buffers) and is staged by
a copy, as before.

A buffer goes back to its arena when the last view of it is dropped (its step is over, a read made ahead
was not chosen), from whichever thread drops it; the last one given back is handed out first, so an
arena touches only the pages of as many buffers as were ever in use at once.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from fomoepy.experts.read_buffers import ReadBuffers
from fomoepy.runtime.pinned import ALIGN, contiguous_address, hand_out

# buffers per record size: about what is in flight at once (a step's misses, the next layer's guesses read
# ahead and not yet taken), as many as the reused read buffers kept idle before (MAX_IDLE); the reads
# beyond them get buffers of their own, of which a few are kept for the next
ARENA_BUFFERS = 16
OTHERS_IDLE = 4


class ReadArena:
    """`count` buffers of `stride` bytes (a multiple of 4 KiB) at base + i · stride."""

    def __init__(self, stride: int, count: int = ARENA_BUFFERS):
        if stride <= 0 or stride % ALIGN or count < 1:
            raise ValueError(f"expected a stride of whole 4 KiB pages and a count >= 1, got {stride} and {count}")
        self.stride, self.count = stride, count
        self._owner = np.empty(stride * count + ALIGN, np.uint8)  # (pages touched only where reads land)
        self.base = contiguous_address(self._owner) + (-contiguous_address(self._owner) % ALIGN)
        self._free = list(range(count - 1, -1, -1))  # a stack: the buffer given back last goes out first
        self._returned: deque[tuple[int, int]] = deque()  # (address, size), appended by any thread

    def take(self) -> np.ndarray | None:
        """A buffer of the arena nobody holds, or None when all are held."""
        while self._returned:
            self._free.append((self._returned.popleft()[0] - self.base) // self.stride)
        if not self._free:
            return None
        return hand_out(self.base + self._free.pop() * self.stride, self.stride, self._returned.append)

    def index_of(self, address: int) -> int | None:
        """The buffer that starts at `address`, or None when none of the arena's does."""
        i, off = divmod(address - self.base, self.stride)
        return i if off == 0 and 0 <= i < self.count else None

    @property
    def free(self) -> int:
        """Buffers nobody holds (those given back so far counted)."""
        return len(self._free) + len(self._returned)


class DeviceReads:
    """The cpu device's buffers for reads (its `host_buffer`): from the arena of the read's size while it
    has one free, else a buffer reused from read to read."""

    def __init__(self, count: int = ARENA_BUFFERS):
        self.count = count
        self.arenas: dict[int, ReadArena] = {}
        self.others = ReadBuffers(max_idle=OTHERS_IDLE)

    def take(self, nbytes: int) -> np.ndarray:
        """A 4 KiB-aligned uint8 buffer of exactly `nbytes` (as O_DIRECT reads need), not held by anyone."""
        size = -(-nbytes // ALIGN) * ALIGN
        arena = self.arenas.get(size)
        if arena is None:
            arena = self.arenas[size] = ReadArena(size, self.count)
        buf = arena.take()
        if buf is None:
            return self.others.take(nbytes)
        return buf[:nbytes] if nbytes != size else buf

    def locate(self, parts, sizes: tuple[int, ...]) -> tuple[ReadArena, int] | None:
        """(the arena, the buffer) an expert's parts were read into, each part `sizes[i]` bytes right after
        the one before (a store record's layout); None where they lie elsewhere."""
        start = contiguous_address(parts[0])
        at = start
        for part, size in zip(parts, sizes, strict=True):
            if part.nbytes != size or contiguous_address(part) != at:
                return None
            at += size
        for arena in self.arenas.values():
            i = arena.index_of(start)
            if i is not None:
                return arena, i
        return None
