"""fomoepy.timing.Accumulator: what ggml's graph computations add to MATMUL."""

from __future__ import annotations

import time

import pytest

from fomoepy.timing import Accumulator


def _sleep(seconds: float, fail: bool = False) -> float:
    time.sleep(seconds)
    if fail:
        raise RuntimeError("the call failed")
    return seconds


def test_a_timed_call_returns_its_value_and_adds_its_seconds_even_when_it_raises():
    acc = Accumulator()
    assert acc.call(_sleep, 0.01) == 0.01
    first = acc.seconds
    assert first >= 0.01  # time.sleep sleeps at least as long as asked
    with pytest.raises(RuntimeError, match="the call failed"):
        acc.call(_sleep, 0.01, True)
    assert acc.seconds - first >= 0.01
    with acc.timed():  # the context manager's count, for the same kind of work
        _sleep(0.01)
    assert acc.seconds - first >= 0.02
