"""The simulated device under the engine: layer placements over several simulated devices, and the
ordering of expert copies by events (deferred streams: a stream runs only what a sync or an event
needs, and the host sees a device-to-host copy only once it syncs that copy's stream).

The same checks run through the real bindings over stand-in drivers in test_standin_bindings.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import ORACLE, open_oracle_engine

from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.device import Phase
from fomoepy.experts.policy import make_policy
from fomoepy.experts.routing import Routing
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.experts.step import MoEStep
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.options import EngineOptions
from fomoepy.runtime.sim.shim import configure

# the simulated device itself, or (test_standin_bindings.py) cuda / hip through the real binding
BACKEND = os.environ.get("FOMOEPY_TEST_GPU", "sim")
LOGIT_TOL = 1e-3  # max |gpu - cpu| / std(cpu logits), the ladder's tolerance against the exact logits



def sim_engine_logits(name: str, **options) -> np.ndarray:
    """Prefill half the oracle tokens, decode the rest, on the simulated device through the Engine."""
    from fomoepy.engine import Engine, EngineOptions

    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=BACKEND, **options))
    state = engine.new_state()
    half = len(tokens) // 2
    parts = [engine.eval(state, tokens[:half], all_logits=True)]
    parts += [engine.eval(state, [t], all_logits=True, phase=Phase.DECODE) for t in tokens[half:]]
    engine.experts.close()
    return np.concatenate(parts)


@pytest.mark.skipif(BACKEND != "sim", reason="three devices and blocks: on the simulated device")
@pytest.mark.parametrize("name", ["qwen35moe_q4_k", "qwen3moe_q4_k_m"])
def test_placements_over_simulated_devices_give_the_one_device_logits(name):
    """Ping-pong and blocks over 2 and 3 devices: the same kernels in the same order, so the same
    bits; the simulator refuses a launch that reads another device's memory, so a hidden state or a
    router input left on the wrong device fails here rather than passing through shared memory."""
    one = sim_engine_logits(name, vram_cache=0)
    for devices, placement in ((2, "pingpong"), (3, "pingpong"), (2, "blocks")):
        got = sim_engine_logits(name, devices=devices, placement=placement, vram_cache=0)
        assert np.array_equal(got, one), f"{devices} devices, {placement}"


@pytest.fixture
def deferred_streams():
    if BACKEND != "sim":  # the stand-in drivers read FOMOE_STANDIN_DEFERRED when they load
        if os.environ.get("FOMOE_STANDIN_DEFERRED") != "1":
            pytest.skip("the stand-in drivers run deferred only with FOMOE_STANDIN_DEFERRED=1")
        yield
        return
    before = configure(deferred=True)
    yield
    configure(**before)


def test_expert_uploads_are_ordered_by_events_not_by_luck(monkeypatch, deferred_streams):
    """Deferred streams run work only when a wait or a sync needs it: the compute stream's wait on
    the copy stream is then the only thing that puts each expert in its slot before the grouped
    launch reads it. Without that one wait the logits are wrong, every time."""
    from fomoepy.runtime.gpu_experts import GpuExperts

    name = "qwen3moe_q4_k_m"
    cpu = open_oracle_engine(name).logits(np.load(ORACLE / f"{name}.tokens.npy"))
    good = sim_engine_logits(name, vram_cache=0)
    assert np.abs(good - cpu).max() / cpu.std() <= LOGIT_TOL

    real_compute = GpuExperts.compute

    def compute_without_the_wait(self, layer, h, ids, weights, experts):
        side = self.side(layer)
        real_wait = side.rt.wait
        side.rt.wait = lambda stream, event: None if event == side.copied else real_wait(stream, event)
        try:
            return real_compute(self, layer, h, ids, weights, experts)
        finally:
            del side.rt.wait

    monkeypatch.setattr(GpuExperts, "compute", compute_without_the_wait)
    bad = sim_engine_logits(name, vram_cache=0)
    assert not np.abs(bad - cpu).max() / cpu.std() <= LOGIT_TOL  # NaN (never-written slots) or wrong


# -- the copies' waits, through the routed-expert interface (whichever module issues them) -------------


def expert_tiers(device_experts: int, host: bool):
    """The MoE step with GpuExperts over the first oracle model's layer 0, a device tier of
    `device_experts` slots and (host) a host tier of every expert under lfu-demote, so that device
    evictees are copied down."""
    from fomoepy.runtime.backends import open_gpu
    from fomoepy.runtime.gpu_experts import GpuExperts, gpu_expert_nbytes

    gf = GGUFFile(ORACLE / "qwen3moe_q4_k_m.gguf")
    spec = ModelSpec.from_gguf(gf)
    source = GGUFExpertSource(gf, spec)
    unit = [gpu_expert_nbytes(layer) for layer in source.layers]
    store = [layer.expert_nbytes for layer in source.layers]
    policies = {"device_policy": make_policy("lfu-demote"), "host_policy": make_policy("lfu-demote")} if host else {}
    cache = ExpertCache(spec.moe.n_expert, store, unit[0] * device_experts, sum(store) * spec.moe.n_expert if host else 0,
                        device_expert_bytes=unit, **policies)  # fmt: skip
    device = GpuExperts(source.layers, open_gpu(BACKEND))
    streamer = ExpertStreamer(source, cache, spec.moe.n_expert_used, EngineOptions(prefetch=False), download=device.download)
    return MoEStep(streamer, device, predicts=False), spec, source


def steps(spec, n: int, seed: int = 0):
    """n single-token steps of layer 0: (h, the router's choice), each choosing k distinct experts."""
    rng = np.random.default_rng(seed)
    E, k = spec.moe.n_expert, spec.moe.n_expert_used
    for _ in range(n):
        ids = np.sort(rng.choice(E, k, replace=False))[None, :]
        w = rng.dirichlet(np.ones(k)).astype(np.float32)[None, :]
        yield rng.standard_normal((1, spec.n_embd)).astype(np.float32), Routing(ids, w, np.full((1, E), 1 / E, np.float32))


def test_steps_issued_back_to_back_compute_what_steps_read_one_by_one(deferred_streams):
    """No device tier: every expert streams through a slot that is free again after its step, so the
    next step's copies overwrite slots the last step's kernels read. Issued back to back with no read-
    back between them (as a schedule that copies a layer ahead issues them), the copies must wait for
    those kernels: deferred streams run the copies when the staging ring needs its buffers and the
    kernels only when the outputs are read, so without that wait the early steps compute on the
    later steps' experts."""
    experts, spec, _ = expert_tiers(0, host=False)
    one_by_one = []
    for h, exact in steps(spec, 6):
        experts.begin_step(Phase.DECODE)
        one_by_one.append(np.asarray(experts(0, h, exact)))
        experts.end_step(1)
    back_to_back = []
    for h, exact in steps(spec, 6):
        experts.begin_step(Phase.DECODE)
        back_to_back.append(experts(0, h, exact))
        experts.end_step(1)
    for i, (a, b) in enumerate(zip(one_by_one, back_to_back)):
        assert np.array_equal(a, np.asarray(b)), f"step {i}"
    experts.close()


def test_a_demoted_expert_is_in_the_host_tier_once_its_step_returns(deferred_streams):
    """lfu-demote over a device tier of 4 slots: each step evicts experts, whose bytes are copied down
    into the host tier, from where a later step copies them up (on the same stream: no wait needed). The
    step does not wait for the copies down; a host reader of those bytes syncs them (sync_downloads).
    Then every demoted expert's host slot holds the expert's store bytes, and a later step's copy up of
    one (stream order, with no sync between) computes what the CPU backend does (the other tests here)."""
    experts, spec, source = expert_tiers(4, host=True)
    for i, (h, exact) in enumerate(steps(spec, 8)):
        experts.begin_step(Phase.DECODE)
        np.asarray(experts(0, h, exact))
        experts.end_step(1)
        experts.device.sync_downloads()
        for key, parts in experts.streamer.host_slots.items():
            for got, want in zip(parts, source.read(*key)):
                assert np.array_equal(np.frombuffer(np.ascontiguousarray(got), np.uint8), np.frombuffer(np.ascontiguousarray(want), np.uint8)), f"step {i}: {key}"
    assert experts.device.downloads > 0
    experts.close()


def test_an_installed_expert_copied_down_before_any_step_comes_back_whole(deferred_streams):
    """An install's copy up is queued outside a step, with nothing joining it yet; a copy down of that
    slot right after (a demotion before any step ran) must follow it on the device: deferred streams run
    the copy stream only when something waits for it, so a copy down that did not wait reads an empty
    slot. A step's own copies up fill slots no expert holds yet, which no copy down reads: the copy
    down does not join those (the reason the install's case is told apart)."""
    experts, spec, source = expert_tiers(4, host=True)
    device = experts.device
    keys = [(0, 3), (0, 5)]
    for key in keys:
        device.install(key, source.read(*key))
    got = [device.download(key) for key in keys]
    device.sync_downloads()
    for key, parts in zip(keys, got):
        for a, b in zip(parts, source.read(*key)):
            assert np.array_equal(np.frombuffer(np.ascontiguousarray(a), np.uint8), np.frombuffer(np.ascontiguousarray(b), np.uint8)), key
    experts.close()


def test_a_step_that_fails_between_its_begin_and_its_compute_gives_its_slots_back():
    """GpuExperts.begin takes a slot for every expert the tier lacks before the plan; a plan commit that
    raises after it (a step that never reaches compute) leaves them with the device. The next step, of
    the same layer, gives them back rather than computing with that step's tables: every slot the device
    ever allocated is then held, free or waiting for its copy down, and the steps after compute what
    steps that never saw the failure compute."""
    from conftest import counting_calls

    experts, spec, _ = expert_tiers(4, host=True)
    device, cache = experts.device, experts.streamer.cache
    want = []
    clean, _, _ = expert_tiers(4, host=True)
    for h, exact in steps(spec, 8, seed=1):
        clean.begin_step(Phase.DECODE)
        want.append(np.asarray(clean(0, h, exact)))
        clean.end_step(1)
    clean.close()
    got = []

    def failing_commit(plan):
        raise RuntimeError("commit failed")

    slot = device.slot_layouts[0].nbytes
    with counting_calls(device.sides[0].rt, "malloc", which=lambda nbytes: nbytes == slot) as allocations:
        for i, (h, exact) in enumerate(steps(spec, 8, seed=1)):
            if i == 4:  # this step fails after its begin, then runs again
                cache.commit = failing_commit
                experts.begin_step(Phase.DECODE)
                with pytest.raises(RuntimeError, match="commit failed"):
                    experts(0, h, exact)
                del cache.commit
                assert device._begun is not None and device._begun.slots, "the failed step took no slot: the test proves nothing"
            experts.begin_step(Phase.DECODE)
            got.append(np.asarray(experts(0, h, exact)))
            experts.end_step(1)
    side = device.sides[0]
    held = len(device.resident) + sum(len(v) for v in side.free.values()) + len(side.dirty)
    assert allocations[0] == held, f"{allocations[0]} slots allocated, {held} held"
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"step {i}"
    experts.close()


def test_a_steps_record_splits_its_host_time_at_its_reads():
    """StepTiming.before_reads and after_landed: the host's time in series with a step's reads, from its
    start until they were issued and from the last one's landing to its return (fomoe plan overlaps the
    rest with them). Made slow on purpose: finding the experts no tier holds (30 ms) counts before the
    reads; the cache plan (30 ms), made once they are issued, and a device's 30 ms of work before it
    waits for them count in neither part. StepTiming.before_launch: from the start to the device's first
    launch, after all three (fomoe plan's `[host] before_launch`: the device computes from then)."""
    import time

    experts, spec, _ = expert_tiers(0, host=False)
    cache, device = experts.streamer.cache, experts.device
    real_uncached, real_plan, real_compute = cache.uncached, cache.plan, device.compute
    cache.uncached = lambda *a, **k: time.sleep(0.03) or real_uncached(*a, **k)
    cache.plan = lambda *a, **k: time.sleep(0.03) or real_plan(*a, **k)
    device.compute = lambda *a, **k: time.sleep(0.03) or real_compute(*a, **k)
    experts.records = []
    try:
        for h, exact in steps(spec, 3):
            experts.begin_step(Phase.DECODE)
            experts(0, h, exact)
            experts.end_step(1)
    finally:
        del cache.uncached, cache.plan, device.compute
    for r in experts.records:
        assert 0.03 <= r.before_reads < 0.06 and r.before_reads <= r.route + r.plan
        assert 0.0 <= r.after_landed <= r.compute + r.release
        assert r.total - r.before_reads - r.after_landed >= 0.06  # the plan and the device's part beside the reads
        # (the first launch comes before the device's part ends: within route + plan + the reads' wait + compute,
        # the step's time until then; without the wait the bound failed once the launch followed a wait)
        assert 0.09 <= r.before_launch <= r.route + r.plan + r.wait + r.compute
    experts.close()
