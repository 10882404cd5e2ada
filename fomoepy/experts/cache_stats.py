"""Counters of the expert cache, per tier and per layer, and how they are reported.

Each expert a plan uses is one access, served from exactly one place:

    accesses    = device.hits + host.hits + disk.reads
    device      (when on)  hits + misses = accesses
    host        (when on)  hits + misses = device.misses, or accesses when the device tier is off
    disk.reads  = host.misses when the host tier is on, else every access the device did not serve

A tier that is off counts nothing. Bytes follow the same sums.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fomoepy.experts.sizes import format_size


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    admitted: int = 0
    admitted_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    demoted: int = 0  # host tier: experts taken from the device tier's evictions (no disk read)
    demoted_bytes: int = 0

    def add(self, other: TierCounters) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


@dataclass
class DiskCounters:
    reads: int = 0
    read_bytes: int = 0

    def add(self, other: DiskCounters) -> None:
        self.reads += other.reads
        self.read_bytes += other.read_bytes


class CacheStats:
    """Per-layer counters for the device tier, the host tier and the disk; totals on demand."""

    def __init__(self, n_layer: int, device_on: bool, host_on: bool):
        self.n_layer = n_layer
        self.device_on = device_on
        self.host_on = host_on
        self.device = [TierCounters() for _ in range(n_layer)]
        self.host = [TierCounters() for _ in range(n_layer)]
        self.disk = [DiskCounters() for _ in range(n_layer)]

    def total(self, tier: str) -> TierCounters:
        out = TierCounters()
        for c in getattr(self, tier):
            out.add(c)
        return out

    def total_disk(self) -> DiskCounters:
        out = DiskCounters()
        for c in self.disk:
            out.add(c)
        return out

    def accesses(self, layer: int | None = None) -> int:
        layers = range(self.n_layer) if layer is None else (layer,)
        return sum(self.device[i].hits + self.host[i].hits + self.disk[i].reads for i in layers)

    def summary(self) -> dict:
        """Plain numbers (JSON-ready): totals, then one entry per layer that saw any access."""
        return {
            **self._summary_of(self.total("device"), self.total("host"), self.total_disk()),
            "layers": {
                layer: self._summary_of(self.device[layer], self.host[layer], self.disk[layer])
                for layer in range(self.n_layer)
                if self.accesses(layer)
            },
        }

    def _summary_of(self, device: TierCounters, host: TierCounters, disk: DiskCounters) -> dict:
        accesses = device.hits + host.hits + disk.reads
        return {
            "accesses": accesses,
            "accessed_bytes": device.hit_bytes + host.hit_bytes + disk.read_bytes,
            "device": {**asdict(device), "hit_rate": device.hit_rate, "enabled": self.device_on},
            "host": {**asdict(host), "hit_rate": host.hit_rate, "enabled": self.host_on},
            "disk": {**asdict(disk), "rate": disk.reads / accesses if accesses else 0.0},
        }

    def line(self) -> str:
        """One line for humans, e.g. 'experts: 6000 uses; device 61.2% hit, host 25.0% hit, disk 13.8% ...'."""
        s = self.summary()
        parts = [f"experts: {s['accesses']} uses"]
        for tier in ("device", "host"):
            parts.append(f"{tier} {100 * s[tier]['hit_rate']:.1f}% hit" if s[tier]["enabled"] else f"{tier} off")
        disk = s["disk"]
        parts.append(f"disk {100 * disk['rate']:.1f}% ({disk['reads']} reads, {format_size(disk['read_bytes'])})")
        return parts[0] + "; " + ", ".join(parts[1:])

    def __str__(self) -> str:
        return self.line()
