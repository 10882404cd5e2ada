"""The C cache core (fomoepy.experts.fast_cache.CoreCache) against ExpertCache, its reference.

Random streams of plans, commits, readiness, releases, host admissions, seeds and ticks go through
both; every plan, every counter and every tier's contents must be the same after every operation.
The policies run with small settings (short half-lives, 2-4 successors, co-use counts halved every
few tokens) so a stream of a few hundred steps crosses every branch: admission refusals, duplicates
first, co-use rows truncated and halved, announcements reordering victims, demotions.
"""

from __future__ import annotations

import gc
import os
import time

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


def replay(seed: int, kind: str, steps: int = 300, batched: bool = False, soon: bool = False) -> tuple[int, int]:
    """Returns the number of evictions seen (the stream must exercise them to prove anything) and the jobs the
    core ran on its own thread. soon: the core
    plans, commits and settles on its own thread (plan_soon, commit_soon, settle_soon), asked between a plan's
    start and its taking as a step asks it (uncached)."""
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
            if rng.random() < 0.5:
                assert ref.admit_host(keys) == core.admit_host(keys), f"step {step}: admit_host"
            else:  # backfill where there is no host tier (the cpu backend's), or beside one
                assert ref.admit_device(keys) == core.admit_device(keys), f"step {step}: admit_device"
        elif op < 0.25 and in_flight:  # land and release the oldest plan in flight
            a, b = in_flight.pop(0)
            ref.mark_ready(a), ref.release(a)
            core.settle_soon(b) if soon else (core.mark_ready(b), core.release(b))
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
            if soon:
                planned = core.plan_soon(layer, ids, seqs)
                if rng.random() < 0.5:  # a query while the plan is made waits for it
                    asked = list(range(n_expert))
                    assert core.uncached(layer, asked) == ref.uncached(layer, asked)
                a, b = ref.plan(layer, ids, seqs), planned()
            else:
                a, b = ref.plan(layer, ids, seqs), core.plan(layer, ids, seqs)
            assert plan_of(a) == plan_of(b), f"step {step}: plan"
            ref.commit(a), core.commit_soon(b) if soon else core.commit(b)
            in_flight.append((a, b))
            if len(in_flight) > int(rng.integers(0, 3)):
                a, b = in_flight.pop(0)
                ref.mark_ready(a), ref.release(a)
                core.settle_soon(b) if soon else (core.mark_ready(b), core.release(b))
            if rng.random() < 0.7:
                ref.tick(1), core.tick(1)
        assert state_of(ref) == state_of(core), f"step {step}"
    summary = ref.stats.summary()
    return summary["device"]["evicted"] + summary["host"]["evicted"], core._core.thread_jobs


@pytest.mark.parametrize("kind", ["admit", "demote", "cooc"])
def test_the_core_decides_as_the_python_cache_does(kind):
    evictions = sum(replay(seed, kind)[0] for seed in range(24))
    assert evictions > 600  # the streams did make the policies choose


def test_the_core_learns_co_use_per_sequence_as_the_python_cache_does():
    evictions = sum(replay(seed, "cooc", batched=True)[0] for seed in range(40, 64))
    assert evictions > 600


@pytest.mark.parametrize("kind", ["demote", "cooc"])
def test_the_core_decides_on_its_own_thread_as_the_python_cache_does(kind):
    evictions, jobs = np.sum([replay(seed, kind, soon=True, batched=kind == "cooc") for seed in range(100, 116)], axis=0)
    assert evictions > 400
    if len(os.sched_getaffinity(0)) > 1:  # (one CPU: the jobs run inline, on the caller's thread)
        assert jobs > 1000


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


def _planned_and_committed(cache, layer: int, ids: list[int]):
    plan = cache.plan_soon(layer, ids)()
    cache.commit_soon(plan)
    cache.mark_ready(plan)
    cache.release(plan)
    return plan


def test_a_commit_that_fails_on_the_cores_thread_is_raised_by_the_next_call():
    cache = make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc"))
    plan = _planned_and_committed(cache, 0, [1, 2])
    assert plan.items[0].to_device
    # the same plan applied again (the Python check of its generation passed by): the admission is refused
    # on the core's thread, where no Python error can be raised; the next call into the cache raises it
    cache._core.commit_soon(plan.layer, *plan.arrays, plan.device_evictions, plan.host_evictions, plan.demotions, plan.users)
    with pytest.raises(RuntimeError, match=r"the cache's commit of layer 0 failed: tier device: \(0, 1\) admitted twice"):
        cache.uncached(0, [1])
    assert cache.uncached(0, [1, 5]) == [5]  # raised once: the cache answers again


def _threads() -> int:
    """The cache cores' threads in this process (named so: another test's threads may come and go meanwhile)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # (a thread that ended as we listed)
            pass
    return names.count("fomoe-cache")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux's /proc and 2 CPUs")
def test_the_cores_thread_ends_with_its_cache():
    gc.collect()  # (the caches of the tests before, and their threads, gone first)
    before = _threads()
    caches = [make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc")) for _ in range(3)]
    for cache in caches:
        _planned_and_committed(cache, 1, [3])
    assert _threads() == before + 3 and all(cache._core.thread_jobs == 2 for cache in caches)
    del cache, caches
    gc.collect()  # (a cache and its tiers' views hold each other)
    assert _threads() == before


@pytest.mark.skipif(not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2, reason="needs fork and 2 CPUs")
def test_a_forked_child_plans_on_a_thread_of_its_own():
    cache = make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc"))
    _planned_and_committed(cache, 0, [1])
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; its first job starts one
        try:
            plan = _planned_and_committed(cache, 0, [2, 6])
            os._exit(0 if cache._core.thread_jobs == 4 and [i.expert for i in plan.items] == [2, 6] else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's plan never came: it waited for the parent's thread")
    assert cache._core.thread_jobs == 2  # (the parent's own, untouched)


def test_lfu_cooc_reads_an_announced_resident_once_a_token_not_once_a_walk():
    """An announcement lifts most low-count residents above their frequency, and the eviction walk must
    pass them in the frequency order before it may yield: walk after walk of a token read them all again
    (~130 entries a walk here, ~200 at the 397B shape). The core now moves each into its tier's announced
    order as a walk meets it, for the rest of the token (the same order: the replays above)."""
    rng = np.random.default_rng(0)
    n_layer, n_expert, k = 24, 64, 8
    unit = [1000] * n_layer
    total = sum(unit) * n_expert
    cache = make_cache(n_expert, unit, int(0.2 * total), int(0.25 * total), make_policy("lfu-cooc"), make_policy("lfu-cooc"))
    assert isinstance(cache, CoreCache)
    preference = rng.random((n_layer, n_expert)) ** 3
    last = [rng.choice(n_expert, k, replace=False) for _ in range(n_layer)]
    for _ in range(48):
        for layer in range(n_layer):  # half of a token's experts the last token's (co-use), half by preference
            kept = last[layer][: k // 2]
            p = preference[layer].copy()
            p[kept] = 0
            ids = np.concatenate([kept, rng.choice(n_expert, k - len(kept), replace=False, p=p / p.sum())])
            last[layer] = ids
            plan = cache.plan(layer, ids[None, :])
            cache.commit(plan), cache.mark_ready(plan), cache.release(plan)
        cache.tick(1)
    walks, read = cache._core.walk_counts
    summary = cache.stats.summary()
    assert walks > 1000 and summary["device"]["evicted"] + summary["host"]["evicted"] > 1000
    assert read / walks < 50  # (each walk read ~134 before; ~25 now, most of them a token's first walk's)


def test_plan_soon_asks_the_core_nothing_once_its_job_is_started():
    # every entry point of the core, its getters too, waits for a job on its thread: a wrapper that asked
    # one after starting the plan (its generation, say) would make the plan in series with the step
    cache = make_cache(8, [100] * 2, 300, 500, make_policy("lfu-cooc"), make_policy("lfu-cooc"))

    class Watched:
        def __init__(self, core):
            self.core, self.asked = core, []

        def __getattr__(self, name):
            self.asked.append(name)
            return getattr(self.core, name)

    watched = cache._core = Watched(cache._core)
    planned = cache.plan_soon(1, [2, 5])
    assert watched.asked[-1] == "plan_soon"
    plan = planned()
    assert watched.asked[-1] == "take_plan" and [item.expert for item in plan.items] == [2, 5]
    cache.commit_soon(plan)
    assert watched.asked[-1] == "commit_soon"
