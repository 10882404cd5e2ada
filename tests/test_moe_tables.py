"""The grouped expert launches' tables (fomoepy.runtime.moe_tables), read back from their bytes: every
pair in exactly one work item of its own expert, the `first` experts' items ahead of the others, and the
pairs' weights and slots in ascending expert order per token. The kernels' side of it (the same bits
split or not) is tests/test_gpu_schedule.py."""

from __future__ import annotations

import numpy as np
import pytest

from fomoepy.runtime import moe_tables
from fomoepy.runtime.moe_tables import (
    EXPERT_WORK_DTYPE,
    MOE_TILE,
    PAIR_DTYPE,
    _decode_tables,
    _rows_tables,
    build_tables,
)

OFFSETS = (0, 4096, 8192)  # gate, up, down in a slot


@pytest.mark.parametrize("T", [1, 3, 6, 40])
@pytest.mark.parametrize("n_first", [0, 1, 5])
@pytest.mark.parametrize("n_then", [0, 2])
def test_every_pair_is_in_one_work_item_of_its_expert_and_the_first_experts_lead(T, n_first, n_then):
    rng = np.random.default_rng(T * 10 + n_first)
    E, k = 16, 4
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    weights = rng.random((T, k)).astype(np.float32)
    chosen = sorted(set(ids.reshape(-1).tolist()))
    slot = {e: (e + 1) << 20 for e in chosen}
    first = set(chosen[len(chosen) - min(n_first, len(chosen) - 1) :])  # the highest: in id order they come last
    then = set([e for e in chosen if e not in first][-n_then:]) if n_then else set()  # the next highest
    t = build_tables(ids, weights, slot, OFFSETS, first, then)
    pairs = t.host[: t.work_offset].view(PAIR_DTYPE)
    work = t.host[t.work_offset :].view(EXPERT_WORK_DTYPE)
    assert len(work) == t.n_work and t.work_row(t.n_work) == t.host.size

    order = np.argsort(ids, axis=1, kind="stable")
    expert_of_pair = np.take_along_axis(ids, order, axis=1).reshape(-1)  # pair p = t*k + j, j ascending
    assert np.array_equal(pairs["weight"], np.take_along_axis(weights, order, axis=1).reshape(-1))
    assert np.array_equal(pairs["down"], [slot[e] + OFFSETS[2] for e in expert_of_pair])

    seen = []
    for row, item in enumerate(work):
        e = (int(item["gate"]) >> 20) - 1
        assert (int(item["up"]), int(item["down"])) == (slot[e] + OFFSETS[1], slot[e] + OFFSETS[2])
        assert 1 <= item["n_pairs"] <= MOE_TILE
        ps = item["pair"][: item["n_pairs"]].tolist()
        assert all(expert_of_pair[p] == e for p in ps)  # the item's pairs are its expert's
        assert (e in first) == (row < t.n_first)  # the first experts' items lead, theirs only
        assert t.experts[row] == e
        seen += ps
    rank = [0 if e in first else 1 if e in then else 2 for e in t.experts]
    assert rank == sorted(rank)  # first, then `then`, then the rest
    for r in (0, 1, 2):  # ascending ids within each
        ids_r = [e for e, q in zip(t.experts, rank) if q == r]
        assert ids_r == sorted(ids_r)
    assert sorted(seen) == list(range(T * k))  # every pair once
    assert t.tile == (1 if all(item["n_pairs"] == 1 for item in work) else MOE_TILE)


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_steps_tables_packed_in_c_are_the_pythons_bytes(seed):
    """The compiled packer (fomoepy/runtime/_moe_tables.c) of a decode step's tables gives the bytes, the
    leading count and the order of the Python definition, whatever experts lead."""
    if moe_tables.pack_decode is None:
        pytest.skip("fomoepy.runtime._moe_tables is not built (no C compiler at install)")
    rng = np.random.default_rng(seed)
    E, k = 512, [1, 4, 8, 10, 16, 22][seed]
    ids = rng.choice(E, k, replace=False)[None, :].astype(np.int64)
    weights = rng.random((1, k)).astype(np.float32)
    slot = {int(e): int(rng.integers(1, 1 << 40)) << 8 for e in ids[0]}
    chosen = ids[0].tolist()
    for first, then in [((), ()), (set(chosen[: k // 2]), chosen[k // 2 : k - 1]), ({chosen[-1]}, ()), ((), chosen[:3])]:
        compiled = build_tables(ids, weights, slot, OFFSETS, first, then)
        python = _decode_tables(chosen, weights[0], slot, OFFSETS, first, then)
        assert compiled.host.tobytes() == python.host.tobytes()
        assert (compiled.n_first, compiled.n_work, compiled.tile, compiled.experts, compiled.work_offset) == (
            python.n_first, python.n_work, python.tile, python.experts, python.work_offset)  # fmt: skip
    with pytest.raises(KeyError):  # an expert with no slot: as the Python definition
        build_tables(ids, weights, {e: p for e, p in slot.items() if e != chosen[0]}, OFFSETS)


@pytest.mark.parametrize("seed", range(8))
def test_the_tables_of_several_rows_packed_in_c_are_the_pythons_bytes(seed):
    """The compiled packer of several rows' tables (a batched decode step, a prefill chunk: pack_rows) gives
    the bytes, the leading count, the tile and the order of the Python definition, whatever experts lead."""
    if moe_tables.pack_rows is None:
        pytest.skip("fomoepy.runtime._moe_tables is not built (no C compiler at install)")
    rng = np.random.default_rng(100 + seed)
    E, k, T = [(8, 2, 3), (16, 4, 9), (64, 8, 8), (128, 8, 64), (512, 10, 8), (512, 22, 40), (4, 4, 20), (256, 1, 33)][seed]
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    weights = rng.random((T, k)).astype(np.float32)
    chosen = sorted(set(ids.reshape(-1).tolist()))
    slot = {e: int(rng.integers(1, 1 << 40)) << 8 for e in chosen}
    picked = rng.permutation(chosen).tolist()
    for first, then in [((), ()), (set(picked[: len(picked) // 2]), picked[len(picked) // 2 : -1]), ({picked[-1]}, ()), ((), picked[:3])]:
        compiled = build_tables(ids, weights, slot, OFFSETS, first, then)
        python = _rows_tables(ids, weights, slot, OFFSETS, first, then)
        assert compiled.host.tobytes() == python.host.tobytes()
        assert (compiled.n_first, compiled.n_work, compiled.tile, compiled.experts, compiled.work_offset) == (
            python.n_first, python.n_work, python.tile, python.experts, python.work_offset)  # fmt: skip
    with pytest.raises(KeyError):  # an expert with no slot: as the Python definition
        build_tables(ids, weights, {e: p for e, p in slot.items() if e != chosen[0]}, OFFSETS)
