"""A decode row's attention node (fomoepy.runtime.row_attention): its arithmetic, as _row_attention.c defines
it, reproduced in float32 numpy bit for bit (so the vector form this CPU runs is the scalar loop's), against
float64 within a bound derived from that arithmetic, the rows of a batch each as alone, the cache writes,
and the positions past a row's own never read."""

from __future__ import annotations

import ggml
import numpy as np
import pytest
from float32_bounds import U

from fomoepy.model.state import KVCache
from fomoepy.runtime import row_attention
from fomoepy.runtime.ggml_attention import KVMemory
from fomoepy.runtime.ggml_dense import Graph

pytestmark = pytest.mark.skipif(not row_attention.runs(), reason="fomoepy.runtime._row_attention is not built (no C compiler at install)")

F32 = np.float32
LANES = 16


def cache(rng, capacity: int, hkv: int, hd: int) -> KVCache:
    k, v = KVMemory.kv((capacity, hkv, hd), False), KVMemory.kv((capacity, hkv, hd), True)
    k[:], v[:] = (rng.standard_normal((capacity, hkv, hd)).astype(F32) for _ in range(2))
    return KVCache(k, v)


def run_node(q, k_new, v_new, caches, positions, threads: int, write: bool = True) -> np.ndarray:
    """q [B, H, hd], k_new [B, Hkv, hd], v_new [B, Hkv, hd] through the node in a graph of its own → [B, H, hd]."""
    B, H, hd = q.shape
    Hkv = k_new.shape[1]
    g = Graph(8, 4 * B * hd * (2 * H + 2 * Hkv) + 4096, threads)
    out = row_attention.node(g.ctx, g.input(hd, H, B), g.input(hd, Hkv, B), g.input(Hkv * hd, B), g.input(row_attention.TABLE, B, qtype=ggml.GGML_TYPE_I64), Hkv, hd)
    g.finish([(out, (B, H, hd))])
    table = row_attention.fill(np.zeros((B, row_attention.TABLE), np.int64), caches, positions, write)
    return g.run(*(np.ascontiguousarray(a, dtype=F32) for a in (q, k_new, v_new)), table, last=True)[0]


def lanes_dot(a: np.ndarray, b: np.ndarray) -> F32:
    """_row_attention.c's dot: element i into partial sum i mod 16 (each product rounded, then added), the
    sums added by halves."""
    s = np.zeros(LANES, F32)
    for i in range(0, len(a), LANES):
        chunk = (a[i : i + LANES] * b[i : i + LANES]).astype(F32)
        s[: len(chunk)] = s[: len(chunk)] + chunk
    w = LANES // 2
    while w:
        s[:w] = s[:w] + s[w : 2 * w]
        w //= 2
    return s[0]


def exp_neg(x: np.ndarray) -> np.ndarray:
    """_row_attention.c's exp, op for op in float32."""
    x = x.astype(F32)
    xc = np.maximum(x, F32(-87))
    magic = F32(12582912.0)
    n = (xc * F32(1.44269504) + magic) - magic
    r = (xc - n * F32(0.693145752)) - n * F32(1.42860677e-06)
    p = F32(1) / F32(5040)
    for c in (F32(1) / F32(720), F32(1) / F32(120), F32(1) / F32(24), F32(1) / F32(6), F32(0.5), F32(1), F32(1)):
        p = p * r + c
    scale = ((np.maximum(n.astype(np.int32) + 127, 0)).astype(np.uint32) << 23).view(F32)
    return np.where(x < F32(-87), F32(0), p * scale)


def emulated(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One head: q [hd], keys [n, hd], values [n, hd] → [hd], the node's arithmetic."""
    scale = F32(1 / np.sqrt(q.shape[0]))
    s = np.array([lanes_dot(q, k) * scale for k in keys], F32)
    w = exp_neg(s - s.max())
    total = lanes_dot(w, np.ones_like(w))
    inv = F32(1) / total
    return np.array([lanes_dot(w, np.ascontiguousarray(values[:, d])) * inv for d in range(q.shape[0])], F32)


@pytest.mark.parametrize("position, hd, threads", [(0, 64, 1), (40, 64, 2), (100, 32, 3), (300, 128, 2)])
def test_the_node_is_its_definition_bit_for_bit_and_writes_the_rows_key_and_value(position, hd, threads):
    rng = np.random.default_rng(position + hd)
    H, Hkv, capacity = 8, 2, 512
    c = cache(rng, capacity, Hkv, hd)
    q = (rng.standard_normal((1, H, hd)) * 3).astype(F32)
    k_new, v_new = (rng.standard_normal((1, Hkv, hd)).astype(F32) for _ in range(2))
    got = run_node(q, k_new, v_new, [c], [position], threads)
    assert np.array_equal(c.k[position], k_new[0]) and np.array_equal(c.v[position], v_new[0])
    group = H // Hkv
    for h in range(H):
        want = emulated(q[0, h], c.k[: position + 1, h // group], c.v[: position + 1, h // group])
        assert np.array_equal(got[0, h].view(np.uint32), want.view(np.uint32)), h


def test_exp_is_within_its_derived_bound_and_zero_below_floats_normals():
    """Range reduction: n·ln2_hi is exact (17 bits of ln2 times |n| <= 126) and so is x - n·ln2_hi (they are
    close), the low part adds one rounding (u·|r|, |r| <= ln2/2: e^r moves by <= u·ln2/2). Horner's 7 steps
    each round a product and a sum: |p_k| <= e^|r| < 1.5, and each step's error is carried on by the later
    multiplications by |r| <= 0.35, so they add up to at most 2u·(1 + 0.35 + ...) / p ≤ 2u·1.54·1.5/0.7
    relative (p = e^r >= 0.7); the truncation after r^7/7! is ≤ 0.35^8/8!·e^0.35 < 0.05u; the scale 2^n is
    exact. Total < (0.35 + 6.6 + 0.05)·u: 8u."""
    x = -np.concatenate([np.linspace(0, 87, 200_001), np.geomspace(1e-30, 1e-3, 1000)]).astype(F32)
    got = exp_neg(x)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 8 * U * want)
    assert np.all(exp_neg(np.array([-87.5, -1e4, -3e38], F32)) == 0)
    assert exp_neg(np.zeros(1, F32))[0] == 1


@pytest.mark.parametrize("position", [0, 5, 77, 255])
def test_the_node_is_softmax_of_scaled_scores_times_values_within_its_rounding(position):
    """A score is an hd-term float32 sum (any order: ≤ hd·u of Σ|q·k|), scaled (2u more): δ ≤ (hd + 2)·u·
    scale·Σ|q·k|; moving every score by δ moves a weight by ≤ e^2δ - 1 relatively. exp adds 8u (above),
    the weights' sum n·u, its inverse u; the output is an n-term sum of weights times values (n·u of
    Σ w·|v|) times that inverse (u). So |Δ| ≤ ((e^2δ - 1) + (2n + 12)·u)·max|v|, n = position + 1."""
    rng = np.random.default_rng(position)
    H, Hkv, hd = 8, 2, 64
    c = cache(rng, 256, Hkv, hd)
    q = (rng.standard_normal((1, H, hd)) * 2).astype(F32)
    k_new, v_new = c.k[position : position + 1].copy(), c.v[position : position + 1].copy()
    got = run_node(q, k_new, v_new, [c], [position], 2)
    n = position + 1
    group = H // Hkv
    for h in range(H):
        keys, values = c.k[:n, h // group].astype(np.float64), c.v[:n, h // group].astype(np.float64)
        s = keys @ q[0, h].astype(np.float64) / np.sqrt(hd)
        w = np.exp(s - s.max())
        want = (w / w.sum()) @ values
        delta = (hd + 2) * U * np.abs(keys * q[0, h]).sum(1).max() / np.sqrt(hd)
        bound = (np.expm1(2 * delta) + (2 * n + 12) * U) * np.abs(values).max()
        assert np.abs(got[0, h] - want).max() <= bound


def test_each_row_of_a_batch_is_its_row_alone_on_any_thread_count_and_reads_nothing_past_its_position():
    rng = np.random.default_rng(9)
    H, Hkv, hd = 8, 2, 64
    positions = [3, 200, 64, 17]
    caches = [cache(rng, 256, Hkv, hd) for _ in positions]
    q = rng.standard_normal((4, H, hd)).astype(F32)
    k_new, v_new = (rng.standard_normal((4, Hkv, hd)).astype(F32) for _ in range(2))
    together = run_node(q, k_new, v_new, caches, positions, 3)
    for b, (c, p) in enumerate(zip(caches, positions)):
        c.k[p + 1 :], c.v[p + 1 :] = np.nan, np.inf  # past the row's position: never read
        alone = run_node(q[b : b + 1], k_new[b : b + 1], v_new[b : b + 1], [c], [p], 1)
        assert np.array_equal(alone[0], together[b]), b
        # the key and value already written (the op-by-op path): the same bits without writing them again
        c.k[p], c.v[p] = k_new[b], v_new[b]
        assert np.array_equal(run_node(q[b : b + 1], 0 * k_new[b : b + 1], 0 * v_new[b : b + 1], [c], [p], 2, write=False)[0], together[b])
