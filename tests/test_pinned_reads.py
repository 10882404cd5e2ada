"""Expert reads into pinned memory (fomoepy.runtime.pinned) on the simulated device: a copy up reads the
buffer in place, so the pool must not hand the buffer out again while such a copy may still be queued.
With deferred streams a queued copy runs only when something needs it, so reusing the buffer too early
overwrites the bytes the copy has not read yet, every time."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest
from sim_backend import sim_backend

from fomoepy.runtime.pinned import ALIGN, PinnedPool, host_address, reserve_bytes
from fomoepy.runtime.shim import GpuError
from fomoepy.runtime.sim.shim import configure

# max |gpu - cpu| / std(cpu logits): the ladder's GPU tolerance against the exact logits (test_gpu_model.py)
LOGIT_TOL = 1e-3


@pytest.fixture
def deferred():
    before = configure(deferred=True)
    yield
    configure(**before)


def sim_store_engine(tmp_path, **options):
    """The simulated device under the engine, the first oracle model's experts read from a store
    prepared in tmp_path: (engine, the model's oracle tokens)."""
    from conftest import ORACLE

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    name = "qwen3moe_q4_k_m"
    store = tmp_path / "store"
    prepare_store(ORACLE / f"{name}.gguf", [store], progress=False)
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="sim", store=(str(store),), **options))
    return engine, np.load(ORACLE / f"{name}.tokens.npy")


def test_a_host_address_is_the_first_bytes_whatever_the_array():
    """host_address (compiled where built: fomoepy/runtime/_host_memory.c) gives numpy's own address of an
    array's first byte: writable or read-only, a view at an offset, one not contiguous, an empty one."""
    block = np.zeros((8, 64), np.uint8)
    frozen = np.arange(16, dtype=np.float32)
    frozen.flags.writeable = False
    for a in (block, block[3], block[2:5, 7:], block[:, 5], frozen, frozen[4:], np.zeros(0, np.uint8)):
        assert host_address(a) == a.ctypes.data


def test_a_buffer_comes_back_when_its_last_view_is_dropped_and_is_recognised_as_pinned():
    dev = sim_backend()
    # one buffer per chunk, none spare: a take after a give reuses it
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=0)
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
    assert not pool.returned  # a view still holds it
    del view
    assert [a for (a, _), _ in pool.returned] == [address]
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


def test_a_reserve_not_yet_taken_is_given_back_at_close():
    log, pool = logged_pool()
    pool.reserve(ALIGN, 64 * ALIGN)
    pool.close()
    assert not pool.ahead and log.all_given_back()


def test_a_host_tier_is_reserved_in_proportion_to_each_layers_expert_size():
    assert reserve_bytes(100, [10, 10, 30]) == {10: 40, 30: 60}
    assert reserve_bytes(7, [4096]) == {4096: 7}


def test_an_engine_with_a_store_takes_its_host_tiers_pinned_memory_at_load(tmp_path):
    """Opened with a store and a host tier, the engine reserves the tier's read buffers on the pool's
    thread; its decode then takes no chunk on its own thread."""
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=1_200_000)
    pool = engine.experts.device.pool
    assert sum(len(q) for q in pool.ahead.values()) >= 1
    here, taken_here = threading.current_thread(), []
    real_take_chunk = pool._take_chunk

    def take_chunk(nbytes):
        if threading.current_thread() is here:
            taken_here.append(nbytes)
        return real_take_chunk(nbytes)

    pool._take_chunk = take_chunk
    state = engine.new_state()
    engine.eval(state, tokens[:8])
    for t in tokens[8:16]:
        engine.decode_token(state, int(t))
    assert pool.chunks and not taken_here
    engine.close()


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


@pytest.mark.parametrize("streams", ["immediate", "deferred"])
def test_an_engine_with_a_store_copies_every_miss_straight_from_its_pinned_read(tmp_path, streams, request):
    """The simulated device under the engine, tiers far smaller than the experts: every expert read from
    the store lands in pinned memory and goes up without a staging copy, demoted ones come down into
    pinned memory, and the logits are the CPU backend's. Deferred, the device runs queued work only when
    waited for: a buffer handed out again before its copy ran would change the logits."""
    if streams == "deferred":
        request.getfixturevalue("deferred")
    from conftest import ORACLE, open_oracle_engine

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    name = "qwen3moe_q4_k_m"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    store = tmp_path / "store"
    prepare_store(ORACLE / f"{name}.gguf", [store], progress=False)
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="sim", store=(str(store),), vram_cache=600_000, ram_cache=1_200_000))
    state, half = engine.new_state(), len(tokens) // 2
    got = np.concatenate([engine.eval(state, tokens[:half], all_logits=True)]
                         + [engine.decode_token(state, int(t))[None] for t in tokens[half:]])  # fmt: skip
    device = engine.experts.device
    cpu = open_oracle_engine(name).logits(tokens)
    assert np.abs(got - cpu).max() / cpu.std() <= LOGIT_TOL
    assert device.uploads > 0 and device.direct_uploads == device.uploads
    assert device.downloads > 0  # lfu-cooc demoted some, into pinned memory, and copied them up again
    engine.close()


def test_demoted_experts_bytes_survive_their_buffers_being_handed_out_again_soon(tmp_path, deferred):
    """As above, with a pool that grows one buffer at a time and never for a wait: buffers given back are
    handed out again as soon as a point passed frees them, among them those copies down wrote, whose bytes
    the host sees only once it has waited for those copies (the pool then makes it)."""
    from conftest import ORACLE, open_oracle_engine

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    name = "qwen3moe_q4_k_m"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    store = tmp_path / "store"
    prepare_store(ORACLE / f"{name}.gguf", [store], progress=False)
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="sim", store=(str(store),), vram_cache=600_000, ram_cache=1_200_000))
    device = engine.experts.device
    device.pool.release_ahead()  # (the chunks the engine reserved at load: this pool grows a buffer at a time)
    device.pool.chunk_bytes, device.pool.spare_bytes = 1, 0
    state, half = engine.new_state(), len(tokens) // 2
    got = np.concatenate([engine.eval(state, tokens[:half], all_logits=True)]
                         + [engine.decode_token(state, int(t))[None] for t in tokens[half:]])  # fmt: skip
    cpu = open_oracle_engine(name).logits(tokens)
    assert device.downloads > 0
    assert np.abs(got - cpu).max() / cpu.std() <= LOGIT_TOL
    engine.close()


class _HeldRead:
    """An expert store whose first read of layer 0's highest expert waits until `release` (or `patience`
    seconds), so what happens before it lands is decided by order, not time."""

    def __init__(self, store, patience: float):
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.layers, self.slot_nbytes = store, store.layers, store.slot_nbytes
        self.pool = ThreadPoolExecutor(4)
        self.gate, self.patience = threading.Event(), patience
        self.held: tuple[int, int] | None = None
        self.released_by = None

    def read(self, layer, expert):
        return self.store.read(layer, expert)

    def submit(self, layer, expert, out=None):
        return self.pool.submit(self._read, layer, expert, out)

    def _read(self, layer, expert, out):
        if (layer, expert) == self.held and not self.gate.wait(self.patience):
            self.release("patience")
        return self.store.read_into(layer, expert, out)

    def release(self, by: str) -> None:
        if self.released_by is None:  # the first thing that let the held read go
            self.released_by = by
        self.gate.set()


def test_a_miss_is_copied_up_before_the_last_read_of_its_layer_lands(tmp_path):
    """The copy of an expert whose bytes are here is issued while another read of the same layer is
    still held back: reads and copies overlap. Waiting for every read before copying any only gets past
    the held read when its patience runs out."""
    from conftest import ORACLE

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    name = "qwen3moe_q4_k_m"
    store = tmp_path / "store"
    prepare_store(ORACLE / f"{name}.gguf", [store], progress=False)
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="sim", store=(str(store),), vram_cache=0, ram_cache=0))
    streamer, device = engine.experts.streamer, engine.experts.device
    held = streamer.source = _HeldRead(streamer.source, patience=20.0)
    token = int(np.load(ORACLE / f"{name}.tokens.npy")[0])
    first_ids = []
    real_choose = streamer.substitute
    streamer.substitute = lambda layer, r, rows=None: first_ids.append((layer, r.ids)) or real_choose(layer, r, rows)
    # the first MoE step's choice, from the same token on the reference engine: hold its highest expert
    probe = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="reference", vram_cache=0, ram_cache=0))
    probe_ids = []
    probe_choose = probe.experts.streamer.substitute
    probe.experts.streamer.substitute = lambda layer, r, rows=None: probe_ids.append((layer, r.ids)) or probe_choose(layer, r, rows)
    probe.eval(probe.new_state(), [token])
    held.held = (0, int(probe_ids[0][1].max()))
    rt = device.dev.rt
    real_htod = rt.htod

    def htod(dst, src, nbytes, stream):
        if stream is device.dev.copy_stream:
            held.release("a copy")
        return real_htod(dst, src, nbytes, stream)

    rt.htod = htod
    try:
        engine.eval(engine.new_state(), [token])
    finally:
        del rt.htod
        held.release("the end")
    assert first_ids[0][0] == 0 and held.held[1] in first_ids[0][1]
    assert held.released_by == "a copy"
    engine.close()


def test_buffers_given_back_together_wait_for_their_copies_once():
    # one fence per batch of returned buffers: the first take waits for it, the rest of the batch reuse
    # the wait (each wait is a driver call, and a decode step takes several buffers)
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=4 * ALIGN, spare_bytes=0)
    held = [pool.take(ALIGN) for _ in range(4)]
    del held
    waits, real = [0], dev.rt.event_sync

    def counted(event, real=real):
        waits[0] += 1
        return real(event)

    dev.rt.event_sync = counted
    try:
        again = [pool.take(ALIGN) for _ in range(4)]
    finally:
        del dev.rt.event_sync
    assert waits[0] == 1 and len({a.ctypes.data for a in again}) == 4


def test_a_take_that_finds_only_buffers_copies_may_still_read_takes_a_new_one_while_they_are_few(deferred):
    # a step gives back buffers that are free only about a step later: rather than wait for every copy
    # queued (this step's copies up among them), the pool hands out a new buffer while those given back
    # and not yet known free hold at most its spare; past it a take waits as before (its idle page-locked
    # memory stays bounded)
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN, spare_bytes=ALIGN)  # one buffer's worth
    waits, real = [0], dev.rt.event_sync

    def counted(event, real=real):
        waits[0] += 1
        return real(event)

    dev.rt.event_sync = counted
    targets = [dev.rt.malloc(ALIGN) for _ in range(2)]
    try:
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
        del dev.rt.event_sync
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
    waits, real = [0], dev.rt.event_sync

    def counted(event, real=real):
        waits[0] += 1
        return real(event)

    dev.rt.event_sync = counted
    target = dev.rt.malloc(ALIGN)
    try:
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
        del dev.rt.event_sync
        dev.rt.free(target)


def test_a_failed_read_leaves_no_slot_waiting_for_bytes_that_never_come(tmp_path):
    """A step whose reads fail raises, and the slots its plan admitted for those bytes are dropped: the
    next run reads the experts again and computes the logits a fresh engine does (it used to take them
    for held and fail on a slot the device never filled)."""
    from concurrent.futures import Future

    from conftest import ORACLE

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    class FailingStore:
        def __init__(self, store):
            self.store, self.layers, self.slot_nbytes, self.fail = store, store.layers, store.slot_nbytes, False

        def read(self, layer, expert):
            if self.fail:
                raise OSError(f"expert ({layer}, {expert}): read failed")
            return self.store.read(layer, expert)

        def submit(self, layer, expert, out=None):
            if not self.fail:
                return self.store.submit(layer, expert, out=out)
            done = Future()
            done.set_exception(OSError(f"expert ({layer}, {expert}): read failed"))
            return done

    name = "qwen3moe_q4_k_m"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    store = tmp_path / "store"
    prepare_store(ORACLE / f"{name}.gguf", [store], progress=False)
    options = EngineOptions(backend="sim", store=(str(store),), vram_cache=600_000, ram_cache=1_200_000, prefetch=False)
    fresh = Engine(ORACLE / f"{name}.gguf", options)
    want = fresh.logits(tokens)
    fresh.close()
    engine = Engine(ORACLE / f"{name}.gguf", options)
    streamer = engine.experts.streamer
    streamer.source = failing = FailingStore(streamer.source)
    failing.fail = True
    with pytest.raises(OSError, match="read failed"):
        engine.logits(tokens)
    failing.fail = False
    assert np.array_equal(engine.logits(tokens), want)
    engine.close()


def test_a_demoted_experts_copy_down_is_not_waited_for_and_comes_back_right(tmp_path, deferred):
    """A demoting policy copies device evictees down into pinned memory on the copy stream and the host
    goes on (the step's reads are issued at once); when such an expert is used again, its copy up follows
    the copy down on the same stream. Under deferred streams (a stream runs only when waited for), the
    logits are still the CPU backend's, and no step waited for the copy stream."""
    from conftest import open_oracle_engine

    name = "qwen3moe_q4_k_m"
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    dev, device = engine.devices[0], engine.experts.device
    waits, real_sync = [0], dev.rt.sync

    def sync(stream, real_sync=real_sync):
        waits[0] += stream is dev.copy_stream
        return real_sync(stream)

    dev.rt.sync = sync
    try:
        state = engine.new_state()
        got = np.concatenate([engine.decode_token(state, int(t))[None] for t in tokens])
    finally:
        del dev.rt.sync
    cpu = open_oracle_engine(name).logits(tokens)
    assert device.downloads > 0 and waits[0] == 0
    assert np.abs(got - cpu).max() / cpu.std() <= LOGIT_TOL
    engine.close()


def test_a_steps_reads_are_issued_before_its_copies_down(tmp_path):
    """A step that both reads misses and demotes device evictees issues the reads first: a drive's
    latency is the longer wait, and the copies down only have to precede the reuse of their slots."""
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    streamer = engine.experts.streamer
    events: list[str] = []
    real_submit, real_download, real_start = streamer.source.submit, streamer._download, streamer.start_acquire
    streamer.source.submit = lambda *a, **k: events.append("read") or real_submit(*a, **k)
    streamer._download = lambda key: events.append("down") or real_download(key)
    streamer.start_acquire = lambda *a: events.append("step") or real_start(*a)
    try:
        state = engine.new_state()
        for t in tokens[:12]:
            engine.decode_token(state, int(t))
    finally:
        del streamer.source.submit, streamer.start_acquire
        streamer._download = real_download
    steps = "".join("|" if e == "step" else e[0] for e in events).split("|")  # "r": a read, "d": a copy down
    both = [s for s in steps if "r" in s and "d" in s]
    assert both, "no step both read and demoted: the test proves nothing"
    assert all(s.rindex("r") < s.index("d") for s in both)
    engine.close()


def test_a_steps_last_expert_kernels_are_launched_before_its_reads_bookkeeping(tmp_path):
    """Once a step's last read has landed and been copied up, its expert kernels are launched first; the
    cache's bookkeeping of the reads (host admissions, readiness) follows, where it delays no kernel."""
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=1_200_000, prefetch=False)
    streamer, dev = engine.experts.streamer, engine.devices[0]
    events: list[str] = []
    real_finish, real_launch = streamer.finish_acquire, dev.launch

    def finish(plan, fetched, reads):
        events.append("books" if reads else "books, no reads")
        return real_finish(plan, fetched, reads)

    def launch(name, *a, **k):
        events.append("last" if name == "moe_combine" or name.startswith("moe_down_sum") else "kernel")
        return real_launch(name, *a, **k)

    streamer.finish_acquire, dev.launch = finish, launch
    try:
        state = engine.new_state()
        for t in tokens[:8]:
            engine.decode_token(state, int(t))
    finally:
        del streamer.finish_acquire, dev.launch
    steps_with_reads = [i for i, e in enumerate(events) if e == "books"]
    assert steps_with_reads, "no step read an expert: the test proves nothing"
    for i in steps_with_reads:
        assert events[i - 1] == "last"  # the step's last expert launch came just before its bookkeeping
    engine.close()


def test_a_steps_copies_up_do_not_wait_for_its_own_copies_down(tmp_path, deferred):
    """A demoting policy's copies down go on a stream of their own, beside the step's copies up (a GPU's
    copy engines move both directions at once): no copy up of a step waits for the step's own copies
    down; the next step's copy stream waits for them once, before it reuses their slots or their bytes.
    Under deferred streams the logits are still the CPU backend's."""
    from conftest import open_oracle_engine

    name = "qwen3moe_q4_k_m"
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    dev, device, streamer = engine.devices[0], engine.experts.device, engine.experts.streamer
    rt = dev.rt
    side = device.sides[0]
    events: list[tuple] = []  # ("step",), ("down", stream), ("up", stream), ("wait", stream, event)
    real = {name: getattr(rt, name) for name in ("dtoh", "htod", "wait", "record")}
    rt.record = lambda event, stream: events.append(("record", stream, event)) or real["record"](event, stream)
    rt.dtoh = lambda dst, src, n, stream: events.append(("down", stream)) or real["dtoh"](dst, src, n, stream)
    rt.htod = lambda dst, src, n, stream: events.append(("up", stream)) or real["htod"](dst, src, n, stream)
    rt.wait = lambda stream, event: events.append(("wait", stream, event)) or real["wait"](stream, event)
    real_start, real_download = streamer.start_acquire, streamer._download
    streamer.start_acquire = lambda *a: events.append(("step",)) or real_start(*a)
    streamer._download = lambda key: events.append(("demote",)) or real_download(key)
    try:
        state = engine.new_state()
        got = np.concatenate([engine.decode_token(state, int(t))[None] for t in tokens])
    finally:
        del rt.dtoh, rt.htod, rt.wait, rt.record, streamer.start_acquire
        streamer._download = real_download
    steps, current = [], None
    for e in events:
        if e[0] == "step":
            current = []
            steps.append(current)
        elif current is not None:
            current.append(e)
    both = [s for s in steps if any(e[0] == "demote" for e in s) and any(e[0] == "up" and e[1] is dev.copy_stream for e in s)]
    assert both, "no step both demoted and copied up: the test proves nothing"
    for s in both:
        first_down = next(i for i, e in enumerate(s) if e[0] == "demote")
        # each demotion's copy down (the next driver copy to the host after it) is on the down stream
        assert all(next(f for f in s[i:] if f[0] == "down")[1] is dev.down_stream for i, e in enumerate(s) if e[0] == "demote")
        # the copy stream waits on `down_done` as recorded before this step's copies down, never after
        recorded = [i for i, e in enumerate(s) if e[0] == "record" and e[2] is side.down_done]
        waits = [i for i, e in enumerate(s) if e[0] == "wait" and e[1] is dev.copy_stream and e[2] is side.down_done]
        assert not [w for w in waits if any(first_down < r < w for r in recorded)]
    assert device.downloads > 0
    cpu = open_oracle_engine(name).logits(tokens)
    assert np.abs(got - cpu).max() / cpu.std() <= LOGIT_TOL
    engine.close()


def test_any_wait_for_the_compute_stream_frees_what_waited_on_it(tmp_path):
    """The host's waits for the compute stream are counted by the runtime (rt.syncs), whatever made them
    (a routing read-back, the sampler's, a plain synchronize): launches queued before one need no event for
    the copies after them, and a join of the copies before one frees the pinned buffers given back before
    it without an event wait."""
    engine, _ = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    dev, device = engine.devices[0], engine.experts.device
    side, pool = device.sides[0], device.pool
    recorded = []
    real_record = dev.rt.record
    dev.rt.record = lambda event, stream: recorded.append(event) or real_record(event, stream)
    try:
        side.launched()
        dev.synchronize()  # not a routing read-back: any wait for the compute stream
        side.fence_launches()
        assert side.computed not in recorded and not side.copies_wait
        side.launched()
        side.fence_launches()  # no wait between: the copies after must wait for these launches
        assert side.computed in recorded and side.copies_must_wait()
        dev.synchronize()
        assert not side.copies_must_wait()
        parts = engine.source.read(0, 0)
        device.install((0, 0), parts)
        device._join_copies(side)
        mark = side.joins_pending[-1][0]
        device._pinned(4096)
        assert pool.passed < mark  # no wait for the compute stream since the join
        dev.synchronize()
        device._pinned(4096)
        assert pool.passed >= mark
    finally:
        del dev.rt.record
    engine.close()


def test_a_copy_down_of_an_expert_just_copied_up_reads_its_bytes(tmp_path, deferred):
    """An expert installed (copied up, no wait for the compute stream since) and demoted at once: its copy
    down, on its own stream, waits for the copy up, so the host gets the store's bytes. Deferred, a copy
    down that did not wait would read the slot before the copy up ran."""
    engine, _ = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    device = engine.experts.device
    parts = engine.source.read(0, 3)
    want = [np.array(p, copy=True) for p in parts]
    device.install((0, 3), parts)
    got = device.download((0, 3))
    device.sync_downloads()
    assert all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want))
    engine.close()
