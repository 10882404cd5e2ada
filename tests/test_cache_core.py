"""The C cache core (fomoepy.experts.fast_cache.CoreCache) against ExpertCache, its reference.

Random streams of plans, commits, readiness, releases, host admissions, seeds and ticks go through
both; every plan, every counter and every tier's contents must be the same after every operation.
The policies run with small settings (short half-lives, 2-4 successors, co-use counts halved every
few tokens) so a stream of a few hundred steps crosses every branch: admission refusals, duplicates
first, co-use rows truncated and halved, announcements reordering victims, demotions.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from fomoepy.experts.cache import ExpertCache, StalePlanError
from fomoepy.experts.co_use import CoUsePolicy
from fomoepy.experts.fast_cache import CoreCache, core_available, make_cache
from fomoepy.experts.policy import (
    AdmittingFrequencyPolicy,
    DemotingFrequencyPolicy,
    make_policy,
)

if not core_available():
    if os.environ.get("CI") == "true":  # CI builds the extension: its absence there is a failure, not a skip
        raise RuntimeError("fomoepy.experts._cache_core is not built")
    pytest.skip("the C cache core is not built (pip install -e . builds it with the C compiler)", allow_module_level=True)


def policies(kind: str, rng: np.random.Generator):
    half_life = float(rng.choice([2.0, 8.0, 64.0, np.inf]))
    if kind == "admit":
        return AdmittingFrequencyPolicy(half_life), AdmittingFrequencyPolicy(half_life)
    if kind == "demote":
        return DemotingFrequencyPolicy(half_life), DemotingFrequencyPolicy(half_life)
    params = dict(half_life_tokens=half_life, weight_next=float(rng.choice([1.0, 4.0])), weight_this=float(rng.choice([0.5, 2.0])),
                  co_half_life_tokens=int(rng.choice([3, 16, 1024])), successors=int(rng.choice([1, 2, 4])))  # fmt: skip
    return CoUsePolicy(**params), CoUsePolicy(**params)


def state_of(cache) -> tuple:
    tiers = []
    for tier in ("device", "host"):
        tiers.append(tuple(tuple(np.flatnonzero(cache.cached_mask(layer, tier))) for layer in range(cache.n_layer)))
    for layer in range(cache.n_layer):  # what a prefetch asks: the experts held by neither tier, in its order
        asked = list(range(cache.n_expert))[::-1]
        held = cache.cached_mask(layer, "device") | cache.cached_mask(layer, "host")
        assert cache.uncached(layer, asked) == [e for e in asked if not held[e]]
    return cache.stats.summary(), tuple(tiers), cache.device.used, cache.host.used, cache.generation, cache.now


def plan_of(plan) -> tuple:
    return (plan.layer, tuple(plan.items), plan.device_evictions, plan.host_evictions, plan.generation, plan.demotions)


def replay(seed: int, kind: str, steps: int = 300, batched: bool = False) -> int:
    """Returns the number of evictions seen (the stream must exercise them to prove anything)."""
    rng = np.random.default_rng(seed)
    n_layer, n_expert = int(rng.integers(1, 5)), int(rng.integers(4, 24))
    k = int(rng.integers(1, min(6, n_expert) + 1))
    unit = [int(rng.integers(1, 5)) * 100 for _ in range(n_layer)]
    device_unit = [u * int(rng.choice([1, 2])) for u in unit]
    total = sum(unit) * n_expert
    device_bytes = int(rng.choice([0, 0.1, 0.3]) * total)
    host_bytes = int(rng.choice([0, 0.15, 0.4]) * total)
    dp, hp = policies(kind, np.random.default_rng(seed + 1000))
    ref = ExpertCache(n_expert, unit, device_bytes, host_bytes, dp, hp, device_expert_bytes=device_unit)
    core = CoreCache(n_expert, unit, device_bytes, host_bytes, policies(kind, np.random.default_rng(seed + 1000))[0], device_unit)
    # the stream's experts: skewed, with a per-layer preference that drifts (frequency and co-use matter)
    weights = rng.random((n_layer, n_expert)) ** 3
    demote = bool(rng.integers(0, 2))  # a device that cannot download turns demotion off (ExpertStreamer)
    ref.demote = ref.demote and demote
    core.demote = core.demote and demote
    seeds = [(int(rng.integers(0, n_layer)), int(rng.integers(0, n_expert))) for _ in range(int(rng.integers(0, 8)))]
    assert ref.seed(seeds) == core.seed(seeds)
    in_flight: list[tuple] = []
    for step in range(steps):
        op = rng.random()
        if op < 0.08:
            n = int(rng.integers(0, 3))
            ref.tick(n), core.tick(n)
        elif op < 0.18:
            keys = [(int(rng.integers(0, n_layer)), int(rng.integers(0, n_expert))) for _ in range(int(rng.integers(1, 6)))]
            assert ref.admit_host(keys) == core.admit_host(keys), f"step {step}: admit_host"
        elif op < 0.25 and in_flight:  # land and release the oldest plan in flight
            a, b = in_flight.pop(0)
            ref.mark_ready(a), core.mark_ready(b)
            ref.release(a), core.release(b)
        elif op < 0.20:  # hits counted by a step that made no plan (a tier holding every expert)
            layer, n = int(rng.integers(0, n_layer)), int(rng.integers(1, k + 1))
            ref.count_resident_hits(layer, n), core.count_resident_hits(layer, n)
        elif op < 0.28 and in_flight:  # the oldest plan's reads failed: released, its loading slots dropped
            a, b = in_flight.pop(0)
            ref.release(a), core.release(b)
            assert ref.abort(a) == core.abort(b), f"step {step}: abort"
        else:
            layer = int(rng.integers(0, n_layer))
            if rng.random() < 0.02:
                weights[layer] = rng.random(n_expert) ** 3
            p = weights[layer] / weights[layer].sum()
            rows = int(rng.choice([1, 1, 1, 3]))
            ids = np.stack([rng.choice(n_expert, k, replace=False, p=p) for _ in range(rows)])
            # a step of several sequences (a batched decode: co-use per sequence), or of one (None)
            seqs = rng.choice([0, 5, 7, 1 << 40], rows) if batched and rng.random() < 0.6 else None
            a, b = ref.plan(layer, ids, seqs), core.plan(layer, ids, seqs)
            assert plan_of(a) == plan_of(b), f"step {step}: plan"
            ref.commit(a), core.commit(b)
            in_flight.append((a, b))
            if len(in_flight) > int(rng.integers(0, 3)):
                a, b = in_flight.pop(0)
                ref.mark_ready(a), core.mark_ready(b)
                ref.release(a), core.release(b)
            if rng.random() < 0.7:
                ref.tick(1), core.tick(1)
        assert state_of(ref) == state_of(core), f"step {step}"
    summary = ref.stats.summary()
    return summary["device"]["evicted"] + summary["host"]["evicted"]


@pytest.mark.parametrize("kind", ["admit", "demote", "cooc"])
def test_the_core_decides_as_the_python_cache_does(kind):
    evictions = sum(replay(seed, kind) for seed in range(24))
    assert evictions > 600  # the streams did make the policies choose


def test_the_core_learns_co_use_per_sequence_as_the_python_cache_does():
    evictions = sum(replay(seed, "cooc", batched=True) for seed in range(40, 64))
    assert evictions > 600


def test_the_engine_policies_run_on_the_core():
    for name in ("lfu-cooc", "lfu-demote", "lfu-admit"):
        cache = make_cache(8, [100] * 2, 300, 500, make_policy(name), make_policy(name))
        assert isinstance(cache, CoreCache) and cache.policy_name == name
    for name in ("lru", "layer-lru", "lfu-decay", "lru-pinned"):
        assert isinstance(make_cache(8, [100] * 2, 300, 500, make_policy(name), make_policy(name)), ExpertCache)
    two_devices = make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc"), device_of_layer=(0, 1))
    assert isinstance(two_devices, ExpertCache)


def test_a_stale_plan_and_bad_ids_are_refused_as_the_python_cache_refuses_them():
    cache = make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc"))
    with pytest.raises(ValueError, match=r"layer 1: expected expert ids in \[0, 8\), got \[3, 9\]"):
        cache.plan(1, [3, 9])
    with pytest.raises(ValueError, match=r"expected a layer in \[0, 2\), got 2"):
        cache.plan(2, [1])
    first = cache.plan(0, [1, 2])
    cache.commit(cache.plan(0, [3]))
    with pytest.raises(StalePlanError):
        cache.commit(first)
    with pytest.raises(RuntimeError, match="unpinning"):  # released twice
        plan = cache.plan(1, [4])
        cache.commit(plan)
        cache.mark_ready(plan)
        cache.release(plan)
        cache.release(plan)
