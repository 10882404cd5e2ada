"""Reads made ahead: the next layer's predicted experts, read while this layer computes, a few at a time.

A guess costs drive time when it is wrong, and a drive's time is what a streamed model is short of, so
the guesses are fed to the drives only as they free up: at most `depth` reads made ahead are in flight
(the next is issued as one lands), most confident guess first. A demand read therefore never queues
behind more than `depth` of them. When the layer's own routing comes, its step takes what it chose:
reads made ahead that it chose are handed over (in flight or landed) instead of being read again; the
guesses it did not choose and that were never issued are dropped unread; the rest land unused.

The cache never sees a read made ahead: the step counts the ones it takes as the disk reads they are,
so what the tiers hold (and so, with cache-aware routing, what the model computes) is the same with
reading ahead on or off. Reading ahead changes only when bytes arrive.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fomoepy.experts.policy import Key
from fomoepy.experts.reads import InFlight

log = logging.getLogger(__name__)

# Reads made ahead in flight per drive, where a source does not say (its read_ahead_depth): two keep a
# drive that serves one read at a time busy (one's bytes cross while the next one's latency passes) and
# bound a demand read's wait behind guesses to two reads
DEPTH_PER_DRIVE = 2
# the share of the guesses read ahead (the next layer's no tier holds) that must be right for reading ahead
# to pay on the GPU schedule (fomoepy.runtime.gpu_experts): a wrong one still in flight when its layer
# routes holds the drive from that step's own reads. Measured on the emulated fomoe-rig (bench/plan_fidelity.py --emulated's child, the
# 397B shape, a predictor right at every rank alike, tok/s read ahead against not): break-even at 0.42,
# 0.42 and 0.46 of the guesses right at the three tier settings (40+30 %, 11.3+12.9 %, 4+4 %); below it
# reading ahead cost up to 19 % (0.12 right), above it gained up to 11 % (0.57 right)
GPU_READ_AHEAD_PAYS = 0.44


@dataclass
class ReadAheadCounts:
    issued: int = 0  # guesses whose read was started
    used: int = 0  # of those, taken by their layer's step (a disk read made early)
    landed: int = 0  # of those used, landed before their step asked (the step waited for none of their bytes)
    wasted: int = 0  # of those, not chosen there (drive time spent on a wrong guess)
    in_the_way: int = 0  # of those wasted, still in flight when their layer routed (its reads queue behind them)
    skipped: int = 0  # guesses dropped unread: their layer's routing came first
    # by position in the order the guesses were read (a step's guesses no tier holds, most confident
    # first): how many were read there, and how many of those their step took. Where the tiers hold the
    # likeliest guesses, the ones read are right less often than the predictor's first choices are
    # (`fomoe plan`'s read-ahead model takes the share of right ones along this order)
    read_at: list[int] = field(default_factory=list)
    used_at: list[int] = field(default_factory=list)

    def count_read(self, at: int, used: bool) -> None:
        """One guess read at position `at` of its step's reading order, taken by its step or not."""
        if at >= len(self.read_at):
            self.read_at += [0] * (at + 1 - len(self.read_at))
            self.used_at += [0] * (at + 1 - len(self.used_at))
        self.read_at[at] += 1
        self.used_at[at] += used

    def along_reading_order(self) -> tuple[float, ...]:
        """The share of the guesses read at each position of the reading order that their step took, over
        the positions read at least a tenth as often as the first (fewer are noise): what `fomoe plan`'s
        read-ahead model takes as the density of right guesses along the order its reads are made in."""
        read, used = self.read_at, self.used_at
        return tuple(u / r for r, u in zip(read, used) if r > 0 and r >= 0.1 * read[0])


class ReadAheadGate:
    """Whether reading ahead pays, judged from the guesses themselves: of the next layer's guesses no tier
    held when they were made (what reading ahead reads), the share its step then read from disk. A wrong
    guess in flight when its layer routes holds the drive from that step's own reads, so below some share
    reading ahead costs more than it saves: `pays_above` is that share for the device's schedule (for a GPU,
    measured on the emulated device: GPU_READ_AHEAD_PAYS).

    Each `window` guesses scored give a verdict, with a margin of two standard errors of a window's share
    (sqrt(p (1 - p) / window) at p = pays_above) either side, so that a predictor near the line does not
    turn reading on and off window by window. While it is off, a prediction is still made on one decode
    token in `sample` (its router costs a launch a step) and scored as if read: a predictor that improves
    (another text, a warmer context) turns reading ahead back on."""

    def __init__(self, pays_above: float, window: int = 512, sample: int = 8):
        if not 0.0 <= pays_above < 1.0 or window < 1 or sample < 1:
            raise ValueError(f"read-ahead gate: pays_above in [0, 1), window and sample >= 1; got {pays_above}, {window}, {sample}")
        self.pays_above, self.window, self.sample = pays_above, window, sample
        self.margin = 2.0 * (pays_above * (1.0 - pays_above) / window) ** 0.5
        self.reading = True
        self.share: float | None = None  # the last window's share of guesses read right
        self.turned = 0  # times reading ahead was turned off or on
        self._guessed = self._right = 0
        self.guessed = self.right = 0  # all scored so far
        self._tokens = 0

    def keeps_reading(self, share: float) -> bool:
        """Whether a gate that starts reading ahead goes on reading at a steady `share` of guesses right."""
        return share >= self.pays_above - self.margin

    @property
    def predicting(self) -> bool:
        """Whether this token's steps predict the next layer: always while reading ahead, else sampled."""
        return self.reading or self._tokens % self.sample == 0

    def tick(self) -> None:
        self._tokens += 1

    def score(self, guessed: int, right: int) -> None:
        """A step's guesses no tier held (`guessed`), of which its step read `right` from disk."""
        self._guessed += guessed
        self._right += right
        self.guessed += guessed
        self.right += right
        if self._guessed < self.window:
            return
        self.share = self._right / self._guessed
        self._guessed = self._right = 0
        reading = self.share > self.pays_above + self.margin if not self.reading else self.share >= self.pays_above - self.margin
        if reading != self.reading:
            self.reading = reading
            self.turned += 1
            log.info("reading ahead %s: %.0f %% of the guesses no tier held were right (it pays above %.0f %%)",
                     "on" if reading else "off", 100 * self.share, 100 * self.pays_above)  # fmt: skip


_UNMADE = object()  # what a guess's read needs, not made yet (prepare_anywhere: made as it is issued)


class PyReadAhead:
    """Feeds guesses to `submit(layer, expert, prepared) -> a read in flight` at most `depth` at a time.

    The inference thread calls `queue` and `take`; a landing read's callback (on whichever thread completes
    it) issues the next guess. What a read needs from objects only the inference thread may touch (a
    pinned buffer from a GPU device's pool) is made when the guess is queued, by `prepare(layer, expert)`
    (or, where `prepare` is a list, one callable per layer: `prepare[layer]()`, no frame of a function that
    only picks the layer's), and handed to `submit` with it. With `prepare_anywhere` (a prepare that any
    thread may call: the cpu device's read arena) it is made as the guess is issued, on the issuing thread:
    most guesses are dropped unissued (a decode step's next layer's, on the bench model at a 25 % tier: 4.4
    taken a step and 0.4 issued), and each made for nothing cost a buffer's taking and giving back on the
    inference thread (8-19 µs of its host time a step, by hand). All state is under one lock; `submit` is called outside it, since a
    store may complete a read at once and so call back into this object on the same thread. The
    definition: where setup.py built it, ReadAhead is fomoepy/experts/_reads.c's, the same in C (a step
    queues and takes about three guesses, some fifteen Python frames and twenty lock operations here)."""

    def __init__(self, submit: Callable[[int, int, Any], InFlight], depth: int,
                 prepare: Callable[[int, int], Any] | list[Callable[[], Any]] | None = None,
                 prepare_anywhere: bool = False):  # fmt: skip
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self.submit = submit  # (replaceable: the reads queued after go to the new one)
        self._prepare = prepare
        self._anywhere = prepare_anywhere
        self.depth = depth
        self.counts = ReadAheadCounts()
        # a plain lock for the state (a Condition's own `with` is Python code, and a step takes it a few
        # times per guess), and a condition over it for the one wait (`take`)
        self._lock = threading.Lock()
        self._filed = threading.Condition(self._lock)
        self._submitting: set[Key] = set()  # popped from the queue, their read not yet filed
        self._waiting = 0  # takes waiting for one of those to be filed
        self._queued: deque[tuple[Key, Any]] = deque()  # guesses not yet issued, in order, each with what it needs
        self._issued: dict[Key, tuple[InFlight, int]] = {}  # issued guesses no step has taken yet, with their position
        self._in_flight = 0  # issued reads not landed (taken or not: they hold the drive either way)
        self._closed = False

    def queue(self, layer: int, experts: Iterable[int]) -> None:
        """Read these guesses for `layer` (most confident first) as the drives free up. Guesses for another
        layer still queued are dropped: a read made ahead is worth it for the next step only."""
        if isinstance(self._prepare, list):
            self._prepare[layer]  # (a layer with none refused here, as the guesses are queued)
        anywhere, prepared_for = self._anywhere, self._prepared_for
        # (key, what its read needs, its position in the reading order), made on the calling thread (anywhere: as issued)
        guesses = deque([((layer, e), _UNMADE if anywhere else prepared_for((layer, e)), i)
                         for i, e in enumerate(map(int, experts))])  # (a list: one frame, not one per guess)  # fmt: skip
        with self._lock:
            self.counts.skipped += len(self._queued)
            self._queued = guesses
            for key in [k for k in self._issued if k[0] != layer]:  # guesses for a step that never came
                del self._issued[key]
                self.counts.wasted += 1
        self._issue()

    def take(self, layer: int, wanted: Iterable[int]) -> dict[int, InFlight]:
        """The reads made ahead that `layer`'s step wants (its disk reads), by expert; every other guess for
        the layer is dropped (unread if still queued)."""
        wanted = set(wanted)
        taken: dict[int, InFlight] = {}
        with self._lock:
            # a guess another thread is issuing right now is filed in a moment: wait for it, not read it twice
            if self._submitting:
                self._waiting += 1
                try:
                    self._filed.wait_for(lambda: not any(k[0] == layer for k in self._submitting))
                finally:
                    self._waiting -= 1
            kept: deque[tuple[Key, Any]] = deque()
            for guess in self._queued:
                if guess[0][0] == layer:
                    self.counts.skipped += 1
                else:
                    kept.append(guess)
            self._queued = kept
            c = self.counts
            for key in [k for k in self._issued if k[0] == layer]:
                future, at = self._issued.pop(key)
                c.count_read(at, key[1] in wanted)
                if key[1] in wanted:
                    taken[key[1]] = future
                    c.used += 1
                    c.landed += future.done()
                else:
                    c.wasted += 1
                    c.in_the_way += not future.done()
        return taken

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _prepared_for(self, key: Key) -> Any:
        """What the read of the guess `key` needs: prepare[layer](), prepare(layer, expert), or None."""
        prepare = self._prepare
        if prepare is None:
            return None
        return prepare[key[0]]() if isinstance(prepare, list) else prepare(*key)

    def _issue(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._in_flight >= self.depth or not self._queued:
                    return
                key, prepared, at = self._queued.popleft()
                self._in_flight += 1
                self.counts.issued += 1
                self._submitting.add(key)
            future, landed = None, False
            try:  # (prepare_anywhere: what the read needs made now, here; its failure the submit's)
                future = self.submit(*key, self._prepared_for(key) if prepared is _UNMADE else prepared)
            except RuntimeError as e:  # a closed store's pool: a guess is optional; a step's own read reports it
                log.debug("read ahead of %s not issued: %s", key, e)
            finally:
                with self._lock:
                    self._submitting.discard(key)
                    if future is None:  # the store refused it (closed): nothing is in flight for it
                        self._in_flight -= 1
                    else:
                        self._issued[key] = (future, at)
                        # landed already (a null or cached read): the drive is free, and the loop goes on
                        # with no callback to make
                        landed = future.done()
                        self._in_flight -= landed
                    if self._waiting:  # (a notify with no one waiting still costs a microsecond)
                        self._filed.notify_all()
            if future is None:
                return
            if not landed:  # added after the future is filed: a read that lands meanwhile calls back at once
                future.add_done_callback(self._landed)

    def _landed(self, _: InFlight) -> None:
        with self._lock:
            self._in_flight -= 1
        self._issue()

    def close(self) -> None:
        """Issue nothing more; reads in flight land unused (a store's close waits for them)."""
        with self._lock:
            self._closed = True
            self.counts.skipped += len(self._queued)
            self._queued.clear()
            self._issued.clear()


try:  # optional (setup.py): without it the Python definition above serves (the same reads, more host time)
    from fomoepy.experts._reads import ReadAhead
except ImportError:
    ReadAhead = PyReadAhead  # type: ignore[misc,assignment]
