"""Routed-expert FFN on the CPU: each selected expert computed once for all tokens that chose it.

On the CPU the device tier holds experts in compute-ready form (dequantised float32, gate and up
stacked into one matrix), so a hit costs two matmuls and no decoding. Which experts it holds is
the MoE step's decision (fomoepy.experts.step); this module only fills and reads it.
"""

from __future__ import annotations

import numpy as np

from fomoepy import quants
from fomoepy.experts.device import Phase, StepExperts
from fomoepy.experts.routing import softmax_route
from fomoepy.experts.source import LayerExperts

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
    """The reference backend's expert device: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]).

    Its tier holds compute-ready experts (fomoepy.experts.device.ExpertDevice); with a demoting policy
    (`keep_raw`) each keeps the store bytes it was made from, which go down to the host tier when it is
    evicted (float32 cannot be turned back into store bytes)."""

    def __init__(self, layers: tuple[LayerExperts, ...], routers: list[np.ndarray] | None = None, keep_raw: bool = False):
        self.layers = layers
        self.ready: dict[tuple[int, int], ReadyExpert] = {}
        self.routers = routers  # every layer's router, to predict the next layer's experts
        self.keep_raw = keep_raw
        self.can_download = keep_raw
        # a step's rows may be computed in runs (MoEStep): a run's experts from the step's plan and reads, as alone
        self.computes_runs = True

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one compute-ready expert of `layer` (the device tier's unit on this backend)."""
        return ready_expert_nbytes(self.layers[layer], self.keep_raw)

    def install(self, key: tuple[int, int], parts: ExpertBytes) -> None:
        self.ready[key] = make_ready(self.layers[key[0]], parts, self.keep_raw)

    def evict(self, key: tuple[int, int]) -> None:
        self.ready.pop(key, None)

    def download(self, key: tuple[int, int]) -> ExpertBytes | None:
        return self.ready[key].raw

    def route(self, layer: int, h: np.ndarray, k: int) -> np.ndarray:
        return softmax_route(h @ self.routers[layer].T, k).ids

    def compute(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> np.ndarray:
        """h [T, D], ids/weights [T, k] → [T, D]; every read landed first (dequantising needs the bytes)."""
        fetched = experts.landed()
        ready: dict[int, ReadyExpert] = {}
        wanted = set(ids.ravel().tolist())  # (the plan's experts, or of a step computed in runs this run's)
        for item in experts.plan.items:
            if item.expert not in wanted:
                continue
            key = (layer, item.expert)
            x = self.ready.get(key)
            if x is None:
                x = make_ready(self.layers[layer], fetched[item.expert], self.keep_raw and item.to_device)
                if item.to_device:
                    self.ready[key] = x
            ready[item.expert] = x
        # a decode step's rows (one per sequence of a batch) are multiplied one at a time, so each
        # sequence gets the bits it gets alone; a prefill's rows share one GEMM per expert
        return self._compute(h, ids, weights, ready, rowwise=experts.phase is Phase.DECODE)

    def close(self) -> None:
        self.ready.clear()

    @staticmethod
    def _compute(h: np.ndarray, ids: np.ndarray, weights: np.ndarray, ready: dict[int, ReadyExpert], rowwise: bool = False) -> np.ndarray:
        """Experts are visited in ascending id order, so each token's k contributions are added in the
        same order whether it is decoded alone or prefilled with others, and whatever the cache held."""
        out = np.zeros_like(h)
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
        k = ids.shape[1]
        for group in np.split(order, bounds):
            x = ready[int(flat_ids[group[0]])]
            rows = group // k  # tokens that chose this expert (each chooses it at most once)
            F = x.down.shape[1]
            if rowwise:  # numpy's stacked matmul: one GEMV per row, the product a row gets alone
                gu = np.matmul(h[rows][:, None, :], x.gate_up.T)[:, 0]  # [n, 2F]
                act = gu[:, :F] / (F32(1) + np.exp(-gu[:, :F])) * gu[:, F:]
                out[rows] += np.matmul(act[:, None, :], x.down.T)[:, 0] * flat_w[group][:, None]  # [n, D]
            else:
                gu = h[rows] @ x.gate_up.T  # [n, 2F]
                act = gu[:, :F] / (F32(1) + np.exp(-gu[:, :F])) * gu[:, F:]
                out[rows] += (act @ x.down.T) * flat_w[group][:, None]  # [n, D]
        return out


def ready_expert_nbytes(layout: LayerExperts, demotes: bool = False) -> int:
    """float32 gate, up and down, plus the store bytes when a demoting policy keeps them."""
    return sum(p.shape[0] * p.shape[1] for p in layout.parts) * 4 + (layout.expert_nbytes if demotes else 0)
