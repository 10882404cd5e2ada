"""The expert cache: where each routed expert of a layer comes from, and what the tiers keep.

Two tiers over the NVMe store, each under one byte budget for all layers:

    device  VRAM (on the CPU backend: the compute-ready tier); admits every expert that is used
    host    DRAM; admits what was read from NVMe (the disk holds everything)

With a demoting policy (lfu-demote, lfu-cooc: `demotes = True`) the tiers are exclusive: what the
device tier evicts moves down into the host tier (`Plan.demotions`; the runtime copies its bytes
down instead of reading them), and a disk read that gets a device slot takes no host slot. The two
tiers then hold mostly different experts, so device + host capacity serves as one cache.

A query/command pair drives it, so the decision is testable without any device:

    plan = cache.plan(layer, ids)   # query: sources, admissions and evictions; changes nothing
    cache.commit(plan)              # command: apply them, pin the plan's experts, count stats
    ... runtime copies bytes ...;   cache.mark_ready(plan)   # admitted slots LOADING → READY
    ... experts computed ...;       cache.release(plan)      # unpin: they may be evicted again

A plan is valid only until the next commit (commit refuses a stale one). The experts of a
committed plan stay pinned until released, so planning the next layer while this one computes
never evicts what it reads. `access(layer, ids)` does all four at once (synchronous paths, the
simulator). A device-resident expert still LOADING counts as a DEVICE hit: the runtime waits for it.
Logical time, used by the policies, is the engine's token count: call `tick(n)` after each step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import NamedTuple

import numpy as np

from fomoepy.experts.cache_stats import CacheStats
from fomoepy.experts.policy import EvictionPolicy, Key, LRUPolicy
from fomoepy.experts.tiers import SlotState, TierDirectory

# with a *-pinned policy, the share of each tier a frequency profile's seeds hold for good
PIN_FRACTION = 0.5


class Source(Enum):
    DEVICE = "device"  # hit: already in a device slot
    HOST = "host"  # in a DRAM slot: copy up
    DISK = "disk"  # read from the NVMe store


class PlanItem(NamedTuple):  # a NamedTuple: plans are built per layer per token, so construction cost counts
    expert: int
    source: Source
    nbytes: int
    to_device: bool  # gets a device slot (the copy or read lands there); False: streamed via scratch
    to_host: bool  # a disk read that gets a host slot


class Plan(NamedTuple):
    """What one MoE layer step needs: each distinct expert once, ascending id. (A named tuple, as PlanItem:
    a step makes one, and a frozen dataclass's __init__ sets each field through object.__setattr__, 0.97 µs
    a plan where this takes 0.25, timeit on this project's 2-core machine.)"""

    layer: int
    items: tuple[PlanItem, ...]
    device_evictions: tuple[Key, ...]
    host_evictions: tuple[Key, ...]
    generation: int
    demotions: tuple[Key, ...] = ()  # device evictees the host tier takes (their bytes come down, not off disk)
    users: tuple[tuple[int, ...], ...] = ()  # per item, the sequences whose rows chose it; () = one sequence, 0
    # the compiled cache's arrays of the plan, read back at commit, mark_ready and release (fast_cache:
    # experts int64 bytes, sources, to_device, to_host); the Python cache keeps none
    arrays: tuple = ()

    @property
    def experts(self) -> tuple[int, ...]:
        return tuple(item.expert for item in self.items)


# plan_of((layer, items, device_evictions, host_evictions, generation, demotions, users, arrays)): a Plan made by
# tuple.__new__ itself, every field given (the compiled cache's, one a step: the named tuple's __new__ is a frame)
plan_of = functools.partial(tuple.__new__, Plan)


class StalePlanError(RuntimeError):
    """A plan committed after another commit changed the cache it was made against."""


class ExpertCache:
    """Device and host tiers of routed experts; `expert_bytes[layer]` is one expert's size in that layer."""

    def __init__(
        self,
        n_expert: int,
        expert_bytes: Sequence[int],
        device_bytes: int,
        host_bytes: int,
        device_policy: EvictionPolicy | None = None,
        host_policy: EvictionPolicy | None = None,
        device_expert_bytes: Sequence[int] | None = None,
        device_of_layer: Sequence[int] | None = None,
    ):
        """`device_expert_bytes`: one expert's size in the device tier's form when it differs from the
        store's (the CPU backend's device tier holds dequantised float32); default: `expert_bytes`.

        `device_of_layer`: with several devices (the scheduler's placement), each device has its own
        device tier of `device_bytes` holding only its layers' experts; the host tier stays one.
        """
        self.n_expert = n_expert
        self.expert_bytes, self.device_expert_bytes = expert_sizes(expert_bytes, device_expert_bytes)
        self.n_layer = len(self.expert_bytes)
        # `is None`, not `or`: a policy with nothing tracked has len 0 and is falsy
        self.device_of_layer = tuple(device_of_layer) if device_of_layer is not None else (0,) * self.n_layer
        if len(self.device_of_layer) != self.n_layer:
            raise ValueError(f"expected a device for each of {self.n_layer} layers, got {len(self.device_of_layer)}")
        n_devices = max(self.device_of_layer) + 1
        self.devices = [
            TierDirectory(
                "device" if n_devices == 1 else f"device{d}",
                device_bytes,
                (LRUPolicy() if device_policy is None else device_policy) if d == 0 else _same_kind(device_policy),
            )
            for d in range(n_devices)
        ]
        self.device = self.devices[0]  # the device tier when there is one device
        self.host = TierDirectory("host", host_bytes, LRUPolicy() if host_policy is None else host_policy)
        self.stats = CacheStats(self.n_layer, device_bytes > 0, self.host.enabled)
        # Exclusive tiers when the host policy asks for them: a device evictee moves down into the host
        # tier instead of being dropped, and a disk read that gets a device slot takes no host slot, so
        # the two tiers hold mostly different experts. The runtime must copy a demoted expert's bytes
        # down (the streamer turns this off when no backend can).
        self.demote = bool(getattr(self.host.policy, "demotes", False)) and self.host.enabled
        # Both tiers see every use (commit: the device tier's policy first): where their policies learn
        # the same things from it, they learn them once (lfu-cooc's co-use counts took half its cost)
        dev_policy, host_policy = self.device.policy, self.host.policy
        if n_devices == 1 and self.device.enabled and self.host.enabled and type(dev_policy) is type(host_policy) \
                and hasattr(dev_policy, "learn_with"):  # fmt: skip
            dev_policy.learn_with(host_policy)
        self.now = 0
        self.generation = 0

    def tick(self, n_tokens: int = 1) -> None:
        """Advance logical time by the tokens just processed (frequency decay counts tokens)."""
        self.now += n_tokens

    # -- queries -----------------------------------------------------------------------------------

    def plan(self, layer: int, ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray | None = None) -> Plan:
        """Sources and tier changes for the union of `ids` (any shape, e.g. [T, k] for T tokens).

        `sequences`: each row's sequence ([T]) when a step decodes several; the policies then learn each
        expert's co-use from its own sequence's previous token (lfu-cooc). None: one sequence."""
        experts = [int(e) for e in np.unique(np.asarray(ids, dtype=np.int64))]
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"expected a layer in [0, {self.n_layer}), got {layer}")
        if experts and not (0 <= experts[0] and experts[-1] < self.n_expert):
            raise ValueError(f"layer {layer}: expected expert ids in [0, {self.n_expert}), got {experts}")
        size = self.expert_bytes[layer]
        keys = [(layer, e) for e in experts]
        protected = set(keys)
        sources = [self._source(key) for key in keys]
        to_device, device_victims = self._dev(layer).plan_admissions(
            [(key, self.device_expert_bytes[layer]) for key, src in zip(keys, sources) if src is not Source.DEVICE],
            protected,
            self.now,
        )
        device_set = set(to_device)
        host_wanted = [(key, size) for key, src in zip(keys, sources) if src is Source.DISK]
        demoted: list[Key] = []
        if self.demote:
            demoted = [v for v in device_victims if v not in self.host]
            # (demotions first or reads first, and letting reads into both tiers: within 0.1 point)
            host_wanted = [(v, self.expert_bytes[v[0]]) for v in demoted] + [
                (key, size) for key, size in host_wanted if key not in device_set
            ]
        to_host, host_victims = self.host.plan_admissions(host_wanted, protected, self.now)
        host_set = set(to_host)
        items = tuple(
            PlanItem(key[1], src, size, key in device_set, key in host_set) for key, src in zip(keys, sources)
        )
        demotions = tuple(v for v in demoted if v in host_set)
        users = users_of(experts, ids, sequences) if sequences is not None else ()
        return Plan(layer, items, tuple(device_victims), tuple(host_victims), self.generation, demotions, users)

    def _dev(self, layer: int) -> TierDirectory:
        return self.devices[self.device_of_layer[layer]]

    def on_device(self, key: Key) -> bool:
        return key in self._dev(key[0])

    def uncached(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The experts of `layer` that neither tier holds (LOADING or READY), in their order: what a read
        ahead fetches."""
        device = self._dev(layer)
        return [e for e in experts if (layer, e) not in device and (layer, e) not in self.host]

    def _source(self, key: Key) -> Source:
        if key in self._dev(key[0]):
            return Source.DEVICE
        if key in self.host:
            return Source.HOST
        return Source.DISK

    def resident(self, layer: int, tier: str = "device") -> frozenset[int]:
        """Experts of `layer` held (LOADING or READY) in `tier` ("device" or "host")."""
        return frozenset(self._tier(tier, layer).experts_in(layer))

    def cached_mask(self, layer: int, tier: str = "device") -> np.ndarray:
        """bool [n_expert]: experts of `layer` held in `tier`, the form cache-aware routing takes."""
        mask = np.zeros(self.n_expert, dtype=bool)
        held = self._tier(tier, layer).experts_in(layer)
        if held:
            mask[list(held)] = True
        return mask

    def _tier(self, name: str, layer: int) -> TierDirectory:
        if name not in ("device", "host"):
            raise ValueError(f"expected tier 'device' or 'host', got {name!r}")
        return self._dev(layer) if name == "device" else self.host

    def plan_soon(self, layer: int, ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray | None = None
                  ) -> Callable[[], Plan]:  # fmt: skip
        """plan(), begun now and taken by calling what this returns: the compiled cache makes it on a thread of
        its own while the caller goes on (fast_cache.CoreCache); this one makes it when it is taken. Between
        the two the caller may ask the cache (it then waits for the plan), not change it."""
        return functools.partial(self.plan, layer, ids, sequences)

    # -- commands ----------------------------------------------------------------------------------

    def commit_soon(self, plan: Plan) -> None:
        """commit(), which the compiled cache applies on its own thread while the caller goes on (whatever asks
        or changes the cache next waits for it, and raises its failure); this one applies it at once."""
        self.commit(plan)

    def settle_soon(self, plan: Plan) -> None:
        """mark_ready and release of a step whose reads landed, which the compiled cache applies on its own
        thread (as commit_soon); this one applies them at once."""
        self.mark_ready(plan)
        self.release(plan)

    def commit(self, plan: Plan) -> None:
        """Apply plan's evictions and admissions (admitted slots LOADING), pin its experts, count it."""
        if plan.generation != self.generation:
            raise StalePlanError(f"plan made at generation {plan.generation}, expected {self.generation}")
        self.generation += 1
        layer, now = plan.layer, self.now
        for tier, victims, counters in (
            (self._dev(layer), plan.device_evictions, self.stats.device),
            (self.host, plan.host_evictions, self.stats.host),
        ):
            for key in victims:
                self._count_eviction(counters, key, tier.evict(key))
                if tier is not self.host:
                    self.host.policy.covered(key, False)
        device, host = self._dev(layer), self.host
        for key in plan.demotions:  # LOADING until the runtime has copied its bytes down
            host.admit(key, self.expert_bytes[key[0]], now)
            self.stats.host[key[0]].demoted += 1
            self.stats.host[key[0]].demoted_bytes += self.expert_bytes[key[0]]
        for i, item in enumerate(plan.items):
            key = (layer, item.expert)
            users = plan.users[i] if plan.users else ONE_SEQUENCE
            # a tier of size 0 never asks its policy: learning for it would only cost (lfu-cooc's
            # co-use counts took 15 % of the cpu backend's decode with both tiers off)
            if device.enabled:
                device.policy.observe(key, now, users)
            if host.enabled:
                host.policy.observe(key, now, users)
            # pin every slot of this expert the step reads or writes, so no later plan evicts it
            if item.to_host:
                host.admit(key, item.nbytes, now)
                host.pin(key)
            elif item.source is Source.HOST:
                host.touch(key, now)
                host.pin(key)
            if item.to_device:
                device.admit(key, self.device_expert_bytes[layer], now)
                device.pin(key)
                host.policy.covered(key, True)
            elif item.source is Source.DEVICE:
                device.touch(key, now)
                device.pin(key)
            self._count(layer, item)

    def _count(self, layer: int, item: PlanItem) -> None:
        dev, host, disk, n = self.stats.device[layer], self.stats.host[layer], self.stats.disk[layer], item.nbytes
        if item.source is Source.DEVICE:
            dev.hits += 1
            dev.hit_bytes += n
            return
        if self._dev(layer).enabled:
            dev.misses += 1
            dev.miss_bytes += n
        if item.to_device:
            dev.admitted += 1
            dev.admitted_bytes += n
        if item.source is Source.HOST:
            host.hits += 1
            host.hit_bytes += n
            return
        if self.host.enabled:
            host.misses += 1
            host.miss_bytes += n
        if item.to_host:
            host.admitted += 1
            host.admitted_bytes += n
        disk.reads += 1
        disk.read_bytes += n

    def mark_ready(self, plan: Plan) -> None:
        """The bytes of every slot the plan admitted (demotions included) have arrived."""
        for key in plan.demotions:
            self.host.mark_ready(key)
        for item in plan.items:
            key = (plan.layer, item.expert)
            if item.to_device:
                self._dev(plan.layer).mark_ready(key)
            if item.to_host:
                self.host.mark_ready(key)

    def release(self, plan: Plan) -> None:
        """The step that used plan's experts is done: unpin them."""
        for item in plan.items:
            key = (plan.layer, item.expert)
            if item.to_host or item.source is Source.HOST:
                self.host.unpin(key)
            if item.to_device or item.source is Source.DEVICE:
                self._dev(plan.layer).unpin(key)

    def count_resident_hits(self, layer: int, n: int) -> None:
        """n device hits in layer, counted as plans would count them, by a step that made no plan (every
        expert held for good: fomoepy.experts.resident_step)."""
        counters = self.stats.device[layer]
        counters.hits += n
        counters.hit_bytes += n * self.expert_bytes[layer]

    def abort(self, plan: Plan) -> list[Key]:
        """A released plan whose bytes did not all arrive (a read failed): the slots it admitted that are
        still LOADING are dropped, so no later plan takes them for held. Returns the device keys dropped
        (the device may hold part of them). Counted as evictions. A slot another plan in flight has pinned
        stays: that plan waits for the same bytes, and its own abort drops it."""
        dropped, changed = [], False
        layer = plan.layer
        device, host = self._dev(layer), self.host
        for key in plan.demotions:
            if host.state(key) is SlotState.LOADING and not host.pinned(key):
                self._count_eviction(self.stats.host, key, host.cancel(key))
                changed = True
        for item in plan.items:
            key = (layer, item.expert)
            if item.to_device and device.state(key) is SlotState.LOADING and not device.pinned(key):
                self._count_eviction(self.stats.device, key, device.cancel(key))
                host.policy.covered(key, False)
                dropped.append(key)
                changed = True
            if item.to_host and host.state(key) is SlotState.LOADING and not host.pinned(key):
                self._count_eviction(self.stats.host, key, host.cancel(key))
                changed = True
        if changed:
            self.generation += 1
        return dropped

    @staticmethod
    def _count_eviction(counters, key: Key, freed: int) -> None:
        counters[key[0]].evicted += 1
        counters[key[0]].evicted_bytes += freed

    def access(self, layer: int, ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray | None = None) -> Plan:
        """plan + commit + mark_ready + release, for synchronous callers."""
        plan = self.plan(layer, ids, sequences)
        self.commit(plan)
        self.mark_ready(plan)
        self.release(plan)
        return plan

    def admit_host(self, keys: Sequence[Key]) -> tuple[list[Key], list[Key]]:
        """Put experts read outside any plan (prefetch, backfill) into the host tier, READY.

        One admission plan for all of `keys`, in order (the policy orders its residents once, not once
        per key, and none of `keys` is evicted for another). Evicts unpinned experts by the host policy
        to make room. Returns (the keys admitted, the keys evicted); a key already held in a tier, or
        one that cannot get a slot, is left out, and nothing changes for it.
        """
        if not self.host.enabled:
            return [], []
        return self._admit_outside(self.host, [(key, self.expert_bytes[key[0]]) for key in self._unheld(keys)], self.stats.host)

    def admit_device(self, keys: Sequence[Key]) -> tuple[list[Key], list[Key]]:
        """admit_host's counterpart for a configuration with no host tier (the cpu backend's one tier is its
        device tier): experts read outside any plan (backfill) into their device's tier, READY, evicting
        unpinned experts by its policy; evictees are dropped, never demoted (no host tier takes them). The
        runtime must install the admitted keys' bytes and free the evicted keys' slots before the next plan
        (MoEStep does). Returns (the keys admitted, the keys evicted)."""
        wanted = self._unheld(keys)
        admitted: list[Key] = []
        victims: list[Key] = []
        for tier in self.devices:
            mine = [(key, self.device_expert_bytes[key[0]]) for key in wanted if self._dev(key[0]) is tier]
            if tier.enabled and mine:
                got, lost = self._admit_outside(tier, mine, self.stats.device)
                admitted += got
                victims += lost
        return admitted, victims

    def _unheld(self, keys: Sequence[Key]) -> list[Key]:
        """keys, each once in their order, that neither tier holds."""
        return [key for key in dict.fromkeys(keys) if key not in self._dev(key[0]) and key not in self.host]

    def _admit_outside(self, tier: TierDirectory, wanted: list[tuple[Key, int]], counters) -> tuple[list[Key], list[Key]]:
        """One admission plan of `wanted` (key, bytes) into `tier`, applied with its evictions; a device
        tier's changes are told to the host policy (what the faster tier covers), as commit tells them."""
        admitted, victims = tier.plan_admissions(wanted, (), self.now)
        for victim in victims:
            self._count_eviction(counters, victim, tier.evict(victim))
            if tier is not self.host:
                self.host.policy.covered(victim, False)
        sizes = dict(wanted)
        for key in admitted:
            tier.admit(key, sizes[key], self.now, SlotState.READY)
            if tier is not self.host:
                self.host.policy.covered(key, True)
        if admitted:
            self.generation += 1
        return admitted, list(victims)

    def seed(self, keys: Iterable[Key], pin_fraction: float = 0.0) -> tuple[list[Key], list[Key]]:
        """Fill the device tier, then the host tier, with keys in order (e.g. a profile's seed_order).

        Keys that do not fit are skipped; nothing is evicted; a key goes to one tier only, so the
        host holds the next-most-wanted experts. Seeded slots are READY (start-up loads them
        before the first token). With a policy that pins (`*-pinned`), the seeded keys filling the
        first `pin_fraction` of each tier's capacity are pinned in it for good. Returns (device keys,
        host keys) for the runtime to load.
        """
        if not 0.0 <= pin_fraction <= 1.0:
            raise ValueError(f"pin fraction must be in [0, 1], got {pin_fraction}")
        pinned_bytes: dict[int, int] = {}
        placed: tuple[list[Key], list[Key]] = ([], [])
        for key in keys:
            layer, expert = key
            if not (0 <= layer < self.n_layer and 0 <= expert < self.n_expert):
                raise ValueError(f"seed key {key} outside {self.n_layer} layers x {self.n_expert} experts")
            sizes = (self.device_expert_bytes[layer], self.expert_bytes[layer])
            for tier, size, out in zip((self._dev(layer), self.host), sizes, placed):
                if key in tier:
                    break
                if size <= tier.free:
                    tier.admit(key, size, self.now, SlotState.READY)
                    out.append(key)
                    if tier is not self.host:
                        self.host.policy.covered(key, True)
                    pin = getattr(tier.policy, "pin", None)
                    if pin is not None and pinned_bytes.get(id(tier), 0) + size <= pin_fraction * tier.capacity:
                        pinned_bytes[id(tier)] = pinned_bytes.get(id(tier), 0) + size
                        pin([key])
                    break
        self.generation += 1
        return placed


ONE_SEQUENCE = (0,)


def expert_sizes(expert_bytes: Sequence[int], device_expert_bytes: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One expert's bytes per layer in the store's form and in the device tier's (default: the store's), checked."""
    if any(b <= 0 for b in expert_bytes):
        raise ValueError(f"expected every expert size > 0 bytes, got {list(expert_bytes)}")
    store = tuple(int(b) for b in expert_bytes)
    device = tuple(int(b) for b in (device_expert_bytes or expert_bytes))
    if len(device) != len(store):
        raise ValueError("expected one device expert size per layer")
    return store, device


def users_of(experts: Sequence[int], ids: Iterable[int] | np.ndarray, sequences: Sequence[int] | np.ndarray) -> tuple[tuple[int, ...], ...]:
    """For each of `experts` (ascending), the sequences, ascending, whose rows of ids [T, k] chose it."""
    first = sequences[0] if len(sequences) else 0
    if all(s == first for s in sequences):  # one sequence (a prefill, or one decoding alone): the usual step
        return ((int(first),),) * len(experts)
    rows = np.asarray(ids, dtype=np.int64).reshape(len(sequences), -1)
    chose: dict[int, set[int]] = {e: set() for e in experts}
    for seq, row in zip(np.asarray(sequences).tolist(), rows.tolist()):
        for e in row:
            chose[e].add(int(seq))
    return tuple(tuple(sorted(chose[e])) for e in experts)


def _same_kind(policy: EvictionPolicy | None) -> EvictionPolicy:
    """An independent copy of a not-yet-used policy for another device's tier (policies hold
    per-tier state; at construction it is empty, so a deep copy is a fresh one)."""
    return LRUPolicy() if policy is None else copy.deepcopy(policy)
