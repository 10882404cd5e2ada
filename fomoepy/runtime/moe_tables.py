"""The host side of the grouped expert launches (hip_kernels/experts.hip): one step's pairs and work
items, packed into one buffer so that a step uploads its tables with one copy.

A step has T tokens with k choices each; pair p = t*k + j is token t's j-th choice, a token's choices
sorted by ascending expert id (the order the CPU backend adds them in). A work item is one expert and up
to MOE_TILE of its pairs. The work items of the experts named `first` come first in the table, then
those named `then`, then the rest, so that a step can launch a stretch of the table as soon as its
experts are in device slots: the experts already there first, computed while the others are still being
copied up; then those whose bytes are at hand, copied at once; then each read as it lands. Each pair's activations and partial output are
written by the one work item that holds it, whatever the items' order, and the combine adds a token's
pairs in j order: the sums do not depend on where the table is split.

    | pairs: T*k x PairInfo (16 B) | work: the first experts' items, `then`'s, the others' (64 B each) |
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

try:  # optional (setup.py): without it the tables are packed here, in Python (the same bytes)
    from fomoepy.runtime._moe_tables import pack_decode, pack_rows
except ImportError:
    pack_decode = pack_rows = None

MOE_TILE = 8  # pairs per work item (MOE_TILE in hip_kernels/experts.hip)

# hip_kernels/experts.hip: struct ExpertWork (64 B) and struct PairInfo (16 B)
EXPERT_WORK_DTYPE = np.dtype(
    [("gate", "<u8"), ("up", "<u8"), ("down", "<u8"), ("n_pairs", "<i4"), ("pad", "<i4"), ("pair", "<i4", (MOE_TILE,))]
)
PAIR_DTYPE = np.dtype([("down", "<u8"), ("weight", "<f4"), ("pad", "<i4")])
DECODE_MAX_K = 64  # choices per token the compiled packer takes (MAX_K in fomoepy/runtime/_moe_pack.h)


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs a microsecond, and a step makes one)
class MoETables:
    host: np.ndarray | None  # uint8: the bytes to upload, pairs then work items (None: packed and uploaded in C, DecodeLaunch)
    work_offset: int  # bytes before the first work item (T*k PairInfo: a multiple of 16)
    n_first: int  # work items of the `first` experts: rows [0, n_first)
    n_work: int
    tile: int  # 1 when every work item has one pair, else MOE_TILE: the gate/up kernel's variant
    experts: list[int]  # the expert of each work item, in table order

    def work_row(self, row: int) -> int:
        """Byte offset of work item `row` in the uploaded tables."""
        return self.work_offset + row * EXPERT_WORK_DTYPE.itemsize


def build_tables(ids: np.ndarray, weights: np.ndarray, slot_ptr: dict[int, int], offsets: tuple[int, int, int],
                 first: Collection[int] = (), then: Collection[int] = ()) -> MoETables:  # fmt: skip
    """ids/weights [T, k]; slot_ptr: each chosen expert's device slot; offsets: gate, up, down in a slot;
    first, then: experts whose work items lead the table, in that order (the rest by ascending id)."""
    T, k = ids.shape
    if T == 1:  # a decode step: k distinct experts, ascending, one work item (one pair) each
        if pack_decode is not None and k <= DECODE_MAX_K:
            host, n_first, experts = pack_decode(ids[0].tolist(), weights[0].tolist(), slot_ptr, tuple(offsets), first, then)
            return MoETables(np.frombuffer(host, np.uint8), k * PAIR_DTYPE.itemsize, n_first, k, 1, experts)
        return _decode_tables(ids[0].tolist(), weights[0], slot_ptr, offsets, first, then)
    if pack_rows is not None and k <= DECODE_MAX_K:
        host, n_first, experts, tile = pack_rows(np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(weights, np.float32), k,
                                                 slot_ptr, tuple(offsets), first, then)  # fmt: skip
        return MoETables(np.frombuffer(host, np.uint8), T * k * PAIR_DTYPE.itemsize, n_first, len(experts), tile, experts)
    return _rows_tables(ids, weights, slot_ptr, offsets, first, then)


def _rows_tables(ids: np.ndarray, weights: np.ndarray, slot_ptr: dict[int, int], offsets: tuple[int, int, int],
                 first: Collection[int], then: Collection[int]) -> MoETables:  # fmt: skip
    """build_tables for T > 1 tokens in whole-array numpy: the definition of what fomoepy/runtime/_moe_tables.c's
    pack_rows packs in C, where it is built (the same bytes)."""
    T, k = ids.shape
    # each token's choices by ascending expert id: the order the CPU backend adds them in
    order = np.argsort(ids, axis=1, kind="stable")
    flat = np.take_along_axis(ids, order, axis=1).reshape(-1)  # [T*k]
    w_s = np.take_along_axis(weights, order, axis=1).astype(np.float32)
    # a work item is one expert and up to MOE_TILE of its pairs, ascending; the experts by rank (first, then,
    # the rest), ascending ids within each. In whole-array operations: a step of B rows has ~5B experts
    uniq, of_pair = np.unique(flat, return_inverse=True)
    chosen = uniq.tolist()
    rank = np.array([0 if e in first else 1 if e in then else 2 for e in chosen], np.int64)
    order_e = np.lexsort((uniq, rank))  # the experts' order in the table
    place = np.empty_like(order_e)
    place[order_e] = np.arange(len(chosen))
    key = place[of_pair]  # each pair's expert's place
    pair_order = np.argsort(key, kind="stable")  # the pairs by expert, ascending within each
    counts = np.bincount(key, minlength=len(chosen))
    per_expert = -(-counts // MOE_TILE)  # its work items
    item_expert = np.repeat(np.arange(len(chosen)), per_expert)
    chunk = np.arange(len(item_expert)) - np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
    start = (np.cumsum(counts) - counts)[item_expert] + chunk * MOE_TILE
    n_pairs = np.minimum(MOE_TILE, counts[item_expert] - chunk * MOE_TILE)
    experts = uniq[order_e][item_expert].tolist()
    host, pairs, work = _buffers(T * k, len(experts))
    ptr = np.fromiter((slot_ptr[e] for e in chosen), np.uint64, count=len(chosen))
    item_base = ptr[order_e][item_expert]
    work["gate"], work["up"], work["down"] = (item_base + np.uint64(o) for o in offsets)
    work["n_pairs"] = n_pairs
    lanes = np.arange(MOE_TILE)
    used = lanes < n_pairs[:, None]
    work["pair"][used] = pair_order[(start[:, None] + lanes)[used]]
    n_first = int(np.count_nonzero(rank[order_e][item_expert] == 0))
    tile = 1 if (n_pairs == 1).all() else MOE_TILE
    pairs["down"] = ptr[of_pair] + np.uint64(offsets[2])
    pairs["weight"] = w_s.reshape(-1)
    return MoETables(host, T * k * PAIR_DTYPE.itemsize, n_first, len(work), tile, experts)


def _decode_tables(row: list[int], weights: np.ndarray, slot_ptr: dict[int, int], offsets: tuple[int, int, int],
                   first: Collection[int], then: Collection[int]) -> MoETables:  # fmt: skip
    """build_tables for one token (every decode step): its k choices in list arithmetic, the table packed by
    one struct call (numpy's field assignments cost a microsecond or more each). The definition of what
    fomoepy/runtime/_moe_tables.c packs in C, where it is built (the same bytes, a tenth of the time)."""
    k = len(row)
    order = sorted(range(k), key=row.__getitem__)  # ascending expert id; pair p is the p-th of them
    ptrs = [slot_ptr[row[j]] for j in order]
    if first or then:
        rank = [0 if row[j] in first else 1 if row[j] in then else 2 for j in order]
        rows = sorted(range(k), key=rank.__getitem__)  # stable: ascending ids within each rank
        n_first = rank.count(0)
    else:
        rows, n_first = list(range(k)), 0
    gate, up, down = offsets
    w = weights.tolist()
    values: list[int | float] = []
    for p, j in enumerate(order):  # PairInfo: the down matrix of pair p's slot, its weight
        values += (ptrs[p] + down, w[j])
    for p in rows:  # ExpertWork: one pair each, so n_pairs 1 and pair[0] = p
        base = ptrs[p]
        values += (base + gate, base + up, base + down, 1, p)
    host = np.frombuffer(bytearray(_decode_struct(k).pack(*values)), np.uint8)
    return MoETables(host, k * PAIR_DTYPE.itemsize, n_first, k, 1, [row[order[p]] for p in rows])


@functools.cache
def _decode_struct(k: int) -> struct.Struct:
    """A decode step's tables as one struct: k PairInfo (down, weight, pad), then k ExpertWork
    (gate, up, down, n_pairs, pad, pair[MOE_TILE] with only pair[0] set)."""
    work = "QQQi4xi" + f"{4 * (MOE_TILE - 1)}x"
    layout = struct.Struct("<" + "Qf4x" * k + work * k)
    assert layout.size == k * (PAIR_DTYPE.itemsize + EXPERT_WORK_DTYPE.itemsize)
    return layout


def _buffers(n_pairs: int, n_work: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One zeroed host buffer and its two typed views: pairs, then work items."""
    split = n_pairs * PAIR_DTYPE.itemsize
    host = np.zeros(split + n_work * EXPERT_WORK_DTYPE.itemsize, np.uint8)
    return host, host[:split].view(PAIR_DTYPE), host[split:].view(EXPERT_WORK_DTYPE)
