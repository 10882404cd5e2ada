"""Expert selection from router logits, as each architecture defines it.

Pure numpy over small arrays ([T, E] logits); no weights. Cache-aware routing (CAR) builds on the
exact selection made here.
"""

from __future__ import annotations

import numpy as np


def softmax_topk_renorm(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3 / Qwen3.5: softmax over all experts, the k largest, their weights renormalised to sum 1.

    logits [T, E] → ids [T, k] (int64, by descending score), weights [T, k] (float32).
    """
    z = logits.astype(np.float32)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # stable sort on −p: ties (which the test models avoid) go to the lower expert id, deterministically
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, ids, axis=-1)
    weights = top / top.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


GATING_FUNCTIONS = {"softmax": softmax_topk_renorm}
