"""Rung 5, whole model: the GPU backend (dense ops + GpuExperts streaming through the expert cache)
against the CPU backend on the oracle models, with the device tier at several sizes and CAR off.

The GPU model is assembled as the engine assembles it for `--backend cuda|hip|sim`: device-resident KV
caches and recurrent states, routing on the device (moe.py calls `ops.route`, GpuBackend's kernel).
Runs the kernel source on the simulated device in CI and, marked `gpu`, on a real one.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import ORACLE, counting_calls, open_oracle_engine
from sim_backend import sim_backend

from fomoepy.errors import FomoeError
from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.device import Phase
from fomoepy.experts.policy import make_policy
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.experts.step import MoEStep
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ATTENTION, ModelSpec
from fomoepy.model.state import DeltaNetState, InferenceState, KVCache
from fomoepy.model.transformer import Transformer, load_weights
from fomoepy.options import EngineOptions
from fomoepy.runtime.backends import open_gpu
from fomoepy.runtime.gpu_experts import GpuExperts, gpu_expert_nbytes

MODELS = sorted(json.loads((ORACLE / "MANIFEST.json").read_text())["models"])
CACHE_FRACTIONS = [0.0, 0.3, 1.0]  # device tier as a share of all experts
LOGIT_TOL = 1e-3  # max |gpu - cpu| / std(cpu logits), the ladder's tolerance against the exact logits


@pytest.fixture(scope="module", params=["sim", pytest.param("device", marks=pytest.mark.gpu)])
def dev(request):
    if request.param == "sim":
        return sim_backend()
    try:
        return open_gpu(os.environ.get("FOMOEPY_TEST_GPU", "auto"))  # cuda or hip: the stand-in runs pick one
    except FomoeError as e:
        pytest.skip(f"no GPU device ({str(e)[:90]}...)")


def gpu_model(dev, name: str, cache_fraction: float):
    gf = GGUFFile(ORACLE / f"{name}.gguf")
    spec = ModelSpec.from_gguf(gf)
    source = GGUFExpertSource(gf, spec)
    unit = [gpu_expert_nbytes(layer) for layer in source.layers]
    budget = int(sum(unit) * spec.moe.n_expert * cache_fraction)
    cache = ExpertCache(spec.moe.n_expert, [layer.expert_nbytes for layer in source.layers], budget, 0, device_expert_bytes=unit)
    weights = load_weights(gf, spec, dev)
    device = GpuExperts(source.layers, dev, weights.routers())
    experts = MoEStep(ExpertStreamer(source, cache, spec.moe.n_expert_used, download=device.download), device)
    return Transformer(spec, weights, dev, experts), spec, device


def device_state(dev, spec: ModelSpec, n_ctx: int) -> InferenceState:
    a, dn = spec.attention, spec.deltanet
    layers = []
    for kind in spec.layer_kinds:
        if kind == ATTENTION:
            shape = (n_ctx, a.n_head_kv, a.head_dim)
            layers.append(KVCache(dev.zeros(shape), dev.zeros(shape)))
        else:
            layers.append(DeltaNetState(dev.zeros((dn.conv_kernel - 1, dn.conv_channels)),
                                        dev.zeros((dn.n_v_heads, dn.state_size, dn.v_head_dim))))  # fmt: skip
    return InferenceState(n_ctx=n_ctx, layers=layers)


@pytest.mark.parametrize("fraction", CACHE_FRACTIONS)
@pytest.mark.parametrize("name", MODELS)
def test_gpu_model_equals_cpu_model_prefill_then_decode(dev, name, fraction):
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    cpu = open_oracle_engine(name).logits(tokens)
    model, spec, experts = gpu_model(dev, name, fraction)
    state = device_state(dev, spec, 64)
    half = len(tokens) // 2
    parts = [np.asarray(model.forward(tokens[:half], state, all_logits=True))]  # prefill: tiled expert kernels
    for t in tokens[half:]:  # decode: one token, the fused down + weighted-sum kernel
        parts.append(np.asarray(model.forward(np.array([t]), state, all_logits=True, phase=Phase.DECODE)))
    gpu = np.concatenate(parts)
    err = np.abs(gpu - cpu).max() / cpu.std()
    assert err <= LOGIT_TOL, f"{name}, device tier {fraction:.0%}: max |gpu - cpu| = {err:.2e} x std"
    assert np.array_equal(gpu.argmax(-1), cpu.argmax(-1))
    if fraction == 1.0:  # every expert now in a device slot: running again copies none
        before = experts.uploads
        model.forward(tokens[:half], device_state(dev, spec, 64))
        assert experts.uploads == before


def test_pingpong_over_two_devices_gives_the_one_device_logits(dev):
    """Two simulated devices, a real pair of GPUs, or two stand-in devices through the real binding."""
    from fomoepy.engine import Engine, EngineOptions

    vendor = dev.rt.vendor
    name = "qwen3moe_q4_k_m"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    logits = []
    for devices in (1, 2):
        try:
            engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=vendor, devices=devices, vram_cache=0))
        except FomoeError as e:
            pytest.skip(f"no {devices} GPU devices ({str(e)[:90]}...)")
        logits.append(engine.eval(engine.new_state(), tokens, all_logits=True))
        engine.experts.close()
    assert np.array_equal(logits[0], logits[1])


def test_a_demoting_policy_copies_device_evictees_down_and_the_logits_stay_exact(dev):
    # a device tier of 30 % and a host tier of every expert under lfu-demote: what the device tier evicts is
    # copied back to the host tier (GpuExperts.download), later served from there, and the logits still match the CPU's
    name = MODELS[0]
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    cpu = open_oracle_engine(name).logits(tokens)
    gf = GGUFFile(ORACLE / f"{name}.gguf")
    spec = ModelSpec.from_gguf(gf)
    source = GGUFExpertSource(gf, spec)
    unit = [gpu_expert_nbytes(layer) for layer in source.layers]
    device = int(sum(unit) * spec.moe.n_expert * 0.3)
    host = sum(layer.expert_nbytes for layer in source.layers) * spec.moe.n_expert
    cache = ExpertCache(spec.moe.n_expert, [layer.expert_nbytes for layer in source.layers], device, host,
                        device_policy=make_policy("lfu-demote"), host_policy=make_policy("lfu-demote"), device_expert_bytes=unit)  # fmt: skip
    weights = load_weights(gf, spec, dev)
    experts = GpuExperts(source.layers, dev, weights.routers())
    streamer = ExpertStreamer(source, cache, spec.moe.n_expert_used, EngineOptions(prefetch=False), download=experts.download)
    model = Transformer(spec, weights, dev, MoEStep(streamer, experts))
    state = device_state(dev, spec, 64)
    gpu = np.concatenate([np.asarray(model.forward(np.array([t]), state, all_logits=True, phase=Phase.DECODE)) for t in tokens])
    assert np.abs(gpu - cpu).max() / cpu.std() <= LOGIT_TOL
    s = streamer.cache.stats.summary()
    assert experts.downloads == s["host"]["demoted"] > 0 and s["host"]["hits"] > 0
    experts.sync_downloads()  # the copies down are not waited for by the step: the host reads them here
    for key, parts in streamer.host_slots.items():  # the bytes that came down are the expert's own
        assert all(np.array_equal(np.frombuffer(np.ascontiguousarray(a), np.uint8), np.frombuffer(np.ascontiguousarray(b), np.uint8))
                   for a, b in zip(parts, source.read(*key)))  # fmt: skip


def test_a_decode_step_reads_its_routing_and_the_next_layers_prediction_back_in_one_trip(dev):
    # route_ahead: the router's choice and the next layer's predicted ids come back in one copy and one
    # synchronisation, where a second round trip per layer used to fetch the prediction. Same logits and
    # the same predictions (counted by the streamer) either way.
    name = MODELS[0]
    tokens = np.load(ORACLE / f"{name}.tokens.npy")[:6]
    runs = []
    for ahead in (True, False):
        model, spec, experts = gpu_model(dev, name, 0.3)
        if not ahead:
            experts.route_ahead = None  # the step then asks device.route for the prediction, as before
        state = device_state(dev, spec, 64)
        model.forward(tokens[:2], state)
        # the host's waits for the compute stream, as the shim counts them: also those a compiled read-back
        # makes in its own C call (DecodeRoute, where the binding's C functions are), which no Python call shows
        waits = dev.rt.syncs(dev.stream)
        logits = [np.asarray(model.forward(np.array([t]), state, phase=Phase.DECODE)) for t in tokens[2:]]
        p = model.experts.streamer.prefetch_stats
        runs.append((dev.rt.syncs(dev.stream) - waits, np.concatenate(logits), p.predicted, p.correct))
    (with_ahead, logits_a, predicted_a, correct_a), (without, logits_b, predicted_b, correct_b) = runs
    moe_layers = spec.n_layer - 1  # the last layer predicts nothing
    assert without - with_ahead == moe_layers * len(tokens[2:])
    assert np.array_equal(logits_a, logits_b) and (predicted_a, correct_a) == (predicted_b, correct_b) and predicted_a > 0
