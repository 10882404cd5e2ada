"""Where an expert's bytes live in a GGUF file: an index built once, read by offset afterwards.

Expert e of a 3-D expert tensor is the contiguous byte range [e·S, (e+1)·S) of its data, S = nbytes / n_expert.
An expert is the triple (gate, up, down) of one MoE layer, each in its tensor's quant type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType

from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class ExpertMatrix:
    """One of gate / up / down of every expert of a layer: type, per-expert shape and byte size."""

    tensor: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # numpy order: (rows, cols) of one expert
    nbytes: int  # of one expert
    offset: int  # absolute file offset of expert 0

    def range_of(self, expert: int) -> tuple[int, int]:
        return self.offset + expert * self.nbytes, self.nbytes


@dataclass(frozen=True)
class LayerExperts:
    layer: int
    parts: tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]  # gate, up, down
    expert_nbytes: int = field(init=False)  # the three parts' bytes (asked for by every read: summed once)

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_nbytes", sum(p.nbytes for p in self.parts))


def expert_index(gf: GGUFFile, spec: ModelSpec) -> tuple[LayerExperts, ...]:
    """The byte layout of every MoE layer's experts (spec has checked the shapes already)."""
    layers = []
    for il in range(spec.n_layer):
        parts = []
        for part in EXPERT_PARTS:
            info = gf.tensor(f"blk.{il}.{part}.weight")
            offset, nbytes = info.slice_bytes(0)  # expert e starts e·nbytes after expert 0
            parts.append(
                ExpertMatrix(
                    tensor=info.name,
                    qtype=info.qtype,
                    shape=(info.shape[1], info.shape[2]),
                    nbytes=nbytes,
                    offset=offset,
                )
            )
        layers.append(LayerExperts(il, (parts[0], parts[1], parts[2])))
    return tuple(layers)


class GGUFExpertSource:
    """Experts read straight from the memory-mapped GGUF (no store prepared): zero-copy byte views."""

    def __init__(self, gf: GGUFFile, spec: ModelSpec, unmap_after_use: bool = False):
        """unmap_after_use: the streamer drops each expert's pages once computed (memory the user bounded
        with --ram-cache); otherwise they stay mapped, which decodes the bench model 40 % faster."""
        self.gf = gf
        self.layers = expert_index(gf, spec)
        self.unmap_after_use = unmap_after_use

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        data = self.gf.raw_file()
        views = []
        for part in self.layers[layer].parts:
            start, size = part.range_of(expert)
            views.append(data[start : start + size])
        return views[0], views[1], views[2]

    def drop(self, layer: int, experts: Iterable[int]) -> None:
        """Unmap the pages reading these experts made resident (the page cache keeps them)."""
        self.gf.drop_pages(*(part.range_of(e) for e in experts for part in self.layers[layer].parts))
