"""Prompts evaluated together (Engine.prefill_many, Transformer.forward_prompts): each prompt's chunks get
the bits they get alone, and the experts they pick are read once for all of them.

A joint pass runs each layer's mixer and each chunk's products per sequence, as alone; only the routed
experts' step is shared: one plan and one read of each selected expert, each chunk's rows computed by a
device call of its own (MoEStep's runs). So on the reference and cpu backends every request's logits
and tokens are its lone run's, bit for bit, with the experts streamed from a store through a small tier.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE
from test_batch import Recording

from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import FomoeError
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store
from fomoepy.sampling import SamplingParams

MODELS = ["qwen3moe_q4_k_m", "qwen35moe_q4_k"]
CHUNK = 4


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    out = {}
    for name in MODELS:
        path = tmp_path_factory.mktemp(name) / "store"
        prepare_store(ORACLE / f"{name}.gguf", [path], progress=False)
        out[name] = path
    return out


def streamed(name: str, store, backend: str, tier_share: float) -> Engine:
    """The model with its experts read from `store`, the tiers at `tier_share` of the experts."""
    probe = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=backend, store=(str(store),), vram_cache=0, ram_cache=0))
    experts = sum(layer.expert_nbytes for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    tier = int(tier_share * experts)
    tiers = {"vram_cache": tier, "ram_cache": tier} if backend == "reference" else {"vram_cache": 0, "ram_cache": tier}
    return Engine(ORACLE / f"{name}.gguf", EngineOptions(backend=backend, threads=1, prefill_chunk=CHUNK, store=(str(store),), **tiers))


def requests(name: str):
    tokens = np.load(ORACLE / f"{name}.tokens.npy").tolist()
    greedy, seeded = SamplingParams.greedy(), SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    # chunks of CHUNK tokens: 9 = 4 + 4 + 1 (the last alone: a one-token chunk is a decode step's path), 3, 6, 2
    return [(tokens[:9], 5, greedy), (tokens[2:5], 4, seeded), (tokens[4:10], 6, greedy), (tokens[1:3], 3, seeded)]


def start(engine, reqs):
    gens = [engine.start(p, n, params) for p, n, params in reqs]
    for g in gens:
        g.sampler = Recording(g.sampler)
    return gens


def run_alone(engine, reqs):
    out = []
    for g in start(engine, reqs):
        tokens = []
        while g.pending:
            first = engine.prefill(g)
        tokens.append(first)
        while not g.finished:
            tokens.append(engine.decode([g])[0])
        out.append((tokens, g.sampler.logits))
    return out


def run_joint(engine, reqs, joint_sizes: list[int]):
    """Every prompt's chunks, those of 2 tokens or more in one pass per step (a one-token chunk alone),
    then each request decoded alone."""
    gens = start(engine, reqs)
    firsts: dict[int, int] = {}
    while any(g.pending for g in gens):
        together = [i for i, g in enumerate(gens) if min(len(g.pending), CHUNK) >= 2]
        single = [i for i, g in enumerate(gens) if len(g.pending) == 1]
        if together:
            joint_sizes.append(len(together))
            for i, t in zip(together, engine.prefill_many([gens[i] for i in together])):
                if t is not None:
                    firsts[i] = t
        for i in single:
            firsts[i] = engine.prefill(gens[i])
    out = []
    for i, g in enumerate(gens):
        tokens = [firsts[i]]
        while not g.finished:
            tokens.append(engine.decode([g])[0])
        out.append((tokens, g.sampler.logits))
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", MODELS)
def test_prompts_evaluated_together_get_their_lone_tokens_and_logits_bit_for_bit(stores, name, backend):
    engine = streamed(name, stores[name], backend, 0.25)
    try:
        assert engine.prefills_jointly
        reqs = requests(name)
        want = run_alone(engine, reqs)
        sizes: list[int] = []
        got = run_joint(engine, reqs, sizes)
    finally:
        engine.close()
    assert max(sizes) >= 3  # the first chunks of three prompts or more in one pass
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
        assert tokens == want_tokens
        assert len(logits) == len(want_logits)
        for a, b in zip(logits, want_logits):
            assert np.array_equal(a, b)


def test_a_joint_pass_reads_each_expert_it_needs_once_for_all_its_prompts(stores, monkeypatch):
    # with no tier every expert a step needs is read, so the reads of a pass are the step's experts: one
    # after another, each prompt's own; together, per layer the union of them
    name = MODELS[0]
    engine = streamed(name, stores[name], "cpu", 0.0)
    reads: list[tuple[int, int]] = []
    real = ExpertStore.submit

    def submit(self, layer, expert, *a, **k):
        reads.append((layer, expert))
        return real(self, layer, expert, *a, **k)

    monkeypatch.setattr(ExpertStore, "submit", submit)
    prompts = [r[0][:CHUNK] for r in requests(name)]
    try:
        separate = []
        for p in prompts:
            before = len(reads)
            engine.prefill(engine.start(p, 0))
            separate.append(set(reads[before:]))
        before = len(reads)
        engine.prefill_many([engine.start(p, 0) for p in prompts])
        joint = reads[before:]
    finally:
        engine.close()
    union = set().union(*separate)
    assert sorted(joint) == sorted(union)  # each expert any prompt needs, read once
    assert len(joint) < sum(len(s) for s in separate)


def test_a_joint_pass_refuses_a_one_token_chunk_and_a_backend_that_cannot(stores):
    name = MODELS[0]
    engine = streamed(name, stores[name], "cpu", 0.25)
    try:
        with pytest.raises(FomoeError, match="at least 2 tokens"):
            engine.prefill_many([engine.start([5, 6, 7], 1), engine.start([8], 1)])
    finally:
        engine.close()
    sim = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="sim", prefill_chunk=CHUNK))
    try:
        assert not sim.prefills_jointly  # (its device computes a step's rows at once: each prompt goes alone)
        a, b = sim.start([5, 6, 7], 1), sim.start([8, 9], 1)
        firsts = sim.prefill_many([a, b])
        assert len(firsts) == 2 and not a.pending and not b.pending
    finally:
        sim.close()


def test_a_joint_pass_traces_each_prompts_rows_with_its_own_sequence_and_tokens(stores, tmp_path):
    # the trace (fomoe simulate, fomoe plan --trace) keeps each prompt's rows apart: a record per prompt
    # and layer, at its rows' first token of the pass, every row with its own sequence; the last layer's
    # records hold the row each prompt's MoE half computes there, its last
    from fomoepy.experts.trace import read_trace

    name = MODELS[0]
    path = tmp_path / "joint.trace"
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=1, prefill_chunk=CHUNK, trace=str(path)))
    prompts = [r[0][:n] for r, n in zip(requests(name), (4, 3, 4))]
    try:
        gens = [engine.start(p, 0) for p in prompts]
        engine.prefill_many(gens)
        sequences = [g.state.sequence for g in gens]
        L = engine.spec.n_layer
    finally:
        engine.close()
    records = read_trace(path).records
    starts = np.cumsum([0] + [len(p) for p in prompts])[:-1].tolist()
    for il in range(L):
        mine = [r for r in records if r.layer == il]
        assert len(mine) == len(prompts)
        for r, p, at, seq in zip(mine, prompts, starts, sequences):
            rows = slice(len(p) - 1, len(p)) if il == L - 1 else slice(0, len(p))
            assert r.token == at + rows.start and r.n_tokens == rows.stop - rows.start
            assert r.sequences.tolist() == [seq] * r.n_tokens


def test_a_joint_pass_replays_as_the_one_step_the_engine_made(stores, tmp_path):
    # fomoe simulate (and fomoe plan --trace) join a pass's records of a layer back into its step: with no
    # tier, where every expert a step needs is read, the replay reads what the engine read
    from fomoepy.experts.simulate import simulate
    from fomoepy.experts.trace import expert_sizes, read_trace

    name = MODELS[0]
    path = tmp_path / "joint.trace"
    engine = Engine(ORACLE / f"{name}.gguf", EngineOptions(backend="cpu", threads=1, prefill_chunk=CHUNK, store=(str(stores[name]),),
                                                           vram_cache=0, ram_cache=0, trace=str(path)))  # fmt: skip
    try:
        engine.prefill_many([engine.start(r[0][:CHUNK], 0) for r in requests(name)])
        read = engine.experts.streamer.cache.stats.summary()["disk"]["reads"]
    finally:
        engine.close()
    trace = read_trace(path)
    replayed = simulate(trace, expert_sizes(trace.header), 0, 0)
    assert replayed.summary["disk"]["reads"] == read > 0
