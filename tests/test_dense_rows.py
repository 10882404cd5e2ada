"""fomoepy's Q8_0 kernel for a decode batch's dense products (fomoepy/runtime/_dense_rows.c): each row's
result is, bit for bit, ggml's one-row product of that row, whatever the batch, its size's parity, the
weight rows' count or the threads; on this CPU the engine takes it (the probe agrees)."""

from __future__ import annotations

import numpy as np
import pytest

from fomoepy import quants
from fomoepy.runtime import dense_rows
from fomoepy.runtime.ggml_matmul import QuantMatrix, fresh_mul_mat

pytestmark = pytest.mark.skipif(not dense_rows.runs(), reason="the kernel is not built or this CPU lacks AVX2")
FORMS = [form for form in (dense_rows.AVX2, dense_rows.AVX512) if form <= dense_rows.best_form()]  # each the CPU runs

Q8_0 = dense_rows.Q8_0
BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # ggml's block_q8_0, 34 bytes


def q8_0_weight(rng: np.random.Generator, n: int, k: int, extremes: bool = False) -> QuantMatrix:
    """Raw Q8_0 blocks: any int8 (-128 included where extremes) and scales of several magnitudes."""
    blocks = np.zeros(n * k // 32, BLOCK)
    blocks["qs"] = rng.integers(-128 if extremes else -127, 128, blocks["qs"].shape)
    blocks["d"] = (rng.standard_normal(blocks.shape) * 10.0 ** rng.integers(-4, 1, blocks.shape)).astype(np.float16)
    if extremes:
        blocks["qs"][::7] = 0  # whole zero blocks
        blocks["qs"][1::5, :8] = -128
        blocks["d"][2::11] = 0.0
    return QuantMatrix.of(np.frombuffer(blocks.tobytes(), np.uint8), Q8_0, (n, k))


def lone(x: np.ndarray, w: QuantMatrix) -> np.ndarray:
    """Each row's one-row product through ggml (the bits a sequence gets alone)."""
    return np.stack([fresh_mul_mat(x[i : i + 1], w, 1)[0] for i in range(len(x))])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B", [2, 3, 5, 8, 9, 11, 13, 16, 17])  # every count of pairs (1-9), an odd batch's last pair of one row
@pytest.mark.parametrize("shape", [(63, 256), (5, 96), (130, 1024), (1, 32)])  # weight rows (N) and columns (K); one row, one block
def test_each_rows_result_is_its_lone_one_row_products_bits(shape, B, form):
    rng = np.random.default_rng([B, *shape])
    w = q8_0_weight(rng, *shape)
    x = (rng.standard_normal((B, shape[1])) * 3.0).astype(np.float32)
    want = lone(x, w)
    for threads in (1, 3):  # (3: more threads than (1, 32)'s one weight row)
        assert np.array_equal(dense_rows.products(w, x, threads, form), want), f"{threads} threads"


@pytest.mark.parametrize("form", FORMS)
def test_extreme_quants_and_zero_scales_and_rows_keep_ggmls_bits(form):
    # -128 (whose absolute value wraps to 128 unsigned), zero blocks and zero scales, a zero row, a huge row
    rng = np.random.default_rng(7)
    w = q8_0_weight(rng, 37, 512, extremes=True)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1] = 0.0
    x[2] *= 1e4  # (its scales near the top of float16)
    x[3, :64] = 0.0  # two zero blocks: scale 0
    assert np.array_equal(dense_rows.products(w, x, 2, form), lone(x, w))


def test_the_engine_takes_the_kernel_here():
    # the probe asks ggml's own one-row products; a kernel that summed otherwise would be left unused, its
    # tests above red, and the batch's products back on ggml's
    assert dense_rows.agrees()
    rng = np.random.default_rng(3)
    assert dense_rows.handles(q8_0_weight(rng, 8, 64))
    q4_0 = quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), quants.GGMLQuantizationType.Q4_0)
    assert not dense_rows.handles(QuantMatrix.of(np.frombuffer(q4_0.tobytes(), np.uint8), int(quants.GGMLQuantizationType.Q4_0), (8, 64)))


def test_a_product_of_a_view_that_is_not_contiguous_fits_the_room_apart_bytes_counts():
    # product() copies such an x (ggml_cont) before the kernel's node quantizes it: both fit in apart_bytes
    # (K > 4·N: the F32 copy and the Q8_0 one outgrow the room counted for ggml's one-row products)
    import ggml

    from fomoepy.runtime.ggml_dense import APART_TENSORS, Graph, apart_bytes, product

    N, K, B = 1, 1024, 7
    rng = np.random.default_rng(5)
    w = q8_0_weight(rng, N, K)
    g = Graph(3 + APART_TENSORS, apart_bytes(w, B) + 4 * B * K, 1)  # the input, the weight, x computed (room counted), product's
    rows = ggml.ggml_scale(g.ctx, g.input(B, K), 1.0)  # [B, K] computed: a view of an input would take no data pointer
    y = product(g, w, ggml.ggml_transpose(g.ctx, rows), B, apart=True)  # x [K, B], not contiguous
    g.finish([(y, (B, N))])
    x = rng.standard_normal((B, K)).astype(np.float32)
    assert np.array_equal(g.run(np.ascontiguousarray(x.T))[0], lone(x, w))
