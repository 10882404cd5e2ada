"""The ggml CPU backend (`--backend cpu`): products on quantized bytes against numpy, logits against
llama.cpp's on every oracle model, streamed == resident bit for bit, and the --vram-cache error."""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest
from conftest import ORACLE
from float32_bounds import U, reorder_bound
from gguf import GGMLQuantizationType as QT

from fomoepy import quants
from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.experts.device import Phase
from fomoepy.experts.store_writer import prepare_store
from fomoepy.runtime import batched_experts
from fomoepy.runtime.ggml_matmul import (
    QuantMatrix,
    expert_ffn,
    fresh_expert_ffn,
    fresh_mul_mat,
    mul_mat,
)

F32 = np.float32
# the type ggml rounds the activations to before a product with each weight type, and that rounding's
# largest error per element: Q8 blocks (Q8_0 for 32-blocks, Q8_K for 256-blocks) round x to
# amax/127 steps (error ≤ amax/254 of its block; the 256-block's amax bounds either), F16/BF16 round
# each element to 11/8 significant bits
QUANT_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
FLOAT_TYPES = {QT.F32: 0.0, QT.F16: 2.0**-11, QT.BF16: 2.0**-8}


def activation_error(x: np.ndarray, qtype) -> np.ndarray:
    if qtype in FLOAT_TYPES:
        return np.abs(x) * FLOAT_TYPES[qtype]
    blocks = np.abs(x).reshape(x.shape[0], -1, 256).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks / 254.0, x.reshape(x.shape[0], -1, 256).shape).reshape(x.shape)


def quantized(rng, qtype, n, k):
    w = rng.standard_normal((n, k)).astype(F32)
    if qtype == QT.F32:
        return w.view(np.uint8).reshape(-1), w
    if qtype == QT.F16:
        return w.astype(np.float16).view(np.uint8).reshape(-1), w.astype(np.float16).astype(F32)
    data = quants.quantize(w, int(qtype))
    return data.reshape(-1), quants.dequantize(data, int(qtype), (n, k))


@pytest.mark.parametrize("qtype", QUANT_TYPES + [QT.F32, QT.F16])
def test_mul_mat_on_quantized_bytes_equals_numpy_within_activation_rounding(qtype):
    rng = np.random.default_rng(int(qtype))
    n, k, t = 96, 512, 3
    data, w = quantized(rng, qtype, n, k)
    x = rng.standard_normal((t, k)).astype(F32)
    got = mul_mat(x, QuantMatrix.of(data, int(qtype), (n, k)), threads=2)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    # rounding the activations, then a float32 sum of k products in ggml's order
    bound = activation_error(x, qtype) @ np.abs(w.T) + 2 * k * U * (np.abs(x) @ np.abs(w.T))
    assert got.shape == (t, n)
    assert np.all(np.abs(got - want) <= bound * 1.01 + 1e-30)


def test_expert_ffn_is_swiglu_of_the_quantized_experts_and_independent_of_its_neighbours():
    rng = np.random.default_rng(7)
    d, f = 256, 64
    h = rng.standard_normal((4, d)).astype(F32)
    experts = []
    for _ in range(3):
        gate, up, down = quantized(rng, QT.Q8_0, f, d), quantized(rng, QT.Q8_0, f, d), quantized(rng, QT.Q8_0, d, f)
        experts.append((QuantMatrix.of(gate[0], 8, (f, d)), QuantMatrix.of(up[0], 8, (f, d)), QuantMatrix.of(down[0], 8, (d, f))))
    rows = [np.array([0, 2]), np.array([1]), np.array([0, 1, 3])]
    together = expert_ffn(h, [(r, *e) for r, e in zip(rows, experts)], threads=2)
    for r, e, y in zip(rows, experts, together):
        alone = expert_ffn(h, [(r, *e)], threads=1)[0]
        assert np.array_equal(y, alone)  # one thread or two, alone or with others: the same bits
        a, b = mul_mat(h[r], e[0], 1), mul_mat(h[r], e[1], 1)
        assert np.array_equal(y, mul_mat(a / (F32(1) + np.exp(-a)) * b, e[2], 1))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_steps_cached_graphs_equal_graphs_built_for_the_call(threads):
    # one token: the graph is built once per type and shape and reused with new pointers; every call,
    # with other weights and inputs each time, must give the bits of a graph built for it alone
    rng = np.random.default_rng(11)
    d, f = 256, 64
    for step in range(3):
        h = rng.standard_normal((1, d)).astype(F32)
        types = [QT.Q4_K, QT.Q6_K, QT.Q8_0] if step != 1 else [QT.Q8_0, QT.Q8_0, QT.Q8_0]
        experts = []
        for _ in range(4):
            gate, up = quantized(rng, types[0], f, d), quantized(rng, types[1], f, d)
            down = quantized(rng, types[2], d, f)
            experts.append((np.zeros(1, np.int64), QuantMatrix.of(gate[0], int(types[0]), (f, d)),
                            QuantMatrix.of(up[0], int(types[1]), (f, d)), QuantMatrix.of(down[0], int(types[2]), (d, f))))  # fmt: skip
        cached, fresh = expert_ffn(h, experts, threads), fresh_expert_ffn(h, experts, threads)
        assert len(cached) == 4 and all(np.array_equal(a, b) for a, b in zip(cached, fresh))
        w = experts[step][1]
        assert np.array_equal(mul_mat(h, w, threads), fresh_mul_mat(h, w, threads))


def test_the_next_layers_prediction_routes_as_the_backends_own_product_on_any_thread_count():
    """GgmlExperts.route runs a few rows' router product on one thread (a decode step's prediction): its
    picks are those of the backend's product on its own threads, whichever layer's router it is."""
    from types import SimpleNamespace

    from fomoepy.experts.routing import softmax_route
    from fomoepy.runtime.ggml_cpu import GgmlBackend
    from fomoepy.runtime.ggml_experts import GgmlExperts

    rng = np.random.default_rng(23)
    d, n_expert, k = 256, 64, 8
    routers = [QuantMatrix.of(quantized(rng, QT.Q8_0, n_expert, d)[0], int(QT.Q8_0), (n_expert, d)) for _ in range(2)]
    ops = GgmlBackend(2)
    device = SimpleNamespace(routers=routers, ops=ops)
    for T in (1, 3, 20):  # 20 rows: past the one-thread path, the backend's own product
        h = rng.standard_normal((T, d)).astype(F32)
        for layer in (0, 1):
            want = softmax_route(ops.linear(h, routers[layer]), k).ids
            assert np.array_equal(GgmlExperts.route(device, layer, h, k), want)


ON_OFF = {False: "off", True: "on"}


@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("T, phase", [(1, Phase.DECODE), (5, Phase.DECODE), (5, Phase.PREFILL), (256, Phase.PREFILL)])  # 256: products per expert
def test_a_steps_experts_sum_the_same_whatever_was_resident_or_at_hand(stored, T, phase, repack):
    """A step's experts through the device's compute: all resident (the one-graph product), none resident
    (every expert set into staging slots, in rounds when they outnumber them), some resident and
    computed while the others are still being read, equal bit for bit, with plain slots and with
    repacked ones (--repack-experts); and with plain slots, a sum of freshly built one-expert graphs in
    the routing's order."""
    from concurrent.futures import Future

    from fomoepy.experts.device import StepExperts
    from fomoepy.runtime.ggml_experts import KERNEL_PROMPT_ROWS, GgmlExperts, expert_matrices, grouped_from

    path, *_ = stored
    engine = Engine(path, EngineOptions(backend="cpu", threads=1, repack_experts=ON_OFF[repack]))
    resident, layer, spec = engine.experts.device, 0, engine.spec
    layers, n_expert, k = resident.layers, spec.moe.n_expert, spec.moe.n_expert_used
    parts, unit = layers[layer].parts, layers[layer].expert_nbytes
    assert len(resident.pool_of[layer]) == n_expert * len(layers)  # the whole model fits: seeded at load
    kernel = any(resident.kernel_layers)  # (as the engine chose)
    none = GgmlExperts(layers, engine.ops, None, n_expert, 0, 2, repack, kernel)  # 2 staging slots: rounds
    some = GgmlExperts(layers, engine.ops, None, n_expert, 3 * unit, k, repack, kernel)
    plain = GgmlExperts(layers, engine.ops, None, n_expert, 0, n_expert, repack=False, kernel=False)
    # with the batched kernel where the CPU runs it (a decode step's picks: fomoepy.runtime.batched_experts)
    kernel = GgmlExperts(layers, engine.ops, None, n_expert, 0, n_expert, repack=False, kernel=True) if batched_experts.vector_kernel() else None
    rng = np.random.default_rng(5 + T)
    every = {e: engine.source.read(layer, e) for e in range(n_expert)}
    for _ in range(3):
        h = rng.standard_normal((T, spec.n_embd)).astype(F32)
        ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(T)])
        weights = rng.dirichlet(np.ones(k), size=T).astype(F32)
        got = resident.compute(layer, h, ids, weights, StepExperts(None, phase, {}, {}, lambda: None))
        assert np.array_equal(none.compute(layer, h, ids, weights, StepExperts(None, phase, dict(every), {}, lambda: None)), got)
        held = [int(e) for e in np.unique(ids)[:3]]
        for e in list(some.pool_of[layer]._slot):
            some.evict(e)
        for e in held:
            some.install((layer, e), every[e])
        late = {e: Future() for e in np.unique(ids).tolist() if e not in held}  # reads in flight
        at_hand: dict = {}
        split = StepExperts(None, phase, at_hand, late, lambda at_hand=at_hand: at_hand.update(every))
        assert np.array_equal(some.compute(layer, h, ids, weights, split), got)
        # each expert's rows as the plain device computes them: a long prefill's as one product per expert
        # (ggml's several-row kernels may sum in another order than a row alone), else each row alone
        grouped = phase is Phase.PREFILL and T >= grouped_from(1)
        chosen = sorted({int(e) for e in ids.ravel()})
        rows = {e: np.flatnonzero((ids == e).any(axis=1)) if grouped else None for e in chosen}
        outs = {}
        if grouped:
            ys = fresh_expert_ffn(h, [(rows[e], *expert_matrices(every[e], parts)) for e in chosen], 1)
            outs = {e: dict(zip(rows[e].tolist(), y)) for e, y in zip(chosen, ys)}
        want = np.zeros_like(h)
        for t in range(T):
            for j in range(k):  # in the routing's order
                e = int(ids[t, j])
                if grouped:
                    y = outs[e][t]
                else:
                    y = fresh_expert_ffn(h[t : t + 1], [(np.zeros(1, np.int64), *expert_matrices(every[e], parts))], 1)[0][0]
                want[t] += y * weights[t, j]
        assert np.array_equal(plain.compute(layer, h, ids, weights, StepExperts(None, phase, dict(every), {}, lambda: None)), want)
        if kernel is not None and (phase is Phase.DECODE or T <= KERNEL_PROMPT_ROWS):  # each pick alone by the kernel, in the routing's order
            want = np.zeros_like(h)
            for t in range(T):
                for j in range(k):
                    e = int(ids[t, j])
                    addresses = np.array([[part.ctypes.data for part in every[e]]], np.uint64)
                    y = batched_experts.pick_outputs(h[t : t + 1], np.zeros(1, np.int32), np.zeros(1, np.int32), addresses,
                                                     tuple(p.qtype for p in parts), parts[0].shape[0], 1)  # fmt: skip
                    want[t] += y[0] * weights[t, j]
            assert np.array_equal(kernel.compute(layer, h, ids, weights, StepExperts(None, phase, dict(every), {}, lambda: None)), want)
    for device in (none, some, plain, kernel):
        if device is not None:
            device.close()
    engine.close()


@pytest.fixture
def grouped_rows(monkeypatch) -> list[int]:
    """The row count of every grouped expert product (SlotLayer.ffn_grouped: a product per expert over
    its tokens) the test's engines run, in order."""
    from fomoepy.runtime.ggml_slots import SlotLayer

    calls: list[int] = []
    real = SlotLayer.ffn_grouped

    def grouped(self, *args):
        calls.append(args[0].shape[0])
        return real(self, *args)

    monkeypatch.setattr(SlotLayer, "ffn_grouped", grouped)
    return calls


@pytest.mark.parametrize("repack", [False, True])
def test_a_long_prefill_runs_each_experts_tokens_as_one_product_and_a_decode_each_row_alone(stored, grouped_rows, repack):
    # GEMM kernels for a long prefill's rows; mul_mat_id's one-row kernels for a short one and for a decode
    # step, whose rows may be several sequences' (a row's bits must not depend on the rows beside it)
    from fomoepy.runtime.ggml_experts import grouped_from

    path, _, tokens, _ = stored
    long = grouped_from(1, repack)
    engine = Engine(path, EngineOptions(backend="cpu", threads=1, n_ctx=3 * long, repack_experts=ON_OFF[repack]))
    state = engine.new_state()
    engine.eval(state, np.resize(tokens, long - 1))  # one token short
    assert not grouped_rows
    engine.eval(state, np.resize(tokens, long), all_logits=True)  # every row read: every layer's experts take them all
    assert grouped_rows == [long] * len(engine.source.layers)
    engine.eval(state, tokens[:6])  # a short chunk
    engine.eval(state, tokens[6:7], phase=Phase.DECODE)
    engine.model.forward_batch(tokens[7:9], [state, engine.new_state()])
    assert grouped_rows == [long] * len(engine.source.layers)
    engine.close()


def test_a_prefill_groups_its_experts_from_the_length_measured_for_the_form_its_slots_have(grouped_rows):
    # F32 experts have no repacked kernels: asked for repacked slots (--repack-experts on) they stay plain,
    # and a prefill takes plain slots' length, not the repacked one's
    from fomoepy.runtime.ggml_experts import grouped_from

    name = "qwen3moe_f32"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    plain, repacked = grouped_from(1, False), grouped_from(1, True)
    assert repacked < plain
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=1, n_ctx=2 * plain, repack_experts="on"))
    assert not any(any(pool.layer.repacked) for pool in engine.experts.device.pools.values())
    engine.eval(engine.new_state(), np.resize(tokens, repacked), all_logits=True)
    assert not grouped_rows
    engine.eval(engine.new_state(), np.resize(tokens, plain), all_logits=True)
    assert grouped_rows == [plain] * engine.spec.n_layer
    engine.close()


MEASURED_TOKENS = 1024  # the longest prefill bench/moe_layer.py measured


@pytest.mark.parametrize("repack", [False, True])
def test_on_several_threads_a_prefill_groups_its_experts_only_from_the_longer_length_measured_for_them(stored, grouped_rows, repack):
    # several threads split one mul_mat_id over the whole layer, where a product per expert splits each
    # small product: mul_mat_id stays faster to longer prefills, over plain slots to every length
    # measured (bench/moe_layer.py)
    from fomoepy.runtime.ggml_experts import grouped_from

    path, _, tokens, _ = stored
    one, many = grouped_from(1, repack), grouped_from(2, repack)
    assert many is None or many > one
    longest = many or MEASURED_TOKENS
    engine = Engine(path, EngineOptions(backend="cpu", threads=2, n_ctx=2 * longest, repack_experts=ON_OFF[repack]))
    engine.eval(engine.new_state(), np.resize(tokens, one))  # long enough for one thread only
    assert not grouped_rows
    engine.eval(engine.new_state(), np.resize(tokens, longest), all_logits=True)
    assert grouped_rows == ([many] * len(engine.source.layers) if many else [])
    engine.close()

ORACLE_MODELS = ["qwen3moe_f32", "qwen3moe_q8_0", "qwen3moe_q6_k", "qwen3moe_q4_k_m", "qwen35moe_f32", "qwen35moe_q4_k"]


@pytest.mark.parametrize("name", ORACLE_MODELS)
def test_cpu_backend_tracks_llamacpp_logits(name, manifest):
    meta = manifest["models"][name]
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    lc = np.load(ORACLE / f"{name}.llamacpp.npy")
    exact = np.load(ORACLE / f"{name}.exact.npy")
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2))
    got = engine.logits(tokens)
    agreement = float(np.mean(got.argmax(-1) == lc.argmax(-1)))
    assert agreement >= meta["argmax_agreement"]
    # no farther from llama.cpp than the exact engine is, or than two float32 orders of the same sums
    # may drift (the F32 models, where both sit at float32 rounding from each other)
    allowed = max(np.abs(exact - lc).max(), reorder_bound(engine.spec, len(tokens)) * np.abs(lc).max())
    assert np.abs(got - lc).max() <= allowed


@pytest.fixture(scope="module", params=["qwen3moe_q4_k_m", "qwen35moe_q4_k"])
def stored(request, tmp_path_factory):
    path = ORACLE / f"{request.param}.gguf"
    store = tmp_path_factory.mktemp("store") / "s"
    prepare_store(path, [store], progress=False)
    tokens = np.load(ORACLE / f"{request.param}.tokens.npy")
    resident = {repack: Engine(path, EngineOptions(backend="cpu", threads=2, repack_experts=repack)).logits(tokens)
                for repack in ("off", "on")}  # fmt: skip
    return path, str(store), tokens, resident


@pytest.mark.parametrize("ram_experts, repack", [(0, "off"), (1, "off"), (5, "off"), (None, "off"), (0, "on"), (5, "on")])
def test_cpu_backend_streamed_equals_resident_bit_for_bit(stored, ram_experts, repack):
    path, store, tokens, resident = stored
    probe = Engine(path, EngineOptions(backend="cpu"))
    unit = probe.source.layers[0].expert_nbytes
    opts = EngineOptions(backend="cpu", threads=1, store=(store,), ram_cache=None if ram_experts is None else ram_experts * unit,
                         repack_experts=repack)  # fmt: skip
    engine = Engine(path, opts)
    assert np.array_equal(engine.logits(tokens), resident[repack])
    # prefill half, then token by token through the same small tier, against the resident engine
    # making the same calls (a prefill and a decode step may add in other orders)
    split = len(tokens) // 2
    ref = Engine(path, EngineOptions(backend="cpu", threads=2, repack_experts=repack))
    state, ref_state = engine.new_state(), ref.new_state()
    assert np.array_equal(engine.model.forward(tokens[:split], state), ref.model.forward(tokens[:split], ref_state))
    for i in range(split, len(tokens)):
        step = tokens[i : i + 1]
        assert np.array_equal(engine.model.forward(step, state, phase=Phase.DECODE), ref.model.forward(step, ref_state, phase=Phase.DECODE))


def test_vram_cache_on_cpu_backend_is_one_clear_error():
    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    cmd = [sys.executable, "-m", "fomoepy.cli", "generate", str(path), "-p", "a", "-n", "1", "--vram-cache", "1M"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fomoe: error: --vram-cache must be 0 on the cpu backend")
    ok = subprocess.run(cmd[:-1] + ["0"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_profile_timing_splits_a_layer_step_into_products_read_waits_and_host(stored):
    # with no host tier every expert is read from the store each step: the inference thread waits on
    # reads; ggml's products are timed where they run; the host's share is what is left
    path, store, tokens, _ = stored
    engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=(store,), ram_cache=0, prefetch=False, profile_timing=True))
    engine.logits(tokens)
    timer = engine.timer
    total, matmul, wait, host = timer.host_seconds()
    assert sum(timer.steps) == len(engine.source.layers)  # one batched step per layer
    assert 0 < matmul < total and 0 < wait < total and host == pytest.approx(total - matmul - wait)
    assert timer.report()[-1].startswith(f"per layer step: {total * 1e6:.0f} µs = ggml products {matmul * 1e6:.0f}")
    engine.close()


def test_expert_slots_are_repacked_when_the_tier_holds_every_expert_plain_when_it_streams_or_as_asked(tmp_path):
    """auto: a tier that holds the whole model (filled at load) repacked where ggml has kernels for the
    matrices, one that streams plain (a streamed miss costs a memcpy, not a repack); on and off as asked.
    Where fomoepy's batched kernel computes the decode steps (--expert-kernel auto, a CPU with AVX-512; on,
    AVX2 too) the whole tier's slots stay plain, which is what it reads; with --expert-kernel ggml they are
    repacked."""
    from fomoepy.options import EngineOptions as Options
    from fomoepy.options import add_engine_options
    from fomoepy.runtime.ggml_buffers import repacks

    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert Options.from_args(parser.parse_args(["--repack-experts", "on"])).repack_experts == "on"
    assert Options.from_args(parser.parse_args([])).repack_experts == "auto"
    with pytest.raises(FomoeError, match="--repack-experts must be one of"):
        Options(repack_experts="yes")
    assert Options.from_args(parser.parse_args(["--expert-kernel", "ggml"])).expert_kernel == "ggml"
    assert Options.from_args(parser.parse_args(["--expert-kernel", "on"])).expert_kernel == "on"
    with pytest.raises(FomoeError, match="--expert-kernel must be one of"):
        Options(expert_kernel="fast")
    store = tmp_path / "s"
    prepare_store(path, [store], progress=False)
    streams = {"store": (str(store),), "ram_cache": 2 * Engine(path, EngineOptions(backend="cpu")).source.layers[0].expert_nbytes}
    forms, kernels, served = {}, [], {}
    for name, opts in [("whole auto", {}), ("whole off", {"repack_experts": "off"}), ("streams auto", streams),
                       ("streams on", {**streams, "repack_experts": "on"}), ("whole auto, 2 threads", {"threads": 2}),
                       ("whole ggml, 2 threads", {"threads": 2, "expert_kernel": "ggml"}), ("whole on", {"expert_kernel": "on"})]:  # fmt: skip
        engine = Engine(path, EngineOptions(backend="cpu", **{"threads": 1, **opts}))
        mats = [m for pool in engine.experts.device.pools.values() for m in pool.layer.mats]
        forms[name] = [m.repacked for m in mats]
        kernels = [repacks(m.qtype, m.n_cols, m.n_rows) for m in mats]  # whether ggml has kernels for each here
        served[name] = any(engine.experts.device.kernel_layers)
        engine.close()
    assert not any(forms["whole off"]) and not any(forms["streams auto"])
    # auto: the kernel at any thread count where it was measured faster (AVX-512), unless --expert-kernel ggml
    kernel = batched_experts.serves(engine.source.layers, batched_experts.AVX512)
    assert served["whole auto"] == served["whole auto, 2 threads"] == kernel and not served["whole ggml, 2 threads"]
    assert served["whole on"] == batched_experts.serves(engine.source.layers)  # (its AVX2 form too)
    if kernel:
        assert not any(forms["whole auto"]) and not any(forms["whole auto, 2 threads"])
    if not any(kernels):
        pytest.skip("this CPU's ggml has no repacked kernels for the model's expert matrices")
    assert forms["streams on"] == kernels and forms["whole ggml, 2 threads"] == kernels
    if not kernel:
        assert forms["whole auto"] == kernels
