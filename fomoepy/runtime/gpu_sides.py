"""One device's share of the routed-expert work (fomoepy.runtime.gpu_experts.GpuExperts): its streams'
events and the order they keep, its staging ring, its free and dirty slots, and its copies down.

GpuExperts decides what to copy and launch; a DeviceSide keeps the bookkeeping that says when a slot, a
pinned buffer or a staging buffer may be touched again: which copies down a copy up must wait for, which
launches a copy into a reused slot must wait for, which joins of the copies a wait of the host for the
compute stream has passed. Counts, not events, where a synchronisation the step makes anyway already
answers (DriverShim.syncs).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Iterable

import numpy as np

from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.gpu_arrays import DeviceArray, DeviceBuffer
from fomoepy.runtime.moe_tables import EXPERT_WORK_DTYPE, PAIR_DTYPE

STAGING_BUFFERS = 4


class Staging:
    """Pinned host buffers in a ring; each is reused only after its last copy has completed."""

    def __init__(self, dev: GpuBackend, nbytes: int, count: int = STAGING_BUFFERS):
        self.rt = dev.rt
        self.buffers = [self.rt.host_alloc(nbytes) for _ in range(count)]
        self.events = [self.rt.event() for _ in range(count)]
        self.used = [False] * count
        self.nbytes = nbytes
        self.next = 0

    def take(self) -> tuple[int, np.ndarray, object]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.used[i]:
            self.rt.event_sync(self.events[i])
        self.used[i] = True
        view = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.buffers[i]))
        return self.buffers[i], view, self.events[i]

    def close(self) -> None:
        for i, ptr in enumerate(self.buffers):
            if self.used[i]:
                self.rt.event_sync(self.events[i])
            self.rt.host_free(ptr)
        self.buffers = []


class DeviceSide:
    """One device's share of the expert work: its streams' events, staging ring and free slots."""

    def __init__(self, dev: GpuBackend, staging_nbytes: int):
        self.dev = dev
        self.rt = dev.rt
        self.staging = Staging(dev, staging_nbytes)
        self.compute_syncs = self.rt.sync_count(dev.stream)  # the host's waits for the compute stream (.n)
        self.copied = self.rt.event()  # the uploads of the layer being prepared are done
        self.computed = self.rt.event()  # recorded after grouped launches that copies into slots must wait for
        self.pending_uploads = 0  # copies issued for the layer being prepared
        self.installs_unjoined = False  # among them an install's (a slot already resident, which a copy down may read)
        self.free: dict[int, list[DeviceBuffer]] = {}  # evicted or temporary slots by size, for reuse
        # Copies down run on their own stream (dev.down_stream). A slot whose expert was copied down, and a
        # pinned buffer a copy down wrote, may be written or read by a copy up only once the copy stream has
        # waited for that copy down: copies down are numbered, `down_covered` is the last the copy stream
        # has waited for, `down_recorded` the last `down_done` was recorded after.
        self.down_done = self.rt.event()
        self.downloads = 0
        self.down_recorded = 0
        self.down_covered = 0
        self.down_host_seen = 0  # the last copy down the host has waited for itself (host_sees_downloads)
        self.dirty: list[tuple[int, DeviceBuffer]] = []  # (the copy down it waits for, the slot) evicted slots
        self.joins = 0  # times `copied` was recorded after copies up (and the compute stream waited for it)
        self.joined_at = 0  # the compute stream's sync count at the last of them
        self.down_saw_joins = 0  # of them, the last the down stream has waited for
        self.down_buffers: dict[int, tuple[int, object]] = {}  # address -> (copy down, its buffer, held till covered)
        self.spares = 0  # slots allocated beyond the tier while only dirty ones were free (up to SPARE_SLOTS)
        # grouped launches issued since the host last waited for the compute stream (a routing read-back,
        # any synchronisation: rt.syncs counts them): they may still read slots that copies are about to
        # fill. Every decode and prefill step begins with such a read-back, so the record and the copies'
        # wait are only made when none came between.
        self.launches_unsynced = False
        self.launched_at = 0  # the compute stream's sync count when they were queued
        self.copies_wait = False  # `computed` covers such launches: the next step's first copy waits for it
        self.computed_at = 0  # the sync count when `computed` was recorded
        self.joins_pending: deque[tuple[int, int]] = deque()  # (the pinned pool's mark of a join, the sync count then)
        self.decode_arrays: dict[tuple[int, int, int], tuple[DeviceArray, DeviceArray, DeviceArray]] = {}
        self.router_arrays: dict[tuple[int, int, bool], DeviceArray] = {}  # router_scratch's, by (T, E, own)

    def decode_scratch(self, k: int, F: int, D: int) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        """A decode step's tables, activations [k, F] and pairs' outputs [k, D] on the device: made once, and
        reused step after step. Safe without an event: only this side's compute stream touches them (the
        tables' copy up is queued on it too), so a step's writes queue behind the last step's reads."""
        arrays = self.decode_arrays.get((k, F, D))
        if arrays is None:
            tables = self.dev.zeros((k * (PAIR_DTYPE.itemsize + EXPERT_WORK_DTYPE.itemsize),), np.uint8)
            arrays = self.decode_arrays[k, F, D] = (tables, self.dev.zeros((k, F)), self.dev.zeros((k, D)))
        if self.dev.poison is not None:  # (tests: as fresh arrays are, so a kernel that skips an element fails)
            for a in arrays[1:]:
                self.rt.memset32(a.ptr, self.dev.poison, a.nbytes // 4, self.dev.stream)
        return arrays

    def router_scratch(self, T: int, E: int, own: bool = False) -> DeviceArray:
        """The next layer's router logits [T, E] of a decode step's prediction (GpuExperts.route_ahead), or
        (own) the layer's own router's: made once and reused, as decode_scratch's arrays are (its top-k, on
        this compute stream, reads them before the next step's product writes them)."""
        logits = self.router_arrays.get((T, E, own))
        if logits is None:
            logits = self.router_arrays[T, E, own] = self.dev.zeros((T, E))
        if self.dev.poison is not None:
            self.rt.memset32(logits.ptr, self.dev.poison, logits.nbytes // 4, self.dev.stream)
        return logits

    def reuse(self, slots: Iterable[DeviceBuffer]) -> None:
        """These slots are free for the next copies up (no copy down reads them). (An eviction, the one a
        step makes most, files its slot inline.)"""
        for buf in slots:
            self.free.setdefault(buf.nbytes, []).append(buf)

    def cover_downloads(self, upto: int | None = None) -> None:
        """The copy stream waits for the copies down up to `upto` (default: those recorded, that is the
        earlier steps'; a number past them records first: every copy down so far): their slots are free
        for copies up, their buffers may be read by them and handed out again."""
        upto = self.down_recorded if upto is None else upto
        if upto <= self.down_covered:
            return
        if upto > self.down_recorded:
            self.record_downloads()
        self.rt.wait(self.dev.copy_stream, self.down_done)
        self.down_covered = self.down_recorded
        if self.dirty:
            kept = []
            for seq, buf in self.dirty:
                if seq <= self.down_covered:
                    self.free.setdefault(buf.nbytes, []).append(buf)
                else:
                    kept.append((seq, buf))
            self.dirty = kept
        if self.down_buffers:
            self.down_buffers = {a: v for a, v in self.down_buffers.items() if v[0] > self.down_covered}

    def host_sees_downloads(self, upto: int) -> None:
        """The host waits for the copies down up to number `upto`, so that their bytes are in its memory
        before it writes there itself (a pinned buffer handed out again): once per record of `down_done`,
        which usually follows copies down a step old, done by now."""
        if upto <= self.down_host_seen:
            return
        if upto > self.down_recorded:
            self.record_downloads()
        self.rt.event_sync(self.down_done)
        self.down_host_seen = self.down_recorded

    def record_downloads(self) -> None:
        """`down_done` after every copy down issued so far."""
        if self.downloads > self.down_recorded:
            self.rt.record(self.down_done, self.dev.down_stream)
            self.down_recorded = self.downloads

    def launched(self) -> None:
        """Grouped launches were queued: copies into slots may have to wait for them."""
        self.launches_unsynced = True
        self.launched_at = self.compute_syncs.n

    def fence_launches(self) -> None:
        """Before a step's launches or an install: the launches still unsynced get an event to wait for
        (none if the host has waited for the compute stream since they were queued)."""
        if self.launches_unsynced and self.compute_syncs.n == self.launched_at:
            self.rt.record(self.computed, self.dev.stream)
            self.copies_wait = True
            self.computed_at = self.launched_at
        self.launches_unsynced = False

    def copies_must_wait(self) -> bool:
        """Whether the next copy into a slot waits for `computed` (not if the host has waited for the
        compute stream since it was recorded)."""
        if self.copies_wait and self.compute_syncs.n != self.computed_at:
            self.copies_wait = False
        return self.copies_wait

    def joins_passed(self) -> int:
        """The pinned pool's newest join mark that a wait of the host for the compute stream has passed
        (the compute stream waited for the copies before it), or 0."""
        now, passed = self.compute_syncs.n, 0
        while self.joins_pending and self.joins_pending[0][1] < now:
            passed = self.joins_pending.popleft()[0]
        return passed
