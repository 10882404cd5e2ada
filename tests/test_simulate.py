"""Routing traces, Belady's optimum and the cache simulator (`fomoe simulate`)."""

from __future__ import annotations

import itertools
import json
from functools import cache

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fomoepy.cli import main
from fomoepy.errors import FomoeError
from fomoepy.experts.belady import belady
from fomoepy.experts.car import CarConfig
from fomoepy.experts.policy import POLICIES
from fomoepy.experts.profile import ExpertCounter, seed_order, write_freq
from fomoepy.experts.routing import softmax_route
from fomoepy.experts.simulate import access_sequence, belady_for, fewest_reads, simulate
from fomoepy.experts.trace import TraceHeader, TraceWriter, read_trace

L, E, K = 3, 16, 2


def profile_from_trace(trace):
    """The profile `fomoe profile` would write for the text a trace recorded (its router choices)."""
    counter = ExpertCounter(trace.header.n_layer, trace.header.n_expert)
    for record in trace.records:
        counter.add(record.layer, record.ids)
    return counter.profile()


def write_trace(path, n_tokens=60, skew=0.0, seed=0, probs=True, sizes=(100, 100, 100), batch=1):
    """A synthetic trace: router logits favour low ids with Zipf exponent `skew` (0 = uniform)."""
    rng = np.random.default_rng(seed)
    prior = np.log(1.0 / np.arange(1, E + 1) ** skew)
    with TraceWriter(path, TraceHeader(L, E, K, sizes, "synthetic")) as w:
        for t in range(0, n_tokens, batch):
            for layer in range(L):
                logits = prior + rng.gumbel(size=(batch, E))
                ids = softmax_route(logits, K).ids
                p = np.exp(logits - logits.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                w.write(t, layer, ids, np.take_along_axis(p, ids, axis=1), p if probs else None)
    return path


# -- traces ----------------------------------------------------------------------------------------


def test_trace_round_trip(tmp_path):
    path = tmp_path / "a.trace"
    ids = np.array([[3, 1], [0, 15]])
    scores = np.array([[0.5, 0.25], [0.375, 0.125]], dtype=np.float32)
    probs = np.full((2, E), 1 / E, dtype=np.float32)
    with TraceWriter(path, TraceHeader(L, E, K, (10, 20, 30), "m")) as w:
        w.write(7, 2, ids, scores, probs)
        w.write(9, 0, ids[:1], scores[:1], predicted=[1, 4])
    trace = read_trace(path)
    assert trace.header == TraceHeader(L, E, K, (10, 20, 30), "m") and not trace.truncated
    a, b = trace.records
    assert (a.token, a.layer, a.ids.tolist(), a.scores.tolist()) == (7, 2, ids.tolist(), scores.tolist())
    assert a.probs.dtype == np.float16 and np.allclose(a.probs, probs)
    assert (b.token, b.layer, b.n_tokens, b.probs) == (9, 0, 1, None)
    assert a.predicted is None and b.predicted.tolist() == [1, 4]
    assert trace.n_tokens == 3 and not trace.has_probs
    assert trace.prediction_accuracy() == (0.5, 2)  # 1 and 4 predicted; the router chose 3 and 1


def test_a_killed_run_loses_only_its_partial_last_record(tmp_path):
    path = write_trace(tmp_path / "a.trace", n_tokens=3)
    data = path.read_bytes()
    full = read_trace(path)
    records = len(full.records)
    # a record holds ≥ 2·16 bytes of f16 probabilities: cutting up to 39 bytes stays inside the last one
    for cut in range(1, 40):
        path.write_bytes(data[:-cut])
        trace = read_trace(path)
        assert trace.truncated and len(trace.records) == records - 1
        assert all(np.array_equal(x.ids, y.ids) for x, y in zip(trace.records, full.records))


def test_damaged_traces_are_refused_clearly(tmp_path):
    path = tmp_path / "bad.trace"
    path.write_bytes(b"")
    with pytest.raises(FomoeError, match="no header"):
        read_trace(path)
    path.write_bytes(msgpack.packb({"format": "something-else"}))
    with pytest.raises(FomoeError, match="not a fomoe trace"):
        read_trace(path)
    path.write_bytes(msgpack.packb({"format": "fomoe-trace", "version": 9}))
    with pytest.raises(FomoeError, match="expected trace version 1, got 9"):
        read_trace(path)
    good = write_trace(tmp_path / "good.trace", n_tokens=2).read_bytes()
    header_len = len(msgpack.packb(TraceHeader(L, E, K, (100, 100, 100), "synthetic").to_msgpack()))
    path.write_bytes(good[:header_len] + b"\xc1" + good[header_len:])  # 0xc1: never valid msgpack
    with pytest.raises(FomoeError, match=f"at byte {header_len}"):
        read_trace(path)
    path.write_bytes(good[:header_len] + msgpack.packb({"t": 0, "l": 0, "n": 1, "k": 2, "ids": b"\0", "s": b""}))
    with pytest.raises(FomoeError, match="expected 4 bytes of ids"):
        read_trace(path)
    record = {"t": 0, "l": 0, "n": 1, "k": 2, "ids": b"\0\0\1\0", "s": b"\0" * 8}
    path.write_bytes(good[:header_len] + msgpack.packb(record | {"q": b"\0\0\0"}))
    with pytest.raises(FomoeError, match="expected 2 bytes of q, got 3"):
        read_trace(path)
    path.write_bytes(good[:header_len] + msgpack.packb(record | {"q": np.array([E], "<u2").tobytes()}))
    with pytest.raises(FomoeError, match=f"predicted expert id {E} outside"):
        read_trace(path)
    with pytest.raises(FomoeError, match="cannot read"):
        read_trace(tmp_path / "missing.trace")


# -- Belady ----------------------------------------------------------------------------------------


def brute_force_hits(seq, capacity, start=frozenset()) -> int:
    """The best hit count over every choice a cache could make (admit or not; which key to evict), from
    the contents `start`."""

    @cache
    def best(i: int, held: frozenset) -> int:
        if i == len(seq):
            return 0
        key = seq[i]
        if key in held:
            return 1 + best(i + 1, held)
        options = [best(i + 1, held)]  # bypass
        if len(held) < capacity:
            options.append(best(i + 1, held | {key}))
        else:
            options += [best(i + 1, (held - {old}) | {key}) for old in held]
        return max(options)

    return best(0, start)


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=14), capacity=st.integers(1, 4))
def test_belady_equals_the_brute_force_optimum_with_equal_sizes(seq, capacity):
    assert belady(seq, lambda key: 1, capacity).hits == brute_force_hits(tuple(seq), capacity)


def one_expert_steps(path, steps, sizes=(100,), n_expert=6):
    """A trace whose step i (token i) of layer 0 uses the one expert steps[i]."""
    with TraceWriter(path, TraceHeader(len(sizes), n_expert, 1, sizes)) as w:
        for t, e in enumerate(steps):
            w.write(t, 0, np.array([[e]]), np.ones((1, 1), np.float32))
    return read_trace(path)


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=12), capacity=st.integers(1, 3))
def test_fewest_reads_is_the_least_any_cache_reads_from_any_start(tmp_path_factory, seq, capacity):
    # a floor under a run's reads, whatever the tiers held when it began: the best over every start
    trace = one_expert_steps(tmp_path_factory.mktemp("t") / "t.trace", seq)
    starts = [frozenset(c) for n in range(capacity + 1) for c in itertools.combinations(range(6), n)]
    best = max(brute_force_hits(tuple(seq), capacity, s) for s in starts)
    assert fewest_reads(trace, (100,), capacity * 100) == (len(seq) - best) * 100


def test_fewest_reads_counts_only_the_steps_of_the_tokens_asked(tmp_path):
    # tokens 0-5 use experts 0-5 once each, tokens 6-11 alternate 0 and 1. With one slot, the best is to
    # keep 0 and read every other: the second half alone reads its three 1s; the first half its five
    # experts but the one it starts with; the whole run both (0 held from the start)
    steps = [0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 0, 1]
    trace = one_expert_steps(tmp_path / "t.trace", steps)
    assert fewest_reads(trace, (100,), 100, range(6, 12)) == 3 * 100
    assert fewest_reads(trace, (100,), 100, range(6)) == 5 * 100
    assert fewest_reads(trace, (100,), 100) == (5 + 3) * 100
    assert fewest_reads(trace, (100,), 200, range(6, 12)) == 0


@pytest.mark.parametrize("batch", [1, 4])
def test_no_policy_reads_less_than_fewest_reads(tmp_path, batch):
    trace = read_trace(write_trace(tmp_path / "t.trace", n_tokens=96, skew=1.2, batch=batch))
    sizes = (100, 100, 100)
    floor = fewest_reads(trace, sizes, 1000)
    assert floor > 0
    reads = [simulate(trace, sizes, 400, 600, policy, half_life_tokens=16).summary["disk"]["read_bytes"] for policy in POLICIES]
    assert min(reads) >= floor


def test_belady_with_a_seeded_start_and_oversized_items():
    assert belady(["a", "b", "a"], lambda key: 1, 1).hits == 1  # bypassing b keeps a
    assert belady(["a", "b", "a"], lambda key: 1, 1, initial=["a"]).hits == 2
    assert belady(["x", "x"], lambda key: 5, 4).hits == 0


@pytest.mark.parametrize("skew", [0.0, 1.2])  # random, Zipf
@pytest.mark.parametrize("device_slots, host_slots", [(2, 4), (6, 0), (0, 5), (8, 16), (1, 1)])
def test_belady_beats_every_policy(tmp_path, skew, device_slots, host_slots):
    trace = read_trace(write_trace(tmp_path / "t.trace", n_tokens=120, skew=skew, seed=int(skew * 10)))
    sizes = (100, 100, 100)
    best_device = belady_for(trace, sizes, device_slots * 100).hit_rate
    best_memory = belady_for(trace, sizes, (device_slots + host_slots) * 100).hit_rate
    for policy in POLICIES:
        r = simulate(trace, sizes, device_slots * 100, host_slots * 100, policy, half_life_tokens=16)
        assert r.device_hit_rate <= best_device + 1e-12
        assert r.memory_hit_rate <= best_memory + 1e-12
    assert best_memory >= best_device


def test_zipf_traces_are_kinder_to_caches_than_uniform_ones(tmp_path):
    uniform = read_trace(write_trace(tmp_path / "u.trace", n_tokens=150, skew=0.0))
    zipf = read_trace(write_trace(tmp_path / "z.trace", n_tokens=150, skew=1.5))
    sizes = (100, 100, 100)
    for policy in ("lru", "lfu-decay"):
        hit = [simulate(t, sizes, 1200, 0, policy).device_hit_rate for t in (uniform, zipf)]
        assert hit[1] > hit[0]


def test_replay_plans_each_record_as_one_step(tmp_path):
    trace = read_trace(write_trace(tmp_path / "b.trace", n_tokens=40, batch=8))
    r = simulate(trace, (100, 100, 100), 10_000, 0)
    assert r.summary["accesses"] == len(access_sequence(trace))
    assert r.summary["accesses"] < 40 * L * K  # experts shared within a batch are fetched once


def test_car_replay_reports_a_substitution_rate(tmp_path):
    trace = read_trace(write_trace(tmp_path / "c.trace", n_tokens=80, skew=0.5))
    exact = simulate(trace, (100, 100, 100), 600, 0)
    off = simulate(trace, (100, 100, 100), 600, 0, car=CarConfig(threshold=0))
    assert off.summary == exact.summary and off.car is None
    on = simulate(trace, (100, 100, 100), 600, 0, car=CarConfig(threshold=0.3))
    assert 0 < on.car.rate < 1
    assert on.device_hit_rate > exact.device_hit_rate
    no_probs = read_trace(write_trace(tmp_path / "d.trace", n_tokens=4, probs=False))
    with pytest.raises(FomoeError, match="full probabilities"):
        simulate(no_probs, (100, 100, 100), 600, 0, car=CarConfig(threshold=0.3))


def _guessing_trace(path):
    """2 layers of 8 experts, top-2; token t takes t and t+1 (mod 8) at both layers, and layer 1's
    prediction (made during layer 0) is [t, t+5]: its first guess always right, its second never."""
    with TraceWriter(path, TraceHeader(2, 8, 2, (100, 100))) as w:
        for t in range(4):
            for layer in range(2):
                w.write(t, layer, np.array([[t % 8, (t + 1) % 8]]), np.full((1, 2), 0.5, np.float32),
                        predicted=np.array([t % 8, (t + 5) % 8]) if layer else None)  # fmt: skip
    return read_trace(path)


def test_a_replay_counts_the_guesses_no_tier_holds_when_the_step_before_reads_them(tmp_path):
    trace = _guessing_trace(tmp_path / "g.trace")
    # no tiers: every guess is read, in the predictor's order; the counts follow its ranks
    none = simulate(trace, (100, 100), 0, 0, "lru").ahead
    assert (none.read_at, none.used_at, none.issued, none.used, none.wasted) == ([4, 4], [4, 0], 8, 4, 4)
    assert none.along_reading_order() == (1.0, 0.0)
    # tiers that hold everything once read: after token 0, guess t is held (layer 1 took it as t + 1 the
    # token before) and only t + 5 is read, first: the reading order's first guess is right a third of the
    # time where the predictor's first is always right; at token 3, 0 is held too (taken at token 0)
    held = simulate(trace, (100, 100), 0, 10_000, "lru").ahead
    assert (held.read_at, held.used_at) == ([3, 1], [1, 0]) and held.along_reading_order() == (1 / 3, 0.0)
    # two experts' room, lru: the engine looks before the step's own access (layer 0 then evicts layer 1's
    # pair); looking after it would find nothing of layer 1 held and read both guesses every token
    two = simulate(trace, (100, 100), 0, 200, "lru").ahead
    assert (two.read_at, two.used_at) == ([4, 1], [1, 0])
    assert simulate(read_trace(write_trace(tmp_path / "n.trace", n_tokens=4)), (100, 100, 100), 0, 0).ahead is None


# -- the command -----------------------------------------------------------------------------------


def test_fomoe_simulate_prints_policies_next_to_belady(tmp_path, capsys):
    path = write_trace(tmp_path / "t.trace", n_tokens=50, skew=1.0)
    assert main(["simulate", str(path), "--vram", "800", "--ram-mb", "0.001", "--policy", "lru,lfu-decay"]) == 0
    out = capsys.readouterr().out
    assert "lru " in out and "lfu-decay" in out and "belady" in out
    assert main(["simulate", str(path), "--vram-mb", "0", "--ram", "1K", "--policy", "all", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["policies"]) == set(POLICIES) and result["device_bytes"] == 0
    assert result["belady_memory_hit_rate"] >= max(p["memory_hit_rate"] for p in result["policies"].values())


def test_fomoe_simulate_with_a_profile_and_car(tmp_path, capsys):
    path = write_trace(tmp_path / "t.trace", n_tokens=50, skew=1.0)
    write_freq(tmp_path / "p.freq", profile_from_trace(read_trace(path)))
    args = ["simulate", str(path), "--vram", "600", "--ram", "600", "--profile", str(tmp_path / "p.freq"),
            "--policy", "lru-pinned", "--car-threshold", "0.5", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)["policies"]["lru-pinned"]
    assert "car_substitution_rate" in result


def test_fomoe_simulate_errors_are_one_line(tmp_path, capsys):
    path = write_trace(tmp_path / "t.trace", n_tokens=5, sizes=())
    assert main(["simulate", str(path), "--vram", "1K", "--ram", "0"]) == 1
    assert "no expert sizes; give --expert-bytes" in capsys.readouterr().err
    assert main(["simulate", str(path), "--vram", "1K", "--ram", "0", "--expert-bytes", "100"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(path), "--vram", "1Q", "--ram", "0", "--expert-bytes", "100"]) == 1
    assert "expected a size" in capsys.readouterr().err
    assert main(["simulate", str(path), "--vram", "1K", "--ram", "0", "--expert-bytes", "9", "--policy", "x"]) == 1
    assert "unknown cache policy 'x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vram", "99999999T", "--ram", "1M"], "size '99999999T' is too large: at most 4194304T"),
        (["--vram", "1M", "--ram", "9" * 30], "is too large"),
        (["--vram-mb", "1e300", "--ram", "1M"], "--vram-mb must be in [0, 4398046511104], got 1e+300"),
        (["--vram-mb", "nan", "--ram", "1M"], "--vram-mb must be in [0, "),
        (["--vram", "1M", "--ram-mb", "inf"], "--ram-mb must be in [0, "),
    ],
)
def test_sizes_no_cache_could_hold_are_one_error_line(tmp_path, capsys, flags, message):
    path = write_trace(tmp_path / "t.trace", n_tokens=5)
    assert main(["simulate", str(path), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fomoe: error: ") and message in err[0]


@pytest.mark.parametrize(
    "content",
    [
        b"GGUF" + bytes(100),  # not a zip: numpy would read it as a pickle
        b"\x93NUMPY",  # a truncated .npy
        "npy",  # a whole .npy, not an .npz
        "other",  # an .npz of other arrays
        "shape",  # the right names, the wrong shapes
    ],
    ids=["not-a-zip", "truncated-npy", "npy", "other-arrays", "wrong-shapes"],
)
def test_a_file_that_is_not_a_packed_trace_is_one_error_line(tmp_path, capsys, content):
    path = tmp_path / "t.npz"
    if content == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    elif content == "other":
        np.savez(path, a=np.zeros(3))
    elif content == "shape":
        np.savez(path, ids=np.zeros((2, 3), np.uint8), expert_bytes=np.zeros(3, np.int64), n_expert=np.int64(4))
    else:
        path.write_bytes(content)
    assert main(["simulate", str(path), "--vram", "1M", "--ram", "1M"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fomoe: error: {path}: not a packed routing trace")


def test_seeding_from_a_profile_helps_and_belady_starts_seeded_too(tmp_path):
    trace = read_trace(write_trace(tmp_path / "t.trace", n_tokens=60, skew=1.2))
    sizes = (100, 100, 100)
    order = seed_order(profile_from_trace(trace))
    cold = simulate(trace, sizes, 500, 500, "lru")
    warm = simulate(trace, sizes, 500, 500, "lru", seed=order)
    assert warm.memory_hit_rate >= cold.memory_hit_rate
    dev_seed, host_seed = warm.seeded
    assert len(dev_seed) == 5 and len(host_seed) == 5 and list(dev_seed) == order[:5]
    assert warm.device_hit_rate <= belady_for(trace, sizes, 500, dev_seed).hit_rate


def test_replay_keeps_the_policies_time_a_batched_step_recorded(tmp_path):
    # a batched decode step is one tick of the policies' time for all its rows, so its records say the time
    # (tk) where it is not the token index. Expert 0 used at ticks 0-3, expert 1 from tick 4 on, in a
    # device tier of one slot (lfu-admit, half-life 64): expert 1 takes the slot once its decayed count + 1
    # passes expert 0's, which at one tick a step is at its fourth use (tick 7: 2.95 + 1 > 3.77), so it
    # hits once (tick 8). Replayed by token index (100-103), expert 0 would have decayed over 96 tokens and
    # expert 1 taken the slot at its second use, hitting twice
    path = tmp_path / "b.trace"
    rows = [(0, 0, None), (1, 0, None), (2, 0, None), (3, 0, None), (4, 1, None), (100, 1, 5), (101, 1, 6), (102, 1, 7), (103, 1, 8)]
    with TraceWriter(path, TraceHeader(1, 4, 1, (100,))) as w:
        for t, e, now in rows:
            w.write(t, 0, np.array([[e]]), np.ones((1, 1), np.float32), now=now)
    trace = read_trace(path)
    assert [r.now for r in trace.records][-4:] == [5, 6, 7, 8]
    assert simulate(trace, (100,), 100, 0, "lfu-admit").summary["device"]["hits"] == 3 + 1
