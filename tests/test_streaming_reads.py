"""A streamed step's reads through the engine: when they are issued (before the cache plan), what the
step does while they are in flight (its routing record, the next layer's guesses, the experts at hand
on the cpu backend), and the reads made ahead (a few at a time, handed to their step, the prediction
only where something uses it). The streamed path's results are tests/test_streaming.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.device import Phase
from fomoepy.experts.tiers import SlotState
from fomoepy.experts.trace import read_trace
from fomoepy.runtime import batched_experts
from fomoepy.sampling import SamplingParams

CPU_KERNELS = ["ggml"] + (["on"] if batched_experts.vector_kernel() else [])  # --expert-kernel: ggml's products, fomoepy's kernel


@pytest.fixture
def model(streamed_model):
    """(the model file, its store's two directories, the oracle's tokens, the all-resident logits)."""
    return streamed_model


class PooledStore:
    """The engine's expert store behind a pool of `workers` threads, as ExpertStore's submit is; the
    stores below change what a read does before it reads."""

    def __init__(self, store, workers: int):
        from concurrent.futures import ThreadPoolExecutor

        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=workers)

    def read(self, layer: int, expert: int, out=None):
        return self.store.read_into(layer, expert, out)

    def submit(self, layer: int, expert: int, out=None):
        return self.pool.submit(self.read, layer, expert, out)

    def __getattr__(self, name):
        return getattr(self.store, name)


class SlowStore(PooledStore):
    """`delay` seconds added to every read: one worker is a disk whose bandwidth is the limit (reads
    queue), many a disk limited by latency."""

    def __init__(self, store, delay: float, workers: int):
        super().__init__(store, workers)
        self.delay = delay

    def read(self, layer: int, expert: int, out=None):
        import time

        time.sleep(self.delay)
        return super().read(layer, expert, out)


class HeldStore(PooledStore):
    """Reads of the keys in `held` wait until `release` (or `patience` seconds): what a step waits for,
    and what it leaves in flight, is then a matter of order, not time."""

    def __init__(self, store, held, patience: float = 5.0):
        super().__init__(store, workers=4)
        self.held, self.patience = set(held), patience
        self.gate = threading.Event()
        self.submitted = []

    def submit(self, layer: int, expert: int, out=None):
        self.submitted.append((layer, expert))
        return super().submit(layer, expert, out)

    def read(self, layer: int, expert: int, out=None):
        if (layer, expert) in self.held:
            self.gate.wait(self.patience)
        return super().read(layer, expert, out)

    def release(self) -> None:
        self.gate.set()


def test_reads_ahead_go_a_few_at_a_time_and_never_delay_the_next_layers_own(model):
    # Layer 1's experts 3, 2, 6, 4 are predicted (most confident first) before layer 0 acquires expert 5.
    # Layer 0 issues its own read, then only the two likeliest guesses (the depth for one drive), and returns with them
    # in flight (held here). Layer 1 then chooses 2 and 7: the read of 2 made ahead is handed over, 7 is
    # read at once, 3's read lands unused, and 6 and 4, never issued, are never read.
    path, store, _, _ = model
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=1 << 30))
    streamer = engine.experts.streamer
    streamer.source = source = HeldStore(streamer.source, held={(1, 2), (1, 3)})
    assert streamer.read_ahead.depth == streamer.source.threads // 2  # half the store's readers
    streamer.read_ahead.depth = 2
    streamer.predict(1, np.array([[3, 2, 6, 4]]))
    plan0, _ = streamer.acquire(0, np.array([[5]]))
    assert source.submitted == [(0, 5), (1, 3), (1, 2)]  # its own read first, then two guesses
    streamer.release(plan0)
    plan1, fetched, reads = streamer.start_acquire(1, np.array([[2, 7]]))
    assert source.submitted == [(0, 5), (1, 3), (1, 2), (1, 7)]  # 7 not queued behind 6 and 4
    assert not reads[2].done()  # the guess's read, still held, is the step's read of 2
    source.release()
    fetched = streamer.finish_acquire(plan1, fetched, reads)
    streamer.release(plan1)
    for e in (2, 7):
        assert all(np.array_equal(a, b) for a, b in zip(fetched[e], source.store.read(1, e)))
    assert {i.source.value for i in plan1.items} == {"disk"}  # the cache counts the read made ahead as a disk read
    source.pool.shutdown(wait=True)  # every read landed: none issued 6 or 4 as it did
    assert source.submitted == [(0, 5), (1, 3), (1, 2), (1, 7)]
    c = streamer.read_ahead.counts
    assert (c.issued, c.used, c.wasted, c.skipped) == (2, 1, 1, 2)
    engine.close()


def test_a_steps_reads_are_issued_before_its_plan_is_made(model):
    # The drives' latency is the longer wait: the experts neither tier holds are read before the plan's
    # eviction walks and commit run (they then run while the reads are in flight). The plan still counts
    # exactly those as its disk reads, and a host hit is not read.
    path, store, _, _ = model
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=1 << 30, prefetch=False))
    streamer = engine.experts.streamer
    streamer.source = source = HeldStore(streamer.source, held=())
    events = []
    real_submit, real_plan = source.submit, streamer.cache.plan
    source.submit = lambda layer, expert, *a, **kw: events.append(("read", expert)) or real_submit(layer, expert, *a, **kw)
    streamer.cache.plan = lambda *a, **kw: events.append(("plan",)) or real_plan(*a, **kw)
    plan, _ = streamer.acquire(0, np.array([[5, 1]]))
    streamer.release(plan)
    assert events == [("read", 1), ("read", 5), ("plan",)]
    assert [(i.expert, i.source.value) for i in plan.items] == [(1, "disk"), (5, "disk")]
    events.clear()
    plan, _ = streamer.acquire(0, np.array([[5, 2]]))  # 5 is now a host hit: only 2 is read
    streamer.release(plan)
    assert events == [("read", 2), ("plan",)]
    assert [(i.expert, i.source.value) for i in plan.items] == [(2, "disk"), (5, "host")]
    source.pool.shutdown(wait=True)
    engine.close()


def test_a_steps_routing_record_and_next_guess_are_made_while_its_reads_are_in_flight(model):
    # The part of a step in series with its reads ends once they are issued: the usage counts, the trace
    # and the next layer's prediction, which the reads do not depend on, come after the submits; the
    # guesses go to the drives then too, before the step's cache plan (a drive with none of the step's
    # own reads starts on them at once).
    path, store, tokens, _ = model
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=0, prefetch=True))
    streamer = engine.experts.streamer
    events = []
    real_submit, real_note, real_predict, real_plan = streamer.source.submit, streamer.note, streamer.predict, streamer.cache.plan
    inference, guessing = threading.get_ident(), [False]
    real_issue = streamer._issue_prefetch

    def issue():  # the step hands its guesses to the read ahead, which issues what the drives have room for
        guessing[0] = True
        try:
            real_issue()
        finally:
            guessing[0] = False

    streamer._issue_prefetch = issue

    def label(layer):
        # a step's own read is ("read", layer), a guess issued as the step hands it over ("guess", layer); a
        # guess issued as an earlier read lands (the read ahead keeps to the drives' depth: fomoepy.experts.
        # read_ahead) comes when it comes, on whichever thread saw the landing
        if threading.get_ident() != inference:
            return ("read later", layer)
        return ("guess", layer) if guessing[0] else ("read", layer)

    streamer.source.submit = lambda layer, expert, *a, **kw: events.append(label(layer)) or real_submit(layer, expert, *a, **kw)
    streamer.note = lambda layer, *a: events.append(("note", layer)) or real_note(layer, *a)
    streamer.predict = lambda layer, ids: events.append(("predict", layer - 1)) or real_predict(layer, ids)
    streamer.cache.plan = lambda layer, *a, **kw: events.append(("plan", layer)) or real_plan(layer, *a, **kw)
    streamer.source = streamer.source  # (the reads made ahead take the source's submit as the source is set)
    state = engine.new_state()
    got = np.stack([engine.decode_token(state, int(t)) for t in tokens[:3]])
    del streamer.source.submit, streamer.note, streamer.predict, streamer.cache.plan, streamer._issue_prefetch
    streamer.source = streamer.source
    noted = [i for i, e in enumerate(events) if e[0] == "note"]
    assert len(noted) == 3 * engine.spec.n_layer
    read_first = guessed = 0
    for i, end in zip(noted, noted[1:] + [len(events)]):
        layer = events[i][1]
        read_first += ("read", layer) in events[:i]
        after = events[i + 1 : end]  # the rest of this step, up to the next step's record
        assert ("read", layer) not in after  # the step's own reads all went out before its record
        if layer + 1 < engine.spec.n_layer:
            assert ("predict", layer) in after  # and its guess of the next layer's experts after it
            if ("guess", layer + 1) in after:  # a guess the step read ahead at once: issued before its plan
                guessed += 1
                assert after.index(("guess", layer + 1)) < after.index(("plan", layer))
    assert read_first > 0 and guessed > 0, "no step read a miss, or none a guess: the test proves nothing"
    engine.close()
    plain = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=0, prefetch=False))
    state = plain.new_state()
    assert np.array_equal(got, np.stack([plain.decode_token(state, int(t)) for t in tokens[:3]]))  # when, never what
    plain.close()


class ComputeGatedStore(PooledStore):
    """Reads finish only once an expert FFN has been computed since they were issued (or after
    `patience` seconds): a step that waits for its reads before computing anything makes them wait
    out their patience."""

    def __init__(self, store, patience: float):
        super().__init__(store, workers=4)
        self.patience = patience
        self.computed = threading.Event()
        self.released = []  # per read: True when a computation let it finish, False when it waited out

    def submit(self, layer: int, expert: int, out=None):
        self.computed.clear()
        return super().submit(layer, expert, out)

    def read(self, layer: int, expert: int, out=None):
        self.released.append(self.computed.wait(self.patience))
        return super().read(layer, expert, out)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_cpu_decode_step_computes_the_experts_at_hand_while_the_others_are_read(model, kernel):
    # ggml backend, one token: of the experts chosen, those in the tier go through their FFN before this
    # step's reads finish; then the read ones. The logits are the resident engine's, bit for bit (with
    # its slots in the same form: --repack-experts auto repacks a whole tier's, not a streaming one's).
    # By ggml's products (rounds) and by the batched kernel (its first call: the tier's picks)
    import fomoepy.runtime.ggml_experts as ge

    path, store, tokens, _ = model
    resident = Engine(path, EngineOptions(backend="cpu", threads=1, repack_experts="off", expert_kernel=kernel))
    resident_state = resident.new_state()
    resident.eval(resident_state, tokens[:5])
    want = resident.eval(resident_state, tokens[5:6], phase=Phase.DECODE)[-1]
    resident.close()
    engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=short_of_whole(path), prefetch=False,
                                        expert_kernel=kernel))  # fmt: skip
    state = engine.new_state()
    engine.eval(state, tokens[:5])  # the prompt's experts are now in the tier
    streamer = engine.experts.streamer
    streamer.source = gated = ComputeGatedStore(streamer.source, patience=0.5)
    module, name = (ge, "_round") if kernel == "ggml" else (ge.batched_experts, "pick_outputs")
    real_round = getattr(module, name)

    def round_(*args):
        out = real_round(*args)
        gated.computed.set()
        return out

    setattr(module, name, round_)
    reads = engine.stats()["cache"]["disk"]["reads"]
    try:
        got = engine.eval(state, tokens[5:6], phase=Phase.DECODE)[-1]
    finally:
        setattr(module, name, real_round)
    assert engine.stats()["cache"]["disk"]["reads"] - reads == len(gated.released) > 0
    assert any(gated.released)  # some step computed experts at hand while its reads were pending
    assert np.array_equal(got, want)  # the order of additions is the resident engine's
    engine.close()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_cpu_decode_step_that_fails_among_the_experts_at_hand_leaves_the_cache_whole(model, kernel):
    # the at-hand FFN raises while the step's reads are in flight: the error reaches the caller, the
    # reads still land, and the next request computes what a fresh engine does
    import fomoepy.runtime.ggml_experts as ge

    path, store, tokens, _ = model
    fresh = Engine(path, EngineOptions(backend="cpu", threads=1, repack_experts="off", expert_kernel=kernel))  # a streaming tier's form
    want = fresh.logits(tokens[:6])[-1]
    fresh.close()
    engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=short_of_whole(path), prefetch=False,
                                        expert_kernel=kernel))  # fmt: skip
    state = engine.new_state()
    engine.eval(state, tokens[:5])
    streamer = engine.experts.streamer
    streamer.source = source = HeldStore(streamer.source, held=set())
    module, name = (ge, "_round") if kernel == "ggml" else (ge.batched_experts, "pick_outputs")
    real_round = getattr(module, name)

    def failing(*args):
        if source.submitted:  # a step with reads in flight
            raise RuntimeError("ggml failed")
        return real_round(*args)

    setattr(module, name, failing)
    try:
        with pytest.raises(RuntimeError, match="ggml failed"):
            engine.eval(state, tokens[5:6], phase=Phase.DECODE)
    finally:
        setattr(module, name, real_round)
    tier = streamer.cache.device  # the cpu backend's one tier
    assert source.submitted and all(tier.state(k) is SlotState.READY for k in tier.keys())
    assert np.array_equal(engine.logits(tokens[:6])[-1], want)
    engine.close()


def short_of_whole(path) -> int:
    """A cpu tier of every expert but one: not filled at load, and nothing evicted over a few tokens."""
    engine = Engine(path, EngineOptions(backend="cpu", ram_cache=0))
    layers, n_expert = engine.source.layers, engine.spec.moe.n_expert
    engine.close()
    return sum(layer.expert_nbytes for layer in layers) * n_expert - 1


def test_prefetch_on_and_off_give_the_same_tokens(model):
    path, store, tokens, _ = model
    outs = []
    for prefetch in (True, False):
        engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=1 << 30, prefetch=prefetch))
        engine.experts.streamer.source = SlowStore(engine.experts.streamer.source, 0.002, workers=4)  # reads finish in any order
        outs.append(list(engine.generate(tokens[:6], 16, SamplingParams(temperature=0.9, seed=3), stop_at_eog=False)))
        stats = engine.stats()["prefetch"]
        engine.close()
        assert (stats["issued"] > 0) == prefetch
    assert outs[0] == outs[1]


def test_a_step_predicts_the_next_layer_only_where_reading_ahead_or_a_trace_uses_it(model, tmp_path):
    # the prediction is a router's product on every decode step (on a GPU, a launch of the next layer's
    # router): paid for reading ahead, or for a trace's record of its accuracy, and nowhere else
    path, store, tokens, _ = model
    cases = [({"store": tuple(store)}, True), ({"store": tuple(store), "prefetch": False}, False),
             ({"store": tuple(store), "prefetch": False, "trace": str(tmp_path / "t.trace")}, True),
             ({}, False)]  # (the GGUF file itself: a source with no reads in the background, nothing read ahead)
    for options, predicts in cases:
        engine = Engine(path, EngineOptions(vram_cache=0, ram_cache=1 << 30, **options))
        list(engine.generate(tokens[:4], 4, SamplingParams.greedy(), stop_at_eog=False))
        predicted = engine.experts.streamer.prefetch_stats.predicted
        engine.close()
        assert engine.experts.predicts == predicts and (predicted > 0) == predicts, options


def test_the_cpu_backend_reads_predicted_experts_ahead_with_no_host_tier(model):
    # the cpu backend's one tier is its device tier (ggml slots): the reads made ahead that the next step
    # chooses are handed to it, as on any backend, and the tokens are the same as without
    path, store, tokens, _ = model
    probe = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=0))
    unit = probe.experts.streamer.cache.device_expert_bytes[0]
    probe.close()
    outs = []
    for prefetch in (True, False):
        engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=8 * unit, prefetch=prefetch))
        assert not engine.experts.streamer.cache.host.enabled
        outs.append(list(engine.generate(tokens[:6], 12, SamplingParams.greedy(), stop_at_eog=False)))
        stats = engine.stats()["prefetch"]
        engine.close()
        assert (stats["issued"] > 0 and stats["used"] > 0) == prefetch, stats
    assert outs[0] == outs[1]


def test_a_trace_keeps_the_prediction_most_confident_first(model, tmp_path):
    # rows [3, 2] and [6, 2] predicted: each row's first choice, then each row's second, once each
    from fomoepy.experts.routing import Routing

    path, store, _, _ = model
    trace_path = tmp_path / "t.trace"
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=1 << 30, trace=str(trace_path)))
    streamer = engine.experts.streamer
    E = streamer.n_expert
    streamer.predict(1, np.array([[3, 2], [6, 2]]))
    streamer.choose(1, Routing(np.array([[2, 5]]), np.full((1, 2), 0.5, np.float32), np.full((1, E), 1.0 / E, np.float32)))
    engine.close()
    (record,) = read_trace(trace_path).records
    assert record.predicted.tolist() == [3, 6, 2]


def test_a_read_made_ahead_that_has_landed_is_at_hand_for_its_step(model):
    # its bytes are here when the step plans: they join the experts at hand (computed, or copied up, first),
    # not the reads the step waits for; the cache still counts it a disk read
    path, store, _, _ = model
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=1 << 30))
    streamer = engine.experts.streamer
    streamer.predict(1, np.array([[2]]))
    streamer.release(streamer.acquire(0, np.array([[5]]))[0])
    ((guess, _),) = streamer.read_ahead._issued.values()  # (the read, its position in the reading order)
    guess.result(timeout=10)
    plan, fetched, reads = streamer.start_acquire(1, np.array([[2]]))
    assert 2 in fetched and 2 not in reads and {i.source.value for i in plan.items} == {"disk"}
    streamer.release(plan)
    assert all(np.array_equal(a, b) for a, b in zip(fetched[2], streamer.source.read(1, 2)))
    engine.close()


def test_a_predictor_whose_guesses_do_not_pay_stops_reading_ahead_and_a_better_one_starts_it_again(model):
    """The streamer's gate (fomoepy.experts.read_ahead.ReadAheadGate), on a small window: guesses its step
    never reads turn reading ahead off after a window (no read ahead is issued after it, the prediction is
    made on one token in `sample` only, and still scored); guesses its step reads turn it back on. No
    tier: every guess is one no tier holds."""
    from fomoepy.experts.read_ahead import ReadAheadGate

    path, store, _, _ = model
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=0, ram_cache=0))
    streamer = engine.experts.streamer
    assert streamer.gate is None  # the cpu backend's schedule: reading ahead is never turned off
    gate = streamer.gate = ReadAheadGate(0.44, window=8, sample=4)
    chosen = np.array([[0, 1]])

    def token(guess) -> bool:
        """One decode token over layers 0 and 1 (layer 1 chooses 0 and 1); whether it predicted layer 1."""
        streamer.begin_step()
        predicted = streamer.wants_prediction()
        if predicted:
            streamer.predict(1, np.array([guess]))
        for layer in (0, 1):
            plan, _ = streamer.acquire(layer, chosen)
            streamer.release(plan)
        streamer.end_step(1)
        return predicted

    wrong = [token([4, 5, 6, 7]) for _ in range(2)]  # 8 guesses, none read by their step: off
    assert wrong == [True, True] and not gate.reading and gate.share == 0.0
    assert streamer.lines()[-1] == "reading ahead off: 0% of 8 guesses no tier held were right, it pays above 44%"  # (the user sees why)
    issued = streamer.read_ahead.counts.issued
    assert issued > 0 and issued + streamer.read_ahead.counts.skipped == 8  # (those not yet issued when their layer routed: skipped)
    off = [token([4, 5, 6, 7]) for _ in range(8)]
    assert off == [False, False, True, False] * 2  # sampled (the gate counts tokens from its start): still scored
    assert streamer.read_ahead.counts.issued == issued and gate.guessed == 16  # none read, still scored
    for _ in range(8):
        token([0, 1, 6, 7])  # half of them read by their step: 50 %, not on yet
    assert not gate.reading
    for _ in range(16):
        token([1, 0])  # all of them
    assert gate.reading and gate.turned == 2
    assert streamer.read_ahead.counts.issued > issued  # reading ahead again
    engine.close()


def test_a_cpu_decode_rows_guesses_come_with_its_routing_from_the_attention_graph(model, monkeypatch):
    # the cpu backend's attention graph of a decode row gives the next layer's guesses with the routing (the
    # next router's k largest products with h: Routing.ahead), so the step makes no product of its own for
    # them where that graph runs (qwen3moe's attention; qwen3.5's is gated and its DeltaNet layers have no
    # such graph), and they are the guesses the step's own product gives
    from fomoepy.experts.streamer import ExpertStreamer
    from fomoepy.runtime.ggml_cpu import GgmlBackend
    from fomoepy.runtime.ggml_experts import GgmlExperts

    path, store, tokens, _ = model
    probe = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=0))
    unit = probe.experts.streamer.cache.device_expert_bytes[0]
    fused = probe.ops.fuses_attention(probe.spec.attention, probe.spec.moe.gating)
    probe.close()

    def decode(with_routing: bool) -> tuple[list, list]:
        products, guesses = [], []
        route, predict, attention_layer = GgmlExperts.route, ExpertStreamer.predict, GgmlBackend.attention_layer
        with monkeypatch.context() as m:
            if not with_routing:  # the attention graph given its first seven arguments, not the next layer's router: no guesses with the routing
                m.setattr(GgmlBackend, "attention_layer", lambda self, *a: attention_layer(self, *a[:7]))
            m.setattr(GgmlExperts, "route", lambda self, layer, h, k: products.append(layer) or route(self, layer, h, k))
            m.setattr(ExpertStreamer, "predict", lambda self, layer, ids: guesses.append((layer, np.asarray(ids).tolist())) or predict(self, layer, ids))
            engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=tuple(store), ram_cache=8 * unit))
            list(engine.generate(tokens[:6], 8, SamplingParams.greedy(), stop_at_eog=False))
            engine.close()
        return products, guesses

    products, guesses = decode(with_routing=True)
    products_apart, guesses_apart = decode(with_routing=False)
    assert guesses and guesses == guesses_apart
    assert products_apart and (not products) == fused
