"""Token-by-token routing traces kept small enough to ship: the router's top-k ids of every token at every
MoE layer, as one uint8/uint16 array in an .npz, with the sizes a simulation needs.

A .trace file (fomoepy.experts.trace) keeps scores and probabilities for cache-aware routing replays and
is large (~200 bytes per token and layer); policies only need the ids, ~k bytes per token and layer.

    ids          [T, L, k]  the experts each token picked at each layer (exact routing, CAR off)
    expert_bytes [L]        store bytes of one expert per layer
    n_expert                experts per layer
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.trace import Trace, TraceHeader, TraceRecord


def pack(trace: Trace) -> dict[str, np.ndarray]:
    """A token-by-token .trace (records of one token each, every layer per token) → arrays."""
    h = trace.header
    if any(r.n_tokens != 1 for r in trace.records):
        raise FomoeError("only token-by-token traces can be packed (a record of several tokens is a batch)")
    if len(trace.records) % h.n_layer:
        raise FomoeError(f"{len(trace.records)} records is not a whole number of tokens x {h.n_layer} layers")
    ids = np.stack([r.ids[0] for r in trace.records]).reshape(-1, h.n_layer, h.n_expert_used)
    dtype = np.uint8 if h.n_expert <= 256 else np.uint16
    return {"ids": ids.astype(dtype), "expert_bytes": np.asarray(h.expert_bytes, dtype=np.int64), "n_expert": np.int64(h.n_expert)}


def save(path: str | Path, trace: Trace) -> None:
    np.savez_compressed(path, **pack(trace))


def load(path: str | Path, model: str = "") -> Trace:
    """A packed trace as a Trace of one record per token and layer (scores uniform, no probabilities)."""
    ids, expert_bytes, n_expert = _read_packed(path)
    T, L, k = ids.shape
    header = TraceHeader(L, n_expert, k, tuple(int(b) for b in expert_bytes), model)
    scores = np.full((1, k), 1.0 / k, dtype=np.float32)
    records = tuple(TraceRecord(t, layer, ids[t, layer][None], scores, None) for t in range(T) for layer in range(L))
    return Trace(header, records, path=str(path))


def _read_packed(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids [T, L, k], expert_bytes [L], n_expert) of a packed trace, or a FomoeError saying what is wrong."""
    try:
        with np.load(path, allow_pickle=False) as z:  # (a zip: anything else is refused, pickles too)
            ids, expert_bytes, n_expert = z["ids"].astype(np.int64), z["expert_bytes"], int(z["n_expert"])
    except OSError as e:
        raise FomoeError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile):
        # numpy's words would mislead (a non-zip is read as a pickle: "contains pickled data"); a .npy
        # gives a TypeError, an .npz of other arrays a KeyError
        raise FomoeError(f"{path}: not a packed routing trace (an .npz of ids, expert_bytes and n_expert)") from None
    if ids.ndim != 3 or expert_bytes.shape != (ids.shape[1],) or not ((0 <= ids) & (ids < n_expert)).all():
        raise FomoeError(f"{path}: not a packed routing trace: ids {ids.shape}, expert_bytes {expert_bytes.shape}, "
                         f"n_expert {n_expert}")  # fmt: skip
    return ids, expert_bytes, n_expert
