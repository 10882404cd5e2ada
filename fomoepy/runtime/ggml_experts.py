"""Routed experts on the ggml CPU backend, computed from the store-form bytes the tiers hold.

There is no device tier on this backend: a host-tier record (or a fresh read, or the mapped GGUF)
is what ggml reads, in place, so a miss costs its read and nothing else: no dequantisation, no
float32 copy. Which experts the host tier holds is the streamer's decision.
"""

from __future__ import annotations

import time

import numpy as np

from fomoepy.experts.routing import Routing, softmax_route
from fomoepy.experts.source import LayerExperts
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.runtime.ggml_matmul import QuantMatrix, expert_ffn


class GgmlExperts:
    """out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]), experts added in ascending id order."""

    def __init__(self, streamer: ExpertStreamer, ops, routers=None, timer=None):
        self.streamer = streamer
        self.layers = streamer.layers
        self.ops = ops
        self.routers = routers  # every layer's router, to predict the next layer's experts
        self.timer = timer  # a fomoepy.timing.LayerTimer when --profile-timing is on

    def begin_step(self) -> None:
        self.streamer.begin_step()

    def end_step(self, n_tokens: int) -> None:
        self.streamer.end_step(n_tokens)

    def choose(self, layer: int, h: np.ndarray, exact: Routing) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        ids, weights = self.streamer.choose(layer, exact)
        nxt = layer + 1
        if self.routers is not None and nxt < len(self.routers) and h.shape[0] == 1:
            predicted = softmax_route(self.ops.linear(h, self.routers[nxt]), exact.ids.shape[1]).ids
            self.streamer.predict(nxt, predicted)
        if self.timer is not None:
            self.timer.add("router", layer, time.perf_counter() - t0)
        return ids, weights

    def use_resident_slots(self, slot_layers: list) -> None:
        """Measurement hook (issue 29, until the step owner wires slots in): every expert of every layer
        held in `slot_layers[layer]` (a fomoepy.runtime.ggml_slots.SlotLayer) at slot = expert id, and
        `ffn` computes a layer's routed experts as one product over them, bypassing the tiers."""
        self.slot_layers = slot_layers

    def ffn(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        if getattr(self, "slot_layers", None) is not None:
            order = np.argsort(ids, axis=1, kind="stable")  # each token's experts in ascending id, as below
            return self.slot_layers[layer].ffn(h, np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1), self.ops.threads)
        t0 = time.perf_counter()
        plan, fetched, reads = self.streamer.start_acquire(layer, ids)
        reads_landed = _ReadsLanded(self.streamer, plan, fetched, reads)
        t1 = time.perf_counter()
        try:
            parts = self.layers[layer].parts
            if h.shape[0] == 1:
                return self._one_token(h, ids[0], weights[0], parts, fetched, reads_landed)
            return self._batched(h, ids, weights, parts, reads_landed())
        finally:
            reads_landed()  # if the experts at hand failed, the step's reads still land in the cache
            self.streamer.release(plan)
            if self.timer is not None:  # waiting for reads is the plan phase's, though it falls among the experts
                self.timer.add("plan", layer, t1 - t0 + reads_landed.seconds)
                self.timer.add("experts", layer, time.perf_counter() - t1 - reads_landed.seconds)

    def _batched(self, h, ids, weights, parts, fetched, ffn=expert_ffn) -> np.ndarray:
        """Tokens grouped by expert, each expert's rows through its FFN in one graph."""
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
        k = ids.shape[1]
        groups, picks = [], []
        for group in np.split(order, bounds):
            groups.append((group // k, *expert_matrices(fetched[int(flat_ids[group[0]])], parts)))
            picks.append(group)
        ys = ffn(h, groups, self.ops.threads)
        out = np.zeros_like(h)
        for group, y in zip(picks, ys):  # ascending expert id: a fixed order of additions
            out[group // k] += y * flat_w[group][:, None]
        return out

    def _one_token(self, h, ids, weights, parts, fetched, reads_landed=None) -> np.ndarray:
        """A decode step: the same sums, in the same order, as the batched path, without its grouping.

        With `reads_landed` (which waits for this step's reads and completes `fetched`), the experts
        whose bytes are at hand are computed while the others are still being read, then the rest: an
        expert's output does not depend on the graph it shares, and the sum keeps ascending id order."""
        order = np.argsort(ids, kind="stable")
        experts = [int(e) for e in ids[order]]  # ascending expert id
        ys = self._ffns(h, [e for e in experts if e in fetched], parts, fetched)
        if reads_landed is not None:
            reads_landed()
        ys.update(self._ffns(h, [e for e in experts if e not in ys], parts, fetched))
        out = np.zeros_like(h)
        for j, e in zip(order, experts):
            out += ys[e] * weights[j]
        return out

    def _ffns(self, h, experts: list[int], parts, fetched) -> dict[int, np.ndarray]:
        """Each of `experts`' FFN of the one token h, in one graph."""
        if not experts:
            return {}
        groups = [(_ROW0, *expert_matrices(fetched[e], parts)) for e in experts]
        return dict(zip(experts, expert_ffn(h, groups, self.ops.threads)))


class _ReadsLanded:
    """Waits, once, for a step's reads (streamer.finish_acquire); `fetched` then holds every expert.
    Later calls return at once, so the wait can be both a point in the computation and a finally."""

    def __init__(self, streamer: ExpertStreamer, plan, fetched: dict, reads: dict):
        self._finish = lambda: streamer.finish_acquire(plan, fetched, reads)
        self._fetched = fetched
        self._done = False
        self.seconds = 0.0  # spent waiting

    def __call__(self) -> dict:
        if not self._done:
            self._done = True  # not again, even if a read failed: its error has been raised once
            t = time.perf_counter()
            try:
                self._finish()
            finally:
                self.seconds = time.perf_counter() - t
        return self._fetched


def expert_matrices(raw, parts) -> tuple[QuantMatrix, ...]:
    """An expert's gate, up and down as ggml reads them: views of its store-form bytes `raw`."""
    return tuple(QuantMatrix.of(raw[i], q.qtype, q.shape) for i, q in enumerate(parts))


_ROW0 = np.zeros(1, np.int64)


def store_expert_nbytes(layout: LayerExperts) -> int:
    """The unit of this backend's tiers: one expert's store bytes."""
    return layout.expert_nbytes
