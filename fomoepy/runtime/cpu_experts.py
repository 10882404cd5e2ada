"""Routed-expert FFN on the CPU: each selected expert computed once for all tokens that chose it.

On the CPU the device tier holds experts in compute-ready form (dequantised float32, gate and up
stacked into one matrix), so a hit costs two matmuls and no decoding. Which experts it holds is
the expert cache's decision (fomoepy.experts.streamer); this module only fills and reads it.
"""

from __future__ import annotations

import time

import numpy as np

from fomoepy import quants
from fomoepy.experts.routing import Routing, softmax_route
from fomoepy.experts.source import LayerExperts
from fomoepy.experts.streamer import ExpertStreamer

F32 = np.float32

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]


class ReadyExpert:
    """gate|up stacked as [2F, D] so one matmul serves both; down [D, F]; with a demoting policy, the
    store bytes it was made from (`raw`), which go down to the host tier when it is evicted."""

    __slots__ = ("down", "gate_up", "raw")

    def __init__(self, gate_up: np.ndarray, down: np.ndarray, raw: ExpertBytes | None = None):
        self.gate_up = gate_up
        self.down = down
        self.raw = raw

    @property
    def nbytes(self) -> int:
        kept = sum(part.nbytes for part in self.raw) if self.raw is not None else 0
        return self.gate_up.nbytes + self.down.nbytes + kept


def make_ready(layout: LayerExperts, raw: ExpertBytes, keep_raw: bool = False) -> ReadyExpert:
    gate_m, up_m, down_m = layout.parts
    gate = quants.dequantize(raw[0], gate_m.qtype, gate_m.shape, tensor_name=gate_m.tensor)
    up = quants.dequantize(raw[1], up_m.qtype, up_m.shape, tensor_name=up_m.tensor)
    down = quants.dequantize(raw[2], down_m.qtype, down_m.shape, tensor_name=down_m.tensor)
    return ReadyExpert(np.concatenate([gate, up], axis=0), np.ascontiguousarray(down), raw if keep_raw else None)


class CpuExperts:
    """The routed-expert half of a MoE layer: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]).

    The streamer decides where each expert comes from; this class holds the device tier's contents
    (compute-ready experts) and does the arithmetic.
    """

    def __init__(self, streamer: ExpertStreamer, routers: list[np.ndarray] | None = None, timer=None):
        self.streamer = streamer
        self.layers = streamer.layers
        self.ready: dict[tuple[int, int], ReadyExpert] = {}
        self.routers = routers  # every layer's router, to predict the next layer's experts
        self.timer = timer  # a fomoepy.timing.LayerTimer when --profile-timing is on
        # float32 cannot be turned back into store bytes: with a demoting policy each device expert keeps
        # the ones it was made from (counted in the tier's unit, ready_expert_nbytes(demotes=True))
        self.keep_raw = streamer.demotes
        if self.keep_raw:
            streamer.set_downloader(lambda key: self.ready[key].raw)  # type: ignore[arg-type,return-value]
        for key in streamer.seed_from_profile():
            self.ready[key] = make_ready(self.layers[key[0]], streamer.source.read(*key), self.keep_raw)

    def begin_step(self) -> None:
        self.streamer.begin_step()

    def end_step(self, n_tokens: int) -> None:
        self.streamer.end_step(n_tokens)

    def choose(self, layer: int, h: np.ndarray, exact: Routing) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        ids, weights = self.streamer.choose(layer, exact)
        nxt = layer + 1
        if self.routers is not None and nxt < len(self.routers) and h.shape[0] == 1:
            # decode only: a prefill batch's union of predictions would be most of the layer
            predicted = softmax_route(h @ self.routers[nxt].T, exact.ids.shape[1]).ids
            self.streamer.predict(nxt, predicted)
        if self.timer is not None:
            self.timer.add("router", layer, time.perf_counter() - t0)
        return ids, weights

    def ffn(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """h [T, D], ids/weights [T, k] → [T, D].

        Experts are visited in ascending id order, so each token's k contributions are added in the
        same order whether it is decoded alone or prefilled with others, and whatever the cache held.
        """
        t0 = time.perf_counter()
        plan, fetched = self.streamer.acquire(layer, ids)
        t1 = time.perf_counter()
        try:
            for victim in plan.device_evictions:
                self.ready.pop(victim, None)
            ready: dict[int, ReadyExpert] = {}
            for item in plan.items:
                key = (layer, item.expert)
                x = self.ready.get(key)
                if x is None:
                    x = make_ready(self.layers[layer], fetched[item.expert], self.keep_raw and item.to_device)
                    if item.to_device:
                        self.ready[key] = x
                ready[item.expert] = x
            return self._compute(h, ids, weights, ready)
        finally:
            self.streamer.release(plan)
            if self.timer is not None:
                self.timer.add("plan", layer, t1 - t0)
                self.timer.add("experts", layer, time.perf_counter() - t1)

    @staticmethod
    def _compute(h: np.ndarray, ids: np.ndarray, weights: np.ndarray, ready: dict[int, ReadyExpert]) -> np.ndarray:
        out = np.zeros_like(h)
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
        k = ids.shape[1]
        for group in np.split(order, bounds):
            x = ready[int(flat_ids[group[0]])]
            rows = group // k  # tokens that chose this expert (each chooses it at most once)
            gu = h[rows] @ x.gate_up.T  # [n, 2F]
            F = x.down.shape[1]
            act = gu[:, :F] / (F32(1) + np.exp(-gu[:, :F])) * gu[:, F:]
            out[rows] += (act @ x.down.T) * flat_w[group][:, None]  # [n, D]
        return out

    def ready_nbytes(self, layer: int) -> int:
        """Bytes of one compute-ready expert of `layer` (the device tier's unit on this backend)."""
        return ready_expert_nbytes(self.layers[layer], self.keep_raw)


def ready_expert_nbytes(layout: LayerExperts, demotes: bool = False) -> int:
    """float32 gate, up and down, plus the store bytes when a demoting policy keeps them."""
    return sum(p.shape[0] * p.shape[1] for p in layout.parts) * 4 + (layout.expert_nbytes if demotes else 0)
