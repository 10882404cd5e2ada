"""The timed null store (fomoepy.devtools.null_store.TimedNullStore): the emulated drive of
bench/plan_fidelity.py --emulated. A read lands no earlier than latency + bytes / bandwidth after it
is issued; reads in flight on one drive share its bandwidth (the n-th of a batch lands no earlier than
latency + n x bytes / bandwidth) while their latencies overlap; two drives take two at a time.

Bounds: a landing is never early (the store's own clock), and late by at most its thread's wake-up,
which the store measures (`late`), plus the test thread's own (SLACK): half of one read's 100 ms
of bytes, so that a store whose reads' bytes overlapped, or whose latencies queued, or that took a read's
time twice, is off by at least twice the slack.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from fomoepy.devtools.null_store import TimedNullStore, shape_layers
from fomoepy.experts.reads import as_landed
from fomoepy.plan.shapes import shape_by_name

LAYERS = shape_layers(shape_by_name("qwen3.5-397b-a17b"))
S = LAYERS[0].expert_nbytes
LATENCY = 0.05
BANDWIDTH = S / 0.1  # one read's bytes take 100 ms
SLACK = 0.05


def landings(store: TimedNullStore, n: int) -> list[float]:
    buf = np.zeros(S, np.uint8)
    t = time.perf_counter()
    futures = [store.submit(0, e, buf) for e in range(n)]
    return sorted(time.perf_counter() - t for _ in as_landed(futures))


@pytest.mark.parametrize("drives", [1, 2])
def test_reads_in_flight_share_a_drives_bandwidth_and_overlap_their_latency(drives):
    store = TimedNullStore(LAYERS, BANDWIDTH, LATENCY, drives)
    try:
        got = landings(store, 4)
        # drive by drive: the i-th read of a drive lands at latency + i x bytes / bandwidth
        want = sorted(LATENCY + (i // drives + 1) * S / BANDWIDTH for i in range(4))
        for g, w in zip(got, want):
            assert w <= g <= w + SLACK + store.late, (got, want)
        assert store.reads == 4
    finally:
        store.close()


def test_a_read_without_a_buffer_takes_its_time_once():
    store = TimedNullStore(LAYERS, BANDWIDTH, LATENCY)
    try:
        t = time.perf_counter()
        store.submit(0, 1).result()
        took = time.perf_counter() - t
        assert LATENCY + S / BANDWIDTH <= took <= LATENCY + S / BANDWIDTH + SLACK + store.late
        t = time.perf_counter()
        parts = store.read(0, 2)  # the synchronous read: the same time, on the caller's thread
        assert time.perf_counter() - t >= LATENCY + S / BANDWIDTH
        assert sum(p.nbytes for p in parts) == S
    finally:
        store.close()


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        TimedNullStore(LAYERS, 0.0, LATENCY)
