"""The inference worker: one thread owns the engine; generation jobs take turns, round-robin across clients.

Scheduling lives on the event loop (plain deques, no locks); the inference thread only runs one engine
step at a time (`Job.step`: the prefill with the first token, then one token). Turns: each client
(sink) has its own first-come-first-served queue, and the clients take turns, one request each, so one
connection's pipeline of long requests delays another client's request by at most the one running
when it arrived. Every queued job is told its place (`queued` messages) as the queue moves.

Between steps the loop checks the running job:

- cancelled (a `cancel` request, a client that went away, shutdown): it ends with `done`/`cancelled`;
- its client is not reading (the connection's write buffer is over its limit): the job is *paused*:
  set aside with its state, and the engine moves on to the next job. When the client has drained its
  buffer the job goes back to the end of its client's queue; a job paused longer than `pause_timeout`
  is cancelled. So a slow reader never blocks the engine, and its buffer grows by at most one frame.

The engine's statistics are read on the loop thread, never queued behind engine work: directly while no
step is in flight, else the copy taken after the last step (refreshed at most every SNAPSHOT_EVERY s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fomoepy.errors import FomoeError
from fomoepy.serve.jobs import Job, JobState, Sessions, Sink

log = logging.getLogger("fomoe.serve")


@dataclasses.dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0  # evaluated by prefill (cached tokens not counted)
    prefill_s: float = 0.0
    completion_tokens: int = 0
    decode_tokens: int = 0  # tokens of decode steps (the first token of a request comes with its prefill)
    decode_s: float = 0.0


SNAPSHOT_EVERY = 0.25  # seconds between copies of the engine's statistics while it runs


class FairQueue:
    """Ready jobs: one FIFO per sink; the next job is the head of the sink served longest ago (a sink
    never served first; ties by arrival). So clients take turns one request each: a connection that
    pipelines many requests and one that sends one at a time alternate, and a newcomer goes next.
    """

    def __init__(self) -> None:
        self._queues: dict[Sink, deque[tuple[int, Job]]] = {}
        self._last_turn: weakref.WeakKeyDictionary[Sink, int] = weakref.WeakKeyDictionary()
        self._arrivals = itertools.count()
        self._turn = 0  # turns given so far

    def push(self, job: Job) -> None:
        self._queues.setdefault(job.sink, deque()).append((next(self._arrivals), job))

    def pop(self) -> Job:
        sink = self._next(self._queues, self._last_turn)
        queue = self._queues[sink]
        _, job = queue.popleft()
        if not queue:
            del self._queues[sink]
        self._last_turn[sink] = self._turn
        self._turn += 1
        return job

    def remove(self, job: Job) -> None:
        queue = self._queues[job.sink]
        queue.remove(next(item for item in queue if item[1] is job))
        if not queue:
            del self._queues[job.sink]

    @staticmethod
    def _next(queues: dict[Sink, deque[tuple[int, Job]]], last_turn: Any) -> Sink:
        return min(queues, key=lambda s: (last_turn.get(s, -1), queues[s][0][0]))

    def order(self) -> list[Job]:
        """Every job, in the order they would start if nothing else arrived."""
        queues = {s: deque(q) for s, q in self._queues.items()}
        last = dict(self._last_turn.items())
        out: list[Job] = []
        turn = self._turn
        while queues:
            sink = self._next(queues, last)
            out.append(queues[sink].popleft()[1])
            if not queues[sink]:
                del queues[sink]
            last[sink] = turn
            turn += 1
        return out

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        return iter(self.order())


class InferenceWorker:
    def __init__(self, engine, *, max_sessions: int = 8, pause_timeout: float = 60.0):
        self.engine = engine
        self.sessions = Sessions(max_sessions)
        self.pause_timeout = pause_timeout
        self.totals = Totals()
        self.running: Job | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fomoe-engine")
        self._ready = FairQueue()
        self._stepping = False  # an engine step is in flight on the inference thread
        self._snapshot: Any = None
        self._snapshot_t = 0.0
        self._paused: dict[Job, asyncio.TimerHandle] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    # -- queries -----------------------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._ready)

    @property
    def paused_count(self) -> int:
        return len(self._paused)

    @property
    def backlog(self) -> int:
        """Jobs waiting for the engine: queued, paused and running."""
        return len(self._ready) + len(self._paused) + (self.running is not None)

    # -- commands (loop thread) --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fomoe-worker")

    def submit(self, job: Job) -> None:
        job.state = JobState.QUEUED
        self._ready.push(job)
        self.totals.requests += 1
        self._tell_positions()
        self._wake.set()

    def cancel(self, job: Job) -> bool:
        """Cancel a job at its next token (running) or now (queued, paused); False if already done."""
        if job.state is JobState.DONE:
            return False
        if job is self.running or job.state is JobState.PREPARING:  # preparing: its owner ends it
            job.cancel_requested = True
        elif job.state is JobState.PAUSED:
            self._paused.pop(job).cancel()
            job.finish("cancelled", self.sessions)
        else:
            self._ready.remove(job)
            job.finish("cancelled", self.sessions)
            self._tell_positions()
        return True

    def resume(self, sink: Sink) -> None:
        """The sink's client reads again: its paused jobs go back to the end of the queue."""
        for job in [j for j in self._paused if j.sink is sink]:
            self._paused.pop(job).cancel()
            job.state = JobState.QUEUED
            self._ready.push(job)
        self._tell_positions()
        self._wake.set()

    async def stop(self) -> None:
        """Cancel every job (each gets its final message) and wait for the running one to end."""
        self._stopping = True
        for job in [*self._ready, *self._paused]:
            self.cancel(job)
        if self.running is not None:
            self.running.cancel_requested = True
        self._wake.set()
        if self._task is not None:
            await self._task

    def close(self) -> None:
        """Release the engine thread and the kept states (after stop)."""
        self._thread.shutdown(wait=True)
        self.sessions.clear()

    def engine_stats(self) -> tuple[Any, list[str], float]:
        """(the engine's statistics as plain data, its summary lines, their age in seconds), without
        waiting for the engine."""
        if not self._stepping or self._snapshot_t == 0.0:
            self._take_snapshot()
        stats, lines = self._snapshot
        return stats, lines, time.monotonic() - self._snapshot_t

    def _take_snapshot(self) -> None:
        stats = getattr(self.engine, "stats", None)
        lines = getattr(self.engine, "stats_lines", None)
        self._snapshot = (plain(stats() if callable(stats) else stats), [str(x) for x in lines()] if callable(lines) else [])
        self._snapshot_t = time.monotonic()

    def _tell_positions(self) -> None:
        for position, job in enumerate(self._ready.order()):
            job.tell_position(position)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            while not self._ready:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
            job = self._ready.pop()
            self.running = job
            self._tell_positions()
            try:
                await self._drive(job)
            finally:
                self.running = None

    async def _drive(self, job: Job) -> None:
        """Run the job until it ends or pauses."""
        try:
            reason = await self._steps(job)
            if reason is not None:
                job.finish(reason, self.sessions)
        except FomoeError as e:
            job.fail("bad_request", str(e))
        except Exception as e:  # a bug in a step must end this request, not the daemon
            log.exception("request %r failed", job.id)
            job.fail("internal", f"internal error: {type(e).__name__}: {e}")

    async def _steps(self, job: Job) -> str | None:
        """Engine steps until a finish reason, or None when the job was paused."""
        loop = asyncio.get_running_loop()
        if job.t_start is None:
            job.begin(self.engine, self.sessions)
        job.state = JobState.RUNNING
        while True:
            if job.cancel_requested:
                return "cancelled"
            if job.sink.write_paused and not self._stopping:
                self._park(job)
                return None
            prefill = job.t_first is None
            t0 = time.perf_counter()
            self._stepping = True
            try:
                token = await loop.run_in_executor(self._thread, job.step)
            finally:
                self._stepping = False
            if time.monotonic() - self._snapshot_t >= SNAPSHOT_EVERY:
                self._take_snapshot()
            self._account(job, prefill, time.perf_counter() - t0, token is not None)
            if token is None:
                return "length"  # max_tokens reached or the context is full
            reason = job.accept(token)
            if reason is not None:
                return reason

    def _account(self, job: Job, prefill: bool, seconds: float, produced: bool) -> None:
        t = self.totals
        if prefill:
            t.prompt_tokens += len(job.prompt) - job.cached
            t.prefill_s += seconds
        else:
            t.decode_s += seconds
            t.decode_tokens += produced
        t.completion_tokens += produced

    def _park(self, job: Job) -> None:
        job.state = JobState.PAUSED
        loop = asyncio.get_running_loop()
        self._paused[job] = loop.call_later(self.pause_timeout, self._pause_expired, job)
        log.info("request %r paused: its client is not reading", job.id)

    def _pause_expired(self, job: Job) -> None:
        if job in self._paused:
            log.info("request %r cancelled: its client read nothing for %.0f s", job.id, self.pause_timeout)
            self.cancel(job)


def plain(value: Any, depth: int = 0) -> Any:
    """Data for msgpack: dataclasses and mappings become maps, sequences lists, other objects repr()."""
    if depth > 16:
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v, depth + 1) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return plain(value.item(), depth + 1)
    return repr(value)
