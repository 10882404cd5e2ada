"""fomoepy.quants against the independent reference, gguf.quants: bit-exact decoding, valid encoding."""

from __future__ import annotations

from pathlib import Path

import gguf.quants
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from fomoepy import quants
from fomoepy.errors import UnsupportedQuantType

Q = GGMLQuantizationType
ORACLE = Path(__file__).parent / "fixtures" / "oracle"
SUPPORTED = list(quants.SUPPORTED)
IDS = [t.name for t in SUPPORTED]

# byte offsets of the fp16 scale fields in each block; random bytes there could be inf/NaN
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}

# quantize -> dequantize error for N(0, 1) data, as RMS error / RMS value (measured, plus headroom)
MAX_REL_RMS_ERROR = {
    Q.F32: 0.0,
    Q.F16: 5e-4,
    Q.BF16: 3e-3,
    Q.Q8_0: 0.008,
    Q.Q6_K: 0.025,
    Q.Q5_K: 0.05,
    Q.Q4_K: 0.095,
    Q.Q4_0: 0.1,
    Q.MXFP4: 0.14,
}


def bits(a: np.ndarray) -> np.ndarray:
    """float32 as uint32 so that NaNs compare equal and -0.0 differs from 0.0."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def random_blocks(qtype: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes of a [n_rows, n_cols] tensor whose scale fields are finite fp16 values."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(qtype, []):
        scales = (rng.standard_normal(raw.shape[0]) * 0.01).astype("<f2")
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


def test_table_matches_gguf_sizes():
    for qtype, fmt in quants.FORMATS.items():
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qtype]
        assert fmt.name == qtype.name


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf: MXFP4 with e = 255
@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 512), (2, 5, 256)])
def test_dequantize_random_blocks_is_bit_exact_with_gguf(qtype, shape):
    raw = random_blocks(qtype, int(np.prod(shape[:-1])), shape[-1], seed=sum(shape))
    ours = quants.dequantize(raw, qtype, shape)
    ref = gguf.quants.dequantize(raw, qtype).reshape(shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(bits(ours), bits(ref))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_quantize_roundtrip_error_is_small(qtype):
    x = np.random.default_rng(1).standard_normal((64, 1024)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (64, quants.row_nbytes(qtype, 1024))
    y = quants.dequantize(raw, qtype, x.shape)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert rel <= MAX_REL_RMS_ERROR[qtype]


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_quantized_blocks_decode_the_same_in_gguf(qtype):
    x = np.random.default_rng(2).standard_normal((4, 3, 512)).astype(np.float32) * 0.05
    raw = quants.quantize(x, qtype)
    assert raw.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(bits(quants.dequantize(raw, qtype, x.shape)), bits(ref))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.MXFP4], ids=lambda t: t.name)
def test_quantize_equals_gguf_where_gguf_can_encode(qtype):
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    np.testing.assert_array_equal(
        quants.quantize(x, qtype).view(np.uint8), gguf.quants.quantize(x, qtype).view(np.uint8)
    )


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
@pytest.mark.parametrize("kind", ["zeros", "constant", "positive", "negative", "wide_range", "tiny", "sparse_outlier"])
def test_quantize_edge_inputs_give_valid_blocks(qtype, kind):
    rng = np.random.default_rng(4)
    x = {
        "zeros": np.zeros((2, 256)),
        "constant": np.full((2, 256), 0.37),
        "positive": rng.uniform(1, 2, (2, 256)),
        "negative": -rng.uniform(1, 2, (2, 256)),
        "wide_range": rng.standard_normal((2, 256)) * np.logspace(-4, 2, 256),
        "tiny": rng.standard_normal((2, 256)) * 1e-4,  # fp16 scales (subnormal) still resolve it
        "sparse_outlier": np.where(np.arange(256) == 7, 30.0, rng.standard_normal((2, 256)) * 0.01),
    }[kind].astype(np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    assert np.all(np.isfinite(y))
    # every element near its value, relative to its block's largest magnitude (a loose, type-free bound;
    # MXFP4's power-of-two scale can clip the block maximum by up to 25%, by design of the format)
    block = quants.FORMATS[qtype].block_size
    if block > 1:
        span = np.abs(x.reshape(-1, block)).max(axis=1, keepdims=True)
        bound = 0.26 if qtype == Q.MXFP4 else 0.2
        assert np.all(np.abs(y - x).reshape(-1, block) <= bound * span + 1e-12)
    if kind == "zeros":
        assert not np.any(y)


def test_k_quant_scale_fields_are_finite_fp16():
    x = np.random.default_rng(5).standard_normal((16, 256)).astype(np.float32) * 100
    for qtype, offsets in [(Q.Q4_K, [0, 2]), (Q.Q5_K, [0, 2]), (Q.Q6_K, [208])]:
        raw = quants.quantize(x, qtype)
        for offset in offsets:
            assert np.all(np.isfinite(np.ascontiguousarray(raw[:, offset : offset + 2]).view("<f2")))


def test_sizes():
    assert quants.row_nbytes(Q.Q4_K, 1024) == 4 * 144
    assert quants.nbytes_for(Q.Q6_K, (8, 512, 1024)) == 8 * 512 * 4 * 210
    assert quants.nbytes_for(Q.F32, (3,)) == 12
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        quants.row_nbytes(Q.Q4_K, 100)


def test_dequantize_rejects_a_wrong_byte_count():
    with pytest.raises(ValueError, match="expected 288 bytes for Q4_K"):
        quants.dequantize(np.zeros(100, np.uint8), Q.Q4_K, (2, 256))


def test_unsupported_type_is_refused_with_one_clear_line():
    name = "blk.0.ffn_up_exps.weight"
    with pytest.raises(UnsupportedQuantType) as e:
        quants.require_format(Q.IQ2_XXS, name)
    assert str(e.value) == (
        "tensor blk.0.ffn_up_exps.weight has type IQ2_XXS, which fomoepy does not support "
        "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4)"
    )
    with pytest.raises(UnsupportedQuantType, match="tensor t has type Q3_K"):
        quants.dequantize(np.zeros(110, np.uint8), Q.Q3_K, (256,), tensor_name="t")
    with pytest.raises(UnsupportedQuantType, match="type IQ4_XS"):
        quants.quantize(np.zeros(256, np.float32), Q.IQ4_XS)
    with pytest.raises(UnsupportedQuantType, match="unknown type id 999"):
        quants.require_format(999, "x")
    assert Q.Q2_K not in quants.FORMATS and Q.Q6_K in quants.FORMATS


ORACLE_MODELS = sorted(p.name for p in ORACLE.glob("qwen*.gguf"))


@pytest.mark.parametrize("filename", ORACLE_MODELS)
def test_fixture_tensors_decode_like_gguf(filename):
    reader = GGUFReader(ORACLE / filename)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        assert quants.nbytes_for(t.tensor_type, shape) == t.n_bytes
        ours = quants.dequantize(t.data, t.tensor_type, shape, tensor_name=t.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(bits(ours), bits(ref), err_msg=t.name)
