"""Attention over a KV cache in ggml: softmax(q·Kᵀ·scale + mask)·V as llama.cpp computes it without
flash attention (two products and ggml's fused softmax), for the cpu backend: a prefill's rows, and a
decode row's where fomoepy.runtime.row_attention's node is not built (where it is, every decode row
takes that node instead, on every path, so a row's bits are the same alone or in a batch).

ggml's products reduce along the contiguous axis of both operands, so the second product, which sums
over positions, needs each head's values position by position. The cpu backend's KV memory
(`KVMemory`) keeps keys head-major ([Hkv, capacity, hd], as numpy memory does: fomoepy.model.state) and
values transposed ([Hkv, hd, capacity], as llama.cpp keeps them without flash attention). The engine
sees both as [capacity, Hkv, hd] arrays and writes them by position as any cache.

A graph reads the cache up to `span(n_kv, capacity)`: the next multiple of BUCKET positions, so one
built graph serves BUCKET decode steps (building a layer's costs ~0.3 ms, about a step's attention).
Positions past a query's own are masked to -inf: their weights are exact zeros, so nothing stored there
reaches the query. Nor do they change its bits while the span is whole BUCKETs: each score is a dot
product over the head's dims alone; the softmax's max ignores -inf, and its sum and the second
product's add exact zeros (a weight of zero times a finite value: a cache's zeros and old rows are
finite) in whole SIMD blocks of 16, with no tail to sum apart. So a batched step reads every sequence
of it over one span, the batch's widest (`batch_spans`), and its graph serves until that span, the
batch's size or a cache's capacity changes, not every time one sequence crosses a BUCKET (a batch graph
is ~6 ms to build at 8 sequences). A span that is not whole BUCKETs (a cache's capacity of another
size: n_ctx) is read only by its own sequence. Each output element is one thread's dot product, and
each softmax row one thread's, whatever the thread count.
"""

from __future__ import annotations

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.runtime.ggml_dense import Graph

F32 = np.float32
BUCKET = 64
_F = 4  # bytes of a float32
_MAX_KEPT_QUERY_ROWS = 64  # a decode step's graphs come back every step; a prefill's rarely
_MAX_KEPT = 16


class KVMemory:
    """The cpu backend's allocator (InferenceState's `zeros`): numpy's zeros, and its KV caches laid out
    for ggml's attention (see the module's docstring)."""

    def __call__(self, shape, dtype=F32) -> np.ndarray:
        return np.zeros(shape, dtype)

    @staticmethod
    def kv(shape: tuple[int, int, int], values: bool) -> np.ndarray:
        capacity, heads, dim = shape
        if values:
            return np.zeros((heads, dim, capacity), F32).transpose(2, 0, 1)
        return np.zeros((heads, capacity, dim), F32).transpose(1, 0, 2)


def span(n_kv: int, capacity: int) -> int:
    """Positions a graph reads: n_kv rounded up to a whole BUCKET, at most the cache's capacity."""
    return min(capacity, -(-n_kv // BUCKET) * BUCKET)


def batch_spans(n_kvs: list[int], capacities: list[int]) -> list[int]:
    """The positions each sequence of a batched decode step reads, its n_kv positions in a cache of its
    capacity: the widest of their spans that is whole BUCKETs, where a sequence's own span is whole
    BUCKETs and its capacity holds that many (the same bits as its own span: see the module's docstring),
    else its own span."""
    own = [span(n, c) for n, c in zip(n_kvs, capacities)]
    whole = [s for s in own if s % BUCKET == 0]
    if not whole:
        return own
    widest = max(whole)
    return [widest if s % BUCKET == 0 and widest <= c else s for s, c in zip(own, capacities)]


def readable(k_cache: np.ndarray, v_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The caches as the graphs read them: keys with each position's head dims contiguous, values with
    each head dim's positions contiguous (KVMemory's arrays as they are; any other layout copied)."""
    if k_cache.strides[2] != _F:
        k_cache = np.ascontiguousarray(k_cache)
    if v_cache.strides[0] != _F:
        v_cache = np.ascontiguousarray(v_cache.transpose(1, 2, 0)).transpose(2, 0, 1)
    return k_cache, v_cache


def cache_inputs(g: Graph, k_cache: np.ndarray, v_cache: np.ndarray, n: int):
    """Inputs K [hd, n, Hkv] and V [n, hd, Hkv] over the caches' first n positions, strided as the arrays
    are (their data is set per run: the arrays move when a cache grows)."""
    _, Hkv, hd = k_cache.shape
    K = g.input(hd, n, Hkv, nb=(_F, k_cache.strides[0], k_cache.strides[1]))
    V = g.input(n, hd, Hkv, nb=(_F, v_cache.strides[2], v_cache.strides[1]))
    return K, V


def attention_nodes(g: Graph, q, K, V, mask, head_dim: int):
    """q [hd, rows, Hkv] (a kv head's query rows: its group of q heads, token by token) → [hd, rows, Hkv]."""
    kq = ggml.ggml_mul_mat(g.ctx, K, q)  # [n, rows, Hkv]: each row's score at each position
    weights = ggml.ggml_soft_max_ext(g.ctx, kq, mask, float(1.0 / np.sqrt(head_dim)), 0.0)
    return ggml.ggml_mul_mat(g.ctx, V, weights)


def causal_mask(n_past: int, T: int, group: int, n: int) -> np.ndarray:
    """[T·group, n]: row t·group + j (query t, at position n_past + t) is 0 up to its position, -inf after."""
    last = n_past + np.arange(T)
    rows = np.where(np.arange(n)[None, :] > last[:, None], F32(-np.inf), F32(0))  # [T, n]
    return np.ascontiguousarray(np.repeat(rows, group, axis=0), dtype=F32)


class Attention:
    """Attention of T new queries over a cache (the standalone graph: a prefill's, a batched decode
    step's per sequence; a lone decode row's is part of its layer's graph, fomoepy.runtime.
    ggml_decode, with the same nodes)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, Graph] = {}

    def __call__(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, threads: int) -> np.ndarray:
        """q [T, H, hd] at positions n_past..n_past+T-1 over caches [≥ n_past+T, Hkv, hd] that already hold
        the new keys and values → [T, H, hd]."""
        T, H, hd = q.shape
        Hkv = k_cache.shape[1]
        group = H // Hkv
        k_cache, v_cache = readable(k_cache, v_cache)
        n = span(n_past + T, k_cache.shape[0])
        # each kv head's query rows, token-major: [Hkv, T, group, hd] (a decode row's q is that already)
        qg = np.ascontiguousarray(q.reshape(T, Hkv, group, hd).transpose(1, 0, 2, 3), dtype=F32)
        key = (T, n, H, Hkv, hd, k_cache.strides, v_cache.strides, threads)
        g = self._graphs.get(key)
        last = g is None and T > _MAX_KEPT_QUERY_ROWS
        if g is None:
            g = _standalone(T, n, group, hd, k_cache, v_cache, threads)
            if not last:
                if len(self._graphs) >= _MAX_KEPT:
                    self._graphs.pop(next(iter(self._graphs)))
                self._graphs[key] = g
        out = g.run(qg, causal_mask(n_past, T, group, n), _address(k_cache), _address(v_cache), last=last)[0]
        return out.reshape(Hkv, T, group, hd).transpose(1, 0, 2, 3).reshape(T, H, hd)


def _standalone(T: int, n: int, group: int, hd: int, k_cache: np.ndarray, v_cache: np.ndarray, threads: int) -> Graph:
    Hkv = k_cache.shape[1]
    rows = T * group
    g = Graph(8, _F * (2 * rows * n * Hkv + rows * hd * Hkv) + 1024, threads)
    q, mask = g.input(hd, rows, Hkv), g.input(n, rows)
    K, V = cache_inputs(g, k_cache, v_cache, n)
    g.finish([(attention_nodes(g, q, K, V, mask, hd), (Hkv, rows, hd))])
    return g


def _address(a: np.ndarray) -> int:
    """The address of a view's first element (not contiguous: no buffer protocol)."""
    return a.__array_interface__["data"][0]


def kv_memory_layout(k_cache: np.ndarray, v_cache: np.ndarray) -> bool:
    """Whether the caches are laid out as KVMemory lays them out."""
    hd = v_cache.shape[2]
    return k_cache.strides[2] == _F and v_cache.strides[0] == _F and v_cache.strides[1] == hd * v_cache.strides[2]


def cache_addresses(cache) -> tuple[int, int]:
    """Where a KVCache's keys and values begin, kept with it until it grows (a view's address costs ~1 µs)."""
    if cache.addresses is None:
        cache.addresses = (_address(cache.k), _address(cache.v))
    return cache.addresses
