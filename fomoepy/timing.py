"""Host-side time per MoE layer, by phase (`--profile-timing`).

Phases: `router` (cache-aware routing, next-layer prediction, the trace; the router matmul itself
counts as dense work), `plan`
(cache plan and commit, gathering host bytes, waiting for disk reads), `experts` (dequantising
misses and the expert arithmetic), and `attention+dense` (the rest of the layer: norms, the
attention or DeltaNet mixer, the shared expert). The CPU executors (cpu, reference) record the
phases; the GPU executor records none yet (its work is asynchronous: host time would say little).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("router", "plan", "experts")


class LayerTimer:
    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.total = [0.0] * n_layer
        self.phases: dict[str, list[float]] = defaultdict(lambda: [0.0] * n_layer)
        self.steps = [0] * n_layer

    @contextmanager
    def layer(self, il: int) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.total[il] += time.perf_counter() - t
            self.steps[il] += 1

    def add(self, phase: str, il: int, seconds: float) -> None:
        self.phases[phase][il] += seconds

    def report(self) -> list[str]:
        """Mean microseconds per layer step, per layer and over all layers."""
        lines = [f"{'layer':>5} {'steps':>6} {'total µs':>10} " + " ".join(f"{p:>10}" for p in (*PHASES, "attn+dense"))]
        sums = defaultdict(float)
        n_steps = 0
        for il in range(self.n_layer):
            n = max(self.steps[il], 1)
            parts = [self.phases[p][il] for p in PHASES]
            rest = self.total[il] - sum(parts)
            row = [self.total[il], *parts, rest]
            lines.append(f"{il:>5} {self.steps[il]:>6} " + " ".join(f"{v / n * 1e6:>10.1f}" for v in row))
            for name, v in zip(("total", *PHASES, "attn+dense"), row):
                sums[name] += v
            n_steps += self.steps[il]
        n = max(n_steps, 1)
        lines.append(f"{'all':>5} {n_steps:>6} " + " ".join(f"{sums[k] / n * 1e6:>10.1f}" for k in ("total", *PHASES, "attn+dense")))
        return lines
