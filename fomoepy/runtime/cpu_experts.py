"""Routed-expert FFN on the CPU: each selected expert computed once for all tokens that chose it.

On the CPU the fast tier holds experts in compute-ready form (dequantised float32, gate and up
stacked into one matrix), so a hit costs two matmuls and no decoding. The tier is an LRU under a
byte budget; what fills it comes from an expert source (the GGUF itself, or the expert store).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol

import numpy as np

from fomoepy import quants
from fomoepy.experts.source import LayerExperts

F32 = np.float32

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]


class ExpertReader(Protocol):
    layers: tuple[LayerExperts, ...]

    def read(self, layer: int, expert: int) -> ExpertBytes: ...


class ReadyExpert:
    """gate|up stacked as [2F, D] so one matmul serves both; down [D, F]."""

    __slots__ = ("gate_up", "down")

    def __init__(self, gate_up: np.ndarray, down: np.ndarray):
        self.gate_up = gate_up
        self.down = down

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def make_ready(layout: LayerExperts, raw: ExpertBytes) -> ReadyExpert:
    gate_m, up_m, down_m = layout.parts
    gate = quants.dequantize(raw[0], gate_m.qtype, gate_m.shape, tensor_name=gate_m.tensor)
    up = quants.dequantize(raw[1], up_m.qtype, up_m.shape, tensor_name=up_m.tensor)
    down = quants.dequantize(raw[2], down_m.qtype, down_m.shape, tensor_name=down_m.tensor)
    return ReadyExpert(np.concatenate([gate, up], axis=0), np.ascontiguousarray(down))


class ReadyExpertCache:
    """LRU of compute-ready experts under a byte budget (0 = keep nothing between calls)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[tuple[int, int], ReadyExpert] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, int], load: Callable[[], ReadyExpert]) -> ReadyExpert:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            self.hits += 1
            return item
        self.misses += 1
        item = load()
        if item.nbytes <= self.budget:
            while self.used + item.nbytes > self.budget:
                _, old = self._items.popitem(last=False)
                self.used -= old.nbytes
            self._items[key] = item
            self.used += item.nbytes
        return item

    def __len__(self) -> int:
        return len(self._items)


class CpuExperts:
    """The routed-expert half of a MoE layer: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t])."""

    def __init__(self, reader: ExpertReader, ready_budget_bytes: int):
        self.reader = reader
        self.ready = ReadyExpertCache(ready_budget_bytes)

    def expert(self, layer: int, expert: int) -> ReadyExpert:
        return self.ready.get(
            (layer, expert), lambda: make_ready(self.reader.layers[layer], self.reader.read(layer, expert))
        )

    def ffn(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """h [T, D], ids/weights [T, k] → [T, D].

        Experts are visited in ascending id order, so each token's k contributions are added in the
        same order whether it is decoded alone or prefilled with others.
        """
        out = np.zeros_like(h)
        flat_ids = ids.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        sorted_ids = flat_ids[order]
        bounds = np.flatnonzero(np.diff(sorted_ids)) + 1
        k = ids.shape[1]
        for group in np.split(order, bounds):
            e = int(flat_ids[group[0]])
            rows = group // k  # tokens that chose e (each chooses it at most once)
            x = self.expert(layer, e)
            gu = h[rows] @ x.gate_up.T  # [n, 2F]
            F = x.down.shape[1]
            act = gu[:, :F] / (F32(1) + np.exp(-gu[:, :F])) * gu[:, F:]
            y = act @ x.down.T  # [n, D]
            out[rows] += y * weights.reshape(-1)[group][:, None]
        return out
