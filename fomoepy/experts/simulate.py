"""Replay a routing trace against the two-tier expert cache and compare with Belady's optimum.

Each trace record (one step of one MoE layer; a joint prefill's records of one layer, one per prompt,
joined back into its step) is one `ExpertCache.access` of the union of its tokens' experts, exactly as
the engine plans it; logical time is the record's token index. The
same flattened access sequence (each record's distinct experts, ascending) is what Belady sees:

    device  hit rate over all accesses      vs  Belady at the VRAM capacity
    memory  served without a disk read      vs  Belady at VRAM + DRAM capacity (an upper bound for
            (device or host)                    any two tiers of that total size, which together
                                                admit only on a disk read)

With cache-aware routing replayed (the trace must hold full probabilities) the access sequence is
the substituted one; Belady stays on the exact one, and the substitution rate is reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.belady import BeladyResult, belady
from fomoepy.experts.car import CarConfig, CarStats, cache_aware_route
from fomoepy.experts.fast_cache import make_cache
from fomoepy.experts.policy import DEFAULT_POLICY, Key, PolicyOptions, make_policy
from fomoepy.experts.read_ahead import ReadAheadCounts
from fomoepy.experts.sizes import format_size
from fomoepy.experts.trace import Trace, TraceRecord


@dataclass(frozen=True)
class SimResult:
    policy: str
    device_bytes: int
    host_bytes: int
    summary: dict  # CacheStats.summary()
    car: CarStats | None
    seeded: tuple[tuple[Key, ...], tuple[Key, ...]] = ((), ())  # what start-up put in device, host
    # the next layer's guesses a replay of a trace with predictions would read (issued, used, wasted and by
    # position in the reading order; none lands late or is skipped here: a replay has no clock)
    ahead: ReadAheadCounts | None = None

    @property
    def device_hit_rate(self) -> float:
        return self.summary["device"]["hit_rate"]

    @property
    def memory_hit_rate(self) -> float:
        n = self.summary["accesses"]
        return 1.0 - self.summary["disk"]["reads"] / n if n else 0.0


def access_sequence(trace: Trace) -> list[Key]:
    """Every (layer, expert) access in replay order: per step, its distinct experts ascending."""
    return [(r.layer, int(e)) for r in steps_of(trace.records) for e in np.unique(r.ids)]


def steps_of(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """The records as the engine's steps: a joint prefill records each prompt's rows of a layer apart,
    one after another at the same logical time, where the engine planned and read them as one step; those
    are joined back into one record (rows in order)."""
    out: list[TraceRecord] = []
    for r in records:
        last = out[-1] if out else None
        if last is not None and last.layer == r.layer and _now(last) == _now(r):
            out[-1] = _joined(last, r)
        else:
            out.append(r)
    return out


def _now(r: TraceRecord) -> int:
    return r.token if r.now is None else r.now


def _joined(a: TraceRecord, b: TraceRecord) -> TraceRecord:
    def both(x, y):
        return None if x is None or y is None else np.concatenate([x, y])

    return replace(a, ids=np.concatenate([a.ids, b.ids]), scores=np.concatenate([a.scores, b.scores]), probs=both(a.probs, b.probs),
                   sequences=both(a.sequences, b.sequences), now=_now(a))  # fmt: skip


def belady_for(
    trace: Trace, expert_bytes: Sequence[int], capacity: int, initial: Iterable[Key] = ()
) -> BeladyResult:
    """Belady at `capacity` bytes over the trace's exact accesses, starting with `initial` resident."""
    return belady(access_sequence(trace), lambda key: expert_bytes[key[0]], capacity, initial)


def fewest_reads(trace: Trace, expert_bytes: Sequence[int], capacity: int, tokens: range | None = None) -> int:
    """The fewest bytes any cache of `capacity` bytes must read over the steps of the trace whose records
    start at a token in `tokens` (all where None): Belady, from the best contents to start with (the
    experts first used soonest, as many as fit, so no miss is only the cold start's). No policy's tiers
    of that total size read less over those steps, whatever they held when the steps began: a floor under
    a run's reads (bench/batch.py's, where it is what batching must lower)."""
    records = [r for r in trace.records if tokens is None or r.token in tokens]
    seq = access_sequence(replace(trace, records=tuple(records)))
    first_used = list(dict.fromkeys(seq))
    best = belady(seq, lambda key: expert_bytes[key[0]], capacity, first_used)
    return sum(expert_bytes[layer] for layer, _ in seq) - best.hit_bytes


def simulate(
    trace: Trace,
    expert_bytes: Sequence[int],
    device_bytes: int,
    host_bytes: int,
    policy: str = DEFAULT_POLICY,
    *,
    half_life_tokens: float = 256.0,
    seed: Iterable[Key] = (),
    pin_fraction: float = 0.0,
    car: CarConfig | None = None,
    device_expert_bytes: Sequence[int] | None = None,
) -> SimResult:
    """Replay trace; `seed` (e.g. profile.seed_order) fills VRAM then DRAM first, and with a
    `*-pinned` policy the seeded keys filling the first `pin_fraction` of each tier are pinned.
    `device_expert_bytes`: one expert's size in the device tier's form, when it is not the store's (the
    CPU backend's compute-ready float32). The engine's reads made ahead are not admitted early: the cache
    counts them as the disk reads they are (fomoepy.experts.read_ahead). Where the trace's records carry
    the predictions made for them, `ahead` counts the guesses the engine reads: a step's prediction of the
    next layer, less what either tier holds at that step (before its own access, as the engine queues its
    guesses once its reads are issued, before its plan), in the predictor's order."""
    header = trace.header
    seed = list(seed)
    cache = make_cache(
        header.n_expert,
        expert_bytes,
        device_bytes,
        host_bytes,
        device_policy=make_policy(policy, PolicyOptions(half_life_tokens)),
        host_policy=make_policy(policy, PolicyOptions(half_life_tokens)),
        device_expert_bytes=device_expert_bytes,
    )
    seeded = cache.seed(seed, pin_fraction)  # the same seeding and pinning as the engine's
    car_stats = CarStats() if car is not None and car.enabled else None
    if car_stats is not None and not trace.has_probs:
        raise FomoeError("replaying cache-aware routing needs a trace recorded with full probabilities")
    records = steps_of(trace.records)
    ahead = ReadAheadCounts() if any(r.predicted is not None for r in records) else None
    guessed: list[int] = []  # the guesses read for this record, made during the record before it
    for i, record in enumerate(records):
        cache.tick(max(0, (record.token if record.now is None else record.now) - cache.now))
        after = records[i + 1] if i + 1 < len(records) else None
        reading = []
        if ahead is not None and after is not None and after.predicted is not None and after.layer == record.layer + 1:
            reading = cache.uncached(after.layer, after.predicted.tolist())
        ids = record.ids
        if car_stats is not None:
            weights = record.scores / record.scores.sum(axis=-1, keepdims=True)
            result = cache_aware_route(
                ids,
                weights,
                record.probs,  # type: ignore[arg-type]
                cache.cached_mask(record.layer),
                car,  # type: ignore[arg-type]
                layer=record.layer,
                n_layer=header.n_layer,
                first_token=record.token,
            )
            car_stats.record(record.layer, result)
            ids = result.ids
        cache.access(record.layer, ids, record.sequences)
        if guessed:
            taken = set(np.asarray(ids).ravel().tolist())
            for at, expert in enumerate(guessed):
                ahead.count_read(at, expert in taken)  # type: ignore[union-attr]
        guessed = reading
    if ahead is not None:  # (the totals are the positions' sums)
        ahead.issued, ahead.used = sum(ahead.read_at), sum(ahead.used_at)
        ahead.wasted = ahead.issued - ahead.used
    return SimResult(
        policy, device_bytes, host_bytes, cache.stats.summary(), car_stats, (tuple(seeded[0]), tuple(seeded[1])), ahead
    )


def report(trace: Trace, expert_bytes: Sequence[int], results: Sequence[SimResult]) -> str:
    """The table `fomoe simulate` prints: per policy and tier, hit rate next to Belady's."""
    if not results:
        return ""
    vram, ram = results[0].device_bytes, results[0].host_bytes
    n = len(access_sequence(trace))
    # the seed is the same for every policy; Belady starts from it too, so it stays a bound
    dev_seed, host_seed = results[0].seeded
    best_device = belady_for(trace, expert_bytes, vram, dev_seed).hit_rate if vram else 0.0
    best_memory = belady_for(trace, expert_bytes, vram + ram, dev_seed + host_seed).hit_rate if vram + ram else 0.0
    h = trace.header
    lines = [
        (
            f"trace: {trace.n_tokens} tokens, {h.n_layer} layers x {h.n_expert} experts (top-{h.n_expert_used}), "
            f"{n} expert accesses{' (truncated tail dropped)' if trace.truncated else ''}"
        ),
        f"capacity: device {format_size(vram)}, host {format_size(ram)}",
        (
            f"{'policy':<18} {'device hit':>10} {'belady':>8} {'memory hit':>11} {'belady':>8} "
            f"{'disk reads':>11} {'read':>10}"
        ),
    ]
    for r in results:
        disk = r.summary["disk"]
        lines.append(
            f"{r.policy:<18} {100 * r.device_hit_rate:>9.2f}% {100 * best_device:>7.2f}% "
            f"{100 * r.memory_hit_rate:>10.2f}% {100 * best_memory:>7.2f}% "
            f"{disk['reads']:>11} {format_size(disk['read_bytes']):>10}"
        )
        if r.car is not None:
            lines.append(f"{'':<18} {r.car.line()} (belady columns: the exact routing)")
    lines.append("memory = device or host; belady for memory uses device + host capacity")
    if len(set(expert_bytes)) > 1:
        lines.append("expert sizes differ across layers: belady is the furthest-next-use heuristic, not a bound")
    return "\n".join(lines)
