"""A lone decode row of the cpu backend in one graph a token (fomoepy.runtime.ggml_decode.DecodeToken),
and a batched step of several sequences in one graph (DecodeBatch), against the path that computes
each layer's attention half in one graph (LayerGraph) and its experts in another: the same logits, KV
caches and expert counts, bit for bit, across a span and a cache growth; a prefill chunk's layer graph
against the op-by-op path; and which path runs when."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.device import Phase
from fomoepy.experts.resident_step import ResidentStep
from fomoepy.model.state import KV_CHUNK, KVCache
from fomoepy.model.transformer import Transformer
from fomoepy.runtime import (
    batched_experts,
    ggml_cpu,
    ggml_decode,
    ggml_threads,
    row_attention,
)
from fomoepy.runtime.ggml_attention import BUCKET
from fomoepy.runtime.ggml_experts import GgmlExperts


def run(monkeypatch, path: str, n_prompt: int, n_decode: int) -> tuple:
    """Prefill n_prompt random tokens, decode n_decode → (decode logits, KV caches, expert counts)."""
    engine = Engine(ORACLE / path, EngineOptions(backend="cpu", threads=2, n_ctx=4 * KV_CHUNK))
    rng = np.random.default_rng(11)
    state = engine.new_state()
    engine.eval(state, rng.integers(0, engine.spec.n_vocab, n_prompt))
    logits = [engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in rng.integers(0, engine.spec.n_vocab, n_decode)]
    caches = [(c.k[: state.n_past].copy(), c.v[: state.n_past].copy()) for c in state.layers if isinstance(c, KVCache)]
    counts = engine.experts.streamer.counter.counts.copy()
    tokens = engine.experts.streamer.counter.tokens.copy()
    hits = engine.experts.streamer.cache.stats.summary()["device"]["hits"]
    engine.close()
    return logits, caches, counts, tokens, hits


@pytest.fixture
def spinning(monkeypatch):
    monkeypatch.setattr(ggml_threads, "spins", lambda: True)  # (read when the backend is made)


@pytest.fixture(params=["node", "ggml"])
def attention(request, monkeypatch):
    """A decode row's attention by row_attention's node (where built), or by ggml's nodes (where it is not)."""
    if request.param == "node" and not row_attention.runs():
        pytest.skip("fomoepy.runtime._row_attention is not built")
    if request.param == "ggml":
        monkeypatch.setattr(row_attention, "runs", lambda: False)
    return request.param


@pytest.mark.parametrize("path, embedded", [("qwen3moe_q6_k.gguf", True), ("qwen3moe_q4_k_m.gguf", True), ("qwen3moe_q8_0.gguf", True),
                                             ("qwen3moe_q4_k_m.gguf", False)])  # fmt: skip
def test_one_graph_a_token_and_the_experts_apart_give_the_same_bits(monkeypatch, spinning, attention, path, embedded):
    # from KV_CHUNK - 3: the decode steps cross the first chunk's end (the caches grow) and a span; the
    # models' token embeddings are F16, Q8_0 and F32, each looked up in the token's graph (get_rows),
    # and a Q8_0 one by fomoepy's decoder before it (a type ggml's rows are not known to match)
    if not embedded:
        monkeypatch.setattr(ggml_decode, "EMBEDDED_TYPES", frozenset())
        monkeypatch.setattr(ggml_cpu, "EMBEDDED_TYPES", frozenset())
    looked_up = []
    token_graph = ggml_decode.DecodeToken.__init__

    def noted(self, *args):
        token_graph(self, *args)
        looked_up.append(self.token is not None)

    monkeypatch.setattr(ggml_decode.DecodeToken, "__init__", noted)
    calls = {"token": 0}
    decode_token = Transformer._in_one_call

    def counted(self, *args):
        calls["token"] += 1
        return decode_token(self, *args)

    compute = GgmlExperts.compute

    def prefill_only(self, layer, h, ids, weights, experts):
        assert experts.phase is Phase.PREFILL, "a decode row's experts computed apart from its token's graph"
        return compute(self, layer, h, ids, weights, experts)

    with monkeypatch.context() as m:
        m.setattr(Transformer, "_in_one_call", counted)
        m.setattr(GgmlExperts, "compute", prefill_only)
        whole = run(monkeypatch, path, KV_CHUNK - 3, 6)
    assert calls["token"] == 6 and looked_up and all(e == embedded for e in looked_up)
    with monkeypatch.context() as m:
        m.setattr(ResidentStep, "in_graph", lambda self, layer: None)  # the experts in a graph of their own
        apart = run(monkeypatch, path, KV_CHUNK - 3, 6)
    assert all(np.array_equal(a, b) for a, b in zip(whole[0], apart[0]))
    assert all(np.array_equal(a, b) for pair in zip(whole[1], apart[1]) for a, b in zip(*pair))
    assert np.array_equal(whole[2], apart[2]) and whole[2].sum() > 0
    assert np.array_equal(whole[3], apart[3]) and whole[4] == apart[4] > 0  # tokens counted, hits (the token's bookkeeping)


def test_sequences_taking_turns_through_one_token_graph_each_get_their_bits_alone(spinning, attention):
    # three sequences take turns, two within one span (through the same kept token graph) and one in
    # the next: a graph keeps its cache addresses and row inputs from one call to the next, so a turn
    # must rebind them, the kept row's mask move back as well as forward, and the first span's graph
    # take the new row inputs made after the second span's turn; against each sequence decoded alone,
    # bit for bit
    def engine():
        return Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2, n_ctx=4 * KV_CHUNK))

    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 200, n) for n in (9, 4, BUCKET + 5)]
    steps = rng.integers(0, 200, (5, 3))
    shared = engine()
    states = [shared.new_state() for _ in prompts]
    for state, prompt in zip(states, prompts):
        shared.eval(state, prompt)
    turns = [[shared.decode_token(state, int(t)) for state, t in zip(states, row)] for row in steps]
    assert len(shared.ops._tokens) == 2  # one graph a span
    shared.close()
    for b, prompt in enumerate(prompts):
        alone = engine()
        state = alone.new_state()
        alone.eval(state, prompt)
        assert all(np.array_equal(alone.decode_token(state, int(row[b])), turn[b]) for row, turn in zip(steps, turns))
        alone.close()


@pytest.mark.parametrize("record", ["trace", "car"])
def test_a_tokens_graph_leaves_the_trace_and_cars_record_the_layer_path_leaves(spinning, tmp_path, record):
    # a token's bookkeeping in one call (ResidentStep.computed_pass) is the usage counts alone; with a
    # trace to write or CAR on (it substitutes nothing where every expert is resident, but counts the
    # slots it saw) the step is recorded layer by layer, as the layer path records it
    from fomoepy.experts.car import CarConfig
    from fomoepy.experts.trace import read_trace

    def decode(name: str, apart: bool):
        options = {"trace": str(tmp_path / f"{name}.trace")} if record == "trace" else {"car": CarConfig(threshold=1e-4, dampen=True)}
        engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2, **options))
        if apart:
            engine.experts.in_graph = lambda layer: None  # every layer's graphs and experts apart
        state = engine.new_state()
        engine.eval(state, [3, 1, 4, 1, 5])
        for t in (9, 2, 6, 5):
            engine.decode_token(state, t)
        assert len(engine.ops._tokens) == (0 if apart else 1)
        car = dict(engine.experts.streamer.car_stats.per_layer)
        engine.close()
        if record == "car":
            return car
        return [(r.token, r.layer, r.ids.tolist(), r.probs.tolist()) for r in read_trace(tmp_path / f"{name}.trace").records]

    whole, apart = decode("whole", False), decode("apart", True)
    assert whole == apart and len(whole) > 0


def run_batch(prompts: list[int], n_decode: int, path: str = "qwen3moe_q6_k.gguf") -> tuple:
    """Prefill a random prompt of each length, one sequence each, then decode n_decode batched steps of
    all of them → (each step's logits [B, V], each sequence's KV caches, expert counts)."""
    engine = Engine(ORACLE / path, EngineOptions(backend="cpu", threads=2, n_ctx=4 * KV_CHUNK))
    rng = np.random.default_rng(12)
    states = [engine.new_state() for _ in prompts]
    for state, n in zip(states, prompts):
        engine.eval(state, rng.integers(0, engine.spec.n_vocab, n))
    logits = [engine.model.forward_batch(rng.integers(0, engine.spec.n_vocab, len(states)), states) for _ in range(n_decode)]
    caches = [(c.k[: s.n_past].copy(), c.v[: s.n_past].copy()) for s in states for c in s.layers if isinstance(c, KVCache)]
    counts = engine.experts.streamer.counter.counts.copy()
    hits = engine.experts.streamer.cache.stats.summary()["device"]["hits"]  # (a step's hits: its rows' union)
    engine.close()
    return logits, caches, counts, hits


@pytest.mark.parametrize("path", ["qwen3moe_q6_k.gguf", "qwen3moe_q4_k_m.gguf"])  # F16 dense weights; Q8_0 ones (dense_rows' node)
def test_a_batched_step_is_one_graph_and_each_row_gets_the_layer_paths_bits(monkeypatch, spinning, attention, path):
    # three sequences at different positions: the first crosses its first chunk's end (its caches grow)
    # and a span, the third a span, at different steps; each step one graph (DecodeBatch), its experts
    # never computed apart; against the layer-by-layer batched step, bit for bit
    calls = {"batch": 0}
    one_call = Transformer._batch_in_one_call

    def counted(self, *args):
        out = one_call(self, *args)
        calls["batch"] += out is not None
        return out

    compute = GgmlExperts.compute

    def prefill_only(self, layer, h, ids, weights, experts):
        assert experts.phase is Phase.PREFILL, "a batched step's experts computed apart from its graph"
        return compute(self, layer, h, ids, weights, experts)

    prompts = [KV_CHUNK - 3, 5, 62]
    with monkeypatch.context() as m:
        m.setattr(Transformer, "_batch_in_one_call", counted)
        m.setattr(GgmlExperts, "compute", prefill_only)
        whole = run_batch(prompts, 6, path)
    assert calls["batch"] == 6
    with monkeypatch.context() as m:
        m.setattr(ResidentStep, "in_graph", lambda self, layer: None)  # every layer's graphs and experts apart
        apart = run_batch(prompts, 6, path)
    assert all(np.array_equal(a, b) for a, b in zip(whole[0], apart[0]))
    assert all(np.array_equal(a, b) for pair in zip(whole[1], apart[1]) for a, b in zip(*pair))
    assert np.array_equal(whole[2], apart[2]) and whole[2].sum() > 0
    assert whole[3] == apart[3] > 0
    # the batched kernel's steps of more picks than its call takes, in parts of rows (graph and layer paths)
    with monkeypatch.context() as m:
        m.setattr(ggml_decode, "MAX_PICKS", 8)  # (this model's rows pick 4 experts each: parts of 2 rows)
        m.setattr(batched_experts, "MAX_PICKS", 8)
        parts = run_batch(prompts, 6, path)
        m.setattr(ResidentStep, "in_graph", lambda self, layer: None)
        parts_apart = run_batch(prompts, 6, path)
    for got in (parts, parts_apart):
        assert all(np.array_equal(a, b) for a, b in zip(whole[0], got[0]))


def test_a_token_is_one_graph_only_where_every_layers_experts_are_resident_and_no_step_is_timed(spinning):
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2))
    assert engine.model._graph_layers() is not None
    engine.decode_token(engine.new_state(), 1)
    assert len(engine.ops._tokens) == 1
    engine.close()
    capped = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2, ram_cache=0))  # every expert read
    assert capped.model._graph_layers() is None
    capped.decode_token(capped.new_state(), 1)
    assert not capped.ops._tokens and capped.model.experts.in_graph(0) is None  # its steps plan, read and evict
    capped.close()
    timed = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2, profile_timing=True))
    timed.decode_token(timed.new_state(), 1)
    assert not timed.ops._tokens and timed.model.experts.in_graph(0) is None  # a graph has no host phases to time
    timed.close()


def test_with_no_thread_count_a_tokens_graph_runs_on_the_count_measured_faster_with_the_same_bits(spinning):
    # no -t: the engine's RowThreads times the token's graph on 1 thread and on all, in turns, then keeps
    # the faster (a thread count never changes a product's bits)
    from fomoepy.runtime.row_threads import RowThreads

    runs = []
    for tuned in (False, True):
        engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2))
        if tuned:
            engine.ops.row_threads = RowThreads(2, samples=2)
        state = engine.new_state()
        engine.eval(state, [1, 2, 3])
        runs.append([engine.eval(state, [t], phase=Phase.DECODE)[-1] for t in range(4, 12)])
        if tuned:
            assert engine.ops.row_threads.chosen.get(("token",)) in (1, 2)  # measured both, then chose
        engine.close()
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_a_prefill_chunks_layer_graph_is_the_op_by_op_path_bit_for_bit(monkeypatch):
    # chunks of one sequence through each layer's one graph (LayerGraph) or op by op: the same logits and
    # KV caches, with chunks that cross a span and the first chunk's end (the caches grow)
    from fomoepy.runtime.ggml_cpu import GgmlBackend

    real = GgmlBackend.prefill_layer
    runs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            calls: list[int] = []
            if fused:
                m.setattr(GgmlBackend, "prefill_layer", lambda self, *a, calls=calls: calls.append(1) or real(self, *a))
            else:
                m.delattr(GgmlBackend, "prefill_layer")
            engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2, n_ctx=4 * KV_CHUNK))
            rng = np.random.default_rng(12)
            state = engine.new_state()
            logits = [engine.eval(state, rng.integers(0, engine.spec.n_vocab, n), all_logits=True) for n in (70, 100, 130)]
            caches = [(c.k[: state.n_past].copy(), c.v[: state.n_past].copy()) for c in state.layers if isinstance(c, KVCache)]
            assert state.kv_capacity == 2 * KV_CHUNK and (len(calls) == 3 * engine.spec.n_layer if fused else not calls)
            runs.append((logits, caches))
            engine.close()
    (a, ka), (b, kb) = runs
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert all(np.array_equal(x, y) for pair in zip(ka, kb) for x, y in zip(*pair))


def test_a_step_record_asked_for_after_load_turns_the_one_graph_token_off(spinning):
    # host_time and other benches ask the MoE step for its records once the engine is up: every step must
    # then run as a step, with its phases timed
    engine = Engine(ORACLE / "qwen3moe_q6_k.gguf", EngineOptions(backend="cpu", threads=2))
    state = engine.new_state()
    engine.decode_token(state, 1)
    engine.experts.records = []
    engine.decode_token(state, 2)
    assert len(engine.experts.records) == engine.spec.n_layer
    engine.close()


def test_a_batch_reads_every_sequence_over_its_widest_span_in_one_graph_with_each_ones_lone_bits(monkeypatch, spinning, attention, tmp_path):
    # three sequences in three BUCKETs decode together; the first crosses into its second BUCKET midway.
    # By ggml's attention nodes each reads the batch's widest span (batch_spans: 192 throughout), so one
    # graph serves every step (the first's own span changes midway), and each row gets the bits it gets
    # alone over its own span; by row_attention's node a graph serves any positions
    from fomoepy.devtools.make_test_model import make_model

    path = tmp_path / "hd64.gguf"
    make_model(path, preset="tiny-qwen3moe-q4km", head_dim=64)
    built = []
    monkeypatch.setattr(ggml_cpu, "DecodeBatch", lambda *a, **k: built.append(1) or ggml_decode.DecodeBatch(*a, **k))
    engine = Engine(path, EngineOptions(backend="cpu", threads=2))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, engine.spec.n_vocab, n) for n in (BUCKET - 3, BUCKET + 9, 2 * BUCKET + 2)]
    steps = rng.integers(0, engine.spec.n_vocab, (6, 3))
    states = [engine.new_state() for _ in prompts]
    for state, prompt in zip(states, prompts):
        engine.eval(state, prompt)
    together = [engine.model.forward_batch(row, states) for row in steps]
    assert len(built) == 1
    for b, prompt in enumerate(prompts):
        state = engine.new_state()
        engine.eval(state, prompt)
        alone = [engine.eval(state, [int(row[b])], phase=Phase.DECODE)[-1] for row in steps]
        assert all(np.array_equal(a, t[b]) for a, t in zip(alone, together)), b
    engine.close()
