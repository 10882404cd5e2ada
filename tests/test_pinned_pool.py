"""The pinned pool (fomoepy.runtime.pinned) on the simulated device, alone: its buffers' addresses and
give-back, how it takes page-locked memory from the driver (mapped and registered chunks, taken ahead on
its own thread, a host tier's worth reserved), and when a buffer a copy may still read is handed out
again. With deferred streams a queued copy runs only when something needs it, so reusing a buffer too
early overwrites the bytes the copy has not read yet, every time. The engine over it:
tests/test_pinned_reads.py."""

from __future__ import annotations

import gc
import mmap
import threading

import numpy as np
import pytest
from conftest import counting_calls
from sim_backend import sim_backend

from fomoepy.runtime.pinned import (
    ALIGN,
    PinnedPool,
    PyShelf,
    Shelf,
    host_address,
    reserve_bytes,
)
from fomoepy.runtime.shim import GpuError

SHELVES = [PyShelf] + ([Shelf] if Shelf is not None else [])  # the definition, and the compiled one where built


def test_a_host_address_is_the_first_bytes_whatever_the_array():
    """host_address (compiled where built: fomoepy/runtime/_host_memory.c) gives numpy's own address of an
    array's first byte: writable or read-only, a view at an offset, one not contiguous, an empty one."""
    block = np.zeros((8, 64), np.uint8)
    frozen = np.arange(16, dtype=np.float32)
    frozen.flags.writeable = False
    for a in (block, block[3], block[2:5, 7:], block[:, 5], frozen, frozen[4:], np.zeros(0, np.uint8)):
        assert host_address(a) == a.ctypes.data


@pytest.mark.parametrize("shelf", SHELVES)
def test_a_buffer_comes_back_when_its_last_view_is_dropped_and_is_recognised_as_pinned(shelf):
    dev = sim_backend()
    # one buffer per chunk, none spare: a take after a give reuses it
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=0, shelf=shelf)
    buf = pool.take(10_000)
    assert buf.nbytes == 3 * ALIGN and buf.ctypes.data % ALIGN == 0
    view = buf[100:200]
    outside = np.zeros(16, np.uint8)
    assert host_address(view) == buf.ctypes.data + 100 and host_address(outside) == outside.ctypes.data
    assert pool.pins(host_address(view), view.nbytes) and pool.pins(host_address(buf), buf.nbytes)
    assert not pool.pins(host_address(buf), buf.nbytes + 1)  # a span running past the pool's memory
    assert not pool.pins(host_address(outside), outside.nbytes)
    address = buf.ctypes.data
    del buf
    assert not pool.shelf.returned()  # a view still holds it
    del view
    assert pool.shelf.returned() == [address]
    assert pool.take(10_000).ctypes.data == address  # the same buffer, handed out again


class AllocationLog:
    """The device's page-locked memory taken (allocated, or registered) and given back, each with the
    thread that took it; `registers=False`: a driver that registers no host memory."""

    def __init__(self, rt, registers=True):
        self.rt, self.registers, self.taken, self.given = rt, registers, [], []

    def host_alloc(self, nbytes):
        address = self.rt.host_alloc(nbytes)
        self.taken.append(("alloc", address, nbytes, threading.current_thread()))
        return address

    def host_register(self, address, nbytes):
        if not self.registers:
            raise GpuError("cuda: cuMemHostRegister failed: operation not supported")
        self.rt.host_register(address, nbytes)
        self.taken.append(("register", address, nbytes, threading.current_thread()))

    def host_free(self, address):
        self.given.append(address)
        self.rt.host_free(address)

    def host_unregister(self, address):
        self.given.append(address)
        self.rt.host_unregister(address)

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def all_given_back(self) -> bool:
        return sorted(self.given) == sorted(address for _, address, _, _ in self.taken)


def logged_pool(registers=True, **options):
    """A pool of one buffer a chunk, none spare, over the simulated device's driver, logged."""
    dev = sim_backend()
    log = AllocationLog(dev.rt, registers)
    return log, PinnedPool(log, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=0, **options)


def test_a_growing_size_has_its_next_chunk_taken_on_another_thread_one_ahead():
    """Taking page-locked memory is slow (tens of ms for 64 MiB on an H200's host), so once a size needs a
    second chunk, each next chunk is taken on the pool's own thread before a take needs it. One chunk a
    buffer here: while the buffers are all held (a tier filling), every chunk after the second comes
    from that thread, and the pool holds exactly one chunk nobody took yet. The chunks are mappings
    registered with the driver, after one page asked whether it registers any."""
    log, pool = logged_pool()
    held = [pool.take(ALIGN) for _ in range(6)]
    pool.ahead[ALIGN][0][0].result()  # (the one ahead, taken by now)
    here = threading.current_thread()
    probe, *chunks = log.taken
    assert probe[0] == "register" and probe[2] == mmap.PAGESIZE and log.given == [probe[1]]
    assert [how for how, *_ in chunks] == ["register"] * 7 and set(pool._mappings) == {a for _, a, _, _ in chunks}
    assert [thread is here for *_, thread in chunks] == [True, True] + [False] * 5
    assert set(pool.ahead) == {ALIGN} and len(chunks) == len(held) + 1
    assert pool.take(2 * ALIGN) is not None and log.taken[-1][-1] is here  # a new size: its first chunk now
    del held
    for _ in range(6):  # buffers given back and reused (a full tier): no chunk taken, none more ahead
        pool.passed_mark(pool.mark())
        assert pool.take(ALIGN) is not None
    assert len(log.taken) == 1 + 8
    pool.close()
    assert log.all_given_back()  # the one ahead too
    assert not pool._mappings


def test_a_reserve_takes_its_chunks_on_the_pools_thread_before_any_take_needs_them():
    log, pool = logged_pool()
    pool.reserve(ALIGN, 5 * ALIGN)
    assert len(pool.ahead[ALIGN]) == 5
    held = [pool.take(ALIGN) for _ in range(6)]  # the five reserved, then one taken ahead as it grows
    pool.ahead[ALIGN][0][0].result()
    here = threading.current_thread()
    probe, *chunks = log.taken
    assert probe[-1] is here and len(chunks) == len(held) + 1  # (one page asked, on the reserving thread)
    assert not any(thread is here for *_, thread in chunks)
    del held
    pool.close()
    assert log.all_given_back()


def mapped(address: int) -> bool:
    """Whether the process has `address` mapped (/proc/self/maps): asked without touching it."""
    with open("/proc/self/maps") as maps:
        spans = (line.split(maxsplit=1)[0].split("-") for line in maps)
        return any(int(a, 16) <= address < int(b, 16) for a, b in spans)


def test_a_pool_closed_with_a_buffer_out_leaves_its_pages_mapped_and_registered_once_dropped():
    """A read in flight at a reset: its buffer is still out when the pool closes, and the pool is then
    dropped. Its pages must stay under that buffer (the read still writes them, a copy up may read them) and
    registered (a mapping freed while registered left an H200's driver refusing later allocations,
    CUDA_ERROR_ALREADY_MAPPED). Closed again once the buffer is back, the pool gives them back."""
    log, pool = logged_pool()
    held = pool.take(ALIGN)
    address = host_address(held)
    chunk = pool.blocks[0]
    pool.close()
    del pool
    gc.collect()
    assert mapped(address) and chunk not in log.given
    held[:] = 7  # (unmapped, this write would kill the process)
    log, pool = logged_pool()
    held = pool.take(ALIGN)
    pool.close()
    assert not log.all_given_back()
    del held
    pool.close()
    assert log.all_given_back() and not pool._mappings


def test_a_reserve_not_yet_taken_is_given_back_at_close():
    log, pool = logged_pool()
    pool.reserve(ALIGN, 64 * ALIGN)
    pool.close()
    assert not pool.ahead and log.all_given_back()


def test_a_host_tier_is_reserved_in_proportion_to_each_layers_expert_size():
    assert reserve_bytes(100, [10, 10, 30]) == {10: 40, 30: 60}
    assert reserve_bytes(7, [4096]) == {4096: 7}


def test_where_the_driver_registers_no_host_memory_chunks_are_its_own_allocations():
    log, pool = logged_pool(registers=False)
    held = [pool.take(ALIGN) for _ in range(3)]
    pool.ahead[ALIGN][0][0].result()
    assert [how for how, *_ in log.taken] == ["alloc"] * (len(held) + 1) and not pool._mappings
    del held
    pool.close()
    assert log.all_given_back()


def test_without_taking_ahead_every_chunk_is_taken_by_the_take_that_needs_it():
    log, pool = logged_pool(grow_ahead=False)
    held = [pool.take(ALIGN) for _ in range(4)]
    chunks = log.taken[1:]
    assert len(chunks) == len(held) and all(thread is threading.current_thread() for *_, thread in chunks)
    assert not pool.ahead


def test_a_buffer_is_not_reused_while_a_copy_from_it_is_still_queued(deferred):
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=0)  # no spare: it must wait
    n = 2 * ALIGN
    first = pool.take(n)
    first[:] = 7
    target = dev.rt.malloc(n)
    dev.rt.htod(target, first.ctypes.data, n, dev.copy_stream)  # queued: deferred, it has not run
    address = first.ctypes.data
    del first
    again = pool.take(n)  # the pool waits for the copies queued so far before handing it out
    assert again.ctypes.data == address
    again[:] = 9  # a new read landing in the reused buffer
    got = np.empty(n, np.uint8)
    dev.rt.dtoh(got.ctypes.data, target, n, dev.copy_stream)
    dev.rt.sync(dev.copy_stream)
    dev.rt.free(target)
    assert (got == 7).all(), "the copy read a buffer the pool had already handed out again"


def test_buffers_given_back_together_wait_for_their_copies_once():
    # one fence per batch of returned buffers: the first take waits for it, the rest of the batch reuse
    # the wait (each wait is a driver call, and a decode step takes several buffers)
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=4 * ALIGN, spare_bytes=0)
    held = [pool.take(ALIGN) for _ in range(4)]
    del held
    with counting_calls(dev.rt, "event_sync") as waits:
        again = [pool.take(ALIGN) for _ in range(4)]
    assert waits[0] == 1 and len({a.ctypes.data for a in again}) == 4


def test_a_take_that_finds_only_buffers_copies_may_still_read_takes_a_new_one_while_they_are_few(deferred):
    # a step gives back buffers that are free only about a step later: rather than wait for every copy
    # queued (this step's copies up among them), the pool hands out a new buffer while those given back
    # and not yet known free hold at most its spare; past it a take waits as before (its idle page-locked
    # memory stays bounded)
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=ALIGN)  # one buffer's worth
    targets = [dev.rt.malloc(ALIGN) for _ in range(2)]
    try:
        with counting_calls(dev.rt, "event_sync") as waits:
            a, b = pool.take(ALIGN), pool.take(ALIGN)
            a[:], b[:] = 7, 8
            first, second = a.ctypes.data, b.ctypes.data
            for buf, target in zip((a, b), targets):
                dev.rt.htod(target, buf.ctypes.data, ALIGN, dev.copy_stream)  # deferred: queued, not run
            del a, buf
            c = pool.take(ALIGN)  # one given back, within the spare: a new buffer, no wait
            assert waits[0] == 0 and c.ctypes.data not in (first, second)
            c[:] = 9
            del b
            again = pool.take(ALIGN)  # two given back, past the spare: it waits for the copies, then reuses
            assert waits[0] == 1 and again.ctypes.data == first
            again[:] = 9
            for value, target in zip((7, 8), targets):
                got = np.empty(ALIGN, np.uint8)
                dev.rt.dtoh(got.ctypes.data, target, ALIGN, dev.copy_stream)
                dev.rt.sync(dev.copy_stream)
                assert (got == value).all(), "a copy read a buffer the pool had already handed out again"
    finally:
        for target in targets:
            dev.rt.free(target)


def test_a_buffer_a_copy_down_wrote_is_handed_out_again_only_once_the_host_has_waited_for_that_copy(deferred):
    # a point on the copy streams passed proves the copy down done on the device, not that the host's view
    # of the bytes it wrote is current (the simulated device holds them back until the host waits for the
    # copy's own stream): a read landing in the buffer handed out again would then be overwritten
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream, dev.down_stream], chunk_bytes=ALIGN, spare_bytes=0)
    done = dev.rt.event()
    settled: list[int] = []

    def settle(upto: int) -> None:
        settled.append(upto)
        dev.rt.record(done, dev.down_stream)
        dev.rt.event_sync(done)

    pool.settle_writes = settle
    source = dev.rt.malloc(ALIGN)
    dev.rt.htod(source, np.full(ALIGN, 5, np.uint8).ctypes.data, ALIGN, dev.copy_stream)
    dev.rt.sync(dev.copy_stream)
    try:
        buf = pool.take(ALIGN)
        dev.rt.dtoh(buf.ctypes.data, source, ALIGN, dev.down_stream)  # deferred: the host's view held back
        pool.device_writes(buf.ctypes.data, 1)
        del buf
        pool.passed_mark(pool.mark())  # a point after it came back, passed: free of the copy streams' work
        again = pool.take(ALIGN)
        assert settled == [1]  # the host waited for the copy down first
        again[:] = 9  # a read landing in the buffer
        dev.rt.sync(dev.down_stream)  # whatever the host waits for later
        assert (again == 9).all(), "a copy down landed over bytes the host wrote after the buffer came back"
    finally:
        dev.rt.free(source)


def test_a_point_marked_after_buffers_came_back_frees_them_once_passed_and_one_marked_before_does_not(deferred):
    # the device marks a point on the copy stream each time its compute stream joins the copies, and says
    # when one is passed (it waited for the compute stream): buffers given back before that point are
    # free of their copies with no driver call; a point marked before they came back proves nothing
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=0)
    target = dev.rt.malloc(ALIGN)
    try:
        with counting_calls(dev.rt, "event_sync") as waits:
            buf = pool.take(ALIGN)
            buf[:] = 7
            early = pool.mark()  # before the copy below is queued
            dev.rt.htod(target, buf.ctypes.data, ALIGN, dev.copy_stream)  # deferred: queued, not run
            del buf
            pool.passed_mark(early)
            again = pool.take(ALIGN)  # must wait: the copy reading it is after the passed point
            assert waits[0] == 1
            again[:] = 9
            got = np.empty(ALIGN, np.uint8)
            dev.rt.dtoh(got.ctypes.data, target, ALIGN, dev.copy_stream)
            dev.rt.sync(dev.copy_stream)
            assert (got == 7).all(), "the copy read a buffer the pool had already handed out again"

            dev.rt.htod(target, again.ctypes.data, ALIGN, dev.copy_stream)
            del again
            late = pool.mark()  # after the copy: the device's join
            dev.rt.sync(dev.copy_stream)  # what the device's read-back waits for, in effect
            pool.passed_mark(late)
            pool.take(ALIGN)
            assert waits[0] == 1  # freed by the passed point, no wait of its own
    finally:
        dev.rt.free(target)


@pytest.mark.skipif(Shelf is None, reason="the compiled shelf is not built here")
def test_the_compiled_shelf_hands_out_what_its_definition_does():
    """Shelf (fomoepy/runtime/_host_memory.c) against PyShelf, the same random run of chunks added, takes,
    give-backs (arrays dropped, in any order), points marked and passed, copies down written and waits: the
    same buffers, in the same order, the same settles, the same counts."""
    memory = np.zeros(64 * ALIGN, np.uint8)  # the addresses must be real: the arrays are over them
    base = host_address(memory) + (-host_address(memory) % ALIGN)
    runs = []
    for make in (PyShelf, Shelf):
        written, settled, log = {}, [], []
        shelf = make(written, settled.append)
        held: list[np.ndarray] = []
        chunks = 0
        rng = np.random.default_rng(7)  # (the same run for both)
        for _ in range(600):
            op = rng.integers(6)
            size = ALIGN * int(rng.choice([1, 2]))
            if op == 0 and chunks < 6:  # a chunk of 4 buffers of this size
                shelf.add_fresh(size, base + chunks * 8 * ALIGN, 4)
                chunks += 1
            elif op == 1:
                buf = shelf.take(size)
                log.append(("take", size, None if buf is None else host_address(buf) - base, None if buf is None else buf.nbytes))
                if buf is not None:
                    held.append(buf)
            elif op == 2 and held:
                held.pop(int(rng.integers(len(held))))
            elif op == 3:
                shelf.marks += 1
                if rng.integers(2):
                    shelf.passed = shelf.marks - int(rng.integers(2))
            elif op == 4 and held:
                written[host_address(held[int(rng.integers(len(held)))])] = int(rng.integers(100))
            elif op == 5 and shelf.waiting(size):
                buf = shelf.take_waiting(size)
                log.append(("waited", size, host_address(buf) - base))
                held.append(buf)
            log.append(("counts", shelf.waiting(ALIGN), shelf.waiting(2 * ALIGN), len([a - base for a in shelf.returned()])))
        held.clear()
        log.append(("held", shelf.held()))
        runs.append((log, settled, sorted(written)))
    assert runs[0] == runs[1]
    assert any(e[0] == "take" and e[2] is None for e in runs[0][0]) and runs[0][1]  # every path was taken
