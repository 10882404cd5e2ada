"""Rung 5 of the correctness ladder, op by op: GpuBackend == CpuBackend on random inputs of realistic sizes.

Each test runs on the simulated device (CI: the kernel source itself, built by the host compiler and
run with real barriers and shuffles, fomoepy/runtime/sim/) and, marked `gpu`, on a real device.
Outputs are poisoned with NaN before every kernel, so an element a kernel fails to write fails the test.

Tolerances come from float32 arithmetic (u = 2^-24, gamma(n) = n u / (1 - n u), the bound on an n-term
float32 sum or dot product in any order, fused or not), never from a machine:
  dequantisation, embeddings  bit-exact: the decoders round each product (__fmul_rn) as numpy does
  matvec, experts             per element 2 gamma(K) (|x| . |w|): two orders of the same K products
  rope                        per element 4u (|x1| + |x2|): cos/sin in double rounded once (one float
                              ulp apart at worst between libms), then two rounded products and a sum
  norms, softmax              2 gamma(n) + 16u of the largest output: an n-term sum of positive terms on
                              each side, and at most four roundings and a 4-ulp exp/sqrt per side
  attention                   2 gamma(hd) S + 2 gamma(n_kv) + 16u, S the largest |q|.|k| scale: the
                              scores' error passes through exp unchanged in relative terms
  conv1d                      2 gamma(K) + 2u (K taps)
  delta rule                  (T + 1)(2 gamma(dk) + 8u): each token's dk-term sums, carried by the state
  router                      ids equal, weights and probabilities as softmax over E
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T_
from sim_backend import sim_backend

from fomoepy import quants
from fomoepy.errors import FomoeError
from fomoepy.experts.routing import softmax_route
from fomoepy.runtime.backends import open_gpu
from fomoepy.runtime.cpu import CpuBackend
from fomoepy.runtime.gpu import READBACK_AT, READBACK_BYTES

CPU = CpuBackend()
NAN = 0x7FC00000
U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def reduction_tol(n: int) -> float:
    """Two n-term sums of positive terms, and a few roundings and one transcendental, per side."""
    return 2 * gamma(n) + 16 * U


TOL = {"norm": reduction_tol(4096)}
QTYPES = [T_.F32, T_.F16, T_.BF16, T_.Q8_0, T_.Q4_0, T_.MXFP4, T_.Q4_K, T_.Q5_K, T_.Q6_K]


@pytest.fixture(scope="module", params=["sim", pytest.param("device", marks=pytest.mark.gpu)])
def dev(request):
    if request.param == "sim":
        d = sim_backend()
    else:
        try:
            d = open_gpu(os.environ.get("FOMOEPY_TEST_GPU", "auto"))  # cuda or hip: the stand-in runs pick one
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


def assert_within_dot_bound(got, x, w, ref):
    """|got - ref| <= 2 gamma(K) (|x| . |w|^T) per element: two summation orders of the same K products."""
    got = np.asarray(got)
    assert got.shape == ref.shape and np.isfinite(got).all()
    bound = 2 * gamma(x.shape[-1]) * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    excess = np.abs(got.astype(np.float64) - ref) - bound
    assert excess.max() <= 0, f"exceeds the summation bound by {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"


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
    assert_within_dot_bound(dev.linear(x, W), x, w, x.astype(np.float64) @ w.T.astype(np.float64))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_linear_of_unit_vectors_decodes_columns_exactly(dev, qtype):
    """x = e_k picks column k: every other product is an exact zero, so the decode shows bit for bit."""
    rng = np.random.default_rng(int(qtype) + 7)
    N, K = 70, 512
    raw, w = quantised(rng, qtype, N, K)
    cols = np.array([0, 1, 7, 8, 31, 32, 255, 256, 300, 511])
    x = np.zeros((len(cols), K), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    got = np.asarray(dev.linear(x, dev.weight_from_bytes(raw, qtype, (N, K), "w")))
    assert np.array_equal(got, w[:, cols].T)


def test_linear_into_a_given_array_writes_the_same_bits_and_refuses_one_of_another_shape(dev):
    rng = np.random.default_rng(3)
    x, W = dev.upload(rand(rng, 2, 256)), dev.upload(rand(rng, 40, 256))
    out = dev.zeros((2, 40))
    assert dev.linear(x, W, out=out) is out and np.array_equal(np.asarray(out), np.asarray(dev.linear(x, W)))
    for wrong in (dev.zeros((2, 41)), dev.zeros((1, 40)), dev.zeros((4, 40))[::2]):  # a shape, rows, a stride
        with pytest.raises(ValueError, match=r"its output is \(2, 40\) float32, contiguous"):
            dev.linear(x, W, out=wrong)


def test_linear_reads_strided_rows_and_float_arrays(dev):
    rng = np.random.default_rng(1)
    wide = dev.upload(rand(rng, 5, 2, 256))
    x = wide[:, 1, :]  # rows 512 apart
    w = rand(rng, 1, 256)
    xs = np.asarray(wide)[:, 1]
    assert_within_dot_bound(dev.linear(x, dev.upload(w[0])[None, :]), xs, w, xs.astype(np.float64) @ w.T.astype(np.float64))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_embedding_rows_are_decoded_exactly(dev, qtype):
    rng = np.random.default_rng(int(qtype))
    raw, table = quantised(rng, qtype, 300, 512)
    W = dev.weight_from_bytes(raw, qtype, (300, 512), "token_embd.weight")
    tokens = np.array([0, 299, 17, 17, 150])
    # bit for bit: the sign of a zero too (MXFP4's code 8 is +0, as ggml's and gguf's decodes have it)
    assert np.array_equal(np.asarray(dev.embed(W, tokens)).view(np.uint32), table[tokens].view(np.uint32))
    dev.embed(W, np.array([300]))
    with pytest.raises(FomoeError, match="token id or index outside"):
        dev.to_host(dev.empty((1,)))


def test_every_f16_bit_pattern_decodes_as_numpy_decodes_it(dev):
    """All 65536 halves as a table of 256 rows: zeros, subnormals, normals, infinities bit for bit;
    NaN stays NaN with its sign (numpy may quiet a signalling NaN's payload, a GPU may too)."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    W = dev.weight_from_bytes(bits.view(np.uint8).reshape(-1), T_.F16, (256, 256), "token_embd.weight")
    got = np.asarray(dev.embed(W, np.arange(256))).view(np.uint32)
    ref = bits.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(bits.view(np.float16))
    assert np.array_equal(got[~nan], ref[~nan])
    assert np.isnan(got[nan].view(np.float32)).all() and np.array_equal(got[nan] >> 31, ref[nan] >> 31)


def test_every_mxfp4_code_decodes_as_numpy_decodes_it(dev):
    """Every code byte (both nibbles: the 16 e2m1 codes, +0 and code 8 among them) under scales from the
    subnormal ones (exponents 0 and 1) to the largest finite, bit for bit as gguf's numpy decode: the
    sign of each zero too (quantising never writes code 8, so random weights would not show it)."""
    exponents = np.array([0, 1, 2, 100, 127, 128, 200, 254], np.uint8)
    blocks = np.zeros((len(exponents), 16, 17), np.uint8)  # a row: 16 blocks of 32 weights, the 256 code bytes
    blocks[:, :, 0] = exponents[:, None]
    blocks[:, :, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    raw = blocks.reshape(-1)
    shape = (len(exponents), 16 * 32)
    W = dev.weight_from_bytes(raw, T_.MXFP4, shape, "token_embd.weight")
    got = np.asarray(dev.embed(W, np.arange(len(exponents)))).view(np.uint32)
    assert np.array_equal(got, quants.dequantize(raw, T_.MXFP4, shape).view(np.uint32))


def test_a_type_without_kernel_is_refused_at_load(dev):
    raw = np.zeros(quants.nbytes_for(T_.F32, (4, 256)), np.uint8)
    with pytest.raises(FomoeError, match="Q2_K, which fomoepy does not support"):
        dev.weight_from_bytes(raw, T_.Q2_K, (4, 256), "blk.0.attn_q.weight")


# -- norms, activations, arithmetic -------------------------------------------------------------------


def test_rms_norm_of_a_per_head_view(dev):
    rng = np.random.default_rng(2)
    T, H, hd = 7, 16, 128
    q_and_gate = rand(rng, T, H, 2 * hd, scale=3.0)
    w = rand(rng, hd)
    got = dev.rms_norm(dev.upload(q_and_gate)[..., :hd], w, 1e-6)
    assert rel_err(got, CPU.rms_norm(q_and_gate[..., :hd], w, 1e-6)) <= reduction_tol(hd)


def test_rms_norm_l2_norm_softmax_rows(dev):
    rng = np.random.default_rng(3)
    x = rand(rng, 9, 4096, scale=2.0)
    w = rand(rng, 4096)
    assert rel_err(dev.rms_norm(x, w, 1e-6), CPU.rms_norm(x, w, 1e-6)) <= TOL["norm"]
    assert rel_err(dev.l2_norm(x, 1e-6), CPU.l2_norm(x, 1e-6)) <= TOL["norm"]
    assert rel_err(dev.softmax(x), CPU.softmax(x)) <= TOL["norm"]


def test_activations(dev):
    x = np.linspace(-30, 30, 10007, dtype=np.float32)
    for op in ("silu", "sigmoid", "softplus"):  # no sums: a few roundings and one exp/log per side
        assert rel_err(getattr(dev, op)(x), getattr(CPU, op)(x)) <= 16 * U, op


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
    assert rel_err(dev.sigmoid_gate(a, a[::-1].copy()), a * CPU.sigmoid(a[::-1])) <= 16 * U
    gate, up, down = rand(rng, 8, 32), rand(rng, 8, 32), rand(rng, 5, 8)
    # three matmuls of 32 and 8 terms and a silu: a relative bound on each stage, carried through
    assert rel_err(dev.swiglu_ffn(a, gate, up, down), CPU.swiglu_ffn(a, gate, up, down)) <= 64 * (2 * gamma(32) + 2 * gamma(8) + 16 * U)


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
        assert_rope_close(dev.rope_neox(x, pos, rot, 1e7), CPU.rope_neox(x, pos, rot, 1e7), x, rot)
    pos = np.array([3, 1, 4, 1, 5])
    x = rand(rng, 5, 2, 64)
    assert_rope_close(dev.rope_neox(x, pos, 64, 1e4), CPU.rope_neox(x, pos, 64, 1e4), x, 64)


def assert_rope_close(got, ref, x, rot):
    """Rotated pairs within 4u (|x1| + |x2|); the pass-through dims bit for bit."""
    got = np.asarray(got)
    half = rot // 2
    pair = np.abs(x[..., :half]) + np.abs(x[..., half:rot])
    bound = 4 * U * np.concatenate([pair, pair], axis=-1)
    assert (np.abs(got[..., :rot] - ref[..., :rot]) <= bound).all()
    assert np.array_equal(got[..., rot:], ref[..., rot:])


@pytest.mark.parametrize("T,n_past,hd", [(1, 0, 128), (1, 777, 128), (1, 300, 256), (40, 0, 128), (13, 61, 256)])
def test_attention_gqa_decode_and_causal_prefill(dev, T, n_past, hd):
    rng = np.random.default_rng(T * 1000 + n_past)
    H, Hkv, n_ctx = 16, 2, 1024
    q = rand(rng, T, H, hd)
    k, v = rand(rng, n_ctx, Hkv, hd), rand(rng, n_ctx, Hkv, hd)
    got = dev.attention(q, dev.upload(k), dev.upload(v), n_past)
    S = float(np.abs(q).max(axis=(0, 1)) @ np.abs(k).max(axis=(0, 1))) / np.sqrt(hd)  # >= every |q|.|k| scale
    assert rel_err(got, CPU.attention(q, k, v, n_past)) <= 2 * gamma(hd) * S + reduction_tol(n_past + T)


def test_attention_past_the_cache_is_an_error_not_a_read(dev):
    rng = np.random.default_rng(7)
    k = dev.upload(rand(rng, 8, 1, 32))
    dev.attention(rand(rng, 2, 2, 32), k, k, 7)
    with pytest.raises(FomoeError, match="KV position past the context"):
        dev.to_host(dev.empty((1,)))


@pytest.mark.parametrize("H, Hkv, hd, sizes, positions", [
    (8, 2, 64, (8, 16, 12), (3, 15, 0)),
    (2, 1, 32, (8,), (3,)),  # its output in the size class of the rows' tables: they must not share a buffer
])  # fmt: skip
def test_a_batched_decode_rows_attention_writes_each_cache_and_gives_each_rows_lone_bits(dev, H, Hkv, hd, sizes, positions):
    # sequences' caches of different sizes and fill: each row's key and value land at its own position of its
    # own cache, and its output is the bits the lone step (copies into its cache, then attention) gives
    from fomoepy.model.state import KVCache

    rng = np.random.default_rng(11)
    B, positions = len(sizes), np.array(positions)
    past = [(rand(rng, n, Hkv, hd), rand(rng, n, Hkv, hd)) for n in sizes]
    q, k, v = rand(rng, B, H, hd), rand(rng, B, Hkv, hd), rand(rng, B, Hkv, hd)
    caches = [KVCache(dev.upload(pk), dev.upload(pv)) for pk, pv in past]
    got = np.asarray(dev.to_host(dev.attend_rows(q, k, v, caches, positions)))
    for b, ((pk, pv), cache, pos) in enumerate(zip(past, caches, positions)):
        alone = KVCache(dev.upload(pk), dev.upload(pv))
        alone.k[pos : pos + 1] = dev.upload(k[b : b + 1])
        alone.v[pos : pos + 1] = dev.upload(v[b : b + 1])
        want = dev.to_host(dev.attention(dev.upload(q[b : b + 1]), alone.k, alone.v, int(pos)))
        assert np.array_equal(got[b], want[0])
        assert np.array_equal(np.asarray(dev.to_host(cache.k)), np.asarray(dev.to_host(alone.k)))
        assert np.array_equal(np.asarray(dev.to_host(cache.v)), np.asarray(dev.to_host(alone.v)))
    # a row at its cache's end is refused, and writes nothing past it (the cache a view of a longer buffer)
    longer = dev.upload(np.concatenate([past[0][0], past[0][0][:1]]))
    dev.attend_rows(q[:1], k[:1], v[:1], [KVCache(longer[: sizes[0]], longer[: sizes[0]])], np.array([sizes[0]]))
    with pytest.raises(FomoeError, match="KV position past the context"):
        dev.to_host(dev.empty((1,)))
    assert np.array_equal(np.asarray(dev.to_host(longer))[sizes[0]], past[0][0][0])


# -- Gated DeltaNet -----------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 9])
def test_causal_conv1d_with_state(dev, T):
    rng = np.random.default_rng(8 + T)
    C, K = 1000, 4
    x, state, w = rand(rng, T, C), rand(rng, K - 1, C), rand(rng, C, K)
    out, new_state = dev.causal_conv1d(x, state, dev.upload(w))
    ref_out, ref_state = CPU.causal_conv1d(x, state, w)
    assert rel_err(out, ref_out) <= 2 * gamma(K) + 2 * U
    assert np.array_equal(np.asarray(new_state), ref_state)  # the state is a copy of inputs


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
    tol = (T + 1) * (2 * gamma(dk) + 8 * U)
    assert rel_err(o, ref_o) <= tol
    assert rel_err(S, ref_S) <= tol


@pytest.mark.parametrize("B, C, K, Hv, dk, dv", [
    (3, 300, 4, 4, 64, 96),
    (1, 64, 4, 1, 32, 64),  # outputs in the size class of the rows' tables: they must not share a buffer
])  # fmt: skip
def test_a_batched_decode_rows_convolution_and_delta_rule_give_each_row_its_lone_bits_and_states(dev, B, C, K, Hv, dk, dv):
    # sequences' DeltaNet states, one decode row each: each row's outputs and each state afterwards are the
    # bits the lone kernels give that row over that state
    rng = np.random.default_rng(12)
    x, w = rand(rng, B, C), rand(rng, C, K)
    q, k, v = rand(rng, B, Hv, dk), rand(rng, B, Hv, dk), rand(rng, B, Hv, dv)
    g, beta = -np.abs(rand(rng, B, Hv, scale=0.3)), CPU.sigmoid(rand(rng, B, Hv))
    convs, ssms = [rand(rng, K - 1, C) for _ in range(B)], [rand(rng, Hv, dk, dv, scale=0.1) for _ in range(B)]
    conv_states, ssm_states = [dev.upload(c) for c in convs], [dev.upload(m) for m in ssms]
    w_dev = dev.upload(w)
    got_x = np.asarray(dev.to_host(dev.causal_conv1d_rows(x, conv_states, w_dev)))
    got_o = np.asarray(dev.to_host(dev.delta_rule_rows(q, k, v, g, beta, ssm_states)))
    for b in range(B):
        want_x, conv = dev.causal_conv1d(x[b : b + 1], dev.upload(convs[b]), w_dev)
        want_o, ssm = dev.delta_rule(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], dev.upload(ssms[b]))
        assert np.array_equal(got_x[b], np.asarray(dev.to_host(want_x))[0])
        assert np.array_equal(got_o[b], np.asarray(dev.to_host(want_o))[0])
        assert np.array_equal(np.asarray(dev.to_host(conv_states[b])), np.asarray(dev.to_host(conv)))
        assert np.array_equal(np.asarray(dev.to_host(ssm_states[b])), np.asarray(dev.to_host(ssm)))
    with pytest.raises(ValueError, match="every state is a contiguous float32 device array"):
        dev.delta_rule_rows(q, k, v, g, beta, ssms)  # host arrays: the kernel would write where they are not


# -- decisions on the device --------------------------------------------------------------------------


# (40, 512, 10): results too large for the error flag's read-back area, read back from an array of their own
@pytest.mark.parametrize("T,E,k", [(1, 512, 10), (7, 128, 8), (3, 16, 4), (40, 512, 10)])
def test_router_softmax_topk_renormalised(dev, T, E, k):
    assert (READBACK_AT + 4 * T * (E + 2 * k) > READBACK_BYTES) == (T == 40)
    rng = np.random.default_rng(E + T)
    logits = rand(rng, T, E, scale=2.0)
    got, ref = dev.route(logits, "softmax", k), softmax_route(logits, k)
    assert np.array_equal(got.ids, ref.ids)
    assert rel_err(got.weights, ref.weights) <= reduction_tol(E) + reduction_tol(k)
    assert rel_err(got.probs, ref.probs) <= reduction_tol(E)


def test_router_on_nan_logits_picks_valid_experts_as_numpy_does(dev):
    """A NaN logit (an upstream kernel gone wrong, a slot read before its copy) makes every probability
    NaN; the selection must still be k distinct experts in range, numpy's (argsort puts NaN last)."""
    logits = np.random.default_rng(3).standard_normal((3, 128)).astype(np.float32)
    logits[1, 77] = np.nan
    logits[2, :] = np.nan
    got, ref = dev.route(logits, "softmax", 8), softmax_route(logits, 8)
    assert np.array_equal(got.ids, ref.ids)
    assert np.isnan(got.weights[1:]).all() and not np.isnan(got.weights[0]).any()


def test_argmax(dev):
    x = np.random.default_rng(10).standard_normal((5, 151936)).astype(np.float32)
    x[1, 5] = x[1, 7] = 100.0  # ties go to the first
    x[3, 9000] = x[3, 4000] = np.nan  # the first NaN, as np.argmax
    x[4, :] = np.nan
    assert np.array_equal(dev.argmax(x), x.argmax(-1))
