"""Next-token sampling: greedy, or a seeded chain of repetition penalty → top-k → top-p → min-p → temperature.

The chain order is llama.cpp's default sampler order, so the same settings mean the same thing in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fomoepy.errors import FomoeError

GREEDY_BELOW = 1e-6  # a temperature under this samples like temperature 0 (argmax)
MAX_PENALTY = 1e6  # repeat_penalty range [1/MAX_PENALTY, MAX_PENALTY]


@dataclass(frozen=True)
class SamplingParams:
    """Each value has a range, and each range's edge a meaning, so that no value the protocol accepts can
    make a logit infinite or a probability NaN (sampling works in float64; logits are below ~1e4):

    temperature     finite, >= 0; below GREEDY_BELOW it is greedy (z / 1e-6 stays finite, but the
                    distribution is argmax's already)
    top_k           >= 0 (0: off)
    top_p           (0, 1] (1: off)
    min_p           [0, 1] (0: off)
    repeat_penalty  [1e-6, 1e6] (1: off): z / 1e-6 and z · 1e6 stay far inside float64
    repeat_last_n   >= 0
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (1 / MAX_PENALTY <= self.repeat_penalty <= MAX_PENALTY, f"repeat_penalty must be in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise FomoeError(f"bad sampling parameter: {message}, got {self._value_of(message)!r}")

    def _value_of(self, message: str) -> object:
        return getattr(self, message.split(" ", 1)[0])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def greedy(cls) -> SamplingParams:
        return cls(temperature=0.0)


class Sampler:
    """Stateful only through its random generator: same seed, same logits → same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        z = np.asarray(logits, dtype=np.float64).copy()  # [V]
        # NaN would sort anywhere and leave no candidate to sample, +inf turns the softmax into NaN: the max
        # is NaN or +inf exactly then (numpy's max propagates NaN), in half isfinite().all()'s time (-inf
        # alone masks a token, which sampling itself does; all of them, the max is -inf too)
        if not math.isfinite(z.max()):
            raise FomoeError(f"the model produced non-finite logits{_at_position(history)} (NaN or infinite: damaged weights?)")
        if p.repeat_penalty != 1.0 and p.repeat_last_n and len(history):
            recent = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            # llama.cpp: divide positive logits, multiply negative ones, so the penalty always lowers them
            z[recent] = np.where(z[recent] > 0, z[recent] / p.repeat_penalty, z[recent] * p.repeat_penalty)
        if p.is_greedy:
            return int(np.argmax(z))

        order = np.argsort(-z, kind="stable")  # candidates, best first
        if p.top_k:
            order = order[: p.top_k]
        probs = _softmax(z[order])
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order = order[:keep]
            probs = probs[:keep]
        if p.min_p > 0.0:
            keep_mask = probs >= p.min_p * probs[0]
            order = order[keep_mask]
        probs = _softmax(z[order] / p.temperature)
        return int(order[self.rng.choice(len(order), p=probs)])


def _at_position(history: Sequence[int]) -> str:
    # the logits predict the token after the last one seen: theirs is that token's position
    return f" at position {len(history) - 1}" if len(history) else ""


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()
