"""One layer's routed experts as one ggml product over the host tier's slots.

The layer's slots are three ggml tensors, one per expert matrix, each holding every slot:

    gate, up  [K = n_embd, F = expert_ff, n_slots]   (ggml order: ne0 = a row's columns)
    down      [F, K, n_slots]

in one CPU buffer per tensor: the CPU device's repacking buffer where ggml has repacked kernels for the
matrix's type and shape (fomoepy.runtime.ggml_buffers.repacks), else a plain one. Setting a slot
copies an expert's store-form bytes in (and repacks them there). `SlotLayer.ffn` computes, for T
tokens that each picked k slots, in one graph:

    a, b = mul_mat_id(gate, h, slots), mul_mat_id(up, h, slots)   # [F, k, T]
    y    = mul_mat_id(down, silu(a) ⊙ b, slots)                   # [K, k, T]
    out  = Σ_j y[:, j, :] · weights[:, j]                          # [K, T], j = 0, 1, …, k-1 in turn

The sum adds the k experts in the order given, and the result is, with plain buffers, bit for bit the
per-expert path's (GgmlExperts.per_expert_ffn, which adds them in the same order): the same
quantization of h, the same dot products, the same silu, products and additions. Repacked weights
run other kernels (the same integer block dot products, their float partial sums in another order).

A graph for a few tokens (decode) is built once per token count and reused: only its inputs' and
output's data pointers change between calls.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from collections.abc import Sequence

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.runtime import ggml_buffers
from fomoepy.runtime.ggml_matmul import first_rows_apart, probe_inputs
from fomoepy.runtime.pinned import contiguous_address
from fomoepy.timing import MATMUL

try:  # optional (setup.py): a decode round's copies, ids and computation in one call; the weighted sum's ops
    from fomoepy.runtime import _ggml_rounds as _rounds
    from fomoepy.runtime._ggml_rounds import RoundCall
except ImportError:
    _rounds = RoundCall = None

F32 = np.float32
_OVERHEAD = ggml.ggml_tensor_overhead()
_MAX_GRAPHS = 8  # token counts kept per layer: decode (1) and a few small batches
# Graphs of more tokens are built for their call and freed after it: their intermediates take
# ~165 KB a token (bench model: 21 MB at 128 tokens, per layer), and building one costs ~0.1 ms
# against the ~50 ms their products take.
_MAX_CACHED_TOKENS = 16
MAX_CACHED_PICKS = 128  # pick_outputs' rows (a round of a decode step of up to 16 sequences of top-8)
# a prefill's grouped products keep their rows, intermediates and outputs in arrays reused from call to
# call (one per thread): fresh ones of a 128-token chunk (~16 MB a layer) cost ~3 ms of page faults a
# layer, more than building the graph. Larger requests (long chunks of big models) get fresh arrays.
_SCRATCH_BYTES = 64 << 20
_scratch = threading.local()


class SlotMatrix:
    """One expert matrix [n_rows, n_cols] of `n_slots` slots: a ggml tensor [n_cols, n_rows, n_slots] in a
    buffer of its own, repacked where the CPU has repacked kernels for it (and `repack`)."""

    def __init__(self, qtype: int, n_rows: int, n_cols: int, n_slots: int, repack: bool = True):
        if n_slots < 1:
            raise FomoeError(f"expected at least one slot, got {n_slots}")
        self.qtype, self.n_rows, self.n_cols, self.n_slots = int(qtype), n_rows, n_cols, n_slots
        self._ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=(1 + n_slots) * _OVERHEAD + 1024, mem_buffer=None, no_alloc=True))
        self.tensor = ggml.ggml_new_tensor_3d(self._ctx, self.qtype, n_cols, n_rows, n_slots)
        nb = self.tensor.contents.nb
        # a 2-D view per slot: the repacking buffer sets (repacks) a whole tensor at a time
        self._views = [ggml.ggml_view_2d(self._ctx, self.tensor, n_cols, n_rows, nb[1], s * nb[2]) for s in range(n_slots)]
        self.repacked = bool(repack and ggml_buffers.repacks(self.qtype, n_cols, n_rows))
        buft = ggml_buffers.repacking_buffer_type() if self.repacked else ggml_buffers.plain_buffer_type()
        try:
            self._buffer = ggml_buffers.alloc_tensors(self._ctx, buft)
        except FomoeError:
            ggml.ggml_free(self._ctx)
            raise
        self.slot_nbytes = ggml.ggml_nbytes(self._views[0])
        self._base, self._stride = int(self.tensor.contents.data or 0), int(nb[2])

    def set_slot(self, slot: int, data: np.ndarray) -> None:
        """Copy one matrix's store-form bytes into `slot` (repacked there where so held)."""
        if not 0 <= slot < self.n_slots:
            raise FomoeError(f"slot {slot} outside [0, {self.n_slots})")
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        if data.nbytes != self.slot_nbytes:
            raise FomoeError(f"expected {self.slot_nbytes} bytes for a slot's matrix, got {data.nbytes}")
        # (`.ctypes.data` builds a ctypes object, a microsecond a matrix, three a miss)
        ggml_buffers.set_tensor(self._views[slot], contiguous_address(data), data.nbytes)

    def slot_address(self, slot: int) -> int:
        """Where slot `slot`'s bytes lie (a plain buffer's: the store form, as fomoepy.runtime.batched_experts reads)."""
        return self._base + slot * self._stride

    def slot_tensor(self, slot: int):
        """Slot `slot`'s matrix as a 2-D ggml tensor (a view, repacked with the rest where so held)."""
        return self._views[slot]

    def product(self, x: np.ndarray, slots: np.ndarray, threads: int) -> np.ndarray:
        """x [T, n_cols], slots [T, k] → [T, k, n_rows]: row t·matrix_{slots[t, j]}ᵀ, one mul_mat_id in a
        graph built for the call (a staging tensor's product, and the measure of a slot tensor alone)."""
        x = np.ascontiguousarray(x, dtype=F32)
        ids = _checked_slots(slots, self.n_slots)
        T, k = ids.shape
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=8 * _OVERHEAD + ggml.ggml_graph_overhead(), mem_buffer=None, no_alloc=True))
        try:
            xt = _wrap(ctx, ggml.GGML_TYPE_F32, (self.n_cols, 1, T), x)
            it = _wrap(ctx, ggml.GGML_TYPE_I32, (k, T), ids)
            y = ggml.ggml_mul_mat_id(ctx, self.tensor, xt, it)
            out = np.empty((T, k, self.n_rows), F32)
            y.contents.data = out.ctypes.data
            gf = ggml.ggml_new_graph(ctx)
            ggml.ggml_build_forward_expand(gf, y)
            _compute(gf, threads)
        finally:
            ggml.ggml_free(ctx)
        return out

    def close(self) -> None:
        if self._ctx:
            ggml_buffers.free_buffer(self._buffer)
            ggml.ggml_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        if ggml is not None and getattr(self, "_ctx", None):
            self.close()


class SlotLayer:
    """A layer's `n_slots` expert slots (gate, up, down of each) and one-graph FFNs over them.

    parts: the three matrices' (GGUF type, (n_rows, n_cols)): gate and up [F, K], down [K, F] (as
    `LayerExperts.parts`). repack=False keeps every matrix in a plain buffer."""

    def __init__(self, parts: Sequence[tuple[int, tuple[int, int]]], n_slots: int, repack: bool = True):
        if len(parts) != 3:
            raise FomoeError(f"expected gate, up and down, got {len(parts)} expert matrices")
        (_, (F, K)), (_, ushape), (_, dshape) = parts
        if tuple(ushape) != (F, K) or tuple(dshape) != (K, F):
            raise FomoeError(f"expected gate/up [{F}, {K}] and down [{K}, {F}], got {ushape} and {dshape}")
        self.n_embd, self.n_ff, self.n_slots = K, F, n_slots
        self.mats = [SlotMatrix(q, rows, cols, n_slots, repack) for q, (rows, cols) in parts]
        self.qtypes = tuple(m.qtype for m in self.mats)
        self.repacked = tuple(m.repacked for m in self.mats)
        self._graphs: dict[tuple[int, int, int], _SlotGraph] = {}
        self._pick_graphs: dict[tuple[int, int], _SlotGraph] = {}  # pick_outputs' graphs by (picks, threads)

    @functools.cached_property
    def rows_kept_together(self) -> int | None:
        """rows_kept_together of this layer's matrices (asked of ggml once)."""
        return rows_kept_together([m.tensor for m in self.mats])

    @functools.cached_property
    def address_table(self) -> np.ndarray:
        """[n_slots, 3] uint64: where each slot's gate, up and down bytes lie (fomoepy.runtime.batched_experts)."""
        table = np.array([[m.slot_address(slot) for m in self.mats] for slot in range(self.n_slots)], np.uint64).reshape(-1, 3)
        table.flags.writeable = False
        return table

    def set_slot(self, slot: int, raw: Sequence[np.ndarray]) -> None:
        """Copy an expert's gate, up and down store-form bytes into `slot` (repacked where so held)."""
        for m, data in zip(self.mats, raw, strict=True):
            m.set_slot(slot, data)

    def ffn(self, h: np.ndarray, slots: np.ndarray, weights: np.ndarray, threads: int) -> np.ndarray:
        """h [T, K], slots and weights [T, k] → Σ_j weights[t, j] · expert_{slots[t, j]}(h[t]), [T, K]."""
        h = np.ascontiguousarray(h, dtype=F32)
        T, k = slots.shape
        if h.shape != (T, self.n_embd) or weights.shape != (T, k):
            raise FomoeError(f"expected h [{T}, {self.n_embd}] and weights [{T}, {k}], got {h.shape} and {weights.shape}")
        return self.ffn_unchecked(h, _checked_slots(slots, self.n_slots), np.ascontiguousarray(weights, dtype=F32), threads)

    def ffn_unchecked(self, h: np.ndarray, ids: np.ndarray, weights: np.ndarray, threads: int) -> np.ndarray:
        """`ffn` for a caller whose arrays are already right: h [T, K] and weights [T, k] float32 and
        C-contiguous, ids [T, k] int32 slots in range (the MoE step's, from its slot lookup)."""
        T, k = ids.shape
        if T > _MAX_CACHED_TOKENS:
            g = _SlotGraph(self, T, k, threads)
            try:
                return g.run(h, ids, weights)
            finally:
                g.free()
        key = (T, k, threads)
        g = self._graphs.get(key)
        if g is None:
            if len(self._graphs) >= _MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs))).free()
            g = self._graphs[key] = _SlotGraph(self, T, k, threads)
        return g.run(h, ids, weights)

    def pick_outputs(self, rows: np.ndarray, slots: np.ndarray, threads: int) -> np.ndarray:
        """rows [P, K], slots [P] → [P, K]: expert_{slots[p]}(rows[p]) for each pick p, unweighted: `ffn`'s y
        with each (token, pick) a row of its own. mul_mat_id computes
        each slot's rows in the order they come, with the kernels it picks for their count, whatever the
        other slots do: so a pick's result here is its result inside `ffn` when the picks of each slot
        listed here are those `ffn` gives it, token-major. A step whose experts are not all in slots at
        once (some still being read, or more misses than staging slots) is computed in such rounds, so the
        graph for a few picks is kept and reused, as `ffn`'s (building one was ~50-130 µs of a streamed
        decode step's host time, against ~15 µs to run a kept one)."""
        rows = np.ascontiguousarray(rows, dtype=F32)
        ids = _checked_slots(np.asarray(slots).reshape(1, -1), self.n_slots)
        P, K = ids.shape[1], self.n_embd
        if rows.shape != (P, K):
            raise FomoeError(f"expected rows [{P}, {K}], got {rows.shape}")
        if P > MAX_CACHED_PICKS:
            g = _SlotGraph(self, P, 1, threads, weighted=False)
            try:
                return g.run(rows, ids.reshape(P, 1), None).reshape(P, K)
            finally:
                g.free()
        return self._pick_graph(P, threads).run(rows, ids.reshape(P, 1), None).reshape(P, K)

    def pick_outputs_of_row(self, row: np.ndarray, slots: list[int], threads: int) -> np.ndarray:
        """pick_outputs of one token's row [1, K] for each of its picks' slots [P] (a decode step's round):
        the same graph on the same rows, its input set from the row and the slots' list as they are."""
        out = np.empty((len(slots), self.n_embd), F32)
        self.pick_outputs_of_row_into(row, slots, threads, out, slice(None))
        return out

    def pick_outputs_of_row_into(self, row: np.ndarray, slots: list[int], threads: int, into: np.ndarray, at) -> None:
        """pick_outputs_of_row, set into into[at] (a step's rows of its picks' outputs). The general path's
        dozen numpy calls on arrays of a few ints each cost a decode step ~10 µs apiece here, run on the
        caches the layer's products have just emptied."""
        P = len(slots)
        if not P or min(slots) < 0 or max(slots) >= self.n_slots or P > MAX_CACHED_PICKS:
            into[at] = self.pick_outputs(np.repeat(row, P, axis=0), np.asarray(slots, np.int32), threads)
            return
        g = self._pick_graphs.get((P, threads, True))  # (_pick_graph's kept one, without its frame)
        (g or self._pick_graph(P, threads, one_row=True)).run_row_into(row, slots, into, at)

    def _pick_graph(self, P: int, threads: int, one_row: bool = False) -> _SlotGraph:
        """The kept graph for P picks (a few token counts kept, as `ffn`'s): of P rows, or of one row
        (`one_row`: one token's P picks, its row set once, 8 KB on the bench model, where the P-row graph
        took P copies of it; the same one-row products as P rows of one pick each, so the same bits:
        mul_mat_id takes each expert's rows apart)."""
        key = (P, threads, one_row)
        g = self._pick_graphs.get(key)
        if g is None:
            if len(self._pick_graphs) >= _MAX_GRAPHS:
                self._pick_graphs.pop(next(iter(self._pick_graphs))).free()
            g = self._pick_graphs[key] = _SlotGraph(self, 1, P, threads, False) if one_row else _SlotGraph(self, P, 1, threads, False)
        return g

    def ffn_grouped(self, h: np.ndarray, slots: np.ndarray, weights: np.ndarray, threads: int) -> np.ndarray:
        """`ffn` for many tokens, each slot's tokens as the rows of one product per matrix (a graph built
        for the call): a repacked matrix then runs its GEMM kernels on 4 rows at a time, where
        mul_mat_id runs their one-row kernels token by token. The same sums in the same order as `ffn`."""
        h = np.ascontiguousarray(h, dtype=F32)
        T, k = slots.shape
        if h.shape != (T, self.n_embd) or weights.shape != (T, k):
            raise FomoeError(f"expected h [{T}, {self.n_embd}] and weights [{T}, {k}], got {h.shape} and {weights.shape}")
        return self._grouped(h, np.arange(T * k) // k, slots.reshape(-1), threads, np.ascontiguousarray(weights, dtype=F32))

    def grouped_outputs(self, h: np.ndarray, tokens: np.ndarray, slots: np.ndarray, threads: int) -> np.ndarray:
        """h [T, K]; for each pick p, its token tokens[p] and slot slots[p] → [P, K]: expert_{slots[p]}(h[tokens[p]]),
        unweighted: each slot's picks, in the order given, the rows of one product per matrix (GEMM
        kernels where repacked). A pick's result depends on the rows its slot gets, so a step computed
        in rounds (fomoepy.runtime.ggml_experts) gives each slot all its picks in one round."""
        return self._grouped(h, tokens, slots, threads, None)

    def _grouped(self, h: np.ndarray, tokens: np.ndarray, slots: np.ndarray, threads: int, weights: np.ndarray | None) -> np.ndarray:
        """grouped_outputs (weights None), or with weights [T, k] (picks token-major) their weighted sum
        per token [T, K] (ffn_grouped). One graph: the picks' rows gathered in slot order (get_rows),
        each slot's products, the outputs put back in pick order (get_rows again) and, weighted, the
        sum: pick j added after picks 0..j-1, weighted_sum's ops. Gathers, products and sums all on
        ggml's threads: in numpy they were a tenth of a 128-token prefill's time at 2 threads."""
        h = np.ascontiguousarray(h, dtype=F32)
        flat = _checked_slots(np.asarray(slots).reshape(1, -1), self.n_slots).reshape(-1)
        K, F, P = self.n_embd, self.n_ff, len(flat)
        if P == 0:
            return np.empty((0, K), F32)
        order = np.argsort(flat, kind="stable")  # picks grouped by slot, each slot's in the order given
        bounds = [0, *(np.flatnonzero(np.diff(flat[order])) + 1).tolist(), P]
        gather = np.ascontiguousarray(np.asarray(tokens)[order], dtype=np.int32)  # sorted pick -> its token's row
        back = np.empty(P, np.int32)
        back[order] = np.arange(P, dtype=np.int32)  # pick -> its place in slot order
        T = h.shape[0]
        k = P // T if weights is not None else 0
        # one array each for every group's rows, intermediates and outputs, in slot order: a group's
        # tensors point at its slice, so building the graph sets pointers but allocates nothing
        rows, inter, ys_sorted, ys, summed = _scratch_arrays((P, K), (4, P, F), (P, K), (P, K), (max(k - 1, 1), T, K) if k else None)
        out = np.empty((T, K), F32) if k else np.empty((P, K), F32)
        n_groups = len(bounds) - 1
        graph_size = 16 * n_groups + 4 * k + 16
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=(10 * n_groups + 3 * k + 16) * _OVERHEAD + ggml.ggml_graph_overhead_custom(graph_size, False),
                                                   mem_buffer=None, no_alloc=True))  # fmt: skip
        try:
            gf = ggml.ggml_new_graph_custom(ctx, graph_size, False)
            rows_t = ggml.ggml_get_rows(ctx, _wrap(ctx, ggml.GGML_TYPE_F32, (K, T), h), _wrap(ctx, ggml.GGML_TYPE_I32, (P,), gather))
            rows_t.contents.data = rows.ctypes.data  # before its views are made: a view takes the pointer then
            ggml.ggml_build_forward_expand(gf, rows_t)
            nb1 = rows_t.contents.nb[1]
            for a, b in itertools.pairwise(bounds):
                gate, up, down = (m.slot_tensor(int(flat[order[a]])) for m in self.mats)
                x = ggml.ggml_view_2d(ctx, rows_t, K, b - a, nb1, a * nb1)
                act = ggml.ggml_mul(ctx, ggml.ggml_silu(ctx, ggml.ggml_mul_mat(ctx, gate, x)), ggml.ggml_mul_mat(ctx, up, x))
                y = ggml.ggml_mul_mat(ctx, down, act)
                for t, buf in zip(_intermediates(y), (*inter, ys_sorted)):  # numpy memory: the context holds headers only
                    t.contents.data = buf[a:b].ctypes.data
                ggml.ggml_build_forward_expand(gf, y)
            # every group's output is in ys_sorted once the nodes above have run (a graph runs its nodes
            # in the order they were added); back in pick order from there
            picks = ggml.ggml_get_rows(ctx, _wrap(ctx, ggml.GGML_TYPE_F32, (K, P), ys_sorted), _wrap(ctx, ggml.GGML_TYPE_I32, (P,), back))
            if not k:
                picks.contents.data = out.ctypes.data
                ggml.ggml_build_forward_expand(gf, picks)
            else:
                picks.contents.data = ys.ctypes.data
                # the products in place of the picks, as weighted_sum's
                total = weighted_sum_nodes(ctx, ggml.ggml_reshape_3d(ctx, picks, K, k, T), _wrap(ctx, ggml.GGML_TYPE_F32, (1, k, T), weights),
                                           into=(ys, summed, out))  # fmt: skip
                ggml.ggml_build_forward_expand(gf, total)
            _compute(gf, threads)
        finally:
            ggml.ggml_free(ctx)
        return out

    def close(self) -> None:
        for graphs in (self._graphs, self._pick_graphs):
            for g in graphs.values():
                g.free()
            graphs.clear()
        for m in self.mats:
            m.close()

    def __del__(self) -> None:
        if ggml is not None and getattr(self, "_graphs", None):
            self.close()


class _SlotGraph:
    """The graph of SlotLayer.ffn for T tokens of k picks; intermediates in its own context memory.
    weighted=False: pick_outputs' graph, each pick's output y [T, k, K] unweighted."""

    def __init__(self, layer: SlotLayer, T: int, k: int, threads: int, weighted: bool = True):
        K, F = layer.n_embd, layer.n_ff
        # a, b, silu(a), its product with b [F, k, T]; y, y·w [K, k, T]; k-1 partial sums [K, T]; float32
        scratch = 4 * (4 * F * k * T + 2 * K * k * T + k * K * T) + 64 * (16 + 2 * k)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=(16 + 2 * k) * (_OVERHEAD + 64) + 2 * ggml.ggml_graph_overhead() + scratch,
                                                        mem_buffer=None, no_alloc=False))  # fmt: skip
        if not self.ctx:
            raise FomoeError("ggml could not allocate a graph context")
        ctx = self.ctx
        # inputs and output in numpy arrays of the graph's own, their pointers set once: a run copies a
        # decode row's few KB in and out, cheaper than setting four pointers through numpy's ctypes views
        self._h, self._ids, self._w = np.empty((T, K), F32), np.empty((T, k), np.int32), np.empty((T, k), F32)
        ggml.ggml_set_no_alloc(ctx, True)
        self.h = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, K, 1, T)  # each token one row, read by its k experts
        self.ids = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, k, T)
        self.w = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, 1, k, T)
        for t, buf in ((self.h, self._h), (self.ids, self._ids), (self.w, self._w)):
            t.contents.data = buf.ctypes.data
        ggml.ggml_set_no_alloc(ctx, False)
        y = expert_outputs(ctx, [m.tensor for m in layer.mats], self.h, self.ids, numpy_output=not weighted)
        # On several threads every node ends at a barrier, where a waiting thread sleeps and is woken
        # (fomoepy.runtime.ggml_threads): the weighted sum's k nodes are then numpy's, the same float32
        # products and additions in the same order. On one thread they cost nothing in the graph.
        self.weighted = weighted
        self.sum_outside = weighted and threads > 1
        if not weighted or self.sum_outside:
            self.out, self.shape = y, (T, k, K)
        else:
            self.out, self.shape = weighted_sum_nodes(ctx, y, self.w), (T, K)
        self._out = np.empty(self.shape, F32)
        self.out.contents.data = self._out.ctypes.data
        self._rows = self._out.reshape(T * k, K) if not weighted else None  # each pick's output, a row (run_row_into)
        self.gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(self.gf, self.out)
        self.plan, self.work = graph_plan(self.gf, threads)
        # a one-row round (pick_outputs_of_row_into) in one C call where it is built
        self._round = round_call(self.gf, self.plan, self._h, ((self._ids, self._rows),)) if not weighted and T == 1 else None

    def run(self, h: np.ndarray, ids: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        """h [T, K], ids [T, k] slots, w [T, k] (None unweighted) → a fresh [T, K] (unweighted [T, k, K])."""
        np.copyto(self._h, h)
        np.copyto(self._ids, ids)
        if self.weighted:
            np.copyto(self._w, w)
        run_graph(self.gf, self.plan)
        if self.sum_outside:
            return weighted_sum(self._out, self._w)
        return self._out.copy()  # the graph's own array is its next run's

    def run_row_into(self, row: np.ndarray, slots: list[int], into: np.ndarray, at) -> None:
        """run of an unweighted graph of one token's picks on `row` [1, K], `slots` [k] their slots, the picks'
        outputs set into into[at] ([k, K] of it) straight from the graph's own array (a decode
        round: one numpy call where a copy handed back and its reshape were two more). The row's copy in
        is the round's first touch of memory after the step's waits and slot fills: it takes ~33 µs there
        (line_profiler, bench model at a 25 % tier), whatever its size; a size of 8 KB or 64 KB made no
        difference measured."""
        if self._round is not None and type(at) is list:
            seconds = self._round(row, (slots,), into, (at,))
            if seconds is not None:  # (None: a row or `into` not float32 and contiguous)
                MATMUL.seconds += seconds
                return
        self._h[:] = row
        self._ids[0] = slots
        run_graph(self.gf, self.plan)
        into[at] = self._rows

    def free(self) -> None:
        self._round = None  # (it computes this context's graph)
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


@functools.cache
def picks_apart_from(qtype: int, repacked: bool) -> int | None:
    """The fewest rows picking one expert of `qtype` (held repacked or not) for which ggml's mul_mat_id gives
    a row other bits than it gets alone, or None (ggml_matmul.first_rows_apart, on one [64, 256] expert).
    ggml 0.25 takes an expert's K-quant rows, eight or more, to its tiled GEMM, which sums otherwise; its
    repacked kernels take them a row at a time. A batch of sequences keeps fewer rows than that together."""
    raw, x = probe_inputs(qtype)
    m = SlotMatrix(qtype, 64, 256, 1, repack=repacked)
    try:
        m.set_slot(0, raw)
        return first_rows_apart(lambda rows: m.product(rows, np.zeros((len(rows), 1), np.int32), 1), x)
    finally:
        m.close()


def rows_kept_together(mats: list) -> int | None:
    """The most rows of several sequences one mul_mat_id of these expert tensors (gate, up, down) may take
    and give each row its own bits: below every matrix's picks_apart_from (an expert may be picked by every
    row); None: any number."""
    firsts = [picks_apart_from(int(t.contents.type), ggml_buffers.is_repacked(t)) for t in mats]
    firsts = [n for n in firsts if n is not None]
    return min(firsts) - 1 if firsts else None


def expert_outputs(ctx, mats: list, h, slots, numpy_output: bool = False):
    """Each pick's expert output y [K, k, T] = down · (silu(gate · h) ⊙ (up · h)) of the slot tensors
    `mats` (gate, up, down), h [K, 1, T], slots [k, T] int32. numpy_output: y's memory is set later."""
    gate, up, down = mats
    a = ggml.ggml_mul_mat_id(ctx, gate, h, slots)  # [F, k, T]
    b = ggml.ggml_mul_mat_id(ctx, up, h, slots)
    act = ggml.ggml_mul(ctx, ggml.ggml_silu(ctx, a), b)
    if not numpy_output:
        return ggml.ggml_mul_mat_id(ctx, down, act, slots)
    ggml.ggml_set_no_alloc(ctx, True)
    try:
        return ggml.ggml_mul_mat_id(ctx, down, act, slots)
    finally:
        ggml.ggml_set_no_alloc(ctx, False)


def weighted_sum_nodes(ctx, y, w, into: tuple | None = None):
    """Σ_j y[:, j, :] · w[j, :] of y [K, k, T], w [1, k, T] → [K, T]: the products, then expert j added
    after experts 0..j-1 (weighted_sum's ops). into: for a context that allocates nothing, the numpy
    memory its nodes compute into: (the products, as many floats as y; k-1 partial sums [k-1, T, K], the
    last of them unused; the result [T, K])."""
    K, k, T = (int(n) for n in list(y.contents.ne)[:3])
    products, partial, result = into if into is not None else (None, None, None)

    def placed(t, memory):
        if memory is not None:
            t.contents.data = memory.ctypes.data
        return t

    yw = placed(ggml.ggml_mul(ctx, y, w), products)
    nb1, nb2 = yw.contents.nb[1], yw.contents.nb[2]
    out = ggml.ggml_view_2d(ctx, yw, K, T, nb2, 0)
    for j in range(1, k):
        out = placed(ggml.ggml_add(ctx, out, ggml.ggml_view_2d(ctx, yw, K, T, nb2, j * nb1)),
                     result if j == k - 1 else None if partial is None else partial[j - 1])  # fmt: skip
    return out if k > 1 else placed(ggml.ggml_cont(ctx, out), result)


class _SumInfo(ctypes.Structure):
    """The fused node's userdata (OpInfo in _ggml_rounds.c): where a ggml_tensor keeps its data, sources,
    sizes and strides (the bindings' struct)."""

    _fields_ = [("data_offset", ctypes.c_int64), ("src_offset", ctypes.c_int64), ("ne_offset", ctypes.c_int64), ("nb_offset", ctypes.c_int64)]


_T = ggml.ggml_tensor
_SUM_INFO = _SumInfo(_T.data.offset, _T.src.offset, _T.ne.offset, _T.nb.offset)  # (alive for the process)
_SUM_OP = ggml.ggml_custom_op_t(_rounds.weighted_sum_op()) if _rounds is not None else None


def weighted_sum_added_node(ctx, y, w, x):
    """x + Σ_j y[:, j, :]·w[j, :] of y [K, k, T], w [k, T], x [K, T] → [K, T]: weighted_sum_nodes, then x added,
    as one node of _ggml_rounds with those nodes' bits (each product and sum rounded as theirs, in their
    order), where it is built and each tensor's rows are contiguous float32; else those nodes."""
    K, k, T = (int(n) for n in list(y.contents.ne)[:3])
    fused = _SUM_OP is not None and k <= _rounds.MAX_K and all(t.contents.type == ggml.GGML_TYPE_F32 and t.contents.nb[0] == 4 for t in (y, w, x))
    if not fused:
        return ggml.ggml_add(ctx, x, weighted_sum_nodes(ctx, y, ggml.ggml_reshape_3d(ctx, w, 1, k, T)))
    args = (ctypes.POINTER(_T) * 3)(y, w, x)
    info = ctypes.cast(ctypes.pointer(_SUM_INFO), ctypes.c_void_p)
    return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, K, T, 1, 1, args, 3, _SUM_OP, ggml.GGML_N_TASKS_MAX, info)


def weighted_sum(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y [T, k, K], w [T, k] → Σ_j y[:, j] · w[:, j] [T, K], j = 0, 1, …, k-1 in turn: the graph's ops (each
    product y·w rounded to float32, then added one pick after another) as two numpy calls, not 2k-1
    (~5 µs against ~15 for a decode row). numpy reduces an axis that is not the innermost one by adding
    its slices in order into a copy of the first, elementwise over the inner axis: the loop's sums."""
    if _rounds is not None:  # the same ops in C: no temporaries, no second call
        out = np.empty((y.shape[0], y.shape[-1]), F32)
        if _rounds.weighted_sum(y, w, out):
            return out
    return np.add.reduce(y * w[:, :, None], axis=1)


def _scratch_arrays(*shapes) -> list:
    """float32 arrays of these shapes (None: None), views of this thread's reused scratch where they fit
    in _SCRATCH_BYTES together, else fresh; their contents are left over from earlier calls."""
    sizes = [0 if s is None else int(np.prod(s)) for s in shapes]
    if 4 * sum(sizes) > _SCRATCH_BYTES:
        return [None if s is None else np.empty(s, F32) for s in shapes]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < sum(sizes):
        buf = _scratch.buf = np.empty(sum(sizes), F32)
    out, at = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(None if shape is None else buf[at : at + n].reshape(shape))
        at += n
    return out


def _checked_slots(slots: np.ndarray, n_slots: int) -> np.ndarray:
    ids = np.ascontiguousarray(slots, dtype=np.int32)
    if ids.ndim != 2:
        raise FomoeError(f"expected slots [T, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_slots):
        raise FomoeError(f"slot ids must lie in [0, {n_slots}), got {int(ids.min())}..{int(ids.max())}")
    return ids


def _intermediates(y) -> list:
    """y's sources computed in the graph (silu, products), then y: the tensors needing memory."""
    act = y.contents.src[1]  # silu(a) ⊙ b
    silu, b = act.contents.src[0], act.contents.src[1]
    return [silu.contents.src[0], b, silu, act, y]


def _wrap(ctx, qtype: int, ne: tuple[int, ...], buf: np.ndarray):
    """A tensor of a no_alloc context whose data is `buf` (kept alive by the caller)."""
    t = ggml.ggml_new_tensor(ctx, qtype, len(ne), (ctypes.c_int64 * len(ne))(*ne))
    t.contents.data = buf.ctypes.data
    return t


def graph_plan(gf, threads: int):
    plan = ggml.ggml_graph_plan(gf, threads, None)
    work = np.empty(max(plan.work_size, 1), np.uint8)
    plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    return plan, work  # the work buffer must outlive the plan's use


def round_call(gf, plan, h: np.ndarray, sets) -> RoundCall | None:
    """A RoundCall of the graph `gf` (planned: `plan`) that reads the row h [1, K] and, for each set of picks
    (ids [1, P] int32, outputs [P, K] float32, the graph's own arrays), writes its outputs; None where
    the C part is not built."""
    if RoundCall is None:
        return None
    return RoundCall(ctypes.cast(ggml.ggml_graph_compute, ctypes.c_void_p).value, ctypes.cast(gf, ctypes.c_void_p).value,
                     ctypes.addressof(plan), h.ctypes.data, h.shape[-1],
                     tuple((ids.ctypes.data, ids.size, out.ctypes.data) for ids, out in sets),
                     (h, *itertools.chain.from_iterable(sets)))  # fmt: skip


def run_graph(gf, plan) -> None:
    status = MATMUL.call(ggml.ggml_graph_compute, gf, ctypes.byref(plan))
    if status != 0:
        raise FomoeError("ggml graph computation failed")


def _compute(gf, threads: int) -> None:
    plan, work = graph_plan(gf, threads)
    run_graph(gf, plan)
    del work
