"""The MoE feed-forward block shared by every architecture: router → top-k → experts (+ shared expert)."""

from __future__ import annotations

import itertools

import numpy as np

from fomoepy.experts.routing import Routing
from fomoepy.model.spec import MoESpec


def moe_ffn(ops, w, m: MoESpec, experts, layer: int, h: np.ndarray, routing: Routing | None = None,
            rows: slice | None = None) -> np.ndarray:  # fmt: skip
    """h [T, D] (already normed) → [T, D], or of the rows `rows` only (the last layer's, where no one reads
    the others: every row is routed and counted, those are computed); routing: h's, where the caller has
    it already (fomoepy.model.attention.attention_block)."""
    if routing is None:
        routing = _route(ops, w, m, experts, layer, h)
    # Σ_j weights[t, j] · expert_ids[t, j](h[t]); CAR may swap ids (off: the router's)
    out = experts(layer, h, routing) if rows is None else experts(layer, h, routing, rows)
    return out + _shared_expert(ops, w, m, kept_rows(h, rows)) if m.shared_ff else out


def moe_ffn_runs(ops, w, m: MoESpec, experts, layer: int, hs: list[np.ndarray], routings: list[Routing | None],
                 kept: list[slice] | None = None) -> list[np.ndarray]:  # fmt: skip
    """moe_ffn of several sequences' rows in one step (a joint prefill): h_s [n_s, D] of each → each one's
    [n_s, D] (or its rows kept[s]), as moe_ffn gives each alone. Each sequence's router and shared expert
    run on its own rows (their products as alone); the routed experts are one step over all of them, each
    selected expert planned and read once, each sequence's rows computed apart (MoEStep's runs)."""
    routings = [r if r is not None else _route(ops, w, m, experts, layer, h) for h, r in zip(hs, routings)]
    starts = np.cumsum([0] + [h.shape[0] for h in hs]).tolist()
    local = kept or [slice(0, h.shape[0]) for h in hs]
    runs = [slice(a + k.start, a + k.stop) for a, k in zip(starts, local)]
    joint = Routing(*(np.concatenate(parts) for parts in zip(*((r.ids, r.weights, r.probs) for r in routings))))
    out = experts(layer, np.concatenate(hs), joint, runs)
    at = np.cumsum([0] + [k.stop - k.start for k in local]).tolist()
    outs = [out[a:b] for a, b in itertools.pairwise(at)]
    if m.shared_ff:
        outs = [o + _shared_expert(ops, w, m, h[k]) for o, h, k in zip(outs, hs, local)]
    return outs


def _route(ops, w, m: MoESpec, experts, layer: int, h: np.ndarray) -> Routing:
    # top-k of the router's logits h · W_gate_inpᵀ [T, E] (the step makes the product: on a GPU's decode step,
    # in the same device round trip as the top-k): ids, weights [T, k]; probs [T, E]
    return experts.route(ops, layer, h, w.ffn_gate_inp, m.gating, m.n_expert_used)


def _shared_expert(ops, w, m: MoESpec, h: np.ndarray) -> np.ndarray:
    shared = ops.swiglu_ffn(h, w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp)
    if m.shared_gate:
        shared = shared * ops.sigmoid(ops.linear(h, w.ffn_gate_inp_shexp[None, :]))  # [T, 1]
    return shared


def kept_rows(x, rows: slice | None):
    """x's rows `rows` (None: all of them)."""
    return x if rows is None else x[rows]
