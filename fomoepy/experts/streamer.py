"""ExpertStreamer: the host side of the MoE step (fomoepy.experts.step.MoEStep), which drives it:

    ids, weights = streamer.substitute(layer, exact)     # cache-aware routing: what the step reads
    plan, fetched, reads = streamer.start_acquire(layer, ids, beside=lambda fetched, reads: streamer.note(layer, exact))
                                                      # reads issued; beside them the trace and profile
                                                      # counts (note); then the cache plan, host bytes
    ... the device computes, filling its tier for plan items with to_device ...
    streamer.finish_acquire(plan, fetched, reads)    # this step's reads landed (the device says when)
    streamer.release(plan)

and `begin_step` / `end_step` around each batch of tokens. The streamer owns the cache
bookkeeping, the host (DRAM) tier's bytes, the reads from the expert source, prefetch and
backfill; the device owns the device tier's contents (it alone knows their form). Only the
inference thread calls in here; the backfill thread and the reader pool hand results back
through futures and a queue.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fomoepy.experts.backfill import BackfillQueue, BackfillThread
from fomoepy.experts.cache import PIN_FRACTION, ExpertCache, Plan, Source
from fomoepy.experts.car import CarStats, cache_aware_route
from fomoepy.experts.policy import Key
from fomoepy.experts.profile import ExpertCounter, read_freq, seed_order
from fomoepy.experts.read_ahead import (
    DEPTH_PER_DRIVE,
    ReadAhead,
    ReadAheadCounts,
    ReadAheadGate,
)
from fomoepy.experts.read_buffers import ReadBuffers
from fomoepy.experts.reads import InFlight
from fomoepy.experts.routing import Routing
from fomoepy.experts.source import LayerExperts
from fomoepy.experts.trace import TraceHeader, TraceWriter
from fomoepy.options import EngineOptions

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]
# a substituted original still unread after this many tokens is no longer worth backfilling
BACKFILL_MAX_AGE = 64


class ExpertSourceLike(Protocol):
    layers: tuple[LayerExperts, ...]

    def read(self, layer: int, expert: int) -> ExpertBytes: ...


@dataclass
class PrefetchStats:
    predicted: int = 0  # experts predicted for the next layer
    correct: int = 0  # of those, selected by the router there

    @property
    def accuracy(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0


# the rows of a step a call takes: all (None), one run of them, or several runs in order (the rows of
# several sequences computed apart: fomoepy.experts.step.MoEStep's runs)
Rows = slice | list[slice] | None


def rows_of(x: Any, rows: Rows) -> Any:
    """x's rows `rows`: all (None), a run, or several runs joined in order."""
    if rows is None:
        return x
    return x[rows] if isinstance(rows, slice) else np.concatenate([x[run] for run in rows])


def _rows_of(exact: Routing, rows: slice | list[slice]) -> Routing:
    """The routing of the rows `rows` (a run, or several joined in order)."""
    return Routing(rows_of(exact.ids, rows), rows_of(exact.weights, rows), rows_of(exact.probs, rows))


try:  # ExpertStreamer.start_acquire in C (setup.py builds it where a compiler is; its definition is the method)
    from fomoepy.experts import _acquire
except ImportError:
    _acquire = None


class ExpertStreamer:
    def __init__(
        self,
        source: ExpertSourceLike,
        cache: ExpertCache,
        n_expert_used: int,
        options: EngineOptions = EngineOptions(),
        model_name: str = "",
        record_trace: bool = True,
        download: Callable[[Key], ExpertBytes | None] | None = None,
        buffers: Callable[[int], np.ndarray] | None = None,
        read_ahead_pays: float | None = None,
        plans_beside: bool = False,
        buffers_anywhere: bool = False,
    ):
        """options: the engine's, of which the streamer acts on car, backfill, backfill_per_token,
        prefetch, trace and freq_profile (the tiers' sizes and policies are the cache's).
        record_trace: open options.trace (False when a reset carries the open trace over).
        download: gives back the store bytes of an expert the device tier holds; with it, and only
        with it, a demoting policy's device evictees move down into the host tier (decided here, once).
        buffers: a buffer of at least n bytes for a read to land in (a GPU device's pinned memory, so the
        copy up needs no staging memcpy; the cpu device's read arena, whose buffers its decode rounds
        compute from in place), used where the source reads into given buffers; without one,
        such a source's reads land in buffers reused from read to read (fomoepy.experts.read_buffers).
        buffers_anywhere: `buffers` may be called from any thread (the cpu device's read arena; the reused
        buffers are): a read made ahead takes its buffer as it is issued, so a guess dropped unissued takes
        none. Otherwise (a GPU device's pinned pool, the inference thread's alone) it takes it as it is queued.
        read_ahead_pays: the share of guesses read that must be right for reading ahead to pay on the
        device's schedule (ReadAheadGate); None: reading ahead is never turned off.
        plans_beside: each step's cache plan is begun as its reads are issued and its commit applied while it
        computes, on the compiled cache's own thread (ExpertCache.plan_soon, commit_soon): a device whose step
        has host work of its own to do meanwhile (a GPU's launches and copies up) gains their time; one whose
        cores compute the step (the cpu backend) loses more than it gains: the thread's spinning takes a core
        from ggml's products, and without it a wake per job costs more than the plan (both measured slower)."""
        self.source = source
        self.options = options
        self._car_on = options.car.enabled  # (options are frozen: asked once, not a property's frame a step)
        self.layers = source.layers
        self.n_layer = len(self.layers)
        self.n_expert = cache.n_expert
        self.cache = cache
        self.host_slots: dict[Key, ExpertBytes] = {}
        # a demoting policy needs the device to copy an evicted expert's store bytes down; a device that
        # cannot (download None) has its evictees dropped as with any policy
        self._demotes = self.cache.demote
        self.cache.demote = self._demotes and download is not None
        self._download = download
        slot_nbytes = getattr(source, "slot_nbytes", None)
        if buffers is None and slot_nbytes is not None and getattr(source, "submit", None) is not None:
            self.read_buffers: ReadBuffers | None = ReadBuffers()
            buffers, buffers_anywhere = self.read_buffers.take, True
        else:
            self.read_buffers = None
        # per layer, a buffer of its slot's size for a read (sizes asked once, not at every read; a partial
        # per layer, not a function of the layer: a step takes several, and each Python frame is counted)
        self._read_buffer: list[Callable[[], np.ndarray]] | None = None
        if buffers and slot_nbytes:
            self._read_buffer = [functools.partial(buffers, slot_nbytes(layer)) for layer in range(self.n_layer)]
        self.reads_issued_at = 0.0  # perf_counter time the last start_acquire had issued its reads
        self.plans_beside = plans_beside
        self._landed_plan: Plan | None = None  # plans_beside: the plan whose reads landed, made ready at its release
        self.car_stats = CarStats()
        self.prefetch_stats = PrefetchStats()
        self.counter = ExpertCounter(self.n_layer, self.n_expert)
        self.tokens_seen = 0  # tokens fully processed; the running index for warmup and traces
        self._predicted: dict[int, list[int]] = {}  # layer → its predicted experts, most confident first
        self._to_prefetch: tuple[int, list[int]] | None = None  # (layer, experts, most confident first) to read ahead
        # the next layer's guesses not yet cached, fed to the drives as they free up (fomoepy.experts.read_ahead)
        depth = getattr(source, "read_ahead_depth", DEPTH_PER_DRIVE)
        # a guess's read buffer is taken as it is queued, on this thread (a GPU device's pinned pool is the
        # inference thread's alone), or where buffers_anywhere as it is issued; the read is issued later, by
        # whichever thread saw the last one land
        self.read_ahead = (ReadAhead(self._read_ahead_submit(), depth, self._read_buffer, prepare_anywhere=buffers_anywhere)
                           if self._prefetching() else None)  # fmt: skip
        self.gate = ReadAheadGate(read_ahead_pays) if read_ahead_pays is not None and self.read_ahead is not None else None
        self._guessed: dict[int, list[int]] = {}  # layer -> its guesses no tier held when they were made (the gate's)
        self.trace: TraceWriter | None = None
        if options.trace and record_trace:
            header = TraceHeader(self.n_layer, self.n_expert, n_expert_used, tuple(l.expert_nbytes for l in self.layers), model_name,
                                 read_ahead=self._prefetching())  # fmt: skip
            self.trace = TraceWriter(options.trace, header)
        self._backfill_queue: BackfillQueue | None = None
        self._backfill_thread: BackfillThread | None = None
        if options.car.enabled and options.backfill == "thread":
            self._backfill_thread = BackfillThread(source.read, BACKFILL_MAX_AGE)
        elif options.car.enabled and options.backfill == "sync":
            self._backfill_queue = BackfillQueue(BACKFILL_MAX_AGE)
        self.backfilled = 0
        self.seeded: tuple[int, int] | None = None  # (device, host) experts a --freq-profile seeded
        # with no host tier (the cpu backend's one tier is its device tier) backfilled experts go to the device
        # tier, whose form the step installs before its next plan (take_device_changes)
        self.backfills_device = ((self._backfill_queue is not None or self._backfill_thread is not None)
                                 and not cache.host.enabled and cache.device.enabled)  # fmt: skip
        self._device_changes: list[tuple[Key, ExpertBytes | None]] = []
        self._sequences: list[int] | None = None  # each row's sequence in this step
        self._first_token = 0

    @property
    def demotes(self) -> bool:
        """Whether the cache's policy wants device evictees demoted (the device must copy them down)."""
        return self._demotes

    # -- start-up ----------------------------------------------------------------------------------
    def carry_over_from(self, old: ExpertStreamer, trace: TraceWriter | None) -> None:
        """Continue a closed streamer's counters and token index, and its trace (a reset empties the tiers,
        not the record of the run)."""
        self.cache.stats = old.cache.stats
        self.car_stats, self.prefetch_stats, self.counter = old.car_stats, old.prefetch_stats, old.counter
        if self.read_ahead is not None and old.read_ahead is not None:
            self.read_ahead.counts = old.read_ahead.counts
        self.tokens_seen, self.backfilled, self.seeded = old.tokens_seen, old.backfilled, old.seeded
        self.trace = trace

    def seed_from_profile(self) -> list[Key]:
        """Fill the tiers with the profile's most frequent experts; returns the device tier's keys
        (the backend loads those into its own form); host keys are read here."""
        if not self.options.freq_profile:
            return []
        profile = read_freq(self.options.freq_profile, self.n_layer, self.n_expert)
        device_keys, host_keys = self.cache.seed(seed_order(profile), PIN_FRACTION)
        for key in host_keys:
            self.host_slots[key] = self.source.read(*key)
        self.seeded = (len(device_keys), len(host_keys))
        return device_keys

    # -- per batch of tokens -----------------------------------------------------------------------
    def begin_step(self, sequences: list[int] | None = None) -> None:
        """A step starts; `sequences`: each of its rows' sequence (None: one sequence), for the policies'
        co-use per sequence and the trace."""
        self._first_token = self.tokens_seen
        self._sequences = sequences

    def end_step(self, n_tokens: int, ticks: int | None = None) -> None:
        """A step of n_tokens rows is done. `ticks`: how far the policies' logical time moves (default
        n_tokens: a prefill's rows are consecutive tokens; a batch of decodes is one tick, whatever its
        rows, so half-lives do not shrink as a batch grows)."""
        ticks = n_tokens if ticks is None else ticks
        self.tokens_seen += n_tokens
        if self.gate is not None:
            self.gate.tick()
        self.cache.tick(ticks)
        if self._backfill_queue is not None:
            for _ in range(self.options.backfill_per_token * ticks):
                key = self._backfill_queue.pop(self.tokens_seen)
                if key is None:
                    break
                self.backfilled += len(self._admit_backfilled({key: self.source.read(*key)}))

    # -- per MoE layer -----------------------------------------------------------------------------
    def choose(self, layer: int, exact: Routing, rows: Rows = None) -> tuple[np.ndarray, np.ndarray]:
        """The experts to compute: the exact selection, or CAR's substitutions when it is on; of the rows
        `rows` only where given (the last layer's rows that are read). Usage counts (profiles) take the
        router's choice of every row; the trace, CAR and the plan take the rows computed. Both halves:
        `note` (the counts and the trace) and `substitute` (CAR)."""
        self.note(layer, exact, rows)
        return self.substitute(layer, exact, rows)

    def note(self, layer: int, exact: Routing, rows: Rows = None) -> None:
        """The step's record of what the router chose: usage counts (every row), the last prediction's
        accuracy and the trace (the rows computed). Nothing the step's reads depend on: MoEStep makes it
        while they are in flight."""
        self.counter.add(layer, exact.ids)
        if isinstance(rows, list):  # several runs of rows (a joint prefill, which predicts nothing): a record of each
            self._predicted.pop(layer, None)
            if self.trace is not None:
                for run in rows:
                    self._record(layer, _rows_of(exact, run), self._first_token + run.start, self._sequences_of(run), None)
            return
        first = self._first_token
        if rows is not None:
            exact = _rows_of(exact, rows)
            first += rows.start
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            # sets of ten ints, not numpy's isin: a step's host time is counted in microseconds
            actual = set(exact.ids.ravel().tolist())
            self.prefetch_stats.predicted += len(predicted)
            self.prefetch_stats.correct += len(actual.intersection(predicted))
        if self.trace is not None:  # (asked here: a decode step without a trace makes no call for it)
            self._record(layer, exact, first, self._sequences_of(rows), predicted)

    def note_pass(self, ids: np.ndarray) -> bool:
        """`choose` for every layer of a pass computed in one call, ids [n_layer, T, k] (every row computed),
        where that is the usage counts alone: no trace to write, CAR off (it substitutes nothing in the
        call's choice) and no prediction to score. False, nothing noted, where it is more: the caller then
        chooses layer by layer."""
        if self.trace is not None or self._car_on or self._predicted:
            return False
        self.counter.add_layers(ids)
        return True

    def _record(self, layer: int, exact: Routing, first: int, sequences: list[int] | None, predicted) -> None:
        """The trace's record of rows from token `first` on."""
        top_scores = np.take_along_axis(exact.probs, exact.ids, axis=-1)
        now = self.cache.now
        self.trace.write(first, layer, exact.ids, top_scores, exact.probs, predicted, sequences,
                         now if now != first else None)  # fmt: skip

    def substitute(self, layer: int, exact: Routing, rows: Rows = None) -> tuple[np.ndarray, np.ndarray]:
        """The ids and weights to compute for the rows `rows` (all where None): the router's, or with CAR on,
        cached experts in place of uncached ones where the scores allow (what the step then reads)."""
        if rows is not None:
            exact = _rows_of(exact, rows)
        if not self._car_on:
            return exact.ids, exact.weights
        first = self._first_token + ((rows if isinstance(rows, slice) else rows[0]).start if rows is not None else 0)
        cached = self.cache.cached_mask(layer, "device") | self.cache.cached_mask(layer, "host")
        result = cache_aware_route(
            exact.ids, exact.weights, exact.probs, cached, self.options.car,
            layer=layer, n_layer=self.n_layer, first_token=first,
        )  # fmt: skip
        self.car_stats.record(layer, result)
        if result.substitutions:
            self._request_backfill(layer, exact, result.substitutions)
        return result.ids, result.weights

    def _sequences_of(self, rows: Rows) -> list[int] | None:
        """The sequence of each of the step's rows `rows` (None: all of them; None back: one sequence)."""
        if rows is None or self._sequences is None:
            return self._sequences
        return self._sequences[rows] if isinstance(rows, slice) else [q for run in rows for q in self._sequences[run]]

    def _request_backfill(self, layer: int, exact: Routing, pairs: list[tuple[int, int]]) -> None:
        score = exact.probs.max(axis=0)  # an original's priority: its best probability in the batch
        for original, _ in pairs:
            key = (layer, int(original))
            if self._backfill_thread is not None:
                self._backfill_thread.request(key, float(score[original]), self.tokens_seen)
            elif self._backfill_queue is not None:
                self._backfill_queue.add(key, float(score[original]), self.tokens_seen)

    def predict(self, layer: int, ids: np.ndarray) -> None:
        """Note the experts predicted for `layer` (ids [T, k], each row most confident first); those no tier
        holds are read ahead from the next `acquire` on, right after that step's own reads are issued, a
        few at a time (a guess costs bandwidth if wrong, never correctness; fomoepy.experts.read_ahead)."""
        if not 0 <= layer < self.n_layer:
            return
        # every row's first choice, then every row's second, ...: the likeliest guesses are read first
        ranked = list(dict.fromkeys(np.asarray(ids).T.ravel().tolist()))
        self._predicted[layer] = ranked
        if self.read_ahead is not None:
            self._to_prefetch = (layer, ranked)

    def _prefetching(self) -> bool:
        """Whether predictions are read ahead: asked for, and a source that reads in the background. Without a
        host tier to keep them (the cpu backend's one tier is its device tier), the reads that the step
        then chooses are handed to it, the others dropped: the read overlaps the layer before either way."""
        return self.options.prefetch and getattr(self.source, "submit", None) is not None

    def wants_prediction(self) -> bool:
        """Whether this pass's steps may predict the next layer (where their owner predicts at all): not
        while the gate has turned reading ahead off, but on the tokens it samples and for a trace (which
        records the prediction's accuracy)."""
        return self.gate is None or self.gate.predicting or self.trace is not None

    def _issue_prefetch(self) -> None:
        if self._to_prefetch is None or self.read_ahead is None:
            return
        layer, ranked = self._to_prefetch
        self._to_prefetch = None
        guesses = self.cache.uncached(layer, ranked)
        if self.gate is not None:
            self._guessed[layer] = guesses  # scored when that layer's step knows its reads
            if not self.gate.reading:
                return
        self.read_ahead.queue(layer, guesses)

    def acquire(self, layer: int, ids: np.ndarray) -> tuple[Plan, dict[int, ExpertBytes]]:
        """Plan and commit this step; the store-form bytes of every expert not already in the device tier.

        Waits only for what this step needs: its own reads, some of them made ahead during the layer before
        (the cache counts those as the disk reads they are, so runs stay repeatable). Reads ahead for the
        next layer are issued after this step's and go on while it computes."""
        plan, fetched, reads = self.start_acquire(layer, ids)
        return plan, self.finish_acquire(plan, fetched, reads)

    def start_acquire(self, layer: int, ids: np.ndarray, rows: Rows = None,
                      beside: Callable[[dict[int, ExpertBytes], dict[int, InFlight | None]], None] | None = None) -> tuple[Plan, dict[int, ExpertBytes], dict[int, InFlight | None]]:  # fmt: skip
        """acquire's first half: the plan, the bytes at hand (host hits, prefetches handed over) and the
        reads in flight, so a backend can compute the experts at hand while the others are read. The
        caller must then call finish_acquire, before anything else of this streamer's. rows: the step's
        rows `ids` are (choose's), where not all of them: a slice, or several (a list, in order).

        The step's reads go out first, before its plan: they are the experts neither tier holds, which the
        tiers' state already says (the plan's disk items are exactly those), so the drives' latency starts
        before the plan's eviction walks and the commit, which then run while the reads are in flight. So
        does `beside(fetched, reads)`, when given, with the bytes at hand so far (reads made ahead that
        landed; the host tier's are in `host_slots`) and the reads in flight: work of the step's that its
        reads do not wait for (MoEStep's first launch of the experts the device holds and copies up of those
        at hand, its record of the routing and the next layer's prediction), made before the plan is taken
        (with plans_beside, while the compiled cache makes it on its own thread)."""
        if self._backfill_thread is not None:
            if not self.backfills_device:  # (into the device tier only where the step installs them: collect_backfill)
                self.collect_backfill()
            self._backfill_thread.set_io_busy(True, self.tokens_seen)
        experts = sorted(set(np.asarray(ids).ravel().tolist()))
        valid = not experts or (experts[0] >= 0 and experts[-1] < self.cache.n_expert)
        # (invalid ids: nothing is read; the plan below says what is wrong)
        reads: dict[int, InFlight | None] = dict.fromkeys(self.cache.uncached(layer, experts)) if valid else {}
        fetched: dict[int, ExpertBytes] = {}
        if self.gate is not None:
            guessed = self._guessed.pop(layer, None)
            if guessed is not None:  # the guesses this step reads from disk were right (read ahead or not)
                self.gate.score(len(guessed), len(reads.keys() & guessed))  # (guesses are distinct)
        if self.read_ahead is not None and valid:  # those read ahead are handed over; the other guesses are dropped
            for e, f in self.read_ahead.take(layer, reads).items():
                if f.done() and f.exception() is None:  # landed: its bytes are at hand, as a host hit's are
                    fetched[e] = f.result()
                    del reads[e]
                else:
                    reads[e] = f
        submit = getattr(self.source, "submit", None)
        if reads and submit is not None:  # issue every read before waiting on any
            if self._read_buffer is not None:  # (each into a buffer of its own)
                buffer = self._read_buffer[layer]
                reads = {e: f if f is not None else submit(layer, e, buffer()) for e, f in reads.items()}
            else:
                reads = {e: f if f is not None else submit(layer, e) for e, f in reads.items()}
        self.reads_issued_at = time.perf_counter()  # (MoEStep's record of the host time before it)
        # the plan (plans_beside: begun now, made beside `beside`; nothing there changes the cache)
        sequences = self._sequences if rows is None else self._sequences_of(rows)
        planned = self.cache.plan_soon(layer, ids, sequences) if self.plans_beside else None
        if beside is not None:
            beside(fetched, reads)
        # the next layer's guesses (predicted in `beside`) go to the drives next, behind this step's reads in
        # the pool: a drive with no read of this step's starts on them now, not after the plan below
        self._issue_prefetch()
        plan = planned() if planned is not None else self.cache.plan(layer, ids, sequences)
        disk, host = [], []
        for item in plan.items:  # (one pass over the plan: its disk items, its host hits)
            source = item.source
            if source is Source.DISK:
                disk.append(item.expert)
            elif source is Source.HOST:
                host.append(item.expert)
        if disk != sorted([*reads, *fetched]):  # (fetched: so far, the reads made ahead that landed)
            raise RuntimeError(f"layer {layer}: the plan reads {disk}, but {sorted([*reads, *fetched])} were read")
        host_slots = self.host_slots
        for e in host:
            fetched[e] = host_slots[(layer, e)]
        # the plan committed once its reads are on their way (the drives' latency is the longer wait): nothing
        # above reads the tiers' state the commit changes, and a host hit's bytes are taken before its evictions
        # (plans_beside: applied while the step goes on; finish_acquire's mark_ready waits for it)
        if self.plans_beside:
            self.cache.commit_soon(plan)
        else:
            self.cache.commit(plan)
        for victim in plan.host_evictions:
            self.host_slots.pop(victim, None)
        # the copies down of the demoted experts: after the reads are issued (a drive's latency is the
        # longer wait), before the backend frees the evicted device slots
        for key in plan.demotions:
            self.host_slots[key] = self._download(key)  # type: ignore[misc]
        return plan, fetched, reads

    def at_hand(self, layer: int, ids: np.ndarray, fetched: dict[int, ExpertBytes], reads: dict) -> dict[int, ExpertBytes]:
        """The bytes of a step's experts that are here before its plan (start_acquire's `beside`): the reads
        made ahead that landed (`fetched`) and the host tier's (as its plan will call them), not those
        still being read (`reads`). Any the device tier holds too are among them: the device skips those."""
        at_hand, host = dict(fetched), self.host_slots
        for e in np.asarray(ids).ravel().tolist():
            if e not in reads and e not in at_hand and (layer, e) in host:
                at_hand[e] = host[(layer, e)]
        return at_hand

    def _set_source(self, source: ExpertSourceLike) -> None:
        """The source, replaced (a test's wrapper of the store): the reads made ahead go to it from now on."""
        self._source = source
        ahead = getattr(self, "read_ahead", None)  # (None while __init__ sets the first)
        if ahead is not None:
            ahead.submit = self._read_ahead_submit()

    # what the experts are read from (a store, the GGUF); read through a C getter, no frame (a step asks often)
    source = property(operator.attrgetter("_source"), _set_source)

    def _read_ahead_submit(self) -> Callable[[int, int, Any], InFlight]:
        """What a read made ahead is issued by: with read buffers, the source's own submit (every read has its
        buffer, as the step's own reads do); else _submit_into, which leaves out the buffer it does not have."""
        return self._source.submit if self._read_buffer is not None else self._submit_into  # type: ignore[attr-defined]

    def _submit_into(self, layer: int, expert: int, out: np.ndarray | None) -> InFlight:
        if out is not None:
            return self.source.submit(layer, expert, out=out)  # type: ignore[attr-defined]
        return self.source.submit(layer, expert)  # type: ignore[attr-defined]

    def finish_acquire(self, plan: Plan, fetched: dict[int, ExpertBytes], reads: dict[int, InFlight | None]) -> dict[int, ExpertBytes]:
        """acquire's second half: wait for this step's reads; `fetched` then holds every expert's bytes."""
        layer = plan.layer
        if reads:
            for e, f in reads.items():
                fetched[e] = f.result() if f is not None else self.source.read(layer, e)
        for item in plan.items:
            if item.to_host:
                self.host_slots[(layer, item.expert)] = fetched[item.expert]
        if self.plans_beside:  # the admissions are made ready with the plan's release (settle_soon): nothing between asks
            self._landed_plan = plan
        else:
            self.cache.mark_ready(plan)
        if self._backfill_thread is not None:
            self._backfill_thread.set_io_busy(False, self.tokens_seen)
        return fetched

    def abort(self, plan: Plan) -> list[Key]:
        """After release, for a step whose reads did not all land: its admissions still loading are
        dropped from the tiers; returns the device-tier keys dropped."""
        return self.cache.abort(plan)

    def release(self, plan: Plan) -> None:
        if self._landed_plan is plan:  # (plans_beside: its reads landed) made ready and released on the core's thread
            self._landed_plan = None
            self.cache.settle_soon(plan)
        else:
            self.cache.release(plan)
        # A source that maps its file (the GGUF, no store), when the user bounded memory, unmaps what
        # computing from an expert made resident: a fault maps up to a 2 MiB folio around the bytes it
        # needs, so the touched pages, not the host tier's budget, would otherwise bound the memory
        # experts take. Its host tier then names what the page cache should hold.
        if getattr(self.source, "unmap_after_use", False):
            self.source.drop(plan.layer, [item.expert for item in plan.items if item.source is not Source.DEVICE])

    # -- background results -----------------------------------------------------------------------
    def collect_backfill(self) -> None:
        """Give the experts the backfill thread has read since the last step slots in a tier (backfills_device:
        the device tier's, which the caller then installs: take_device_changes)."""
        if self._backfill_thread is None:
            return
        backfilled = {}
        while not self._backfill_thread.done.empty():
            key, result = self._backfill_thread.done.get()
            if isinstance(result, BaseException):
                raise result
            backfilled[key] = result
        self.backfilled += len(self._admit_backfilled(backfilled))

    def _admit_backfilled(self, read: dict[Key, ExpertBytes]) -> set[Key]:
        """Gives experts read outside a plan slots where the policy admits them, in the host tier (or where
        backfills_device, the device tier); returns those admitted."""
        if not read:
            return set()
        if self.backfills_device:
            admitted, evicted = self.cache.admit_device(list(read))
            self._device_changes += [(victim, None) for victim in evicted]
            self._device_changes += [(key, read[key]) for key in admitted]
            return set(admitted)
        admitted, evicted = self.cache.admit_host(list(read))
        for victim in evicted:
            self.host_slots.pop(victim, None)
        for key in admitted:
            self.host_slots[key] = read[key]
        return set(admitted)

    def take_device_changes(self) -> list[tuple[Key, ExpertBytes | None]]:
        """The device tier's changes backfill made since the last call, in order: (key, its store bytes) to
        install, (key, None) to evict. The step applies them before its next plan, which takes them for done."""
        changes, self._device_changes = self._device_changes, []
        return changes

    # -- reporting and lifetime --------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"cache": self.cache.stats.summary(), "tokens": self.tokens_seen}
        if self.options.car.enabled:
            out["car"] = {"substitution_rate": self.car_stats.rate, "line": self.car_stats.line()}
            out["backfilled"] = self.backfilled
        p = self.prefetch_stats
        a = self.read_ahead.counts if self.read_ahead is not None else ReadAheadCounts()
        out["prefetch"] = {"predicted": p.predicted, "accuracy": p.accuracy, "issued": a.issued, "used": a.used, "landed": a.landed,
                           "wasted": a.wasted, "in_the_way": a.in_the_way, "skipped": a.skipped}  # fmt: skip
        if self.gate is not None:  # reading ahead now, the last window's share of guesses right, times turned
            g = self.gate
            out["prefetch"].update(reading=g.reading, right_share=g.share, turned=g.turned, guessed=g.guessed, guessed_right=g.right)
        return out

    def lines(self) -> list[str]:
        lines = [self.cache.stats.line()]
        if self.seeded is not None:  # (the profile's header names no model: say what it did)
            lines.append(f"profile {self.options.freq_profile}: seeded {self.seeded[0]} experts into the device tier, "
                         f"{self.seeded[1]} into the host tier")  # fmt: skip
        if self.options.car.enabled:
            lines.append(self.car_stats.line() + f"; backfilled {self.backfilled}")
        p = self.prefetch_stats
        if p.predicted:
            line = f"prefetch: next-layer prediction accuracy {p.accuracy:.1%}"
            if self.read_ahead is not None:
                a = self.read_ahead.counts
                line += (f"; read ahead {a.issued} ({a.used} used by their step, {a.landed} of them landed before it asked; {a.wasted} wrong), "
                         f"{a.skipped} guesses dropped unread")
            lines.append(line)
        g = self.gate
        if g is not None and g.guessed:  # why reading ahead is on or off now
            lines.append(f"reading ahead {'on' if g.reading else 'off'}: {g.right / g.guessed:.0%} of {g.guessed} guesses no tier "
                         f"held were right, it pays above {g.pays_above:.0%}")  # fmt: skip
        return lines

    def close(self) -> None:
        if self._backfill_thread is not None:
            self._backfill_thread.close()
        if self.read_ahead is not None:
            self.read_ahead.close()
        if self.trace is not None:
            self.trace.close()
            self.trace = None


# start_acquire's definition, kept by name; where setup.py built it, start_acquire is fomoepy/experts/_acquire.c's:
# the same statements in C for a step of all its rows with no backfill thread (every decode step), this
# method for any other call
ExpertStreamer.py_start_acquire = ExpertStreamer.start_acquire
if _acquire is not None:
    ExpertStreamer.start_acquire = _acquire.install(ExpertStreamer, ExpertStreamer.py_start_acquire, Source.DISK, Source.HOST)
