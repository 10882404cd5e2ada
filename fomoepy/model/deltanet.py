"""Gated DeltaNet, the linear-attention mixer of qwen35moe (as llama.cpp reads converted files).

Conventions of converted files: ssm_a holds −exp(A_log); v head j reads q/k head j mod n_k_heads
(v heads are stored in that tiled order); ssm_norm is used as stored.
"""

from __future__ import annotations

import numpy as np

from fomoepy.model.rows import Segment, one_row_each, rows_of, stack
from fomoepy.model.spec import DeltaNetSpec
from fomoepy.model.state import DeltaNetState


def deltanet_mixer(ops, w, dn: DeltaNetSpec, eps: float, x: np.ndarray, il: int, segments: list[Segment]) -> np.ndarray:
    """x [N, D] (already normed) → [N, D]; each segment advances its own sequence's convolution and
    delta-rule states. The projections run on all N rows at once."""
    N = x.shape[0]
    Hv, dv = dn.n_v_heads, dn.v_head_dim
    qkv = ops.linear(x, w.attn_qkv)  # [N, 2·Hk·dk + Hv·dv], before the convolution
    beta = ops.sigmoid(ops.linear(x, w.ssm_beta))  # [N, Hv]
    g = ops.softplus(ops.linear(x, w.ssm_alpha) + w.ssm_dt_bias) * w.ssm_a  # log-decay, [N, Hv]
    # o [N, Hv, dv]: each sequence's rows through its own convolution and delta-rule states
    if one_row_each(segments) and hasattr(ops, "delta_rule_rows"):
        o = _recur_rows(ops, w, dn, eps, qkv, beta, g, [s.state.layers[il] for s in segments])
    else:
        single = len(segments) == 1
        o = stack(
            ops,
            [
                _recur(ops, w, dn, eps, rows_of(qkv, s, single), rows_of(beta, s, single), rows_of(g, s, single),
                       s.state.layers[il])
                for s in segments
            ]
        )  # fmt: skip
    z = ops.linear(x, w.attn_gate).reshape(N, Hv, dv)
    o = ops.rms_norm(o, w.ssm_norm, eps) * ops.silu(z)
    return ops.linear(o.reshape(N, Hv * dv), w.ssm_out)


def _recur(ops, w, dn: DeltaNetSpec, eps: float, qkv, beta, g, state: DeltaNetState):
    """One sequence's T rows through its convolution and delta rule → o [T, Hv, dv]."""
    qkv, state.conv = ops.causal_conv1d(qkv, state.conv, w.ssm_conv1d)
    q, k, v = _heads(ops, dn, eps, qkv)
    o, state.ssm = ops.delta_rule(q, k, v, g, beta, state.ssm)  # [T, Hv, dv]
    return o


def _recur_rows(ops, w, dn: DeltaNetSpec, eps: float, qkv, beta, g, states: list[DeltaNetState]):
    """A batched decode step's rows, one of each sequence, as _recur takes each alone, through the backend's
    one call for all at each stage (ops.causal_conv1d_rows, ops.delta_rule_rows: each row through its own
    sequence's states, updated in place) → o [B, Hv, dv]."""
    qkv = ops.causal_conv1d_rows(qkv, [s.conv for s in states], w.ssm_conv1d)
    q, k, v = _heads(ops, dn, eps, qkv)
    return ops.delta_rule_rows(q, k, v, g, beta, [s.ssm for s in states])


def _heads(ops, dn: DeltaNetSpec, eps: float, qkv):
    """The convolution's output [T, 2·Hk·dk + Hv·dv] → q, k [T, Hv, dk] (normed, q scaled; v head j reads
    q/k head j mod Hk) and v [T, Hv, dv]."""
    T = qkv.shape[0]
    Hk, Hv, dk, dv = dn.n_k_heads, dn.n_v_heads, dn.state_size, dn.v_head_dim
    qkv = ops.silu(qkv)  # [T, 2·Hk·dk + Hv·dv]
    q = qkv[:, : Hk * dk].reshape(T, Hk, dk)
    k = qkv[:, Hk * dk : 2 * Hk * dk].reshape(T, Hk, dk)
    v = qkv[:, 2 * Hk * dk :].reshape(T, Hv, dv)

    q = ops.l2_norm(q, eps) * np.float32(1.0 / np.sqrt(dk))
    k = ops.l2_norm(k, eps)
    tile = np.arange(Hv) % Hk  # v head j ← q/k head j mod Hk
    q, k = q[:, tile], k[:, tile]  # [T, Hv, dk]
    return q, k, v
