"""Expert reads into pinned memory (fomoepy.runtime.pinned) on the simulated device: a copy up reads the
buffer in place, so the pool must not hand the buffer out again while such a copy may still be queued.
With deferred streams a queued copy runs only when something needs it, so reusing the buffer too early
overwrites the bytes the copy has not read yet, every time."""

from __future__ import annotations

import numpy as np
import pytest
from sim_backend import sim_backend

from fomoepy.runtime.pinned import ALIGN, PinnedPool
from fomoepy.runtime.sim.shim import configure


@pytest.fixture
def deferred():
    before = configure(deferred=True)
    yield
    configure(**before)


def test_a_buffer_comes_back_when_its_last_view_is_dropped_and_is_recognised_as_pinned():
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN)  # one buffer per chunk: a take after a give reuses it
    buf = pool.take(10_000)
    assert buf.nbytes == 3 * ALIGN and buf.ctypes.data % ALIGN == 0
    view = buf[100:200]
    assert pool.holds(view) and pool.holds(buf) and not pool.holds(np.zeros(16, np.uint8))
    address = buf.ctypes.data
    del buf
    assert not pool.returned  # a view still holds it
    del view
    assert [a for a, _ in pool.returned] == [address]
    assert pool.take(10_000).ctypes.data == address  # the same buffer, handed out again


def test_a_buffer_is_not_reused_while_a_copy_from_it_is_still_queued(deferred):
    dev = sim_backend()
    pool = PinnedPool(dev.rt, [dev.copy_stream], chunk_bytes=ALIGN)
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


def test_an_engine_with_a_store_copies_every_miss_straight_from_its_pinned_read(tmp_path):
    """The simulated device under the engine, tiers far smaller than the experts: every expert read from
    the store lands in pinned memory and goes up without a staging copy, demoted ones come down into
    pinned memory, and the logits are the CPU backend's."""
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
                         + [engine.decode(state, int(t))[None] for t in tokens[half:]])  # fmt: skip
    device = engine.experts.device
    cpu = open_oracle_engine(name).logits(tokens)
    assert np.abs(got - cpu).max() / cpu.std() <= 1e-3  # the ladder's GPU tolerance (test_gpu_model.py)
    assert device.uploads > 0 and device.direct_uploads == device.uploads
    assert device.downloads > 0  # lfu-cooc demoted some, into pinned memory, and copied them up again
    engine.close()
