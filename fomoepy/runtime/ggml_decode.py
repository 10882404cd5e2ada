"""A qwen3moe layer's attention half, and a lone decode row's whole token, as single ggml graphs of the
cpu backend.

A qwen3moe layer for T rows of one sequence at positions p.., in the ops the op-by-op path calls one
at a time:

    xn = rms_norm(x)·attn_norm;  q, k, v = Wq·xn, Wk·xn, Wv·xn;  q, k = rope(rms_norm(q, k per head)·norms)
    K[p..], V[p..] = k, v                              (the rows' keys and values into the KV cache)
    attn = softmax(q·Kᵀ/√hd + causal mask)·V           (ggml_attention; a decode row's: row_attention)
    x' = x + Wo·attn;  h = rms_norm(x')·ffn_norm;  routing = softmax top-k of Wr·h   (ggml_dense)
    x'' = x' + Σ_j w_j · down_j(silu(gate_j·h) ⊙ up_j·h)                      (ggml_slots)

`LayerGraph` builds the first four lines as one graph, for a decode row (kept: one graph serves a
span of steps) or a prefill chunk (built for the call); the MoE step then plans, reads and computes the
experts. `DecodeToken` chains every layer, experts included (their slots looked up in a table given
per run), and the output head (rms_norm·output_norm, then the output product) into one graph for a
whole decode token, where every expert is in the tier: one call from Python a token, where the layer
path made some twenty. The routings come back for the MoE step's bookkeeping (its trace, counts, CAR).

Every node is one the op-by-op path also runs, on the same rows, and row by row: a row gets the same
bits from each path. A graph reads the KV caches up to a span (ggml_attention.span) and is built for
one span and one cache capacity; a decode graph is rebuilt when the row crosses a span (every BUCKET
steps), ~0.3 ms a layer.
"""

from __future__ import annotations

import functools

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.runtime import row_attention
from fomoepy.runtime.batched_experts import MAX_PICKS, GraphExperts
from fomoepy.runtime.ggml_attention import (
    attention_nodes,
    cache_addresses,
    cache_inputs,
    kv_memory_layout,
)
from fomoepy.runtime.ggml_dense import (
    Graph,
    normed,
    post_attention_bytes,
    post_attention_nodes,
    pre_attention_bytes,
    pre_attention_nodes,
    product,
    routed_outputs,
    routing_nodes,
)
from fomoepy.runtime.ggml_matmul import top_k_nodes
from fomoepy.runtime.ggml_slots import (
    expert_outputs,
    rows_kept_together,
    weighted_sum_added_node,
)

_F = 4  # bytes of a float32
# token embeddings whose rows ggml's get_rows gives with the bits of fomoepy's own decoder (TokenEmbedding):
# a copy, an exact widening, one product per element (Q8_0: q·d); a token's graph looks its row up itself
EMBEDDED_TYPES = frozenset((ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_Q8_0))


def row_node(T: int) -> bool:
    """Whether T rows of one sequence take their attention in row_attention's node: a decode row, where the
    node is built (every decode row of the cpu backend takes it then: the same bits on every path)."""
    return T == 1 and row_attention.runs()


def _attention_part(g: Graph, w, a, eps: float, x, pos, mask, k_cache: np.ndarray, v_cache: np.ndarray, n: int, T: int):
    """One layer's nodes for T rows up to the router's logits; the inputs it adds, in order: K and V (the
    caches' first n positions) and the rows' key and value destinations in them, or for a decode row
    (row_node) its row_attention table. → (writes, x', h, logits)."""
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    group = H // Hkv
    if not kv_memory_layout(k_cache, v_cache):
        raise ValueError("a layer's graph writes into KV caches laid out by ggml_attention.KVMemory")
    if row_node(T):  # a decode row: its key, value and attention in row_attention's node; one input, its table
        q, k_rot, v = pre_attention_nodes(g, w, a, eps, x, pos, 1)
        table = g.input(row_attention.TABLE, 1, qtype=ggml.GGML_TYPE_I64)
        attn = row_attention.node(g.ctx, q, k_rot, v, table, Hkv, hd)
        return (), *post_attention_nodes(g, w, eps, x, ggml.ggml_reshape_2d(g.ctx, attn, H * hd, 1))
    K, V = cache_inputs(g, k_cache, v_cache, n)
    q, k_rot, v = pre_attention_nodes(g, w, a, eps, x, pos, T)  # [hd, H, T], [hd, Hkv, T], [Hkv·hd, T]
    # the rows' keys [hd, Hkv, T] (position p's at p·hd, a head a capacity apart) and values, as
    # [T, Hkv·hd] (position p's at p, a head dim a capacity apart): a copy takes its source's elements
    # in order, so T rows' values go transposed (one row's are in order as they are: no copy node for a
    # decode step, and the same bits either way)
    values = v if T == 1 else ggml.ggml_transpose(g.ctx, v)
    writes = (g.write_into(k_rot, hd, Hkv, T, nb=(_F, k_cache.strides[1], k_cache.strides[0])),
              g.write_into(values, T, Hkv * hd, nb=(_F, v_cache.strides[2])))  # fmt: skip
    # each kv head's query rows token-major, [hd, group·T, Hkv], as Attention lays them (a row's are so)
    q4 = ggml.ggml_reshape_4d(g.ctx, q, hd, group, Hkv, T)
    q3 = ggml.ggml_reshape_3d(g.ctx, q4 if T == 1 else ggml.ggml_cont(g.ctx, ggml.ggml_permute(g.ctx, q4, 0, 1, 3, 2)), hd, group * T, Hkv)
    attn = attention_nodes(g, q3, K, V, mask, hd)  # [hd, group·T, Hkv]
    if T > 1:  # back to [hd, group, Hkv, T]: each row's heads together
        attn = ggml.ggml_cont(g.ctx, ggml.ggml_permute(g.ctx, ggml.ggml_reshape_4d(g.ctx, attn, hd, group, T, Hkv), 0, 1, 3, 2))
    x2, h, logits = post_attention_nodes(g, w, eps, x, ggml.ggml_reshape_2d(g.ctx, attn, H * hd, T))
    return writes, x2, h, logits


def _expert_rows(g: Graph, x2, h, logits, k: int, experts: list, B: int, into: tuple):
    """B rows' routed experts of h [D, B], added to x'; adds one input, the experts' slot table [1, E, 1]
    int32 (get_rows reads row e of it). → x'', the routing computed into `into`'s arrays (ids, weights,
    probs: ggml_dense.routing_nodes)."""
    D, E = int(h.contents.ne[0]), int(logits.contents.ne[0])
    ids, weights, _ = routing_nodes(g, logits, k, B, into)
    table = g.input(1, E, 1, qtype=ggml.GGML_TYPE_I32)
    # (the B rows' picks as one list: get_rows takes a 2-D list as one per matrix of its table)
    slots = ggml.ggml_reshape_2d(g.ctx, ggml.ggml_get_rows(g.ctx, table, ggml.ggml_reshape_1d(g.ctx, ids, k * B)), k, B)
    rows = ggml.ggml_reshape_3d(g.ctx, h, D, 1, B)
    kernel = _kernel(experts)  # fomoepy's batched kernel: each row's bits its own in any batch
    # the most rows one product takes: the kernel's nodes' picks at most, or as many as ggml keeps each row's
    # bits in (every row may pick one expert); past that, several products
    together = MAX_PICKS // k if kernel else (rows_kept_together(experts) if B > 1 else None) or B

    def outputs(first: int, n: int):
        """Rows first..first+n-1's expert outputs [D, k, n] (all B rows: the tensors themselves, no views)."""
        part_slots = slots if n == B else ggml.ggml_view_2d(g.ctx, slots, k, n, slots.contents.nb[1], first * slots.contents.nb[1])
        if kernel:
            part_h = h if n == B else ggml.ggml_view_2d(g.ctx, h, D, n, h.contents.nb[1], first * h.contents.nb[1])
            return experts.nodes(g.ctx, part_h, part_slots, n, k)
        part_rows = rows if n == B else ggml.ggml_view_3d(g.ctx, rows, D, 1, n, rows.contents.nb[1], rows.contents.nb[2],
                                                          first * rows.contents.nb[2])  # fmt: skip
        return expert_outputs(g.ctx, experts, part_rows, part_slots)

    parts = [outputs(first, min(together, B - first)) for first in range(0, B, together)]
    y = functools.reduce(lambda a, b: ggml.ggml_concat(g.ctx, a, b, 2), parts)  # [D, k, B]
    return weighted_sum_added_node(g.ctx, y, weights, x2)


def _expert_parts_bytes(experts: list, D: int, k: int, B: int) -> int:
    """Room for _expert_rows' concatenations of its products' outputs, where it takes B rows in parts."""
    if _kernel(experts):  # (its nodes' outputs, in parts of at most MAX_PICKS picks, and their concatenations)
        n = min(B, MAX_PICKS // k)
        m = -(-B // n)
        # the i-th concatenation's output holds i + 1 parts: Σ (i + 1)·n rows, quadratic in m (as below, B·(m - 1)
        # bounds it for m ≥ 2); at least the 2·B rows counted before
        return m * experts.node_bytes(n, k) + _F * D * k * B * max(2, m - 1)
    together = rows_kept_together(experts) if B > 1 else None
    return 0 if together is None or B <= together else _F * D * k * B * (-(-B // together) - 1)


def _kernel(experts) -> bool:
    """Whether a layer's graph experts are the batched kernel's (GgmlExperts.graph_inputs), not slot tensors."""
    return isinstance(experts, GraphExperts)


def _layer_bytes(w, a, n: int, T: int, k: int, experts: list | None = None) -> int:
    """Room for a layer's intermediates for T rows: its dense nodes', attention's (the queries and output
    reordered, the scores and their weights), the routing's, and a row's experts' (a, b, silu(a)·b [F, k];
    y, y·w [D, k]; k-1 partial sums [D])."""
    H, Hkv, hd, D, E = a.n_head, a.n_head_kv, a.head_dim, w.attn_q.n_cols, w.ffn_gate_inp.n_rows
    attention = _F * (2 * (H // Hkv) * T * n * Hkv + 4 * H * hd * T + 4 * T * (E + k))
    if experts is None:
        expert = 0
    elif _kernel(experts):  # (its nodes' outputs, then y·w and the partial sums)
        expert = experts.node_bytes(T, k) + _F * k * 3 * D
    else:
        expert = _F * k * (4 * int(experts[0].contents.ne[1]) + 3 * D)
    return pre_attention_bytes(w, a, T) + post_attention_bytes(w, T) + attention + expert + 64 * (128 + 2 * k)


def _room(nbytes: int) -> int:
    """A context's memory for intermediates counted at nbytes: a quarter more, and 4 KiB, for alignment
    and anything the count misses (a context that runs out aborts the process)."""
    return nbytes + nbytes // 4 + 4096


def _row_inputs(g: Graph, D: int, n: int, group: int, T: int, tokens: bool = False):
    """The inputs every layer shares: the rows x [D, T] (tokens: their tokens [T] int32 instead), their
    positions [T] int32, their mask [n, group·T]."""
    rows = g.input(T, qtype=ggml.GGML_TYPE_I32) if tokens else g.input(D, T)
    return rows, g.input(T, qtype=ggml.GGML_TYPE_I32), g.input(n, group * T)


class LayerGraph:
    """T rows of one sequence (a decode row, or a prefill chunk) through a layer's attention half in one
    graph (see the module's docstring) → x', h, h's routing to k experts (ids [T, k] int32, weights
    [T, k], probs [T, E]). Built for one pair of caches' strides and one span n; run with their
    addresses."""

    def __init__(self, w, a, eps: float, threads: int, k_cache: np.ndarray, v_cache: np.ndarray, n: int, T: int, k: int,
                 ahead=None):  # fmt: skip
        """ahead: the next layer's router (a QuantMatrix), whose k largest products with h the graph also
        gives, [T, k] int32 (the next layer's guesses, as GgmlExperts.route picks them: the same product and
        sort), so a decode step's prediction costs no graph of its own."""
        D = w.attn_q.n_cols
        E_ahead = 0 if ahead is None else ahead.n_rows
        g = self.graph = Graph(132 + 2 * k, _room(_layer_bytes(w, a, n, T, k) + _F * T * (2 * E_ahead + k)), threads)
        x, pos, mask = _row_inputs(g, D, n, a.n_head // a.n_head_kv, T)
        writes, x2, h, logits = _attention_part(g, w, a, eps, x, pos, mask, k_cache, v_cache, n, T)
        outputs = [(x2, (T, D)), (h, (T, D))] + routed_outputs(g, logits, k, T)
        if ahead is not None:
            outputs.append((top_k_nodes(g.ctx, ggml.ggml_mul_mat(g.ctx, g.weight(ahead), h), k, T), (T, k)))
        g.finish(outputs, effects=writes)
        self._row_steps = (k_cache.strides[0], v_cache.strides[0])
        self._table = np.zeros((1, row_attention.TABLE), np.int64) if row_node(T) else None

    def __call__(self, x: np.ndarray, n_past: int, inputs: tuple, cache, last: bool = False) -> list[np.ndarray]:
        """x [T, D] at positions n_past.., inputs their ([T] int32 positions, causal_mask(n_past, T, group, n)),
        cache the layer's KVCache; last: the graph runs no more."""
        if self._table is not None:
            return self.graph.run(x, *inputs, row_attention.fill(self._table, [cache], [n_past]), last=last)
        k, v = cache_addresses(cache)
        return self.graph.run(x, *inputs, k, v, k + n_past * self._row_steps[0], v + n_past * self._row_steps[1], last=last)


class DecodeToken:
    """Every layer of a lone decode row and the output head in one graph: the layers' LayerGraph nodes and
    their experts, chained, then logits = Wout·(rms_norm(x)·output_norm). layers: each layer's (weights,
    experts' slot tensors, their slot table [1, E, 1] int32, kept alive by the caller: the graph reads
    it at every run); caches: each layer's KVCache (they share a capacity, so their strides). Run with
    each layer's cache addresses → logits [1, V] and every layer's routing, one array each: ids [L, k]
    int32, weights [L, k], probs [L, E] (a call from Python costs several µs after a graph has streamed
    the weights through the caches: few arrays, few calls). embedding: the token embedding's (ggml type,
    file bytes [V, row bytes]) for one of EMBEDDED_TYPES: the graph then takes the token and looks its
    row up (get_rows), else the row."""

    def __init__(self, layers: list[tuple], caches: list, a, eps: float, output_norm, output, threads: int, n: int, k: int,
                 embedding: tuple | None = None):  # fmt: skip
        w0 = layers[0][0]
        D, V, E, L = w0.attn_q.n_cols, output.n_rows, w0.ffn_gate_inp.n_rows, len(layers)
        size = sum(_layer_bytes(w, a, n, 1, k, experts) for w, experts, _ in layers) + _F * 4 * (D + V)
        g = self.graph = Graph(L * (128 + 2 * k) + 18, _room(size), threads)
        self.routing = (np.empty((L, k), np.int32), np.empty((L, k), np.float32), np.empty((L, E), np.float32))
        x, pos, mask = _row_inputs(g, D, n, a.n_head // a.n_head_kv, 1, tokens=embedding is not None)
        self.token = None
        if embedding is not None:  # input 0 the token, its row the graph's own lookup
            qtype, table = embedding
            x = ggml.ggml_get_rows(g.ctx, g.leaf(qtype, D, table.shape[0], data=table), x)  # [D, 1]
            self.token = np.zeros(1, np.int32)  # (the input's memory for good: a token is written into it)
        writes = []
        for il, ((w, experts, _), cache) in enumerate(zip(layers, caches)):
            written, x2, h, logits = _attention_part(g, w, a, eps, x, pos, mask, cache.k, cache.v, n, 1)
            x = _expert_rows(g, x2, h, logits, k, experts, 1, tuple(r[il] for r in self.routing))
            writes += written  # in layer order: a layer's attention (added after them) sees its row
        logits = ggml.ggml_mul_mat(g.ctx, g.weight(output), normed(g, x, eps, output_norm))
        g.finish([(logits, (1, V))], effects=tuple(writes))
        self._row_steps = (caches[0].k.strides[0], caches[0].v.strides[0])
        # the inputs, in order: x, position, mask, then each layer's K, V, its row's key and value
        # destinations, slot table (with row_attention's node: its table, slot table). The tables are set
        # once; a token sets x and the destinations (the node's tables: positions); the rest stay while the
        # row's inputs and caches are the ones bound last (a sequence's steps within a span)
        self.node = row_node(1)
        per = 2 if self.node else 5

        def of_layers(*parts: int) -> list:  # each layer's inputs at these places of its `per`, layer after layer
            return g.inputs_at([3 + per * il + j for il in range(L) for j in parts])

        g.set_inputs(of_layers(per - 1), [table for _, _, table in layers])
        if self.token is not None:
            g.set_inputs(g.inputs_at([0]), [self.token])
        if self.node:  # each layer's row: its cache's strides now (a graph is kept for them), addresses when bound
            self._tables = np.zeros((L, 1, row_attention.TABLE), np.int64)
            for table, cache in zip(self._tables, caches):
                row_attention.fill(table, [cache], [0])
            g.set_inputs(of_layers(0), list(self._tables))
        self._per_token = (g.inputs_at([0]) if self.token is None else []) + ([] if self.node else of_layers(2, 3))
        self._kept = g.inputs_at([1, 2]) + ([] if self.node else of_layers(0, 1))
        self._bound: tuple = (None, None)  # (inputs, addresses) the kept inputs were set to

    def __call__(self, x: np.ndarray, position: int, inputs: tuple, addresses: list[tuple[int, int]], threads: int | None = None):
        """x [1, D] at `position` (with an embedding: the token, an int), inputs its ([position] int32, its
        causal mask), each layer's cache addresses → logits, ids, weights, probs (fresh arrays); threads:
        another count than the graph's (the same bits). inputs' arrays may be the last call's, changed in
        place."""
        if inputs is not self._bound[0] or addresses != self._bound[1]:
            if self.node:
                self.graph.set_inputs(self._kept, list(inputs))
                self._tables[:, 0, :2] = addresses
            else:
                self.graph.set_inputs(self._kept, [*inputs, *(address for pair in addresses for address in pair)])
            self._bound = (inputs, addresses)  # (held: their memory stays while the graph reads it)
        if self.token is None:
            per_token = [x]
        else:
            self.token[0] = x
            per_token = []
        if self.node:
            self._tables[:, 0, 2] = position
        else:
            dk, dv = self._row_steps
            for k, v in addresses:
                per_token += (k + position * dk, v + position * dv)
        self.graph.set_inputs(self._per_token, per_token)
        logits = self.graph.compute(threads)[0]
        return logits, *(r.copy() for r in self.routing)


class DecodeBatch:
    """One decode row of each of B sequences through every layer and the output head in one graph: the
    rows' dense products and their experts over all B rows at once (each weight read once a step), each
    sequence's keys and values into its own caches and its attention over them on its own; otherwise the
    nodes of DecodeToken, row by row, so each row gets the bits it gets alone (a product of several
    sequences' rows is taken apart where ggml's several-row kernel sums otherwise: ggml_dense.product).
    Each layer's attention is one row_attention node for all the rows (their caches and positions in a
    table set per run: one graph serves any positions and caches); where that node is not built, spans
    (spans[b] the positions sequence b's graph reads, its cache's strides fixed at build) give each
    sequence ggml's attention nodes. caches[b][il]: sequence b's KVCache of layer il. Run with every
    sequence's caches and each layer's slot table → logits [B, V] and every layer's routing, ids [L, B, k]
    int32, weights [L, B, k], probs [L, B, E]."""

    def __init__(self, layers: list[tuple], caches: list[list], spans: list[int] | None, a, eps: float, output_norm, output,
                 threads: int, k: int):  # fmt: skip
        w0 = layers[0][0]
        D, V, E, L, B = w0.attn_q.n_cols, output.n_rows, w0.ffn_gate_inp.n_rows, len(layers), len(caches)
        H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
        group = H // Hkv
        for seq in caches:
            if not all(kv_memory_layout(c.k, c.v) for c in seq):
                raise ValueError("a batch's graph writes into KV caches laid out by ggml_attention.KVMemory")
        self.node = spans is None
        # room: every layer as a lone row's of each sequence (the dense parts counted B times over: more than
        # the B-row products need), the concatenations of the rows' attention, the head's B rows
        size = sum(_layer_bytes(w, a, 1 if self.node else n, 1, k, experts) for w, experts in layers for n in spans or [1] * B)
        size += L * _F * H * hd * B * B + _F * 4 * B * (D + V) + sum(pre_attention_bytes(w, a, B, True) + post_attention_bytes(w, B, True)
                                                                     for w, _ in layers)  # fmt: skip
        size += sum(_expert_parts_bytes(experts, D, k, B) for _, experts in layers)
        g = self.graph = Graph(L * B * (128 + 2 * k) + 16 * B + 16, _room(size), threads)
        self.routing = (np.empty((L, B, k), np.int32), np.empty((L, B, k), np.float32), np.empty((L, B, E), np.float32))
        x, pos = g.input(D, B), g.input(B, qtype=ggml.GGML_TYPE_I32)
        masks = [] if self.node else [g.input(n, group) for n in spans]
        writes = []
        for il, (w, experts) in enumerate(layers):
            q, k_rot, v = pre_attention_nodes(g, w, a, eps, x, pos, B, apart=True)  # [hd, H, B], [hd, Hkv, B], [Hkv·hd, B]
            if self.node:  # (the layer's table: each row's cache and position)
                table = g.input(row_attention.TABLE, B, qtype=ggml.GGML_TYPE_I64)
                attn = ggml.ggml_reshape_2d(g.ctx, row_attention.node(g.ctx, q, k_rot, v, table, Hkv, hd), H * hd, B)
            else:
                attn = None
                for b, (seq, n) in enumerate(zip(caches, spans)):
                    cache = seq[il]
                    keys, values = cache_inputs(g, cache.k, cache.v, n)
                    k_b = ggml.ggml_view_3d(g.ctx, k_rot, hd, Hkv, 1, k_rot.contents.nb[1], k_rot.contents.nb[2], b * k_rot.contents.nb[2])
                    v_b = ggml.ggml_view_2d(g.ctx, v, Hkv * hd, 1, v.contents.nb[1], b * v.contents.nb[1])
                    writes += [g.write_into(k_b, hd, Hkv, 1, nb=(_F, cache.k.strides[1], cache.k.strides[0])),
                               g.write_into(v_b, 1, Hkv * hd, nb=(_F, cache.v.strides[2]))]  # fmt: skip
                    # row b's query heads as a lone row's: each kv head's group of them, [hd, group, Hkv]
                    q_b = ggml.ggml_view_3d(g.ctx, q, hd, group, Hkv, hd * _F, group * hd * _F, b * q.contents.nb[2])
                    a_b = ggml.ggml_reshape_2d(g.ctx, attention_nodes(g, q_b, keys, values, masks[b], hd), H * hd, 1)
                    attn = a_b if attn is None else ggml.ggml_concat(g.ctx, attn, a_b, 1)  # [H·hd, b + 1]
            x2, h, logits = post_attention_nodes(g, w, eps, x, attn, B, apart=True)
            x = _expert_rows(g, x2, h, logits, k, experts, B, tuple(r[il] for r in self.routing))
        logits = product(g, output, normed(g, x, eps, output_norm), B, True)
        g.finish([(logits, (B, V))], effects=tuple(writes))
        self._row_steps = [(seq[0].k.strides[0], seq[0].v.strides[0]) for seq in caches]
        self._tables = np.zeros((L, B, row_attention.TABLE), np.int64)  # (the node's: each layer's rows' caches and positions)
        self._filled: list = []  # the caches' addresses the tables were filled for

    def __call__(self, x: np.ndarray, positions: list[int], masks: list[np.ndarray], caches: list[list], tables: list[np.ndarray]):
        """x [B, D], row b at positions[b] (with its causal mask, for ggml's attention nodes), caches[b][il]
        sequence b's layer-il KVCache, each layer's slot table → logits [B, V], ids, weights, probs (fresh
        arrays)."""
        inputs = [x, np.array(positions, np.int32), *masks]
        if self.node:
            addresses = [cache_addresses(c) for seq in caches for c in seq]  # (a cache's move when it grows)
            if addresses != self._filled:
                for il, table in enumerate(self._tables):
                    row_attention.fill(table, [seq[il] for seq in caches], positions)
                self._filled = addresses
            self._tables[:, :, 2] = positions
            for table, slots in zip(self._tables, tables):
                inputs += (table, slots)
        else:
            for il, slots in enumerate(tables):
                for b, (dk, dv) in enumerate(self._row_steps):
                    k, v = cache_addresses(caches[b][il])
                    inputs += (k, v, k + positions[b] * dk, v + positions[b] * dv)
                inputs.append(slots)
        logits = self.graph.run(*inputs)[0]
        return logits, *(r.copy() for r in self.routing)
