"""A decode step over several sequences: each request's tokens and logits are those it gets alone
(sequences joining and leaving mid-batch, greedy and seeded sampling, attention and DeltaNet models);
KV caches that grow by chunks; the KV budget's admission rule.

Alone and batched run the same engine steps (prompt chunks, then decode steps); only the decode steps
differ, by the rows beside each sequence's own. On the reference backend the dense products give each
row its own bits (RowwiseOps), and in a decode step so do the routed experts' (fomoepy.runtime.
cpu_experts multiplies a decode step's rows one at a time): a batched request is its lone run bit for
bit. On the cpu backend (ggml) every product of a decode step is row by row (each output element one
dot product of its row's own Q8 activations; no product of more rows than ggml keeps each row's bits
in: its tiled K-quant GEMM takes eight or more), so a batched request is its lone run bit for bit there
too. A prefill's rows share one GEMM per expert.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import ORACLE
from float32_bounds import reorder_bound

from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.model.state import KV_CHUNK, ContextFullError
from fomoepy.sampling import SamplingParams
from fomoepy.serve.kv_budget import KVBudget

F32 = np.float32
MODELS = ["qwen3moe_q4_k_m", "qwen35moe_q4_k"]


GPUS = ("sim", "cuda", "hip")  # the simulated device runs the GPU kernels' source; a real one, marked gpu


@pytest.fixture(scope="module", params=[(m, b) for m in MODELS for b in ("reference", "cpu", "sim")]
                + [pytest.param((m, "device"), marks=pytest.mark.gpu) for m in MODELS], ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def engine(request):
    name, backend = request.param
    backend = os.environ.get("FOMOEPY_TEST_GPU", "cuda") if backend == "device" else backend
    try:
        e = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=backend, threads=1, prefill_chunk=4))
    except FomoeError as err:
        pytest.skip(f"no GPU device ({str(err)[:90]}...)")
    yield e
    e.close()


class Recording:
    """A sampler that keeps every logits row it is given (the request's view of each step)."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def __call__(self, logits, history):
        self.logits.append(np.array(logits, copy=True))
        return self.sampler(logits, history)


def requests(engine):
    tokens = np.load(ORACLE / f"{engine.file.path.stem}.tokens.npy").tolist()
    greedy, seeded = SamplingParams.greedy(), SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    # (prompt, max_tokens, params, the schedule step at which it joins)
    return [(tokens[:9], 12, greedy, 0), (tokens[2:5], 5, seeded, 2), (tokens[4:15], 9, greedy, 3), (tokens[1:2], 7, seeded, 6)]


def alone(engine, prompt, n, params):
    gen = engine.start(prompt, n, params)
    gen.sampler = Recording(gen.sampler)
    out = [t for t in _drive(engine, [gen])]
    return out, gen.sampler.logits


def _drive(engine, gens):
    while gens[0].pending:
        t = engine.prefill(gens[0])
    yield t
    while not gens[0].finished:
        yield engine.decode(gens)[0]


def batched(engine, reqs):
    """The worker's schedule: each step, one decode step for every generation past its prompt and one
    prompt chunk of one newcomer; requests join at their step and leave when they finish."""
    gens, out, step = [], [[] for _ in reqs], 0
    while step < 100 and (len(gens) < len(reqs) or any(not g.finished for g in gens)):
        for prompt, n, params, at in reqs[len(gens) :]:
            if at <= step:
                g = engine.start(prompt, n, params)
                g.sampler = Recording(g.sampler)
                gens.append(g)
        live = [i for i, g in enumerate(gens) if not g.finished and not g.pending and g.next_token is not None]
        for i, token in zip(live, engine.decode([gens[i] for i in live]) if live else []):
            out[i].append(token)
        newcomer = next((i for i, g in enumerate(gens) if g.pending), None)
        if newcomer is not None:
            first = engine.prefill(gens[newcomer])
            if first is not None:
                out[newcomer].append(first)
        step += 1
    assert all(g.finished for g in gens)
    return out, [g.sampler.logits for g in gens]


def test_rows_of_the_batch_met_other_rows(engine):
    # the schedule is a real batch: some decode steps carry three or four sequences at once
    if engine.options.backend == "sim":
        pytest.skip("checked inside the bit-for-bit test below (the simulated device is slow)")
    sizes = []
    decode = engine.decode
    engine.decode = lambda gens: sizes.append(len(gens)) or decode(gens)
    try:
        batched(engine, requests(engine))
    finally:
        del engine.decode
    assert max(sizes) >= 3


def test_each_request_in_a_batch_gets_its_lone_tokens_and_logits_within_two_summation_orders(engine):
    if engine.options.backend in GPUS:
        pytest.skip("the GPU kernels give the lone run's bits: the test below")
    reqs = requests(engine)
    got, got_logits = batched(engine, reqs)
    for (prompt, n, params, _), tokens, logits in zip(reqs, got, got_logits):
        want, want_logits = alone(engine, prompt, n, params)
        assert tokens == want
        assert len(logits) == len(want_logits)
        for a, b in zip(logits, want_logits):
            # the MoE half's GEMM against its one-row GEMV: two orders of the same sums
            bound = reorder_bound(engine.spec, len(prompt) + n) * np.abs(b).max()
            assert np.abs(a - b).max() <= bound


def test_a_batched_request_is_its_lone_run_bit_for_bit(engine):
    # the GPU's kernels sum each row's products in the same order alone and in a batch (its matvec's
    # tile of rows shares weight loads, not sums; the experts' tables add a token's pairs in its order);
    # cpu: a batched step's dense graphs and head are row by row (ggml_dense, ggml_cpu.linear_rows) and
    # its experts one mul_mat_id whose rows each go alone (ggml_slots)
    reqs = requests(engine)
    sizes = []
    decode = engine.decode
    engine.decode = lambda gens: sizes.append(len(gens)) or decode(gens)
    try:
        got, got_logits = batched(engine, reqs)
    finally:
        del engine.decode
    assert max(sizes) >= 3  # a real batch
    for (prompt, n, params, _), tokens, logits in zip(reqs, got, got_logits):
        want, want_logits = alone(engine, prompt, n, params)
        assert tokens == want
        assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits))


@pytest.mark.parametrize("kernel", ["auto", "ggml"])  # fomoepy's batched expert kernel where it serves; ggml's products
@pytest.mark.parametrize("tier", ["every expert", "a third of them"])
@pytest.mark.parametrize("name", MODELS)
def test_nine_rows_that_pick_the_same_experts_each_get_their_lone_bits_on_the_cpu_backend(name, tier, kernel):
    # nine sequences of one prompt: every expert a step computes is picked by all nine rows, and every
    # dense product has nine rows, past the eight from which ggml's tiled K-quant GEMM takes them (and
    # sums otherwise than each row's own product): the batch keeps its products under that (ggml_matmul.
    # rows_apart_from, ggml_slots.picks_apart_from), so each row is still its lone run's, bit for bit.
    # Every expert in the tier: the decode graph's products (repacked slots under ggml's, past eight rows in
    # parts); a third: the MoE step's (plain slots, misses staged)
    path = ORACLE / f"{name}.gguf"
    full = Engine(path)
    third = None if tier == "every expert" else sum(l.expert_nbytes for l in full.source.layers) * full.spec.moe.n_expert // 3
    e = Engine(path, EngineOptions(backend="cpu", threads=1, ram_cache=third, expert_kernel=kernel))
    prompt = np.load(ORACLE / f"{name}.tokens.npy").tolist()[:6]
    _, want_logits = alone(e, prompt, 4, SamplingParams.greedy())
    got = together(e, [prompt] * 9, 4)  # every decode step of the nine together, at one position
    e.close()
    for logits in got:
        assert len(logits) == len(want_logits) == 4
        assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits))


def together(e, prompts, n):
    """Each prompt prefilled alone, then every decode step of all of them together (greedy, n tokens each)
    → each sequence's logits, step by step."""
    gens = [e.start(p, n, SamplingParams.greedy()) for p in prompts]
    for g in gens:
        g.sampler = Recording(g.sampler)
        while g.pending:
            e.prefill(g)
    while not gens[0].finished:
        e.decode(gens)
    return [g.sampler.logits for g in gens]


def test_a_full_context_refuses_the_batched_step_before_any_state_moves():
    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(n_ctx=6))
    a, b = e.start([1, 2, 3], 5, SamplingParams.greedy()), e.start([1, 2, 3, 4, 5], 5, SamplingParams.greedy())
    e.prefill(a), e.prefill(b)
    e.decode([a, b])
    assert b.finished and b.state.n_past == 6 and not a.finished  # b's context is full: it ends there
    before = (a.state.n_past, b.state.n_past)
    with pytest.raises(ContextFullError):
        e.model.forward_batch(np.array([7, 7]), [a.state, b.state])
    assert (a.state.n_past, b.state.n_past) == before
    with pytest.raises(ValueError, match="twice"):
        e.model.forward_batch(np.array([7, 7]), [a.state, a.state])


def test_kv_caches_grow_by_chunks_and_keep_their_past():
    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(n_ctx=2 * KV_CHUNK + 10))
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    stream = np.resize(tokens, 2 * KV_CHUNK + 4)
    grown, full = e.new_state(), e.new_state()
    full.reserve(full.n_ctx)  # every position up front, as before
    assert grown.kv_capacity == KV_CHUNK and full.kv_capacity == full.n_ctx
    capacities = []
    for chunk in np.array_split(stream, 7):  # chunks that cross both chunk boundaries
        assert np.array_equal(e.eval(grown, chunk, all_logits=True), e.eval(full, chunk, all_logits=True))
        capacities.append(grown.kv_capacity)
    assert capacities == sorted(capacities) and capacities[0] == KV_CHUNK and capacities[-1] == grown.n_ctx
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in grown.layers)
    assert held == e.kv_nbytes(grown.n_past)


def test_a_states_bytes_are_what_kv_nbytes_says_deltanet_included():
    e = Engine(ORACLE / "qwen35moe_q4_k.gguf")
    s = e.new_state()
    e.eval(s, [1, 2, 3])
    held = sum(a.nbytes for layer in s.layers for a in vars(layer).values() if isinstance(a, np.ndarray))
    assert held == e.kv_nbytes(3) and e.kv_nbytes(KV_CHUNK + 1) > e.kv_nbytes(KV_CHUNK)


def test_the_kv_budget_refuses_what_can_never_fit_and_admits_by_what_is_left():
    per_token = 1000
    budget = KVBudget(10_000, lambda n: per_token * n, n_ctx=8)
    assert budget.refusal(4, 4) is None and budget.worst_tokens(4, 100) == 8  # capped at the context
    small = KVBudget(5_000, lambda n: per_token * n, n_ctx=8)
    why = small.refusal(3, 4)
    assert why == ("up to 7 tokens (3 prompt + max_tokens 4, context 8) need 0.0 MiB of KV cache, more than the "
                   "daemon's KV budget of 0.0 MiB (--kv-budget)")  # fmt: skip
    budget.reserve("a", 6)
    assert budget.can_reserve("b", 4) and not budget.can_reserve("b", 5)
    budget.hold_only("a", 2_000)  # paused: only what its state holds
    assert budget.can_reserve("b", 8)
    budget.release("a")
    assert budget.reserved == 0 and "a" not in budget
    with pytest.raises(ValueError):
        KVBudget(5_000, lambda n: per_token * n, 8).reserve("x", 6)


def test_generation_refuses_bad_input_with_one_clear_error(engine):
    with pytest.raises(FomoeError, match="max_tokens must be >= 0"):
        engine.start([1], -1)
    with pytest.raises(FomoeError, match="the prompt is empty"):
        engine.start([], 3)
    with pytest.raises(ContextFullError):
        engine.start([1] * (engine.n_ctx + 1), 3)
    with pytest.raises(FomoeError, match="expected generations in decode"):
        engine.decode([engine.start([1, 2], 3)])


def test_the_default_kv_budget_holds_one_full_context_at_least_and_the_batch_at_most(monkeypatch):
    from fomoepy.runtime import available_memory
    from fomoepy.serve.worker import default_kv_budget

    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf")
    full = e.kv_nbytes(e.n_ctx)
    monkeypatch.setattr(available_memory, "available_memory_bytes", lambda: 1 << 40)
    assert default_kv_budget(e, 8) == 8 * full
    monkeypatch.setattr(available_memory, "available_memory_bytes", lambda: 4 * 3 * full)
    assert default_kv_budget(e, 8) == 3 * full  # a quarter of what is available
    monkeypatch.setattr(available_memory, "available_memory_bytes", lambda: 0)
    assert default_kv_budget(e, 8) == full  # one request with the whole context always fits


def test_on_a_gpu_the_automatic_device_tier_leaves_room_for_max_batch_states_and_the_budget_keeps_within_it(monkeypatch):
    # the sequences' KV caches and recurrent states live in a GPU's memory: the device tier sized automatically
    # leaves --max-batch full contexts' worth (EngineOptions.sequences), and the daemon's default KV budget
    # admits what the tier left, not a share of the host's memory
    from fomoepy.runtime import available_memory
    from fomoepy.runtime.shim import DriverShim
    from fomoepy.serve.worker import default_kv_budget

    monkeypatch.setattr(available_memory, "available_memory_bytes", lambda: 1 << 40)
    probe = Engine(ORACLE / "qwen35moe_q4_k.gguf", EngineOptions(backend="sim", vram_cache=0))
    full, dense = probe.kv_nbytes(probe.n_ctx), probe._dense_bytes()
    every = sum(probe.experts.device.expert_nbytes(layer.layer) for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    free = 2 * dense + (1 << 30) + every // 2 + 4 * full  # the tier's share and the states' (Engine._device_free)
    monkeypatch.setattr(DriverShim, "mem_info", lambda self: (free, free))
    for sequences, tier, room in ((1, every // 2 + 3 * full, full), (4, every // 2, 4 * full)):
        e = Engine(ORACLE / "qwen35moe_q4_k.gguf", EngineOptions(backend="sim", sequences=sequences))
        assert e.experts.streamer.cache.device.capacity == tier and e.device_state_room == room
        assert default_kv_budget(e, 8) == room
        e.close()


def test_a_batched_decode_step_is_one_tick_of_the_policies_time_whatever_its_rows():
    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(threads=1))
    gens = [e.start([1, 2, 3 + i], 4, SamplingParams.greedy()) for i in range(3)]
    for g in gens:
        e.prefill(g)
    cache, streamer = e.experts.streamer.cache, e.experts.streamer
    now, seen = cache.now, streamer.tokens_seen
    e.decode(gens)
    assert cache.now == now + 1  # half-lives are in steps: they do not shrink as a batch grows
    assert streamer.tokens_seen == seen + 3  # the trace and CAR's warm-up still count tokens


def test_a_batched_trace_replays_to_the_engines_own_counters(tmp_path):
    # requests joining and leaving a batch, tiers capped (lfu-cooc, so co-use is learned per sequence):
    # the trace records each row's sequence and the policies' time (a batched step is one tick), and the
    # simulator's replay of it makes the engine's own decisions, counter for counter
    from fomoepy.experts.simulate import simulate
    from fomoepy.experts.trace import read_trace

    trace_path = tmp_path / "batch.trace"
    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(backend="reference", prefill_chunk=4, trace=str(trace_path)))
    cache = e.experts.streamer.cache
    sizes, device_sizes = cache.expert_bytes, cache.device_expert_bytes
    e.close()
    device, host = 5 * device_sizes[0], 6 * sizes[0]
    e = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(backend="reference", prefill_chunk=4, vram_cache=device,
                                                               ram_cache=host, trace=str(trace_path)))  # fmt: skip
    device_sizes = e.experts.streamer.cache.device_expert_bytes  # (with a host tier, the device keeps store bytes too)
    batched(e, requests(e))
    measured = e.stats()["cache"]
    e.close()
    trace = read_trace(trace_path)
    assert any(r.sequences is not None and len(set(r.sequences.tolist())) > 1 for r in trace.records)
    assert any(r.now is not None and r.now != r.token for r in trace.records)
    replay = simulate(trace, sizes, device, host, device_expert_bytes=device_sizes).summary
    counted = ("hits", "misses", "admitted", "evicted", "demoted")
    for tier in ("device", "host"):
        assert {c: measured[tier][c] for c in counted} == {c: replay[tier][c] for c in counted}, tier


@pytest.mark.parametrize("kernel", ["auto", "ggml"])  # the experts by fomoepy's batched kernel where it serves; by ggml's
@pytest.mark.parametrize("dense", ["Q4_K", "Q6_K"])
def test_k_quant_dense_weights_keep_each_rows_lone_bits_in_a_batch(tmp_path, dense, kernel):
    # a Q4_K_M model's attention and output weights are K-quants where their rows are long enough (no
    # oracle model has them): a batched step's products with them are ggml's one-row products, apart from
    # two rows on (rows_go_apart), so nine sequences at nine positions each get their lone bits, past the
    # eight rows from which ggml's tiled K-quant GEMM would sum otherwise (under ggml's expert products the
    # decode graph takes the nine rows' experts in two products)
    from gguf import GGMLQuantizationType

    from fomoepy.devtools.make_test_model import make_model

    path = tmp_path / f"dense-{dense}.gguf"
    make_model(path, preset="tiny-qwen3moe-q4km", dense_type=GGMLQuantizationType[dense])
    e = Engine(path, EngineOptions(backend="cpu", threads=2, expert_kernel=kernel))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, e.spec.n_vocab, 2 + i).tolist() for i in range(9)]
    wants = [alone(e, p, 3, SamplingParams.greedy())[1] for p in prompts]
    got = together(e, prompts, 3)
    e.close()
    for logits, want in zip(got, wants):
        assert len(logits) == len(want) == 3
        assert all(np.array_equal(a, b) for a, b in zip(logits, want))
