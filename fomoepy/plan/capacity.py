"""How much of each tier is left for routed experts once the resident weights are placed."""

from __future__ import annotations

from dataclasses import dataclass

from fomoepy.plan.hardware import Hardware
from fomoepy.plan.shapes import ModelBytes

GIB = 1 << 30
# Stated, not measured: per GPU, KV cache + activations + kernel workspace at a few thousand tokens of
# context; on the host, the OS, the process and page cache the store's reads need.
DEVICE_RESERVE = 1 * GIB
HOST_RESERVE = 4 * GIB


@dataclass(frozen=True)
class Capacity:
    device: int  # bytes of routed experts the device tier holds (all GPUs together)
    host: int

    def shares(self, m: ModelBytes) -> tuple[float, float]:
        """Fractions of the whole store: what a trace from another model is replayed at."""
        return min(1.0, self.device / m.store_bytes), min(1.0, self.host / m.store_bytes)


def capacity_for(m: ModelBytes, hw: Hardware) -> Capacity:
    """GPU: VRAM minus the resident weights and a reserve per device; DRAM minus a reserve.
    CPU only: RAM minus the resident weights is the one tier, counted as the compute device's."""
    def fit(n: int) -> int:  # a tier larger than the store holds the store
        return max(0, min(n, m.store_bytes))

    if hw.device.count:
        device = hw.device.count * (hw.device.memory - DEVICE_RESERVE) - m.resident_bytes
        return Capacity(fit(device), fit(hw.host.memory - HOST_RESERVE))
    return Capacity(fit(hw.host.memory - HOST_RESERVE - m.resident_bytes), 0)
