"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): pre-norm blocks of GQA attention and a MoE FFN."""

from __future__ import annotations

from fomoepy.model.attention import attention_block, attention_mixer
from fomoepy.model.moe import kept_rows, moe_ffn


def qwen3moe_layer(model, il: int, x, segments, rows: slice | None = None):
    """x [N, D]: the rows of one or more sequences (`segments`, fomoepy.model.rows) → [N, D], or the
    rows `rows` only: the attention takes every row, the MoE half those (moe_ffn)."""
    x, h, routing = qwen3moe_mix(model, il, x, segments)
    ops, m = model.layer_ops(il, len(segments) > 1), model.spec.moe
    return kept_rows(x, rows) + moe_ffn(ops, model.weights.layer(il), m, model.experts, il, h, routing=routing, rows=rows)


def qwen3moe_mix(model, il: int, x, segments):
    """The layer's first half: (x after the attention, h = the MoE half's normed input, the routing where a
    fused call computed it with them, else None)."""
    ops, spec, w = model.layer_ops(il, len(segments) > 1), model.spec, model.weights.layer(il)
    eps = spec.rms_eps
    fuses = getattr(ops, "fuses_attention", None)
    m = spec.moe
    if x.shape[0] == len(segments) and fuses is not None and fuses(spec.attention, m.gating):  # a row per sequence: fused calls
        # the next layer's router where the MoE step will predict its experts from this row (one sequence's)
        predicts = getattr(model.experts, "predicts_after", None)
        ahead = model.weights.layer(il + 1).ffn_gate_inp if len(segments) == 1 and predicts is not None and predicts(il) else None
        return attention_block(ops, w, spec.attention, eps, x, il, segments, m.n_expert_used, ahead)
    prefill_layer = getattr(ops, "prefill_layer", None)
    if len(segments) == 1 and prefill_layer is not None and fuses(spec.attention, m.gating):  # a chunk of one sequence
        s = segments[0]
        return prefill_layer(x, w, spec.attention, eps, s.state.layers[il], s.state.n_past, m.n_expert_used)
    x = x + attention_mixer(ops, w, spec.attention, eps, ops.rms_norm(x, w.attn_norm, eps), il, segments)
    return x, ops.rms_norm(x, w.ffn_norm, eps), None
