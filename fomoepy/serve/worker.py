"""The inference worker: one thread owns the engine; the loop forms a batch of generations every step.

Scheduling lives on the event loop (plain deques, no locks); the inference thread runs one engine step
at a time. A step is one decode step for every job of the batch that is decoding (one token each, in
one batched forward pass: fomoepy.engine.Engine.decode) and prompt chunks of jobs still in their prompt,
at most `prefill_chunk` prompt tokens in all: the chunk of the job whose turn it is (they take turns),
and, where the engine evaluates several prompts in one pass (Engine.prefill_many: the experts they pick
read once for all of them), the whole next chunks of the next jobs in turn while they fit. So prompts
that arrive together share their reads, and while newcomers' prompts are evaluated a running stream's
gap between two of its tokens is bounded by one decode step plus `prefill_chunk` prompt tokens, however
long the prompts.

Joining and leaving happen between steps (at a token boundary). Jobs join from the ready queue while
the batch has fewer than `max_batch` jobs and the KV budget (fomoepy.serve.kv_budget) has room for
their worst case. Turns: each client (sink) has its own first-come-first-served queue, and the
clients take turns, one request each, so one connection's pipeline of long requests waits behind
another's one request, and a full batch keeps newcomers queued in that fair order, each told its place
(`queued` messages) as the queue moves. A job leaves the batch when it ends, or when:

- it is cancelled (a `cancel` request, a client that went away, shutdown): it ends with `done`/`cancelled`;
- its client is not reading (the connection's write buffer is over its limit): the job is *paused*:
  set aside with its state, and the batch goes on without it. When the client has drained its
  buffer the job goes back to the end of its client's queue; a job paused longer than `pause_timeout`
  is cancelled. So a slow reader never blocks the engine, and its buffer grows by at most one frame;
- the batch is full, the head of the queue is a client's that holds two places fewer than another
  client: that client's latest admitted job *gives its place up*, queued again first of its client's
  queue with its state, and goes on where it stopped when it runs again. So clients share the batch's
  places as they share the queue's turns, and a newcomer waits one step, not a whole generation.

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
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fomoepy.errors import FomoeError
from fomoepy.serve.jobs import Job, JobState, Sessions, Sink
from fomoepy.serve.kv_budget import KVBudget

log = logging.getLogger("fomoe.serve")


@dataclasses.dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0  # evaluated by prefill (cached tokens not counted)
    prefill_s: float = 0.0
    completion_tokens: int = 0
    decode_tokens: int = 0  # tokens of decode steps (the first token of a request comes with its prefill)
    decode_s: float = 0.0
    preempted: int = 0  # paused or queued requests that gave their KV cache up to a waiting one (rebuilt when they ran again)
    yielded: int = 0  # running requests that gave their place in a full batch to another client's (and went on later)


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

    def push_front(self, job: Job) -> None:
        """A job that gave its place in the batch up: first of its client's queue again (it came before them)."""
        queue = self._queues.setdefault(job.sink, deque())
        queue.appendleft((queue[0][0] - 1 if queue else next(self._arrivals), job))

    def pop(self) -> Job:
        job = self._queues[self._next(self._queues, self._last_turn)][0][1]
        self.take(job)
        return job

    def take(self, job: Job) -> None:
        """`job`, chosen as the head, leaves the queue on its client's turn (after a place was given up, the
        head of the fair order may be the job that gave it: `job` is still the one admitted)."""
        self.remove(job)
        self._last_turn[job.sink] = self._turn
        self._turn += 1

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

    def jobs(self) -> list[Job]:
        """Every job, in no particular order (order() gives the fair one)."""
        return [job for queue in self._queues.values() for _, job in queue]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        return iter(self.order())


class InferenceWorker:
    def __init__(self, engine, *, max_sessions: int = 8, pause_timeout: float = 60.0, max_batch: int = 8,
                 kv_budget: int | None = None):  # fmt: skip
        """max_batch: jobs in one step (1 on a backend that cannot batch); kv_budget: bytes of KV cache
        the batch may reserve (None: default_kv_budget)."""
        self.engine = engine
        self.sessions = Sessions(max_sessions)
        self.pause_timeout = pause_timeout
        self.max_batch = max_batch if getattr(engine, "batches", False) else 1
        if max_batch < 1:
            raise FomoeError(f"max_batch must be >= 1, got {max_batch}")
        if self.max_batch < max_batch:
            log.info("this backend decodes one sequence per step: --max-batch %d runs as 1", max_batch)
        if kv_budget is not None and kv_budget < engine.kv_nbytes(1):
            raise FomoeError(f"--kv-budget {kv_budget} bytes is less than the smallest state, {engine.kv_nbytes(1)} bytes "
                             "(one KV chunk): no request could ever run")  # fmt: skip
        self.kv = KVBudget(kv_budget if kv_budget is not None else default_kv_budget(engine, max_batch),
                           engine.kv_nbytes, engine.n_ctx)  # fmt: skip
        self.totals = Totals()
        self.batch: list[Job] = []  # admitted: in their prompt or decoding, in admission order
        self.observe: Any = None  # called on the loop after each step with ([(job, its prompt tokens) evaluated], decoded jobs)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fomoe-engine")
        self._ready = FairQueue()
        self._prefill_turn = 0  # which job in its prompt gets the next chunk
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
    def running(self) -> int:
        """Jobs in the batch."""
        return len(self.batch)

    @property
    def backlog(self) -> int:
        """Jobs waiting for the engine: queued, paused and running."""
        return len(self._ready) + len(self._paused) + len(self.batch)

    # -- commands (loop thread) --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fomoe-worker")

    def submit(self, job: Job) -> None:
        self.totals.requests += 1
        refusal = self.kv.refusal(len(job.prompt), job.request.max_tokens)
        if refusal is not None:
            job.fail("bad_request", f"generate: {refusal}")
            return
        job.state = JobState.QUEUED
        self._ready.push(job)
        self._tell_positions()
        self._wake.set()

    def cancel(self, job: Job) -> bool:
        """Cancel a job at its next token (in the batch) or now (queued, paused); False if already done."""
        if job.state is JobState.DONE:
            return False
        if job in self.batch or job.state is JobState.PREPARING:  # preparing: its owner ends it
            job.cancel_requested = True
            self._wake.set()
        elif job.state is JobState.PAUSED:
            self._paused.pop(job).cancel()
            self._end(job, "cancelled")
        else:
            self._ready.remove(job)
            self._end(job, "cancelled")
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
        """Cancel every job (each gets its final message) and wait for the batch's to end."""
        self._stopping = True
        for job in [*self._ready, *self._paused]:
            self.cancel(job)
        for job in self.batch:
            job.cancel_requested = True
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
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            admitted = self._admit()
            self._leave_between_steps()
            if not self.batch:
                if admitted:
                    continue  # they left at once (cancelled, paused): others may join now
                if self._stopping and not self._ready:
                    return
                await self._wake.wait()  # a job queued or resumed, or memory released
                continue
            prefills = self._next_prefills()
            decoders = [j for j in self.batch if j.decoding]
            self._stepping = True
            try:
                result = await loop.run_in_executor(self._thread, self._engine_step, prefills, decoders)
            finally:
                self._stepping = False
            if time.monotonic() - self._snapshot_t >= SNAPSHOT_EVERY:
                self._take_snapshot()
            self._deliver(prefills, decoders, result)

    def _admit(self) -> bool:
        """Jobs join the batch in fair order while it has room and the KV budget has their worst case;
        whether any did."""
        admitted = False
        while self._ready and not self._stopping:
            job = self._ready.order()[0]
            if len(self.batch) >= self.max_batch and not self._give_place_to(job):
                break
            worst = self.kv.worst_tokens(len(job.prompt), job.request.max_tokens)
            if not self.kv.can_reserve(job, worst) and not self._take_paused_memory(job, worst):
                break  # the head waits for memory; jobs behind it do not overtake it
            self._ready.take(job)  # (not pop(): a place given up puts its job first of its client's queue)
            self.kv.reserve(job, worst)
            try:
                if job.t_start is None:
                    job.begin(self.engine, self.sessions)
                else:
                    job.rejoin(self.engine)
            except FomoeError as e:
                self._fail(job, "bad_request", str(e))
                continue
            job.state = JobState.RUNNING
            self.batch.append(job)
            admitted = True
        if admitted:
            self._tell_positions()
        return admitted

    def _give_place_to(self, job: Job) -> bool:
        """The batch is full and `job` heads the queue. Where another client holds at least two more of the
        batch's places than `job`'s, that client's latest admitted job gives its place up: queued again, first
        of its client's queue, its state kept, so it goes on where it stopped when it runs again. So clients
        share the batch's places, not only the queue's turns: one that pipelines many long requests cannot
        keep another's waiting a whole generation. Only where the budget then has `job`'s worst case, and
        no place frees at this boundary anyway. Whether a place was given."""
        if any(j.cancel_requested or j.sink.write_paused for j in self.batch):
            return False  # a place frees at this boundary: the next one admits into it
        places = Counter(j.sink for j in self.batch)
        sink, most = places.most_common(1)[0]
        if most < places[job.sink] + 2:
            return False
        victim = next(j for j in reversed(self.batch) if j.sink is sink)
        keeps = min(self.kv.held(victim), self._state_nbytes(victim))
        worst = self.kv.worst_tokens(len(job.prompt), job.request.max_tokens)
        if not self.kv.can_reserve(job, worst, freed=self.kv.held(victim) - keeps):
            return False
        self.batch.remove(victim)
        victim.state = JobState.QUEUED
        victim.queue_position = None  # queued again: told its place anew, mid-stream (`queued`)
        self.kv.hold_only(victim, keeps)
        self._ready.push_front(victim)
        self.totals.yielded += 1
        log.info("request %r gives its place in the batch to another client's request; it goes on when it runs again", victim.id)
        return True

    def _take_paused_memory(self, job: Job, worst: int) -> bool:
        """The head of the queue needs KV memory that paused jobs hold (their clients are not reading), or queued
        ones that gave their place up: when giving theirs up lets it in, they give their states up, one by one until it fits
        (each is rebuilt by prefill when its job runs again: Job.rejoin). Whether it fits now. Memory that
        running jobs hold is waited for, as before: they free it as they finish."""
        # (paused jobs in the order they paused, then queued ones that hold a state, having given their place up
        # or been paused, client by client; a queued job that never ran holds nothing)
        queued = [q for q in self._ready.jobs() if q is not job]
        holders = [p for p in (*self._paused, *queued) if p in self.kv and p.gen is not None and p.gen.state is not None]
        held = sum(self.kv.held(p) for p in holders)
        if not held or not self.kv.can_reserve(job, worst, held):
            return False
        for paused in holders:  # (in the order they paused)
            if self.kv.can_reserve(job, worst):
                break
            log.info("request %r gives up its KV cache (%.1f MiB) to a waiting request while %s; it is rebuilt when it runs again",
                     paused.id, self.kv.held(paused) / (1 << 20),
                     "its client is not reading" if paused in self._paused else "it is queued, having given its place up")  # fmt: skip
            paused.give_up_state()
            self.kv.release(paused)
            self.totals.preempted += 1
        return True

    def _leave_between_steps(self) -> None:
        """At the token boundary: cancelled jobs end, jobs whose client does not read are paused."""
        for job in list(self.batch):
            if job.cancel_requested:
                self.batch.remove(job)
                self._end(job, "cancelled")
            elif job.sink.write_paused and not self._stopping:
                self.batch.remove(job)
                self._park(job)

    def _next_prefills(self) -> list[Job]:
        """The jobs in their prompt whose next chunks this step evaluates: the one whose turn it is (round
        robin), then, where the engine evaluates several prompts in one pass, the next ones in turn whose
        whole next chunks fit, `prefill_chunk` prompt tokens in all (a chunk of one token, a decode step's
        path, goes alone)."""
        in_prompt = [j for j in self.batch if not j.decoding]
        if not in_prompt:
            return []
        self._prefill_turn = (self._prefill_turn + 1) % len(in_prompt)
        order = in_prompt[self._prefill_turn :] + in_prompt[: self._prefill_turn]
        chunk = self.engine.prefill_chunk
        sizes = [min(len(j.gen.pending), chunk) for j in order]
        chosen, left = [order[0]], chunk - sizes[0]
        if not self.engine.prefills_jointly or sizes[0] < 2:
            return chosen
        for job, n in zip(order[1:], sizes[1:]):
            if 2 <= n <= left:
                chosen.append(job)
                left -= n
        return chosen

    def _engine_step(self, prefills: list[Job], decoders: list[Job]):
        """On the inference thread: one decode step for `decoders`, then one prompt chunk of each of
        `prefills` (in one pass). Each part's outcome is its own: ([tokens] or an exception, seconds),
        ([token or None for each] or an exception, seconds)."""
        decoded: Any = []
        t0 = time.perf_counter()
        if decoders:
            try:
                decoded = self.engine.decode([j.gen for j in decoders])
            except Exception as e:  # every job of the step fails with it; the others go on
                decoded = e
        t1 = time.perf_counter()
        firsts: Any = []
        if prefills:
            try:
                firsts = self.engine.prefill_many([j.gen for j in prefills])
            except Exception as e:  # every job of the pass fails with it
                firsts = e
        return (decoded, t1 - t0), (firsts, time.perf_counter() - t1)

    def _deliver(self, prefills: list[Job], decoders: list[Job], result) -> None:
        (decoded, decode_s), (firsts, prefill_s) = result
        t = self.totals
        if decoders:
            t.decode_s += decode_s
            if isinstance(decoded, BaseException):
                for job in decoders:
                    self._step_failed(job, decoded)
            else:
                t.decode_tokens += len(decoders)
                t.completion_tokens += len(decoders)
                for job, token in zip(decoders, decoded):
                    self._accept(job, token)
        if prefills:
            t.prefill_s += prefill_s
        chunks = [(j, j.gen.last_chunk) for j in prefills]  # (taken first: a job that fails drops its generation)
        for (prefill, n), first in zip(chunks, firsts if isinstance(firsts, list) else [firsts] * len(prefills)):
            t.prompt_tokens += n
            if isinstance(first, BaseException):
                self._step_failed(prefill, first)
            elif first is not None:
                t.completion_tokens += 1
                self._accept(prefill, first)
            elif prefill.gen.finished:  # max_tokens 0: the prompt evaluated, nothing sampled
                self._leave(prefill, "length")
        if self.observe is not None:
            self.observe(chunks, decoders)

    def _accept(self, job: Job, token: int) -> None:
        reason = job.accept(token)
        if reason is None and job.gen.finished:
            reason = "length"  # max_tokens reached or the context is full
        if reason is not None:
            self._leave(job, reason)

    def _step_failed(self, job: Job, e: BaseException) -> None:
        if job in self.batch:
            self.batch.remove(job)
        if isinstance(e, FomoeError):
            self._fail(job, "bad_request", str(e))
        else:  # a bug in a step must end its requests, not the daemon
            log.error("request %r failed", job.id, exc_info=e)
            self._fail(job, "internal", f"internal error: {type(e).__name__}: {e}")

    def _leave(self, job: Job, reason: str) -> None:
        self.batch.remove(job)
        self._end(job, reason)

    def _end(self, job: Job, reason: str) -> None:
        self.kv.release(job)
        self._wake.set()  # its memory may let the head of the queue in
        job.finish(reason, self.sessions)

    def _fail(self, job: Job, code: str, message: str) -> None:
        self.kv.release(job)
        self._wake.set()
        job.fail(code, message)

    def _park(self, job: Job) -> None:
        job.state = JobState.PAUSED
        if job.gen is not None:
            self.kv.hold_only(job, self._state_nbytes(job))
        loop = asyncio.get_running_loop()
        self._paused[job] = loop.call_later(self.pause_timeout, self._pause_expired, job)
        log.info("request %r paused: its client is not reading", job.id)

    def _state_nbytes(self, job: Job) -> int:
        """What a job's state holds now (its KV caches' chunks): all it keeps while set aside."""
        return self.engine.kv_nbytes(job.gen.state.kv_capacity)

    def _pause_expired(self, job: Job) -> None:
        if job in self._paused:
            log.info("request %r cancelled: its client read nothing for %.0f s", job.id, self.pause_timeout)
            self.cancel(job)


def default_kv_budget(engine, max_batch: int) -> int:
    """max_batch full contexts, within a quarter of the memory available now (the host tier's default
    takes another quarter), or on a GPU within what its device tier left for the states (they live in its
    memory: Engine.device_state_room), but always one full context: what one request could always use."""
    from fomoepy.runtime.available_memory import available_memory_bytes

    full = engine.kv_nbytes(engine.n_ctx)
    room = getattr(engine, "device_state_room", None)
    return max(full, min(max_batch * full, available_memory_bytes() // 4 if room is None else room))


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
