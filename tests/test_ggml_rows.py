"""A product over the rows of several sequences gives each row the bits it gets alone, for every weight
type the cpu backend computes from (fomoepy.runtime.ggml_matmul.rows_apart): the rows of a type whose
several-row products sum otherwise (llamafile's float GEMMs from two rows, ggml's tiled K-quant GEMM from
eight) are multiplied apart; the others' several-row kernels give each row its one-row bits (llamafile's
Q8_0 and Q4_0 GEMMs where the probe on this CPU says so, the K-quants' below eight rows), which is why one
product serves them: checked here on another shape than the probe's, at 5 and 9 rows."""

from __future__ import annotations

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np
import pytest

from fomoepy import quants
from fomoepy.runtime.ggml_matmul import (
    APART_BELOW_ROWS,
    SUPPORTED_TYPES,
    QuantMatrix,
    mul_mat,
    rows_apart,
    rows_apart_from,
    rows_differ_together,
)

N, K = 96, 512  # K a multiple of every block


def weight(rng: np.random.Generator, qtype: int) -> QuantMatrix:
    raw = quants.quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), quants.GGMLQuantizationType(qtype))
    return QuantMatrix.of(np.frombuffer(raw.tobytes(), np.uint8), qtype, (N, K))


@pytest.mark.parametrize("B", [5, 9])  # rows, as a batched step of B sequences: below and past the tiled GEMM's 8
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES))
def test_each_row_of_a_batched_product_is_its_lone_product(qtype, B):
    rng = np.random.default_rng(qtype)
    w, x = weight(rng, qtype), rng.standard_normal((B, K)).astype(np.float32)
    got = rows_apart(x, w, threads=2)
    for i in range(B):
        assert np.array_equal(got[i], mul_mat(x[i : i + 1], w, threads=1)[0]), f"row {i}"
    if not rows_differ_together(qtype, B):  # one product of the rows is what rows_apart takes for them
        assert np.array_equal(mul_mat(x, w, threads=2), got)


@pytest.mark.skipif(not ggml.ggml_cpu_has_llamafile(), reason="ggml built without llamafile: no several-row GEMM to tell apart")
def test_the_probe_tells_a_gemm_that_sums_otherwise_from_one_that_keeps_rows():
    # llamafile's F32 GEMM sums a row in another order than the one-row product: the probe must see it
    # (a probe that always answered "keeps rows" would let the integer types through unchecked)
    assert rows_apart_from(0) == 2


@pytest.mark.parametrize("qtype", [ggml.GGML_TYPE_Q8_0, ggml.GGML_TYPE_Q4_0])  # rows keep their bits in llamafile's GEMMs
def test_a_few_sequences_rows_take_one_row_products_which_are_faster_there(qtype):
    # below APART_BELOW_ROWS a decode batch's product is B one-row products (x as [K, 1, B]) even where
    # one several-row product would give the same bits: llamafile's GEMM is the slower at a few rows;
    # Q8_0 weights go to fomoepy's kernel wherever it agrees with ggml, at every row count
    from fomoepy.runtime import dense_rows
    from fomoepy.runtime.ggml_dense import Graph, apart_bytes, product

    w = weight(np.random.default_rng(1), qtype)
    for B, apart in ((2, True), (4, True), (7, True), (16, rows_differ_together(qtype, 16))):
        g = Graph(16, apart_bytes(w, B) + 4 * N * B, 1)
        node = product(g, w, g.input(K, B), B, apart=True)
        if dense_rows.handles(w):
            assert ggml.ggml_op_name(node.contents.op) == b"CUSTOM", f"{B} rows"  # (the library's name: the bindings' enum is older)
            continue
        while node.contents.op != ggml.GGML_OP_MUL_MAT:
            node = node.contents.src[0]
        assert node.contents.src[1].contents.ne[1] == (1 if apart else B), f"{B} rows"
    assert APART_BELOW_ROWS <= 16
