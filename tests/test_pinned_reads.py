"""Expert reads into pinned memory (fomoepy.runtime.pinned) under the engine on the simulated device: a
copy up reads the buffer in place, so the pool must not hand the buffer out again while such a copy may
still be queued; the order of a step's reads, copies up and down, and launches; a host tier's pinned
memory reserved at load. With deferred streams a queued copy runs only when something needs it, so
reusing the buffer too early overwrites the bytes the copy has not read yet, every time. The pool
alone: tests/test_pinned_pool.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest


# max |gpu - cpu| / std(cpu logits): the ladder's GPU tolerance against the exact logits (test_gpu_model.py)
LOGIT_TOL = 1e-3


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
    from conftest import counting_calls, open_oracle_engine

    name = "qwen3moe_q4_k_m"
    engine, tokens = sim_store_engine(tmp_path, vram_cache=600_000, ram_cache=4_000_000, prefetch=False)
    dev, device = engine.devices[0], engine.experts.device
    with counting_calls(dev.rt, "sync", which=lambda stream: stream is dev.copy_stream) as waits:
        state = engine.new_state()
        got = np.concatenate([engine.decode_token(state, int(t))[None] for t in tokens])
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
