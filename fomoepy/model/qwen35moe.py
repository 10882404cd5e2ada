"""qwen35moe (Qwen3.5 / 3.6, e.g. 397B-A17B): Gated DeltaNet layers with gated full attention every
`full_attention_interval` layers, and a MoE FFN with a sigmoid-gated shared expert."""

from __future__ import annotations

from fomoepy.model.attention import attention_mixer
from fomoepy.model.deltanet import deltanet_mixer
from fomoepy.model.moe import kept_rows, moe_ffn
from fomoepy.model.spec import ATTENTION


def qwen35moe_layer(model, il: int, x, segments, rows: slice | None = None):
    """x [N, D]: the rows of one or more sequences (`segments`, fomoepy.model.rows) → [N, D], or the
    rows `rows` only: the mixer takes every row, the MoE half those (moe_ffn)."""
    x, h, _ = qwen35moe_mix(model, il, x, segments)
    ops, m = model.layer_ops(il, len(segments) > 1), model.spec.moe
    return kept_rows(x, rows) + moe_ffn(ops, model.weights.layer(il), m, model.experts, il, h, rows=rows)


def qwen35moe_mix(model, il: int, x, segments):
    """The layer's first half: (x after the mixer, h = the MoE half's normed input, None: the MoE half
    routes)."""
    ops, spec, w = model.layer_ops(il, len(segments) > 1), model.spec, model.weights.layer(il)
    eps = spec.rms_eps
    xn = ops.rms_norm(x, w.attn_norm, eps)
    if spec.layer_kinds[il] == ATTENTION:
        x = x + attention_mixer(ops, w, spec.attention, eps, xn, il, segments)
    else:
        x = x + deltanet_mixer(ops, w, spec.deltanet, eps, xn, il, segments)
    return x, ops.rms_norm(x, w.post_attention_norm, eps), None
