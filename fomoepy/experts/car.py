"""Cache-aware routing (CAR): swap an uncached selected expert for a cached one the router nearly chose.

Off by default, and then the router's selection passes through untouched (the same arrays). When on,
for each token the selected slots are visited in the order given (descending probability, as the
router returns them). For a slot whose expert o is not cached, the candidate is the cached expert s
with the highest probability that is neither selected for this token nor already used as a
substitute (ties: lower id). It replaces o exactly when

    probs[s] / probs[o] >= threshold.

If it does not clear the threshold the slot keeps o (a later slot, with a smaller probs[o], may
still take s). An expert is never selected twice.

Weight contract. The substitute takes over the original's slot. Before normalisation that slot's
weight is
    p_o                          without dampening, and
    p_o · (p_s / p_o) = p_s      with dampening,
then the token's k weights are renormalised to sum 1, as Qwen3 / Qwen3.5 normalise top-k weights.
So without dampening a token's weights are exactly its exact-run weights (only ids change), and with
dampening they are probs[new ids] / Σ probs[new ids], computed in float32 like the router does. A
token with no substitution keeps its input weights bit for bit.

Options: no CAR for tokens whose index is below `warmup_tokens` (the cache is still cold), nor in
the first `protect_first` and last `protect_last` layers (where errors cost most). Substituted
originals are returned so the caller can queue them for backfill.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from fomoepy.errors import FomoeError


@dataclass(frozen=True)
class CarConfig:
    threshold: float | None = None  # None or 0: off
    dampen: bool = False
    warmup_tokens: int = 0
    protect_first: int = 0
    protect_last: int = 0

    def __post_init__(self) -> None:
        if self.threshold is not None and not self.threshold >= 0:
            raise FomoeError(f"CAR threshold must be >= 0 (0 = off), got {self.threshold}")
        for name in ("warmup_tokens", "protect_first", "protect_last"):
            if getattr(self, name) < 0:
                raise FomoeError(f"CAR {name.replace('_', ' ')} must be >= 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.threshold)

    @staticmethod
    def add_arguments(g) -> None:
        """The --car-* flags (fomoe generate/serve/ppl/profile and fomoe simulate share them)."""
        g.add_argument("--car-threshold", type=float, default=None, metavar="T",
                       help="substitute a cached expert when p(substitute)/p(original) >= T")  # fmt: skip
        g.add_argument("--car-dampen", action="store_true", help="a substitute weighs its own probability, not the original's")
        g.add_argument("--car-warmup", type=int, default=0, metavar="N", help="no substitution for the first N tokens")
        g.add_argument("--car-protect-first", type=int, default=0, metavar="N", help="no substitution in the first N layers")
        g.add_argument("--car-protect-last", type=int, default=0, metavar="N", help="no substitution in the last N layers")

    @classmethod
    def from_args(cls, args) -> CarConfig:
        return cls(threshold=args.car_threshold, dampen=args.car_dampen, warmup_tokens=args.car_warmup,
                   protect_first=args.car_protect_first, protect_last=args.car_protect_last)  # fmt: skip

    def applies_to_layer(self, layer: int, n_layer: int) -> bool:
        return self.enabled and self.protect_first <= layer < n_layer - self.protect_last


@dataclass(frozen=True)
class CarResult:
    ids: np.ndarray  # [T, k] the experts to compute
    weights: np.ndarray  # [T, k]
    substitutions: list[tuple[int, int]]  # (original, substitute), by token then slot
    n_slots: int  # T · k, the denominator of the substitution rate


def cache_aware_route(
    ids: np.ndarray,
    weights: np.ndarray,
    probs: np.ndarray,
    cached: np.ndarray | Collection[int],
    config: CarConfig,
    *,
    layer: int,
    n_layer: int,
    first_token: int = 0,
) -> CarResult:
    """ids/weights [T, k] from the router, probs [T, E] its full softmax, cached: bool [E] or a set of ids.

    Row t is token number first_token + t (the engine's running count, for warmup).
    """
    ids = np.asarray(ids)
    T, k = ids.shape
    passthrough = CarResult(ids, weights, [], T * k)
    if not config.applies_to_layer(layer, n_layer) or T == 0:
        return passthrough
    E = probs.shape[-1]
    mask = as_mask(cached, E)
    active = np.arange(first_token, first_token + T) >= config.warmup_tokens  # [T]
    need = ~mask[ids] & active[:, None]  # [T, k] slots that CAR may replace
    rows = np.flatnonzero(need.any(axis=1))
    if rows.size == 0:
        return passthrough
    p = probs[rows].astype(np.float32)  # [R, E]
    sel = ids[rows]  # [R, k]
    rr = np.arange(rows.size)[:, None]  # row index for fancy indexing ([R, k] picks; cheaper than *_along_axis)
    cand_p = np.where(mask[None, :], p, -np.inf)
    cand_p[rr, sel] = -np.inf  # never a second copy of a selected expert
    # the k best candidates suffice: at most k slots take one each; stable sort → ties to lower id
    cand = np.argsort(-cand_p, axis=1, kind="stable")[:, :k]  # [R, k]
    # the greedy walk is a few Python steps per row, on Python floats: float32 values widened
    # exactly, so each ratio is one correctly rounded float64 division
    cand_l, cand_pl = cand.tolist(), cand_p[rr, cand].tolist()
    sel_l, p_sel = sel.tolist(), p[rr, sel].tolist()
    need_l = need[rows].tolist()
    threshold = float(config.threshold)  # type: ignore[arg-type]
    pairs: list[tuple[int, int]] = []
    changed: list[int] = []  # indices into rows
    for i in range(rows.size):
        ptr, row_changed = 0, False
        for j in range(k):
            if not need_l[i][j]:
                continue
            p_sub = cand_pl[i][ptr] if ptr < k else -math.inf
            if p_sub == -math.inf:
                break  # no cached candidate left for this token
            if _ratio(p_sub, p_sel[i][j]) >= threshold:
                pairs.append((sel_l[i][j], cand_l[i][ptr]))
                sel_l[i][j] = cand_l[i][ptr]
                ptr += 1
                row_changed = True
        if row_changed:
            changed.append(i)
    if not pairs:
        return passthrough
    hit = rows[changed]  # rows of the batch that changed
    out_ids = ids.copy()
    out_ids[hit] = np.array([sel_l[i] for i in changed], dtype=ids.dtype)
    out_w = weights
    if config.dampen:
        top = probs[hit[:, None], out_ids[hit]].astype(np.float32)
        out_w = weights.copy()
        out_w[hit] = (top / top.sum(axis=-1, keepdims=True)).astype(weights.dtype)
    return CarResult(out_ids, out_w, pairs, T * k)


def _ratio(p_sub: float, p_orig: float) -> float:
    if p_orig > 0:
        return p_sub / p_orig
    return math.inf if p_sub > 0 else math.nan  # an underflowed original: any live substitute beats it


def as_mask(cached: np.ndarray | Collection[int], n_expert: int) -> np.ndarray:
    """bool [E] from a bool mask or a collection of expert ids."""
    if isinstance(cached, np.ndarray) and cached.dtype == bool:
        if cached.shape != (n_expert,):
            raise ValueError(f"expected a cached mask of shape ({n_expert},), got {cached.shape}")
        return cached
    mask = np.zeros(n_expert, dtype=bool)
    ids = np.fromiter((int(e) for e in cached), dtype=np.int64)
    mask[ids] = True
    return mask


@dataclass
class CarStats:
    """Substitution rate: substituted slots / all routed slots seen while CAR was configured."""

    slots: int = 0
    substituted: int = 0
    per_layer: dict[int, list[int]] = field(default_factory=dict)  # layer → [slots, substituted]

    def record(self, layer: int, result: CarResult) -> None:
        n = len(result.substitutions)
        self.slots += result.n_slots
        self.substituted += n
        counts = self.per_layer.setdefault(layer, [0, 0])
        counts[0] += result.n_slots
        counts[1] += n

    @property
    def rate(self) -> float:
        return self.substituted / self.slots if self.slots else 0.0

    def line(self) -> str:
        return f"CAR: {self.substituted} of {self.slots} expert slots substituted ({100 * self.rate:.2f}%)"
