"""GGUF tensor formats: one table of facts per type, vectorised numpy decoders and encoders.

`FORMATS` is the single source of truth: block size and bytes per block (from `gguf.GGML_QUANT_SIZES`),
the two block functions and the GPU kernels' name suffix of every type fomoepy supports. Everything else (byte sizes, `dequantize`,
`quantize`, the "unsupported type" error) is derived from it, so a caller never branches on a type.

Decoders must agree with `gguf.quants.dequantize` bit for bit: each performs the same float32
operations in the same order (e.g. Q4_K is `(d * sc) * q - (dmin * m)`, never a fused or reordered
form), and only the unpacking of bits is rearranged for speed. Block functions take `[n_blocks, type_size]`
uint8 and return `[n_blocks, block_size]` float32, and the reverse for encoders.

The K-quant encoders are ours (gguf can only decode K-quants): plain min/max fitting, no rounding
search like llama.cpp's, but always valid blocks with a small error. The other encoders are gguf's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fomoepy.errors import UnsupportedQuantType

BlockFn = Callable[[np.ndarray], np.ndarray]

QK_K = 256  # elements per K-quant super-block


@dataclass(frozen=True)
class QuantFormat:
    """Facts about one tensor type: a row of `block_size` elements is stored in `type_size` bytes."""

    qtype: GGMLQuantizationType
    block_size: int  # elements per block
    type_size: int  # bytes per block
    dequantize_blocks: BlockFn  # [n, type_size] uint8 -> [n, block_size] float32
    quantize_blocks: BlockFn  # [n, block_size] float32 -> [n, type_size] uint8

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def kernel_suffix(self) -> str:
        """The suffix of this type's GPU kernels (mv_q4_k_t1, ...): FOR_EACH_FORMAT in hip_kernels/dequant.h
        instantiates every kernel family for each (tests/test_kernels_compile.py checks the two agree)."""
        return self.qtype.name.lower()


# --- small helpers ------------------------------------------------------------------------------------


def _f16(cols: np.ndarray) -> np.ndarray:
    """[n, 2k] uint8 (k little-endian fp16 fields) -> [n, k] float32."""
    return np.ascontiguousarray(cols).view("<f2").astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[n, k] float -> [n, 2k] uint8 of little-endian fp16."""
    return np.ascontiguousarray(values, dtype="<f2").view(np.uint8)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, c, 32] uint8 -> [n, c, 2, 32]: the low nibbles, then the high nibbles, of each 32-byte chunk."""
    out = np.empty((*packed.shape[:-1], 2, packed.shape[-1]), np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    np.right_shift(packed, 4, out=out[..., 1, :])
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Inverse of `_nibbles`: [n, c, 2, 32] values 0..15 -> [n, c, 32] bytes."""
    return (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, with 0 where den is 0 (an all-zero block gets scale 0 and quants 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), 0).astype(np.float32)


# --- plain floats -------------------------------------------------------------------------------------


def _dequant_f32(b: np.ndarray) -> np.ndarray:
    return b.view("<f4")


def _quant_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)


# every fp16 bit pattern -> float32: one gather is twice as fast as numpy's fp16 conversion loop
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _dequant_f16(b: np.ndarray) -> np.ndarray:
    return np.take(_F16_TO_F32, b.view("<u2"))


def _quant_f16(x: np.ndarray) -> np.ndarray:
    return _f16_bytes(x)


def _dequant_bf16(b: np.ndarray) -> np.ndarray:
    # bf16 is the top half of a float32
    return (b.view("<u2").astype(np.uint32) << 16).view(np.float32)


# --- 32-element blocks --------------------------------------------------------------------------------


def _dequant_q8_0(b: np.ndarray) -> np.ndarray:
    # Q8_0 (34 B): d fp16 | 32 x int8 q          x = q * d
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:
    # Q4_0 (18 B): d fp16 | 16 bytes: element i in the low nibble of byte i, element 16+i in the high
    # nibble;   x = d * (q - 8)
    q = _nibbles(b[:, None, 2:]).reshape(b.shape[0], 32).view(np.int8) - np.int8(8)
    return _f16(b[:, :2]) * q.astype(np.float32)


# MXFP4 e2m1 values, doubled; the scale is e8m0 halved to match (see gguf / ggml_e8m0_to_fp32_half)
_MXFP4_KVALUES = np.array(gguf.quants.MXFP4.kvalues, dtype=np.float32)


def _dequant_mxfp4(b: np.ndarray) -> np.ndarray:
    # MXFP4 (17 B): e8m0 exponent e | 16 bytes of 4-bit e2m1 codes, laid out like Q4_0
    e = b[:, :1].astype(np.uint32)
    d = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
    q = np.take(_MXFP4_KVALUES, _nibbles(b[:, None, 1:]).reshape(b.shape[0], 32))
    with np.errstate(over="ignore"):  # e = 255 with |q| = 12 is +-inf, as in ggml
        return d * q


# --- K-quants: 256-element super-blocks ---------------------------------------------------------------
#
# Q4_K (144 B) and Q5_K (176 B), 8 sub-blocks of 32, x = (d * sc[j]) * q - (dmin * m[j]):
#   0..1    d     fp16   scale of the 6-bit sub-block scales
#   2..3    dmin  fp16   scale of the 6-bit sub-block mins
#   4..15   12 bytes: eight 6-bit sc and eight 6-bit m
#             byte 0..3   sc[0..3] in bits 0-5, bits 4-5 of sc[4..7] in bits 6-7
#             byte 4..7   m[0..3]  in bits 0-5, bits 4-5 of m[4..7]  in bits 6-7
#             byte 8..11  bits 0-3 of sc[4..7] low nibble, bits 0-3 of m[4..7] high nibble
#   Q5_K only: 32 bytes qh: bit j of byte i is bit 4 of element i of sub-block j
#   then 128 bytes qs: chunk c (32 bytes) holds sub-block 2c in its low nibbles, 2c+1 in its high ones
#
# Q6_K (210 B), 16 sub-blocks of 16, x = (d * sc[j]) * (q - 32), q 6-bit:
#   0..127    ql: half h (64 bytes each): element h*128 + s*64 + i has low 4 bits in nibble s of byte i
#   128..191  qh: half h (32 bytes each): element h*128 + k*32 + i has bits 4-5 in bits 2k..2k+1 of byte i
#   192..207  sc  int8 x 16
#   208..209  d   fp16


def _unpack_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed bytes -> (sc, m), each [n, 8] uint8 in 0..63."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of `_unpack_scale_min`."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=-1).astype(np.uint8)


def _dequant_kq_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Shared tail of Q4_K/Q5_K: q [n, 8, 32] uint8 -> x = (d * sc) * q - (dmin * m)."""
    n = b.shape[0]
    dd = _f16(b[:, :4])  # [n, 2]: d, dmin
    sc, mn = _unpack_scale_min(b[:, 4:16])
    ds = (dd[:, :1] * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (dd[:, 1:] * mn.astype(np.float32)).reshape(n, 8, 1)
    out = q.astype(np.float32)
    np.multiply(ds, out, out=out)
    np.subtract(out, dm, out=out)
    return out.reshape(n, QK_K)


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32))  # [n, 4, 2, 32] = [n, 8 sub-blocks, 32]
    return _dequant_kq_affine(b, q.reshape(-1, 8, 32))


_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def _dequant_q5_k(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = (b[:, None, 16:48] >> _BIT_SHIFTS) & 1  # [n, 8, 32]: bit j of byte i
    return _dequant_kq_affine(b, q | (qh << 4))


_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
# byte -> its four 2-bit fields, lowest first, as 4 bytes read in one gather
_CRUMBS = ((np.arange(256, dtype=np.uint8)[:, None] >> _CRUMB_SHIFTS.reshape(1, 4)) & 3).view("<u4").ravel()


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    q = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, QK_K)  # [n, half, s, 64]: low 4 bits
    hi = np.take(_CRUMBS, b[:, 128:192]).view(np.uint8).reshape(n, 2, 32, 4).transpose(0, 1, 3, 2)
    q |= hi.reshape(n, QK_K) << 4  # [n, half, k, 32]: bits 4-5
    q = q.view(np.int8)
    q -= np.int8(32)
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    out = q.astype(np.float32).reshape(n, 16, 16)
    np.multiply(d, out, out=out)
    return out.reshape(n, QK_K)


def _fit_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fit x [n, 8, 32] as (d*sc)*q - (dmin*m) with q in 0..nmax; returns (d, dmin, sc, m) quantised.

    The min is rounded up and the scale is chosen after it, also rounded up, so that every element
    lies inside the representable range (no clipping beyond fp16 rounding of d/dmin).
    """
    lo = np.minimum(x.min(axis=-1), 0)  # [n, 8]; a sub-block min above 0 is stored as m = 0
    hi = x.max(axis=-1)
    dmin = _round_f16_up((-lo).max(axis=-1) / 63)
    m = np.clip(np.ceil(_safe_div(-lo, dmin[:, None])), 0, 63)
    shift = dmin[:, None] * m  # what the decoder subtracts
    scale = (hi + shift) / nmax
    d = _round_f16_up(scale.max(axis=-1) / 63)
    sc = np.clip(np.ceil(_safe_div(scale, d[:, None])), 0, 63)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8)


def _round_f16_up(v: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= v (as float32), so that a scale rounded to fp16 never shrinks the range."""
    h = np.minimum(v, 65504).astype(np.float16)
    h = np.where((h.astype(np.float32) < v) & (h < 65504), np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float32)


def _affine_quants(x: np.ndarray, d, dmin, sc, m, nmax: int) -> np.ndarray:
    """q = round((x + dmin*m) / (d*sc)) in 0..nmax, for x [n, 8, 32]."""
    inv_step = _safe_div(np.float32(1), d[:, None] * sc.astype(np.float32))[..., None]  # [n, 8, 1]
    shift = (dmin[:, None] * m.astype(np.float32))[..., None]
    return np.clip(np.rint((x + shift) * inv_step), 0, nmax).astype(np.uint8)


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32)
    d, dmin, sc, m = _fit_affine(x, 15)
    q = _affine_quants(x, d, dmin, sc, m, 15)
    qs = _pack_nibbles(q.reshape(-1, 4, 2, 32)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(np.stack([d, dmin], -1)), _pack_scale_min(sc, m), qs], axis=-1)


def _quant_q5_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32)
    d, dmin, sc, m = _fit_affine(x, 31)
    q = _affine_quants(x, d, dmin, sc, m, 31)
    qs = _pack_nibbles((q & 0x0F).reshape(-1, 4, 2, 32)).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << _BIT_SHIFTS, axis=1).astype(np.uint8)  # [n, 32]
    return np.concatenate([_f16_bytes(np.stack([d, dmin], -1)), _pack_scale_min(sc, m), qh, qs], axis=-1)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # [n, 16]; q in -31..31 leaves -32 unused: symmetric
    d = _round_f16_up(scale.max(axis=-1) / 127)
    sc = np.clip(np.ceil(_safe_div(scale, d[:, None])), 0, 127)
    inv_step = _safe_div(np.float32(1), d[:, None] * sc)[..., None]  # [n, 16, 1]
    q = (np.clip(np.rint(sub * inv_step), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, QK_K)
    lo = _pack_nibbles((q & 0x0F).reshape(n, 2, 2, 64)).reshape(n, 128)
    crumbs = (q >> 4).reshape(n, 2, 4, 32) << _CRUMB_SHIFTS
    hi = np.bitwise_or.reduce(crumbs, axis=2).astype(np.uint8).reshape(n, 64)
    return np.concatenate([lo, hi, sc.astype(np.int8).view(np.uint8), _f16_bytes(d[:, None])], axis=-1)


# --- the table ----------------------------------------------------------------------------------------

_T = GGMLQuantizationType

_BLOCK_FNS: dict[GGMLQuantizationType, tuple[BlockFn, BlockFn]] = {
    _T.F32: (_dequant_f32, _quant_f32),
    _T.F16: (_dequant_f16, _quant_f16),
    _T.BF16: (_dequant_bf16, gguf.quants.BF16.quantize_blocks),
    _T.Q8_0: (_dequant_q8_0, gguf.quants.Q8_0.quantize_blocks),
    _T.Q4_0: (_dequant_q4_0, gguf.quants.Q4_0.quantize_blocks),
    _T.Q4_K: (_dequant_q4_k, _quant_q4_k),
    _T.Q5_K: (_dequant_q5_k, _quant_q5_k),
    _T.Q6_K: (_dequant_q6_k, _quant_q6_k),
    _T.MXFP4: (_dequant_mxfp4, gguf.quants.MXFP4.quantize_blocks),
}

FORMATS: dict[GGMLQuantizationType, QuantFormat] = {
    qtype: QuantFormat(qtype, *GGML_QUANT_SIZES[qtype], dequantize_blocks=dec, quantize_blocks=enc)
    for qtype, (dec, enc) in _BLOCK_FNS.items()
}

SUPPORTED: tuple[GGMLQuantizationType, ...] = tuple(FORMATS)


# --- public API ---------------------------------------------------------------------------------------


def require_format(qtype: int, tensor_name: str | None = None) -> QuantFormat:
    """The format of `qtype`, or `UnsupportedQuantType` naming the tensor, its type and what is supported."""
    fmt = FORMATS.get(qtype)  # type: ignore[call-overload]
    if fmt is not None:
        return fmt
    try:
        type_name = GGMLQuantizationType(qtype).name
    except ValueError:
        type_name = f"unknown type id {int(qtype)}"
    subject = f"tensor {tensor_name}" if tensor_name else "a tensor"
    supported = ", ".join(t.name for t in SUPPORTED)
    raise UnsupportedQuantType(
        f"{subject} has type {type_name}, which fomoepy does not support (supported: {supported})"
    )


def row_nbytes(qtype: int, n_cols: int, tensor_name: str | None = None) -> int:
    """Bytes of one row of `n_cols` elements; the row must be a whole number of blocks."""
    fmt = require_format(qtype, tensor_name)
    if n_cols % fmt.block_size:
        what = f"{tensor_name}: " if tensor_name else ""
        raise ValueError(f"{what}row length {n_cols} is not a multiple of the {fmt.name} block size {fmt.block_size}")
    return n_cols // fmt.block_size * fmt.type_size


def nbytes_for(qtype: int, shape: tuple[int, ...], tensor_name: str | None = None) -> int:
    """Bytes of a tensor of numpy `shape` (last axis = row) stored as `qtype`."""
    if not shape:
        return row_nbytes(qtype, 1, tensor_name)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    return n_rows * row_nbytes(qtype, int(shape[-1]), tensor_name)


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...], tensor_name: str | None = None) -> np.ndarray:
    """Decode the bytes of a tensor into float32 of numpy `shape`, bit-exactly as `gguf.quants.dequantize`.

    `raw` may have any shape as long as it holds exactly `nbytes_for(qtype, shape)` bytes. For F32 the
    result is a view of `raw` (no copy; read-only if `raw` is).
    """
    fmt = require_format(qtype, tensor_name)
    shape = tuple(int(n) for n in shape)
    expected = nbytes_for(qtype, shape, tensor_name)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != expected:
        what = f"{tensor_name}: " if tensor_name else ""
        raise ValueError(f"{what}expected {expected} bytes for {fmt.name} {shape}, got {data.size}")
    return fmt.dequantize_blocks(data.reshape(-1, fmt.type_size)).reshape(shape)


_CHUNK_ELEMENTS = 1 << 20  # encoders make several temporaries per element; bound them


def quantize(values: np.ndarray, qtype: int, tensor_name: str | None = None) -> np.ndarray:
    """Encode float values as GGUF rows: uint8 of shape `(*values.shape[:-1], row_nbytes)`."""
    fmt = require_format(qtype, tensor_name)
    x = np.asarray(values, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    row_bytes = row_nbytes(qtype, x.shape[-1], tensor_name)
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fmt.quantize_blocks(blocks[start : start + step]).reshape(-1, fmt.type_size)
    return out.reshape(*x.shape[:-1], row_bytes)
