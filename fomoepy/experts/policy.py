"""Eviction policies: which resident expert a tier gives up when it needs room.

Pure Python over keys `(layer, expert)`; a policy knows nothing of bytes, slots or devices. A tier
tells its policy what it holds (`touch` on admission and on every use, `forget` on eviction) and
asks for candidates in eviction order, skipping the ones it may not evict (pinned, in use, still
loading). Time is logical: the number of tokens the engine has processed.

    lru               least recently used first
    lfu-decay         lowest frequency first, each use's weight halving every half-life tokens
    lru-pinned        lru, but profile-pinned experts are never evicted
    lfu-decay-pinned  lfu-decay, same pinning
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable
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
        self._heap: list[tuple[float, int, Key]] = []  # (v, t_last, key); stale entries skipped

    def _rank(self, now: int) -> float:
        return 0.0 if math.isinf(self.half_life) else now / self.half_life

    def score(self, key: Key, now: int) -> float:
        """The decayed use count of key at time now (0 for a key never touched)."""
        if key not in self._score:
            return 0.0
        v, _ = self._score[key]
        return 2.0 ** (v - self._rank(now))

    def touch(self, key: Key, now: int) -> None:
        old = self._score.get(key)
        # score(now) = 2^(v − now/h); adding this use's weight 1 and taking log2 again
        count = 1.0 if old is None else 2.0 ** (old[0] - self._rank(now)) + 1.0
        entry = (math.log2(count) + self._rank(now), now)
        self._score[key] = entry
        self._tracked.add(key)
        heapq.heappush(self._heap, (entry[0], entry[1], key))
        if len(self._heap) > 2 * len(self._tracked) + 64:
            self._compact()

    def forget(self, key: Key) -> None:
        self._tracked.discard(key)

    def __len__(self) -> int:
        return len(self._tracked)

    def _compact(self) -> None:
        self._heap = [(self._score[k][0], self._score[k][1], k) for k in self._tracked]
        heapq.heapify(self._heap)

    def _current(self, entry: tuple[float, int, Key]) -> bool:
        v, t, key = entry
        return key in self._tracked and self._score[key] == (v, t)

    def eviction_order(self) -> Generator[Key, None, None]:
        # pops live entries in order and pushes them back when the caller stops; stale ones are dropped
        popped: list[tuple[float, int, Key]] = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if self._current(entry):
                    popped.append(entry)
                    yield entry[2]
        finally:
            for entry in popped:
                heapq.heappush(self._heap, entry)


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


PolicyFactory = Callable[[PolicyOptions], EvictionPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "lru": lambda o: LRUPolicy(),
    "lfu-decay": lambda o: FrequencyDecayPolicy(o.half_life_tokens),
    "lru-pinned": lambda o: PinnedProfilePolicy(LRUPolicy(), o.pinned),
    "lfu-decay-pinned": lambda o: PinnedProfilePolicy(FrequencyDecayPolicy(o.half_life_tokens), o.pinned),
}


def make_policy(name: str, options: PolicyOptions | None = None) -> EvictionPolicy:
    """A fresh policy by its CLI name (one per tier: policies hold state)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise FomoeError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICIES)}")
    return factory(options or PolicyOptions())
