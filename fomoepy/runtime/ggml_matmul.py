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
from fomoepy.timing import MATMUL

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
    def of(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantMatrix:
        if int(qtype) not in SUPPORTED_TYPES:
            raise FomoeError(f"quant type {int(qtype)} is not supported by the ggml CPU backend")
        n, k = int(shape[0]), int(shape[1])
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if data.nbytes != ggml.ggml_row_size(int(qtype), k) * n:
            raise FomoeError(f"{data.nbytes} bytes do not hold a [{n}, {k}] matrix of type {int(qtype)}")
        return QuantMatrix(data, int(qtype), n, k)


class _Graph:
    """One ggml context holding only tensor headers: every tensor's data is numpy memory (weights
    where they lie, activations and results in fresh arrays), and the work buffer is sized by
    ggml's own plan, so nothing depends on guessing ggml's scratch needs."""

    def __init__(self, n_tensors: int):
        size = n_tensors * _TENSOR_OVERHEAD + 2 * _GRAPH_OVERHEAD  # the graph object and its hash set
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise FomoeError(f"ggml could not allocate a {size}-byte context")
        self.keep: list[np.ndarray] = []  # numpy memory the tensors point at, alive until compute

    def wrap(self, qtype: int, ne0: int, ne1: int, buf: np.ndarray):
        t = ggml.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1)
        t.contents.data = ctypes.c_void_p(buf.ctypes.data)
        self.keep.append(buf)
        return t

    def weight(self, w: QuantMatrix):
        return self.wrap(w.qtype, w.n_cols, w.n_rows, w.data)

    def result(self, t, rows: int, cols: int) -> np.ndarray:
        """Give the (unallocated) result tensor t [rows, cols] float32 numpy memory."""
        out = np.empty((rows, cols), F32)
        t.contents.data = ctypes.c_void_p(out.ctypes.data)
        self.keep.append(out)
        return out

    def compute(self, outputs, threads: int) -> None:
        gf = ggml.ggml_new_graph(self.ctx)
        for t in outputs:
            ggml.ggml_build_forward_expand(gf, t)
        plan = ggml.ggml_graph_plan(gf, threads, None)
        work = np.empty(max(plan.work_size, 1), np.uint8)
        plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        with MATMUL.timed():
            status = ggml.ggml_graph_compute(gf, ctypes.byref(plan))
        if status != 0:
            raise FomoeError("ggml graph computation failed")

    def free(self) -> None:
        ggml.ggml_free(self.ctx)
        self.keep.clear()


def mul_mat(x: np.ndarray, w: QuantMatrix, threads: int) -> np.ndarray:
    """x [T, K] float32 · wᵀ → [T, N] float32."""
    x = np.ascontiguousarray(x, dtype=F32)
    T = x.shape[0]
    g = _Graph(4)
    try:
        y = ggml.ggml_mul_mat(g.ctx, g.weight(w), g.wrap(ggml.GGML_TYPE_F32, w.n_cols, T, x))
        out = g.result(y, T, w.n_rows)
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
    g = _Graph(8 * len(groups) + 4)
    try:
        outs, results = [], []
        for rows, gate, up, down in groups:
            n, F = len(rows), gate.n_rows
            xt = g.wrap(ggml.GGML_TYPE_F32, gate.n_cols, n, np.ascontiguousarray(h[rows]))
            a = ggml.ggml_mul_mat(g.ctx, g.weight(gate), xt)
            g.result(a, n, F)
            b = ggml.ggml_mul_mat(g.ctx, g.weight(up), xt)
            g.result(b, n, F)
            s_ = ggml.ggml_silu(g.ctx, a)
            g.result(s_, n, F)
            act = ggml.ggml_mul(g.ctx, s_, b)
            g.result(act, n, F)
            y = ggml.ggml_mul_mat(g.ctx, g.weight(down), act)
            outs.append(g.result(y, n, down.n_rows))
            results.append(y)
        g.compute(results, threads)
    finally:
        g.free()
    return outs
