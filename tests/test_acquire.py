"""ExpertStreamer.start_acquire in C (fomoepy/experts/_acquire.c) against its definition, the Python method
(ExpertStreamer.py_start_acquire): the same reads issued in the same order, the same plans, bytes at hand,
host tier and errors, on the engine's two kinds of step (the cpu backend's, whose plan is made on the
inference thread; the simulated GPU's, made beside its launches, demoting into the host tier and gating
its reads ahead)."""

import types

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts import streamer as streamer_module
from fomoepy.experts.reads import Read
from fomoepy.experts.store_writer import prepare_store
from fomoepy.experts.streamer import ExpertStreamer

pytestmark = pytest.mark.skipif(streamer_module._acquire is None, reason="the compiled start_acquire is not built (setup.py)")

NAME = "qwen3moe_q4_k_m"  # 16 experts, top-4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("acquire") / "store"
    prepare_store(ORACLE / f"{NAME}.gguf", [path], progress=False)
    return str(path)


class Logged:
    """The store, its submits logged in order (the step's own reads and those made ahead), each read landing as
    it is asked for, on the asking thread: what lands when, and so the order of everything, is the same in
    every run (a read still in flight as its step starts: tests/test_streaming_reads.py)."""

    def __init__(self, source, log):
        self.source, self.layers, self.log = source, source.layers, log
        self.slot_nbytes = source.slot_nbytes

    def read(self, layer, expert):
        return self.source.read(layer, expert)

    def submit(self, layer, expert, out=None):
        self.log.append(("read", layer, expert))
        return Read.landed(self.source.read(layer, expert) if out is None else self.source.read_into(layer, expert, out))

    def __getattr__(self, name):  # the store's other asks (read_ahead_depth, threads, ...)
        return getattr(self.source, name)


def decode(store, compiled, **options):
    """Decode the oracle tokens with start_acquire the compiled one or the definition: the logits, and the
    log of every read issued and of what each start_acquire gave back."""
    engine = Engine(ORACLE / f"{NAME}.gguf", EngineOptions(store=(store,), **options))
    streamer, log = engine.experts.streamer, []
    method = ExpertStreamer.start_acquire if compiled else ExpertStreamer.py_start_acquire
    assert isinstance(method, types.FunctionType) != compiled  # (the compiled one is a method descriptor)
    started = types.MethodType(method, streamer)

    def start_acquire(*args):
        plan, fetched, reads = started(*args)
        items = [(i.expert, i.source.value, i.to_device, i.to_host) for i in plan.items]
        log.append(("step", plan.layer, tuple(items), plan.host_evictions, plan.demotions, tuple(fetched), tuple(reads)))
        return plan, fetched, reads

    streamer.start_acquire = start_acquire
    streamer.source = Logged(streamer.source, log)
    tokens = [int(t) for t in np.load(ORACLE / f"{NAME}.tokens.npy")[:24]]
    state = engine.new_state()
    engine.eval(state, tokens[:4])  # (a prefill's step: all its rows, the compiled one's case too)
    logits = np.stack([engine.decode_token(state, t) for t in tokens[4:]])
    stats = engine.experts.streamer.cache.stats.summary()
    ahead = streamer.read_ahead.counts if streamer.read_ahead is not None else None
    gate = (streamer.gate.guessed, streamer.gate.right) if streamer.gate is not None else None  # (what it scored)
    direct = getattr(engine.experts.device, "direct_uploads", None)  # (copies up straight from the reads' buffers)
    held = sorted(streamer.host_slots)  # (the host tier's bytes, its evictees dropped)
    engine.close()
    return logits, log, (stats, direct, held), ahead, gate


@pytest.mark.parametrize(
    "options",
    [
        # the cpu backend: its one tier a quarter of the experts, reads made ahead
        {"backend": "cpu", "vram_cache": 0, "ram_cache": 300_000},
        # the simulated GPU: a device tier and a host tier under a demoting policy, reads made ahead and gated
        {"backend": "sim", "vram_cache": 400_000, "ram_cache": 800_000, "cache_policy": "lfu-demote"},
    ],
    ids=["cpu", "sim"],
)
def test_the_compiled_start_acquire_makes_the_steps_the_definition_makes(store, options):
    logits_c, log_c, stats_c, ahead_c, gate_c = decode(store, True, **options)
    logits_p, log_p, stats_p, ahead_p, gate_p = decode(store, False, **options)
    steps = [e for e in log_c if e[0] == "step"]
    assert log_c == log_p and stats_c == stats_p and ahead_c == ahead_p and gate_c == gate_p
    assert logits_c.tobytes() == logits_p.tobytes()
    # what the runs went through, or the comparison proves little: reads issued and reads made ahead handed
    # over on both; on the GPU's, host hits, demotions and host evictions, and the gate's scores
    assert any(e[0] == "read" for e in log_c) and ahead_c.used > 0 and any(e[5] for e in steps)
    if options["backend"] == "sim":
        assert any("host" in [i[1] for i in e[2]] for e in steps) and any(e[4] for e in steps) and any(e[3] for e in steps)
        assert gate_c[0] > 0 and 0 < gate_c[1] < gate_c[0]


def streamer_of(store, compiled):
    engine = Engine(ORACLE / f"{NAME}.gguf", EngineOptions(store=(store,), backend="cpu", vram_cache=0, ram_cache=300_000, prefetch=False))
    streamer = engine.experts.streamer
    method = ExpertStreamer.start_acquire if compiled else ExpertStreamer.py_start_acquire
    return engine, types.MethodType(method, streamer)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_plan_that_reads_other_experts_than_were_read_is_refused_the_same_way(store, compiled):
    engine, start_acquire = streamer_of(store, compiled)
    engine.experts.streamer.cache.uncached = lambda layer, experts: experts[:1]  # a lie: only the first is read
    with pytest.raises(RuntimeError, match=r"^layer 0: the plan reads \[2, 5\], but \[2\] were read$"):
        start_acquire(0, np.array([[5, 2]]))
    engine.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_ids_outside_the_layer_read_nothing_and_the_plan_says_what_is_wrong(store, compiled):
    engine, start_acquire = streamer_of(store, compiled)
    source = engine.experts.streamer.source
    log = []
    engine.experts.streamer.source = Logged(source, log)
    with pytest.raises(ValueError, match=r"expected expert ids in \[0, 16\), got \[3, 16\]"):
        start_acquire(0, np.array([[3, 16]]))
    assert log == []
    engine.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_ids_of_another_type_some_rows_and_a_failing_read_go_as_the_definition_has_them(store, compiled):
    engine, start_acquire = streamer_of(store, compiled)
    streamer = engine.experts.streamer
    plan, fetched, reads = start_acquire(1, np.array([[7, 3]], np.int32))  # (not int64: the definition's)
    streamer.finish_acquire(plan, fetched, reads)
    streamer.release(plan)
    assert [i.expert for i in plan.items] == [3, 7] and set(fetched) == {3, 7}
    plan, fetched, reads = start_acquire(1, np.array([[9, 3]]), slice(1, 2))  # (the ids of some rows: the definition's)
    streamer.finish_acquire(plan, fetched, reads)
    streamer.release(plan)
    assert [i.expert for i in plan.items] == [3, 9]

    def failing(layer, expert, out=None):
        raise OSError(f"the drive refused {layer}/{expert}")

    streamer.source.submit = failing
    with pytest.raises(OSError, match="the drive refused 2/1"):
        start_acquire(2, np.array([[1, 5]]))
    engine.close()
