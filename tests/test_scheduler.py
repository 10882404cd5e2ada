"""Placement of layers on devices and the hidden-state relay: N logical CPU devices give the same
logits as one, bit for bit, and each device's expert tier holds only its own layers' experts."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.runtime.cpu_experts import ready_expert_nbytes
from fomoepy.scheduler import Placement


def test_pingpong_alternates_and_blocks_are_contiguous():
    assert Placement.pingpong(5, 2).device_of_layer == (0, 1, 0, 1, 0)
    assert Placement.blocks(5, 2).device_of_layer == (0, 0, 0, 1, 1)
    assert Placement.blocks(7, 3).device_of_layer == (0, 0, 0, 1, 1, 2, 2)
    assert Placement.pingpong(5, 2).relays() == 4
    assert Placement.blocks(5, 2).relays() == 1
    assert Placement.parse("0,1,1", 3, 2).device_of_layer == (0, 1, 1)


@pytest.mark.parametrize(
    "text, n_devices, message",
    [
        ("0,1", 2, "lists 2 devices, the model has 3 layers"),
        ("0,2,1", 2, "names device 2"),
        ("zigzag", 2, "must be pingpong, blocks or one device index per layer"),
        ("pingpong", 0, "--devices must be >= 1"),
    ],
)
def test_bad_placements_are_clear_errors(text, n_devices, message):
    with pytest.raises(FomoeError, match=message):
        Placement.parse(text, 3, n_devices)


@pytest.mark.parametrize("name", ["qwen3moe_q4_k_m", "qwen35moe_q4_k"])
@pytest.mark.parametrize("devices, placement", [(2, "pingpong"), (3, "pingpong"), (2, "blocks"), (3, "blocks"), (2, "1,0,0,1")])
def test_logical_devices_give_the_single_device_logits(name, devices, placement):
    if placement == "1,0,0,1" and name == "qwen3moe_q4_k_m":
        placement = "1,0,1"  # 3 layers
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    one = Engine(ORACLE / f"{name}.gguf", EngineOptions(vram_cache=0))
    many = Engine(ORACLE / f"{name}.gguf", EngineOptions(vram_cache=0, devices=devices, placement=placement))
    assert many.placement.n_devices == devices
    assert np.array_equal(many.logits(tokens), one.logits(tokens))
    # prefill then decode through the relays
    s1, s2 = one.new_state(), many.new_state()
    for part in (tokens[:5], tokens[5:6], tokens[6:7]):
        assert np.array_equal(many.eval(s2, part, all_logits=True), one.eval(s1, part, all_logits=True))


def test_each_device_tier_holds_its_own_layers_experts():
    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    probe = Engine(path, EngineOptions(vram_cache=0))
    unit = ready_expert_nbytes(probe.source.layers[0])
    engine = Engine(path, EngineOptions(vram_cache=4 * unit, devices=2, placement="pingpong"))
    engine.logits(np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy"))
    cache = engine.experts.streamer.cache
    assert len(cache.devices) == 2
    for d, tier in enumerate(cache.devices):
        assert 0 < tier.used <= 4 * unit  # a budget per device
        assert all(engine.placement.device_of_layer[layer] == d for layer, _ in tier.keys())


def test_profile_timing_reports_every_layer(capsys):
    from fomoepy.cli import main

    code = main(["generate", str(ORACLE / "qwen3moe_q4_k_m.gguf"), "-p", "hi", "-n", "3", "--temp", "0",
                 "--devices", "2", "--profile-timing"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    assert "placement: 2 devices, 2 relays per token" in err
    assert "host time per MoE layer step" in err and "attn+dense" in err


@pytest.mark.parametrize("backend", ["reference", "sim"])
def test_profile_timing_on_a_backend_whose_products_it_does_not_time_puts_them_in_the_rest(backend):
    # only the cpu backend's ggml products are timed apart (timing.MATMUL); numpy's, or a GPU's work and the
    # host's waits for it, are in the rest, which the line must not call host time beside zero products
    engine = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(backend=backend, profile_timing=True))
    engine.logits(np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")[:4])
    total, matmul, wait, rest = engine.timer.host_seconds()
    assert matmul == 0 and rest > 0
    assert engine.timer.report()[-1] == (f"per layer step: {total * 1e6:.0f} µs = waiting for reads {wait * 1e6:.0f} + the rest "
                                         f"{rest * 1e6:.0f} (compute and host work together: only the cpu backend times its products apart)")  # fmt: skip
    engine.close()
