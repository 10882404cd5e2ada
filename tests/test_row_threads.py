"""A decode row's thread count, measured per kind of product (fomoepy.runtime.row_threads): the counts
take turns, the first timing of each (the graph's build) is left out, the faster stays; and the choice
never changes a product's bits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from gguf import GGMLQuantizationType

from fomoepy import quants
from fomoepy.runtime import row_threads
from fomoepy.runtime.backends import make_backend
from fomoepy.runtime.ggml_matmul import QuantMatrix, mul_mat
from fomoepy.runtime.row_threads import RowThreads


class Clock:
    """time.perf_counter for RowThreads: a product of n threads advances it by cost[n], and by `build`
    more the first time each count runs (a graph is built once per thread count)."""

    def __init__(self, cost: dict[int, float], build: dict[int, float]):
        self.now, self.cost, self.build, self.ran = 0.0, cost, dict(build), []

    def product(self, n: int) -> int:
        self.now += self.cost[n] + self.build.pop(n, 0.0)
        self.ran.append(n)
        return n

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("cost, want", [({1: 1.0, 2: 2.0}, 1), ({1: 2.0, 2: 1.0}, 2), ({1: 1.0, 2: 1.0}, 1)])
def test_the_counts_take_turns_and_the_faster_stays(monkeypatch, cost, want):
    clock = Clock(cost, {})
    monkeypatch.setattr(row_threads.time, "perf_counter", clock)
    rt = RowThreads(2, samples=3)
    for _ in range(8 + 5):
        rt.run("head", clock.product)
    assert clock.ran[:8] == [1, 2] * 4  # 3 timings of each, after the first of each
    assert rt.chosen == {"head": want} and clock.ran[8:] == [want] * 5


def test_the_first_timing_of_each_count_builds_its_graph_and_is_left_out(monkeypatch):
    # one thread is faster, but its first run also built its graph: counted, two threads would win
    clock = Clock({1: 1.0, 2: 2.0}, {1: 100.0})
    monkeypatch.setattr(row_threads.time, "perf_counter", clock)
    rt = RowThreads(2, samples=1)
    for _ in range(4):
        rt.run(("mul_mat", 12, (8, 256)), clock.product)
    assert rt.chosen == {("mul_mat", 12, (8, 256)): 1}


def test_each_kind_settles_on_its_own(monkeypatch):
    clock_a, clock_b = Clock({1: 1.0, 2: 2.0}, {}), Clock({1: 2.0, 2: 1.0}, {})
    now = {"t": 0.0}
    monkeypatch.setattr(row_threads.time, "perf_counter", lambda: clock_a.now + clock_b.now + now["t"])
    rt = RowThreads(2, samples=2)
    for _ in range(6):
        rt.run("experts", clock_a.product)
        rt.run("head", clock_b.product)
    assert rt.chosen == {"experts": 1, "head": 2}


def test_a_tuned_backends_one_row_products_keep_their_bits():
    rng = np.random.default_rng(0)
    n, k = 64, 512
    w = QuantMatrix.of(quants.quantize(rng.standard_normal((n, k)).astype(np.float32), int(GGMLQuantizationType.Q4_K)),
                       int(GGMLQuantizationType.Q4_K), (n, k))  # fmt: skip
    x = rng.standard_normal((1, k)).astype(np.float32)
    tuned, fixed = make_backend("cpu", 2, 0, tune_rows=True), make_backend("cpu", 2, 0)
    assert tuned.row_threads is not None and fixed.row_threads is None
    want = mul_mat(x, w, 1)
    for _ in range(2 * tuned.row_threads.samples + 4):  # while it measures, and after it has chosen
        assert np.array_equal(tuned.linear(x, w), want)
    assert list(tuned.row_threads.chosen) == [("mul_mat", w.qtype, w.shape)]


def test_an_engine_without_t_tunes_its_decode_rows_and_decodes_the_bits_of_one_thread(monkeypatch):
    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.runtime import backends

    name = "qwen3moe_q4_k_m"
    tokens = np.load(ORACLE / f"{name}.tokens.npy")[:24]
    one = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=1))
    monkeypatch.setattr(backends, "cpu_threads", lambda spec, requested: requested or 2)  # as on a larger model
    tuned = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu"))
    rt = tuned.devices[0].row_threads
    assert rt is not None
    for engine in (one, tuned):
        state = engine.new_state()
        engine.logits_seen = [engine.decode_token(state, int(t)) for t in tokens]
    assert all(np.array_equal(a, b) for a, b in zip(one.logits_seen, tuned.logits_seen))
    assert any(kind[0] == "experts" for kind in rt.chosen)  # the routed experts' product was measured too
    one.close()
    tuned.close()


def test_a_kind_measures_again_after_every_rows_and_follows_a_change_of_load(monkeypatch):
    clock = Clock({1: 1.0, 2: 2.0}, {})
    monkeypatch.setattr(row_threads.time, "perf_counter", clock)
    rt = RowThreads(2, samples=1, every=5)
    for _ in range(4):  # measures: 1, 2, 1, 2
        rt.run("experts", clock.product)
    assert rt.chosen == {"experts": 1}
    clock.cost = {1: 2.0, 2: 1.0}  # the load changed: now 2 threads are faster
    for _ in range(5):
        rt.run("experts", clock.product)
    assert clock.ran[4:] == [1] * 5 and "experts" not in rt.chosen  # its 5 rows run, it measures again
    for _ in range(4 + 3):
        rt.run("experts", clock.product)
    assert clock.ran[9:13] == [1, 2, 1, 2] and clock.ran[13:] == [2] * 3 and rt.chosen == {"experts": 2}
