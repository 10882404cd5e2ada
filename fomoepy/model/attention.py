"""Full softmax attention with per-head q/k RMSNorm and NEOX RoPE (qwen3moe; gated variant for qwen35moe)."""

from __future__ import annotations

import numpy as np

from fomoepy.model.spec import AttentionSpec
from fomoepy.model.state import KVCache


def attention_mixer(ops, w, a: AttentionSpec, eps: float, x: np.ndarray, cache: KVCache, n_past: int) -> np.ndarray:
    """x [T, D] (already normed) → [T, D]; appends this step's keys and values to `cache`."""
    T = x.shape[0]
    H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
    positions = np.arange(n_past, n_past + T)

    q = ops.linear(x, w.attn_q)  # [T, H·hd] or, gated, [T, H·2hd] = per head [q | gate]
    if a.gated:
        q_and_gate = q.reshape(T, H, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(T, H * hd)
    q = q.reshape(T, H, hd)
    k = ops.linear(x, w.attn_k).reshape(T, Hkv, hd)
    v = ops.linear(x, w.attn_v).reshape(T, Hkv, hd)

    q = ops.rope_neox(ops.rms_norm(q, w.attn_q_norm, eps), positions, a.rotary_dim, a.rope_base)
    k = ops.rope_neox(ops.rms_norm(k, w.attn_k_norm, eps), positions, a.rotary_dim, a.rope_base)
    cache.k[n_past : n_past + T] = k
    cache.v[n_past : n_past + T] = v

    out = ops.attention(q, cache.k, cache.v, n_past).reshape(T, H * hd)
    if a.gated:
        out = out * ops.sigmoid(gate)
    return ops.linear(out, w.attn_output)
