"""Matrix products through ggml (ggml-python) on quantized bytes, computed in place.

A weight is a `QuantMatrix`: the GGUF/store bytes of an [N, K] matrix, untouched, and its GGUF type
(GGUF type ids are ggml's). ggml reads those bytes where they lie (the mapped file, or a host-tier
record) and quantizes the activations as llama.cpp does (Q8_0/Q8_K blocks), so results track
llama.cpp's logits rather than the exact float32 ones.

Granularity, measured on the 2-core machine (busy): one graph per call costs ~55 µs for a
1024×1024 Q8_0 matvec on one thread, of which ~15 µs is building the graph through ctypes; numpy's
float32 matvec of the already dequantised matrix takes ~40 µs. So dense projections use a graph per
call, and routed experts put all of a layer's selected experts (gate, up, SwiGLU, down) into one
graph (`expert_ffn`), which is where the calls per token are.

Every output element is one dot product computed by one thread, in a fixed order: the result does
not depend on the thread count or on which other experts share the graph.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ggml
import numpy as np

from fomoepy.errors import FomoeError

F32 = np.float32
# GGUF types ggml computes from (fomoepy.quants supports exactly these)
SUPPORTED_TYPES = {0, 1, 2, 8, 12, 13, 14, 30, 39}
_TENSOR_OVERHEAD = ggml.ggml_tensor_overhead()
_GRAPH_OVERHEAD = ggml.ggml_graph_overhead()


@dataclass(frozen=True)
class QuantMatrix:
    """[N, K] weight as its stored bytes (uint8, C-contiguous) and GGUF type."""

    data: np.ndarray
    qtype: int
    n_rows: int
    n_cols: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    @staticmethod
    def of(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> "QuantMatrix":
        if int(qtype) not in SUPPORTED_TYPES:
            raise FomoeError(f"quant type {int(qtype)} is not supported by the ggml CPU backend")
        n, k = int(shape[0]), int(shape[1])
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if data.nbytes != ggml.ggml_row_size(int(qtype), k) * n:
            raise FomoeError(f"{data.nbytes} bytes do not hold a [{n}, {k}] matrix of type {int(qtype)}")
        return QuantMatrix(data, int(qtype), n, k)


class _Graph:
    """One ggml context: weights and inputs point at numpy memory; intermediates live in the context."""

    def __init__(self, work_bytes: int, n_tensors: int):
        size = n_tensors * _TENSOR_OVERHEAD + _GRAPH_OVERHEAD + work_bytes + (1 << 16)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise FomoeError(f"ggml could not allocate a {size}-byte context")
        self.keep: list[np.ndarray] = []  # numpy memory the tensors point at, alive until compute

    def wrap(self, qtype: int, ne0: int, ne1: int, buf: np.ndarray):
        ggml.ggml_set_no_alloc(self.ctx, True)
        t = ggml.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1)
        ggml.ggml_set_no_alloc(self.ctx, False)
        t.contents.data = ctypes.c_void_p(buf.ctypes.data)
        self.keep.append(buf)
        return t

    def weight(self, w: QuantMatrix):
        return self.wrap(w.qtype, w.n_cols, w.n_rows, w.data)

    def compute(self, outputs, threads: int) -> None:
        gf = ggml.ggml_new_graph(self.ctx)
        for t in outputs:
            ggml.ggml_build_forward_expand(gf, t)
        if ggml.ggml_graph_compute_with_ctx(self.ctx, gf, threads) != 0:
            raise FomoeError("ggml graph computation failed")

    def free(self) -> None:
        ggml.ggml_free(self.ctx)
        self.keep.clear()


def _row_bytes_q8(k: int) -> int:
    # room for ggml's quantized copy of the activations (Q8_K is the largest vec_dot type)
    return ggml.ggml_row_size(ggml.GGML_TYPE_Q8_K, k) + ggml.ggml_row_size(ggml.GGML_TYPE_F32, k)


def mul_mat(x: np.ndarray, w: QuantMatrix, threads: int) -> np.ndarray:
    """x [T, K] float32 · wᵀ → [T, N] float32."""
    x = np.ascontiguousarray(x, dtype=F32)
    T = x.shape[0]
    out = np.empty((T, w.n_rows), F32)
    g = _Graph(T * _row_bytes_q8(w.n_cols) + 4096 * threads, 4)
    try:
        wt = g.weight(w)
        xt = g.wrap(ggml.GGML_TYPE_F32, w.n_cols, T, x)
        y = ggml.ggml_mul_mat(g.ctx, wt, xt)
        y.contents.data = ctypes.c_void_p(out.ctypes.data)
        g.compute([y], threads)
    finally:
        g.free()
    return out


def expert_ffn(
    h: np.ndarray, groups: list[tuple[np.ndarray, QuantMatrix, QuantMatrix, QuantMatrix]], threads: int
) -> list[np.ndarray]:
    """For each (rows, gate, up, down): down · (silu(gate · h[rows]) ⊙ up · h[rows]) → [len(rows), D].

    All experts in one graph; silu and the product run in ggml in float32, as llama.cpp's do.
    """
    h = np.ascontiguousarray(h, dtype=F32)
    outs = []
    work = 4096 * threads
    for rows, gate, up, down in groups:
        n = len(rows)
        F = gate.n_rows
        work += n * (3 * F * 4 + _row_bytes_q8(gate.n_cols) + _row_bytes_q8(F))
    g = _Graph(work, 10 * len(groups) + 4)
    try:
        results = []
        for rows, gate, up, down in groups:
            x = np.ascontiguousarray(h[rows])
            out = np.empty((len(rows), down.n_rows), F32)
            xt = g.wrap(ggml.GGML_TYPE_F32, gate.n_cols, len(rows), x)
            a = ggml.ggml_mul_mat(g.ctx, g.weight(gate), xt)
            b = ggml.ggml_mul_mat(g.ctx, g.weight(up), xt)
            y = ggml.ggml_mul_mat(g.ctx, g.weight(down), ggml.ggml_mul(g.ctx, ggml.ggml_silu(g.ctx, a), b))
            y.contents.data = ctypes.c_void_p(out.ctypes.data)
            g.keep.append(out)
            results.append(y)
            outs.append(out)
        g.compute(results, threads)
    finally:
        g.free()
    return outs
