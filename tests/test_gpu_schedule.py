"""The GPU step's schedule on the simulated device (fomoepy.runtime.gpu_experts): what is issued before
what, proved by order rather than by time. With deferred streams a stream runs its work only when a sync
or an event needs it, and a held read lands only when the test lets it, so each test holds something back
and names what let it go: the awaited event, or running out of patience (the schedule is wrong).

  - experts already in device slots are computed (both stages) before any missing expert's copy is issued;
  - a step that splits its experts that way computes the bits one launch over all of them computes;
  - the next layer's predicted reads are issued before this layer's expert kernels and are still in
    flight when those kernels run (the CPU path's twin: test_streaming_reads.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import ORACLE
from sim_backend import sim_backend

from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.device import Phase
from fomoepy.experts.routing import Routing
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.experts.step import MoEStep
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.options import EngineOptions

NAME = "qwen3moe_q4_k_m"  # 16 experts, top-4
PATIENCE = 10.0  # seconds a held read waits for its event before it lets itself go (the test then fails)


class HeldSource:
    """An expert source read by a pool of threads (as the store's submit is); the read of `held` waits
    until release() or PATIENCE seconds, and the first thing that let it go is kept."""

    def __init__(self, source):
        self.source = source
        self.layers = source.layers
        self.pool = ThreadPoolExecutor(4)
        self.held: set[tuple[int, int]] = set()
        self.gate = threading.Event()
        self.released_by: str | None = None
        self.submitted: list[tuple[int, int]] = []

    def read(self, layer, expert):
        return self.source.read(layer, expert)

    def submit(self, layer, expert, out=None):
        self.submitted.append((layer, expert))
        return self.pool.submit(self._read, layer, expert, out)

    def _read(self, layer, expert, out):
        if (layer, expert) in self.held and not self.gate.wait(PATIENCE):
            self.release("patience")
        return self.source.read(layer, expert) if out is None else self.source.read_into(layer, expert, out)

    def release(self, by: str) -> None:
        if self.released_by is None:
            self.released_by = by
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.source, name)


def layer0_step(device_slots: int, host_experts: int = 0):
    """The MoE step over the first oracle model's layer 0 with GpuExperts on the simulated device, a
    device tier of `device_slots` experts, a host tier of `host_experts` (none by default), every read
    through a HeldSource."""
    from fomoepy.runtime.gpu_experts import GpuExperts, gpu_expert_nbytes

    gf = GGUFFile(ORACLE / f"{NAME}.gguf")
    spec = ModelSpec.from_gguf(gf)
    source = HeldSource(GGUFExpertSource(gf, spec))
    unit = [gpu_expert_nbytes(layer) for layer in source.layers]
    cache = ExpertCache(spec.moe.n_expert, [layer.expert_nbytes for layer in source.layers], unit[0] * device_slots,
                        source.layers[0].expert_nbytes * host_experts, device_expert_bytes=unit)  # fmt: skip
    device = GpuExperts(source.layers, sim_backend())
    streamer = ExpertStreamer(source, cache, spec.moe.n_expert_used, EngineOptions(prefetch=False))
    return MoEStep(streamer, device, predicts=False), spec, source


def step_input(spec, ids: list[list[int]], seed: int):
    """h [T, D] and a routing of T tokens onto `ids` (each row k distinct experts), random weights."""
    rng = np.random.default_rng(seed)
    E = spec.moe.n_expert
    ids_a = np.array(ids, np.int64)
    w = rng.dirichlet(np.ones(ids_a.shape[1]), ids_a.shape[0]).astype(np.float32)
    h = rng.standard_normal((len(ids), spec.n_embd)).astype(np.float32)
    return h, Routing(ids_a, w, np.full((len(ids), E), 1 / E, np.float32))


def run(step: MoEStep, h, exact) -> np.ndarray:
    step.begin_step(Phase.DECODE if len(h) == 1 else Phase.PREFILL)
    out = np.asarray(step(0, h, exact))
    step.end_step(len(h))
    return out


def expert_launches(dev, log: list, then=None):
    """Log every expert kernel dev launches (name); then(name) runs after each."""
    real = dev.launch

    def launch(name, *args, **kw):
        real(name, *args, **kw)
        if name.startswith("moe_"):
            log.append(name)
            if then is not None:
                then(name)

    dev.launch = launch


def is_down_stage(name: str) -> bool:
    """moe_down_<type>: the down stage on its own (not moe_down_sum_<type>, which sums every pair too)."""
    return name.startswith("moe_down_") and not name.startswith("moe_down_sum_")


# token rows of the step under test, and the experts a first step puts into the device tier
SPLITS = {
    1: ([[1, 4, 9, 12]], [[4, 12, 13, 14]]),  # decode: 4 and 12 in slots, 1 and 9 copied up
    3: ([[0, 2, 5, 7], [2, 3, 5, 11], [7, 8, 0, 15]], [[2, 7, 9, 10]]),  # a few tokens: the fused sum when not split
    6: ([[0, 1, 2, 3], [1, 2, 3, 4], [5, 1, 6, 2], [7, 8, 9, 1], [3, 10, 2, 11], [12, 13, 1, 14]], [[1, 2, 3, 15]]),
}


@pytest.mark.parametrize("T", sorted(SPLITS))
def test_a_step_split_between_slots_and_copies_computes_the_bits_of_one_launch_over_all(T):
    """The experts in slots launched first and the copied ones after, then one combine: each pair's
    activations and down output are written once and a token's pairs are summed in the same order, so
    the output is bit for bit the output of the same step with every expert in a slot already (one
    grouped launch per stage; for up to 4 tokens the fused down + weighted-sum kernel)."""
    ids, warm = SPLITS[T]
    split, spec, _ = layer0_step(device_slots=8)
    whole, _, _ = layer0_step(device_slots=16)
    h, exact = step_input(spec, ids, seed=T)
    run(whole, h, exact)  # every expert of the step into a slot
    run(split, *step_input(spec, warm, seed=98))  # some of them
    chosen = {e for row in ids for e in row}
    assert 0 < sum((0, e) in split.device.resident for e in chosen) < len(chosen)  # the step is split
    launched: tuple[list, list] = ([], [])
    uploads = whole.device.uploads
    for step, log in zip((whole, split), launched):
        expert_launches(step.device.dev, log)
        try:
            got = run(step, h, exact)
        finally:
            del step.device.dev.launch
        if step is whole:
            want = got
    assert whole.device.uploads == uploads and len(launched[0]) == (2 if T <= 4 else 3)  # one launch per stage
    # the slots' experts' two stages, two more for each stretch of copied experts launched, one combine
    assert len(launched[1]) >= 5 and len(launched[1]) % 2 == 1 and launched[1].count("moe_combine") == 1
    assert launched[1][-1] == "moe_combine"
    assert np.array_equal(got, want)
    split.close()
    whole.close()


def step_with_9_held():
    """layer0_step with 4, 12, 13 and 14 in slots and the read of expert 9 held; the copies up it issues
    are logged (their sizes, in order) until the caller deletes rt.htod: (step, spec, source, copies)."""
    step, spec, source = layer0_step(device_slots=8)
    run(step, *step_input(spec, [[4, 12, 13, 14]], seed=1))  # 4, 12, 13, 14 into slots
    dev, rt = step.device.dev, step.device.dev.rt
    source.held = {(0, 9)}
    copies: list[int] = []
    real_htod = rt.htod

    def htod(dst, src, nbytes, stream):
        if stream is dev.copy_stream:
            copies.append(nbytes)
        return real_htod(dst, src, nbytes, stream)

    rt.htod = htod
    return step, spec, source, copies


def decode_1_4_9_12(step, spec, source, after):
    """One decode step onto experts 1, 4, 9 and 12, after(name) run after each expert kernel's launch;
    the logging of step_with_9_held undone and the held read let go after: (output, the expert kernels
    launched, (h, routing))."""
    dev = step.device.dev
    log: list[str] = []
    expert_launches(dev, log, after)
    h, exact = step_input(spec, [[1, 4, 9, 12]], seed=2)
    try:
        got = run(step, h, exact)
    finally:
        del dev.rt.htod, dev.launch
        source.release("the end")
    return got, log, (h, exact)


def all_in_slots(spec, h, exact) -> np.ndarray:
    """The same step with every expert already in a slot: the output a split step must give bit for bit."""
    whole, _, _ = layer0_step(device_slots=16)
    run(whole, *step_input(spec, [[1, 4, 9, 12]], seed=3))
    try:
        return run(whole, h, exact)
    finally:
        whole.close()


def test_experts_in_slots_are_computed_before_a_missing_experts_copy_is_issued(deferred):
    """A decode step with two experts in slots and two read from disk, one of whose reads is held: the
    experts in slots go through gate/up and down, and their kernels run (a sync of the compute stream
    runs them, deferred), while no copy of the step's misses has been issued, let alone completed. Only
    then is the held read let go. A step that waits for its copies first never gets there: its held
    read runs out of patience."""
    step, spec, source, copies = step_with_9_held()
    device = step.device
    dev, rt = device.dev, device.dev.rt
    seen: list[tuple[str, int, bool]] = []  # (kernel, copies issued so far, the held read let go)

    def after(name):
        seen.append((name, len(copies), source.gate.is_set()))
        if is_down_stage(name) and source.released_by is None:
            rt.sync(dev.stream)  # deferred: the launches queued so far run now
            seen.append(("ran", len(copies), source.gate.is_set()))
            source.release("the experts in slots were computed")

    got, log, (h, exact) = decode_1_4_9_12(step, spec, source, after)
    assert source.released_by == "the experts in slots were computed"
    assert [s[0] for s in seen[:3]] == [log[0], log[1], "ran"] and is_down_stage(log[1])  # both stages, run
    assert all(n == 0 and not let_go for _, n, let_go in seen[:3])  # before any copy of a miss, held read held
    assert len(copies) == 2 and device.uploads == 6  # then the misses, 1 and 9, were copied up
    assert np.array_equal(got, all_in_slots(spec, h, exact))  # and computed after their copies, on the device
    step.close()


@pytest.mark.parametrize("ids", [[1, 4, 9, 12], [4, 12, 13, 14]])
def test_the_experts_in_slots_are_launched_before_the_steps_cache_plan(ids, deferred):
    """A decode step's experts in slots (4 and 12, then all four) are launched as soon as its reads are
    issued, before its cache plan and evictions: the device computes them from there, not from the end
    of the host's plan (GpuExperts.begin). The misses' rows of the tables, which that launch leaves
    empty, are filled before their own launches: the output is the all-in-slots step's, bit for bit."""
    step, spec, source = layer0_step(device_slots=8)
    run(step, *step_input(spec, [[4, 12, 13, 14]], seed=1))  # 4, 12, 13, 14 into slots
    events: list[str] = []
    items: list[int] = []  # the work items of each gate/up launch (its grid's second dimension)
    expert_launches(step.device.dev, events)
    logged = step.device.dev.launch

    def launch(name, grid, *args, **kw):
        if name.startswith("moe_gate_up"):
            items.append(grid[1])
        return logged(name, grid, *args, **kw)

    step.device.dev.launch = launch
    cache = step.streamer.cache
    real_plan = cache.plan
    cache.plan = lambda *a, **kw: events.append("plan") or real_plan(*a, **kw)
    h, exact = step_input(spec, [ids], seed=2)
    try:
        got = run(step, h, exact)
    finally:
        del step.device.dev.launch, cache.plan
    assert events.index("plan") >= 2 and all(name.startswith("moe_") for name in events[: events.index("plan")])
    whole = all(e in (4, 12, 13, 14) for e in ids)
    assert events.index("plan") == (len(events) - 1 if whole else 2)  # every stage before it, or the slots' two
    assert sum(items) == len(ids)  # each expert's work item launched once: the slots' by begin alone
    assert np.array_equal(got, all_in_slots(spec, h, exact))
    step.close()


@pytest.mark.parametrize("ids", [[1, 9, 13, 14], [1, 4, 9, 13]])
def test_the_experts_at_hand_are_copied_up_before_the_steps_cache_plan(ids, deferred):
    """A decode step's experts whose bytes the host tier holds (13 and 14; then 13, beside 4 in a slot)
    are copied up into free slots as soon as its reads are issued, before its cache plan
    (GpuExperts.begin): the link starts on them there, not after the plan. The output is the
    all-in-slots step's, bit for bit."""
    step, spec, source = layer0_step(device_slots=2, host_experts=8)
    run(step, *step_input(spec, [[4, 12, 13, 14]], seed=1))  # 4 and 12 into slots, all four into the host tier
    streamer, device = step.streamer, step.device
    at_hand = [e for e in ids if (0, e) in streamer.host_slots and (0, e) not in device.resident]
    assert at_hand, "no expert of the step is at hand: the test proves nothing"
    held = [e for e in ids if (0, e) in device.resident]
    dev, rt = device.dev, device.dev.rt
    events: list[str] = []
    real_htod, real_plan = rt.htod, streamer.cache.plan

    def htod(dst, src, nbytes, stream):
        if stream is dev.copy_stream:
            events.append("copy up")
        return real_htod(dst, src, nbytes, stream)

    rt.htod = htod
    streamer.cache.plan = lambda *a, **kw: events.append("plan") or real_plan(*a, **kw)
    h, exact = step_input(spec, [ids], seed=2)
    try:
        got = run(step, h, exact)
    finally:
        del rt.htod, streamer.cache.plan
    assert events[: len(at_hand) + 1] == ["copy up"] * len(at_hand) + ["plan"]
    assert events.count("copy up") == len(ids) - len(held)  # each expert not held copied up once
    assert np.array_equal(got, all_in_slots(spec, h, exact))
    step.close()


def test_a_missing_expert_is_computed_once_copied_while_a_later_read_is_still_held(deferred):
    """A decode step with two experts in slots and two read from disk, 1 and 9, the read of 9 held: once
    1 has landed and been copied up, its gate/up and down are launched and run (a sync of the compute
    stream, deferred) while 9's read is still held; only then is it let go. A step that launches its
    misses after the last read never gets there: the held read runs out of patience. Under deferred
    streams a launch that did not wait for 1's copy on the device would read an unfilled slot: the output
    is checked against a step with every expert in a slot."""
    step, spec, source, copies = step_with_9_held()
    dev, rt = step.device.dev, step.device.dev.rt
    downs: list[tuple[int, bool]] = []  # (copies issued so far, the held read let go) at each down stage

    def after(name):
        if is_down_stage(name):
            downs.append((len(copies), source.gate.is_set()))
            if len(copies) == 1 and source.released_by is None:  # 1's stages: launched after its copy alone
                rt.sync(dev.stream)
                source.release("the first miss was computed")

    got, _, (h, exact) = decode_1_4_9_12(step, spec, source, after)
    assert source.released_by == "the first miss was computed"
    assert downs == [(0, False), (1, False), (2, True)]  # slots' experts, then 1 with 9 held, then 9
    assert np.array_equal(got, all_in_slots(spec, h, exact))
    step.close()


def test_a_prefetched_read_is_issued_before_the_layers_expert_kernels_and_in_flight_while_they_run(tmp_path, deferred):
    """The GPU path of the engine, one decode step from empty tiers, prefetch on: layer L's step predicts
    layer L+1's experts and reads them behind its own reads, before it launches its expert kernels. The
    prefetched reads are held until the compute stream next runs its queued work (deferred: a sync), which
    runs layer L's kernels: they were in flight while layer L computed. A prefetch issued after the
    compute comes after the launches; a step that waited for its prefetches would run out of patience."""
    from fomoepy.engine import Engine
    from fomoepy.experts.store_writer import prepare_store

    store = tmp_path / "store"
    prepare_store(ORACLE / f"{NAME}.gguf", [store], progress=False)
    options = {"backend": "sim", "store": (str(store),), "vram_cache": 0, "ram_cache": 1 << 30}
    token = int(np.load(ORACLE / f"{NAME}.tokens.npy")[0])
    plain = Engine(ORACLE / f"{NAME}.gguf", EngineOptions(**options, prefetch=False))
    want = plain.eval(plain.new_state(), [token], phase=Phase.DECODE)
    plain.close()

    engine = Engine(ORACLE / f"{NAME}.gguf", EngineOptions(**options))
    streamer, dev = engine.experts.streamer, engine.experts.device.dev
    source = streamer.source = HeldSource(streamer.source)
    events: list[tuple] = []
    layer = [-1]  # the step under way
    real_substitute, real_submit, real_sync = streamer.substitute, source.submit, dev.rt.sync

    def substitute(il, exact, rows=None):  # a step's first call into the streamer
        layer[0] = il
        events.append(("step", il))
        return real_substitute(il, exact, rows)

    def submit(il, expert, out=None):
        if il > layer[0]:  # a read for a later layer: a prefetch; held
            source.held.add((il, expert))
        events.append(("read", il, expert, layer[0]))
        return real_submit(il, expert, out)

    def sync(stream):
        real_sync(stream)
        launched = {e[2] for e in events if e[0] == "launch"}
        if stream is dev.stream and any(h[0] - 1 in launched for h in source.held):
            events.append(("ran", layer[0]))
            source.release("the compute stream ran the layer's kernels")

    streamer.substitute, source.submit, dev.rt.sync = substitute, submit, sync
    streamer.source = source  # (the reads made ahead take the source's submit as the source is set)
    log: list[str] = []
    expert_launches(dev, log, lambda name: events.append(("launch", name, layer[0])))
    try:
        got = engine.eval(engine.new_state(), [token], phase=Phase.DECODE)
    finally:
        del dev.launch, dev.rt.sync
        source.release("the end")
    prefetches = [e for e in events if e[0] == "read" and e[1] > e[3]]
    assert prefetches and streamer.read_ahead.counts.issued == len(prefetches)
    il = prefetches[0][3]
    first_launch = next(i for i, e in enumerate(events) if e[0] == "launch" and e[2] == il)
    assert events.index(prefetches[0]) < first_launch  # issued before layer il's expert kernels
    assert source.released_by == "the compute stream ran the layer's kernels"  # and in flight while they ran
    assert np.array_equal(got, want)  # prefetch changes what is read when, never the result
    engine.close()


def test_a_gpu_engine_gates_its_reads_ahead_and_predicts_only_on_sampled_tokens_while_they_are_off(tmp_path):
    """The engine gives a GPU device's step the gate of the GPU schedule (reading ahead turned off where its
    guesses are right too seldom to pay); while it is off, a decode token's steps launch the next layer's
    router (route_ahead's second routing) only on the tokens the gate samples."""
    from fomoepy.engine import Engine
    from fomoepy.experts.read_ahead import GPU_READ_AHEAD_PAYS
    from fomoepy.experts.store_writer import prepare_store

    store = tmp_path / "store"
    prepare_store(ORACLE / f"{NAME}.gguf", [store], progress=False)
    engine = Engine(ORACLE / f"{NAME}.gguf", EngineOptions(backend="sim", store=(str(store),), vram_cache=0, ram_cache=0))
    gate, device = engine.experts.streamer.gate, engine.experts.device
    assert gate is not None and gate.pays_above == GPU_READ_AHEAD_PAYS
    gate.reading, gate.sample = False, 4
    real, predictions = device.route_ahead, []

    def route_ahead(layer, h, logits, gating, k):
        predictions[-1] += 1
        return real(layer, h, logits, gating, k)

    device.route_ahead = route_ahead
    state = engine.new_state()
    sampled = []
    for t in np.load(ORACLE / f"{NAME}.tokens.npy")[:8]:
        sampled.append(gate.predicting)
        predictions.append(0)
        engine.eval(state, [int(t)], phase=Phase.DECODE)
    n_layer = engine.spec.n_layer
    assert sampled.count(True) == 2 and predictions == [n_layer - 1 if s else 0 for s in sampled]
    assert engine.experts.streamer.read_ahead.counts.issued == 0  # nothing read ahead while off
    engine.close()
