"""The backfill thread: substituted originals come back into DRAM (the host tier; on the cpu backend,
which has none, its one tier of ggml slots), and backfill never stands between a step and its own reads.

What happens to a backfill read already in flight when a step needs the disk: it finishes (one expert's
read; reads are not interrupted), on the backfill thread, while the step's reads go through the store's
own pool at once, so the step never waits for it; no new backfill read starts until the step's reads are
done (`set_io_busy`)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.experts.car import CarConfig
from fomoepy.experts.store_writer import prepare_store
from fomoepy.runtime.cpu_experts import ready_expert_nbytes
from fomoepy.runtime.gpu_experts import gpu_expert_nbytes
from fomoepy.sampling import SamplingParams

MODEL = ORACLE / "qwen3moe_q4_k_m.gguf"


def one_device_expert() -> int:
    e = Engine(MODEL, EngineOptions(vram_cache=0))
    return ready_expert_nbytes(e.source.layers[0])


def test_substituted_originals_come_back_with_the_backfill_thread():
    # CAR substitutes cached experts for uncached ones; the thread reads the originals into DRAM. No
    # --store and no --ram-cache: the DRAM tier's default must then leave backfill room (it was 0)
    car = CarConfig(threshold=0.01)
    engine = Engine(MODEL, EngineOptions(vram_cache=6 * one_device_expert(), car=car, backfill="thread", prefetch=False))
    streamer = engine.experts.streamer
    assert streamer.cache.host.capacity > 0
    requested: set = set()
    real = streamer._backfill_thread.request
    streamer._backfill_thread.request = lambda key, score, now: (requested.add(key), real(key, score, now))[1]
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    list(engine.generate(tokens[:4], 24, SamplingParams(temperature=0.9, seed=1), stop_at_eog=False))
    stats = engine.stats()
    held = {(layer, e) for layer in range(engine.spec.n_layer) for e in streamer.cache.resident(layer, "host")}
    engine.close()
    assert stats["car"]["substitution_rate"] > 0 and requested
    assert stats["backfilled"] > 0 and held & requested  # originals came back into DRAM


def cpu_engine_with_backfill(tmp_path, mode: str) -> tuple[Engine, list]:
    """The cpu backend streaming from a store (its only tier: its slots, no host tier), CAR and backfill on;
    and the list of keys backfill has installed into slots, as the step takes them."""
    store = tmp_path / "store"
    prepare_store(MODEL, [store], progress=False)
    unit = Engine(MODEL, EngineOptions(backend="cpu")).source.layers[0].expert_nbytes
    engine = Engine(MODEL, EngineOptions(backend="cpu", store=(str(store),), ram_cache=12 * unit, car=CarConfig(threshold=0.01),
                                         backfill=mode, backfill_per_token=4, prefetch=False))  # fmt: skip
    assert not engine.experts.streamer.cache.host.enabled
    return engine, recorded_installs(engine.experts.streamer)


def recorded_installs(streamer) -> list:
    """The list of keys backfill will install into the device tier's slots, as the step takes them."""
    installed: list = []
    real = streamer.take_device_changes

    def take_device_changes():
        changes = real()
        installed.extend(key for key, parts in changes if parts is not None)
        return changes

    streamer.take_device_changes = take_device_changes
    return installed


def check_slots_hold_what_the_cache_says(engine: Engine, installed: list) -> int:
    """The slots hold exactly the cache's device tier, and each installed expert still held computes from its
    slot what its store bytes compute; returns how many were checked."""
    streamer, device = engine.experts.streamer, engine.experts.device
    held = {(layer, e) for layer in range(engine.spec.n_layer) for e in streamer.cache.resident(layer, "device")}
    assert held == {key for layer in range(engine.spec.n_layer) for key in device.pool_of[layer]._slot}
    rng = np.random.default_rng(0)
    checked = 0
    for key in dict.fromkeys(installed):
        pool = device.pool_of[key[0]]
        if key not in pool:
            continue  # evicted since
        h = rng.standard_normal((1, pool.layer.n_embd)).astype(np.float32)
        one = np.ones((1, 1), np.float32)
        from_slot = pool.layer.ffn(h, np.array([[pool.slot(key)]]), one, 1)
        from_store = pool.layer.ffn(h, np.array([[pool.stage(0, streamer.source.read(*key))]]), one, 1)
        np.testing.assert_array_equal(from_slot, from_store)
        checked += 1
    return checked


def test_originals_come_back_into_the_cpu_backends_slots(tmp_path):
    # the cpu backend's only tier is its slots (no host tier): a backfilled original is admitted there and
    # installed into a slot before the next step plans (sync: N a token, repeatable)
    engine, installed = cpu_engine_with_backfill(tmp_path, "sync")
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    list(engine.generate(tokens[:4], 32, SamplingParams(temperature=0.9, seed=1), stop_at_eog=False))
    assert engine.stats()["backfilled"] > 0 and installed
    assert check_slots_hold_what_the_cache_says(engine, installed)
    engine.close()


def test_the_backfill_threads_reads_go_into_the_cpu_backends_slots_at_the_next_step(tmp_path):
    # what the thread has read is taken at the next MoE step, admitted to the slots' tier and installed
    # before that step plans (the tier is empty here: it has room); decided by order, not by time
    engine, installed = cpu_engine_with_backfill(tmp_path, "thread")
    thread = engine.experts.streamer._backfill_thread
    thread.request((0, 5), 0.9, 0)
    deadline = time.monotonic() + 10
    while thread.done.empty():
        assert time.monotonic() < deadline, "the backfill thread never read"
        time.sleep(0.005)
    engine.logits(np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")[:1])
    assert installed[:1] == [(0, 5)] and engine.stats()["backfilled"] >= 1
    check_slots_hold_what_the_cache_says(engine, installed)
    engine.close()


@pytest.mark.parametrize("backend", ["sim", pytest.param("device", marks=pytest.mark.gpu)])
def test_with_no_host_tier_a_gpus_backfilled_originals_go_into_its_slots(tmp_path, backend):
    # --ram-cache 0 on a GPU backend: no host tier, so a backfilled original is admitted to the device tier
    # and copied up into a slot before the next step plans; the slots then hold exactly that tier, and each
    # backfilled expert still held copies down as its store bytes
    backend = os.environ.get("FOMOEPY_TEST_GPU", "cuda") if backend == "device" else backend
    try:
        probe = Engine(MODEL, EngineOptions(backend=backend, vram_cache=0))
    except FomoeError as e:
        pytest.skip(f"no GPU device ({str(e)[:90]}...)")
    unit = gpu_expert_nbytes(probe.source.layers[0])
    probe.close()  # (its device memory, before the engine under test takes its tier)
    store = tmp_path / "store"
    prepare_store(MODEL, [store], progress=False)
    engine = Engine(MODEL, EngineOptions(backend=backend, store=(str(store),), vram_cache=12 * unit, ram_cache=0,
                                         car=CarConfig(threshold=0.01), backfill="sync", backfill_per_token=4, prefetch=False))  # fmt: skip
    streamer, device = engine.experts.streamer, engine.experts.device
    assert streamer.backfills_device and not streamer.cache.host.enabled
    installed = recorded_installs(streamer)
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    list(engine.generate(tokens[:4], 32, SamplingParams(temperature=0.9, seed=1), stop_at_eog=False))
    assert engine.stats()["backfilled"] > 0 and installed
    n_layer, n_expert = engine.spec.n_layer, engine.spec.moe.n_expert
    held = {(layer, e) for layer in range(n_layer) for e in streamer.cache.resident(layer, "device")}
    assert held == {(layer, e) for layer in range(n_layer) for e in range(n_expert) if (layer, e) in device.resident}
    still_held = [key for key in dict.fromkeys(installed) if key in held]
    assert still_held
    for key in still_held:
        copied_down = device.download(key)
        device.sync_downloads()
        for part, stored in zip(copied_down, streamer.source.read(*key), strict=True):
            np.testing.assert_array_equal(np.frombuffer(np.ascontiguousarray(part), np.uint8),
                                          np.frombuffer(np.ascontiguousarray(stored), np.uint8))  # fmt: skip
    engine.close()


@pytest.fixture()
def streamer_with_backfill(tmp_path):
    store = tmp_path / "store"
    prepare_store(MODEL, [store], progress=False)
    engine = Engine(MODEL, EngineOptions(store=(str(store),), vram_cache=0, ram_cache=1 << 30,
                                         car=CarConfig(threshold=0.01), backfill="thread", prefetch=False))  # fmt: skip
    yield engine.experts.streamer
    engine.close()


def test_a_step_does_not_wait_for_a_backfill_read_in_flight(streamer_with_backfill):
    streamer = streamer_with_backfill
    thread = streamer._backfill_thread
    started, finish = threading.Event(), threading.Event()
    real = thread.read

    def slow_read(layer, expert):
        started.set()
        finish.wait(10)
        return real(layer, expert)

    thread.read = slow_read
    thread.request((2, 9), 0.9, 0)
    assert started.wait(5)  # the backfill read is in flight, and stays so until `finish`
    t0 = time.perf_counter()
    plan, fetched = streamer.acquire(0, np.array([[1, 2]]))  # a step with two disk reads
    waited = time.perf_counter() - t0
    streamer.release(plan)
    in_flight = not finish.is_set()
    finish.set()
    assert sorted(fetched) == [1, 2] and in_flight and waited < 5


def test_no_backfill_read_starts_while_a_steps_reads_are_in_flight(streamer_with_backfill):
    streamer = streamer_with_backfill
    thread = streamer._backfill_thread
    reads: list = []
    real = thread.read
    thread.read = lambda layer, expert: (reads.append((layer, expert)), real(layer, expert))[1]
    thread.set_io_busy(True, 0)  # what acquire says while its reads are in flight
    thread.request((1, 3), 0.8, 0)
    time.sleep(0.2)
    assert reads == []  # held back
    thread.set_io_busy(False, 0)
    deadline = time.monotonic() + 5
    while not reads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reads == [(1, 3)]
