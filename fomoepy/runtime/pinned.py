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
import mmap
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fomoepy.runtime.shim import GpuError

try:  # optional (setup.py): without it the same through ctypes and PyShelf, a microsecond or so more each
    from fomoepy.runtime._host_memory import Lent, Shelf, address
except ImportError:
    Lent = Shelf = address = None

ALIGN = 4096


def host_address(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte: through the buffer protocol (a copy up asks for a
    few addresses per expert, and `a.ctypes.data` costs a microsecond and more)."""
    if address is not None:
        try:
            return address(a)
        except (BufferError, ValueError):  # not contiguous: its first element's
            return a.ctypes.data
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty
        return a.ctypes.data


# the same for an array known to be contiguous (a step's expert parts, buffers and tables): the compiled
# call itself where it is built, one call fewer each
contiguous_address = address if address is not None else host_address


def hand_out(address: int, size: int, give_back) -> np.ndarray:
    """A uint8 array over [address, address + size) that calls give_back((address, size)) once the last
    view of it is gone, from whichever thread drops it."""
    if Lent is not None:  # (the memory object and its give-back in one compiled object)
        return np.frombuffer(Lent(address, size, (address, size), give_back), np.uint8)
    array_type = _ARRAY_TYPES.get(size)
    if array_type is None:  # (ctypes makes the type of each size anew at every `c_uint8 * size`)
        array_type = _ARRAY_TYPES[size] = ctypes.c_uint8 * size
    memory = array_type.from_address(address)
    memory._fomoe_return = GiveBack((address, size), give_back)
    return np.frombuffer(memory, np.uint8)


_ARRAY_TYPES: dict[int, Any] = {}  # ctypes array types by size: a pool's buffers come in a few sizes


def _mapping_address(mapping: mmap.mmap) -> int:
    """A mapping's first byte's address, with no view of it left open (a mapping with one cannot close)."""
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view
    return address


class GiveBack:
    """Hung on a buffer's memory object: when the last view of it goes, so does this, which gives the
    buffer back (cheaper than a weakref.finalize per buffer handed out)."""

    __slots__ = ("key", "sink")

    def __init__(self, key: tuple[int, int], sink: Any):
        self.key = key
        self.sink = sink

    def __del__(self) -> None:
        self.sink(self.key)


class PyShelf:
    """A pinned pool's buffers by size: those never handed out (`fresh`, a stack per size: a chunk's are
    handed out from its start), those given back (`free`, a queue per size, each with the count of points
    marked when it came back: free of its copies once a later point has passed) and those given back since
    the last take, by any thread (`_returned`). The definition of fomoepy/runtime/_host_memory.c's Shelf,
    which the pool uses where it is built: a decode step takes about seven buffers (its reads, the next
    layer's guesses, its copies down), and each comes back once.

    `written` (address -> number): the buffers a copy down wrote; taking one calls settle(number) first
    (PinnedPool.written)."""

    def __init__(self, written: dict[int, int], settle: Callable[[int], None] | None):
        self.written, self.settle = written, settle
        self.marks = 0  # points marked on the copy streams so far (PinnedPool.mark)
        self.passed = 0  # the newest of them known complete
        self.fresh: dict[int, list[int]] = {}
        self.free: dict[int, deque[tuple[int, int]]] = {}
        self._returned: deque[tuple[tuple[int, int], int]] = deque()

    def take(self, size: int) -> np.ndarray | None:
        """A buffer of `size` bytes no copy may still read: one never handed out, else the longest given
        back whose mark has passed; None when there is none."""
        if self._returned:
            self._collect()
        fresh = self.fresh.get(size)
        if fresh:  # one never handed out first: those given back age meanwhile
            return self._lend(fresh.pop(), size)
        queue = self.free.get(size)
        if queue and self.passed > queue[0][1]:
            return self._lend(queue.popleft()[0], size)
        return None

    def take_waiting(self, size: int) -> np.ndarray:
        """The longest given back, its mark passed or not (the pool has waited for every copy)."""
        if self._returned:
            self._collect()
        queue = self.free.get(size)
        if not queue:
            raise LookupError("no buffer of this size was given back")
        return self._lend(queue.popleft()[0], size)

    def add_fresh(self, size: int, start: int, count: int) -> None:
        """A chunk's `count` buffers of `size` bytes from `start`, handed out from its start."""
        self.fresh.setdefault(size, []).extend(start + i * size for i in reversed(range(count)))

    def waiting(self, size: int) -> int:
        """Buffers of `size` bytes given back and not taken again."""
        if self._returned:
            self._collect()
        return len(self.free.get(size, ()))

    def held(self) -> int:
        """Buffers on the shelf, fresh and given back."""
        self._collect()
        return sum(map(len, self.fresh.values())) + sum(map(len, self.free.values()))

    def returned(self) -> list[int]:
        """The addresses given back since the last take."""
        return [address for (address, _), _ in self._returned]

    def clear(self) -> None:
        self.fresh.clear()
        self.free.clear()
        self._returned.clear()

    def _lend(self, address: int, size: int) -> np.ndarray:
        if self.written:
            written = self.written.pop(address, None)
            if written is not None and self.settle is not None:
                self.settle(written)
        return hand_out(address, size, self._given_back)

    def _given_back(self, key: tuple[int, int]) -> None:
        self._returned.append((key, self.marks))

    def _collect(self) -> None:
        while self._returned:
            (address, size), mark = self._returned.popleft()
            self.free.setdefault(size, deque()).append((address, mark))


# the mappings of pools closed while buffers of theirs were still out (a read in flight at a reset), kept
# for the life of the process: those buffers may still be written and copied from, and a mapping dropped
# with its pool unmaps its pages under them and leaves the driver a registration of pages no longer there
# (on an H200 a later allocation was then refused, CUDA_ERROR_ALREADY_MAPPED). A pool closed again once
# they are back releases them from the same dict.
_OUTLIVING: dict[int, dict[int, mmap.mmap]] = {}  # id of a pool's mappings -> them (held: the id stays theirs)

CHUNK_BYTES = 64 << 20  # pinned memory is taken from the driver this much at a time (its calls are slow)
# A buffer given back is free once a point marked after it has passed, about a step later (a step gives
# back read buffers it does not keep and host-tier evictees). A take that finds only such buffers takes a
# new one instead of waiting for every copy queued, this step's included (at the 397B shape with a
# demoting policy that wait was 0.36 ms of a 2.5 ms step on the emulated device), while the buffers
# waiting for a point hold at most this much: about two steps' worth of 7 MiB experts. Past it (points
# not passing as they should) a take waits, so the pool's idle page-locked memory stays bounded.
SPARE_BYTES = 4 * CHUNK_BYTES
# Page-locked memory is slow to take: on an H200's host (driver 580, cuda-python 13.3), 34-40 ms for 64 MiB
# through the driver's own allocation, which holds the GIL and blocks every other thread's driver calls
# all the while; a 397B decode step is under 1 ms, and while the host tier fills a step at that shape took
# a new chunk every dozen steps (bench/host_time.py --real-gpu, 16 tokens warm: p90 34-45 ms a step). Most
# of that time is the kernel faulting the pages in (an anonymous mapping populated: 26-31 ms, no driver
# lock, no GIL); registering the faulted pages with the driver then takes 4-5 ms (its lock held, the GIL
# not). So a chunk is mapped and populated, then registered (`_take_chunk`); and a size that has needed a
# second chunk is growing, so from then on its next chunk is taken on a thread of its own while the steps
# run: the take that needs it finds it ready. At most one such chunk per size waits unused, besides those a
# host tier reserves at load (`reserve`).


def reserve_bytes(total: int, sizes: list[int]) -> dict[int, int]:
    """A host tier of `total` bytes over layers whose experts take `sizes` bytes each, as bytes per size:
    each layer's share in proportion to its expert's size (each layer holding as many experts)."""
    out: dict[int, int] = {}
    whole = sum(sizes)
    for size in sizes:
        out[size] = out.get(size, 0) + total * size // whole
    return out


class PinnedPool:
    def __init__(self, rt: Any, copy_streams: list[Any], chunk_bytes: int = CHUNK_BYTES, spare_bytes: int = SPARE_BYTES,
                 settle_writes: Callable[[int], None] | None = None, grow_ahead: bool = True,
                 shelf: type | None = None):  # fmt: skip
        """shelf: the buffers' bookkeeping (Shelf where it is built, else PyShelf; a test's choice)."""
        self.rt = rt
        self.chunk_bytes = chunk_bytes
        self.spare_bytes = spare_bytes  # given back, not yet known free: past this much a take waits
        # Buffers a copy down wrote (address -> its number, `device_writes`): a point on the copy streams
        # proves the copy done on the device, but the host's view of its bytes is current only once the host
        # has waited for that copy itself (or anything after it on its stream); until then a write of the
        # host's own (a read landing in the buffer) could be overwritten. `settle_writes(n)` makes the
        # host wait so, for the copies down up to number n (the device's; None: no copy down writes here).
        self.written: dict[int, int] = {}
        self.copy_streams = copy_streams
        # the buffers never handed out, and those given back: free of their copies once a point marked after
        # they came back is known complete (passed > its mark), then for good (points only pass)
        self.shelf = (shelf or Shelf or PyShelf)(self.written, settle_writes)
        self.blocks: list[int] = []  # what the driver gave, freed at close
        self.addresses: set[int] = set()  # every buffer's start (close counts them back)
        self.events: list[Any] = []  # the events a wait records, reused
        self._starts: list[int] = []  # the blocks' usable spans, sorted by start: what `pins` searches
        self._ends: list[int] = []
        self.grow_ahead = grow_ahead
        self.chunks: dict[int, int] = {}  # size → chunks taken for it so far
        # size → its chunks taken ahead, oldest first: (a future of the chunk's address, its buffer count)
        self.ahead: dict[int, deque[tuple[Future, int]]] = {}
        self._taker: ThreadPoolExecutor | None = None  # the thread that takes them
        self._mappings: dict[int, mmap.mmap] = {}  # a registered chunk's address → its mapping
        self._registers: bool | None = None  # whether the driver registers host memory (asked at the first chunk)

    def take(self, nbytes: int) -> np.ndarray:
        """A pinned uint8 buffer of at least `nbytes`, free of any copy still reading it."""
        size = -(-nbytes // ALIGN) * ALIGN
        buf = self.shelf.take(size)  # one never handed out, else the longest given back and free of its copies
        if buf is not None:
            return buf
        waiting = self.shelf.waiting(size)
        if not waiting or waiting * size <= self.spare_bytes:
            # none given back is known free of its copies (they came back after the last point marked): a
            # new chunk, while those waiting for a point are few
            self._grow(size)
            return self.shelf.take(size)
        # spare spent: wait for every copy queued, which frees all given back so far, at once
        self._wait_for_copies()
        return self.shelf.take_waiting(size)

    def device_writes(self, address: int, number: int) -> None:
        """Copy down `number` writes the buffer at `address` (see `written`)."""
        self.written[address] = number

    def pins(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in this pool's page-locked memory (a copy may read it in
        place)."""
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + nbytes <= self._ends[i]

    def mark(self) -> int:
        """The device marked a point on the copy streams (an event recorded after its copies, which its
        compute stream waits for); returns its number, for `passed`."""
        self.shelf.marks += 1
        return self.shelf.marks

    def passed_mark(self, mark: int) -> None:
        """Point `mark` is known complete (the device waited for work ordered after it): every copy queued
        before it is done."""
        self.shelf.passed = max(self.shelf.passed, mark)

    @property
    def passed(self) -> int:
        return self.shelf.passed

    @property
    def settle_writes(self) -> Callable[[int], None] | None:
        return self.shelf.settle

    @settle_writes.setter
    def settle_writes(self, settle: Callable[[int], None] | None) -> None:
        self.shelf.settle = settle

    def _wait_for_copies(self) -> None:
        """Every copy queued on the copy streams so far is done: events recorded now, waited for (a later
        record waits for more copies than needed, never fewer)."""
        for stream in self.copy_streams:
            event = self.events.pop() if self.events else self.rt.event()
            self.rt.record(event, stream)
            self.rt.event_sync(event)
            self.events.append(event)
        self.shelf.marks += 1  # a point past every buffer given back so far, complete
        self.shelf.passed = self.shelf.marks

    def reserve(self, nbytes: int, total: int) -> None:
        """Chunks for about `total` bytes of buffers of `nbytes` each, taken ahead on the pool's thread, in
        order: a host tier's worth while the model loads and its first tokens run (`reserve_bytes`), so
        that its filling finds them ready."""
        size = -(-nbytes // ALIGN) * ALIGN
        count = self._per_chunk(size)
        for _ in range(-(-total // (count * size))):
            self._take_ahead(size, count)

    def release_ahead(self) -> None:
        """Give back the chunks taken ahead and not yet handed out; those not started are never taken."""
        for queue in self.ahead.values():
            for future, _ in queue:
                if not future.cancel() and future.exception() is None:
                    self._release_chunk(future.result())
        self.ahead.clear()

    def _per_chunk(self, size: int) -> int:
        """Buffers of `size` bytes in one chunk."""
        return max(1, self.chunk_bytes // size)

    def _take_ahead(self, size: int, count: int) -> None:
        if self._registers is None:  # asked here, on the taking thread, before any chunk is taken on the pool's
            self._registers = self._driver_registers()
        if self._taker is None:
            self._taker = ThreadPoolExecutor(1, thread_name_prefix="fomoe-pinned")
        self.ahead.setdefault(size, deque()).append((self._taker.submit(self._take_chunk, count * size + ALIGN), count))

    def _grow(self, size: int) -> None:
        """A chunk of buffers of `size`, never handed out yet: the oldest taken ahead for it (waited for,
        if still being taken), else one taken now."""
        ahead = self.ahead.get(size)
        if ahead:
            future, count = ahead.popleft()
            base = future.result()
        else:
            count = self._per_chunk(size)
            base = self._take_chunk(count * size + ALIGN)
        self.blocks.append(base)
        start = -(-base // ALIGN) * ALIGN
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, start + count * size)
        self.addresses.update(range(start, start + count * size, size))
        self.shelf.add_fresh(size, start, count)
        self.chunks[size] = self.chunks.get(size, 0) + 1
        if self.grow_ahead and self.chunks[size] >= 2 and not self.ahead.get(size):  # growing: its next taken meanwhile
            self._take_ahead(size, self._per_chunk(size))

    def _take_chunk(self, nbytes: int) -> int:
        """nbytes of page-locked memory: an anonymous mapping the kernel populates, registered with the
        driver (see above); where the driver registers no host memory, its own allocation."""
        if self._registers is None:
            self._registers = self._driver_registers()
        if not self._registers:
            return self.rt.host_alloc(nbytes)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        base = _mapping_address(mapping)
        try:
            self.rt.host_register(base, nbytes)
        except Exception:
            mapping.close()
            raise
        self._mappings[base] = mapping
        return base

    def _driver_registers(self) -> bool:
        """Whether the driver registers host memory: asked with one page."""
        page = mmap.mmap(-1, mmap.PAGESIZE)
        base = _mapping_address(page)
        try:
            self.rt.host_register(base, mmap.PAGESIZE)
        except GpuError:
            return False
        else:
            self.rt.host_unregister(base)
            return True
        finally:
            page.close()

    def _release_chunk(self, base: int) -> None:
        mapping = self._mappings.pop(base, None)
        if mapping is None:
            self.rt.host_free(base)
        else:
            self.rt.host_unregister(base)
            mapping.close()

    def close(self) -> None:
        """Give the pinned memory back once every buffer is back and every copy done; while one is still
        held (a read in flight at a reset) the memory stays with the process instead of under its feet.
        The chunks taken ahead, never handed out, go back whatever is held."""
        self.release_ahead()
        if self._taker is not None:
            self._taker.shutdown()
            self._taker = None
        if self.shelf.held() < len(self.addresses):
            _OUTLIVING[id(self._mappings)] = self._mappings
            return
        for stream in self.copy_streams:
            self.rt.sync(stream)
        for base in self.blocks:
            self._release_chunk(base)
        _OUTLIVING.pop(id(self._mappings), None)
        self.blocks.clear()
        self.shelf.clear()
        self.written.clear()
        self.addresses.clear()
        self._starts.clear()
        self._ends.clear()
