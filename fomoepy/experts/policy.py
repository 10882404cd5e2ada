"""Eviction policies: which resident expert a tier gives up when it needs room.

Pure Python over keys `(layer, expert)`; a policy knows nothing of bytes, slots or devices. A tier
tells its policy what it holds (`touch` on admission and on every use, `forget` on eviction) and
asks for candidates in eviction order, skipping the ones it may not evict (pinned, in use, still
loading). Time is logical: the number of tokens the engine has processed.

    lru               least recently used first
    lfu-decay         lowest frequency first, each use's weight halving every half-life tokens
    lru-pinned        lru, but profile-pinned experts are never evicted
    lfu-decay-pinned  lfu-decay, same pinning
    layer-lru         FOMOE's: equal slots per layer, LRU inside each
    lfu-admit         decayed frequency of every use, TinyLFU-style admission, duplicates of the faster
                      tier evicted first (AdmittingFrequencyPolicy)
    lfu-demote        lfu-admit over exclusive tiers: device evictees demoted into the host tier
                      (DemotingFrequencyPolicy)
    lfu-cooc          the default: lfu-demote, plus what the experts of the last token and of this one
                      announce for the next by co-use counts (co_use.CoUsePolicy). On the held-out trace
                      it is the one at >= 0.8 of Belady's memory hit rate at 10 % + 25 % (bench/RESULTS.md)
"""

from __future__ import annotations

import bisect
import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass, field

from fomoepy.errors import FomoeError

Key = tuple[int, int]  # (layer, expert)


class EvictionPolicy(ABC):
    """The interface every policy implements.

    `eviction_order()` is a lazy generator; the caller must finish or close it before the next
    `touch`/`forget` (tiers use `contextlib.closing`), so policies may reorganise while it runs.
    """

    name = "base"

    @abstractmethod
    def touch(self, key: Key, now: int) -> None:
        """key was admitted, or used while resident, at logical time `now` (tokens; never decreasing)."""

    @abstractmethod
    def forget(self, key: Key) -> None:
        """key left the tier: it is no longer a candidate (a no-op for keys not tracked)."""

    @abstractmethod
    def eviction_order(self) -> Generator[Key, None, None]:
        """Every tracked key, best victim first."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys the policy tracks."""

    # -- optional hooks (no-ops here): what a policy may also learn, and what it may refuse ------------
    def observe(self, key: Key, now: int, sequences: Sequence[int] = (0,)) -> None:
        """key was used at `now`, resident in this tier or not (once per step, whatever the tier served),
        by the rows of these sequences (a step may decode several)."""

    def admits(self, key: Key, victims: Sequence[Key], now: int) -> bool:
        """Whether key should take the place of `victims` (the tier streams it without a slot if not)."""
        return True

    def covered(self, key: Key, by_faster_tier: bool) -> None:
        """key is (or stops being) held by the tier in front of this one as well."""

    def eviction_order_for(self, layer: int) -> Generator[Key, None, None]:
        """Eviction order when room is wanted for an expert of `layer` (policies that partition by layer)."""
        return self.eviction_order()

    def victim(self, evictable: Callable[[Key], bool] = lambda key: True) -> Key | None:
        """The first key in eviction order that `evictable` accepts, or None."""
        with closing(self.eviction_order()) as order:
            return next((key for key in order if evictable(key)), None)


class LRUPolicy(EvictionPolicy):
    """Least recently used first; `now` is not needed, only the order of touches."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def touch(self, key: Key, now: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def eviction_order(self) -> Generator[Key, None, None]:
        yield from self._order

    def __len__(self) -> int:
        return len(self._order)


class LayerLRUPolicy(EvictionPolicy):
    """`layer-lru`, FOMOE's policy as a baseline: equal slots per layer, LRU inside each layer.

    Room for an expert of layer L is taken from L while L holds at least as many experts as any other
    layer, else from the layer holding the most; in steady state every layer keeps an equal share.
    """

    name = "layer-lru"

    def __init__(self) -> None:
        self._layers: dict[int, OrderedDict[Key, None]] = {}  # per layer, oldest first

    def touch(self, key: Key, now: int) -> None:
        order = self._layers.setdefault(key[0], OrderedDict())
        order[key] = None
        order.move_to_end(key)

    def forget(self, key: Key) -> None:
        order = self._layers.get(key[0])
        if order is not None:
            order.pop(key, None)

    def __len__(self) -> int:
        return sum(len(o) for o in self._layers.values())

    def eviction_order(self) -> Generator[Key, None, None]:
        for layer in sorted(self._layers, key=lambda l: -len(self._layers[l])):
            yield from list(self._layers[layer])

    def eviction_order_for(self, layer: int) -> Generator[Key, None, None]:
        own = len(self._layers.get(layer, ()))
        largest = max((len(o) for o in self._layers.values()), default=0)
        first = layer if own and own >= largest else max(self._layers, key=lambda l: len(self._layers[l]), default=layer)
        yield from list(self._layers.get(first, ()))
        for other in sorted(self._layers, key=lambda l: -len(self._layers[l])):
            if other != first:
                yield from list(self._layers[other])


class FrequencyDecayPolicy(EvictionPolicy):
    """Lowest decayed frequency first: score(t) = Σ over uses u of 2^(−(t − t_u) / half_life).

    Ties go to the least recently used, then the lower key. A key's score survives eviction, so an
    expert that comes back is recognised as frequent (history is one float per expert ever seen).
    half_life_tokens = inf is plain LFU.

    All scores decay by the same factor as time passes, so their order only changes on a touch. We
    rank by v = log2(score(t_last)) + t_last / half_life, which equals log2(score(t)) + t / half_life
    for every t ≥ t_last: a constant per key between touches, so a heap keyed on v stays valid.
    """

    name = "lfu-decay"

    def __init__(self, half_life_tokens: float = 256.0):
        if not half_life_tokens > 0:
            raise FomoeError(f"half-life must be > 0 tokens, got {half_life_tokens}")
        self.half_life = float(half_life_tokens)
        self._score: dict[Key, tuple[float, int]] = {}  # key → (v, t_last), also for evicted keys
        self._tracked: set[Key] = set()
        # (v, t_last, key) in ascending order, kept sorted as entries arrive (bisect: a C memmove, cheap
        # beside a heap's pop and push-back per entry walked); stale entries skipped, and dropped by the
        # walks that meet them
        self._order: list[tuple[float, int, Key]] = []

    def _rank(self, now: int) -> float:
        return 0.0 if math.isinf(self.half_life) else now / self.half_life

    def score(self, key: Key, now: int) -> float:
        """The decayed use count of key at time now (0 for a key never touched)."""
        if key not in self._score:
            return 0.0
        v, _ = self._score[key]
        return 0.0 if v == -math.inf else 2.0 ** (v - self._rank(now))

    def touch(self, key: Key, now: int) -> None:
        self.add_use(key, now)
        self.track(key, now)

    def add_use(self, key: Key, now: int) -> None:
        """One more use of key at `now` (resident or not); a resident key's rank moves with it."""
        old = self._score.get(key)
        # score(now) = 2^(v − now/h); adding this use's weight 1 and taking log2 again
        count = 1.0 if old is None else 2.0 ** (old[0] - self._rank(now)) + 1.0
        self._score[key] = (math.log2(count) + self._rank(now), now)
        if key in self._tracked:
            self._push(key)

    def track(self, key: Key, now: int) -> None:
        """key is resident: a candidate for eviction at its current score (0 uses if never used)."""
        if key not in self._score:
            self._score[key] = (-math.inf, now)
        self._tracked.add(key)
        self._push(key)

    def rank_changed(self, key: Key) -> None:
        """Another policy sharing this one's scores (learn_with) has just counted a use of key."""
        if key in self._tracked:
            self._push(key)

    def _push(self, key: Key) -> None:
        v, t = self._score[key]
        bisect.insort(self._order, (v, t, key))
        if len(self._order) > 2 * len(self._tracked) + 64:
            self._compact()

    def forget(self, key: Key) -> None:
        self._tracked.discard(key)

    def __len__(self) -> int:
        return len(self._tracked)

    def _compact(self) -> None:
        self._order = sorted((self._score[k][0], self._score[k][1], k) for k in self._tracked)

    def _current(self, entry: tuple[float, int, Key]) -> bool:
        v, t, key = entry
        return key in self._tracked and self._score[key] == (v, t)

    def eviction_order(self) -> Generator[Key, None, None]:
        # reads the live entries in order (the caller changes nothing until it closes the walk); the
        # stale ones it meets are dropped when it stops
        order = self._order
        stale: list[int] = []
        last = None
        try:
            for i, entry in enumerate(order):
                if entry != last and self._current(entry):  # (a key pushed twice unchanged: once)
                    last = entry
                    yield entry[2]
                else:
                    stale.append(i)
        finally:
            for i in reversed(stale):
                del order[i]


class AdmittingFrequencyPolicy(EvictionPolicy):
    """`lfu-admit`: frequency of use with a long memory, an admission test, and duplicates out
    first.

    - Every use counts, resident or not (`observe`), decayed with a half-life of `half_life_tokens`
      (default 64: tuned on the demo-project trace, where 16-256 were within 2 points and 4096 lost 3-4:
      nearby tokens reuse experts more than the text's overall preferences predict). Eviction takes the
      lowest decayed count.
    - Admission (TinyLFU's rule): a newcomer takes the place of its victims only if it has been used more
      than the most used of them; otherwise it is streamed once and the tier keeps what it has. A token's
      experts come and go by the dozen; without the test each one flushes a frequent expert.
    - In the host tier, an expert the device tier also holds is a duplicate: it is evicted before any
      other (a memory hit needs only one copy), and ranks normally again once the device drops it.

    Scored on the demo-heldout trace, which it was not tuned on (bench/simulate_trace.py).
    """

    name = "lfu-admit"

    def __init__(self, half_life_tokens: float = 64.0):
        self.freq = FrequencyDecayPolicy(half_life_tokens)  # its scores: every use; its heap: residents
        self._duplicates: set[Key] = set()
        self._dup_heap: list[Key] = []  # the resident duplicates in key order (lazily: stale entries skipped)
        self._learns = True  # False: another tier's policy counts the uses (learn_with)

    def learn_with(self, other: AdmittingFrequencyPolicy) -> None:
        """`other` (the next tier's policy, observing the same uses after this one) reads what this one
        learns instead of counting every use again: one set of scores for both tiers."""
        other.freq._score = self.freq._score
        other._learns = False

    def observe(self, key: Key, now: int, sequences: Sequence[int] = (0,)) -> None:
        if self._learns:
            self.freq.add_use(key, now)
        else:
            self.freq.rank_changed(key)

    def touch(self, key: Key, now: int) -> None:
        new = key not in self.freq._tracked
        self.freq.track(key, now)
        if new and key in self._duplicates:
            self._push_duplicate(key)

    def forget(self, key: Key) -> None:
        self.freq.forget(key)
        self._duplicates.discard(key)

    def covered(self, key: Key, by_faster_tier: bool) -> None:
        if by_faster_tier:
            if key not in self._duplicates:
                self._duplicates.add(key)
                self._push_duplicate(key)
        else:
            self._duplicates.discard(key)

    def _push_duplicate(self, key: Key) -> None:
        """A key both resident here and covered by the faster tier joins the heap of victims-first (most
        covered keys are not resident here: the heap holds only the ones a walk may yield)."""
        if key in self.freq._tracked:
            heapq.heappush(self._dup_heap, key)
            if len(self._dup_heap) > 2 * len(self.freq._tracked) + 64:
                tracked = self.freq._tracked
                self._dup_heap = sorted(k for k in self._duplicates if k in tracked)

    def _duplicates_in_order(self) -> Generator[Key, None, None]:
        """The resident duplicates, ascending key, popped lazily and put back when the walk stops."""
        tracked = self.freq._tracked
        popped: list[Key] = []
        try:
            while self._dup_heap:
                key = heapq.heappop(self._dup_heap)
                if key not in self._duplicates or key not in tracked or (popped and popped[-1] == key):
                    continue  # no longer a resident duplicate (dropped: pushed again if it becomes one), or a second entry
                popped.append(key)
                yield key
        finally:
            for key in popped:
                heapq.heappush(self._dup_heap, key)

    def admits(self, key: Key, victims: Sequence[Key], now: int) -> bool:
        worst = max((self.freq.score(v, now) for v in victims if v not in self._duplicates), default=0.0)
        return self.freq.score(key, now) + 1.0 > worst

    def __len__(self) -> int:
        return len(self.freq)

    def eviction_order(self) -> Generator[Key, None, None]:
        with closing(self._duplicates_in_order()) as duplicates:
            yield from duplicates
        with closing(self.freq.eviction_order()) as order:
            for key in order:
                if key not in self._duplicates:
                    yield key


class DemotingFrequencyPolicy(AdmittingFrequencyPolicy):
    """`lfu-demote`: lfu-admit over exclusive tiers. What the device tier evicts is demoted into the host
    tier (if the host's admission test takes it) instead of dropped, and a disk read that gets a device
    slot takes no host slot, so device and host hold mostly different experts (ExpertCache.demote)."""

    name = "lfu-demote"
    demotes = True


class PinnedProfilePolicy(EvictionPolicy):
    """Wraps a policy; pinned keys (e.g. the top of a frequency profile) are never chosen.

    With strict=False they are only favoured: offered last, in the inner policy's order.
    """

    def __init__(self, inner: EvictionPolicy, pinned: Iterable[Key] = (), strict: bool = True):
        self.inner = inner
        self.pinned: set[Key] = set(pinned)
        self.strict = strict
        self.name = f"{inner.name}-pinned"

    def pin(self, keys: Iterable[Key]) -> None:
        self.pinned.update(keys)

    def unpin(self, keys: Iterable[Key]) -> None:
        self.pinned.difference_update(keys)

    def touch(self, key: Key, now: int) -> None:
        self.inner.touch(key, now)

    def forget(self, key: Key) -> None:
        self.inner.forget(key)

    def __len__(self) -> int:
        return len(self.inner)

    def eviction_order(self) -> Generator[Key, None, None]:
        held: list[Key] = []
        with closing(self.inner.eviction_order()) as order:
            for key in order:
                if key in self.pinned:
                    held.append(key)
                else:
                    yield key
        if not self.strict:
            yield from held


@dataclass(frozen=True)
class PolicyOptions:
    """What the factories need: the decay half-life and the profile-pinned keys of the tier."""

    half_life_tokens: float = 256.0
    pinned: frozenset[Key] = field(default_factory=frozenset)
    admit_half_life_tokens: float = 64.0


PolicyFactory = Callable[[PolicyOptions], EvictionPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "lfu-cooc": lambda o: _co_use(),
    "lfu-demote": lambda o: DemotingFrequencyPolicy(o.admit_half_life_tokens),
    "lfu-admit": lambda o: AdmittingFrequencyPolicy(o.admit_half_life_tokens),
    "layer-lru": lambda o: LayerLRUPolicy(),
    "lru": lambda o: LRUPolicy(),
    "lfu-decay": lambda o: FrequencyDecayPolicy(o.half_life_tokens),
    "lru-pinned": lambda o: PinnedProfilePolicy(LRUPolicy(), o.pinned),
    "lfu-decay-pinned": lambda o: PinnedProfilePolicy(FrequencyDecayPolicy(o.half_life_tokens), o.pinned),
}
DEFAULT_POLICY = "lfu-cooc"


def _co_use() -> EvictionPolicy:
    # imported here: co_use builds on this module's policies
    from fomoepy.experts.co_use import CoUsePolicy

    return CoUsePolicy()


def policy_demotes(name: str) -> bool:
    """Whether the named policy wants exclusive tiers (device evictees demoted into the host tier)."""
    return bool(getattr(make_policy(name), "demotes", False))


def make_policy(name: str, options: PolicyOptions | None = None) -> EvictionPolicy:
    """A fresh policy by its CLI name (one per tier: policies hold state)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise FomoeError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")
    return factory(options or PolicyOptions())
