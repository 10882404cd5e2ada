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
        self._waited = 0.0  # this step's time in finish_acquire (the plan phase's, though it falls among the experts)
        self._finished = False  # this step's finish_acquire has been called

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

    def ffn(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        plan, fetched, reads = self.streamer.start_acquire(layer, ids)
        self._waited, self._finished = 0.0, False
        t1 = time.perf_counter()
        try:
            parts = self.layers[layer].parts
            if h.shape[0] == 1:
                return self._one_token(h, ids[0], weights[0], parts, fetched, lambda: self._finish(plan, fetched, reads))
            return self._batched(h, ids, weights, parts, self._finish(plan, fetched, reads))
        finally:
            if not self._finished:  # the experts at hand failed: the step's reads still land in the cache
                self._finish(plan, fetched, reads)
            self.streamer.release(plan)
            if self.timer is not None:
                self.timer.add("plan", layer, t1 - t0 + self._waited)
                self.timer.add("experts", layer, time.perf_counter() - t1 - self._waited)

    def _finish(self, plan, fetched, reads) -> dict:
        t = time.perf_counter()
        self._finished = True
        try:
            return self.streamer.finish_acquire(plan, fetched, reads)
        finally:
            self._waited += time.perf_counter() - t


    def _batched(self, h, ids, weights, parts, fetched, ffn=expert_ffn) -> np.ndarray:
        """Tokens grouped by expert, each expert's rows through its FFN in one graph."""
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
        k = ids.shape[1]
        groups, picks = [], []
        for group in np.split(order, bounds):
            raw = fetched[int(flat_ids[group[0]])]
            mats = tuple(QuantMatrix.of(raw[i], p.qtype, p.shape) for i, p in enumerate(parts))
            groups.append((group // k, *mats))
            picks.append(group)
        ys = ffn(h, groups, self.ops.threads)
        out = np.zeros_like(h)
        for group, y in zip(picks, ys):  # ascending expert id: a fixed order of additions
            out[group // k] += y * flat_w[group][:, None]
        return out

    def _one_token(self, h, ids, weights, parts, fetched, finish=None) -> np.ndarray:
        """A decode step: the same sums, in the same order, as the batched path, without its grouping.

        With `finish` (which waits for this step's reads and completes `fetched`), the experts whose
        bytes are at hand are computed while the others are still being read, then the rest: an
        expert's output does not depend on the graph it shares, and the sum keeps ascending id order."""
        experts = [int(e) for e in ids[np.argsort(ids, kind="stable")]]  # ascending expert id
        ys: dict[int, np.ndarray] = {}
        for batch in ([e for e in experts if e in fetched], None):
            if batch is None:
                if finish is not None:
                    finish()
                batch = [e for e in experts if e not in ys]
            if batch:
                groups = [(_ROW0, *(QuantMatrix.of(fetched[e][i], q.qtype, q.shape) for i, q in enumerate(parts))) for e in batch]
                ys.update(zip(batch, expert_ffn(h, groups, self.ops.threads)))
        out = np.zeros_like(h)
        for j in np.argsort(ids, kind="stable"):
            out += ys[int(ids[j])] * weights[j]
        return out


_ROW0 = np.zeros(1, np.int64)


def store_expert_nbytes(layout: LayerExperts) -> int:
    """The unit of this backend's tiers: one expert's store bytes."""
    return layout.expert_nbytes
