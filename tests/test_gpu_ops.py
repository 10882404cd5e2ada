"""Rung 5 of the correctness ladder, op by op: GpuBackend == CpuBackend on random inputs of realistic sizes.

Each test runs twice: on the emulated device (CI: checks the Python side — views, strides, launch
arguments, read-backs) and, marked `gpu`, on a real device (checks the kernels). Outputs are poisoned
with NaN before every kernel, so an element a kernel fails to write fails the test.

Tolerances, as max |gpu - cpu| / max |cpu| (documented here, the one place):
  matvec, embedding, experts  1e-4  decoding is bit-exact (the dequantisers round like numpy), only
                                    the order of float32 additions differs (K up to 4096 terms)
  norms, softmax, activations 1e-5  one reduction in a different order, expf vs numpy's exp
  rope                        1e-6  angles in double as in numpy; products rounded as numpy rounds them
  attention                   1e-5  online softmax (max, sum and weighted values merged across warps)
  conv1d                      1e-6  same products and sums in the same order (exact in practice)
  delta rule                  1e-4  a recurrence: per-step rounding differences accumulate over T
  router                      ids equal, weights 1e-5
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T_
from sim_backend import sim_backend

from fomoepy import quants
from fomoepy.errors import FomoeError
from fomoepy.experts.routing import softmax_route
from fomoepy.runtime.cpu import CpuBackend
from fomoepy.runtime.select import open_gpu

CPU = CpuBackend()
NAN = 0x7FC00000
TOL = {"matvec": 1e-4, "norm": 1e-5, "rope": 1e-6, "attention": 1e-5, "conv": 1e-6, "deltanet": 1e-4}
QTYPES = [T_.F32, T_.F16, T_.BF16, T_.Q8_0, T_.Q4_0, T_.MXFP4, T_.Q4_K, T_.Q5_K, T_.Q6_K]


@pytest.fixture(scope="module", params=["sim", pytest.param("device", marks=pytest.mark.gpu)])
def dev(request):
    if request.param == "sim":
        d = sim_backend()
    else:
        try:
            d = open_gpu("auto")
        except FomoeError as e:
            pytest.skip(f"no GPU device ({str(e)[:90]}...)")
    d.poison = NAN
    return d


def rel_err(got, ref) -> float:
    got = np.asarray(got)
    assert got.shape == ref.shape, f"shape {got.shape}, expected {ref.shape}"
    assert np.isfinite(got).all(), "an output element was not written (still NaN poison) or is not finite"
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def quantised(rng, qtype, n, k):
    raw = quants.quantize(rand(rng, n, k, scale=0.05), qtype)
    return raw, quants.dequantize(raw, qtype, (n, k))


# -- matvec, embedding --------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_linear_equals_dequantised_matmul(dev, qtype, T):
    rng = np.random.default_rng(int(qtype) * 100 + T)
    N, K = 515, (1000 if quants.FORMATS[qtype].block_size == 1 else 2048)  # odd N; a float row not a multiple of 8
    raw, w = quantised(rng, qtype, N, K)
    x = rand(rng, T, K)
    W = dev.weight_from_bytes(raw, qtype, (N, K), "w")
    assert rel_err(dev.linear(x, W), x @ w.T) <= TOL["matvec"]


def test_linear_reads_strided_rows_and_float_arrays(dev):
    rng = np.random.default_rng(1)
    wide = dev.upload(rand(rng, 5, 2, 256))
    x = wide[:, 1, :]  # rows 512 apart
    w = rand(rng, 1, 256)
    assert rel_err(dev.linear(x, dev.upload(w[0])[None, :]), np.asarray(wide)[:, 1] @ w.T) <= TOL["matvec"]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_embedding_rows_are_decoded_exactly(dev, qtype):
    rng = np.random.default_rng(int(qtype))
    raw, table = quantised(rng, qtype, 300, 512)
    W = dev.weight_from_bytes(raw, qtype, (300, 512), "token_embd.weight")
    tokens = np.array([0, 299, 17, 17, 150])
    assert np.array_equal(np.asarray(dev.embed(W, tokens)), table[tokens])
    dev.embed(W, np.array([300]))
    with pytest.raises(FomoeError, match="token id or index outside"):
        dev.to_host(dev.empty((1,)))


def test_a_type_without_kernel_is_refused_at_load(dev):
    raw = np.zeros(quants.nbytes_for(T_.F32, (4, 256)), np.uint8)
    with pytest.raises(FomoeError, match="no GPU kernel"):
        dev.weight_from_bytes(raw, T_.Q2_K, (4, 256), "blk.0.attn_q.weight")


# -- norms, activations, arithmetic -------------------------------------------------------------------


def test_rms_norm_of_a_per_head_view(dev):
    rng = np.random.default_rng(2)
    T, H, hd = 7, 16, 128
    q_and_gate = rand(rng, T, H, 2 * hd, scale=3.0)
    w = rand(rng, hd)
    got = dev.rms_norm(dev.upload(q_and_gate)[..., :hd], w, 1e-6)
    assert rel_err(got, CPU.rms_norm(q_and_gate[..., :hd], w, 1e-6)) <= TOL["norm"]


def test_rms_norm_l2_norm_softmax_rows(dev):
    rng = np.random.default_rng(3)
    x = rand(rng, 9, 4096, scale=2.0)
    w = rand(rng, 4096)
    assert rel_err(dev.rms_norm(x, w, 1e-6), CPU.rms_norm(x, w, 1e-6)) <= TOL["norm"]
    assert rel_err(dev.l2_norm(x, 1e-6), CPU.l2_norm(x, 1e-6)) <= TOL["norm"]
    assert rel_err(dev.softmax(x), CPU.softmax(x)) <= TOL["norm"]


def test_activations(dev):
    x = np.linspace(-30, 30, 10007, dtype=np.float32)
    for op in ("silu", "sigmoid", "softplus"):
        assert rel_err(getattr(dev, op)(x), getattr(CPU, op)(x)) <= TOL["norm"], op


def test_broadcast_arithmetic_like_numpy(dev):
    rng = np.random.default_rng(4)
    a, b = rand(rng, 6, 32), rand(rng, 32)
    da = dev.upload(a)
    s = np.float32(0.125)
    cases = {
        "a + b": (da + b, a + b), "b * a": (b * da, b * a), "a * s": (da * s, a * s),
        "s - a": (s - da, s - a), "a / b": (da / b, a / b), "2 / a": (2 / da, 2 / a), "-a": (-da, -a),
        "numpy + device": (a + dev.upload(b), a + b), "a - a[:1]": (da - da[:1], a - a[:1]),
    }  # fmt: skip
    for what, (got, ref) in cases.items():
        assert rel_err(got, ref) <= 1e-6, what
    assert rel_err(dev.sigmoid_gate(a, a[::-1].copy()), a * CPU.sigmoid(a[::-1])) <= TOL["norm"]
    gate, up, down = rand(rng, 8, 32), rand(rng, 8, 32), rand(rng, 5, 8)
    assert rel_err(dev.swiglu_ffn(a, gate, up, down), CPU.swiglu_ffn(a, gate, up, down)) <= TOL["matvec"]


def test_views_gathers_and_assignment(dev):
    rng = np.random.default_rng(5)
    qkv = rand(rng, 3, 2 * 2 * 8 + 4 * 8)
    d = dev.upload(qkv)
    q = d[:, : 2 * 8].reshape(3, 2, 8)  # a column slice made contiguous by reshape
    tile = np.arange(4) % 2
    assert np.array_equal(np.asarray(q[:, tile]), qkv[:, :16].reshape(3, 2, 8)[:, tile])
    cache = dev.zeros((10, 2, 8))
    cache[4:7] = q
    ref = np.zeros((10, 2, 8), np.float32)
    ref[4:7] = qkv[:, :16].reshape(3, 2, 8)
    assert np.array_equal(np.asarray(cache), ref)
    assert np.array_equal(np.asarray(d[-1:]), qkv[-1:])
    assert np.array_equal(np.asarray(d.T.reshape(-1)), qkv.T.reshape(-1))


# -- attention ----------------------------------------------------------------------------------------


def test_rope_neox_partial_rotary_dims(dev):
    rng = np.random.default_rng(6)
    for T, H, hd, rot, start in ((1, 32, 128, 128, 4097), (9, 16, 256, 64, 0), (5, 4, 128, 32, 100000)):
        x = rand(rng, T, H, hd)
        pos = np.arange(start, start + T)
        assert rel_err(dev.rope_neox(x, pos, rot, 1e7), CPU.rope_neox(x, pos, rot, 1e7)) <= TOL["rope"]
    pos = np.array([3, 1, 4, 1, 5])
    x = rand(rng, 5, 2, 64)
    assert rel_err(dev.rope_neox(x, pos, 64, 1e4), CPU.rope_neox(x, pos, 64, 1e4)) <= TOL["rope"]


@pytest.mark.parametrize("T,n_past,hd", [(1, 0, 128), (1, 777, 128), (1, 300, 256), (40, 0, 128), (13, 61, 256)])
def test_attention_gqa_decode_and_causal_prefill(dev, T, n_past, hd):
    rng = np.random.default_rng(T * 1000 + n_past)
    H, Hkv, n_ctx = 16, 2, 1024
    q = rand(rng, T, H, hd)
    k, v = rand(rng, n_ctx, Hkv, hd), rand(rng, n_ctx, Hkv, hd)
    got = dev.attention(q, dev.upload(k), dev.upload(v), n_past)
    assert rel_err(got, CPU.attention(q, k, v, n_past)) <= TOL["attention"]


def test_attention_past_the_cache_is_an_error_not_a_read(dev):
    rng = np.random.default_rng(7)
    k = dev.upload(rand(rng, 8, 1, 32))
    dev.attention(rand(rng, 2, 2, 32), k, k, 7)
    with pytest.raises(FomoeError, match="KV position past the context"):
        dev.to_host(dev.empty((1,)))


# -- Gated DeltaNet -----------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 9])
def test_causal_conv1d_with_state(dev, T):
    rng = np.random.default_rng(8 + T)
    C, K = 1000, 4
    x, state, w = rand(rng, T, C), rand(rng, K - 1, C), rand(rng, C, K)
    out, new_state = dev.causal_conv1d(x, state, dev.upload(w))
    ref_out, ref_state = CPU.causal_conv1d(x, state, w)
    assert rel_err(out, ref_out) <= TOL["conv"]
    assert rel_err(new_state, ref_state) <= TOL["conv"]


@pytest.mark.parametrize("T", [1, 12])
def test_delta_rule(dev, T):
    rng = np.random.default_rng(9 + T)
    Hv, dk, dv = 8, 128, 128
    q = CPU.l2_norm(rand(rng, T, Hv, dk), 1e-6) / np.float32(np.sqrt(dk))
    k = CPU.l2_norm(rand(rng, T, Hv, dk), 1e-6)
    v = rand(rng, T, Hv, dv)
    g = -np.abs(rand(rng, T, Hv, scale=0.3))
    beta = CPU.sigmoid(rand(rng, T, Hv))
    state = rand(rng, Hv, dk, dv, scale=0.1)
    o, S = dev.delta_rule(q, k, v, g, beta, state.copy())
    ref_o, ref_S = CPU.delta_rule(q, k, v, g, beta, state)
    assert rel_err(o, ref_o) <= TOL["deltanet"]
    assert rel_err(S, ref_S) <= TOL["deltanet"]


# -- decisions on the device --------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k", [(1, 512, 10), (7, 128, 8), (3, 16, 4)])
def test_router_softmax_topk_renormalised(dev, T, E, k):
    rng = np.random.default_rng(E + T)
    logits = rand(rng, T, E, scale=2.0)
    got, ref = dev.route(logits, "softmax", k), softmax_route(logits, k)
    assert np.array_equal(got.ids, ref.ids)
    assert rel_err(got.weights, ref.weights) <= 1e-5
    assert rel_err(got.probs, ref.probs) <= 1e-5


def test_argmax(dev):
    x = np.random.default_rng(10).standard_normal((3, 151936)).astype(np.float32)
    x[1, 5] = x[1, 7] = 100.0  # ties go to the first
    assert np.array_equal(dev.argmax(x), x.argmax(-1))
