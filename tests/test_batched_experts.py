"""fomoepy.runtime.batched_experts (fomoepy/runtime/_batched_experts.c): a decode step's expert picks, each
expert's K-quant weights decoded once for every row that picked it, against the exact arithmetic it
implements (numpy, float64), in both its forms (AVX-512 where the CPU has it, portable C everywhere).

The bound. The kernel computes y = W_d · Q8_K(silu(g) ⊙ u), g = W_g · Q8_K(h), u = W_u · Q8_K(h), with the
block dot products exact in integers and each superblock's scaling and the sums in float32. The numpy
side computes the same quantizations and products in float64 from the dequantized weights. They differ by:
- float32 rounding of gate and up: at most γ·S per element, S = Σ_c |W[f, c]·hq[c]| (a superblock's
  scale products and the int → float conversion, 3 roundings, then a sum of nb terms in 16 lanes and a
  reduction of 16: depth nb + 3 + 4; the dequantized weights' own float32 rounding, 2 more), γ = depth·u;
- that error carried through silu(g)·u (|silu'| ≤ 1.1): ε_act = 1.1·|u|·ε_g + |silu(g)|·ε_u, and its own
  roundings;
- the activation's Q8_K: its block scale d moved by at most the block's largest ε_act (relative to the
  block's largest value), each quant's value with it by |q|·Δd; and a quant rounded the other way, by one
  quantum d, only where its scaled value lies within its error of a half (`flips`);
- float32 rounding of down: γ_F·Σ_j |W_d[i, j]·aq[j]|.
So |Δy_i| ≤ Σ_j |W_d[i, j]|·(flip_j·d_j + |q_j|·Δd_j) + γ_F·Σ_j |W_d[i, j]·a_j|. A wrong scale, offset,
nibble or lane moves outputs by a good fraction of their size, far past it.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from fomoepy.quants import dequantize, quantize
from fomoepy.runtime import batched_experts

pytestmark = pytest.mark.skipif(batched_experts._kernel is None, reason="the compiled kernel is not built (setup.py)")

U = 2.0**-24
K, F = 512, 256
TYPES = {"q4k-q4k-q6k": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "q6k-q4k-q4k": (Q.Q6_K, Q.Q4_K, Q.Q4_K)}
FORMS = list(range(batched_experts.best_form() + 1))  # portable C, and AVX2 and AVX-512 where this CPU runs them
FORM_NAMES = {batched_experts.PORTABLE: "portable", batched_experts.AVX2: "avx2", batched_experts.AVX512: "avx512"}


def q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_K in float32: per 256, the value of largest magnitude to -127, rounded to
    nearest even; (quants [n] as float64, each one's block scale d [n])."""
    b = x.astype(np.float32).reshape(-1, 256)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)]
    safe = np.where(mx == 0, np.float32(1), mx)
    iscale = (np.float32(-127) / safe).astype(np.float32)
    q = np.minimum(127, np.rint((iscale[:, None] * b).astype(np.float32)))
    d = np.where(mx == 0, np.float32(0), (np.float32(1) / iscale).astype(np.float32))
    q[mx == 0] = 0
    return q.ravel().astype(np.float64), np.repeat(d.astype(np.float64), 256)


def experts(rng, types, n: int, K: int = K, F: int = F):
    """n experts' gate, up and down in store form, and their dequantized float64 matrices."""
    shapes = [(F, K), (F, K), (K, F)]
    raw = [[quantize((rng.standard_normal(s) * 0.05).astype(np.float32), t) for t, s in zip(types, shapes)] for _ in range(n)]
    dense = [[dequantize(m, t, s).astype(np.float64) for m, t, s in zip(mats, types, shapes)] for mats in raw]
    return raw, dense


def exact_and_bound(h_row: np.ndarray, mats) -> tuple[np.ndarray, np.ndarray]:
    Wg, Wu, Wd = mats
    F, K = Wg.shape
    q, d = q8_K(h_row)
    hq = q * d
    g, u = Wg @ hq, Wu @ hq
    eps_g = (K // 256 + 9) * U * (np.abs(Wg) @ np.abs(hq))
    eps_u = (K // 256 + 9) * U * (np.abs(Wu) @ np.abs(hq))
    silu = g / (1 + np.exp(-g))
    act = silu * u
    eps_act = 1.1 * np.abs(u) * eps_g + np.abs(silu) * eps_u + 4 * U * np.abs(act)  # (+ silu·u's own float32 roundings)
    aq, ad = q8_K(act)
    # the block scale d = amax/127 moves by at most its block's largest error: each quant's value by |q|·Δd
    amax = np.repeat(np.abs(act).reshape(-1, 256).max(1), 256)
    rel_d = np.repeat(eps_act.reshape(-1, 256).max(1), 256) / np.where(amax > 0, amax, 1) + 2 * U
    # a quant may round the other way only where its scaled value lies within its error of a half
    scaled = act / np.where(ad != 0, ad, 1)
    margin = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5)
    quantum = np.abs(ad)  # (d is negative where a block's largest value is positive: ggml maps it to -127)
    flips = margin <= eps_act / np.where(quantum > 0, quantum, 1) + np.abs(scaled) * rel_d + 2 * U * np.abs(scaled)
    a = aq * ad
    bound = np.abs(Wd) @ (flips * quantum + np.abs(aq) * quantum * rel_d) + (F // 256 + 9) * U * (np.abs(Wd) @ np.abs(a))
    return Wd @ a, bound


def addresses_of(raw) -> np.ndarray:
    return np.array([[m.ctypes.data for m in mats] for mats in raw], np.uint64)


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES.get)
@pytest.mark.parametrize("name", list(TYPES))
def test_each_pick_is_the_exact_arithmetic_within_its_float32_rounding(name, form):
    rng = np.random.default_rng(3)
    types = tuple(int(t) for t in TYPES[name])
    raw, dense = experts(rng, types, 5)
    T = 4
    h = rng.standard_normal((T, K)).astype(np.float32)
    h[2, :256] = 0  # an all-zero block: its scale 0, its quants 0
    rows = np.array([0, 0, 1, 2, 3, 3, 1, 2, 0], np.int32)
    picked = np.array([0, 1, 0, 2, 3, 4, 4, 1, 2], np.int32)
    y = batched_experts.pick_outputs(h, rows, picked, addresses_of(raw), types, F, 2, form=form)
    for p in range(len(rows)):
        want, bound = exact_and_bound(h[rows[p]], dense[picked[p]])
        assert np.all(np.abs(y[p] - want) <= bound), (p, np.max(np.abs(y[p] - want) / bound))
        assert np.max(np.abs(want)) > 20 * np.max(bound)  # (the bound is far under the outputs' size)


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES.get)
def test_a_picks_bits_are_its_own_whatever_else_the_step_holds(form):
    """A sequence's output alone and in any batch, any order of picks and any thread count: the same
    bits (the batch's requirement: output as if it ran alone)."""
    rng = np.random.default_rng(4)
    types = tuple(int(t) for t in TYPES["q4k-q4k-q6k"])
    raw, _ = experts(rng, types, 6)
    addrs = addresses_of(raw)
    T, k = 9, 4  # (more than the eight rows an expert's registers take at a time: two passes)
    h = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.stack([rng.permutation(6)[:k] for _ in range(T)]).astype(np.int32)
    ids[:, 0] = 5  # every row picks expert 5: nine rows of one expert
    rows = np.repeat(np.arange(T, dtype=np.int32), k)
    batched = batched_experts.pick_outputs(h, rows, ids.ravel(), addrs, types, F, 2, form=form)
    for p in range(T * k):
        alone = batched_experts.pick_outputs(h[rows[p]][None], np.zeros(1, np.int32), ids.ravel()[p : p + 1], addrs, types, F, 1, form=form)
        assert np.array_equal(alone[0], batched[p])
    order = rng.permutation(T * k)
    for threads in (1, 3):
        shuffled = batched_experts.pick_outputs(h, rows[order], ids.ravel()[order], addrs, types, F, threads, form=form)
        assert np.array_equal(shuffled, batched[order])


def test_what_the_kernel_does_not_have_is_refused_in_one_line():
    rng = np.random.default_rng(5)
    types = tuple(int(t) for t in TYPES["q4k-q4k-q6k"])
    raw, _ = experts(rng, types, 1)
    h = rng.standard_normal((1, K)).astype(np.float32)
    one = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="types 8, 12, 14"):
        batched_experts.pick_outputs(h, one, one, addresses_of(raw), (int(Q.Q8_0), types[1], types[2]), F, 1)
    with pytest.raises(ValueError, match="multiples of 256"):
        batched_experts.pick_outputs(h, one, one, addresses_of(raw), types, F + 1, 1)
    with pytest.raises(ValueError, match="pick 0's row 1 or expert 0 out of range"):
        batched_experts.pick_outputs(h, one + 1, one, addresses_of(raw), types, F, 1)
    assert not batched_experts.handles((int(Q.Q8_0), types[1], types[2]), K, F)
    assert not batched_experts.handles(types, K, F + 128)
    assert batched_experts.handles(types, K, F)


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES.get)
@pytest.mark.parametrize("name", list(TYPES))
def test_several_superblocks_of_F_against_the_exact_arithmetic(name, form):
    """F = 768: three gate/up items an expert and down over three superblocks; K = 768, an odd count."""
    rng = np.random.default_rng(12)
    types = tuple(int(t) for t in TYPES[name])
    raw, dense = experts(rng, types, 3, 768, 768)
    h = rng.standard_normal((5, 768)).astype(np.float32)
    rows = np.array([0, 1, 2, 3, 4, 0, 1, 2], np.int32)
    picked = np.array([0, 0, 0, 0, 0, 1, 2, 2], np.int32)
    y = batched_experts.pick_outputs(h, rows, picked, addresses_of(raw), types, 768, 2, form=form)
    for p in range(len(rows)):
        want, bound = exact_and_bound(h[rows[p]], dense[picked[p]])
        assert np.all(np.abs(y[p] - want) <= bound), (p, np.max(np.abs(y[p] - want) / bound))


@pytest.mark.parametrize("form", FORMS, ids=FORM_NAMES.get)
@pytest.mark.parametrize("K, F, T", [(256, 256, 130), (768, 512, 67), (512, 256, 64)])
def test_more_rows_of_one_expert_than_a_pass_takes_are_each_their_own(K, F, T, form):
    """An expert picked by more rows than the kernel keeps sums for at a time (64): each row's bits its own."""
    rng = np.random.default_rng(7)
    types = tuple(int(t) for t in TYPES["q4k-q4k-q6k"])
    raw, _ = experts(rng, types, 3, K, F)
    addrs = addresses_of(raw)
    h = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.stack([np.zeros(T, np.int32), 1 + np.arange(T, dtype=np.int32) % 2], axis=1)  # expert 0: every row
    rows = np.repeat(np.arange(T, dtype=np.int32), 2)
    batched = batched_experts.pick_outputs(h, rows, ids.ravel(), addrs, types, F, 2, form=form)
    for p in range(0, 2 * T, 7):
        alone = batched_experts.pick_outputs(h[rows[p]][None], np.zeros(1, np.int32), ids.ravel()[p : p + 1], addrs, types, F, 1, form=form)
        assert np.array_equal(alone[0], batched[p]), p


def test_a_full_step_and_an_empty_one():
    rng = np.random.default_rng(8)
    types = tuple(int(t) for t in TYPES["q4k-q4k-q6k"])
    raw, _ = experts(rng, types, 8, 256, 256)
    addrs, P = addresses_of(raw), batched_experts.MAX_PICKS
    T = P // 8
    h = rng.standard_normal((T, 256)).astype(np.float32)
    ids = np.stack([rng.permutation(8) for _ in range(T)]).astype(np.int32).ravel()
    rows = np.repeat(np.arange(T, dtype=np.int32), 8)
    y = batched_experts.pick_outputs(h, rows, ids, addrs, types, 256, 2)
    for p in rng.choice(P, 8, replace=False):
        alone = batched_experts.pick_outputs(h[rows[p]][None], np.zeros(1, np.int32), ids[p : p + 1], addrs, types, 256, 1)
        assert np.array_equal(alone[0], y[p])
    with pytest.raises(ValueError, match="at most 1024 picks"):
        batched_experts.pick_outputs(np.concatenate([h, h[:1]]), np.append(rows, T), np.append(ids, 0), addrs, types, 256, 2)
    with pytest.raises(ValueError, match="rows and experts"):
        batched_experts.pick_outputs(h, rows, ids[:-1], addrs, types, 256, 2)
    assert batched_experts.pick_outputs(h, np.zeros(0, np.int32), np.zeros(0, np.int32), addrs, types, 256, 2).shape == (0, 256)


@pytest.mark.skipif(not batched_experts.vector_kernel(), reason="the graph nodes run a vector form")
@pytest.mark.parametrize("B, k, K, F", [(3, 4, 512, 256), (100, 2, 256, 256), (128, 8, 256, 256)])
def test_the_graph_nodes_give_pick_outputs_bits_on_any_thread_count(B, k, K, F):
    import ggml

    from fomoepy.runtime.ggml_dense import Graph

    rng = np.random.default_rng(11)
    types = (int(Q.Q4_K), int(Q.Q6_K), int(Q.Q6_K))
    raw, _ = experts(rng, types, 9, K, F)
    table = addresses_of(raw)
    graph_experts = batched_experts.GraphExperts(table, types, K, F)
    g = Graph(64, 2 * graph_experts.node_bytes(B, k), 2)
    y = graph_experts.nodes(g.ctx, g.input(K, B), g.input(k, B, qtype=ggml.GGML_TYPE_I32), B, k)
    g.finish([(y, (B, k, K))])
    h = rng.standard_normal((B, K)).astype(np.float32)
    ids = np.stack([rng.permutation(9)[:k] for _ in range(B)]).astype(np.int32)
    ids[:, 0] = 0  # expert 0 picked by every row
    want = batched_experts.pick_outputs(h, np.repeat(np.arange(B, dtype=np.int32), k), ids.ravel(), table, types, F, 2)
    for threads in (1, 2, 3):
        assert np.array_equal(g.run(h, ids, threads=threads)[0].reshape(B * k, K), want), threads
    for _ in range(3):  # graphs built again (a batch's spans move): the nodes' userdata one a k, not one a graph
        again = Graph(64, 2 * graph_experts.node_bytes(2, k), 1)
        graph_experts.nodes(again.ctx, again.input(K, 2), again.input(k, 2, qtype=ggml.GGML_TYPE_I32), 2, k)
    assert len(graph_experts._infos) == 1
