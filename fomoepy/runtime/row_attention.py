"""Every decode row's attention on the cpu backend, as one ggml node for all the rows of a step
(fomoepy/runtime/_row_attention.c, whose header gives the arithmetic and the measure behind it).

A lone row's graphs (ggml_decode.LayerGraph, DecodeToken), a batch's (DecodeBatch) and the op-by-op path
(GgmlBackend.attention) all take a decode row's attention here, so a row gets the same bits alone or in
any batch; a prefill's rows keep ggml's nodes (ggml_attention). Each row's cache and position come in a
table set per run (`fill`), so a graph serves every position. Where the module is not built, ggml's
nodes serve decode rows as well.
"""

from __future__ import annotations

import ctypes

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

from fomoepy.runtime.ggml_attention import (
    _address,
    cache_addresses,
    kv_memory_layout,
    readable,
)
from fomoepy.runtime.ggml_dense import Graph

try:  # optional (setup.py)
    from fomoepy.runtime import _row_attention as _kernel
except ImportError:
    _kernel = None

TABLE = 8  # int64 a row: keys' and values' addresses, position, write, keys' position and head strides, values' dim and head strides
_F = 4  # bytes of a float32


class _OpInfo(ctypes.Structure):
    """The node's userdata (OpInfo in _row_attention.c): where a ggml_tensor keeps its data, sources and
    sizes, the kv heads and the scores' scale."""

    _fields_ = [("data_offset", ctypes.c_int64), ("src_offset", ctypes.c_int64), ("ne_offset", ctypes.c_int64),
                ("n_head_kv", ctypes.c_int64), ("scale", ctypes.c_float)]  # fmt: skip


_T = ggml.ggml_tensor
_OP = ggml.ggml_custom_op_t(_kernel.graph_op()) if _kernel is not None else None
_INFOS: dict[tuple[int, int], _OpInfo] = {}  # (kv heads, head dim) -> the nodes' userdata, alive for the process


def runs() -> bool:
    """Whether the node is built (else ggml's attention nodes serve decode rows)."""
    return _kernel is not None


def node(ctx, q, k_new, v_new, table, n_head_kv: int, head_dim: int):
    """q [hd, H, B], the rows' keys k_new [hd, Hkv, B] (normed, rotated) and values v_new [Hkv·hd, B], float32,
    and `table` (an int64 [TABLE, B] input, `fill`'s) → [hd, H, B]: each row's key and value into its own
    cache at its position (where the table says to), then its attention over positions 0 .. its own."""
    info = _INFOS.get((n_head_kv, head_dim))
    if info is None:
        info = _INFOS[(n_head_kv, head_dim)] = _OpInfo(_T.data.offset, _T.src.offset, _T.ne.offset, n_head_kv, float(1.0 / np.sqrt(head_dim)))
    sources = [t if ggml.ggml_is_contiguous(t) else ggml.ggml_cont(ctx, t) for t in (q, k_new, v_new)]
    args = (ctypes.POINTER(_T) * 4)(*sources, table)
    hd, H, B = (int(n) for n in list(q.contents.ne)[:3])
    return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, hd, H, B, 1, args, 4, _OP, ggml.GGML_N_TASKS_MAX,
                               ctypes.cast(ctypes.pointer(info), ctypes.c_void_p))  # fmt: skip


def fill(table: np.ndarray, caches: list, positions, write: bool = True) -> np.ndarray:
    """table [B, TABLE] int64 ← row b's cache (a KVCache laid out by ggml_attention.KVMemory) and position;
    write: whether the node writes the rows' keys and values (the op-by-op path has written them)."""
    for row, cache, position in zip(table, caches, positions):
        if not kv_memory_layout(cache.k, cache.v):
            raise ValueError("a decode row's attention node reads KV caches laid out by ggml_attention.KVMemory")
        row[:] = _row(cache.k, cache.v, cache_addresses(cache), position, write)
    return table


def _row(k: np.ndarray, v: np.ndarray, addresses: tuple[int, int], position: int, write: bool) -> tuple:
    """A table row: keys k and values v (each position's key dims contiguous, each value dim's positions),
    where they begin, the position, whether to write the row there, and their strides in floats."""
    return (*addresses, position, write, k.strides[0] // _F, k.strides[1] // _F, v.strides[2] // _F, v.strides[1] // _F)


class RowAttention:
    """The op-by-op path's decode row (GgmlBackend.attention of one query row, its key and value already
    in the cache): the node in a graph of its own, kept per shape and thread count, the row's key and value
    not written again."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, object] = {}

    def __call__(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, threads: int) -> np.ndarray:
        """q [1, H, hd] at position n_past over caches [>= n_past + 1, Hkv, hd] → [1, H, hd]."""
        _, H, hd = q.shape
        Hkv = k_cache.shape[1]
        k, v = readable(k_cache, v_cache)  # (any layout: the table gives the strides)
        key = (H, Hkv, hd, threads)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = Graph(8, _F * (2 * H * hd + 2 * Hkv * hd) + 4096, threads)
            out = node(g.ctx, g.input(hd, H, 1), g.input(hd, Hkv, 1), g.input(Hkv * hd, 1), g.input(TABLE, 1, qtype=ggml.GGML_TYPE_I64), Hkv, hd)
            g.finish([(out, (1, H, hd))])
        q = np.ascontiguousarray(q, dtype=np.float32)
        table = np.array([_row(k, v, (_address(k), _address(v)), n_past, False)], np.int64)
        return g.run(q, q, q, table)[0]  # (the row's key and value not read: any memory stands for them)
