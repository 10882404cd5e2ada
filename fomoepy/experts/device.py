"""What the MoE step (fomoepy.experts.step) asks of a compute device, and what it hands it.

The step owns every decision: routing and CAR, the cache plan, the reads, prefetch and backfill,
what each tier keeps. A device only holds its tier's experts in its own form and does arithmetic:

    expert_nbytes(layer)      one expert of `layer` in the device tier's form (the tier's unit)
    install(key, parts)       put an expert into the device tier (a seed, or a plan's admission)
    evict(key)                drop it (the cache chose it)
    download(key)             its store bytes back, for a demoting policy (where `can_download`)
    route(layer, h, k)        the top-k ids of `layer`'s router for h: the next layer's prediction
    compute(layer, h, ids, weights, experts)   Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]), filling
                              the tier with the plan's admissions as their bytes land
    begin(layer, h, ids, weights, at_hand)     optional: a decode step's experts the device holds
                              launched, those at hand copied up, before the cache plan (compute
                              then does the rest)

`experts` (StepExperts) says where each selected expert's bytes are: already in the device tier,
at hand in host memory, or still being read. The device decides the order: it may compute what it
holds while the rest arrive, then call `experts.landed()`, which waits for the step's reads once.
Nothing here imports a backend, and no backend imports the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np

from fomoepy.experts.policy import Key
from fomoepy.experts.reads import as_landed

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down in store form


class Phase(Enum):
    """What a forward pass is, stated by its caller (never read off the number of rows)."""

    PREFILL = "prefill"  # many tokens of one sequence: no next-layer prediction (the union is most of a layer)
    DECODE = "decode"  # one token: prediction, prefetch and the one-token fast paths


@dataclass
class StepTiming:
    """Host seconds of one MoE layer step, by part (a record per step, summed by whoever wants a mean)."""

    layer: int = 0
    route: float = 0.0  # cache-aware routing, the trace, counting, next-layer prediction
    plan: float = 0.0  # cache plan and policy, host-tier bytes, issuing reads, device evictions
    wait: float = 0.0  # blocked on this step's expert reads
    compute: float = 0.0  # the device's part: fills and arithmetic (on a GPU: the calls that queue them)
    release: float = 0.0  # unpinning, unmapping
    # The parts of the host's work in series with the step's reads: from its start until they were issued,
    # and from the last one's landing to its return (the last copies and launches). What lies between runs
    # while the reads are in flight (fomoe plan's `[host] serial` is their sum)
    before_reads: float = 0.0
    after_landed: float = 0.0
    # from its start until the device's first work of it, a launch or a copy up (a GPU computes the experts
    # it holds and copies up those at hand from then: fomoe plan's `[host] before_launch`); 0: a device
    # that does not say
    before_launch: float = 0.0

    @property
    def total(self) -> float:
        return self.route + self.plan + self.wait + self.compute + self.release


class StepExperts:
    """The experts of one step: their plan, the bytes at hand, and one wait for the rest.

    `fetched[e]` holds the store bytes of every expert not in the device tier once `landed()` has
    returned; before that, only those at hand (host-tier hits, prefetches handed over)."""

    __slots__ = ("plan", "phase", "fetched", "pending", "_finish", "_done", "failed", "wait_seconds", "landed_at", "launched_at")

    def __init__(self, plan, phase: Phase, fetched: dict[int, ExpertBytes], pending: dict, finish: Callable[[], None]):
        self.plan = plan
        self.phase = phase
        self.fetched = fetched
        self.pending = pending  # expert -> its read in flight
        self._finish = finish
        self._done = False
        self.failed = False  # a read of this step raised: its bytes never came
        self.wait_seconds = 0.0
        self.landed_at = 0.0  # perf_counter time landed() returned: every read of the step was in
        # perf_counter time the device queued its first work of the step (a GPU's first launch or copy up: it
        # works from then on, beside the host); 0: a device that does not say
        self.launched_at = 0.0

    def as_they_land(self) -> Iterator[tuple[int, ExpertBytes]]:
        """(expert, bytes) of this step's reads in flight, each as soon as it lands, in the order they
        land: a device can start copying one up while the others are still being read. Reads the source
        makes without a pool (no future) are left to landed(). When the last one lands, `landed_at` is set:
        the step's reads are in, whether or not landed() has been called yet."""
        futures = {f: e for e, f in self.pending.items() if f is not None}
        left = len(futures)
        t = time.perf_counter()
        try:
            for f in as_landed(futures):  # (those landed already first, with no waiter made)
                self.wait_seconds += time.perf_counter() - t
                left -= 1
                if not left:
                    self._all_in()
                yield futures[f], f.result()
                t = time.perf_counter()
        finally:
            self.wait_seconds += time.perf_counter() - t

    def _all_in(self) -> None:
        if not self.landed_at and all(f is not None for f in self.pending.values()):
            self.landed_at = time.perf_counter()

    @property
    def done(self) -> bool:
        """Whether landed() has been called."""
        return self._done

    def landed(self) -> dict[int, ExpertBytes]:
        """Wait, once, for this step's reads; later calls return at once (so it is both a point in the
        computation and a `finally`). A failed read raises here, once."""
        if not self._done:
            self._done = True
            t = time.perf_counter()
            try:
                self._finish()
            except BaseException:
                self.failed = True
                raise
            finally:
                now = time.perf_counter()
                self.landed_at = self.landed_at or now
                self.wait_seconds += now - t
        return self.fetched


class ExpertDevice(Protocol):
    can_download: bool  # whether download() gives store bytes back (a demoting policy needs it)

    def expert_nbytes(self, layer: int) -> int: ...

    def install(self, key: Key, parts: ExpertBytes) -> None: ...

    def evict(self, key: Key) -> None: ...

    def download(self, key: Key) -> ExpertBytes | None: ...

    def route(self, layer: int, h: Any, k: int) -> np.ndarray: ...

    # optional: route_ahead(layer, h, router, gating, k) -> (Routing, next layer's ids or None), the step's
    # routing (its router's product of h and the top-k) and the next layer's prediction in one device round
    # trip (GpuExperts)

    # optional: begin(layer, h, ids, weights, at_hand) -> the perf_counter time of a launch (0.0: none), a
    # decode step's experts the device holds launched, and those at hand (expert -> bytes) copied up, once
    # its reads are issued, before the cache plan (which never evicts the step's own experts) (GpuExperts)

    def compute(self, layer: int, h: Any, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> Any: ...

    def close(self) -> None: ...
