"""fomoepy.runtime.ggml_reads: the cpu backend's reads land in an arena per record size, and a decode round
computes the misses its tier does not keep where they landed, not from staging slots they are copied into."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.read_buffers import ReadBuffers
from fomoepy.experts.store_writer import prepare_store
from fomoepy.runtime import batched_experts, ggml_experts, ggml_pool, ggml_reads
from fomoepy.runtime.ggml_reads import DeviceReads, PyReadArena

# the definition, and the compiled one (fomoepy/runtime/_host_memory.c's Arena) where setup.py built it
ARENAS = [PyReadArena] + ([ggml_reads.Arena] if ggml_reads.Arena is not None else [])
from fomoepy.runtime.pinned import ALIGN


@pytest.mark.parametrize("ReadArena", ARENAS, ids=lambda c: "python" if c is PyReadArena else "compiled")
def test_an_arenas_buffers_are_aligned_apart_and_come_back_from_any_thread_the_last_one_first(ReadArena):
    arena = ReadArena(3 * ALIGN, count=3)
    assert (arena.stride, arena.count, arena.free) == (3 * ALIGN, 3, 3)
    bufs = [arena.take() for _ in range(3)]
    assert all(b.dtype == np.uint8 and b.nbytes == 3 * ALIGN and b.flags.writeable for b in bufs)
    starts = [b.ctypes.data for b in bufs]
    assert arena.take() is None  # all three held
    assert all(a % ALIGN == 0 for a in starts) and sorted(starts) == [arena.base + i * 3 * ALIGN for i in range(3)]
    assert [arena.index_of(a) for a in starts] == [0, 1, 2] and arena.index_of(starts[1] + ALIGN) is None
    assert arena.index_of(arena.base + 3 * 3 * ALIGN) is None  # past the last buffer
    part = bufs[2][ALIGN:]  # a view (an expert's part) keeps its buffer held
    dropper = threading.Thread(target=bufs.clear)
    dropper.start()
    dropper.join()
    assert arena.free == 2
    again = arena.take()
    assert again.ctypes.data in starts[:2]
    del part
    last = arena.take(100)  # the first bytes of one: a buffer all the same
    assert last.ctypes.data == starts[2] and last.nbytes == 100  # given back last, handed out first
    del last, again
    assert arena.free == 3
    with pytest.raises(ValueError):
        arena.take(3 * ALIGN + 1)  # more than a buffer
    for stride, count in [(ALIGN + 1, 2), (0, 2), (ALIGN, 0)]:
        with pytest.raises(ValueError):
            ReadArena(stride, count)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_device_reads_take_from_the_arena_of_their_size_then_buffers_of_their_own_and_locate_a_records_parts(compiled, monkeypatch):
    if compiled and ggml_reads.record_index is None:
        pytest.skip("fomoepy.runtime._host_memory not built")
    if not compiled:
        monkeypatch.setattr(ggml_reads, "record_index", None)  # the definition's Python (py_record_index)
    reads = DeviceReads(count=2)
    held = [reads.take(2 * ALIGN) for _ in range(3)]
    arena = reads.arenas[2 * ALIGN]
    assert [arena.index_of(b.ctypes.data) for b in held] == [0, 1, None]  # the third: a buffer of its own
    sizes = (ALIGN, 512, ALIGN - 512)

    def parts(b):
        return b[:ALIGN], b[ALIGN : ALIGN + 512], b[ALIGN + 512 :]

    assert reads.locate(parts(held[1]), sizes) == (arena, 1)
    assert reads.locate(parts(held[2]), sizes) is None  # not in an arena
    assert reads.locate((held[1][:ALIGN], held[1][ALIGN + 512 :], held[1][ALIGN : ALIGN + 512]), (ALIGN, ALIGN - 512, 512)) is None
    assert reads.locate(parts(held[0])[:2] + (held[0][ALIGN + 512 : -1],), sizes) is None  # a part short of its size
    shifted = held[0][ALIGN:]  # parts one after another, but from a page into the buffer: not its record
    assert reads.locate((shifted[:ALIGN], shifted[ALIGN : ALIGN + 1], shifted[ALIGN + 1 : ALIGN + 1]), (ALIGN, 1, 0)) is None
    fetched = {3: parts(held[0]), 5: parts(held[2]), 8: parts(held[1])}
    assert reads.in_arena([3, 5, 8], fetched, sizes) == {3: (arena, 0), 8: (arena, 1)}
    assert reads.in_arena([3], fetched, (ALIGN, ALIGN, ALIGN)) == {}  # no arena of that record size


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    d = tmp_path_factory.mktemp("store")
    prepare_store(path, [d], progress=False)
    tokens = [int(t) for t in np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")]
    want = {}
    for kernel in KERNELS:  # every expert resident, by each expert kernel (their float sums differ in order)
        resident = Engine(path, EngineOptions(backend="cpu", expert_kernel=kernel, repack_experts="off"))
        state = resident.new_state()
        want[kernel] = np.stack([resident.decode_token(state, t) for t in tokens])
        resident.close()
    return path, d, tokens, want


# a decode step's experts by ggml's products (whose misses the read arena's rounds compute in place) and by
# fomoepy's batched kernel, where it serves (which computes every miss from where its read landed)
KERNELS = ["ggml"] + (["on"] if batched_experts.vector_kernel() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ram_cache", [0, 2 << 20])
def test_a_streamed_decodes_misses_the_tier_does_not_keep_are_computed_where_their_reads_landed(store, ram_cache, kernel, monkeypatch):
    path, d, tokens, want = store
    counts = {"staged": 0, "in place": 0}
    real_stage, real_round = ggml_pool.SlotPool.stage, ggml_experts._round_in_place

    def stage(self, *a):
        counts["staged"] += 1
        return real_stage(self, *a)

    def in_place(*a):
        counts["in place"] += 1
        return real_round(*a)

    monkeypatch.setattr(ggml_pool.SlotPool, "stage", stage)
    monkeypatch.setattr(ggml_experts, "_round_in_place", in_place)
    engine = Engine(path, EngineOptions(backend="cpu", store=(str(d),), vram_cache=0, ram_cache=ram_cache, expert_kernel=kernel))
    assert any(engine.experts.device.kernel_layers) == (kernel == "on")
    state = engine.new_state()
    got = np.stack([engine.decode_token(state, t) for t in tokens])
    assert engine.stats()["cache"]["disk"]["reads"] > len(tokens)
    engine.close()
    assert counts["staged"] == 0  # no miss was copied into a staging slot
    assert counts["in place"] > 0 or kernel == "on"  # (the kernel's steps take no rounds)
    assert np.array_equal(got, want[kernel])  # the same bits as every expert resident (plain slots, the same kernels)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_reads_beyond_the_arena_are_staged_by_a_copy_with_the_same_bits(store, kernel, monkeypatch):
    """ggml's products: the misses beyond the read arena copied into staging slots; the batched kernel's: none,
    every miss read where its read landed, arena or not. The same bits as every expert resident either way."""
    path, d, tokens, want = store
    monkeypatch.setattr(DeviceReads.__init__, "__defaults__", (1,))
    staged = [0]
    real_stage = ggml_pool.SlotPool.stage

    def stage(self, *a):
        staged[0] += 1
        return real_stage(self, *a)

    monkeypatch.setattr(ggml_pool.SlotPool, "stage", stage)
    engine = Engine(path, EngineOptions(backend="cpu", store=(str(d),), vram_cache=0, ram_cache=0, expert_kernel=kernel))
    assert engine.experts.device.reads.count == 1
    state = engine.new_state()
    got = np.stack([engine.decode_token(state, t) for t in tokens])
    engine.close()
    if kernel == "ggml":
        assert staged[0] > 0  # a step's misses outnumber the one buffer: the others were copied
    else:
        assert staged[0] == 0
    assert np.array_equal(got, want[kernel])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_batched_decode_steps_misses_are_computed_where_they_landed_each_row_with_its_lone_bits(store, kernel, monkeypatch):
    # several sequences' rows a step: each pick a row of its own in the round, from a slot or from the buffer
    # its read landed in; each row's logits those of its sequence decoded alone (plain slots either way)
    path, d, tokens, _ = store
    options = EngineOptions(backend="cpu", store=(str(d),), vram_cache=0, ram_cache=2 << 20, threads=1, expert_kernel=kernel)
    streams = [tokens[i:] + tokens[:i] for i in (0, 5, 11)]  # three sequences, each its own tokens
    steps = 8
    engine = Engine(path, options)
    lone = []
    for stream in streams:
        state = engine.new_state()
        lone.append(np.stack([engine.decode_token(state, t) for t in stream[:steps]]))
    engine.close()
    counts = {"staged": 0, "batched rounds in place": 0}
    real_stage, real_round = ggml_pool.SlotPool.stage, ggml_experts._round_in_place

    def stage(self, *a):
        counts["staged"] += 1
        return real_stage(self, *a)

    def in_place(pool, reads, h, ids, *a):
        counts["batched rounds in place"] += ids.shape[0] > 1
        return real_round(pool, reads, h, ids, *a)

    monkeypatch.setattr(ggml_pool.SlotPool, "stage", stage)
    monkeypatch.setattr(ggml_experts, "_round_in_place", in_place)
    monkeypatch.setattr(DeviceReads.__init__, "__defaults__", (64,))  # room for three rows' misses and their reads ahead
    engine = Engine(path, options)
    states = [engine.new_state() for _ in streams]
    batched = np.stack([engine.model.forward_batch(np.array([s[i] for s in streams]), states) for i in range(steps)], axis=1)
    engine.close()
    assert (counts["batched rounds in place"] > 0 or kernel == "on") and counts["staged"] == 0
    for b in range(len(streams)):
        assert np.array_equal(batched[b], lone[b])


def test_the_rounds_of_a_pick_a_row_kept_stay_within_their_bytes_and_the_logits_keep_their_bits(store, monkeypatch):
    # a prompt's rounds (a pick a row) are many splits of many picks: kept by count alone they held ~30 MB on a
    # 19-layer bench model, which under bench/over_memory.py's cap cost the dense weights their pages. Here the
    # bound is set to about two of this model's rounds, so the splits of five prompts must drop older ones
    # (ggml's products: the batched kernel, which takes short prompts where it serves, keeps no rounds)
    path, d, tokens, _ = store
    options = EngineOptions(backend="cpu", store=(str(d),), vram_cache=0, ram_cache=2 << 20, threads=1, expert_kernel="ggml")
    monkeypatch.setattr(DeviceReads.__init__, "__defaults__", (128,))  # room for a prompt's misses: every one in place
    made = []
    real_init = ggml_reads.InPlaceRound.__init__

    def init(self, *a):
        real_init(self, *a)
        made.append(self)

    monkeypatch.setattr(ggml_reads.InPlaceRound, "__init__", init)

    def prompt_logits():
        engine = Engine(path, options)
        logits = [engine.eval(engine.new_state(), tokens[i : i + n], all_logits=True) for i, n in enumerate((16, 13, 11, 9, 7))]
        reads = engine.experts.device.reads
        kept = [g.nbytes for key, g in reads._rounds.items() if key[5]]
        engine.close()
        return logits, kept

    monkeypatch.setattr(ggml_reads, "PER_PICK_KEPT_BYTES", 1 << 40)
    want, kept_unbounded = prompt_logits()  # every round of a pick a row kept
    assert len(kept_unbounded) > 2
    bound = 2 * max(kept_unbounded) + 1
    monkeypatch.setattr(ggml_reads, "PER_PICK_KEPT_BYTES", bound)
    got, kept = prompt_logits()
    assert 0 < sum(kept) <= bound < sum(kept_unbounded)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))  # a round built again: the same bits as one kept
    monkeypatch.setattr(ggml_reads, "PER_PICK_KEPT_BYTES", 0)  # none kept: each built for its call
    made.clear()
    got, kept = prompt_logits()
    assert not kept and made
    assert all(g.ctx is None for g in made)  # each one's ggml memory freed after its call
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_streamed_decode_takes_a_read_buffer_for_each_read_issued_and_none_for_a_guess_dropped_unissued(store, monkeypatch):
    # the next layer's guesses are read ahead as the drives free up, and most are dropped unissued when that
    # step comes: their buffers are taken as they are issued (host_buffer_anywhere), so none is taken for those
    from fomoepy.experts.store_reader import ExpertStore

    path, d, tokens, want = store
    calls = {"takes": 0, "reads": 0}
    real_take, real_submit = DeviceReads.take, ExpertStore.submit

    def take(self, nbytes):
        calls["takes"] += 1
        return real_take(self, nbytes)

    def submit(self, *a, **k):
        calls["reads"] += 1
        return real_submit(self, *a, **k)

    monkeypatch.setattr(DeviceReads, "take", take)
    monkeypatch.setattr(ExpertStore, "submit", submit)
    engine = Engine(path, EngineOptions(backend="cpu", store=(str(d),), vram_cache=0, ram_cache=0))
    state = engine.new_state()
    got = np.stack([engine.decode_token(state, t) for t in tokens])
    ahead = engine.experts.streamer.read_ahead.counts
    engine.close()
    assert ahead.skipped > 0  # guesses were dropped unissued (the case this is about)
    assert calls["takes"] == calls["reads"] > len(tokens)
    assert np.array_equal(got, want["on" if batched_experts.serves(engine.source.layers, batched_experts.AVX512) else "ggml"])  # (the default's)


@pytest.mark.parametrize("pool", ["arena", "python arena", "reused"])
def test_read_buffers_taken_and_given_back_on_many_threads_have_one_holder_each(pool, monkeypatch):
    # a read made ahead takes its buffer on whichever thread issues it: each buffer handed out is its
    # holder's alone until it is given back (each holder fills its buffers with a mark and finds it intact)
    if pool == "python arena":
        monkeypatch.setattr(ggml_reads, "ReadArena", PyReadArena)
    take, errors = (ReadBuffers(max_idle=2) if pool == "reused" else DeviceReads(count=4)).take, []

    def hold(me: int) -> None:
        held = []
        for i in range(2000):
            buf = take(3 * ALIGN).view(np.int64)
            buf[:] = mark = me << 32 | i
            held.append((mark, buf))
            if len(held) > 2 or i % 3 == 0:
                mark, buf = held.pop(0)
                if not (buf == mark).all():
                    errors.append(f"holder {me}: buffer {mark} written by another")
                    return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switched as often as they can be)
    try:
        threads = [threading.Thread(target=hold, args=(me,)) for me in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
