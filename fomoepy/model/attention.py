"""Full softmax attention with per-head q/k RMSNorm and NEOX RoPE (qwen3moe; gated variant for qwen35moe)."""

from __future__ import annotations

import numpy as np

from fomoepy.model.rows import Segment, one_row_each, rows_of, stack
from fomoepy.model.spec import AttentionSpec
from fomoepy.model.state import KVCache


def attention_mixer(ops, w, a: AttentionSpec, eps: float, x: np.ndarray, il: int, segments: list[Segment]) -> np.ndarray:
    """x [N, D] (already normed) → [N, D]; each segment's rows attend over its own sequence's cache,
    to which they append their keys and values. The projections run on all N rows at once."""
    N = x.shape[0]
    H, hd = a.n_head, a.head_dim
    q = ops.linear(x, w.attn_q)  # [N, H·hd] or, gated, [N, H·2hd] = per head [q | gate]
    if a.gated:
        q_and_gate = q.reshape(N, H, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(N, H * hd)
    k = ops.linear(x, w.attn_k)
    v = ops.linear(x, w.attn_v)
    if one_row_each(segments) and hasattr(ops, "attend_rows"):
        out = _attend_rows(ops, w, a, eps, q, k, v, [s.state for s in segments], il).reshape(N, H * hd)
    else:
        single = len(segments) == 1
        out = stack(
            ops,
            [
                _attend(ops, w, a, eps, rows_of(q, s, single), rows_of(k, s, single), rows_of(v, s, single),
                        s.state.layers[il], s.state.n_past)
                for s in segments
            ]
        ).reshape(N, H * hd)  # fmt: skip
    if a.gated:
        out = out * ops.sigmoid(gate)
    return ops.linear(out, w.attn_output)


def attention_block(ops, w, a: AttentionSpec, eps: float, x: np.ndarray, il: int, segments: list[Segment], k: int,
                    ahead=None) -> tuple:  # fmt: skip
    """Decode rows x [B, D], one of each sequence (`segments` of one row each), through a backend that
    fuses a layer's dense work around attention (ops.attention_layer for one row, ops.attention_inputs /
    attention_output for several: the cpu backend's graphs) → (x + attention, its FFN norm h, h's routing
    to k experts): the ops of attention_mixer, its residual, the FFN norm, the router's product and its
    routing, in fewer calls, on all rows at once; each row attends over its own sequence's cache. ahead: the
    next layer's router, for one sequence's row: its k largest products with h come with the routing
    (Routing.ahead, the next layer's guesses)."""
    if len(segments) == 1:  # one sequence's row: the layer's whole attention in one of the backend's calls
        s = segments[0]
        return ops.attention_layer(x, w, a, eps, s.state.layers[il], s.state.n_past, k, ahead)
    positions = [s.state.n_past for s in segments]
    q, k_rot, v = ops.attention_inputs(x, w, a, eps, positions, k)  # q [B, H, hd], k [B, Hkv, hd] normed, rotated; v [B, Hkv·hd]
    out = stack(ops, [_cache_attend(ops, q[i : i + 1], k_rot[i : i + 1], v[i : i + 1], s.state.layers[il], s.state.n_past)
                 for i, s in enumerate(segments)])  # fmt: skip
    return ops.attention_output(x, out.reshape(len(segments), -1), w, a, eps, k)


def _attend(ops, w, a: AttentionSpec, eps: float, q, k, v, cache: KVCache, n_past: int) -> np.ndarray:
    """One sequence's T new rows: q [T, H·hd], k, v [T, Hkv·hd] → [T, H, hd]."""
    T = q.shape[0]
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    positions = np.arange(n_past, n_past + T)
    q = ops.rope_neox(ops.rms_norm(q.reshape(T, H, hd), w.attn_q_norm, eps), positions, a.rotary_dim, a.rope_base)
    k = ops.rope_neox(ops.rms_norm(k.reshape(T, Hkv, hd), w.attn_k_norm, eps), positions, a.rotary_dim, a.rope_base)
    return _cache_attend(ops, q, k, v, cache, n_past)


def _attend_rows(ops, w, a: AttentionSpec, eps: float, q, k, v, states: list, il: int):
    """A batched decode step's rows, one of each sequence, as _attend takes each alone, in the backend's
    one call for all (ops.attend_rows: each row's key and value into its own cache, its query over it):
    q [B, H·hd], k, v [B, Hkv·hd] → [B, H, hd]. The norms and RoPE run on every row at once, each row at
    its own position."""
    B = q.shape[0]
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    positions = np.array([s.n_past for s in states])
    q = ops.rope_neox(ops.rms_norm(q.reshape(B, H, hd), w.attn_q_norm, eps), positions, a.rotary_dim, a.rope_base)
    k = ops.rope_neox(ops.rms_norm(k.reshape(B, Hkv, hd), w.attn_k_norm, eps), positions, a.rotary_dim, a.rope_base)
    return ops.attend_rows(q, k, v.reshape(B, Hkv, hd), [s.layers[il] for s in states], positions)


def _cache_attend(ops, q, k, v, cache: KVCache, n_past: int) -> np.ndarray:
    """q [T, H, hd], k [T, Hkv, hd] normed and rotated, v [T, Hkv·hd] → [T, H, hd]: into the cache, attention."""
    T, Hkv, hd = k.shape
    cache.k[n_past : n_past + T] = k
    cache.v[n_past : n_past + T] = v.reshape(T, Hkv, hd)
    return ops.attention(q, cache.k, cache.v, n_past)
