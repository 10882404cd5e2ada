"""An expert store of a model that is not here: every read completes at once and carries no bytes.

For measuring the host's own time per MoE layer step at a real model's shape (bench/host_time.py):
the layers have the true byte sizes of every expert (from fomoepy.plan.shapes and the quant table), so
every tier's bookkeeping, every plan and every copy the device is asked for are the real ones, while a
read costs nothing: each expert's parts are views of one shared zero buffer per layer shape.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from fomoepy.experts.source import ExpertMatrix, LayerExperts
from fomoepy.plan.shapes import MIXES, ModelShape
from fomoepy.quants import row_nbytes


def shape_layers(shape: ModelShape, mix_name: str | None = None) -> tuple[LayerExperts, ...]:
    """The expert layout of every layer of `shape` at a quant mix (gate, up: [ff, n_embd]; down: [n_embd, ff])."""
    mix = MIXES[mix_name or shape.default_mix]
    e, f = shape.n_embd, shape.expert_ff
    layers = []
    for il in range(shape.n_layer):
        parts = tuple(
            ExpertMatrix(f"blk.{il}.{name}.weight", qtype, (rows, cols), rows * row_nbytes(qtype, cols), 0)
            for name, qtype, rows, cols in (
                ("ffn_gate_exps", mix.expert_gate_up, f, e),
                ("ffn_up_exps", mix.expert_gate_up, f, e),
                ("ffn_down_exps", mix.expert_down, e, f),
            )
        )
        layers.append(LayerExperts(il, parts))  # type: ignore[arg-type]
    return tuple(layers)


class NullStore:
    """`read` and `submit` of an expert store (fomoepy.experts.store_reader.ExpertStore) that do no I/O."""

    def __init__(self, layers: tuple[LayerExperts, ...]):
        self.layers = layers
        self._parts: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
        self.reads = 0

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.reads += 1
        sizes = tuple(p.nbytes for p in self.layers[layer].parts)
        parts = self._parts.get(sizes)
        if parts is None:
            block = np.zeros(sum(sizes), np.uint8)
            bounds = np.cumsum((0,) + sizes)
            parts = self._parts[sizes] = tuple(block[a:b] for a, b in zip(bounds, bounds[1:]))
        return parts  # type: ignore[return-value]

    def slot_nbytes(self, layer: int) -> int:
        return self.layers[layer].expert_nbytes

    def submit(self, layer: int, expert: int, out: np.ndarray | None = None) -> Future:
        """A read into `out` (views of it, its bytes untouched) or into the shared buffer."""
        done: Future = Future()
        if out is None:
            done.set_result(self.read(layer, expert))
        else:
            self.reads += 1
            bounds = np.cumsum([0] + [p.nbytes for p in self.layers[layer].parts])
            done.set_result(tuple(out[a:b] for a, b in zip(bounds, bounds[1:])))
        return done
