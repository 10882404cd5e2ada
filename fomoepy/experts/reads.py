"""Reads in flight, and the reader threads that make them: what a MoE step waits on, at a fraction of
what concurrent.futures costs the inference thread.

A decode step issues a few reads and guesses per layer and asks each several times whether it landed.
A concurrent.futures.Future takes its condition's lock at every such ask (two Python calls and two of the
lock's), and ThreadPoolExecutor.submit makes a work item and a future with a condition and a lock of its
own, takes the executor's lock and a semaphore: at the 397B shape's host-time bench (bench/host_time.py)
the futures were about a quarter of the Python calls of a step.

A Read is one small object: whether it landed, its value or its error are plain attributes, set once,
under one lock shared by every read (it is held for a few attribute stores); asking `done()` takes no
lock. It has the methods of a Future the engine uses (done, result, exception, add_done_callback), so
the code that waits for reads takes either (a test's stub source may hand back Futures). Where setup.py
built it, a Read's state and asks are C's (fomoepy/experts/_reads.c: a step makes some twenty-five of them,
each a Python frame here); PyRead below is the definition, and serves where it is not built.

A ReadPool is `threads` reader threads taking jobs from one queue (queue.SimpleQueue: put and get are C
calls), started at its first job. Closing it lets the jobs queued so far finish, then stops the threads,
as ThreadPoolExecutor.shutdown(wait=True) does; a job submitted after that is refused with the
RuntimeError an executor raises.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

try:  # optional (setup.py)
    from fomoepy.experts import _reads
except ImportError:
    _reads = None

log = logging.getLogger(__name__)

_settled = threading.Lock()  # held while a read is settled or a callback is added to one


class PyRead:
    __slots__ = ("_callbacks", "_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Read], Any]] | None = None

    @classmethod
    def landed(cls, value: Any) -> Read:
        """A read that completed as it was made (nothing waits on it yet: no lock)."""
        read = cls()
        read._value, read._done = value, True
        return read

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._wait(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Read], Any]) -> None:
        """fn(read) once it has landed: at once, on this thread, if it has; else on the thread that
        settles it."""
        with _settled:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        with _settled:
            if self._done:
                raise InvalidStateError("this read has landed already")
            self._value, self._error = value, error
            self._done = True  # (last: a thread that sees it done sees the value)
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # as a Future does: one callback's failure neither stops the others nor the reader
                log.exception("a callback of a read raised")

    def _wait(self, timeout: float | None) -> None:
        _wait_for(self, timeout)


def _wait_for(read, timeout: float | None) -> None:
    """Block until `read` lands (its callback, on the thread that lands it, wakes this one)."""
    arrived: queue.SimpleQueue = queue.SimpleQueue()
    read.add_done_callback(arrived.put)
    try:
        arrived.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"a read did not land within {timeout} s") from None


if _reads is not None:

    class Read(_reads.Read):
        """PyRead's semantics, its state and asks in C (fomoepy/experts/_reads.c); waiting is _wait_for's."""

        __slots__ = ()

        def _wait(self, timeout: float | None) -> None:
            _wait_for(self, timeout)

    _reads.set_callback_failed(lambda error: log.error("a callback of a read raised", exc_info=error))
else:
    Read = PyRead  # type: ignore[misc,assignment]


def as_landed(reads: Iterable[InFlight]) -> Iterator[InFlight]:
    """Each read as it lands, in the order they land (concurrent.futures.as_completed, for Reads and
    Futures alike): those landed already first; each other puts itself on a queue as it lands (its
    callback, on the thread that lands it)."""
    pending = []
    for read in reads:
        if read.done():
            yield read
        else:
            pending.append(read)
    if not pending:
        return
    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    for read in pending:
        read.add_done_callback(arrivals.put)
    for _ in pending:
        yield arrivals.get()


# what a source's submit hands back: a Read (the stores here), or a Future (a source of a test's)
InFlight = Read | Future


class ReadPool:
    def __init__(self, threads: int, name: str = "fomoe-read"):
        if threads < 1:
            raise ValueError(f"a read pool needs at least one thread, got {threads}")
        self.n_threads = threads
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # starting and closing
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Read:
        """fn(*args) on a reader thread; its value or its exception become the Read's."""
        if self._closed:
            raise RuntimeError("cannot schedule new reads after the pool was closed")
        if not self._threads:
            self._start()
        read = Read()
        self._jobs.put((read, fn, args))
        return read

    def close(self) -> None:
        """Let the jobs queued so far finish, then stop the threads (waits for both)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = self._threads
        for _ in threads:
            self._jobs.put(None)  # behind every job queued: each thread stops at one
        for t in threads:
            t.join()

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for i in range(self.n_threads):
                # daemons: a pool nobody closed does not keep the interpreter from exiting
                t = threading.Thread(target=self._work, name=f"{self.name}_{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            read, fn, args = job
            value = None
            try:
                value = fn(*args)
            except BaseException as e:  # the reader goes on; whoever waits for the read gets the error
                read.set_exception(e)
            else:
                read.set_result(value)
            job = read = fn = args = value = None  # (no buffer of this job is held while the thread waits)
