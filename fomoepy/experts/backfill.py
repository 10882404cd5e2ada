"""Backfill: bring back the experts that cache-aware routing substituted, while nobody needs the disk.

A substituted original is an expert the router wanted but the cache did not hold; reading it into
DRAM makes the next token that wants it exact again. Requests are served highest router score
first and age out: one still waiting `max_age` tokens after it was asked for is dropped, because
routing has moved on by then.

Two modes: `thread` — a background thread reads while the inference thread computes (it starts no
read while a plan's reads are in flight; one it has already started finishes on its own thread while the
plan's reads go through the store's pool, so a miss never waits behind it); `sync` — the inference
thread reads the best N at the end of every token, which makes runs repeatable.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
from collections.abc import Callable

from fomoepy.experts.policy import Key

ExpertBytes = tuple
Reader = Callable[[int, int], ExpertBytes]


class BackfillQueue:
    """Priority queue of substituted originals: best score first, one entry per expert, aged."""

    def __init__(self, max_age: int = 64):
        self.max_age = max_age
        self._heap: list[tuple[float, int, Key, int]] = []  # (-score, seq, key, asked_at)
        self._best: dict[Key, float] = {}
        self._seq = itertools.count()
        self.dropped_stale = 0

    def add(self, key: Key, score: float, now: int) -> None:
        if score <= self._best.get(key, -1.0):
            return
        self._best[key] = score
        heapq.heappush(self._heap, (-score, next(self._seq), key, now))

    def pop(self, now: int) -> Key | None:
        while self._heap:
            neg_score, _, key, asked = heapq.heappop(self._heap)
            if self._best.get(key) != -neg_score:
                continue  # superseded by a later, better-scored request for the same expert
            del self._best[key]
            if now - asked > self.max_age:
                self.dropped_stale += 1
                continue
            return key
        return None

    def __len__(self) -> int:
        return len(self._best)


class BackfillThread:
    """Reads queued experts in the background; results wait in `done` for the inference thread."""

    def __init__(self, read: Reader, max_age: int = 64):
        self.read = read
        self.queue = BackfillQueue(max_age)
        self.done: queue.SimpleQueue[tuple[Key, ExpertBytes | BaseException]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._io_idle = True
        self._now = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fomoe-backfill", daemon=True)
        self._thread.start()

    def request(self, key: Key, score: float, now: int) -> None:
        with self._wake:
            self.queue.add(key, score, now)
            self._now = now
            self._wake.notify()

    def set_io_busy(self, busy: bool, now: int) -> None:
        """The inference thread says when a plan's own reads are in flight (backfill then waits)."""
        with self._wake:
            self._io_idle = not busy
            self._now = now
            if not busy:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (not self._io_idle or not len(self.queue)):
                    self._wake.wait()
                if self._stop:
                    return
                key = self.queue.pop(self._now)
            if key is None:
                continue
            try:
                self.done.put((key, self.read(*key)))
            except BaseException as e:  # handed to the inference thread, which reports it
                self.done.put((key, e))

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5)
