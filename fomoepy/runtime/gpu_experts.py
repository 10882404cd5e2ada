"""Routed experts on the GPU: the device tier's slots hold each expert's store bytes (quantised), and
grouped launches compute every selected expert of a layer straight from its slot: one per stage, or,
when some experts are in slots and others are being copied up, one per stage for each group.

The MoE step (fomoepy.experts.step) decides where each expert comes from, as on the CPU; this class
is its device (fomoepy.experts.device.ExpertDevice): it only fills and reads device slots. A miss is
copied host → device on the copy stream, straight from its pinned read buffer or through a ring of
pinned staging buffers (the host side packs buffer i+1 while buffer i crosses PCIe), and the compute
stream waits on an event, not the host. The experts already in slots are computed first (their gate/up
and down stages, launched before any wait on the copies), then each stretch of copied ones as soon as
its copies are issued, then one combine of every pair (the same sums as one launch over all of them:
moe_tables.py; the tables and launches themselves: fomoepy.runtime.gpu_launches). A demoting policy's
evictees are copied device → host on a third stream, beside the copies up. What says when a slot, a
pinned or a staging buffer may be touched again is each device's bookkeeping
(fomoepy.runtime.gpu_sides.DeviceSide). On one device, with the binding's C functions in use, a step's
begin, compute, copies down and evictions are each one C call over the same books (DecodeExperts,
fomoepy/runtime/_decode_experts.c); the methods here stay the definition and serve everywhere else.
Slot layout, mirrored in the staging buffers so one copy moves an expert:

    | gate (F rows) | pad to 256 | up (F rows) | pad to 256 | down (D rows) |
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fomoepy.experts.device import StepExperts
from fomoepy.experts.policy import Key
from fomoepy.experts.read_ahead import GPU_READ_AHEAD_PAYS
from fomoepy.experts.routing import Routing
from fomoepy.experts.source import LayerExperts
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.gpu_arrays import DeviceArray, DeviceBuffer
from fomoepy.runtime.gpu_launches import ExpertLaunches, Launch
from fomoepy.runtime.gpu_sides import DeviceSide
from fomoepy.runtime.pinned import ALIGN, PinnedPool, contiguous_address
from fomoepy.scheduler import relay

try:  # optional (setup.py): without it a step's device work is made in Python (the same calls), over a dict
    from fomoepy.runtime._driver_calls import Calls, DecodeExperts, ResidentMap
except ImportError:
    Calls = DecodeExperts = ResidentMap = None

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]

SLOT_ALIGN = 256
# slots a device side may hold beyond its tier so that a step's copies up need not wait for the copies down
# of the slots it evicts (those are reused a step later): one step's evictions, at most; 8 of the 397B's
# 7.25 MiB experts are 58 MiB
SPARE_SLOTS = 8


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Where gate, up and down sit in one slot of a layer: their offsets, their (start, end) spans, the end
    of the last (the bytes a copy moves) and the slot's padded size."""

    offsets: tuple[int, int, int]
    spans: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    end: int
    nbytes: int

    @classmethod
    def of(cls, layout: LayerExperts) -> SlotLayout:
        g, u, d = (p.nbytes for p in layout.parts)
        up = _align(g)
        down = up + _align(u)
        return cls((0, up, down), ((0, g), (up, up + u), (down, down + d)), down + d, _align(down + d))


def gpu_expert_nbytes(layout: LayerExperts) -> int:
    """Bytes of one device slot of `layout`'s layer (the device tier's unit on this backend)."""
    return SlotLayout.of(layout).nbytes


@dataclass(slots=True)
class _Begun:
    """A decode step's work made before its cache plan (GpuExperts.begin): the experts the device held
    then, launched; those at hand then (after them in the tables), copied up; the launch."""

    layer: int
    ids: np.ndarray  # the step's own (compute knows its step's begin by them)
    held: list[int]
    at_hand: list[int]
    run: Launch  # the step's tables, uploaded with every slot, and its arrays
    slots: dict[int, DeviceBuffer]  # the slots of the experts not held (those at hand and the reads)
    copied: dict[int, DeviceBuffer]  # of them, those at hand, copied up


class GpuExperts:
    """The routed-expert device of a MoE layer on the GPU (fomoepy.experts.device.ExpertDevice).

    `devs` is one backend, or one per device with `device_of_layer` placing each layer's slots
    (the scheduler's placement): each device has its own slots, staging buffers and streams."""

    can_download = True  # a slot's bytes are the store's: a demoted expert is copied down, not re-read
    read_ahead_pays = GPU_READ_AHEAD_PAYS  # below this share of guesses read right, reading ahead is turned off
    plans_beside = True  # a step's cache plan and commit run beside its launches and copies up (ExpertStreamer)

    def __init__(self, layers: tuple[LayerExperts, ...], devs: GpuBackend | list[GpuBackend], routers: list | None = None,
                 device_of_layer: tuple[int, ...] | None = None):  # fmt: skip
        self.devs = list(devs) if isinstance(devs, (list, tuple)) else [devs]
        self.device_of_layer = tuple(device_of_layer) if device_of_layer is not None else (0,) * len(layers)
        if len(self.device_of_layer) != len(layers) or max(self.device_of_layer) >= len(self.devs):
            raise ValueError(f"device_of_layer {self.device_of_layer} does not fit {len(layers)} layers on {len(self.devs)} devices")
        self.dev = self.devs[0]
        self.layers = layers
        self.routers = routers
        self.slot_layouts = [SlotLayout.of(layer) for layer in self.layers]
        # the device tier's slots by (layer, expert): an array per layer where built (a step asks it some thirty
        # times; a dict's tuple keys are made, hashed and compared each time), else a dict
        self.resident: dict[Key, DeviceBuffer] = ResidentMap(len(layers)) if ResidentMap is not None else {}
        self.sides: list[DeviceSide] = []
        for d, dev in enumerate(self.devs):
            on_d = [s.nbytes for s, owner in zip(self.slot_layouts, self.device_of_layer) if owner == d]
            self.sides.append(DeviceSide(dev, max(on_d, default=SLOT_ALIGN)))
        self._side_of = [self.sides[d] for d in self.device_of_layer]  # each layer's device side
        self.launches = ExpertLaunches(layers, self._side_of, [s.offsets for s in self.slot_layouts])
        self._decode_routes: list = [None] * len(layers)  # per layer: its DecodeRoute with the next layer's prediction
        self.uploads = 0
        self.downloads = 0
        self.direct_uploads = 0  # of those, copied straight from a pinned read buffer (no staging memcpy)
        # reads land in pinned buffers (host_buffer), so an upload is a DMA from them; on one device only:
        # page-locked memory belongs to the context that took it
        # (a buffer a copy down wrote is handed out again once the host has waited for that copy)
        self.pool = (PinnedPool(self.dev.rt, [self.dev.copy_stream, self.dev.down_stream], settle_writes=self.sides[0].host_sees_downloads)
                     if len(self.devs) == 1 else None)  # fmt: skip
        self._downloaded: dict[int, int] = {}  # slot address -> the copy down that read it (until evicted)
        self.host_buffer = self._pinned if self.pool is not None else None
        self._take_ready = self.pool.shelf.take if self.pool is not None else None  # (PinnedPool.take's first step)
        self._begun: _Begun | None = None  # the step begun before its plan, until its compute
        self._steps: DecodeExperts | bool | None = None  # the compiled step work (made at first use; False: none)
        steps = self._compiled_steps()
        if steps is not None:  # made now where it can be: the reads' buffers, evictions and copies down are then
            # its methods, one C call each where the methods below would forward to them (their own frame is one
            # more, ~5 a decode step); the binding's C functions stay in use (shim.use_direct_calls, for good)
            self.host_buffer, self.evict, self.download = steps.pinned, steps.evict, steps.download

    def _compiled_steps(self) -> DecodeExperts | None:
        """The step work in C (DecodeExperts): on one device with a pinned pool, while the binding's C functions
        are in use (they make its driver calls); else None. Made at construction where they are in use then
        (GpuExperts.__init__), else at its first use."""
        steps, direct = self._steps, self.dev.rt.direct
        if steps is None:
            if DecodeExperts is None or self.pool is None:
                steps = self._steps = False
            elif isinstance(direct, Calls):  # (made through the binding's Calls itself, not a wrapper of them)
                layouts = [(s.end, s.nbytes, s.offsets, s.spans, layer.parts[0].shape[0], layer.parts[2].shape[0])
                           for s, layer in zip(self.slot_layouts, self.layers)]  # fmt: skip
                steps = self._steps = DecodeExperts(direct, self, self.sides[0], layouts)
        return steps if steps and direct is not None else None

    def _pinned(self, nbytes: int) -> np.ndarray:
        """A buffer of the pinned pool (one device), the pool first told which of its join marks a wait
        for the compute stream has passed since: the buffers given back before them are free of their
        copies, with no event to wait for. (A step takes about seven: its shelf's take inline, the pool's
        own take only where the shelf has none ready.)"""
        steps = self._steps
        if steps:  # (the same in one C call)
            return steps.pinned(nbytes)
        self._tell_pool(self.sides[0])
        buf = self._take_ready(-(-nbytes // ALIGN) * ALIGN)
        return buf if buf is not None else self.pool.take(nbytes)

    def reserve_reads(self, nbytes_by_size: dict[int, int]) -> None:
        """The pinned chunks of a host tier's read buffers (bytes of each buffer size), taken ahead on the
        pool's thread from now (fomoepy/runtime/pinned.py: taken as first needed, each stalled a step)."""
        if self.pool is not None:
            for size, total in nbytes_by_size.items():
                self.pool.reserve(size, total)

    def _tell_pool(self, side: DeviceSide) -> None:
        """The pinned pool learns which of its join marks a wait for the compute stream has passed."""
        pending = side.joins_pending
        if pending and pending[0][1] < side.compute_syncs.n:  # (asked at every take: the common no)
            self.pool.passed_mark(side.joins_passed())

    def side(self, layer: int) -> DeviceSide:
        return self._side_of[layer]

    # -- the ExpertDevice interface -----------------------------------------------------------------
    def expert_nbytes(self, layer: int) -> int:
        return self.slot_layouts[layer].nbytes

    def install(self, key: Key, parts: ExpertBytes) -> None:
        side = self._side_of[key[0]]
        side.fence_launches()
        self.resident[key] = self._upload(key[0], parts)
        side.installs_unjoined = True

    def evict(self, key: Key) -> None:
        steps = self._steps if self._steps else self._compiled_steps()
        if steps and self.dev.rt.direct is not None:
            steps.evict(key)
            return
        buf = self.resident.pop(key, None)
        if buf is not None:
            side = self._side_of[key[0]]
            seq = self._downloaded.pop(buf.ptr, 0)
            if seq > side.down_covered:  # its copy down may still be reading it: reused once covered
                side.dirty.append((seq, buf))
            else:
                side.free.setdefault(buf.nbytes, []).append(buf)

    def route(self, layer: int, h, k: int) -> np.ndarray:
        """Top-k of `layer`'s router for h, which sits on the previous layer's device."""
        dev, here = self._side_of[layer].dev, self._side_of[layer - 1].dev  # the router lives where its layer does
        if dev is not here:
            h = relay(h, here, dev)
        return dev.route(dev.linear(h, self.routers[layer]), "softmax", k).ids

    def route_ahead(self, layer: int, h, router, gating: str, k: int) -> tuple[Routing, np.ndarray | None]:
        """The router's choice for `layer` (its product of h, then the top-k) and the next layer's predicted
        ids (its router applied to h), read back together: one device round trip per decode step, not two.
        None for the prediction when the next layer sits on another device (route() relays h there)."""
        side = self._side_of[layer]
        dev = side.dev
        if layer + 1 >= len(self.layers) or self._side_of[layer + 1].dev is not dev:
            return dev.route(dev.linear(h, router), gating, k), None
        ahead_router = self.routers[layer + 1]
        E = ahead_router.shape[0]
        predicted = side.router_scratch(h.shape[0], E)
        if h.shape[0] == 1 and type(h) is DeviceArray and h.strides == (h.shape[1], 1) and router is self.routers[layer]:
            compiled = self._decode_route(layer, dev, gating, k, ahead_router, predicted)
            if compiled is not None:  # (a decode step: both products, both top-k and the read-back in one C call)
                exact, ahead = dev.read_routings(compiled.route_from(h.ptr), ((1, E, k), (1, E, k)))
                return exact, ahead.ids
        logits = dev.linear(h, router)
        dev.linear(h, ahead_router, out=predicted)
        exact, ahead = dev.route_many([(logits, gating, k), (predicted, "softmax", k)])
        return exact, ahead.ids

    def _decode_route(self, layer: int, dev: GpuBackend, gating: str, k: int, ahead_router, predicted: DeviceArray):
        """The layer's compiled routing, its own router's product first and the next layer's prediction
        after (GpuBackend.compiled_route), made at its first decode step; None where there is none (the direct
        calls off, another gating)."""
        if gating != "softmax" or dev.rt.direct is None:
            return None
        compiled = self._decode_routes[layer]
        if compiled is None:
            E = ahead_router.shape[0]
            logits = self._side_of[layer].router_scratch(1, E, own=True)
            compiled = dev.compiled_route(E, k, ahead_router, predicted, self.routers[layer], logits)
            compiled = self._decode_routes[layer] = compiled or False
        return compiled or None

    def begin(self, layer: int, h, ids: np.ndarray, weights: np.ndarray, at_hand: dict[int, ExpertBytes]) -> float:
        """A decode step's device work that need not wait for its cache plan, made as soon as its reads are
        issued: the plan and its evictions never touch the step's own experts. The experts the device tier
        holds are launched (they compute from here on, not from the end of the plan, about 120 µs of host
        time later at the 397B shape), and those whose bytes are at hand (host-tier hits, reads made ahead
        that landed) are copied up into free slots (the link starts on them here too). Every expert the
        tier does not hold gets its slot here, the reads' too, so the step's tables go up once, whole:
        compute, given the plan, only copies and launches the rest. A slot taken here before the plan's
        evictions free their room may be one beyond the tier: at most one step's experts, given back to
        the free slots by the evictions. Where every expert is held the whole step is launched here.
        Returns the perf_counter time of its first launch or copy (0.0: none made, nothing held or at
        hand: compute then makes the whole step)."""
        if self._begun is not None:  # the last step failed between its begin and its compute
            self._drop_begun()
        steps = self._steps  # (_compiled_steps' answer, without its frame once made)
        steps = steps if steps and self.dev.rt.direct is not None else self._compiled_steps()
        if steps is not None:  # (None back: not there, at the layer's first decode step)
            launched_at = steps.begin(layer, h, ids, weights, at_hand)
            if launched_at is not None:
                return launched_at
        if ids.shape[0] != 1:  # (a decode step: one row)
            return 0.0
        resident = self.resident
        chosen = ids[0].tolist()
        held, early, ptrs = [], [], {}  # (one pass: a decode step's host time is counted in microseconds)
        for e in chosen:
            buf = resident.get((layer, e))
            if buf is not None:
                held.append(e)
                ptrs[e] = buf.ptr
            elif e in at_hand:
                early.append(e)
        if not held and not early:
            return 0.0
        side = self._side_of[layer]
        self._open_step(side)
        slots = {}  # the slots of the experts the tier does not hold (after the covering: dirty ones may be free now)
        if len(held) < len(chosen):
            for e in chosen:
                if e not in ptrs:
                    buf = slots[e] = self._take_slot(layer)
                    ptrs[e] = buf.ptr
        # the held experts first in the tables (launched now), then those at hand, then the reads
        run = self.launches.prepare(layer, side.dev.asdevice(h).contiguous(), ids, weights, ptrs, held if slots else None, early)
        launched_at = 0.0
        if held:
            launched_at = time.perf_counter()
            if slots:
                self.launches.stages(run, 0, run.tables.n_first)
            else:
                self.launches.grouped(run)
        copied = {}
        for e in early:  # (after the launch: the compute stream is busy first)
            launched_at = launched_at or time.perf_counter()
            copied[e] = self._upload(layer, at_hand[e], slots[e])
        self._begun = _Begun(layer, ids, held, early, run, slots, copied)
        return launched_at

    def _drop_begun(self) -> None:
        """A step begun and never computed (its plan or a copy down raised between the two): its work is
        moot, and the slots it took are free again."""
        begun, self._begun = self._begun, None
        self._side_of[begun.layer].reuse(begun.slots.values())

    def compute(self, layer: int, h, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> DeviceArray:
        """h [T, D], ids/weights [T, k] → [T, D] on the device. The experts already in slots are launched
        first, with no wait on any copy; each missing expert's copy up is issued as soon as its bytes are
        here: those at hand first, then each read as it lands, so the layer's reads and copies overlap
        (fetch time max(disk, copy), not their sum) and the resident experts compute beside them. A
        missing expert is launched once its copy is issued and the table's experts before it are in
        slots (the table puts those at hand before those read, each read in id order): its launch waits
        for the copies on the device, not on the host, and after the last read lands only the last
        experts' work is left, not every miss's."""
        steps = self._steps  # (_compiled_steps' answer, without its frame once made)
        steps = steps if steps and self.dev.rt.direct is not None else self._compiled_steps()
        if steps is not None:  # the step begun there (None back: none was)
            out = steps.compute(layer, ids, experts)
            if out is not None:
                return out
        plan = experts.plan
        side = self._side_of[layer]
        if self._begun is not None and self._begun.ids is not ids:  # another step's (one that failed after its begin)
            self._drop_begun()
        begun, self._begun = self._begun, None
        copied = begun.copied if begun is not None else {}
        self._open_step(side)
        missing: dict[int, bool] = {}  # expert -> whether its slot joins the device tier (to_device)
        if begun is not None:  # every slot taken and the tables up (begin): the plan says which slots join the tier
            slots, resident = begun.slots, self.resident
            for item in plan.items:
                if item.expert in slots:
                    missing[item.expert] = item.to_device
                elif (layer, item.expert) not in resident:
                    raise RuntimeError(f"layer {layer}: expert {item.expert} was held before the plan, and is not now")
            if len(missing) != len(slots):
                raise RuntimeError(f"layer {layer}: the experts given slots before the plan {sorted(slots)} are not all "
                                   f"in it {sorted(missing)}")  # fmt: skip
            split = bool(begun.held) and bool(missing)
            run = begun.run
            if not missing:  # the whole step was launched by begin
                side.launched()
                side.record_downloads()
                experts.landed()
                return run.out
            at_hand = [e for e in begun.at_hand if e in experts.fetched]
            launched = run.tables.n_first  # (begin launched the held experts' stretch)
        else:
            slots = {}
            for item in plan.items:
                buf = self.resident.get((layer, item.expert))
                if buf is None:  # the slot its copy fills, taken now so that one table names every slot
                    buf = self._take_slot(layer)
                    missing[item.expert] = item.to_device
                slots[item.expert] = buf
            split = len(missing) not in (0, len(slots))
            at_hand = [e for e in missing if e in experts.fetched]
            run = self.launches.prepare(layer, side.dev.asdevice(h).contiguous(), ids, weights, {e: buf.ptr for e, buf in slots.items()},
                                [e for e in slots if e not in missing] if split else None, at_hand)  # fmt: skip
            launched = 0  # work items launched (split): the table's stretch whose experts are all in slots
            if split:  # what the slots hold computes while the misses are read and copied up
                experts.launched_at = experts.launched_at or time.perf_counter()  # (begin's copies may have come first)
                self.launches.stages(run, 0, run.tables.n_first)
                launched = run.tables.n_first
        temporary: list[DeviceBuffer] = []

        def place(expert: int, parts: ExpertBytes) -> None:
            buf = slots[expert]
            if expert not in copied:  # (begin copied those at hand then)
                self._upload(layer, parts, buf)
            if missing.pop(expert):
                self.resident[(layer, expert)] = buf
            else:
                temporary.append(buf)  # streamed through a slot that is free again after this layer

        def launch_placed() -> None:
            """Launch the work items from `launched` up to the first whose expert is still missing."""
            nonlocal launched
            stop, order = launched, run.tables.experts
            while stop < run.tables.n_work and order[stop] not in missing:
                stop += 1
            if stop > launched:
                self._join_copies(side)
                self.launches.stages(run, launched, stop)
                launched = stop

        try:
            for expert in at_hand:
                place(expert, experts.fetched[expert])
            if split and at_hand:
                launch_placed()
            for expert, parts in experts.as_they_land():
                place(expert, parts)
                if split and missing:  # (the last: launched below with the rest)
                    launch_placed()
            if missing:  # read by a source with no pool of its own: the bytes come at landed()
                fetched = experts.landed()
                for expert in list(missing):
                    place(expert, fetched[expert])
        except BaseException:
            # the slots no launch reads are free again; a later copy into a slot the launches above read
            # (one evicted next) waits for them
            side.launched()
            side.reuse([slots[e] for e in missing] + temporary)
            raise
        self._join_copies(side)
        if split:
            self.launches.stages(run, launched, run.tables.n_work)
            self.launches.combine(run)
        else:
            experts.launched_at = experts.launched_at or time.perf_counter()  # (every expert in a slot, or none was: all at once)
            self.launches.grouped(run)
        side.launched()
        if temporary:
            side.reuse(temporary)
        side.record_downloads()  # this step's copies down: the next step's copies up wait for them
        experts.landed()  # the reads' bookkeeping (host admissions), after the launches: it delays no kernel
        return run.out

    def sync_downloads(self) -> None:
        """Wait for the copies down issued so far (before the host reads a demoted expert's bytes)."""
        for side in self.sides:
            side.rt.sync(side.dev.down_stream)

    def close(self) -> None:
        """Free the pinned staging buffers and every device slot (the engine's reset and close)."""
        for side in self.sides:
            side.rt.sync(side.dev.down_stream)
            side.staging.close()
            side.free.clear()
            side.dirty.clear()
            side.down_buffers.clear()
            side.decode_arrays.clear()
            side.router_arrays.clear()
        self.launches.close()
        self._decode_routes = [None] * len(self.layers)  # (their predictions' arrays are the sides' router_arrays)
        if self._steps:
            self._steps.close()
        self._steps = None
        self.resident.clear()
        self._downloaded.clear()
        self._begun = None
        if self.pool is not None:
            self.pool.close()

    # -- copies -------------------------------------------------------------------------------------
    def _open_step(self, side: DeviceSide) -> None:
        """Before a step's copies and launches (begin's, and compute's): the launches still unsynced get their
        event (this step's copies need not wait for them); the earlier steps' copies down are covered (the
        slots and buffers this step's copies may reuse; a copy down of this step's, issued since begin, goes
        on beside its copies up); copies queued outside a step (install) land before any slot is read."""
        side.fence_launches()
        if side.down_recorded > side.down_covered:
            side.cover_downloads()
        self._join_copies(side)

    def _join_copies(self, side: DeviceSide) -> None:
        """The compute stream waits for every copy up issued so far (on the device: the host goes on). The
        pinned pool learns of the point: once the compute stream has been waited for, so have these copies."""
        if side.pending_uploads:
            side.rt.record(side.copied, side.dev.copy_stream)
            side.rt.wait(side.dev.stream, side.copied)
            side.pending_uploads = 0
            side.installs_unjoined = False
            side.joins += 1
            side.joined_at = side.compute_syncs.n
            if self.pool is not None:
                self._tell_pool(side)  # (the marks already passed first: the pending ones stay few)
                side.joins_pending.append((self.pool.mark(), side.joined_at))

    def _take_slot(self, layer: int) -> DeviceBuffer:
        """A free slot of `layer`'s size (an evicted or streamed one); else, while this step's evictees'
        copies down may still read theirs, a spare (up to SPARE_SLOTS) or, past them, one of those once
        the copy stream waits for its copy down; else a new one."""
        side = self._side_of[layer]
        nbytes = self.slot_layouts[layer].nbytes
        stack = side.free.get(nbytes)
        if stack:
            return stack.pop()
        dirty = [i for i, (_, buf) in enumerate(side.dirty) if buf.nbytes == nbytes]
        if dirty and side.spares >= SPARE_SLOTS:
            seq, buf = side.dirty.pop(dirty[0])
            side.cover_downloads(seq)
            return buf
        if dirty:
            side.spares += 1
        return DeviceBuffer(side.dev._direct, side.rt.malloc(nbytes), nbytes)

    def _upload(self, layer: int, parts: ExpertBytes, buf: DeviceBuffer | None = None) -> DeviceBuffer:
        """Copy the expert into a slot (`buf`, or a free one) on the copy stream: straight from its pinned
        read buffer, or packed into a pinned staging buffer first."""
        side = self._side_of[layer]
        layout = self.slot_layouts[layer]
        if buf is None:
            buf = self._take_slot(layer)
        if not side.pending_uploads and side.copies_must_wait():
            # a reused slot may still be read by grouped launches no read-back has waited for: copies wait
            side.rt.wait(side.dev.copy_stream, side.computed)
            side.copies_wait = False
        if self.pool is not None:
            addresses = [contiguous_address(parts[0]), contiguous_address(parts[1]), contiguous_address(parts[2])]
            start, (up, down), end = addresses[0], layout.offsets[1:], layout.end
            # the read buffer has the slot's layout (the store's records pad as slots do): one span, one
            # check that the pool pins it, one copy
            whole = addresses[1] == start + up and addresses[2] == start + down
            if self.pool.pins(start, end) if whole else all(self.pool.pins(a, part.nbytes) for a, part in zip(addresses, parts)):
                # the bytes are in a pinned read buffer: copied from there, with no staging memcpy; the
                # pool hands the buffer out again only after these copies are done
                written = side.down_buffers.get(start)
                if written is not None:  # a copy down wrote these bytes: not yet waited for by this stream
                    side.cover_downloads(written[0])
                if whole:
                    side.rt.htod(buf.ptr, start, end, side.dev.copy_stream)
                else:
                    for a, offset, part in zip(addresses, layout.offsets, parts):
                        side.rt.htod(buf.ptr + offset, a, part.nbytes, side.dev.copy_stream)
                side.pending_uploads += 1
                self.uploads += 1
                self.direct_uploads += 1
                return buf
        host_ptr, view, done = side.staging.take()
        self._pack(view, layout, parts)
        side.rt.htod(buf.ptr, host_ptr, layout.end, side.dev.copy_stream)
        side.rt.record(done, side.dev.copy_stream)
        side.pending_uploads += 1
        self.uploads += 1  # experts copied host -> device so far (a device-tier hit copies nothing)
        return buf

    @staticmethod
    def _pack(view: np.ndarray, layout: SlotLayout, parts: ExpertBytes) -> None:
        """The expert's parts into a pinned staging buffer at its slot offsets (a host memcpy of its bytes)."""
        for offset, part in zip(layout.offsets, parts):
            raw = np.frombuffer(np.ascontiguousarray(part), np.uint8)
            view[offset : offset + raw.size] = raw

    def download(self, key: Key) -> ExpertBytes:
        """Copy a resident expert's store bytes back to the host (a demoting policy's device evictee).

        On the down stream, after the copies up that filled slots so far (the slot's among them), beside
        the step's copies up: a GPU's copy engines move the two directions at once, and the copies up are
        the step's critical path (on the copy stream, these went first: at the fomoe-rig's tiers 2.7
        experts a step, a link's time as long as the step's copies up). A copy up that writes the slot or
        reads these bytes waits for it (`DeviceSide.cover_downloads`): the next step's, by the stream
        order set at its start; one in the same step, by waiting then. Into pinned memory (one device) it
        is not waited for by the host (the host waiting here cost an expert's transfer time per demotion,
        before the step's reads were issued); whoever reads the bytes on the host waits for the down stream
        first (`sync_downloads`). Without a pool (several devices) it is synchronous."""
        steps = self._steps if self._steps else self._compiled_steps()
        if steps and self.dev.rt.direct is not None:
            return steps.download(key)
        side = self._side_of[key[0]]
        layout = self.slot_layouts[key[0]]
        end = layout.end
        # into pinned memory when there is a pool: the DMA needs no bounce, and a later copy up is direct too
        out = self._pinned(end) if self.pool is not None else np.empty(end, np.uint8)
        # an install not yet joined may have filled the slot (a step's own copies up fill slots no expert
        # holds yet, which no copy down reads: this step's are not joined here, a wait and a record less)
        if side.installs_unjoined:
            self._join_copies(side)
        if side.joins > side.down_saw_joins:  # the copies up joined so far are done before this reads the slot
            if side.compute_syncs.n <= side.joined_at:  # (a wait for the compute stream since: done)
                side.rt.wait(side.dev.down_stream, side.copied)
            side.down_saw_joins = side.joins
        address, slot = contiguous_address(out), self.resident[key].ptr
        side.rt.dtoh(address, slot, end, side.dev.down_stream)
        if self.pool is None:
            side.rt.sync(side.dev.down_stream)
        else:
            side.downloads += 1
            self.pool.device_writes(address, side.downloads)
            self._downloaded[slot] = side.downloads
            side.down_buffers[address] = (side.downloads, out)  # held (not handed out again) till covered
        self.downloads += 1
        (g0, g1), (u0, u1), (d0, d1) = layout.spans
        return out[g0:g1], out[u0:u1], out[d0:d1]
