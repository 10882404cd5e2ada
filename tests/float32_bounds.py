"""How far two float32 evaluations of the same forward pass may drift apart when only the order of their
sums differs (batched GEMM against one-row GEMV, another BLAS kernel on another processor).

Derivation. A float32 sum of n terms computed in any order carries an error of at most γ_n·Σ|terms|,
γ_n = n·u/(1 − n·u) ≈ n·u with u = 2^-24 (Higham, Accuracy and Stability, §3.1): each addition
rounds once, relative to a partial sum no larger than Σ|terms|. Two orders of the same sum therefore
differ by at most 2·n·u·Σ|terms|. To first order, the rounding errors of the sums along the chain that
leads to one logit add up: an error made in layer l's hidden state reaches the logit through the same
(normalised) path as the signal, so it contributes its own relative size. The relative drift of a logit
is then at most 2·u·D, where D — the *depth* — is the total length of the float32 sums on that chain:

    D = Σ_layers (mixer sums + MoE sums) + n_embd (output head)

    attention mixer  n_embd (q, k, v) + head_dim (q·k) + 2·n_ctx (softmax denominator, weights·V)
                     + n_head·head_dim (output projection)
    DeltaNet mixer   n_embd (qkv, β, α, gate) + 2·state_size (Sᵀk, Sᵀq) + n_ctx (the state sums one
                     update per token) + inner_size (output projection)
    MoE              n_embd (router) + n_embd + expert_ff (gate/up, down) + n_expert_used (weighted sum)
                     + n_embd + shared_ff (shared expert, when present)

Σ|terms| is measured against the largest logit rather than per entry, and the first-order argument
ignores the amplification of a norm's or softmax's Jacobian; both are covered by the stated factor
SAFETY = 2. The bound is worst case (errors all aligned); rounding errors of real sums mostly cancel, so a
correct forward pass sits one to two orders of magnitude under it, while a real defect (a causal mask
shifted by one position, one token's RoPE dropped) moves logits by a good fraction of their size.
"""

from __future__ import annotations

import numpy as np

from fomoepy.model.spec import ATTENTION, ModelSpec

U = 2.0**-24  # unit round-off of float32
SAFETY = 2.0


def sum_depth(spec: ModelSpec, n_ctx: int) -> int:
    """D: the total length of the float32 sums on the chain from the embedding to one logit."""
    a, m = spec.attention, spec.moe
    moe = 2 * spec.n_embd + m.expert_ff + m.n_expert_used + (spec.n_embd + m.shared_ff if m.shared_ff else 0)
    depth = spec.n_embd  # output head
    for kind in spec.layer_kinds:
        if kind == ATTENTION:
            mixer = spec.n_embd + a.head_dim + 2 * n_ctx + a.n_head * a.head_dim
        else:
            dn = spec.deltanet
            mixer = spec.n_embd + 2 * dn.state_size + n_ctx + dn.inner_size
        depth += mixer + moe
    return depth


def reorder_bound(spec: ModelSpec, n_ctx: int, evaluations: int = 2) -> float:
    """Largest |a − b| / max|logit| for two summation orders of the same forward pass over n_ctx tokens
    (evaluations=2), or for one float32 evaluation against the exact function (evaluations=1)."""
    return SAFETY * evaluations * U * sum_depth(spec, n_ctx)


def ppl_bound(logit_bound: float, max_abs_logit: float, ppl: float, printed_decimals: int = 4) -> float:
    """Largest relative difference of two printed perplexities whose logits differ by at most
    logit_bound × max_abs_logit.

    A token's NLL is logsumexp(z) − z_target: each term moves by at most max|Δz|, so the NLL by 2·max|Δz|,
    and so does the mean NLL, ln PPL; PPL's relative change is then at most e^(2·max|Δz|) − 1. Each
    printed value is also rounded to half a unit of its last decimal.
    """
    rounding = 2 * 0.5 * 10.0**-printed_decimals / ppl
    return float(np.expm1(2 * logit_bound * max_abs_logit)) + rounding
