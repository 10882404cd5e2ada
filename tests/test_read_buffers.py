"""fomoepy.experts.read_buffers: expert reads land in buffers reused from read to read, where no device's
pinned pool or read arena gives them (the reference backend over a store)."""

from __future__ import annotations

import gc
import threading

import numpy as np
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.read_buffers import ReadBuffers
from fomoepy.experts.store_writer import prepare_store
from fomoepy.runtime.pinned import ALIGN


def test_a_buffer_comes_back_when_its_last_view_goes_and_is_handed_out_again():
    pool = ReadBuffers()
    a = pool.take(10_000)
    assert a.nbytes == 10_000 and a.ctypes.data % ALIGN == 0 and a.flags.c_contiguous and a.flags.writeable
    address = a.ctypes.data
    part = a[4096:8192]  # a view of it (an expert's part) keeps it held
    del a
    gc.collect()
    b = pool.take(10_000)
    assert b.ctypes.data != address  # still held through `part`: a new one
    del part
    c = pool.take(10_000)
    assert c.ctypes.data == address and pool.allocated == 2  # given back, handed out again, not allocated
    assert c.ctypes.data != b.ctypes.data  # two buffers held at once are two


def test_buffers_given_back_on_another_thread_are_reused():
    pool = ReadBuffers()
    held = [pool.take(8192) for _ in range(4)]
    addresses = {a.ctypes.data for a in held}
    t = threading.Thread(target=held.clear)  # the last views dropped elsewhere (a store's reader)
    t.start()
    t.join()
    assert pool.take(8192).ctypes.data in addresses and pool.allocated == 4


def test_at_most_max_idle_buffers_are_kept_unheld():
    pool = ReadBuffers(max_idle=3)
    held = [pool.take(4096) for _ in range(8)]
    del held
    assert pool.idle == 3  # the other five were freed
    again = [pool.take(4096) for _ in range(5)]
    assert pool.allocated == 8 + 2 and len(again) == 5  # three reused, two allocated anew


def test_a_streamed_decode_reads_into_reused_buffers_and_computes_the_same(tmp_path):
    # (the reference backend's device gives no buffers of its own: the cpu backend's reads land in its read
    # arena, tests/test_ggml_reads.py)
    name = "qwen3moe_q4_k_m"
    path = ORACLE / f"{name}.gguf"
    prepare_store(path, [tmp_path / "store"], progress=False)
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    resident = Engine(path, EngineOptions(backend="reference"))
    want = np.stack([resident.decode_token(s, int(t)) for s in [resident.new_state()] for t in tokens])
    resident.close()
    engine = Engine(path, EngineOptions(backend="reference", store=(str(tmp_path / "store"),), vram_cache=0, ram_cache=0))
    streamer = engine.experts.streamer
    state = engine.new_state()
    got = np.stack([engine.decode_token(state, int(t)) for t in tokens])
    reads = engine.stats()["cache"]["disk"]["reads"]
    pool = streamer.read_buffers
    assert pool is not None and reads > 4 * pool.max_idle, "too few reads: the test proves nothing"
    assert pool.allocated <= 2 * pool.max_idle  # bounded by what is in flight and kept, not by the reads
    assert np.array_equal(got, want)
    engine.close()
