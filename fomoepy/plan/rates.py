"""Where a routed expert access is served from: the tier shares a projection rests on.

Three sources, and the report says which one was used:
  trace      a recorded routing trace replayed through the simulator (policy, capacities, CAR)
  given      --hit-rates DEVICE,HOST,DISK[,SUBSTITUTED] typed by the user (e.g. published figures)
  synthetic  a trace drawn for the shape from a skew and reuse fitted to recorded traces
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fomoepy.errors import FomoeError

TOLERANCE = 0.015  # published percentages are rounded; 4 of them may be off by 0.5 % each


@dataclass(frozen=True)
class TierRates:
    """Shares of expert accesses; they sum to 1. `substituted`: CAR swapped the expert for a cached
    one, which is then computed where it is cached (counted with the device tier's work)."""

    device: float
    host: float
    disk: float
    substituted: float = 0.0
    source: str = "given"  # trace | given | synthetic, with details after a colon
    # per access, device evictees a demoting policy (lfu-cooc, lfu-demote) copied down into the host tier:
    # not a tier of its own, a copy over the link that the GPU step makes before its reads (a trace's replay
    # counts them; given hit rates have none)
    demoted: float = 0.0
    # per access, reads made a step ahead (the next layer's predicted experts, right or wrong): served
    # beside the step before, so no step waits for them, but the drives read their bytes all the same (a
    # run's counts have them; a projection's own read-ahead, `prefetch`, counts its wrong guesses instead)
    ahead: float = 0.0

    def __post_init__(self) -> None:
        parts = (self.device, self.host, self.disk, self.substituted)
        if any(not 0.0 <= p <= 1.0 for p in parts):
            raise FomoeError(f"hit rates must each be in [0, 1], got {', '.join(f'{p:g}' for p in parts)}")
        if not 0.0 <= self.demoted <= 1.0:
            raise FomoeError(f"the demoted share must be in [0, 1], got {self.demoted:g}")
        if not 0.0 <= self.ahead <= 1.0:
            raise FomoeError(f"the share read ahead must be in [0, 1], got {self.ahead:g}")
        if abs(sum(parts) - 1.0) > TOLERANCE:
            raise FomoeError(f"hit rates must sum to 1 (device + host + disk + substituted), got {sum(parts):.3f}")

    @property
    def on_device(self) -> float:
        return self.device + self.substituted

    def as_dict(self) -> dict:
        return asdict(self)


def parse_hit_rates(text: str) -> TierRates:
    """'0.6,0.12,0.28' or '60,12,28' (percent) or '46,6,6,42': DEVICE,HOST,DISK[,SUBSTITUTED]."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise FomoeError(f"--hit-rates: expected DEVICE,HOST,DISK[,SUBSTITUTED] numbers, got {text!r}") from None
    if len(values) not in (3, 4):
        raise FomoeError(f"--hit-rates: expected 3 or 4 comma-separated numbers, got {len(values)}")
    if sum(values) > 1.0 + TOLERANCE:  # percentages
        values = [v / 100.0 for v in values]
    return TierRates(*values, source="given: --hit-rates " + text)
