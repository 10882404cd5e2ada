"""Host-side time per MoE layer, by phase (`--profile-timing`).

Phases: `router` (cache-aware routing, next-layer prediction, the trace; the router matmul itself
counts as dense work), `plan`
(cache plan and commit, gathering host bytes, waiting for disk reads), `experts` (dequantising
misses and the expert arithmetic), and `attention+dense` (the rest of the layer: norms, the
attention or DeltaNet mixer, the shared expert). The CPU executors (cpu, reference) record the
phases. Each MoE step hands its record (fomoepy.experts.device.StepTiming) to `add_step`; on a GPU
backend its `experts` part is the host's calls that queue the copies and launches.

`MATMUL` sums the seconds inside ggml's graph computations and fomoepy's batched expert kernel
(fomoepy.runtime.batched_experts): every product of the cpu backend, dense ones too. Blocked on expert reads is the step record's `wait`.
What is left of a layer step is the host's own time: Python and numpy outside the matrix products,
the number `host` reports. (On the reference backend the products are numpy's and count as host time.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("router", "plan", "experts")


class Accumulator:
    """Seconds of one kind of work, added to by whoever does it (one thread: the inference thread)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, fn, *args):
        """fn(*args), its seconds added: `timed` for one call, without a context manager's ~1.5 µs (paid
        by every ggml graph a decode step runs, ~25 a token)."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t

    @contextmanager
    def timed(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t


MATMUL = Accumulator()  # inside ggml graph computations and the batched expert kernel


class LayerTimer:
    def __init__(self, n_layer: int, times_products: bool = True):
        """times_products: whether the backend's products are timed apart (MATMUL: the cpu backend's ggml
        graphs); elsewhere (numpy, a GPU) they are in the rest, and the host line says so."""
        self.n_layer = n_layer
        self.times_products = times_products
        self.total = [0.0] * n_layer
        self.phases: dict[str, list[float]] = defaultdict(lambda: [0.0] * n_layer)
        self.steps = [0] * n_layer
        self.matmul = [0.0] * n_layer
        self.io_wait = [0.0] * n_layer

    @contextmanager
    def layer(self, il: int) -> Iterator[None]:
        t, matmul = time.perf_counter(), MATMUL.seconds
        try:
            yield
        finally:
            self.total[il] += time.perf_counter() - t
            self.steps[il] += 1
            self.matmul[il] += MATMUL.seconds - matmul

    def add_step(self, step) -> None:
        """A MoE step's record (StepTiming): waiting for reads counts in the plan phase, where it falls."""
        il = step.layer
        self.phases["router"][il] += step.route
        self.phases["plan"][il] += step.plan + step.wait
        self.phases["experts"][il] += step.compute + step.release
        self.io_wait[il] += step.wait

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
        lines.append(self.host_line())
        return lines

    def host_seconds(self) -> tuple[float, float, float, float]:
        """Mean seconds per layer step: (total, inside matrix products, blocked on reads, the rest: host)."""
        n = max(sum(self.steps), 1)
        total, matmul, wait = sum(self.total) / n, sum(self.matmul) / n, sum(self.io_wait) / n
        return total, matmul, wait, total - matmul - wait

    def host_line(self) -> str:
        total, matmul, wait, host = self.host_seconds()
        if not self.times_products:  # (numpy's products, or a GPU's work and the host's waits for it, are in the rest)
            return (f"per layer step: {total * 1e6:.0f} µs = waiting for reads {wait * 1e6:.0f} + the rest {host * 1e6:.0f} "
                    "(compute and host work together: only the cpu backend times its products apart)")  # fmt: skip
        return (
            f"per layer step: {total * 1e6:.0f} µs = ggml products {matmul * 1e6:.0f} + waiting for reads "
            f"{wait * 1e6:.0f} + host {host * 1e6:.0f} (Python and numpy outside the products)"
        )
