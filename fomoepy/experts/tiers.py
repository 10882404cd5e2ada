"""Bookkeeping of one cache tier: which experts it holds, under one byte budget for all layers.

Pure Python over keys `(layer, expert)` and byte sizes; the runtime owns the memory and executes
what this directory decides. Capacity is global: a layer whose experts are popular may hold many
slots while another holds none, and experts of different layers may differ in size.

A key's slot is EMPTY (not held), LOADING (admitted; its bytes are in flight) or READY. A key is
not evictable while LOADING (a copy targets its memory) or pinned (the current computation reads
it). Pins are counted, so overlapping plans can pin the same expert.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from collections.abc import Set as AbstractSet
from contextlib import closing
from enum import Enum

from fomoepy.experts.policy import EvictionPolicy, Key


class SlotState(Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"


class TierDirectory:
    """What one tier holds. Invariant: 0 ≤ used ≤ capacity, used = Σ bytes of held keys."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy):
        if capacity < 0:
            raise ValueError(f"tier {name}: expected a capacity >= 0 bytes, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.used = 0
        self._bytes: dict[Key, int] = {}
        self._state: dict[Key, SlotState] = {}
        self._pins: dict[Key, int] = {}
        self._by_layer: dict[int, set[int]] = {}

    @property
    def enabled(self) -> bool:
        """A tier of size 0 is off: it holds nothing and is never consulted."""
        return self.capacity > 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    # -- queries -----------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def state(self, key: Key) -> SlotState:
        return self._state.get(key, SlotState.EMPTY)

    def nbytes(self, key: Key) -> int:
        return self._bytes[key]

    def keys(self) -> list[Key]:
        return list(self._state)

    def experts_in(self, layer: int) -> AbstractSet[int]:
        """Experts of `layer` held here (LOADING or READY): a live read-only view."""
        return self._by_layer.get(layer, frozenset())

    def pinned(self, key: Key) -> bool:
        return key in self._pins

    def evictable(self, key: Key) -> bool:
        return key not in self._pins and self._state.get(key) is SlotState.READY

    def plan_admissions(
        self, wanted: Sequence[tuple[Key, int]], protected: Container[Key], now: int = 0
    ) -> tuple[list[Key], list[Key]]:
        """Which of `wanted` (key, nbytes), in order, can be admitted, and which keys to evict for them.

        Changes nothing. Victims come in policy order among evictable keys not in `protected` (the
        keys the same plan uses). A key that cannot fit even after evicting every candidate is
        skipped (the caller streams it without a slot); later, smaller keys may still fit.
        """
        if not self.enabled or not wanted:
            return [], []
        free = self.free
        admitted: list[Key] = []
        victims: list[Key] = []
        pulled: deque[tuple[Key, int]] = deque()  # candidates taken from the policy, not yet evicted
        pulled_bytes = 0
        with closing(self.policy.eviction_order_for(wanted[0][0][0])) as order:
            exhausted = False
            for key, nbytes in wanted:
                if nbytes > self.capacity:
                    continue
                while free + pulled_bytes < nbytes and not exhausted:
                    candidate = next(order, None)
                    if candidate is None:
                        exhausted = True
                    elif self.evictable(candidate) and candidate not in protected:
                        pulled.append((candidate, self._bytes[candidate]))
                        pulled_bytes += self._bytes[candidate]
                if free + pulled_bytes < nbytes:
                    continue
                if free < nbytes and not self._admits(key, nbytes - free, pulled, now):
                    continue  # the policy keeps what it has: this one is streamed without a slot
                while free < nbytes:  # the shortest prefix of candidates that makes room
                    victim, size = pulled.popleft()
                    victims.append(victim)
                    free += size
                    pulled_bytes -= size
                free -= nbytes
                admitted.append(key)
        return admitted, victims

    def _admits(self, key: Key, needed: int, pulled: deque[tuple[Key, int]], now: int) -> bool:
        victims, freed = [], 0
        for victim, size in pulled:
            if freed >= needed:
                break
            victims.append(victim)
            freed += size
        return self.policy.admits(key, victims, now)

    # -- commands ----------------------------------------------------------------------------------

    def admit(self, key: Key, nbytes: int, now: int, state: SlotState = SlotState.LOADING) -> None:
        if key in self._state:
            raise RuntimeError(f"tier {self.name}: {key} admitted twice (state {self._state[key].value})")
        if nbytes > self.free:
            raise RuntimeError(
                f"tier {self.name}: admitting {key} needs {nbytes} bytes, expected at most {self.free} free"
            )
        if state is SlotState.EMPTY:
            raise ValueError("admit as LOADING or READY")
        self._bytes[key] = nbytes
        self._state[key] = state
        self._by_layer.setdefault(key[0], set()).add(key[1])
        self.used += nbytes
        self.policy.touch(key, now)

    def evict(self, key: Key) -> int:
        """Drop key; returns the bytes freed."""
        return self._drop(key, SlotState.READY, "evicting")

    def cancel(self, key: Key) -> int:
        """Drop a key still LOADING whose bytes will never come (its read failed); returns the bytes freed."""
        return self._drop(key, SlotState.LOADING, "cancelling")

    def _drop(self, key: Key, expected: SlotState, what: str) -> int:
        if key in self._pins:
            raise RuntimeError(f"tier {self.name}: {what} {key}, expected it unpinned, got {self._pins[key]} pins")
        if self._state.get(key) is not expected:
            raise RuntimeError(f"tier {self.name}: {what} {key}, expected {expected.name}, got {self.state(key).value}")
        del self._state[key]
        nbytes = self._bytes.pop(key)
        self._by_layer[key[0]].discard(key[1])
        self.used -= nbytes
        self.policy.forget(key)
        return nbytes

    def touch(self, key: Key, now: int) -> None:
        self.policy.touch(key, now)

    def mark_ready(self, key: Key) -> None:
        if key not in self._state:
            raise RuntimeError(f"tier {self.name}: {key} marked ready, expected LOADING, got empty")
        self._state[key] = SlotState.READY

    def pin(self, key: Key) -> None:
        if key not in self._state:
            raise RuntimeError(f"tier {self.name}: pinning {key}, expected it held, got empty")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise RuntimeError(f"tier {self.name}: unpinning {key}, expected a pin, got none")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1
