"""Belady's optimum: the hit count no eviction policy can beat on a known access sequence.

On a miss, the cache considers the incoming expert and every resident one, and leaves out whichever
is next used furthest in the future (possibly the incoming one: a bypass, as our tiers may decline
to admit). With equal sizes this is MIN, exactly optimal (Belady 1966; with bypass allowed). With
unequal byte sizes, evicting furthest-next-use until the newcomer fits is the classic heuristic,
not a proven optimum (that problem is NP-hard); we still call it Belady, as the literature does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BeladyResult:
    accesses: int
    hits: int
    hit_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def next_uses(seq: Sequence[Hashable]) -> list[int]:
    """For each position, the position of the same key's next access (len(seq) + 1 if none)."""
    never = len(seq) + 1
    nxt = [never] * len(seq)
    last: dict[Hashable, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    return nxt


def belady(
    seq: Sequence[Hashable],
    size_of: Callable[[Hashable], int],
    capacity: int,
    initial: Iterable[Hashable] = (),
) -> BeladyResult:
    """Replay seq against a cache of `capacity` bytes under furthest-next-use eviction with bypass.

    `initial` keys are resident at the start (a seeded cache), as many as fit, in order.
    """
    nxt = next_uses(seq)
    first: dict[Hashable, int] = {}
    for i, key in enumerate(seq):
        first.setdefault(key, i)
    resident: dict[Hashable, int] = {}  # key → position of its next use
    heap: list[tuple[int, int, Hashable]] = []  # (−next use, tiebreak, key); stale entries skipped
    used = hits = hit_bytes = 0
    for key in initial:
        if key not in resident and used + size_of(key) <= capacity:
            used += size_of(key)
            resident[key] = first.get(key, len(seq) + 1)
            heapq.heappush(heap, (-resident[key], -1, key))
    for i, key in enumerate(seq):
        size = size_of(key)
        if key in resident:
            hits += 1
            hit_bytes += size
            resident[key] = nxt[i]
            heapq.heappush(heap, (-nxt[i], i, key))
            continue
        if size > capacity:
            continue
        victims: list[tuple[int, int, Hashable]] = []
        freed = 0
        # evict only keys needed later than this one; if that cannot make room, bypass instead
        while used - freed + size > capacity and heap:
            entry = heapq.heappop(heap)
            far, _, other = entry
            if resident.get(other) != -far:
                continue  # stale
            if -far <= nxt[i]:
                heapq.heappush(heap, entry)
                break
            victims.append(entry)
            freed += size_of(other)
        if used - freed + size > capacity:
            for entry in victims:
                heapq.heappush(heap, entry)
            continue
        for _, _, other in victims:
            del resident[other]
        used += size - freed
        resident[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], i, key))
        if len(heap) > 4 * len(resident) + 64:
            heap = [(-n, 0, k) for k, n in resident.items()]
            heapq.heapify(heap)
    return BeladyResult(len(seq), hits, hit_bytes)
