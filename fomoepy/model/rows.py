"""The rows of one forward pass, grouped by sequence: a prefill is one segment of T rows, a batched
decode step B segments of one row each (each with its own state and position).

Per-sequence work (attention over its KV cache, DeltaNet's convolution and delta rule, RoPE at its
positions) runs segment by segment; the products with weights run on every row at once. When the
rows belong to several sequences those products must give each row the bits it gets alone, so that
a request's output does not depend on who shares its step: `RowwiseOps` makes them so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fomoepy.model.state import InferenceState


@dataclass(frozen=True)
class Segment:
    state: InferenceState
    start: int  # first row of this sequence in the step's [N, D] rows
    n: int  # its rows (tokens)


def rows_of(a, s: Segment, single: bool):
    """The segment's rows of a [N, ...] array (the array itself when it is the only segment, so a
    one-sequence step touches its arrays exactly as before, on any backend)."""
    return a if single else a[s.start : s.start + s.n]


def one_row_each(segments: list[Segment]) -> bool:
    """Whether the rows are a batched decode step's: one row of each of several sequences (the steps a
    backend's `*_rows` calls take for all sequences at once)."""
    return len(segments) > 1 and all(s.n == 1 for s in segments)


def stack(ops: Any, parts: list) -> Any:
    """Segments' results in row order (one segment: itself), where the backend keeps them (a GPU's
    concat_rows: they stay on the device)."""
    if len(parts) == 1:
        return parts[0]
    concat = getattr(ops, "concat_rows", None)
    return concat(parts) if concat is not None else np.concatenate([np.asarray(p) for p in parts], axis=0)


class RowwiseOps:
    """A backend whose products give each row of x the bits that row gets alone.

    The reference backend's `x @ w.T` is a BLAS GEMM for many rows and a GEMV for one, and the two sum
    in different orders (measured here: row i of a [B, 1024] GEMM differs from the [1, 1024] GEMV by up
    to 6e-5 on unit-normal inputs), so a batched row would drift from its sequence run alone. Its
    `linear_rows` runs one product per row (numpy's stacked matmul: a GEMV each), the same call a row
    gets alone. The cpu backend's ggml computes every output element as one dot product of the row's
    own quantized activations, whatever the rows around it, so its `linear_rows` is its `linear`.
    """

    def __init__(self, ops: Any):
        self._ops = ops
        self.linear = ops.linear_rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def swiglu_ffn(self, x, gate, up, down):
        return self.linear(self.silu(self.linear(x, gate)) * self.linear(x, up), down)


def supports_rows(ops: Any) -> bool:
    return callable(getattr(ops, "linear_rows", None))
