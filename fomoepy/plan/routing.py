"""Tier shares from routing: a recorded trace replayed through the simulator, or a synthetic trace
for the shape whose skew and reuse were fitted to recorded traces.

A trace recorded on one model can stand in for another only through shares: the capacities are
given to the simulator as the same fraction of the trace model's expert bytes as they are of the
projected model's store. The report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.cache import PIN_FRACTION
from fomoepy.experts.car import CarConfig
from fomoepy.experts.read_ahead import ReadAheadCounts
from fomoepy.experts.simulate import SimResult, simulate
from fomoepy.experts.trace import (
    Trace,
    TraceHeader,
    TraceRecord,
    expert_sizes,
    read_trace,
)
from fomoepy.plan.rates import TierRates


def rates_of(result: SimResult, source: str) -> TierRates:
    """Simulator counts -> shares. A substituted slot was served by a cached expert: it leaves the
    device share (where the simulator counted its hit) for the substituted share."""
    s = result.summary
    n = s["accesses"]
    if not n:
        raise FomoeError("the trace holds no expert accesses")
    device, host, disk = s["device"]["hits"] / n, s["host"]["hits"] / n, s["disk"]["reads"] / n
    sub = result.car.rate if result.car is not None else 0.0
    sub = min(sub, device)
    return TierRates(device - sub, host, disk, sub, source=source, demoted=s["host"]["demoted"] / n)


def rates_from_trace(
    trace: Trace,
    device_share: float,
    host_share: float,
    policy: str,
    car_threshold: float | None = None,
    seed: list | None = None,
) -> TierRates:
    """Replay `trace` with the tiers holding these shares of its experts' bytes."""
    sizes = expert_sizes(trace.header) if trace.header.expert_bytes else (1 << 20,) * trace.header.n_layer
    total = sum(sizes) * trace.header.n_expert
    car = CarConfig(threshold=car_threshold) if car_threshold is not None else None
    result = simulate(
        trace, sizes, int(device_share * total), int(host_share * total), policy, seed=seed or (), car=car,
        pin_fraction=PIN_FRACTION if seed else 0.0,  # as the engine and `fomoe simulate` do
    )
    what = "synthetic" if not trace.path else f"trace {trace.path}"
    car_text = f", CAR {car_threshold}" if car_threshold is not None else ""
    return rates_of(
        result,
        f"{what}: {trace.n_tokens} tokens, {policy}{car_text}, tiers at "
        f"{100 * device_share:.1f}% + {100 * host_share:.1f}% of the experts",
    )


@dataclass(frozen=True)
class ReadAheadReplay:
    """What the engine's reads a layer ahead would do, from a trace's recorded predictions replayed
    through the tiers: of a step's misses, the share read ahead by a right guess; the wrong guesses read
    per miss; and the share of right guesses along the reading order (the guesses no tier holds, most
    confident first)."""

    share: float
    wrong: float
    along: tuple[float, ...]
    memory: float  # the share of accesses the replay's tiers served (device or host)
    tiers: float  # the tiers' size in the replay, a share of the trace's expert bytes
    predictions: int
    path: str

    @property
    def right(self) -> float:
        """Of the guesses read, the share their step then read from disk (what the engine's gate judges):
        right ones per miss over all read per miss."""
        return self.share / (self.share + self.wrong) if self.share + self.wrong else 0.0

    def line(self) -> str:
        along = ", ".join(f"{100 * a:.0f}" for a in self.along)
        return (f"the engine's next-layer predictions in {Path(self.path).name or 'the trace'} ({self.predictions} "
                f"guesses) replayed through tiers of {100 * self.tiers:.1f} % of its experts, serving "
                f"{100 * self.memory:.1f} % of accesses: the guesses no tier holds are right {along} % along the "
                f"order they are read in ({100 * self.right:.0f} % of them all), {self.wrong:.2f} wrong ones read a miss")  # fmt: skip


# the replay's tiers are sized until they serve the projection's share of accesses this closely: half the
# rounding of hit rates given in whole percents
MEMORY_MATCH = 0.005


def read_ahead_from_trace(trace: Trace, memory: float, device_fraction: float, policy: str) -> ReadAheadReplay:
    """Replay `trace`'s predictions with the tiers sized (device `device_fraction` of them) to serve
    `memory` of its accesses, as the projected tiers do: which guesses are read is what neither tier holds,
    so the reading order's accuracy depends on how much the tiers hold, not on how big they are. The tiers'
    size is found by bisection (a replay of a few thousand steps takes some 20 ms)."""
    sizes = expert_sizes(trace.header) if trace.header.expert_bytes else (1 << 20,) * trace.header.n_layer
    total = sum(sizes) * trace.header.n_expert

    def replay(tiers: float):
        device = int(tiers * device_fraction * total)
        return simulate(trace, sizes, device, int(tiers * total) - device, policy)

    low, high = 0.0, 1.0
    result = replay(0.0)
    for _ in range(20):  # the tiers' size to 2^-20 of the trace's experts: finer than one expert
        if abs(result.memory_hit_rate - memory) <= MEMORY_MATCH:
            break
        tiers = (low + high) / 2
        result = replay(tiers)
        low, high = (tiers, high) if result.memory_hit_rate < memory else (low, tiers)
    ahead: ReadAheadCounts | None = result.ahead
    if ahead is None:
        raise FomoeError(f"{trace.path or 'the trace'} records no predictions to replay")
    disk = result.summary["disk"]["reads"]
    tiers = (result.device_bytes + result.host_bytes) / total
    predicted = sum(len(r.predicted) for r in trace.records if r.predicted is not None)
    return ReadAheadReplay(ahead.used / disk if disk else 0.0, ahead.wasted / disk if disk else 0.0,
                           ahead.along_reading_order(), result.memory_hit_rate, tiers, predicted, trace.path)  # fmt: skip


@dataclass(frozen=True)
class RoutingFit:
    """Zipf exponent of per-layer expert popularity, and the share of a token's experts kept from the
    previous token beyond what popularity alone repeats."""

    skew: float
    reuse: float
    sources: tuple[str, ...] = ()

    def line(self) -> str:
        where = ", ".join(self.sources) or "stated"
        return f"synthetic routing: popularity ~ rank^-{self.skew:.3f}, extra reuse {self.reuse:.3f} (fitted to {where})"


def _counts(trace: Trace) -> np.ndarray:
    h = trace.header
    counts = np.zeros((h.n_layer, h.n_expert))
    for r in trace.records:
        np.add.at(counts[r.layer], r.ids.ravel(), 1)
    return counts


def _zipf_slope(counts: np.ndarray) -> float:
    """Least-squares slope of log count against log rank, averaged over layers."""
    slopes = []
    for row in counts:
        c = np.sort(row[row > 0])[::-1]
        if len(c) >= 3:
            slopes.append(-np.polyfit(np.log(np.arange(1, len(c) + 1)), np.log(c), 1)[0])
    if not slopes:
        raise FomoeError("a trace needs at least 3 distinct experts per layer to fit its skew")
    return float(np.mean(slopes))


def _reuse(trace: Trace) -> float:
    """Share of a decode token's experts (per layer) that the previous token also used there."""
    last: dict[int, set] = {}
    kept = total = 0
    for r in trace.records:
        if r.n_tokens != 1:
            last.pop(r.layer, None)  # a prefill step has no single previous token
            continue
        ids = set(int(e) for e in r.ids[0])
        if r.layer in last:
            kept += len(ids & last[r.layer])
            total += len(ids)
        last[r.layer] = ids
    return kept / total if total else 0.0


def fit_routing(traces: list[Trace]) -> RoutingFit:
    """Skew from the popularity curve; reuse as the excess over a skew-only trace of the same shape."""
    skew = float(np.mean([_zipf_slope(_counts(t)) for t in traces]))
    measured = float(np.mean([_reuse(t) for t in traces]))
    h = traces[0].header
    base = _reuse(synthetic_trace(h.n_layer, h.n_expert, h.n_expert_used, 256, RoutingFit(skew, 0.0), 1 << 20))
    extra = max(0.0, (measured - base) / (1 - base)) if base < 1 else 0.0
    return RoutingFit(skew, extra, tuple(t.path or "trace" for t in traces))


def synthetic_trace(
    n_layer: int, n_expert: int, k: int, n_tokens: int, fit: RoutingFit, expert_bytes: int, seed: int = 0
) -> Trace:
    """Decode-only trace: each layer has its own random popularity order; a token keeps each of the
    previous token's experts with probability `reuse`, and draws the rest by popularity."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, n_expert + 1, dtype=np.float64) ** -fit.skew
    p /= p.sum()
    order = [rng.permutation(n_expert) for _ in range(n_layer)]
    prev: list[np.ndarray | None] = [None] * n_layer
    records = []
    for t in range(n_tokens):
        for layer in range(n_layer):
            keep = [] if prev[layer] is None else [e for e in prev[layer] if rng.random() < fit.reuse]
            w = p.copy()
            w[keep] = 0.0  # ranks; order[layer] maps rank -> expert id
            need = k - len(keep)
            fresh = rng.choice(n_expert, size=need, replace=False, p=w / w.sum()) if need else []
            ranks = np.array(list(keep) + list(fresh), dtype=np.int64)
            prev[layer] = ranks
            ids = order[layer][ranks][None, :]
            records.append(TraceRecord(t, layer, ids, np.full((1, k), 1.0 / k, np.float32), None))
    header = TraceHeader(n_layer, n_expert, k, (expert_bytes,) * n_layer, "synthetic")
    return Trace(header, tuple(records))


def popularity_seed(trace: Trace) -> list[tuple[int, int]]:
    """Most used (layer, expert) first: what a .freq profile of this routing would seed the tiers with."""
    counts = _counts(trace)
    flat = np.argsort(-counts, axis=None, kind="stable")
    n_expert = trace.header.n_expert
    return [(int(i // n_expert), int(i % n_expert)) for i in flat]


def load_traces(paths: list[str]) -> list[Trace]:
    return [read_trace(p) for p in paths]
