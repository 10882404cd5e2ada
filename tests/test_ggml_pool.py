"""The cpu backend's expert tier (fomoepy.runtime.ggml_pool, ggml_experts): slot placement, the engine's
sizing of it from --ram-cache, and what a tier holding the whole model skips."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from gguf import GGMLQuantizationType as QT

from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.experts.device import Phase
from fomoepy.experts.resident_step import ResidentStep
from fomoepy.runtime.ggml_pool import SlotPool

K, F = 256, 256
LAYOUT = ((int(QT.Q8_0), (F, K)), (int(QT.Q8_0), (F, K)), (int(QT.Q8_0), (K, F)))
MODEL = ORACLE / "qwen3moe_q4_k_m.gguf"


def expert(pool: SlotPool, value: int) -> list[np.ndarray]:
    """Store bytes whose every byte is `value` (a slot's content is then easy to tell apart)."""
    return [np.full(m.slot_nbytes, value, np.uint8) for m in pool.layer.mats]


def test_installs_take_the_lowest_free_slot_and_the_lookup_follows():
    pool = SlotPool(LAYOUT, n_tier=3, n_staging=1, n_expert=8)
    assert [pool.install((0, e), expert(pool, e)) for e in (5, 2, 7)] == [0, 1, 2]
    assert pool.slots_of(0).tolist() == [-1, -1, 1, -1, -1, 0, -1, 2]
    pool.evict((0, 5))
    assert pool.slots_of(0)[5] == -1 and (0, 5) not in pool
    assert pool.install((1, 4), expert(pool, 9)) == 0  # the freed slot, for another layer
    assert pool.slots_of(1)[4] == 0 and pool.slots_of(0)[4] == -1
    assert pool.stage(0, expert(pool, 1)) == 3  # staging slots follow the tier's
    pool.close()


def test_a_full_pool_a_double_install_and_a_stranger_are_one_clear_error():
    pool = SlotPool(LAYOUT, n_tier=1, n_staging=1, n_expert=4)
    pool.install((0, 1), expert(pool, 1))
    with pytest.raises(FomoeError, match="installed twice"):
        pool.install((0, 1), expert(pool, 1))
    with pytest.raises(FomoeError, match="expected a free slot"):
        pool.install((0, 2), expert(pool, 2))
    with pytest.raises(FomoeError, match="expected it in a slot"):
        pool.evict((0, 3))
    with pytest.raises(FomoeError, match="staging slot 1 outside"):
        pool.stage(1, expert(pool, 1))
    with pytest.raises(FomoeError, match="bytes for a slot"):  # a failed set leaves the slot free
        pool.evict((0, 1))
        pool.install((0, 2), [b[:-1] for b in expert(pool, 2)])
    assert pool.install((0, 2), expert(pool, 2)) == 0
    pool.close()


def test_the_engine_sizes_the_tier_from_ram_cache_and_fills_a_whole_one_at_load():
    probe = Engine(MODEL, EngineOptions(backend="cpu", threads=1, ram_cache=0))
    layers, n_expert = probe.source.layers, probe.spec.moe.n_expert
    unit = layers[0].expert_nbytes
    probe.close()
    whole = n_expert * len(layers)
    for n_slots in (0, 5, whole - 1, whole):
        engine = Engine(MODEL, EngineOptions(backend="cpu", threads=1, ram_cache=n_slots * unit))
        (pool,) = engine.experts.device.pools.values()  # every layer of this model has one layout
        cache = engine.experts.streamer.cache
        assert pool.n_tier == n_slots and cache.device.capacity == n_slots * unit and not cache.host.enabled
        filled = n_slots == whole  # only a tier that holds the whole model is filled at load
        assert len(pool) == (whole if filled else 0) and len(cache.device) == len(pool)
        # ... and there a step skips the cache's plans; no step predicts (the GGUF file reads nothing ahead)
        assert isinstance(engine.experts, ResidentStep) == filled and not engine.experts.predicts
        engine.close()


def test_a_whole_tiers_steps_count_what_plans_count_and_compute_the_same():
    # the resident step skips the cache's plans: its device hits are the accesses a planned step counts
    # (hits and misses of a tier one expert short of whole), its logits those of the planned steps
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    probe = Engine(MODEL, EngineOptions(backend="cpu", threads=1, ram_cache=0))
    whole = sum(layer.expert_nbytes for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    runs = []
    for ram_cache in (whole, whole - 1):
        engine = Engine(MODEL, EngineOptions(backend="cpu", threads=1, ram_cache=ram_cache))
        engine.experts.records = []
        state = engine.new_state()
        logits = [engine.eval(state, tokens[:5])[-1]] + [engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in tokens[5:9]]
        counters = engine.experts.streamer.cache.stats.device
        runs.append((logits, [(c.hits + c.misses, c.hit_bytes + c.miss_bytes, c.misses) for c in counters], len(engine.experts.records)))
        engine.close()
    (l0, c0, r0), (l1, c1, r1) = runs
    assert all(np.array_equal(a, b) for a, b in zip(l0, l1))
    assert all(m == 0 for *_, m in c0) and [c[:2] for c in c0] == [c[:2] for c in c1] and c0[0][0] > 0
    assert r0 == r1 == 5 * len(c0)  # a timing record per layer step
