"""How many of ggml's threads a decode row's products use, when the user gave no `-t`: measured on the
products themselves, each kind on its own, and measured again now and then.

For a decode row a second thread can cost more than it saves: every barrier of the row's graphs waits
for it, and if its core is taken (or it sleeps between graphs: fomoepy.runtime.ggml_threads) each wait
is long. On the 2-core machine, idle, with sleeping threads the bench model decoded at 77 tok/s on 2
threads and 104 on 1 (bench/cpu_decode.py), while a prefill gains from both (260 against 194 tok/s)
and a large model's products on many cores gain from every thread. A single timed product at start
does not tell: one large product ran faster on 2 threads while the whole decode step, a graph of
several barriers per layer, ran slower. So the first decode rows of each kind of product (a weight's
shape, a layer's routed experts) run on 1 and on all threads in turn, and after `samples` timings of
each (the first of each count left out: it builds the graph), the kind keeps the faster. After `every`
rows on its choice the kind measures again: a daemon outlives the load it started under. The thread
count does not change a product's bits: each output element is one thread's dot product.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np

T = TypeVar("T")


class RowThreads:
    def __init__(self, threads: int, samples: int = 8, every: int = 1024):
        """every: rows a kind runs on its choice before it measures again. Measuring runs `samples` + 1
        rows on the slower count, so it costs at most (samples + 1) / every of the rows' time twice over,
        under 1 % at the defaults, and a change of load is followed within `every` rows of the kind
        (a few seconds of decoding)."""
        if threads < 2 or samples < 1 or every < 1:
            raise ValueError(f"RowThreads chooses between 1 and threads >= 2 with samples, every >= 1, got {threads}, {samples}, {every}")
        self.threads = threads
        self.samples = samples
        self.every = every
        self.chosen: dict[Hashable, int] = {}
        self._left: dict[Hashable, int] = {}  # rows each chosen kind runs before it measures again
        self._times: dict[Hashable, dict[int, list[float]]] = {}

    def run(self, kind: Hashable, product: Callable[[int], T]) -> T:
        """product(threads) on the count `kind` has settled on, or, while it measures, on the next count to
        time (the one with fewer timings: the two take turns)."""
        n = self.chosen.get(kind)
        if n is not None:
            left = self._left[kind] - 1
            if left:
                self._left[kind] = left
            else:  # the next row measures again, as the first did
                del self.chosen[kind], self._left[kind]
            return product(n)
        times = self._times.setdefault(kind, {1: [], self.threads: []})
        n = 1 if len(times[1]) <= len(times[self.threads]) else self.threads
        t = time.perf_counter()
        out = product(n)
        times[n].append(time.perf_counter() - t)
        if min(len(v) for v in times.values()) > self.samples:  # each count's first timing built its graph
            self.chosen[kind] = faster_count({c: v[1:] for c, v in times.items()})
            self._left[kind] = self.every
            del self._times[kind]
        return out


def faster_count(times: dict[int, list[float]]) -> int:
    """The thread count whose median time is the least (ties: the fewer threads)."""
    return min(times, key=lambda n: (float(np.median(times[n])), n))
