"""`fomoe plan --measure`: what it takes from this machine (the host's rates, the drive, and given a model,
the engine's own host time, slot fills and predictions on it), and that the projection uses them."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from fomoepy.cli import main
from fomoepy.experts.policy import DEFAULT_POLICY
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.plan.hardware import load_hardware
from fomoepy.plan.routing import read_ahead_from_trace


def test_measure_replaces_host_and_drive_figures_and_leaves_no_file(tmp_path, monkeypatch):
    from fomoepy.plan import measure

    monkeypatch.setattr(measure, "SCRATCH_BYTES", 8 << 20)
    rig = load_hardware("rtx4090-64g-2nvme")
    hw = measure.measured(rig, str(tmp_path)).hardware
    assert list(tmp_path.iterdir()) == []
    assert hw.drives.count == rig.drives.count and hw.device == rig.device
    assert hw.drives.bandwidth > 0 and hw.host.matvec > 0 and hw.host.bandwidth > 0 and hw.host.flops > 0
    assert hw.drives.bandwidth != rig.drives.bandwidth and hw.host.matvec != rig.host.matvec


def test_measure_on_a_model_takes_its_host_time_and_slot_fills_from_the_engine(tmp_path, monkeypatch):
    # given a model (and DIR holding its store), --measure runs the cpu backend on it: the host's own time
    # per layer step, and the rate at which it sets a miss into its tier's slots (the `fill` term)
    from conftest import ORACLE

    from fomoepy.experts.store_writer import prepare_store
    from fomoepy.plan import measure

    monkeypatch.setattr(measure, "SCRATCH_BYTES", 8 << 20)
    store = tmp_path / "store"
    prepare_store(ORACLE / "qwen3moe_q4_k_m.gguf", [store], progress=False)
    rig = load_hardware("cpu-only-64g")
    found = measure.measured(rig, str(store), str(ORACLE / "qwen3moe_q4_k_m.gguf"))
    hw, notes = found.hardware, found.notes
    assert rig.host.fill == 0.0 and hw.host.fill > 0 and hw.host.plan > 0 and hw.host.plan != rig.host.plan
    assert f"slot fills {hw.host.fill / 1e9:.2f} GB/s" in notes[-1] and ".fomoe-plan-measure.tmp" not in {p.name for p in store.iterdir()}
    # a quarter of the experts in the tier: of the misses read, it keeps some (set into slots) and not others
    # (computed where their reads landed)
    assert rig.host.fill_share == 1.0 and 0.0 < hw.host.fill_share < 1.0


def test_measure_counts_only_the_admitted_misses_as_slot_fills(oracle_store, monkeypatch):
    # the share --measure states is the decode's own: its tier's admissions over its reads, in the counted
    # tokens; and the host time leaves out only the fills those admissions made
    from fomoepy.experts.cache_stats import CacheStats
    from fomoepy.plan import measure

    model, store = oracle_store
    seen = []
    real_total = CacheStats.total

    def total(self, tier):
        out = real_total(self, tier)
        if tier == "device":
            seen.append((self.total_disk().reads, out.admitted))
        return out

    monkeypatch.setattr(CacheStats, "total", total)
    _, _, share = measure.engine_figures(str(model), str(store), tokens=8, warm=8)
    (reads0, admitted0), (reads1, admitted1) = seen[-2:]
    assert reads1 > reads0 and share == (admitted1 - admitted0) / (reads1 - reads0) and 0.0 < share < 1.0


@pytest.fixture(scope="module")
def oracle_store(tmp_path_factory):
    from conftest import ORACLE

    from fomoepy.experts.store_writer import prepare_store

    model = ORACLE / "qwen3moe_q4_k_m.gguf"
    store = tmp_path_factory.mktemp("measure") / "store"
    prepare_store(model, [store], progress=False)
    return model, store


def test_measure_reads_a_stores_drive_as_the_engine_reads_the_store(oracle_store, monkeypatch):
    # where DIR holds the model's store, the drive's rate is its records read through its own reader in a
    # random order, several in flight (a scratch file read in order, one block at a time, is not how the
    # engine reads): every pass reads a sample of distinct records, and no scratch file is written. The
    # passes are spread over the measurement: half before the model's decode, half after it (a virtual
    # disk's rate moves within seconds)
    from fomoepy.experts.store_reader import ExpertStore
    from fomoepy.plan import measure

    model, store = oracle_store
    monkeypatch.setattr(measure, "drive_figures", lambda d: pytest.fail("a scratch file was read, not the store"))
    read, in_flight, most, counting = [], [0], [0], [True]
    real_submit, real_engine = ExpertStore.submit, measure.engine_figures

    def engine_figures(*a, **k):  # (the decode's own reads are not the drive's measurement)
        counting[0] = False
        read.append("decode")
        try:
            return real_engine(*a, **k)
        finally:
            counting[0] = True

    def submit(self, layer, expert, *a, **k):
        if not counting[0]:
            return real_submit(self, layer, expert, *a, **k)
        read.append((layer, expert))
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        future = real_submit(self, layer, expert, *a, **k)
        future.add_done_callback(lambda _: in_flight.__setitem__(0, in_flight[0] - 1))
        return future

    monkeypatch.setattr(ExpertStore, "submit", submit)
    monkeypatch.setattr(measure, "engine_figures", engine_figures)
    found = measure.measured(load_hardware("cpu-only-64g"), str(store), str(model))
    with ExpertStore.open([store], model) as s:
        keys = {(il, e) for il, layer in enumerate(s.manifest.layers) for e in range(layer.n_expert)}
        threads = s.threads
    per_pass = min(len(keys), measure.SCRATCH_BYTES // s.layers[0].expert_nbytes)
    assert read.count("decode") == 1
    before, after = read[: read.index("decode")], read[read.index("decode") + 1 :]
    assert len(before) == len(after) == 3 * per_pass  # three passes before the decode, three after
    for p in range(6):  # each pass: distinct records of the store
        sample = (before + after)[p * per_pass : (p + 1) * per_pass]
        assert len(set(sample)) == len(sample) and set(sample) <= keys
    assert most[0] > 1 and most[0] <= 2 * threads  # several in flight, as the engine keeps them
    assert found.hardware.drives.bandwidth > 0 and found.hardware.drives.latency > 0
    assert "as the engine reads the store" in found.notes[0]
    assert ".fomoe-plan-measure.tmp" not in {p.name for p in store.iterdir()}


def test_a_drive_pass_reads_into_buffers_reused_from_read_to_read(oracle_store, monkeypatch):
    # as the engine's reads land (a buffer new to the process pays its page faults in the read): `window`
    # buffers taken in turn, none taken again before its last read is done
    from fomoepy.experts.store_reader import ExpertStore
    from fomoepy.plan import measure

    model, store = oracle_store
    outs, last_read = [], {}
    real_submit = ExpertStore.submit

    def submit(self, layer, expert, out=None, copy=None):
        assert out is not None and (out.ctypes.data not in last_read or last_read[out.ctypes.data].done())
        outs.append(out.ctypes.data)
        future = last_read[out.ctypes.data] = real_submit(self, layer, expert, out, copy)
        return future

    monkeypatch.setattr(ExpertStore, "submit", submit)
    with ExpertStore.open([store], model) as s:
        keys = [(il, e) for il, layer in enumerate(s.manifest.layers) for e in range(layer.n_expert)]
        nbytes, seconds = measure.timed_reads(s, keys)
        window = 2 * s.threads
    assert len(outs) == len(keys) > 2 * window and len(set(outs)) == window  # every buffer reused
    assert nbytes == sum(s.layers[il].expert_nbytes for il, _ in keys) and seconds > 0


def test_measure_on_a_model_reads_ahead_with_the_models_own_predictions(oracle_store, monkeypatch):
    # --measure on a model file decodes it: the reads made ahead are projected from that decode's own
    # next-layer predictions, not the demo model's
    from fomoepy.plan import measure

    model, store = oracle_store
    monkeypatch.setattr(measure, "host_figures", lambda threads=None: {"bandwidth": 2e10, "matvec": 1e10, "flops": 1e11})
    found = measure.measured(load_hardware("cpu-only-64g"), str(store), str(model))
    gf = GGUFFile(model)
    spec = ModelSpec.from_gguf(gf)
    assert found.predictions is not None and found.predictions.prediction_accuracy()[0] > 0
    assert (found.predictions.header.n_layer, found.predictions.header.n_expert) == (spec.n_layer, spec.moe.n_expert)

    def plan(*extra):
        monkeypatch.setattr(measure, "measured", lambda *a: found)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", str(model), "--hardware", "cpu-only-64g", "--hit-rates", "40,0,60", "--json", *extra]) == 0
        return json.loads(out.getvalue())["prefetch"]

    ours, demo = plan("--measure", str(store)), plan()
    expected = read_ahead_from_trace(found.predictions, 0.40, 1.0, DEFAULT_POLICY)
    assert ours["share"] == expected.share and ours["along"] == list(expected.along)
    assert "decode under --measure" in ours["source"] and "demo-predictions" in demo["source"]
    assert ours["share"] != demo["share"]


def test_measure_takes_its_products_and_its_engine_run_on_the_threads_given(oracle_store, monkeypatch):
    # `fomoe plan --measure DIR -t N` measures as a run with -t N decodes: the host's products (the matvec
    # and prompt rates) and its run of the engine (host time, fills, predictions) on N threads
    from fomoepy.plan import measure

    model, store = oracle_store
    seen = {}
    real_host, real_engine = measure.host_figures, measure.engine_figures

    def host_figures(threads=None):
        seen["host"] = threads
        return real_host(threads)

    def engine_figures(m, st, threads=None, **k):
        seen["engine"] = threads
        return real_engine(m, st, threads, **k)

    monkeypatch.setattr(measure, "host_figures", host_figures)
    monkeypatch.setattr(measure, "engine_figures", engine_figures)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(model), "--hardware", "cpu-only-64g", "--measure", str(store), "--hit-rates", "40,0,60",
                     "-t", "1", "--json"]) == 0  # fmt: skip
    assert seen == {"host": 1, "engine": 1} and json.loads(out.getvalue())["projection"]["tokens_per_s"] > 0


def test_measure_leaves_the_slot_fills_out_of_the_host_time(oracle_store, monkeypatch):
    # the projection has the misses' slot fills as a term of their own (their bytes at the fill rate), so
    # the host time --measure takes leaves that same time out: with fills measured as slow as a byte a
    # second, the rest of the step is far below zero; as fast as light, above it
    from fomoepy.plan import measure

    model, store = oracle_store
    monkeypatch.setattr(measure, "slot_fill_rate", lambda engine: 1.0)
    slow, _, _ = measure.engine_figures(str(model), str(store), tokens=8, warm=8)
    monkeypatch.setattr(measure, "slot_fill_rate", lambda engine: 1e30)
    fast, _, _ = measure.engine_figures(str(model), str(store), tokens=8, warm=8)
    assert slow < -1.0 < 0 < fast


@pytest.mark.parametrize("decoded", [1 << 50, 1, None], ids=["decode-faster", "passes-faster", "not-said"])
def test_a_decode_that_read_the_disk_faster_than_the_passes_sets_the_drive_figure(oracle_store, monkeypatch, decoded):
    # a disk whose rate depends on what read before it (this project's virtual one) can serve the model's decode
    # faster than the passes before and after it: the drive is at least as fast as the decode's own reads came
    # (the bytes the process read from the disk over the decode's time), so that rate is the figure where it
    # is the higher; the passes' where not, or where the system does not say what the process read
    from fomoepy.plan import measure

    model, store = oracle_store
    asked = []

    def disk_read_bytes():  # the decode's counted tokens read `decoded` bytes from the disk
        asked.append(None)
        return None if decoded is None else 0 if len(asked) == 1 else decoded

    monkeypatch.setattr(measure, "disk_read_bytes", disk_read_bytes)
    monkeypatch.setattr(measure, "store_figures", lambda d, m, between=None: (between(), ({"bandwidth": 1e9, "latency": 1e-4}, []))[1])
    found = measure.measured(load_hardware("cpu-only-64g"), str(store), str(model))
    note = next(n for n in found.notes if n.startswith("drive"))
    assert len(asked) == 2  # (before the counted tokens and after them)
    if decoded == 1 << 50:
        assert found.hardware.drives.bandwidth > 1e12 and f"drive {found.hardware.drives.bandwidth / 1e9:.2f} GB/s" in note
        assert "the rate that decode's own reads came at" in note and "above the 1.00 GB/s" in note
    else:
        assert found.hardware.drives.bandwidth == 1e9 and note.endswith("before and after that decode")
