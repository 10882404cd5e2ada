"""The cpu backend's expert tier: slots in ggml tensors, shared by every layer of one expert layout.

Layers whose experts have the same types and shapes (most models: all of them) share one SlotLayer
(fomoepy.runtime.ggml_slots), so the tier's one byte budget for all layers is one pool of slots, and
a layer's step is one mul_mat_id over it, whichever slots its experts sit in:

    slots [0, n_tier)                     the tier's experts, keyed (layer, expert); a freed slot is
                                          reused lowest first, so the memory touched stays the
                                          fewest slots the tier has held at once
    slots [n_tier, n_tier + n_staging)    a step's misses the tier does not keep, set for that step

Every slot of a pool is held alike (all plain, or all repacked where ggml has kernels for the type),
so a miss set into a staging slot is computed by the same kernels as when it is a tier slot: streamed
logits are the resident ones, bit for bit. Which experts the tier holds is the cache's decision; this only
places them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.policy import Key
from fomoepy.runtime.ggml_slots import SlotLayer

Layout = tuple[tuple[int, tuple[int, int]], ...]  # (GGUF type, (rows, cols)) of gate, up, down


def layout_of(layer) -> Layout:
    """A layer's expert layout (a LayerExperts, or anything with `.parts` of qtype and shape)."""
    return tuple((int(p.qtype), (int(p.shape[0]), int(p.shape[1]))) for p in layer.parts)


class SlotPool:
    """`n_tier` tier slots and `n_staging` staging slots of one expert layout."""

    def __init__(self, layout: Layout, n_tier: int, n_staging: int, n_expert: int, repack: bool = False):
        if n_tier < 0 or n_staging < 1:
            raise FomoeError(f"expected >= 0 tier slots and >= 1 staging slot, got {n_tier} and {n_staging}")
        self.layer = SlotLayer(layout, n_tier + n_staging, repack)
        self.n_tier, self.n_staging, self.n_expert = n_tier, n_staging, n_expert
        self._slot: dict[Key, int] = {}
        self._free = list(range(n_tier))  # a heap: the lowest free slot first
        self._lut: dict[int, np.ndarray] = {}  # layer -> [n_expert] int32: each expert's slot, -1 where none

    @property
    def slot_nbytes(self) -> int:
        """One expert's bytes in a slot (gate, up and down)."""
        return sum(m.slot_nbytes for m in self.layer.mats)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slot(self, key: Key) -> int:
        return self._slot[key]

    def slots_of(self, layer: int) -> np.ndarray:
        """[n_expert] int32: the slot of each expert of `layer` the tier holds, -1 for the others (a
        decode step maps its picks to slots with one lookup). Read-only to the caller."""
        lut = self._lut.get(layer)
        if lut is None:
            lut = self._lut[layer] = np.full(self.n_expert, -1, np.int32)
        return lut

    def install(self, key: Key, raw: Sequence[np.ndarray]) -> int:
        """Set the expert's store bytes into a free tier slot; returns it."""
        if key in self._slot:
            raise FomoeError(f"expert {key} installed twice (slot {self._slot[key]})")
        if not self._free:
            raise FomoeError(f"installing {key}: expected a free slot, got all {self.n_tier} held")
        slot = heapq.heappop(self._free)
        try:
            self.layer.set_slot(slot, raw)
        except Exception:
            heapq.heappush(self._free, slot)
            raise
        self._slot[key] = slot
        self.slots_of(key[0])[key[1]] = slot
        return slot

    def evict(self, key: Key) -> None:
        slot = self._slot.pop(key, None)
        if slot is None:
            raise FomoeError(f"evicting {key}: expected it in a slot, got none")
        self.slots_of(key[0])[key[1]] = -1
        heapq.heappush(self._free, slot)

    def stage(self, i: int, raw: Sequence[np.ndarray]) -> int:
        """Set an expert's store bytes into staging slot i for this step; returns the slot."""
        if not 0 <= i < self.n_staging:
            raise FomoeError(f"staging slot {i} outside [0, {self.n_staging})")
        self.layer.set_slot(self.n_tier + i, raw)
        return self.n_tier + i

    def close(self) -> None:
        self.layer.close()
        self._slot.clear()
        self._lut.clear()
