"""An expert store of a model that is not here: every read completes at once and carries no bytes.

For measuring the host's own time per MoE layer step at a real model's shape (bench/host_time.py):
the layers have the true byte sizes of every expert (from fomoepy.plan.shapes and the quant table), so
every tier's bookkeeping, every plan and every copy the device is asked for are the real ones, while a
read costs nothing: each expert's parts are views of one shared zero buffer per layer shape.
TimedNullStore's reads instead take the time stated drives would (bench/plan_fidelity.py --emulated).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import numpy as np

from fomoepy.experts.read_ahead import DEPTH_PER_DRIVE
from fomoepy.experts.reads import Read
from fomoepy.experts.source import ExpertMatrix, LayerExperts
from fomoepy.plan.shapes import MIXES, ModelShape
from fomoepy.quants import row_nbytes


def shape_layers(shape: ModelShape, mix_name: str | None = None) -> tuple[LayerExperts, ...]:
    """The expert layout of every layer of `shape` at a quant mix (gate, up: [ff, n_embd]; down: [n_embd, ff])."""
    mix = MIXES[mix_name or shape.default_mix]
    e, f = shape.n_embd, shape.expert_ff
    layers = []
    for il in range(shape.n_layer):
        parts = tuple(
            ExpertMatrix(f"blk.{il}.{name}.weight", qtype, (rows, cols), rows * row_nbytes(qtype, cols), 0)
            for name, qtype, rows, cols in (
                ("ffn_gate_exps", mix.expert_gate_up, f, e),
                ("ffn_up_exps", mix.expert_gate_up, f, e),
                ("ffn_down_exps", mix.expert_down, e, f),
            )
        )
        layers.append(LayerExperts(il, parts))  # type: ignore[arg-type]
    return tuple(layers)


class NullStore:
    """`read` and `submit` of an expert store (fomoepy.experts.store_reader.ExpertStore) that do no I/O."""

    def __init__(self, layers: tuple[LayerExperts, ...]):
        self.layers = layers
        self._parts: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
        self._bounds = [(g.nbytes, g.nbytes + u.nbytes) for g, u, _ in (layer.parts for layer in layers)]  # parts' ends
        self.reads = 0

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.reads += 1
        sizes = tuple(p.nbytes for p in self.layers[layer].parts)
        parts = self._parts.get(sizes)
        if parts is None:
            block = np.zeros(sum(sizes), np.uint8)
            bounds = np.cumsum((0,) + sizes)
            parts = self._parts[sizes] = tuple(block[a:b] for a, b in zip(bounds, bounds[1:]))
        return parts  # type: ignore[return-value]

    def slot_nbytes(self, layer: int) -> int:
        return self.layers[layer].expert_nbytes

    def submit(self, layer: int, expert: int, out: np.ndarray | None = None) -> Read:
        """A read into `out` (views of it, its bytes untouched) or into the shared buffer, landed as it is
        made (as the store's Read, fomoepy.experts.reads)."""
        if out is None:
            return Read.landed(self.read(layer, expert))
        self.reads += 1
        a, b = self._bounds[layer]
        return Read.landed((out[:a], out[a:b], out[b : b + self.layers[layer].parts[2].nbytes]))


SPIN = 0.1e-3  # seconds before a read lands that the completing thread stops sleeping and spins


class TimedNullStore(NullStore):
    """A null store whose reads take a stated drive's time: each read lands `latency` after it is issued
    at the earliest, and the bytes of the reads on one drive cross one after another at `bandwidth`, so
    many reads in flight share a drive's bandwidth while their latencies overlap:

        lands = max(issued + latency, the drive's previous read landed) + bytes / bandwidth

    A read goes to the drive free soonest (the store stripes experts across its drives). A thread
    completes each read's future when its time comes."""

    def __init__(self, layers: tuple[LayerExperts, ...], bandwidth: float, latency: float, drives: int = 1):
        if bandwidth <= 0 or latency < 0 or drives < 1:
            raise ValueError(f"a timed null store needs bandwidth > 0, latency >= 0 and drives >= 1, got {bandwidth}, {latency}, {drives}")
        super().__init__(layers)
        self.bandwidth, self.latency = bandwidth, latency
        # its drives overlap a read's latency with another read's bytes: two in flight each keep them busy
        self.read_ahead_depth = DEPTH_PER_DRIVE * drives
        self._free_at = [0.0] * drives  # perf_counter time at which each drive's last read lands
        self._due: list[tuple[float, int, Read, tuple]] = []  # heap: (lands, order, read, parts)
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self.late = 0.0  # seconds the reads' futures were completed after their time, summed (wake-up delays)
        self.late_max = 0.0  # the most one read was late since the caller last set this to 0
        self._thread = threading.Thread(target=self._complete, name="timed-null-store", daemon=True)
        self._thread.start()

    def _lands(self, nbytes: int) -> float:
        d = min(range(len(self._free_at)), key=self._free_at.__getitem__)
        lands = max(time.perf_counter() + self.latency, self._free_at[d]) + nbytes / self.bandwidth
        self._free_at[d] = lands
        return lands

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._wake:
            lands = self._lands(self.layers[layer].expert_nbytes)
        time.sleep(max(0.0, lands - time.perf_counter()))
        return super().read(layer, expert)

    def submit(self, layer: int, expert: int, out: np.ndarray | None = None) -> Read:
        done = Read()
        # under the lock: reads made ahead are issued from the completing thread, beside the step's own
        with self._wake:
            # the untimed store's parts (its submit, not this class's read, which would take the time twice)
            parts = NullStore.read(self, layer, expert) if out is None else super().submit(layer, expert, out).result()
            heapq.heappush(self._due, (self._lands(self.layers[layer].expert_nbytes), next(self._order), done, parts))
            self._wake.notify()
        return done

    def _complete(self) -> None:
        with self._wake:
            while not self._closed:
                if not self._due:
                    self._wake.wait()
                    continue
                wait = self._due[0][0] - time.perf_counter()
                if wait > SPIN:  # a timed wait wakes a few hundred µs late: sleep most of the way ...
                    self._wake.wait(wait - SPIN)
                    continue
                if wait > 0:  # ... and spin the rest, letting go of the lock (and the GIL) each turn
                    self._wake.release()
                    time.sleep(0)
                    self._wake.acquire()
                    continue
                lands, _, done, parts = heapq.heappop(self._due)
                late = time.perf_counter() - lands
                self.late += late
                self.late_max = max(self.late_max, late)
                done.set_result(parts)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
