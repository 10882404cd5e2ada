"""The cpu backend's attention over its KV cache (fomoepy.runtime.ggml_attention): against float64 within
a bound derived from its arithmetic, a query's bits whatever lies in the cache past its position and
whatever the caches' layout, and a decode row's one-graph layer against the op-by-op path, bit for bit, across a span
and a cache growth."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from float32_bounds import U

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.device import Phase
from fomoepy.model.state import KV_CHUNK, KVCache
from fomoepy.runtime.ggml_attention import (
    BUCKET,
    Attention,
    KVMemory,
    batch_spans,
    span,
)

F32 = np.float32
H, HKV, HD = 16, 4, 64


def caches(rng, capacity: int, memory=None):
    """Random keys and values [capacity, Hkv, hd] in KVMemory's layout (or numpy's plain one)."""
    k, v = (rng.standard_normal((capacity, HKV, HD)).astype(F32) for _ in range(2))
    if memory is None:
        return k, v
    kc, vc = memory.kv(k.shape, False), memory.kv(v.shape, True)
    kc[:], vc[:] = k, v
    return kc, vc


def float64_attention(q, k, v, n_past):
    T = q.shape[0]
    group = H // HKV
    out = np.empty((T, H, HD))
    for t in range(T):
        n_kv = n_past + t + 1
        for h in range(H):
            s = k[:n_kv, h // group].astype(np.float64) @ q[t, h].astype(np.float64) / np.sqrt(HD)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[:n_kv, h // group].astype(np.float64)
    return out


@pytest.mark.parametrize("T, n_past, capacity, threads", [(1, 0, 256, 1), (1, 200, 256, 2), (1, 300, 512, 2), (5, 37, 256, 1), (70, 10, 256, 2)])
def test_attention_is_softmax_of_scaled_scores_times_values_within_its_rounding(T, n_past, capacity, threads):
    """A score is an hd-term float32 dot product (≤ hd·u of Σ|q·k| off), scaled (the scale's rounding and
    the product's, 2u): δ ≤ (hd + 2)·u·scale·Σ|q·k|. Moving every score by δ moves a softmax weight by at
    most e^2δ - 1 relatively; ggml's exp is within 2 ulp (4u), its normalisation (a double sum, rounded
    to float32, times each weight) 2u more. The output is an n-term float32 sum of weights times values
    (n the span the graph reads; masked terms are exact zeros): ≤ n·u of Σ w·|v|, plus the weights'
    error. So |Δ| ≤ ((e^2δ - 1) + (n + 6)·u)·max|v|."""
    rng = np.random.default_rng(T + n_past)
    k, v = caches(rng, capacity, KVMemory())
    q = rng.standard_normal((T, H, HD)).astype(F32)
    got = Attention()(q, k, v, n_past, threads)
    n_kv = n_past + T
    group = H // HKV
    terms = np.abs(q.reshape(T, HKV, group, 1, HD) * k[:n_kv].transpose(1, 0, 2)[None, :, None]).sum(-1).max()
    delta = (HD + 2) * U * terms / np.sqrt(HD)
    bound = (np.expm1(2 * delta) + (span(n_kv, capacity) + 6) * U) * np.abs(v[:n_kv]).max()
    assert got.shape == (T, H, HD) and got.dtype == F32
    assert np.abs(got - float64_attention(q, k, v, n_past)).max() <= bound


def test_what_lies_past_a_querys_position_never_reaches_it_and_any_cache_layout_gives_the_same_bits():
    # the positions a graph reads past each query's own (up to its span) are masked to exact zero weights
    rng = np.random.default_rng(3)
    n_past, T = 19, 3
    k, v = caches(rng, 4 * BUCKET, KVMemory())
    plain = k.copy(), v.copy()  # numpy's position-major layout: read through a copy in KVMemory's
    q = rng.standard_normal((T, H, HD)).astype(F32)
    attend = Attention()
    want = attend(q, k, v, n_past, 1)
    k[n_past + 1 :] = rng.standard_normal(k[n_past + 1 :].shape) * 100  # past the first query's position
    v[n_past + 1 :] = 1e30
    got = attend(q, k, v, n_past, 2)
    assert np.array_equal(got[0], want[0]) and not np.array_equal(got[1:], want[1:])  # the later ones see them
    k[n_past + T :], v[n_past + T :] = -7, -1e30  # past the last query's (finite, as a cache's zeros and old rows are)
    assert np.array_equal(attend(q, k, v, n_past, 2)[1:], got[1:])
    assert np.array_equal(attend(q, *plain, n_past, 1), want)


@pytest.mark.parametrize("name", ["qwen3moe_q6_k"])
def test_a_decode_rows_one_graph_layer_is_the_op_by_op_path_across_a_span_and_a_cache_growth(name):
    # decoding from position KV_CHUNK - 3 crosses the first chunk's end (the caches grow: new strides,
    # new graphs) and a span's; the cache rows the graph writes are the ones the op-by-op path writes
    runs = []
    for fused in (True, False):
        engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=2, n_ctx=4 * KV_CHUNK))
        if not fused:
            engine.ops.attention_layer = None  # (never called: fuses_attention says no)
            engine.ops.fuses_attention = lambda a, gating: False
        rng = np.random.default_rng(7)
        state = engine.new_state()
        engine.eval(state, rng.integers(0, engine.spec.n_vocab, KV_CHUNK - 3))
        logits = [engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in rng.integers(0, engine.spec.n_vocab, 6)]
        assert state.kv_capacity == 2 * KV_CHUNK
        runs.append((logits, [(c.k[: state.n_past].copy(), c.v[: state.n_past].copy()) for c in state.layers if isinstance(c, KVCache)]))
        engine.close()
    (fused_logits, fused_kv), (ops_logits, ops_kv) = runs
    assert all(np.array_equal(a, b) for a, b in zip(fused_logits, ops_logits))
    assert all(np.array_equal(a, b) for pair in zip(fused_kv, ops_kv) for a, b in zip(*pair))


@pytest.mark.parametrize("n_past", [0, 63, 64, 200])
def test_a_decode_rows_bits_are_the_same_over_any_span_of_whole_buckets(monkeypatch, n_past):
    # a batched step reads every sequence over the batch's widest span (batch_spans): past the row's
    # position are exact zero weights, summed in whole SIMD blocks, whatever the cache holds there
    rng = np.random.default_rng(n_past)
    k, v = caches(rng, 8 * BUCKET, KVMemory())
    k[n_past + 1 :] *= 50  # old rows: finite, and far from the row's own
    v[n_past + 1 :] = rng.uniform(-1e30, 1e30, v[n_past + 1 :].shape)
    q = rng.standard_normal((1, H, HD)).astype(F32)
    own = Attention()(q, k, v, n_past, 2)
    for wider in range(span(n_past + 1, 8 * BUCKET) + BUCKET, 8 * BUCKET + 1, BUCKET):
        monkeypatch.setattr("fomoepy.runtime.ggml_attention.span", lambda n, capacity, wider=wider: wider)
        assert np.array_equal(Attention()(q, k, v, n_past, 2), own), wider


def test_a_batch_reads_its_widest_whole_span_where_each_cache_holds_it():
    # own spans 64, 128, 192; a capacity of 150 (n_ctx) neither reads 192 nor lends its 150 to the others
    assert batch_spans([10, 100, 130], [256, 256, 256]) == [192, 192, 192]
    assert batch_spans([10, 100, 130], [256, 128, 512]) == [192, 128, 192]  # 128 holds no more
    assert batch_spans([10, 140], [256, 150]) == [64, 150]
    assert batch_spans([10, 40], [150, 150]) == [64, 64]
    assert batch_spans([7], [40]) == [40]
