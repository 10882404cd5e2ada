"""Matrix products through ggml (ggml-python) on quantized bytes, computed in place.

A weight is a `QuantMatrix`: the GGUF/store bytes of an [N, K] matrix, untouched, and its GGUF type
(GGUF type ids are ggml's). ggml reads those bytes where they lie (the mapped file, or a host-tier
record) and quantizes the activations as llama.cpp does (Q8_0/Q8_K blocks), so results track
llama.cpp's logits rather than the exact float32 ones.

Granularity, measured on the 2-core machine: every ggml-python call costs about 1 µs, and building a
graph takes some 20 calls per expert. So routed experts put all of a layer's selected experts (gate,
up, SwiGLU, down) into one graph (`expert_ffn`), and a decode step (one token) runs graphs built
once per type mix and shape, with only their data pointers set per call (`_DecodeGraph`). Idle, one
thread, the bench model's 8 experts of a layer: 881 µs with a graph built for the call (246 µs of it
building and Python), 639 µs with the cached graph (70 µs); a 512×1024 Q4_K matvec 34.7 µs against
26.0 µs, of which ggml computes 19.9. Prefill builds a graph per call, which its many rows amortise.

Every output element is one dot product computed by one thread, in a fixed order: the result does
not depend on the thread count or on which other experts share the graph. It may depend on how many
rows the product has: from two rows on, llamafile's GEMMs (ggml's for F32, F16, BF16, Q8_0, Q4_0, ...)
sum in another order than a row alone, so the rows of several sequences go through `rows_apart`.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.routing import top_ids
from fomoepy.runtime import dense_rows
from fomoepy.timing import MATMUL

F32 = np.float32
# GGUF types ggml computes from (fomoepy.quants supports exactly these)
SUPPORTED_TYPES = {0, 1, 2, 8, 12, 13, 14, 30, 39}
# A product of several rows may take another kernel than one row's. llamafile's GEMMs (where this ggml is
# built with them) take products of two rows or more: its float ones (F32, F16, BF16) sum a row's products
# in another order than ggml's one-row dot product; its Q8_0 and Q4_0 ones do, per output element, what
# the one-row dot product does on x86 with AVX2 (the same blocks' integer dot products in the same lanes,
# scaled and fused-added in block order, the lanes summed alike), so rows keep their bits there. ggml
# 0.25's tiled GEMM takes K-quant products of eight rows or more and sums otherwise. Which holds on this
# CPU is asked of ggml itself, once a type (`rows_apart_from`).
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
        """Checked view of `data` (called for every expert a decode step computes: kept lean)."""
        qtype, n, k = int(qtype), int(shape[0]), int(shape[1])
        if not (data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if data.nbytes != _row_size(qtype, k) * n:
            raise FomoeError(f"{data.nbytes} bytes do not hold a [{n}, {k}] matrix of type {qtype}")
        return QuantMatrix(data, qtype, n, k)


@functools.lru_cache(maxsize=None)
def _row_size(qtype: int, k: int) -> int:
    if qtype not in SUPPORTED_TYPES:
        raise FomoeError(f"quant type {qtype} is not supported by the ggml CPU backend")
    return ggml.ggml_row_size(qtype, k)


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

    def wrap(self, qtype: int, ne0: int, ne1: int, buf: np.ndarray, ne2: int = 1):
        t = ggml.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1) if ne2 == 1 else ggml.ggml_new_tensor_3d(self.ctx, qtype, ne0, ne1, ne2)
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
    if T == 1:  # a decode step: a graph built once per weight type and shape, its pointers set per call
        return _decode_graph(("mul_mat", w.qtype, w.n_rows, w.n_cols), lambda: _build_mul_mat(w), threads).run([w], x)[0]
    return fresh_mul_mat(x, w, threads)


def top_ids_of_product(x: np.ndarray, w: QuantMatrix, k: int, threads: int) -> np.ndarray:
    """The ids of the k largest of each row of x [T, K] · wᵀ, largest first: a router's pick for x without
    its probabilities (softmax is monotonic), for a prediction that needs neither (the next layer's guesses,
    read ahead). A decode row's in the product's own graph, by ggml's descending argsort, as the backend's
    routing sorts (ggml_dense.routing_nodes): the numpy sort that did it after the product cost 35-48 µs
    there, on the caches the product and the step's reads had just emptied, where it costs 2.7 µs warm
    (measured in the bench model's decode at a 25 % tier, this project's 2-core machine). Ties (equal
    products) may come in another order than numpy's stable sort would give them: a guess's rank only
    orders the reads made ahead."""
    x = np.ascontiguousarray(x, dtype=F32)
    if x.shape[0] == 1 and k <= w.n_rows:
        graph = _decode_graph(("top_ids", w.qtype, w.n_rows, w.n_cols, k), lambda: _build_top_ids(w, k), threads)
        return graph.run([w], x)[0]
    return top_ids(mul_mat(x, w, threads), k)


# Below this many rows a product of several sequences' rows is taken apart whatever its type's bits do:
# llamafile's Q8_0 GEMM (whose rows keep their bits) is slower than one-row dot products at a decode
# batch's few rows. Measured (bench/batch_step.py's model's Q8_0 output head, 2 threads, AMD EPYC family 26):
# 1.81 / 2.39 / 4.10 / 7.37 ms apart at 2 / 4 / 8 / 16 rows against 2.95 / 4.30 / 3.95 / 5.55 ms as one GEMM.
APART_BELOW_ROWS = 8


def rows_go_apart(qtype: int, rows: int) -> bool:
    """Whether a product of `rows` rows of several sequences is taken as one-row products (x as [K, 1, B]):
    where one product would give a row other bits than alone (rows_differ_together), or is slower."""
    return rows > 1 and (rows < APART_BELOW_ROWS or rows_differ_together(qtype, rows))


def rows_differ_together(qtype: int, rows: int) -> bool:
    """Whether ggml may compute a product of `rows` rows with `qtype` weights otherwise than each row alone:
    llamafile's GEMMs from two rows on (where their sums differ: the float ones), ggml's tiled K-quant GEMM
    from eight (`rows_apart_from`)."""
    first = rows_apart_from(int(qtype))
    return first is not None and rows >= first


PROBED_ROWS = 16  # the probes look this far: past every several-row kernel's threshold ggml has


@functools.cache
def rows_apart_from(qtype: int) -> int | None:
    """The fewest rows for which a product of several rows with `qtype` weights gives a row other bits than
    it gets alone on this CPU and this ggml, or None up to PROBED_ROWS (first_rows_apart). ggml takes
    llamafile's GEMMs from two rows on for the types they take, and (0.25) its tiled K-quant GEMM from
    eight, whose sums are ordered otherwise than the one-row dot products'."""
    raw, x = probe_inputs(qtype)
    m = QuantMatrix.of(raw, qtype, (64, 256))
    return first_rows_apart(lambda rows: fresh_mul_mat(rows, m, 1), x)


def probe_inputs(qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """A probe's fixed data: a [64, 256] weight of `qtype` as its stored bytes, and PROBED_ROWS rows [., 256]
    to multiply by it (every product non-zero)."""
    from fomoepy import quants

    rng = np.random.default_rng(qtype)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(F32)
    raw = np.frombuffer((w if qtype == 0 else quants.quantize(w, quants.GGMLQuantizationType(qtype))).tobytes(), np.uint8)
    return raw, rng.standard_normal((PROBED_ROWS, 256)).astype(F32)


def first_rows_apart(product: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> int | None:
    """Asked of ggml itself: the fewest of x's rows n = 2, 3, ... whose product(x[:n]) gives a row other bits
    than product of that row alone, or None."""
    alone = [product(x[i : i + 1])[0] for i in range(len(x))]
    for n in range(2, len(x) + 1):
        together = product(x[:n])
        if not all(np.array_equal(together[i], alone[i]) for i in range(n)):
            return n
    return None


def rows_apart(x: np.ndarray, w: QuantMatrix, threads: int) -> np.ndarray:
    """x [B, K] · wᵀ → [B, N], each row a one-row product of its own: the bits each row gets alone. ggml
    takes another kernel for a product of several rows than for one (llamafile's GEMMs, from two rows on,
    may sum in another order), so where the weights' type is one it takes (rows_differ_together), or where
    one product of a few rows is slower (rows_go_apart), the rows of several sequences are B products of
    one row each: x as [K, 1, B], w broadcast over the B."""
    x = np.ascontiguousarray(x, dtype=F32)
    B = x.shape[0]
    if B > 1 and dense_rows.handles(w):  # Q8_0: fomoepy's kernel, each row its one-row product's bits
        return dense_rows.products(w, x, threads)
    if not rows_go_apart(w.qtype, B):
        return mul_mat(x, w, threads)
    g = _Graph(3)
    try:
        y = ggml.ggml_mul_mat(g.ctx, g.weight(w), g.wrap(ggml.GGML_TYPE_F32, w.n_cols, 1, x, B))  # [N, 1, B]: row i's N outputs, then row i+1's
        out = g.result(y, B, w.n_rows)
        g.compute([y], threads)
    finally:
        g.free()
    return out


def fresh_mul_mat(x: np.ndarray, w: QuantMatrix, threads: int) -> np.ndarray:
    """mul_mat through a graph built for this call alone (what a decode step's cached graph must equal)."""
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
    if h.shape[0] == 1:  # a decode step: every expert reads the one token; a cached graph per type mix
        weights = [m for _, *mats in groups for m in mats]
        key = ("experts", *((m.qtype, m.n_rows, m.n_cols) for m in weights))
        return _decode_graph(key, lambda: _build_experts(weights), threads).run(weights, h)
    return fresh_expert_ffn(h, groups, threads)


def fresh_expert_ffn(h: np.ndarray, groups: list, threads: int) -> list[np.ndarray]:
    """expert_ffn through a graph built for this call alone."""
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


class _DecodeGraph:
    """A one-token graph built once and run many times: only its weights', input's and outputs' data
    pointers change between calls. Building a graph costs about 1 µs per ggml-python call, some 20
    per expert; a decode step of the bench model (8 layers, 8 experts each, 5 dense products) built
    ~90 graphs per token, about a third of the host's time per layer step. Intermediates live in
    the graph's own context memory, allocated once."""

    def __init__(self, n_tensors: int, scratch_bytes: int):
        size = n_tensors * (_TENSOR_OVERHEAD + 64) + 2 * _GRAPH_OVERHEAD + scratch_bytes
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise FomoeError(f"ggml could not allocate a {size}-byte context")
        self.weights: list = []  # leaf tensors whose data is a weight's bytes, in run()'s order
        self.input = None
        self.outputs: list[tuple] = []  # (tensor, rows, cols, numpy dtype)
        self.plan = None
        self.work = None
        self.gf = None

    def leaf(self, qtype: int, ne0: int, ne1: int):
        ggml.ggml_set_no_alloc(self.ctx, True)  # its data is numpy memory, set per call
        try:
            return ggml.ggml_new_tensor_2d(self.ctx, qtype, ne0, ne1)
        finally:
            ggml.ggml_set_no_alloc(self.ctx, False)

    def finish(self, threads: int) -> None:
        self.gf = ggml.ggml_new_graph(self.ctx)
        for t, *_ in self.outputs:
            ggml.ggml_build_forward_expand(self.gf, t)
        self.plan = ggml.ggml_graph_plan(self.gf, threads, None)
        self.work = np.empty(max(self.plan.work_size, 1), np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def run(self, weights: list[QuantMatrix], x: np.ndarray) -> list[np.ndarray]:
        for t, w in zip(self.weights, weights):
            t.contents.data = w.data.ctypes.data
        self.input.contents.data = x.ctypes.data
        outs = []
        for t, rows, cols, dtype in self.outputs:
            out = np.empty((rows, cols), dtype)
            t.contents.data = out.ctypes.data
            outs.append(out)
        status = MATMUL.call(ggml.ggml_graph_compute, self.gf, ctypes.byref(self.plan))
        if status != 0:
            raise FomoeError("ggml graph computation failed")
        return outs  # weights, x and outs are the caller's: alive for the whole computation

    def __del__(self) -> None:
        if getattr(self, "ctx", None) and ggml is not None:  # at interpreter exit the module may be gone
            ggml.ggml_free(self.ctx)


_graphs = threading.local()  # per thread: a graph's pointers are set and run without a lock


def _decode_graph(key: tuple, build, threads: int) -> _DecodeGraph:
    cache = getattr(_graphs, "cache", None)
    if cache is None:
        cache = _graphs.cache = {}
    g = cache.get((key, threads))
    if g is None:
        g = build()
        g.finish(threads)
        if len(cache) >= _MAX_GRAPHS:  # shapes are few per model; a long-lived process may see many models
            cache.pop(next(iter(cache)))
        cache[(key, threads)] = g
    return g


_MAX_GRAPHS = 64


def _build_mul_mat(w: QuantMatrix) -> _DecodeGraph:
    g = _DecodeGraph(4, 4 * w.n_rows)
    weight = g.leaf(w.qtype, w.n_cols, w.n_rows)
    g.input = g.leaf(ggml.GGML_TYPE_F32, w.n_cols, 1)
    g.weights = [weight]
    g.outputs = [(ggml.ggml_mul_mat(g.ctx, weight, g.input), 1, w.n_rows, F32)]
    return g


def top_k_nodes(ctx, scores, k: int, B: int):
    """scores [E, B] → each row's k largest's indices [k, B] int32, largest first: a descending argsort's
    first k, as llama.cpp routes (nodes in the ggml context ctx)."""
    order = ggml.ggml_argsort(ctx, scores, ggml.GGML_SORT_ORDER_DESC)  # [E, B]
    return ggml.ggml_cont(ctx, ggml.ggml_view_2d(ctx, order, k, B, order.contents.nb[1], 0))


def _build_top_ids(w: QuantMatrix, k: int) -> _DecodeGraph:
    """x · wᵀ's k largest, largest first (top_k_nodes: the routing's order)."""
    g = _DecodeGraph(8, 4 * w.n_rows * 2 + 4 * k + 256)
    weight = g.leaf(w.qtype, w.n_cols, w.n_rows)
    g.input = g.leaf(ggml.GGML_TYPE_F32, w.n_cols, 1)
    g.weights = [weight]
    g.outputs = [(top_k_nodes(g.ctx, ggml.ggml_mul_mat(g.ctx, weight, g.input), k, 1), 1, k, np.int32)]
    return g


def _build_experts(weights: list[QuantMatrix]) -> _DecodeGraph:
    """gate, up, down of each expert, in order; every expert reads the same input row."""
    experts = [weights[i : i + 3] for i in range(0, len(weights), 3)]
    scratch = sum(4 * 4 * gate.n_rows + 4 * down.n_rows + 4 * 64 for gate, _, down in experts)
    g = _DecodeGraph(8 * len(experts) + 4, scratch)
    g.input = g.leaf(ggml.GGML_TYPE_F32, experts[0][0].n_cols, 1)
    for gate, up, down in experts:
        tensors = [g.leaf(m.qtype, m.n_cols, m.n_rows) for m in (gate, up, down)]
        g.weights += tensors
        a = ggml.ggml_mul_mat(g.ctx, tensors[0], g.input)
        b = ggml.ggml_mul_mat(g.ctx, tensors[1], g.input)
        act = ggml.ggml_mul(g.ctx, ggml.ggml_silu(g.ctx, a), b)
        g.outputs.append((ggml.ggml_mul_mat(g.ctx, tensors[2], act), 1, down.n_rows, F32))
    return g
