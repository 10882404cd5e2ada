"""Reads in flight and the reader threads (fomoepy.experts.reads): a Read settles once, runs its callbacks
once on the thread that settles it (at once when added after), and hands its value or its error to
whoever waits; a ReadPool runs jobs on at most its threads, lets the queued ones finish at close and
refuses new ones after; as_landed gives reads in the order they land, those landed first. A Read's
tests run on the definition (PyRead) and on the compiled one (fomoepy/experts/_reads.c), where built."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, InvalidStateError

import pytest

from fomoepy.experts import reads
from fomoepy.experts.reads import PyRead, ReadPool, as_landed

# the definition, and the compiled Read where setup.py built it
READS = [PyRead] + ([reads.Read] if reads._reads is not None else [])

WAIT = 10.0  # seconds a test waits for what should happen at once before it fails (never a hang)


def in_thread(fn) -> list:
    """fn() on another thread, joined within WAIT: [its value] or [] if it did not return."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(WAIT)
    return out


@pytest.mark.parametrize("Read", READS, ids=lambda r: r.__name__ if r is PyRead else "compiled")
def test_a_read_settles_once_and_runs_each_callback_once_on_the_settling_thread(Read):
    read = Read()
    seen = []
    read.add_done_callback(lambda r: seen.append(("first", threading.current_thread().name, r.result())))
    assert not read.done()
    t = threading.Thread(target=read.set_result, args=(42,), name="lander")
    t.start()
    t.join(WAIT)
    read.add_done_callback(lambda r: seen.append(("after", threading.current_thread().name, r.result())))
    assert read.done() and read.result() == 42 and read.exception() is None
    assert seen == [("first", "lander", 42), ("after", threading.current_thread().name, 42)]
    with pytest.raises(InvalidStateError):
        read.set_result(1)
    assert Read.landed("x").done() and Read.landed("x").result() == "x"


@pytest.mark.parametrize("Read", READS, ids=lambda r: r.__name__ if r is PyRead else "compiled")
def test_waiting_for_a_read_returns_its_value_or_raises_its_error_when_it_lands(Read):
    read = Read()
    threading.Timer(0.05, read.set_result, args=("bytes",)).start()
    assert in_thread(read.result) == ["bytes"]
    failed = Read()
    threading.Timer(0.05, failed.set_exception, args=(OSError("bad sector"),)).start()
    assert isinstance(in_thread(failed.exception)[0], OSError)
    with pytest.raises(OSError, match="bad sector"):
        failed.result()
    with pytest.raises(TimeoutError):
        Read().result(timeout=0.01)


@pytest.mark.parametrize("Read", READS, ids=lambda r: r.__name__ if r is PyRead else "compiled")
def test_a_callback_that_raises_does_not_stop_the_others(Read):
    read = Read()
    seen = []
    read.add_done_callback(lambda r: 1 / 0)
    read.add_done_callback(lambda r: seen.append(r.result()))
    read.set_result(7)
    assert seen == [7]


@pytest.mark.parametrize("Read", READS, ids=lambda r: r.__name__ if r is PyRead else "compiled")
def test_as_landed_gives_reads_and_futures_in_the_order_they_land_those_landed_first(Read):
    early, late, later = Read.landed("early"), Read(), Future()
    threading.Timer(0.05, late.set_result, args=("late",)).start()
    threading.Timer(0.15, later.set_result, args=("later",)).start()
    got = in_thread(lambda: [r.result() for r in as_landed([later, late, early])])
    assert got == [["early", "late", "later"]]


def test_a_pool_runs_at_most_its_threads_jobs_at_once_on_its_own_threads():
    pool = ReadPool(2, "reader")
    running, most, lock = [0], [0], threading.Lock()

    def job(i: int) -> tuple[int, str]:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i, threading.current_thread().name

    try:
        reads = [pool.submit(job, i) for i in range(8)]
        results = in_thread(lambda: [r.result() for r in reads])[0]
        assert [i for i, _ in results] == list(range(8))
        assert {name for _, name in results} <= {"reader_0", "reader_1"}
        assert most[0] == 2
    finally:
        pool.close()


def test_a_failed_job_is_its_reads_error_and_the_reader_goes_on():
    pool = ReadPool(1)
    try:
        bad = pool.submit(lambda: 1 / 0)
        good = pool.submit(lambda: "fine")
        assert in_thread(good.result) == ["fine"]
        assert isinstance(bad.exception(), ZeroDivisionError)
    finally:
        pool.close()


def test_close_lets_the_queued_jobs_finish_then_refuses_new_ones():
    pool = ReadPool(1)
    gate = threading.Event()
    first = pool.submit(gate.wait, WAIT)
    queued = pool.submit(lambda: "queued")
    threading.Timer(0.05, gate.set).start()
    assert in_thread(pool.close) == [None]
    assert first.done() and queued.done()  # close returned once both had run
    assert first.result() is True and queued.result() == "queued"
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(ValueError):
        ReadPool(0)
