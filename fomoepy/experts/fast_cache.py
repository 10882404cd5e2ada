"""The expert cache with its bookkeeping in C, where the policy allows: `make_cache` picks it.

`CoreCache` has ExpertCache's interface (plan / commit / mark_ready / release, admit_host, seed,
tick, the tiers' membership and the counters) over `fomoepy.experts._cache_core`, which holds both
tiers and runs the frequency family's policies (lfu-admit, lfu-demote, lfu-cooc) over arrays. Its
decisions are ExpertCache's, exactly: same plans, same counters (tests/test_cache_core.py replays
random streams through both). Why: the Python cache's dictionaries, heaps and co-use counts made
about 0.6 ms of host time per MoE layer step at Qwen3.5-397B's shape.

ExpertCache stays for every other case: the other policies, several devices, a policy that pins a
profile's seeds, and a machine where the extension was not built (pip builds it with the C compiler
that ggml's build needs too; without one, the install goes on without it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from fomoepy.experts.cache import (
    ExpertCache,
    Plan,
    PlanItem,
    Source,
    StalePlanError,
    expert_sizes,
    plan_of,
    users_of,
)
from fomoepy.experts.cache_stats import CacheStats, DiskCounters, TierCounters
from fomoepy.experts.co_use import CoUsePolicy
from fomoepy.experts.policy import (
    AdmittingFrequencyPolicy,
    DemotingFrequencyPolicy,
    EvictionPolicy,
    Key,
)
from fomoepy.experts.tiers import SlotState

try:
    from fomoepy.experts import _cache_core
except ImportError as e:  # built by pip at install; ExpertCache does the same in Python
    _cache_core = None
    IMPORT_ERROR: str | None = str(e)
else:
    IMPORT_ERROR = None

_STATES = (SlotState.EMPTY, SlotState.LOADING, SlotState.READY)  # the core's codes
_KIND = {AdmittingFrequencyPolicy: "POLICY_ADMIT", DemotingFrequencyPolicy: "POLICY_DEMOTE", CoUsePolicy: "POLICY_COOC"}
_TAKEN = object()  # CoreCache._plan_of's `out` for plan_soon's plan, taken from the core's thread when asked


def core_available() -> bool:
    return _cache_core is not None


class TierView:
    """What callers read of one tier: membership, capacity and use."""

    def __init__(self, cache: CoreCache, which: int, capacity: int):
        self._cache, self._which, self.capacity = cache, which, capacity
        self.name = ("device", "host")[which]

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def used(self) -> int:
        return self._cache._core.used[self._which]

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def __contains__(self, key: object) -> bool:
        layer, expert = key  # type: ignore[misc]
        return self._cache._core.state(self._which, layer * self._cache.n_expert + expert) != 0  # held: LOADING or READY

    def state(self, key: Key) -> SlotState:
        return _STATES[self._cache._core.state(self._which, key[0] * self._cache.n_expert + key[1])]

    def keys(self) -> list[Key]:
        return [(layer, int(e)) for layer in range(self._cache.n_layer) for e in np.flatnonzero(self._held(layer))]

    def __len__(self) -> int:
        return len(self.keys())

    def _held(self, layer: int) -> np.ndarray:
        return np.frombuffer(self._cache._core.held(self._which, layer), dtype=bool)


class CoreCache:
    """ExpertCache over the C core (one device; lfu-admit, lfu-demote or lfu-cooc in both tiers)."""

    def __init__(self, n_expert: int, expert_bytes: Sequence[int], device_bytes: int, host_bytes: int,
                 policy: EvictionPolicy, device_expert_bytes: Sequence[int] | None = None):  # fmt: skip
        if _cache_core is None:
            raise RuntimeError(f"the cache core is not built: {IMPORT_ERROR}")
        self.n_expert = n_expert
        self.expert_bytes, self.device_expert_bytes = expert_sizes(expert_bytes, device_expert_bytes)
        self.n_layer = len(self.expert_bytes)
        self.device_of_layer = (0,) * self.n_layer
        kind = getattr(_cache_core, _KIND[type(policy)])
        extra = ()
        if isinstance(policy, CoUsePolicy):
            c = policy.counts
            extra = (c.weight_next, c.weight_this, c.co_half_life, c.successors)
        self._core = _cache_core.Core(self.n_layer, n_expert, self.expert_bytes, self.device_expert_bytes,
                                      device_bytes, host_bytes, kind, policy.freq.half_life, *extra)  # fmt: skip
        self._core.set_types(PlanItem, (Source.DEVICE, Source.HOST, Source.DISK))
        self._core.demote = bool(getattr(policy, "demotes", False)) and host_bytes > 0
        self.device = TierView(self, 0, device_bytes)
        self.host = TierView(self, 1, host_bytes)
        self.devices = [self.device]
        self.policy_name = policy.name
        self._device_on, self._host_on = device_bytes > 0, host_bytes > 0
        self._carried: CacheStats | None = None
        self._seeded_generation = 0
        # ExpertCache.uncached(layer, experts), the core's own (no frame of ours: a step asks twice)
        self.uncached = self._core.uncached

    # -- state ---------------------------------------------------------------------------------------
    @property
    def now(self) -> int:
        return self._core.now

    @property
    def generation(self) -> int:
        return self._core.generation + self._seeded_generation

    @property
    def demote(self) -> bool:
        return self._core.demote

    @demote.setter
    def demote(self, value: bool) -> None:
        self._core.demote = value

    def tick(self, n_tokens: int = 1) -> None:
        self._core.tick(n_tokens)

    # -- queries -------------------------------------------------------------------------------------
    # plan and plan_soon, commit and commit_soon, each pair the same few lines, inline rather than a shared
    # helper's: a step makes one plan and one commit, and each frame of their wrappers costs a microsecond
    # or two in the cold caches a step's products leave (the cpu path's host time was counted in frames)
    def plan(self, layer: int, ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray | None = None) -> Plan:
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"expected a layer in [0, {self.n_layer}), got {layer}")
        raw = np.ascontiguousarray(ids, dtype=np.int64)  # (the core copies them out of its buffer)
        core = self._core
        return self._plan_of(core.plan(layer, raw), layer, raw, sequences, core.generation + self._seeded_generation)

    def plan_soon(self, layer: int, ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray | None = None
                  ) -> Callable[[], Plan]:  # fmt: skip
        """ExpertCache.plan_soon: made on the core's thread, without the GIL (a step's plan is ~20 µs of C at
        the 397B shape, made while the step's first launches go out in Python)."""
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"expected a layer in [0, {self.n_layer}), got {layer}")
        raw = np.ascontiguousarray(ids, dtype=np.int64)
        core = self._core
        generation = core.generation + self._seeded_generation  # (asked before the job: the core's getters wait for it)
        core.plan_soon(layer, raw)
        return functools.partial(self._plan_of, _TAKEN, layer, raw, sequences, generation)

    def _plan_of(self, out: tuple | None, layer: int, raw: np.ndarray, sequences: Sequence[int] | np.ndarray | None,
                 generation: int) -> Plan:  # fmt: skip
        """The Plan of the core's plan value `out` (None: an id out of range; _TAKEN: plan_soon's, taken now)."""
        if out is _TAKEN:
            out = self._core.take_plan()
        if out is None:
            experts = [int(e) for e in np.unique(raw)]
            raise ValueError(f"layer {layer}: expected expert ids in [0, {self.n_expert}), got {experts}")
        experts, sources, to_device, to_host, items, dev_victims, host_victims, demotions = out  # victims as (layer, expert)
        if sequences is None:
            users = ()
        elif len(sequences) == 1:  # one row (a decode step of one sequence): users_of's answer, without its frames
            users = ((int(sequences[0]),),) * len(items)
        else:
            users = users_of([item.expert for item in items], raw, sequences)
        return plan_of((layer, items, dev_victims, host_victims, generation, demotions, users, (experts, sources, to_device, to_host)))

    def on_device(self, key: Key) -> bool:
        return key in self.device

    def resident(self, layer: int, tier: str = "device") -> frozenset[int]:
        return frozenset(int(e) for e in np.flatnonzero(self.cached_mask(layer, tier)))

    def cached_mask(self, layer: int, tier: str = "device") -> np.ndarray:
        if tier not in ("device", "host"):
            raise ValueError(f"expected tier 'device' or 'host', got {tier!r}")
        return np.frombuffer(self._core.held(0 if tier == "device" else 1, layer), dtype=bool).copy()

    # -- commands ------------------------------------------------------------------------------------
    def commit(self, plan: Plan) -> None:
        core = self._core  # (a plan of the cache as it is now)
        if plan.generation != core.generation + self._seeded_generation:
            raise StalePlanError(f"plan made at generation {plan.generation}, expected {self.generation}")
        core.commit(plan.layer, *plan.arrays, plan.device_evictions, plan.host_evictions, plan.demotions, plan.users)

    def commit_soon(self, plan: Plan) -> None:
        """ExpertCache.commit_soon: applied on the core's thread, without the GIL (~13 µs of C a step at the
        397B shape, while the step's copies up and launches go out)."""
        core = self._core
        if plan.generation != core.generation + self._seeded_generation:
            raise StalePlanError(f"plan made at generation {plan.generation}, expected {self.generation}")
        core.commit_soon(plan.layer, *plan.arrays, plan.device_evictions, plan.host_evictions, plan.demotions, plan.users)

    def settle_soon(self, plan: Plan) -> None:
        """ExpertCache.settle_soon: on the core's thread (its parse of the plan's arrays stays here, ~1.5 µs; its
        bookkeeping goes on beside the next layer's routing)."""
        experts, sources, to_device, to_host = plan.arrays
        self._core.settle_soon(plan.layer, experts, sources, to_device, to_host, plan.demotions)

    def mark_ready(self, plan: Plan) -> None:
        experts, _, to_device, to_host = plan.arrays
        self._core.mark_ready(plan.layer, experts, to_device, to_host, plan.demotions)

    def release(self, plan: Plan) -> None:
        self._core.release(plan.layer, *plan.arrays)

    def count_resident_hits(self, layer: int, n: int) -> None:
        """ExpertCache.count_resident_hits."""
        self._core.count_hits(layer, n)

    def abort(self, plan: Plan) -> list[Key]:
        """ExpertCache.abort: a released plan's admissions still LOADING are dropped."""
        experts, _, to_device, to_host = plan.arrays
        return list(self._core.abort(plan.layer, experts, to_device, to_host, plan.demotions))

    access = ExpertCache.access  # plan + commit + mark_ready + release, through this class's methods

    def admit_host(self, keys: Sequence[Key]) -> tuple[list[Key], list[Key]]:
        admitted, victims = self._core.admit_host(list(keys))  # (the core takes and names keys as pairs)
        return list(admitted), list(victims)

    def admit_device(self, keys: Sequence[Key]) -> tuple[list[Key], list[Key]]:
        admitted, victims = self._core.admit_device(list(keys))
        return list(admitted), list(victims)

    def seed(self, keys: Iterable[Key], pin_fraction: float = 0.0) -> tuple[list[Key], list[Key]]:
        """ExpertCache.seed (these policies pin nothing, so pin_fraction only has to be valid)."""
        if not 0.0 <= pin_fraction <= 1.0:
            raise ValueError(f"pin fraction must be in [0, 1], got {pin_fraction}")
        placed: tuple[list[Key], list[Key]] = ([], [])
        for key in keys:
            layer, expert = key
            if not (0 <= layer < self.n_layer and 0 <= expert < self.n_expert):
                raise ValueError(f"seed key {key} outside {self.n_layer} layers x {self.n_expert} experts")
            where = self._core.seed_one(layer * self.n_expert + expert)
            if where >= 0:
                placed[where].append(key)
        self._seeded_generation += 1
        return placed

    # -- counters ------------------------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """The counters as ExpertCache keeps them (a snapshot), plus those carried over by a reset."""
        c = np.frombuffer(self._core.counters, dtype=np.int64).reshape(3, self.n_layer, 10)
        stats = CacheStats(self.n_layer, self._device_on, self._host_on)
        for layer in range(self.n_layer):
            stats.device[layer] = TierCounters(*(int(x) for x in c[0, layer]))
            stats.host[layer] = TierCounters(*(int(x) for x in c[1, layer]))
            stats.disk[layer] = DiskCounters(int(c[2, layer, 0]), int(c[2, layer, 1]))
            if self._carried is not None:
                stats.device[layer].add(self._carried.device[layer])
                stats.host[layer].add(self._carried.host[layer])
                stats.disk[layer].add(self._carried.disk[layer])
        return stats

    @stats.setter
    def stats(self, carried: CacheStats) -> None:
        """A reset's new cache continues the old one's counters (ExpertStreamer.carry_over_from)."""
        self._carried = carried


def core_policy(device_policy: EvictionPolicy | None, host_policy: EvictionPolicy | None) -> EvictionPolicy | None:
    """The policy the C core can run for these two tiers' policies, or None: the same fresh frequency-family
    policy, with the same settings, in both."""
    if device_policy is None or host_policy is None or type(device_policy) is not type(host_policy):
        return None
    if type(device_policy) not in _KIND or len(device_policy) or len(host_policy):
        return None
    a, b = device_policy, host_policy
    if a.freq.half_life != b.freq.half_life:  # type: ignore[attr-defined]
        return None
    if isinstance(a, CoUsePolicy) and (
        (a.counts.weight_next, a.counts.weight_this, a.counts.co_half_life, a.counts.successors)
        != (b.counts.weight_next, b.counts.weight_this, b.counts.co_half_life, b.counts.successors)  # type: ignore[attr-defined]
    ):
        return None
    return a


def make_cache(n_expert: int, expert_bytes: Sequence[int], device_bytes: int, host_bytes: int,
               device_policy: EvictionPolicy | None = None, host_policy: EvictionPolicy | None = None,
               device_expert_bytes: Sequence[int] | None = None, device_of_layer: Sequence[int] | None = None,
               ) -> ExpertCache | CoreCache:  # fmt: skip
    """The expert cache for these tiers: CoreCache where it applies, else ExpertCache (same decisions)."""
    policy = core_policy(device_policy, host_policy)
    one_device = device_of_layer is None or not any(device_of_layer)
    if policy is not None and one_device and _cache_core is not None:
        return CoreCache(n_expert, expert_bytes, device_bytes, host_bytes, policy, device_expert_bytes)
    return ExpertCache(n_expert, expert_bytes, device_bytes, host_bytes, device_policy, host_policy,
                       device_expert_bytes, device_of_layer)  # fmt: skip
