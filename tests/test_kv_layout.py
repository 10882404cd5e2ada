"""A KV cache in numpy memory is laid out head by head (fomoepy.model.state.kv_zeros): one head's keys and
values are one stretch of memory, before and after the cache grows, and attention over it gives what it
gives over a cache laid out position by position, but for the order of its sums."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.model.state import KV_CHUNK, KVCache, kv_zeros
from fomoepy.runtime.cpu import CpuBackend


def head_major(a: np.ndarray) -> bool:
    return a.transpose(1, 0, 2).flags.c_contiguous


def position_minor(a: np.ndarray) -> bool:
    """[Hkv, hd, capacity] in memory: each head dim's positions one stretch (ggml's attention reads values so)."""
    return a.transpose(1, 2, 0).flags.c_contiguous


@pytest.mark.parametrize("backend, values", [("reference", head_major), ("cpu", position_minor)])
def test_each_heads_keys_and_values_are_one_stretch_before_and_after_the_cache_grows(backend, values):
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend=backend, n_ctx=4 * KV_CHUNK))
    state = engine.new_state()
    caches = [layer for layer in state.layers if isinstance(layer, KVCache)]
    assert caches and all(head_major(c.k) and values(c.v) for c in caches)
    tokens = np.load(ORACLE / "qwen3moe_q6_k.tokens.npy")[:4]
    engine.eval(state, tokens)
    before = [(c.k[:4].copy(), c.v[:4].copy()) for c in caches]
    state.reserve(KV_CHUNK)  # grows every cache past its first chunk
    assert all(c.capacity == 2 * KV_CHUNK and head_major(c.k) and values(c.v) for c in caches)
    assert all(np.array_equal(c.k[:4], k) and np.array_equal(c.v[:4], v) for c, (k, v) in zip(caches, before))  # kept
    engine.close()


@pytest.mark.parametrize("T, n_past", [(1, 0), (1, 200), (5, 37)])
def test_attention_over_a_head_major_cache_is_attention_over_a_position_major_one(T, n_past):
    """The same products over either layout; the BLAS kernel reading a transposed operand may sum in
    another order (equal bits on this machine's). Bound: a score's hd-term sum may move by
    2·hd·u·Σ|q·k|·scale, which moves the softmax's weights by at most twice that relatively, and the
    n_kv-term weighted sum of V by 2·n_kv·u more: |Δ| ≤ SAFETY·(2·δs + 2·n_kv·u)·max|v|."""
    rng = np.random.default_rng(T + n_past)
    capacity, H, Hkv, hd = 2 * KV_CHUNK, 16, 4, 64
    by_position = [rng.standard_normal((capacity, Hkv, hd)).astype(np.float32) for _ in range(2)]
    by_head = [kv_zeros(np.zeros, (capacity, Hkv, hd)) for _ in range(2)]
    for dst, src in zip(by_head, by_position):
        dst[:] = src
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    ops = CpuBackend(1)
    got, want = ops.attention(q, *by_head, n_past), ops.attention(q, *by_position, n_past)
    u, n_kv, k, v = 2.0**-24, n_past + T, by_position[0][: n_past + T], by_position[1][: n_past + T]
    terms = np.abs(q.reshape(T, Hkv, H // Hkv, hd)[:, None] * k[None, :, :, None, :]).sum(-1).max()
    delta_s = 2 * hd * u * terms / np.sqrt(hd)
    bound = 2.0 * (2 * delta_s + 2 * n_kv * u) * np.abs(v).max()
    assert np.abs(got - want).max() <= bound
