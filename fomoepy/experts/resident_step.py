"""ResidentStep: the MoE step when the device tier holds every expert for good.

The cpu backend fills a tier that holds the whole model at load (fomoepy.engine); from then on no step
misses, evicts, reads or prefetches, so the cache has nothing to decide. A step is then routing as
MoEStep's (the trace, usage counts, CAR: the streamer's `choose`) and the device's product; the plan,
its pins and its release are skipped (they were a tenth of a decode step's time on the cpu backend),
and each selected expert is counted as the device hit a plan would have counted.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.device import StepExperts, StepTiming
from fomoepy.experts.routing import Routing
from fomoepy.experts.step import MoEStep, compute_in_runs
from fomoepy.experts.streamer import Rows, rows_of


class ResidentStep(MoEStep):
    def __init__(self, streamer, device, timer: Any = None):
        super().__init__(streamer, device, predicts=False, timer=timer)
        self._cache = streamer.cache
        self._graph_inputs: dict[int, tuple | None] = {}  # layer -> the device's graph_inputs, asked once

    def __call__(self, layer: int, h: Any, exact: Routing, rows: Rows = None) -> Any:
        t0 = time.perf_counter()
        ids, weights = self.streamer.choose(layer, exact, rows)
        h = rows_of(h, rows)  # (MoEStep.__call__)
        # a decode row's picks as a set of ints, not np.unique (~8 µs of a ~40 µs step's Python)
        self._cache.count_resident_hits(layer, len(set(ids[0].tolist())) if ids.shape[0] == 1 else len(np.unique(ids)))
        t1 = time.perf_counter()
        experts = StepExperts(None, self.phase, {}, {}, _nothing)
        out = compute_in_runs(self.device, layer, h, ids, weights, experts, rows if isinstance(rows, list) else None)
        if self.records is not None or self.timer is not None:
            timing = StepTiming(layer, t1 - t0, 0.0, 0.0, time.perf_counter() - t1, 0.0, t1 - t0)
            if self.records is not None:
                self.records.append(timing)
            if self.timer is not None:
                self.timer.add_step(timing)
        return out

    def in_graph(self, layer: int) -> tuple | None:
        """What the backend's decode graph needs to compute this step itself (the device's graph_inputs),
        where it can: every expert is resident, so the step has nothing to plan, read or wait for, and
        no step record is asked for now (a graph has no host phases to time). The inputs are asked once
        per layer: the tier, whole, does not change."""
        if self.records is not None or self.timer is not None:
            return None
        kept = self._graph_inputs.get(layer, _UNASKED)
        if kept is _UNASKED:
            inputs = getattr(self.device, "graph_inputs", None)
            kept = self._graph_inputs[layer] = None if inputs is None else inputs(layer)
        return kept

    def computed(self, layer: int, exact: Routing) -> None:
        """The step's bookkeeping once the backend's graph computed it (in_graph): the trace, usage counts
        and CAR's (which substitutes only experts that are not resident: here none), the hits."""
        ids, _ = self.streamer.choose(layer, exact)
        if ids is not exact.ids and not np.array_equal(ids, exact.ids):
            raise FomoeError(f"layer {layer}: cache-aware routing changed a step whose experts were all resident")
        self._cache.count_resident_hits(layer, len(set(ids.ravel().tolist())))  # (the rows' union, as a step's plan takes it)

    def computed_pass(self, ids: np.ndarray, weights: np.ndarray, probs: np.ndarray) -> None:
        """`computed` for every layer of a pass its backend computed in one call: ids [n_layer, T, k],
        weights [n_layer, T, k], probs [n_layer, T, E], layer il's routing at [il]. In one call where the
        streamer's record is the usage counts alone (note_pass; a token's layer-by-layer bookkeeping was
        ~60 µs of Python after its graph), else layer by layer."""
        if not self.streamer.note_pass(ids):
            for layer in range(len(ids)):
                self.computed(layer, Routing(ids[layer], weights[layer], probs[layer]))
            return
        # each layer's union of its rows' picks, as computed counts it (as sets of ints: numpy's few calls
        # on a few dozen ids cost more, on the caches a graph has just emptied)
        for layer, picks in enumerate(ids.reshape(len(ids), -1).tolist()):
            self._cache.count_resident_hits(layer, len(set(picks)))


_UNASKED = object()


def _nothing() -> None:
    """No read to wait for."""
