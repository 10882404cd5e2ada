"""The cpu backend's norms and routing, and decode rows' dense attention-layer work as two ggml graphs.

`rms_norm_rows(x, eps)` is ggml's RMS norm of each row (no weight) and `rope_neox` ggml's NEOX RoPE:
the cpu backend's, so that the graphs below, which use the same ops, give a row the bits the op-by-op
path gives it.

A decode step of one sequence (one row) spends most of its host time between products: each ggml
call from Python costs some 10-30 µs beside the product itself, and an attention layer made ~10 of
them (norms, q/k/v, q/k norms, output, residual, FFN norm, router). `AttentionGraphs` puts them in
two graphs built once per layer, run with only the row's pointers set:

    before attention:  xn = rms_norm(x)·attn_norm;  q, k, v = Wq·xn, Wk·xn, Wv·xn
                       q = rope(rms_norm(q per head)·q_norm);  k = rope(rms_norm(k per head)·k_norm)
    after attention:   x' = x + Wo·attn;  h = rms_norm(x')·ffn_norm;  routing of Wr·h (routing_nodes)

A batched decode step (one row of each of B sequences) runs the same two graphs built for B rows,
each row at its own position, its products with weights taken row by row (`product`: ggml's products
of several rows may take llamafile's GEMMs, which sum in another order than one row's), and between
them each sequence's attention over its KV cache (fomoepy.runtime.ggml_attention), as on the op-by-op
path; a lone row's layer runs the same nodes as one graph (fomoepy.runtime.ggml_decode). Every op here
is the one that path calls (ggml's products, norm, RoPE and routing; a product with a weight vector and
a residual sum, elementwise float32 either way), so a row gets the same bits through the graphs, op by
op, or batched beside other sequences' rows.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.runtime import dense_rows
from fomoepy.runtime.ggml_matmul import QuantMatrix, rows_go_apart, top_k_nodes
from fomoepy.runtime.pinned import host_address
from fomoepy.timing import MATMUL

F32 = np.float32
_OVERHEAD = ggml.ggml_tensor_overhead()


@dataclass(frozen=True)
class RopeSpec:
    """What RoPE reads of an AttentionSpec."""

    rotary_dim: int
    rope_base: float


class Graph:
    """A graph built once: leaves whose data is numpy memory (weights fixed at build, inputs set per
    call), intermediates in the context's own memory, outputs in fresh arrays per call."""

    def __init__(self, n_tensors: int, scratch_bytes: int, threads: int):
        # a graph of its own size: ggml's default one (2048 nodes) costs a ~0.1 ms clearing per build
        self.graph_size = 2 * n_tensors
        size = n_tensors * (_OVERHEAD + 64) + ggml.ggml_graph_overhead_custom(self.graph_size, False) + scratch_bytes
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise FomoeError(f"ggml could not allocate a {size}-byte context")
        self.threads = threads
        self.keep: list = []  # the weights' memory, alive as long as the graph
        self.inputs: list = []
        self.outputs: list[tuple] = []  # (tensor, shape)
        self._owned: dict[int, np.ndarray] = {}  # address of a tensor's struct -> the numpy memory it computes into

    def leaf(self, qtype: int, *ne: int, data: np.ndarray | None = None, nb: tuple[int, ...] | None = None):
        """A tensor over memory the graph does not own; nb: its strides in bytes (default: contiguous)."""
        ggml.ggml_set_no_alloc(self.ctx, True)
        try:
            t = ggml.ggml_new_tensor(self.ctx, qtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))
        finally:
            ggml.ggml_set_no_alloc(self.ctx, False)
        if nb is not None:
            strides = t.contents.nb
            for i, step in enumerate(nb):
                strides[i] = step
            for i in range(len(nb), 4):  # the dims past the given ones follow on
                strides[i] = strides[i - 1] * t.contents.ne[i - 1]
        if data is not None:
            t.contents.data = data.ctypes.data
            self.keep.append(data)
        return t

    def weight(self, w):
        """A product's weight (a QuantMatrix) or a float32 vector (a norm's weight)."""
        if isinstance(w, QuantMatrix):
            return self.leaf(w.qtype, w.n_cols, w.n_rows, data=w.data)
        v = np.ascontiguousarray(w, dtype=F32).reshape(-1)
        return self.leaf(ggml.GGML_TYPE_F32, v.size, data=v)

    def input(self, *ne: int, qtype: int = ggml.GGML_TYPE_F32, nb: tuple[int, ...] | None = None):
        """An input of the given ggml shape (and strides): never viewed (a view takes its source's data
        pointer when made, and an input's is set only per call)."""
        t = self.leaf(qtype, *ne, nb=nb)
        self.inputs.append(t)
        return t

    def write_into(self, src, *ne: int, nb: tuple[int, ...]):
        """A node that copies src into the caller's memory, strided by nb; the address is an input, set per
        run (the node itself takes it: a copy's node is a view of its destination, made with the data
        pointer its destination had then). Pass the node to finish as an effect."""
        node = ggml.ggml_cpy(self.ctx, src, self.leaf(ggml.GGML_TYPE_F32, *ne, nb=nb))
        self.inputs.append(node)
        return node

    def own(self, t, shape: tuple[int, ...], into: np.ndarray | None = None):
        """t computes into numpy memory of its own from now on (an output that later nodes view: a view
        takes its source's data pointer when it is made, so t's must be set before), or into `into` (a
        contiguous array of t's size and type, kept by the caller); returns t."""
        dtype = np.int32 if t.contents.type == ggml.GGML_TYPE_I32 else F32
        buf = np.empty(shape, dtype) if into is None else into
        if buf.dtype != dtype or buf.size != int(np.prod(shape)) or not buf.flags.c_contiguous:
            raise ValueError(f"expected a contiguous {dtype.__name__} array of shape {shape}, got {buf.dtype} {buf.shape}")
        t.contents.data = buf.ctypes.data
        self._owned[ctypes.addressof(t.contents)] = buf
        return t

    def finish(self, outputs: list[tuple], effects: tuple = ()) -> None:
        """Build the graph and plan it; each output gets memory of its own (float32, or int32 for an int32
        tensor), set once: a run sets only its inputs' pointers and copies the outputs out (a pointer set
        per array, through numpy's ctypes view, cost more than the copy of a decode row's few KB)."""
        self.outputs = outputs
        self._results = []
        for t, shape in outputs:
            buf = self._owned.get(ctypes.addressof(t.contents))
            if buf is None:
                self.own(t, shape)
                buf = self._owned[ctypes.addressof(t.contents)]
            self._results.append(buf)
        self.keep += self._results
        self._handed: list = [None] * len(self._results)  # the copies the last run handed out (_copies)
        self._input_structs = [t.contents for t in self.inputs]  # one struct object each, not one per run
        self.gf = ggml.ggml_new_graph_custom(self.ctx, self.graph_size, False)
        # nodes whose work is a write into the caller's memory (a KV cache row) go first: ggml runs a
        # graph's nodes in the order they were added, each after the last, so reads added later see it
        for t in effects:
            ggml.ggml_build_forward_expand(self.gf, t)
        for t, _ in outputs:
            ggml.ggml_build_forward_expand(self.gf, t)
        self._plans: dict[int, tuple] = {}  # thread count -> (plan, its work memory, a pointer to it)
        self._plan_ref = self._plan(self.threads)

    def _plan(self, threads: int):
        """A pointer to the graph's plan on `threads` threads (made once per count)."""
        kept = self._plans.get(threads)
        if kept is None:
            plan = ggml.ggml_graph_plan(self.gf, threads, None)
            work = np.empty(max(plan.work_size, 1), np.uint8)
            plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            kept = self._plans[threads] = (plan, work, ctypes.pointer(plan))
        return kept[2]

    def run(self, *inputs: np.ndarray | int, last: bool = False, threads: int | None = None) -> list[np.ndarray]:
        """The outputs for these inputs (arrays, or addresses of memory the caller keeps alive), as fresh
        arrays (the graph's own are overwritten by its next run); last: the graph runs no more (a
        prefill's, built for the call): its own arrays, not copies. threads: another count than the
        graph's (every node's output elements are each one thread's: the same bits)."""
        if len(inputs) != len(self._input_structs):
            raise FomoeError(f"expected {len(self._input_structs)} inputs, got {len(inputs)}")
        for t, x in zip(self._input_structs, inputs):
            t.data = x if isinstance(x, int) else host_address(x)  # (the buffer protocol: a fifth of x.ctypes.data's ~1 µs)
        plan = self._plan_ref if threads is None or threads == self.threads else self._plan(threads)  # (compute's, inline: a frame)
        status = MATMUL.call(ggml.ggml_graph_compute, self.gf, plan)
        if status != 0:
            raise FomoeError("ggml graph computation failed")
        return list(self._results) if last else self._copies()  # inputs are the caller's, alive for the whole computation

    def inputs_at(self, positions: list[int]) -> list:
        """The inputs at these positions (run's order), to be set by set_inputs: a caller that keeps most
        inputs from one run to the next sets only the others (each set ~0.5 µs after a graph)."""
        return [self._input_structs[i] for i in positions]

    @staticmethod
    def set_inputs(inputs: list, values) -> None:
        """inputs (inputs_at's) take these arrays or addresses, for the next compute."""
        for t, x in zip(inputs, values):
            t.data = x if isinstance(x, int) else host_address(x)

    def compute(self, threads: int | None = None) -> list[np.ndarray]:
        """run's outputs (fresh arrays) for the inputs set last: every one set, by run or set_inputs, to
        memory still alive."""
        plan = self._plan_ref if threads is None or threads == self.threads else self._plan(threads)
        status = MATMUL.call(ggml.ggml_graph_compute, self.gf, plan)
        if status != 0:
            raise FomoeError("ggml graph computation failed")
        return self._copies()

    def _copies(self) -> list[np.ndarray]:
        """The outputs as arrays of the caller's: each into the one the last run handed out where nothing else
        holds it any more (its memory, warm and mapped, again: a decode batch's fresh 1 MB of logits a step
        cost ~0.6 ms of an 8-row bench-model step in page faults and cold copies, by hand), else a new one."""
        out = []
        for i, r in enumerate(self._results):
            last = self._handed[i]
            if last is not None and sys.getrefcount(last) == 3:  # (this list's reference, `last`, the call's argument)
                np.copyto(last, r)
            else:
                last = self._handed[i] = r.copy()
            out.append(last)
        return out

    def __del__(self) -> None:
        if getattr(self, "ctx", None) and ggml is not None:
            ggml.ggml_free(self.ctx)


def _rotated(g: Graph, x, positions, a):
    """NEOX RoPE of x [hd, heads, T] at `positions` (an int32 input [T]): ggml's, as llama.cpp's (angles
    pos·base^(-2i/rotary_dim) in float32, the dims past rotary_dim unchanged)."""
    return ggml.ggml_rope_ext(g.ctx, x, positions, None, a.rotary_dim, ggml.GGML_ROPE_TYPE_NEOX, 0, float(a.rope_base),
                              1.0, 0.0, 1.0, 0.0, 0.0)  # fmt: skip  (no scaling: freq_scale 1, ext_factor 0, attn_factor 1)


def normed(g: Graph, x, eps: float, w):
    """rms_norm(x) · w, w broadcast over x's rows."""
    return ggml.ggml_mul(g.ctx, ggml.ggml_rms_norm(g.ctx, x, eps), g.weight(w))


def product(g: Graph, w, x, B: int, apart: bool):
    """w · x for x [K, B] → [N, B]. apart: each column a one-row product of its own: ggml takes another
    kernel for a product of several rows than for one (llamafile's GEMMs, from two rows on, may sum in
    another order than its one-row dot products), so the rows of several sequences are multiplied as B
    products of one row each (x as [K, 1, B], w broadcast over the B) to get the bits each gets alone, and
    below APART_BELOW_ROWS rows whatever the type, where they are faster so (rows_go_apart); Q8_0 weights by
    fomoepy's kernel where it agrees with ggml (dense_rows: the same bits, each block read once for the B
    rows). A prefill's rows (one sequence) are not taken apart."""
    if apart and B > 1 and dense_rows.handles(w):  # Q8_0: each block read once for the B rows, each row's bits its lone ones
        return dense_rows.node(g.ctx, g.weight(w), x if ggml.ggml_is_contiguous(x) else ggml.ggml_cont(g.ctx, x), B)
    if not apart or not rows_go_apart(getattr(w, "qtype", ggml.GGML_TYPE_F32), B):
        return ggml.ggml_mul_mat(g.ctx, g.weight(w), x)
    # the copy: a reshape is a view, which takes its source's data address when it is made, and an
    # input's is set only when the graph runs
    rows = ggml.ggml_reshape_3d(g.ctx, ggml.ggml_cont(g.ctx, x), int(x.contents.ne[0]), 1, B)
    y = ggml.ggml_mul_mat(g.ctx, g.weight(w), rows)  # [N, 1, B]
    # a node of its own, not a view of y: a graph's output gets memory of its own (Graph.own), which a
    # view would not compute into
    return ggml.ggml_cont(g.ctx, ggml.ggml_reshape_2d(g.ctx, y, int(y.contents.ne[0]), B))


def apart_bytes(w, B: int) -> int:
    """Room for product(w, ..., apart=True)'s intermediates: the copy of x, the product and its copy; for
    Q8_0 weights (dense_rows' node) also x quantized to Q8_0, beside a copy of x where x is not contiguous."""
    if B <= 1:
        return 0
    quantized = B * ggml.ggml_row_size(dense_rows.Q8_0, w.n_cols) if getattr(w, "qtype", None) == dense_rows.Q8_0 else 0
    return 4 * B * (w.n_cols + 2 * w.n_rows) + quantized


APART_TENSORS = 5  # the tensors product(..., apart=True) adds: two copies, two reshapes, the product


def pre_attention_nodes(g: Graph, w, a, eps: float, x, pos, B: int, apart: bool = False):
    """x [D, B] at positions pos [B] → q [hd, H, B], k [hd, Hkv, B] (normed and rotated), v [Hkv·hd, B];
    apart: the rows belong to several sequences (`product`)."""
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    xn = normed(g, x, eps, w.attn_norm)
    q = product(g, w.attn_q, xn, B, apart)
    k = product(g, w.attn_k, xn, B, apart)
    v = product(g, w.attn_v, xn, B, apart)
    qn = normed(g, ggml.ggml_reshape_3d(g.ctx, q, hd, H, B), eps, w.attn_q_norm)  # each head's row normed
    kn = normed(g, ggml.ggml_reshape_3d(g.ctx, k, hd, Hkv, B), eps, w.attn_k_norm)
    return _rotated(g, qn, pos, a), _rotated(g, kn, pos, a), v


def pre_attention_bytes(w, a, B: int, apart: bool = False) -> int:
    """Room for pre_attention_nodes' float32 intermediates, each one's norm with it."""
    extra = sum(apart_bytes(m, B) for m in (w.attn_q, w.attn_k, w.attn_v)) if apart else 0
    return 4 * 4 * B * (w.attn_q.n_cols + 2 * (a.n_head + 2 * a.n_head_kv) * a.head_dim) + extra


def post_attention_nodes(g: Graph, w, eps: float, x, attn, B: int = 1, apart: bool = False):
    """x [D, B], attention's output attn [H·hd, B] → x' = x + Wo·attn, h = its FFN norm, the router's
    logits; apart: the rows belong to several sequences (`product`)."""
    x2 = ggml.ggml_add(g.ctx, x, product(g, w.attn_output, attn, B, apart))
    h = normed(g, x2, eps, w.ffn_norm)
    return x2, h, product(g, w.ffn_gate_inp, h, B, apart)


def post_attention_bytes(w, B: int, apart: bool = False) -> int:
    extra = sum(apart_bytes(m, B) for m in (w.attn_output, w.ffn_gate_inp)) if apart else 0
    return 4 * 4 * B * (3 * w.attn_q.n_cols + 3 * w.ffn_gate_inp.n_rows) + extra


def routing_nodes(g: Graph, logits, k: int, B: int, into: tuple | None = None):
    """Router logits [E, B] → each row's k experts by descending probability (ids [k, B] int32), their
    probabilities renormalised to sum 1 (weights [k, B]), and the softmax over all experts (probs [E, B]),
    which g computes into its own memory (`own`): Qwen3's softmax routing, as llama.cpp builds it (a
    softmax, a descending argsort's first k, their rows of the probabilities over their sum). Each op is
    row by row: a row gets its bits whatever rows are beside it. All three compute into g's own memory
    (outputs later nodes may view), or into the arrays `into` = (ids, weights, probs) (Graph.own)."""
    E = int(logits.contents.ne[0])
    ids_into, weights_into, probs_into = into if into is not None else (None, None, None)
    probs = g.own(ggml.ggml_soft_max(g.ctx, logits), (B, E), probs_into)
    ids = g.own(top_k_nodes(g.ctx, probs, k, B), (B, k), ids_into)
    top = ggml.ggml_reshape_2d(g.ctx, ggml.ggml_get_rows(g.ctx, ggml.ggml_reshape_3d(g.ctx, probs, 1, E, B), ids), k, B)
    weights = g.own(ggml.ggml_div(g.ctx, top, ggml.ggml_sum_rows(g.ctx, top)), (B, k), weights_into)
    return ids, weights, probs


class AttentionGraphs:
    """One layer's two decode graphs (see the module's docstring) for `rows` decode rows, one of each
    sequence of a batched step: w the layer's weights (attn_norm, attn_q/k/v/output, attn_q_norm/k_norm,
    ffn_norm, ffn_gate_inp), a its AttentionSpec (not gated). Every op is row by row (each product's
    output element one dot product of its row, norms over a row or a head of it, RoPE at the row's own
    position), so a row gets the bits it gets in a graph of one row."""

    def __init__(self, w, a, eps: float, threads: int, rows: int, k: int):
        H, Hkv, hd, B = a.n_head, a.n_head_kv, a.head_dim, rows
        D = w.attn_q.n_cols
        # the rows are one of each of B sequences: their products with weights are taken apart (`product`)
        pre = self.pre = Graph(28 + 3 * APART_TENSORS, pre_attention_bytes(w, a, B, apart=True), threads)
        x, pos = pre.input(D, B), pre.input(B, qtype=ggml.GGML_TYPE_I32)
        q, k_rot, v = pre_attention_nodes(pre, w, a, eps, x, pos, B, apart=True)
        pre.finish([(q, (B, H, hd)), (k_rot, (B, Hkv, hd)), (v, (B, Hkv * hd))])
        post = self.post = Graph(40 + 2 * APART_TENSORS, post_attention_bytes(w, B, apart=True), threads)
        x, attn = post.input(D, B), post.input(H * hd, B)
        x2, h, logits = post_attention_nodes(post, w, eps, x, attn, B, apart=True)
        post.finish([(x2, (B, D)), (h, (B, D))] + routed_outputs(post, logits, k, B))

    def inputs(self, x: np.ndarray, positions) -> list[np.ndarray]:
        """x [B, D], row i at positions[i] → q [B, H, hd], k [B, Hkv, hd] (normed and rotated), v [B, Hkv·hd]."""
        return self.pre.run(np.ascontiguousarray(x, dtype=F32), np.array(positions, np.int32).reshape(-1))

    def output(self, x: np.ndarray, attn: np.ndarray) -> list[np.ndarray]:
        """x [B, D], attn [B, H·hd] → x + Wo·attn, its FFN norm [B, D], and its routing (routed_outputs)."""
        return self.post.run(np.ascontiguousarray(x, dtype=F32), np.ascontiguousarray(attn, dtype=F32))


def routed_outputs(g: Graph, logits, k: int, B: int) -> list[tuple]:
    """A graph's outputs for router logits [E, B]: each row's routing (routing_nodes), ids [B, k] int32,
    weights [B, k], probs [B, E]."""
    E = int(logits.contents.ne[0])
    ids, weights, probs = routing_nodes(g, logits, k, B)
    return [(ids, (B, k)), (weights, (B, k)), (probs, (B, E))]


def route_softmax(logits: np.ndarray, k: int, threads: int) -> list[np.ndarray]:
    """routing_nodes of logits [T, E] → ids [T, k] int32, weights [T, k], probs [T, E]."""
    logits = np.ascontiguousarray(logits, dtype=F32)
    T, E = logits.shape
    def build() -> Graph:
        g = Graph(12, 4 * 4 * T * (2 * E + 2 * k) + 1024, threads)
        g.finish(routed_outputs(g, g.input(E, T), k, T))
        return g

    g, last = _graph_for(("route", T, E, k, threads), T, build)
    return g.run(logits, last=last)


def rms_norm_rows(x: np.ndarray, eps: float, threads: int) -> np.ndarray:
    """x / rms(x) over the last axis, by ggml's RMS norm (its row sums in double, as llama.cpp's)."""
    x = np.ascontiguousarray(x, dtype=F32)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    def build() -> Graph:
        g = Graph(4, 4 * rows * n + 64, threads)
        g.finish([(ggml.ggml_rms_norm(g.ctx, g.input(n, rows), eps), x.shape)])
        return g

    g, last = _graph_for(("norm", rows, n, float(eps), threads), rows, build)
    out = g.run(x, last=last)[0]
    return out.reshape(x.shape)


_graphs = threading.local()  # per thread: a graph's pointers are set and run without a lock
_MAX_CACHED_ROWS = 64
_MAX_GRAPHS = 64


def rope_neox(x: np.ndarray, positions: np.ndarray, a, threads: int) -> np.ndarray:
    """x [T, heads, hd] rotated at positions [T] by ggml's NEOX RoPE (`_rotated`); each row at its own
    position, whatever the rows beside it."""
    x = np.ascontiguousarray(x, dtype=F32)
    T, heads, hd = x.shape
    def build() -> Graph:
        g = Graph(4, 4 * x.size + 64, threads)
        g.finish([(_rotated(g, g.input(hd, heads, T), g.input(T, qtype=ggml.GGML_TYPE_I32), a), x.shape)])
        return g

    g, last = _graph_for(("rope", T, heads, hd, a.rotary_dim, float(a.rope_base), threads), T, build)
    return g.run(x, np.ascontiguousarray(positions, dtype=np.int32), last=last)[0]


def _graph_for(key: tuple, rows: int, build) -> tuple[Graph, bool]:
    """This thread's graph for `key`, built by build() the first time; kept for later calls where its
    shape comes back often (decode shapes every step, a prefill's rarely). → (graph, last: it was not
    kept, so its run may hand out its own arrays)."""
    cache = getattr(_graphs, "cache", None)
    if cache is None:
        cache = _graphs.cache = {}
    g = cache.get(key)
    if g is not None:
        return g, False
    g = build()
    if rows > _MAX_CACHED_ROWS:
        return g, True
    if len(cache) >= _MAX_GRAPHS:
        cache.pop(next(iter(cache)))
    cache[key] = g
    return g, False

