"""Routed experts on the ggml CPU backend, computed from the store-form bytes the tiers hold.

There is no device tier on this backend: a host-tier record (or a fresh read, or the mapped GGUF)
is what ggml reads, in place, so a miss costs its read and nothing else: no dequantisation, no
float32 copy. Which experts the host tier holds is the MoE step's decision (fomoepy.experts.step).
"""

from __future__ import annotations

import numpy as np

from fomoepy.experts.device import StepExperts
from fomoepy.experts.routing import softmax_route
from fomoepy.experts.source import LayerExperts
from fomoepy.runtime.ggml_matmul import QuantMatrix, expert_ffn


class GgmlExperts:
    """The cpu backend's expert device: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]), experts added
    in ascending id order. It has no tier of its own (install and evict are never asked of it)."""

    can_download = False

    def __init__(self, layers: tuple[LayerExperts, ...], ops, routers=None):
        self.layers = layers
        self.ops = ops
        self.routers = routers  # every layer's router, to predict the next layer's experts
        self.slot_layers: list | None = None  # use_resident_slots

    def expert_nbytes(self, layer: int) -> int:
        return store_expert_nbytes(self.layers[layer])

    def install(self, key, parts) -> None:
        raise RuntimeError(f"the cpu backend has no device tier: nothing to install {key} into")

    def evict(self, key) -> None:
        raise RuntimeError(f"the cpu backend has no device tier: nothing to evict {key} from")

    def download(self, key):
        return None

    def use_resident_slots(self, slot_layers: list) -> None:
        """Measurement hook (issue 29, until the step wires slots in): every expert of every layer held in
        `slot_layers[layer]` (a fomoepy.runtime.ggml_slots.SlotLayer) at slot = expert id, and `compute`
        does a layer's routed experts as one product over them, bypassing the tiers."""
        self.slot_layers = slot_layers

    def route(self, layer: int, h: np.ndarray, k: int) -> np.ndarray:
        return softmax_route(self.ops.linear(h, self.routers[layer]), k).ids

    def compute(self, layer: int, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: StepExperts) -> np.ndarray:
        """Tokens grouped by expert, each expert's rows through its FFN. The experts whose bytes are at hand
        are computed while the others are still being read, then the rest: an expert's output does not
        depend on the graph it shares, and the sum keeps ascending id order, so the result is the same
        bit for bit whatever was at hand (and a one-token step reuses ggml's cached decode graphs)."""
        if self.slot_layers is not None:
            experts.landed()
            order = np.argsort(ids, axis=1, kind="stable")  # each token's experts in ascending id, as below
            return self.slot_layers[layer].ffn(h, np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1), self.ops.threads)
        parts = self.layers[layer].parts
        flat_ids = ids.reshape(-1)
        flat_w = weights.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(flat_ids[order])) + 1
        k = ids.shape[1]
        picks = {int(flat_ids[group[0]]): group for group in np.split(order, bounds)}  # ascending expert id
        fetched = experts.fetched
        ys = self._ffns(h, [e for e in picks if e in fetched], picks, k, parts, fetched)
        experts.landed()
        ys.update(self._ffns(h, [e for e in picks if e not in ys], picks, k, parts, fetched))
        out = np.zeros_like(h)
        for e, group in picks.items():  # ascending expert id: a fixed order of additions
            out[group // k] += ys[e] * flat_w[group][:, None]
        return out

    def _ffns(self, h, chosen: list[int], picks, k: int, parts, fetched) -> dict[int, np.ndarray]:
        """Each of `chosen`'s FFN of the rows that picked it, in one graph."""
        if not chosen:
            return {}
        groups = [(picks[e] // k, *expert_matrices(fetched[e], parts)) for e in chosen]
        return dict(zip(chosen, expert_ffn(h, groups, self.ops.threads)))

    def close(self) -> None:
        pass


def expert_matrices(raw, parts) -> tuple[QuantMatrix, ...]:
    """An expert's gate, up and down as ggml reads them: views of its store-form bytes `raw`."""
    return tuple(QuantMatrix.of(raw[i], q.qtype, q.shape) for i, q in enumerate(parts))



def store_expert_nbytes(layout: LayerExperts) -> int:
    """The unit of this backend's tiers: one expert's store bytes."""
    return layout.expert_nbytes
