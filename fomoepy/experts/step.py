"""MoEStep: the routed-expert half of a MoE layer, whole, in one place.

    out = step(layer, h, exact)      # h [T, D] normed; exact: the router's own choice (ids, weights, probs)

does, in order:
    1. routing: cache-aware substitutions (streamer.substitute), which say what the step reads;
    2. the step's reads, issued first (streamer.start_acquire); while they are in flight, the routing's
       record (the trace, usage counts: streamer.note) and the next layer's prediction on a decode step
       (device.route, or what route() read back with the router's own choice), whose misses are read
       during this one; then the cache plan (on a GPU, made beside them: ExpertStreamer's plans_beside),
       and the device tier's evictions;
    3. the device's arithmetic (device.compute), which fills the tier as the bytes land;
    4. release: the plan's experts are unpinned.
and keeps a StepTiming record of each step when asked (`records`).

The streamer (fomoepy.experts.streamer) is the host side the step owns: the cache, the host tier's
bytes, the reads, prefetch and backfill. The device (fomoepy.experts.device.ExpertDevice) is the
compute side: it knows the form its tier holds, nothing of the cache.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.device import ExpertDevice, Phase, StepExperts, StepTiming
from fomoepy.experts.routing import Routing, routing_of
from fomoepy.experts.streamer import ExpertStreamer, Rows, rows_of


class MoEStep:
    def __init__(self, streamer: ExpertStreamer, device: ExpertDevice, predicts: bool = True, timer: Any = None):
        """predicts: decode steps predict the next layer's experts (device.route) so the streamer can read
        them ahead. timer: a fomoepy.timing.LayerTimer (`--profile-timing`) that gets every step's record."""
        self.streamer = streamer
        self.device = device
        self.predicts = predicts
        self._predicting = False  # whether this pass's steps predict the next layer's experts (begin_step)
        self.timer = timer
        self.layers = streamer.layers
        self.phase = Phase.PREFILL
        self.records: list[StepTiming] | None = None  # set to [] to keep every step's record
        for key in streamer.seed_from_profile():
            device.install(key, streamer.source.read(*key))

    def begin_step(self, phase: Phase, sequences: list[int] | None = None) -> None:
        """A forward pass starts: what kind it is, as its caller states it, and each row's sequence (None:
        one sequence)."""
        self.phase = phase
        self.streamer.begin_step(sequences)
        # (asked once a pass: a decode pass predicts while reading ahead, which uses the prediction, is on for now)
        self._predicting = phase is Phase.DECODE and self.predicts and self.streamer.wants_prediction()

    def end_step(self, n_tokens: int) -> None:
        """The forward pass is done: a decode step (one row per sequence) is one tick of the policies' time,
        a prefill one tick per token."""
        self.streamer.end_step(n_tokens, ticks=1 if self.phase is Phase.DECODE else n_tokens)
        if self.streamer.backfills_device:  # (sync backfill's reads, made in end_step)
            self._install_backfilled()

    def _install_backfilled(self) -> None:
        """The device tier's changes backfill made (no host tier: its experts go to the device's), applied to
        the device before a plan takes them for done."""
        for key, parts in self.streamer.take_device_changes():
            if parts is None:
                self.device.evict(key)
            else:
                self.device.install(key, parts)

    def route(self, ops: Any, layer: int, h: Any, router: Any, gating: str, k: int) -> Routing:
        """The router's own choice: the top-k of its logits h · routerᵀ (ops.linear, ops.route); on a decode
        step whose device can, the logits, their top-k and the next layer's prediction are made in one device
        round trip (route_ahead), the prediction as the routing's `ahead` for the step to use."""
        route_ahead = getattr(self.device, "route_ahead", None)
        # (predicts_after's test, inline: the step's host time is counted in frames)
        if route_ahead is None or not (self._predicting and layer + 1 < self.streamer.n_layer):
            return ops.route(ops.linear(h, router), gating, k)
        exact, ahead = route_ahead(layer, h, router, gating, k)
        return exact if ahead is None else routing_of((exact[0], exact[1], exact[2], ahead))

    def in_graph(self, layer: int) -> tuple | None:
        """What a backend's decode graph would need to compute this step itself: never here (a step may
        miss, read and evict); see ResidentStep."""
        return None

    def predicts_after(self, layer: int) -> bool:
        """Whether `layer`'s step will predict the next layer's experts: a router that gives them with its
        routing (Routing.ahead: the cpu backend's decode-row attention graph) saves the step a product."""
        return self._predicting and layer + 1 < self.streamer.n_layer

    def __call__(self, layer: int, h: Any, exact: Routing, rows: Rows = None) -> Any:
        """Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]) over the experts routing settles on → [T, D]; of the
        rows `rows` only where given (every row is routed, counted and traced; those are computed). `rows`
        may be several runs of rows (a list of slices, in order: each sequence's of a joint prefill): the
        plan and the reads are made once for all of them, and each run is computed by a device call of its
        own, so its products are those it gets alone (a device that can: `computes_runs`)."""
        s, device = self.streamer, self.device
        t0 = time.perf_counter()
        if s.backfills_device:  # what the backfill thread read since the last step, into the device tier first
            s.collect_backfill()
            self._install_backfilled()
        runs = rows if isinstance(rows, list) else None
        if runs is not None and not getattr(device, "computes_runs", False):
            raise FomoeError(f"{type(device).__name__} cannot compute a step's rows in runs")
        ids, weights = s.substitute(layer, exact, rows)  # (CAR: what the step's reads are of)
        if rows is not None:
            h = rows_of(h, rows)
        t1 = time.perf_counter()

        begin = getattr(device, "begin", None) if self.phase is Phase.DECODE else None
        predicts = self._predicting and layer + 1 < s.n_layer  # (predicts_after, inline)
        launched = [0.0]

        def beside(fetched, reads) -> None:  # while the step's reads are in flight: the first launch, the routing's record, the next layer's guesses
            if begin is not None:  # the experts the device holds compute from here, those at hand are copied up
                launched[0] = begin(layer, h, ids, weights, s.at_hand(layer, ids, fetched, reads))
            s.note(layer, exact, rows)
            if predicts:  # with the routing where its router gave it (Routing.ahead), else a product here
                ahead = exact.ahead
                s.predict(layer + 1, ahead if ahead is not None else device.route(layer + 1, h, exact.ids.shape[1]))

        plan, fetched, reads = s.start_acquire(layer, ids, rows, beside)
        for victim in plan.device_evictions:
            device.evict(victim)
        experts = StepExperts(plan, self.phase, fetched, reads, functools.partial(s.finish_acquire, plan, fetched, reads))
        experts.launched_at = launched[0]
        t2 = time.perf_counter()
        try:
            out = device.compute(layer, h, ids, weights, experts) if runs is None else compute_in_runs(device, layer, h, ids, weights, experts, runs)
        finally:
            t3 = time.perf_counter()
            waited_inside = experts.done
            try:
                experts.landed()  # a device that failed still lands the step's reads: no slot stays LOADING
            finally:
                s.release(plan)
                if experts.failed:
                    # a read failed: the slots the plan admitted for bytes that never came are dropped, so no
                    # later step takes them for held (and what the device installed of them goes too)
                    for key in s.abort(plan):
                        device.evict(key)
        t4 = time.perf_counter()
        if self.records is not None or self.timer is not None:
            wait = experts.wait_seconds
            before, after = s.reads_issued_at - t0, t4 - experts.landed_at
            launch = experts.launched_at - t0 if experts.launched_at else 0.0
            if waited_inside:  # the device waited among its work
                timing = StepTiming(layer, t1 - t0, t2 - t1, wait, t3 - t2 - wait, t4 - t3, before, after, launch)
            else:  # it never called landed(): the wait fell after it returned
                timing = StepTiming(layer, t1 - t0, t2 - t1, wait, t3 - t2, t4 - t3 - wait, before, after, launch)
            if self.records is not None:
                self.records.append(timing)
            if self.timer is not None:
                self.timer.add_step(timing)
        return out

    def close(self) -> None:
        """The streamer first: its host tier's bytes may live in the device's pinned memory, which the
        device gives back only once nothing holds them."""
        self.streamer.close()
        self.streamer.host_slots.clear()
        self.device.close()


def compute_in_runs(device: ExpertDevice, layer: int, h: Any, ids: np.ndarray, weights: np.ndarray, experts: StepExperts,
                    runs: list[slice] | None) -> Any:  # fmt: skip
    """device.compute over the rows, or over each run's rows apart (runs: the slices the rows were taken by,
    in order), each as it is computed alone, from the same plan and reads; joined in order."""
    if runs is None:
        return device.compute(layer, h, ids, weights, experts)
    at = np.cumsum([0] + [run.stop - run.start for run in runs])
    return np.concatenate([device.compute(layer, h[a:b], ids[a:b], weights[a:b], experts) for a, b in itertools.pairwise(at)])
