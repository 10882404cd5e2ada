"""Expert selection from router logits, as each architecture defines it.

Pure numpy over small arrays ([T, E] logits); no weights. Cache-aware routing (CAR) starts from
the exact selection made here, and needs the full distribution too.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np


class Routing(NamedTuple):  # (a named tuple, as the cache's Plan: a decode step makes three, and a frozen dataclass's
    # __init__ sets each field through object.__setattr__)
    ids: np.ndarray  # [T, k] int64, by descending score
    weights: np.ndarray  # [T, k] float32, as the architecture normalises them
    probs: np.ndarray  # [T, E] float32, the distribution the selection was made from
    # [T, k]: the next layer's experts predicted from the same rows (its router's k largest, largest first),
    # where whoever routed computed them with this routing (the cpu backend's decode-row attention graph, a
    # GPU's read-back of both: GpuExperts.route_ahead); the MoE step then reads them ahead without a
    # product of its own
    ahead: np.ndarray | None = None


# routing_of((ids, weights, probs, ahead)): a Routing made by tuple.__new__ itself, for the decode step's hot
# paths: the named tuple's own __new__ is a Python function, a frame each (a decode step makes three)
routing_of = functools.partial(tuple.__new__, Routing)


def softmax_probs(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float32)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def softmax_route(logits: np.ndarray, k: int) -> Routing:
    """Qwen3 / Qwen3.5: softmax over all experts, the k largest, their weights renormalised to sum 1."""
    if logits.ndim == 2 and logits.shape[0] == 1:
        return _softmax_route_row(logits, k)
    return softmax_route_rows(logits, k)


def softmax_route_rows(logits: np.ndarray, k: int) -> Routing:
    """softmax_route for any number of rows."""
    probs = softmax_probs(logits)
    # stable sort on −p: ties (which the test models avoid) go to the lower expert id, deterministically
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, ids, axis=-1)
    weights = (top / top.sum(axis=-1, keepdims=True)).astype(np.float32)
    return Routing(ids, weights, probs)


def _softmax_route_row(logits: np.ndarray, k: int) -> Routing:
    """softmax_route_rows of one row [1, E] (a decode step's, once per MoE layer), bit for bit: the same
    float32 ops on the row as a 1-D array, without the [T, E] machinery (take_along_axis, keepdims),
    which was half of its ~22 µs. A row's max, sum and argsort are the same reductions over the same
    contiguous values either way."""
    row = np.asarray(logits, np.float32)[0]
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    ids = np.argsort(-probs, kind="stable")[:k]  # ties to the lower expert id, as softmax_route_rows
    top = probs[ids]
    return Routing(ids[None], (top / top.sum())[None], probs[None])


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's k largest logits, largest first, ties to the lower id: the experts softmax_route
    picks (softmax is monotonic), without its probabilities or weights, for a prediction that needs neither
    (the next layer's guesses, read ahead). One sort: run right after a layer's products, on caches they
    have emptied, each numpy call of the full routing costs tens of µs (bench/host_time.py's cpu path)."""
    return np.argsort(-np.asarray(logits, np.float32), axis=-1, kind="stable")[:, :k]


GATING_FUNCTIONS = {"softmax": softmax_route}
