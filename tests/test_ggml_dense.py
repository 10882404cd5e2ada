"""The cpu backend's RMS norm and a decode row's two attention-layer graphs (fomoepy.runtime.ggml_dense):
the norm against float64, row by row; the graphs against the op-by-op path, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from float32_bounds import U

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.device import Phase
from fomoepy.runtime.ggml_dense import RopeSpec, rms_norm_rows, rope_neox

F32 = np.float32


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_rows_is_x_over_its_rms_and_each_row_its_own(threads):
    # ggml sums x² in double (exact to far below float32 here), then rounds: the mean to float32 (u),
    # its sum with eps (u), the square root (u, and half its input's u), the reciprocal (u) and the
    # product with x (u): at most 5.5u of the exact value, relatively
    rng = np.random.default_rng(1)
    eps = 1e-6
    x = (rng.standard_normal((7, 3, 256)) * rng.uniform(0.01, 100, size=(7, 3, 1))).astype(F32)
    got = rms_norm_rows(x, eps, threads)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(F32(eps)))
    assert got.shape == x.shape and got.dtype == F32
    assert np.all(np.abs(got - want) <= 5.5 * U * np.abs(want))
    for i in (0, 4):  # a row alone: the bits it gets among the others
        assert np.array_equal(rms_norm_rows(x[i, 1], eps, threads), got[i, 1])
    assert not np.array_equal(rms_norm_rows(x, 1.0, threads), got)  # eps is the graph's, not a cached one's


def test_a_kept_graphs_results_stay_the_callers_after_its_next_run():
    # a kept graph computes into memory of its own, run after run: each run's results are the caller's
    rng = np.random.default_rng(4)
    first, second = (rng.standard_normal((1, 256)).astype(F32) for _ in range(2))
    got = rms_norm_rows(first, 1e-6, 1)
    kept = got.copy()
    again = rms_norm_rows(second, 1e-6, 1)  # the same graph (shape, eps, threads), other input
    assert np.array_equal(got, kept) and not np.array_equal(again, kept)


def test_a_kept_graph_hands_its_last_results_memory_out_again_only_when_nothing_holds_it():
    # run after run, a dropped result's memory is the next one's (warm, mapped); a result the caller holds,
    # or a view of, is never written again
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1, 256)).astype(F32) for _ in range(4)]
    want = [rms_norm_rows(x, 1e-6, 1).copy() for x in inputs]
    held = rms_norm_rows(inputs[0], 1e-6, 1)
    second = rms_norm_rows(inputs[1], 1e-6, 1)
    assert second is not held and np.array_equal(held, want[0]) and np.array_equal(second, want[1])
    address = second.ctypes.data
    del second
    third = rms_norm_rows(inputs[2], 1e-6, 1)
    assert third.ctypes.data == address and np.array_equal(third, want[2])
    row = third[0]  # a view holds its base
    del third
    fourth = rms_norm_rows(inputs[3], 1e-6, 1)
    assert fourth.ctypes.data != address and np.array_equal(row, want[2][0]) and np.array_equal(fourth, want[3])
    assert np.array_equal(held, want[0])


@pytest.mark.parametrize("rotary_dim", [64, 32])  # 32 of 64: the dims past it pass through unchanged
def test_rope_neox_rotates_pairs_i_and_i_plus_half_by_pos_times_base_to_the_minus_2i_over_d(rotary_dim):
    # ggml computes θ_i = pos·s^i with s = base^(-2/d) rounded to float32 and multiplied in i times, each
    # product rounded: |Δθ_i| ≤ (2i + 1)·u·θ_i; cos and sin add u each, the rotation's two products and
    # its sum 2u of |x1| + |x2|: |Δout| ≤ (|x1| + |x2|)·((2i + 1)·u·θ_i + 3u)
    rng = np.random.default_rng(2)
    T, heads, hd, base = 5, 3, 64, 10000.0
    x = rng.standard_normal((T, heads, hd)).astype(F32)
    positions = np.array([0, 1, 17, 200, 255])
    got = rope_neox(x, positions, RopeSpec(rotary_dim, base), 1)
    half = rotary_dim // 2
    i = np.arange(half)
    theta = positions[:, None, None].astype(np.float64) * base ** (-2.0 * i / rotary_dim)  # [T, 1, half]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:rotary_dim].astype(np.float64)
    bound = (np.abs(x1) + np.abs(x2)) * ((2 * i + 1) * U * theta + 3 * U)
    assert np.all(np.abs(got[..., :half] - (x1 * np.cos(theta) - x2 * np.sin(theta))) <= bound)
    assert np.all(np.abs(got[..., half:rotary_dim] - (x2 * np.cos(theta) + x1 * np.sin(theta))) <= bound)
    assert np.array_equal(got[..., rotary_dim:], x[..., rotary_dim:])
    assert np.array_equal(rope_neox(x[3:4], positions[3:4], RopeSpec(rotary_dim, base), 1), got[3:4])  # a row alone


@pytest.mark.parametrize("name", ["qwen3moe_q4_k_m", "qwen3moe_q6_k"])
def test_a_decode_rows_graphs_give_the_op_by_op_paths_bits(name):
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    runs = []
    for fused in (True, False):
        engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2))
        assert engine.ops.fuses_attention(engine.spec.attention, engine.spec.moe.gating)
        if not fused:
            engine.ops.fuses_attention = lambda a, gating: False
        state = engine.new_state()
        engine.eval(state, tokens[:-4])
        runs.append([engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in tokens[-4:]])
        engine.close()
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("threads", [1, 2])
def test_each_graph_gives_the_op_by_op_paths_bits(threads):
    # at the graphs' own outputs: a model's logits can absorb an attention difference (x + o rounds it away)
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=threads))
    ops, a, eps, k_used = engine.ops, engine.spec.attention, engine.spec.rms_eps, engine.spec.moe.n_expert_used
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    rng = np.random.default_rng(threads)
    for il, position in ((0, 0), (1, 37), (1, 200)):
        w = engine.weights.layer(il)
        x = rng.standard_normal((1, engine.spec.n_embd)).astype(F32)
        q, k, v = ops.attention_inputs(x, w, a, eps, position, k_used)
        xn = ops.rms_norm(x, w.attn_norm, eps)
        at = np.array([position])
        want_q = ops.rope_neox(ops.rms_norm(ops.linear(xn, w.attn_q).reshape(1, H, hd), w.attn_q_norm, eps), at, a.rotary_dim, a.rope_base)
        want_k = ops.rope_neox(ops.rms_norm(ops.linear(xn, w.attn_k).reshape(1, Hkv, hd), w.attn_k_norm, eps), at, a.rotary_dim, a.rope_base)
        assert np.array_equal(q, want_q) and np.array_equal(k, want_k) and np.array_equal(v, ops.linear(xn, w.attn_v))
        attn = rng.standard_normal((1, H * hd)).astype(F32)
        x2, h, routing = ops.attention_output(x, attn, w, a, eps, k_used)
        want_x2 = x + ops.linear(attn, w.attn_output)
        want_h = ops.rms_norm(want_x2, w.ffn_norm, eps)
        assert np.array_equal(x2, want_x2) and np.array_equal(h, want_h)
        want = ops.route(ops.linear(want_h, w.ffn_gate_inp), "softmax", k_used)
        assert all(np.array_equal(getattr(routing, f), getattr(want, f)) for f in ("ids", "weights", "probs"))
    engine.close()


def test_a_batched_steps_graphs_give_each_row_the_bits_of_its_one_row_graphs():
    # a batched decode step runs the graphs built for B rows, one row of each sequence at its own position
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=1))
    ops, a, eps, k_used = engine.ops, engine.spec.attention, engine.spec.rms_eps, engine.spec.moe.n_expert_used
    w = engine.weights.layer(1)
    rng = np.random.default_rng(5)
    positions = [0, 37, 200, 5]
    x = rng.standard_normal((len(positions), engine.spec.n_embd)).astype(F32)
    attn = rng.standard_normal((len(positions), a.n_head * a.head_dim)).astype(F32)
    q, k, v = ops.attention_inputs(x, w, a, eps, positions, k_used)
    x2, h, routing = ops.attention_output(x, attn, w, a, eps, k_used)
    assert q.shape == (4, a.n_head, a.head_dim) and routing.probs.shape == (4, engine.spec.moe.n_expert)
    for i, position in enumerate(positions):
        alone = ops.attention_inputs(x[i : i + 1], w, a, eps, position, k_used), ops.attention_output(x[i : i + 1], attn[i : i + 1], w, a, eps, k_used)
        r = alone[1][2]
        for got, want in zip((q, k, v, x2, h, routing.ids, routing.weights, routing.probs), (*alone[0], *alone[1][:2], r.ids, r.weights, r.probs)):
            assert np.array_equal(got[i : i + 1], want)
    assert not np.array_equal(q[1], ops.attention_inputs(x[1:2], w, a, eps, 0, k_used)[0][0])  # each row at its own position
    engine.close()


def test_every_layer_keeps_its_one_row_graphs_and_those_of_the_last_two_batch_sizes():
    # a graph's intermediates take room for its rows in every layer: sizes a batch no longer has are dropped
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=1))
    ops, a, eps, k_used = engine.ops, engine.spec.attention, engine.spec.rms_eps, engine.spec.moe.n_expert_used
    x = np.random.default_rng(6).standard_normal((5, engine.spec.n_embd)).astype(F32)
    layers = [engine.weights.layer(il) for il in range(2)]

    def step(B):  # what a batched step of B sequences asks of each layer
        return [ops.attention_inputs(x[:B], w, a, eps, list(range(B)), k_used) for w in layers]

    first = step(1), step(3)
    step(2), step(4)
    assert all(set(graphs) == {1, 2, 4} for _, graphs in ops._attention.values())
    again = step(1), step(3)  # 3 built anew: the same bits
    assert all(set(graphs) == {1, 3, 4} for _, graphs in ops._attention.values())
    for before, after in zip(first, again):
        assert all(np.array_equal(p, q) for b, c in zip(before, after) for p, q in zip(b, c))
    engine.close()


def test_gated_attention_keeps_the_op_by_op_path():
    engine = Engine(ORACLE / "qwen35moe_q4_k.gguf", EngineOptions(backend="cpu", threads=1))
    assert engine.spec.attention.gated and not engine.ops.fuses_attention(engine.spec.attention, engine.spec.moe.gating)
    engine.close()


@pytest.mark.parametrize("spins", [False, True])
def test_a_decode_rows_graphs_run_on_one_thread_unless_the_threads_spin(monkeypatch, spins):
    # small products: a second, sleeping thread's wake-up per node costs more than it saves; one that
    # spins gains, and then a lone row's whole token is one graph
    from fomoepy.runtime import ggml_threads

    monkeypatch.setattr(ggml_threads, "spins", lambda: spins)
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2))
    graphs = engine.ops._graphs(engine.weights.layer(0), engine.spec.attention, engine.spec.rms_eps, 1, engine.spec.moe.n_expert_used)
    assert engine.ops.threads == 2 and graphs.pre.threads == graphs.post.threads == (2 if spins else 1)
    engine.decode_token(engine.new_state(), 1)
    layers = [graph for _, kept in engine.ops._layers.values() for graph in kept.values()]
    tokens = [graph for _, graph in engine.ops._tokens.values()]
    if spins:  # the whole token in one graph (the experts' large products in it): every thread
        assert len(tokens) == 1 and tokens[0].graph.threads == 2 and not layers
    else:  # a graph a layer, the experts apart: one thread
        assert not tokens and len(layers) == engine.spec.n_layer and all(g.graph.threads == 1 for g in layers)
    engine.close()
    alone = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=1))  # nothing waits
    alone.decode_token(alone.new_state(), 1)
    assert len(alone.ops._tokens) == 1 and not alone.ops._layers
    alone.close()


def test_a_few_rows_are_normed_and_rotated_on_one_thread_a_prefills_on_all():
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2))
    ops = engine.ops
    assert ops._threads_for(np.zeros((1, 4096), F32)) == 1 and ops._threads_for(np.zeros((128, 1024), F32)) == 2
    x = np.random.default_rng(3).standard_normal((128, 1024)).astype(F32)
    w = np.ones(1024, F32)
    assert np.array_equal(ops.rms_norm(x[:1], w, 1e-6), ops.rms_norm(x, w, 1e-6)[:1])  # one thread or two: same bits
    engine.close()
