"""Routing from a synthetic decode trace, for the benches that run the engine's MoE step on a null device
(bench/host_time.py, bench/plan_fidelity_emulated.py).

The trace is fitted to the demo model's (fomoepy.plan.routing), at the shape being measured. The device's
`route_many` (or, for a decode step routed in C, `compiled_route`'s launches and `read_routings`) still
makes its launches and its one read-back; what it returns is the trace's choice (a
null device computes nothing): for each MoE layer step, the step's own routing and the prediction of the
next layer's, which gets `accuracy` of that layer's experts right (at every rank alike, or rank by rank:
the demo model's, `demo_accuracy_by_rank`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fomoepy.experts.routing import Routing
from fomoepy.plan.routing import RoutingFit, fit_routing, load_traces, synthetic_trace

DEMO_TRACE = Path(__file__).resolve().parents[1] / "fomoepy" / "plan" / "traces" / "demo-qwen3moe.trace"
PREDICT_ACCURACY = 0.8  # share of the next layer's experts a prediction gets right (the demo model: 0.63-0.85)
DEMO_PREDICTIONS = Path(__file__).resolve().parents[1] / "fomoepy" / "plan" / "traces" / "demo-predictions.trace"


def demo_accuracy_by_rank(k: int) -> list[float]:
    """The demo model's measured next-layer prediction accuracy at each of k ranks (most confident first):
    its trace's ranks spread evenly over k (rank r takes the trace's rank r x n / k)."""
    measured = load_traces([str(DEMO_PREDICTIONS)])[0].prediction_accuracy_by_rank()
    return [measured[r * len(measured) // k] for r in range(k)]


class TraceRouting:
    def __init__(self, dev, n_layer: int, n_expert: int, k: int, n_tokens: int, expert_nbytes: int,
                 accuracy: float | list[float] = PREDICT_ACCURACY):  # fmt: skip
        """`accuracy`: one share for every rank, or one per rank (most confident first)."""
        fit = fit_routing(load_traces([str(DEMO_TRACE)]))
        trace = synthetic_trace(n_layer, n_expert, k, n_tokens + 1, RoutingFit(fit.skew, fit.reuse), expert_nbytes)
        self.ids = np.array([r.ids[0] for r in trace.records]).reshape(n_tokens + 1, n_layer, k)
        self.n_layer, self.n_expert, self.k, self.accuracy = n_layer, n_expert, k, accuracy
        self.rng = np.random.default_rng(1)
        # predictions made and right at each rank (most confident first, the order the engine reads them in)
        self.predicted, self.right_by_rank = 0, np.zeros(k, np.int64)
        self.weights = np.full((1, k), 1.0 / k, np.float32)
        self.probs = np.full((1, n_expert), 1.0 / n_expert, np.float32)
        self._answers: list[Routing] = []
        real_route_many, real_read_routings = dev.route_many, dev.read_routings

        def route_many(requests):
            real_route_many(requests)
            return [self._answers.pop() for _ in requests]

        def read_routings(total, shapes):  # (a decode step's compiled routing: GpuBackend.compiled_route)
            real_read_routings(total, shapes)
            return [self._answers.pop() for _ in shapes]

        dev.route_many, dev.read_routings = route_many, read_routings

    def queue(self, t: int, il: int) -> None:
        """What the device answers for token t's step of layer il: its routing, then (before the last layer)
        the next layer's prediction."""
        ids = self.ids
        if il + 1 < self.n_layer:
            guess = ids[t, il + 1].copy()
            wrong = self.rng.random(self.k) > np.asarray(self.accuracy)
            others = np.setdiff1d(np.arange(self.n_expert), ids[t, il + 1])
            guess[wrong] = self.rng.choice(others, int(wrong.sum()), replace=False)
            self.predicted += 1
            self.right_by_rank += ~wrong
            self._answers.append(Routing(guess[None, :], self.weights, self.probs))
        self._answers.append(Routing(ids[t, il][None, :], self.weights, self.probs))

    def accuracy_by_rank(self) -> list[float]:
        """The share of predictions right at each rank, over those made so far."""
        return (self.right_by_rank / max(1, self.predicted)).tolist()
