"""The simulated device under the engine: layer placements over several simulated devices, and the
ordering of expert uploads by events (deferred streams).

The same checks run through the real bindings over stand-in drivers in test_standin_bindings.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import ORACLE, open_oracle_engine

from fomoepy.experts.device import Phase
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
