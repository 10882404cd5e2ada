"""The MoE feed-forward block shared by every architecture: router → top-k → experts (+ shared expert)."""

from __future__ import annotations

import numpy as np

from fomoepy.experts.routing import Routing
from fomoepy.model.spec import MoESpec


def moe_ffn(ops, w, m: MoESpec, experts, layer: int, h: np.ndarray, routing: Routing | None = None,
            rows: slice | None = None) -> np.ndarray:  # fmt: skip
    """h [T, D] (already normed) → [T, D], or of the rows `rows` only (the last layer's, where no one reads
    the others: every row is routed and counted, those are computed); routing: h's, where the caller has
    it already (fomoepy.model.attention.attention_block)."""
    if routing is None:
        router_logits = ops.linear(h, w.ffn_gate_inp)  # [T, E]
        routing = experts.route(ops, layer, h, router_logits, m.gating, m.n_expert_used)  # ids, weights [T, k]; probs [T, E]
    # Σ_j weights[t, j] · expert_ids[t, j](h[t]); CAR may swap ids (off: the router's)
    out = experts(layer, h, routing) if rows is None else experts(layer, h, routing, rows)
    if m.shared_ff:
        h = kept_rows(h, rows)
        shared = ops.swiglu_ffn(h, w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp)
        if m.shared_gate:
            shared = shared * ops.sigmoid(ops.linear(h, w.ffn_gate_inp_shexp[None, :]))  # [T, 1]
        out = out + shared
    return out


def kept_rows(x, rows: slice | None):
    """x's rows `rows` (None: all of them)."""
    return x if rows is None else x[rows]
