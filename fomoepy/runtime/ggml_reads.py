"""Where the cpu backend's expert reads land: an arena per record size, whose buffers a step's rounds
compute from where they lie (a decode row's round, a batch of rows', a short prompt's; not a long
prompt's grouped products).

A step's misses that the cache does not keep were each copied into a staging slot of the tier's pool,
computed once and dropped: a memcpy of the whole expert in series after the step's last read (bench
model at a 25 % tier: 3.1 such copies a layer step, of 4.5 slot fills taking ~400 µs in all;
bench/host_time.py's cpu path). Reads that land in an arena (`count` record-sized buffers in one
allocation, each 4 KiB-aligned as O_DIRECT needs) are instead read by the round's products in place: the
arena is also three strided ggml tensors, gate, up and down at their offsets in each record
(DeviceReads._matrices), so `mul_mat_id` picks a buffer of it as it picks a slot. Only where
the tier's slots are plain: the products' kernels are then the same, and so are their bits. A read
beyond the arena's buffers lands in a buffer of its own (fomoepy.experts.read_buffers) and is staged by
a copy, as before. Measured on that model: slot fills 469.9 → 79.1 µs a layer step (bench/host_time.py,
recorded), `fomoe generate` 21.1-22.7 → 26.2-28.5 tok/s (three interleaved pairs by hand).

A buffer goes back to its arena when the last view of it is dropped (its step is over, a read made ahead
was not chosen), from whichever thread drops it; the last one given back is handed out first, so an
arena touches only the pages of as many buffers as were ever in use at once.
"""

from __future__ import annotations

import threading
from collections import deque

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.read_buffers import ReadBuffers
from fomoepy.runtime.ggml_slots import (
    MAX_CACHED_PICKS,
    SlotLayer,
    expert_outputs,
    graph_plan,
    round_call,
    run_graph,
)
from fomoepy.runtime.pinned import ALIGN, contiguous_address, hand_out

try:  # optional (setup.py): without it, PyReadArena and py_record_index below
    from fomoepy.runtime._host_memory import Arena, record_index
except ImportError:
    Arena = record_index = None
from fomoepy.timing import MATMUL

F32 = np.float32
_OVERHEAD = ggml.ggml_tensor_overhead()

# buffers per record size: about what is in flight at once (a step's misses, the next layer's guesses read
# ahead and not yet taken), as many as the reused read buffers kept idle before (MAX_IDLE); the reads
# beyond them get buffers of their own, of which a few are kept for the next
ARENA_BUFFERS = 16
OTHERS_IDLE = 4
# in-place rounds kept: one per split of a round's picks between slots and read buffers (a decode row of
# top-8: 44 splits), a few kB of intermediates each; building one costs about what a step's products take.
# A round of more picks than MAX_CACHED_PICKS (a prompt's) gets a graph built for the call, as
# SlotLayer.pick_outputs' do.
_MAX_ROUNDS = 64
# Rounds of several rows (a short prompt's, a batch of sequences' decode rows: a pick a row) are kept within
# this many bytes all told, the oldest dropped first; one larger alone is built for its call. Their splits
# are many and each holds its picks' rows, intermediates and outputs (~1 MB at 100 picks on the bench
# model): kept by count alone, a 16-token prompt's over a 19-layer model held ~30 MB, which under
# bench/over_memory.py's 320 MiB cap pushed the mapped dense weights out of the page cache and back in
# every token (its 4.1x case: 244 MiB read a token and 3.7 tok/s, against 192 and 6.0 before such rounds).
PER_PICK_KEPT_BYTES = 4 << 20


class PyReadArena:
    """`count` buffers of `stride` bytes (a multiple of 4 KiB) at base + i · stride; `take` from any thread.
    The definition of fomoepy/runtime/_host_memory.c's Arena, which serves where setup.py built it (a step
    takes one a read: here three frames and a lock each)."""

    def __init__(self, stride: int, count: int = ARENA_BUFFERS):
        if stride <= 0 or stride % ALIGN or count < 1:
            raise ValueError(f"expected a stride of whole 4 KiB pages and a count >= 1, got {stride} and {count}")
        self.stride, self.count = stride, count
        self._owner = np.empty(stride * count + ALIGN, np.uint8)  # (pages touched only where reads land)
        self.base = contiguous_address(self._owner) + (-contiguous_address(self._owner) % ALIGN)
        self._free = list(range(count - 1, -1, -1))  # a stack: the buffer given back last goes out first
        self._returned: deque[tuple[int, int]] = deque()  # (address, size), appended by any thread
        self._lock = threading.Lock()

    def take(self, nbytes: int | None = None) -> np.ndarray | None:
        """The first `nbytes` (None: all) of a buffer of the arena nobody holds, or None when all are held."""
        if nbytes is not None and not 0 <= nbytes <= self.stride:
            raise ValueError(f"expected 0 <= nbytes <= {self.stride}, got {nbytes}")
        with self._lock:
            while self._returned:
                self._free.append((self._returned.popleft()[0] - self.base) // self.stride)
            if not self._free:
                return None
            buf = hand_out(self.base + self._free.pop() * self.stride, self.stride, self._returned.append)
        return buf if nbytes is None else buf[:nbytes]

    def index_of(self, address: int) -> int | None:
        """The buffer that starts at `address`, or None when none of the arena's does."""
        i = buffer_at(self.base, self.stride, self.count, address)
        return i if i >= 0 else None

    @property
    def free(self) -> int:
        """Buffers nobody holds (those given back so far counted)."""
        return len(self._free) + len(self._returned)


ReadArena = Arena if Arena is not None else PyReadArena


def py_record_index(parts, sizes, base: int, stride: int, count: int) -> int:
    """The i of the buffer at base + i · stride (0 <= i < count) that `parts` fill from its start, one right
    after the other, part j sizes[j] bytes; -1 where they lie elsewhere. The definition of
    fomoepy/runtime/_host_memory.c's record_index, which serves where setup.py built it."""
    start = at = contiguous_address(parts[0])
    for part, size in zip(parts, sizes, strict=True):
        if part.nbytes != size or contiguous_address(part) != at:
            return -1
        at += size
    return buffer_at(base, stride, count, start)


def buffer_at(base: int, stride: int, count: int, address: int) -> int:
    """The i of the buffer at base + i · stride (0 <= i < count) that starts at `address`; -1 where none does
    (_host_memory.c's buffer_at, which its Arena and record_index use)."""
    i, off = divmod(address - base, stride)
    return i if off == 0 and 0 <= i < count else -1


class DeviceReads:
    """The cpu device's buffers for reads (its `host_buffer`): from the arena of the read's size while it
    has one free, else a buffer reused from read to read. `take` may be called from any thread (a read
    made ahead takes its buffer as it is issued, on whichever thread issues it: host_buffer_anywhere)."""

    def __init__(self, count: int = ARENA_BUFFERS):
        self.count = count
        self._taking = threading.Lock()
        self.arenas: dict[int, ReadArena] = {}
        self.others = ReadBuffers(max_idle=OTHERS_IDLE)
        self._tensors: dict[tuple[int, int], tuple] = {}  # (id(slot layer), id(arena)) -> (layer, arena, context, matrices)
        self._rounds: dict[tuple, InPlaceRound] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A 4 KiB-aligned uint8 buffer of exactly `nbytes` (as O_DIRECT reads need), not held by anyone."""
        size = -(-nbytes // ALIGN) * ALIGN
        arena = self.arenas.get(size)
        if arena is None:
            with self._taking:  # (one arena a size, whichever thread asks first)
                arena = self.arenas.get(size)
                if arena is None:
                    arena = self.arenas[size] = ReadArena(size, self.count)
        buf = arena.take(nbytes)  # (an arena and the others' pool each take from any thread)
        return buf if buf is not None else self.others.take(nbytes)

    def locate(self, parts, sizes: tuple[int, ...]) -> tuple[ReadArena, int] | None:
        """(the arena, the buffer) an expert's parts were read into, each part `sizes[i]` bytes right after
        the one before (a store record's layout, read into a buffer of the record's size: `take`'s arena
        of that size); None where they lie elsewhere."""
        return self.in_arena([0], {0: parts}, sizes).get(0)

    def in_arena(self, experts: list[int], fetched: dict, sizes: tuple[int, ...]) -> dict[int, tuple[ReadArena, int]]:
        """locate for each of `experts` (their parts fetched[e]): those read into the arena, with (the arena, the
        buffer); a step's misses the tier does not keep, in one frame."""
        arena = self.arenas.get(-(-sum(sizes) // ALIGN) * ALIGN)
        if arena is None:
            return {}
        index = record_index if record_index is not None else py_record_index
        base, stride, count, found = arena.base, arena.stride, arena.count, {}
        for e in experts:
            i = index(fetched[e], sizes, base, stride, count)
            if i >= 0:
                found[e] = (arena, i)
        return found

    def outputs_of_row_into(self, layer: SlotLayer, row: np.ndarray, slots: list[int], arena: ReadArena, bufs: list[int],
                            threads: int, into: np.ndarray, at_slots, at_bufs) -> None:  # fmt: skip
        """SlotLayer.pick_outputs_of_row_into for a round whose picks are partly in the layer's slots (`slots`,
        set into into[at_slots]) and partly in buffers of the arena their reads landed in (`bufs`, into
        into[at_bufs]), computed there: no copy into a staging slot first. One graph, kept per pick counts;
        each pick's output has the bits a plain slot gives it (the same one-row products)."""
        g = self._rounds.get((id(layer), len(slots), len(bufs), threads, id(arena), False))  # (_round's kept one, no frame)
        if g is None or g.layer is not layer:
            g = self._round(layer, len(slots), len(bufs), threads, arena, False)
        try:
            g.run_into(row, slots, bufs, into, at_slots, at_bufs)
        finally:
            if not g.kept:
                g.free()

    def pick_outputs(self, layer: SlotLayer, rows: np.ndarray, slots: np.ndarray, arena: ReadArena, buf_rows: np.ndarray,
                     bufs: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """SlotLayer.pick_outputs of picks partly in the layer's slots (rows [P1, K], slots [P1]) and partly in
        buffers of the arena their reads landed in (buf_rows [P2, K], bufs [P2]), computed there: each pick's
        output, [P1, K] and [P2, K], with the bits a plain slot gives it."""
        g = self._round(layer, len(slots), len(bufs), threads, arena, True)
        try:
            return g.run(rows, slots, buf_rows, bufs)
        finally:
            if not g.kept:
                g.free()

    @property
    def per_pick_bytes(self) -> int:
        """Bytes the rounds of a pick a row kept hold (within PER_PICK_KEPT_BYTES)."""
        return sum(g.nbytes for key, g in self._rounds.items() if key[5])

    def close(self) -> None:
        for g in self._rounds.values():
            g.free()
        self._rounds.clear()
        for *_, ctx, _ in self._tensors.values():
            ggml.ggml_free(ctx)
        self._tensors.clear()

    def _round(self, layer: SlotLayer, P1: int, P2: int, threads: int, arena: ReadArena, per_pick: bool) -> InPlaceRound:
        """The round kept for these picks, or a new one, kept where the bounds allow (its `kept`)."""
        key = (id(layer), P1, P2, threads, id(arena), per_pick)
        g = self._rounds.get(key)
        if g is not None and g.layer is layer:
            return g
        if g is not None:
            self._rounds.pop(key).free()
        g = InPlaceRound(layer, self._matrices(layer, arena), P1, P2, threads, per_pick)
        if P1 + P2 > MAX_CACHED_PICKS or (per_pick and g.nbytes > PER_PICK_KEPT_BYTES):
            return g  # (for its call only)
        if per_pick:  # the oldest of a pick a row dropped until it fits beside them
            held = self.per_pick_bytes
            for old in [k for k in self._rounds if k[5]]:
                if held + g.nbytes <= PER_PICK_KEPT_BYTES:
                    break
                held -= self._rounds[old].nbytes
                self._rounds.pop(old).free()
        if len(self._rounds) >= _MAX_ROUNDS:
            self._rounds.pop(next(iter(self._rounds))).free()
        g.kept = True
        self._rounds[key] = g
        return g

    def _matrices(self, layer: SlotLayer, arena: ReadArena) -> list:
        """The arena's buffers as `layer`'s three expert matrices, gate, up and down, each [n_cols, n_rows,
        arena.count] strided by the arena's buffer: a store record's parts, one after another at the start
        of its buffer, in their store form (as plain slots hold them)."""
        if any(layer.repacked):
            raise FomoeError("a round computes from its reads' buffers only where the slots are plain, as they are")
        kept = self._tensors.get((id(layer), id(arena)))
        if kept is None or kept[0] is not layer:
            ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=4 * _OVERHEAD + 1024, mem_buffer=None, no_alloc=True))
            tensors, at = [], 0
            for m in layer.mats:
                t = ggml.ggml_new_tensor_3d(ctx, m.qtype, m.n_cols, m.n_rows, arena.count)
                t.contents.data = arena.base + at
                t.contents.nb[2] = arena.stride
                t.contents.nb[3] = arena.stride * arena.count
                tensors.append(t)
                at += m.slot_nbytes
            kept = self._tensors[(id(layer), id(arena))] = (layer, arena, ctx, tensors)
        return kept[3]


class InPlaceRound:
    """A round's picks: P1 from a slot layer's tensors and P2 from a read arena's (`read_mats`), each pick's
    output unweighted into arrays of the graph's own. One token's picks share its row (as SlotLayer's
    one-row round graph), or each pick has a row of its own (per_pick: as pick_outputs' graph)."""

    def __init__(self, layer: SlotLayer, read_mats: list, P1: int, P2: int, threads: int, per_pick: bool = False):
        K, F = layer.n_embd, layer.n_ff
        self.layer = layer
        scratch = 4 * 4 * F * (P1 + P2) + 64 * 16
        mem_size = 16 * (_OVERHEAD + 64) + 2 * ggml.ggml_graph_overhead() + scratch
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem_size, mem_buffer=None, no_alloc=False))
        self.kept = False  # whether DeviceReads keeps it for later rounds (else freed after its call)
        if not self.ctx:
            raise FomoeError("ggml could not allocate a graph context")
        ctx = self.ctx
        self._slots, self._bufs = np.empty((1, P1), np.int32), np.empty((1, P2), np.int32)
        self._from_slots, self._from_bufs = np.empty((P1, K), F32), np.empty((P2, K), F32)
        # the rows: one shared [1, K], or one a pick, [P1, K] and [P2, K]
        self._rows = (np.empty((P1, K), F32), np.empty((P2, K), F32)) if per_pick else (np.empty((1, K), F32),) * 2
        ggml.ggml_set_no_alloc(ctx, True)
        picks = []
        for mats, ids, rows, out in (([m.tensor for m in layer.mats], self._slots, self._rows[0], self._from_slots),
                                     (read_mats, self._bufs, self._rows[1], self._from_bufs)):  # fmt: skip
            if ids.size:
                P = ids.shape[1]
                h = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, K, 1, P if per_pick else 1)
                h.contents.data = rows.ctypes.data
                t = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, *((1, P) if per_pick else (P, 1)))
                t.contents.data = ids.ctypes.data
                picks.append((mats, h, t, out))
        ggml.ggml_set_no_alloc(ctx, False)
        self.gf = ggml.ggml_new_graph(ctx)
        for mats, h, ids, out in picks:
            y = expert_outputs(ctx, mats, h, ids, numpy_output=True)  # [K, P, 1], or [K, 1, P] a pick a row
            y.contents.data = out.ctypes.data
            ggml.ggml_build_forward_expand(self.gf, y)
        self.plan, self.work = graph_plan(self.gf, threads)
        # a one-row round in one C call where it is built (its sets: those with picks)
        sets = [(ids, out) for ids, out in ((self._slots, self._from_slots), (self._bufs, self._from_bufs)) if ids.size]
        self._round = round_call(self.gf, self.plan, self._rows[0], sets) if not per_pick else None
        self._which = tuple(i for i, ids in enumerate((self._slots, self._bufs)) if ids.size)
        arrays = (self._slots, self._bufs, self._from_slots, self._from_bufs, *self._rows[: 2 if per_pick else 1])
        self.nbytes = mem_size + self.work.nbytes + sum(a.nbytes for a in arrays)  # what it holds

    def run_into(self, row: np.ndarray, slots: list[int], bufs: list[int], into: np.ndarray, at_slots, at_bufs) -> None:
        """One shared row: the picks' outputs set into into[at_slots] and into[at_bufs]."""
        if self._round is not None:
            if len(self._which) == 2:
                seconds = self._round(row, (slots, bufs), into, (at_slots, at_bufs))
            else:  # (the one set with picks)
                i = self._which[0]
                seconds = self._round(row, ((slots, bufs)[i],), into, ((at_slots, at_bufs)[i],))
            if seconds is not None:
                MATMUL.seconds += seconds
                return
        self._rows[0][:] = row  # (both sets read it)
        self._slots[0] = slots
        self._bufs[0] = bufs
        run_graph(self.gf, self.plan)
        if slots:
            into[at_slots] = self._from_slots
        if bufs:
            into[at_bufs] = self._from_bufs

    def run(self, rows: np.ndarray, slots: np.ndarray, buf_rows: np.ndarray, bufs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A pick a row (per_pick): fresh outputs [P1, K] and [P2, K]."""
        self._rows[0][:] = rows
        self._rows[1][:] = buf_rows
        self._slots[0] = slots
        self._bufs[0] = bufs
        run_graph(self.gf, self.plan)
        return self._from_slots.copy(), self._from_bufs.copy()

    def free(self) -> None:
        self._round = None  # (it computes this context's graph)
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None
