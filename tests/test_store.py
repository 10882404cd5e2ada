"""The expert store: every expert reads back as the GGUF's bytes; anything else is refused or detected."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.cli import main
from fomoepy.engine import Engine, EngineOptions
from fomoepy.errors import StoreError
from fomoepy.experts.source import GGUFExpertSource, expert_index
from fomoepy.experts.store_format import ALIGN, MANIFEST_NAME, decode_manifest
from fomoepy.experts.store_reader import O_DIRECT, ExpertStore
from fomoepy.experts.store_writer import WRITE_DELAY_ENV, prepare_store, stripe_of
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

Q4KM = ORACLE / "qwen3moe_q4_k_m.gguf"
Q35 = ORACLE / "qwen35moe_q4_k.gguf"
PREPARE_TOOL = Path(__file__).parent.parent / "tools" / "prepare_experts"
PAGE = os.sysconf("SC_PAGE_SIZE")


def gguf_source(path: Path) -> GGUFExpertSource:
    gf = GGUFFile(path)
    return GGUFExpertSource(gf, ModelSpec.from_gguf(gf))


def all_keys(store: ExpertStore) -> list[tuple[int, int]]:
    return [(ll.layer, e) for ll in store.manifest.layers for e in range(ll.n_expert)]


def assert_same_expert(got, want, key) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.uint8 and np.array_equal(g, w), key


def make_store(root: Path, model: Path = Q4KM, n_dirs: int = 2, mirror: bool = False) -> list[Path]:
    dirs = [root / f"drive{i}" for i in range(n_dirs)]
    prepare_store(model, dirs, mirror=mirror, progress=False)
    return dirs


@pytest.fixture(scope="module")
def striped(tmp_path_factory) -> list[Path]:
    """A 2-directory striped store of Q4KM, shared by tests that only read it."""
    return make_store(tmp_path_factory.mktemp("striped"))


@pytest.fixture
def damaged(striped, tmp_path) -> list[Path]:
    """A private copy of `striped` to damage."""
    out = [tmp_path / d.name for d in striped]
    for src, dst in zip(striped, out):
        shutil.copytree(src, dst)
    return out


def flip_bit(path: Path, pos: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


# --- every expert, every layout ------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, n_dirs, mirror",
    [(Q4KM, 1, False), (Q4KM, 2, False), (Q4KM, 3, False), (Q4KM, 2, True), (Q4KM, 3, True), (Q35, 3, False), (Q35, 2, True)],
)
def test_every_expert_reads_back_as_the_gguf_bytes(tmp_path, model, n_dirs, mirror):
    dirs = make_store(tmp_path, model, n_dirs, mirror)
    source = gguf_source(model)
    with ExpertStore.open(list(reversed(dirs)), model, threads=4) as store:  # any order of directories
        assert store.layers == source.layers  # a drop-in expert source
        keys = all_keys(store)
        assert len(keys) == sum(ll.n_expert for ll in store.manifest.layers) > 0
        for key, got in zip(keys, store.read_many(keys)):
            assert_same_expert(got, source.read(*key), key)
        for key in keys[::5]:
            assert_same_expert(store.read(*key), source.read(*key), key)
            assert_same_expert(store.submit(*key).result(), source.read(*key), key)
        for copy in range(store.n_copies):
            assert_same_expert(store.read_into(*keys[-1], copy=copy), source.read(*keys[-1]), keys[-1])
        assert store.n_copies == (n_dirs if mirror else 1)


def test_records_are_aligned_and_striped_evenly(tmp_path):
    dirs = make_store(tmp_path, Q4KM, n_dirs=3)
    with ExpertStore.open(dirs, Q4KM) as store:
        m = store.manifest
        assert np.all(m.index["offset"] % ALIGN == 0)
        stripes = np.array([m.files[f].stripe for f in m.index["file"]])
        want = [stripe_of(int(r["layer"]), int(r["expert"]), m.layers[int(r["layer"])].n_expert, 3) for r in m.index]
        assert stripes.tolist() == want
        assert np.bincount(stripes).tolist() == [16, 16, 16]  # 3 layers x 16 experts
    for i, d in enumerate(dirs):
        assert sorted(p.name for p in d.glob("*.experts")) == [f"layer-000{layer}.s{i}.experts" for layer in range(3)]


def test_store_is_a_drop_in_source_for_the_engine(striped):
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")[:12]
    want = Engine(Q4KM, EngineOptions(vram_cache=0)).logits(tokens)
    engine = Engine(Q4KM, EngineOptions(store=tuple(str(d) for d in striped), vram_cache=0, ram_cache=0))
    assert isinstance(engine.source, ExpertStore)
    got = engine.logits(tokens)
    engine.close()
    assert np.array_equal(got, want)  # bit for bit


@pytest.mark.parametrize("cpus, threads", [(1, 2), (2, 4), (3, 6), (4, 8), (64, 8)])
def test_a_store_starts_two_reader_threads_a_cpu_it_may_run_on_at_most_eight(striped, monkeypatch, cpus, threads):
    # (measured on 2 vCPUs: four readers decoded faster than eight; see store_reader.default_threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    with ExpertStore.open([str(d) for d in striped], Q4KM) as store:
        assert store.threads == threads
        assert len(store.read_many([(0, e) for e in range(4)])) == 4
        assert store._pool is not None and store._pool.n_threads == threads
    with ExpertStore.open([str(d) for d in striped], Q4KM, threads=3) as store:  # a count given is kept
        assert store.threads == 3


def resident_offsets(path: Path) -> np.ndarray:
    """File offsets of the pages of `path` this process has mapped and resident (Linux pagemap)."""
    out = []
    with open("/proc/self/pagemap", "rb") as pagemap:
        for line in open("/proc/self/maps"):
            fields = line.split()
            if len(fields) < 6 or fields[5] != str(path.resolve()):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(lo // PAGE * 8)
            entries = np.frombuffer(pagemap.read((hi - lo) // PAGE * 8), np.uint64)
            out.append(int(fields[2], 16) + PAGE * np.flatnonzero(entries >> np.uint64(63)))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="needs Linux's /proc/self/pagemap")
def test_opening_a_store_leaves_no_gguf_expert_page_resident(striped, tmp_path):
    """Binding samples the GGUF's expert bytes through its map; a store's user then holds none of them
    (with --store the experts' memory is --ram-cache, not whatever the sampling faulted in)."""
    model = tmp_path / Q4KM.name  # a copy only this test maps (other tests' engines map the original)
    shutil.copyfile(Q4KM, model)
    gf = GGUFFile(model)
    with ExpertStore.open(striped, gf):
        resident = resident_offsets(model)
        spans = [gf.tensor(p.tensor) for layer in expert_index(gf, ModelSpec.from_gguf(gf)) for p in layer.parts]
        held = [t.name for t in spans if ((resident >= t.offset) & (resident < t.offset + t.nbytes)).any()]
    assert held == []


def test_mirror_reads_from_any_subset_of_copies(tmp_path):
    dirs = make_store(tmp_path, Q4KM, n_dirs=3, mirror=True)
    source = gguf_source(Q4KM)
    with ExpertStore.open(dirs[1:2], Q4KM) as store:
        assert store.n_copies == 1
        assert_same_expert(store.read(2, 7), source.read(2, 7), (2, 7))


# --- refusing what is not this GGUF's complete store ---------------------------------------------


def test_store_of_another_gguf_is_refused(striped):
    with pytest.raises(StoreError, match="prepared from another GGUF, qwen3moe_q4_k_m.gguf"):
        ExpertStore.open(striped, Q35)


def test_a_store_of_the_crc32_format_is_refused_with_what_to_do(damaged):
    # version 1 stores carry zlib crc32 record checksums; this fomoe writes and checks CRC-32C (version 2)
    from fomoepy.experts.store_format import MANIFEST_NAME

    for d in damaged:
        path = d / MANIFEST_NAME
        data = bytearray(path.read_bytes())
        data[8:12] = (1).to_bytes(4, "little")  # the version field (outside the manifest's own checksum)
        path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="store format version 1, this fomoe reads version 2; run `fomoe prepare` again"):
        ExpertStore.open(damaged, Q4KM)


def test_record_checksums_are_crc32c_of_the_slot_seeded_with_its_identity(striped):
    import struct

    import crc32c

    store = ExpertStore.open(striped, Q4KM)
    (row,) = [r for r in store.manifest.index if (int(r["layer"]), int(r["expert"])) == (1, 5)]
    path = striped[int(row["file"]) % len(striped)] / store.manifest.files[int(row["file"])].name
    with open(path, "rb") as f:
        f.seek(int(row["offset"]))
        slot = f.read(store.manifest.layers[1].slot_nbytes)
    assert int(row["crc"]) == crc32c.crc32c(slot, crc32c.crc32c(struct.pack("<II", 1, 5)))


def test_store_of_a_gguf_with_changed_expert_bytes_is_refused(striped, tmp_path):
    changed = tmp_path / "changed.gguf"
    shutil.copyfile(Q4KM, changed)
    first_expert_byte = GGUFFile(Q4KM).tensor("blk.1.ffn_up_exps.weight").offset
    flip_bit(changed, first_expert_byte)
    with pytest.raises(StoreError, match="prepared from another GGUF"):
        ExpertStore.open(striped, changed)


def test_verify_store_compares_with_the_gguf_bytes_not_only_checksums(striped, tmp_path, capsys):
    changed = tmp_path / "changed.gguf"
    shutil.copyfile(Q4KM, changed)
    gate = GGUFFile(Q4KM).tensor("blk.1.ffn_gate_exps.weight")
    flip_bit(changed, gate.offset + 3 * gate.nbytes // 16 + 100)  # expert 3: outside the sampled bytes
    assert main(["verify-store", str(changed), *map(str, striped), "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fomoe: error: 1 of 48 records are bad: layer 1 expert 3")
    assert "differs from" in err[0]


def test_striped_store_needs_all_its_directories(striped):
    with pytest.raises(StoreError, match=r"striped over 2 directories, 1 given \(missing slot 1\)"):
        ExpertStore.open(striped[:1], Q4KM)
    with pytest.raises(StoreError, match="given twice"):
        ExpertStore.open([striped[0], striped[0], striped[1]], Q4KM)


def test_directories_of_different_stores_are_refused(striped, tmp_path):
    other = make_store(tmp_path, Q4KM, n_dirs=3)
    with pytest.raises(StoreError, match="holds a different store"):
        ExpertStore.open([striped[0], other[1]], Q4KM)


def test_directory_without_manifest_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="no complete expert store here .*run `fomoe prepare` first"):
        ExpertStore.open([tmp_path / "empty"], Q4KM)


# --- corruption is detected, never read as weights -------------------------------------------------


def test_any_bit_flip_in_the_manifest_is_detected(striped):
    path = striped[0] / MANIFEST_NAME
    data = path.read_bytes()
    decode_manifest(data, path)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(StoreError, match=f"{path}: (damaged store manifest|store format version)"):
            decode_manifest(bytes(bad), path)
    for n in (0, 10, 31, len(data) // 2, len(data) - 1):
        with pytest.raises(StoreError, match="damaged store manifest"):
            decode_manifest(data[:n], path)


def test_damaged_manifest_on_disk_is_refused(damaged):
    path = damaged[1] / MANIFEST_NAME
    flip_bit(path, path.stat().st_size - 5)  # in the index
    with pytest.raises(StoreError, match=f"{path}: damaged store manifest \\(checksum mismatch\\)"):
        ExpertStore.open(damaged, Q4KM)


def test_bit_flip_in_a_record_file_header_is_detected(damaged):
    path = damaged[0] / "layer-0001.s0.experts"
    for pos in (0, 9, 13, 25, 40, 64, 100, ALIGN - 1):
        flip_bit(path, pos, pos % 8)
        with pytest.raises(StoreError, match=f"{path}: damaged record file of layer 1"):
            ExpertStore.open(damaged, Q4KM)
        flip_bit(path, pos, pos % 8)
    ExpertStore.open(damaged, Q4KM).close()


def test_bit_flips_anywhere_in_a_record_are_detected(damaged):
    source = gguf_source(Q4KM)
    rng = np.random.default_rng(0)
    with ExpertStore.open(damaged, Q4KM) as store:
        m = store.manifest
        for _ in range(40):
            row = m.index[rng.integers(len(m.index))]
            layer, expert = int(row["layer"]), int(row["expert"])
            slot = m.layers[layer].slot_nbytes
            pos = int(row["offset"]) + int(rng.integers(slot))  # payload or zero padding
            path = store.record_path(layer, expert)
            flip_bit(path, pos, int(rng.integers(8)))
            with pytest.raises(StoreError, match=f"layer {layer} expert {expert}: checksum mismatch in {path}"):
                store.read(layer, expert)
            with pytest.raises(StoreError, match=f"layer {layer} expert {expert}"):
                store.read_many([(0, 0), (layer, expert)])
            with open(path, "r+b") as f:  # undo: restore the slot from the GGUF
                f.seek(int(row["offset"]))
                f.write(b"".join(v.tobytes() for v in source.read(layer, expert)))
                f.write(bytes(slot - m.layers[layer].record_nbytes))
            assert_same_expert(store.read(layer, expert), source.read(layer, expert), (layer, expert))


def test_truncated_or_missing_record_file_is_refused(damaged):
    path = damaged[1] / "layer-0002.s1.experts"
    size = path.stat().st_size
    with ExpertStore.open(damaged, Q4KM) as store:
        os.truncate(path, size - ALIGN)  # after open: the read itself notices
        last = max((int(r["offset"]), int(r["expert"])) for r in store.manifest.index if store.manifest.files[r["file"]].name == path.name)
        with pytest.raises(StoreError, match=f"layer 2 expert {last[1]}: {path} is truncated"):
            store.read(2, last[1])
    with pytest.raises(StoreError, match=f"{path}: record file of layer 2 has {size - ALIGN:,} bytes, expected {size:,} \\(truncated\\)"):
        ExpertStore.open(damaged, Q4KM)
    path.unlink()
    with pytest.raises(StoreError, match=f"{path}: missing record file of layer 2"):
        ExpertStore.open(damaged, Q4KM)


def test_mirror_falls_back_to_a_good_copy_and_verify_names_the_bad_one(tmp_path, capsys, caplog):
    dirs = make_store(tmp_path, Q4KM, n_dirs=2, mirror=True)
    source = gguf_source(Q4KM)
    with ExpertStore.open(dirs, Q4KM) as store:
        bad = store.record_path(1, 5, copy=0)
        row = store.manifest.index[store.manifest.layer_base()[1] + 5]
        flip_bit(bad, int(row["offset"]) + 1000)
        with caplog.at_level(logging.WARNING, logger="fomoepy.experts.store_reader"):
            for _ in range(4):  # round-robin: both copies get a turn
                assert_same_expert(store.read(1, 5), source.read(1, 5), (1, 5))
        assert len(caplog.records) == 1 and str(bad) in caplog.records[0].getMessage()
        with pytest.raises(StoreError, match=f"layer 1 expert 5: checksum mismatch in {bad}"):
            store.read_into(1, 5, copy=0)
    assert main(["verify-store", str(Q4KM), *map(str, dirs), "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"1 of 96 records are bad: layer 1 expert 5: checksum mismatch in {bad}" in err[0]


# --- prepare: atomic, resumable ----------------------------------------------------------------------


def test_prepare_killed_midway_resumes_to_the_same_store(tmp_path):
    ref = make_store(tmp_path / "ref", Q4KM, n_dirs=2)
    dirs = [tmp_path / "kill" / f"drive{i}" for i in range(2)]
    env = {**os.environ, WRITE_DELAY_ENV: "0.05"}  # 8 records per file: ~0.4 s per file
    proc = subprocess.Popen([sys.executable, str(PREPARE_TOOL), str(Q4KM), *map(str, dirs), "--quiet"], env=env)
    deadline = time.monotonic() + 60
    # killed once a file is complete and the next is being written: between the two (a rename, then an
    # open) no .partial exists, and a kill there would leave nothing mid-way to resume
    def written(pattern: str) -> bool:
        return any(d.is_dir() and any(d.glob(pattern)) for d in dirs)

    while not (written("*.experts") and written("*.partial")):
        assert proc.poll() is None, "prepare ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = {p: p.stat().st_ino for d in dirs for p in d.glob("*.experts")}
    assert done and any(p for d in dirs for p in d.glob("*.partial")), "killed mid-way"
    with pytest.raises(StoreError, match="did not finish: run it again"):
        ExpertStore.open(dirs, Q4KM)

    prepare_store(Q4KM, dirs, progress=False)
    assert all(p.stat().st_ino == ino for p, ino in done.items()), "complete files are kept"
    for d, r in zip(dirs, ref):
        assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in r.iterdir())  # no .partial left
        for p in r.iterdir():
            assert (d / p.name).read_bytes() == p.read_bytes(), p.name
    assert main(["verify-store", str(Q4KM), *map(str, dirs), "-q"]) == 0


def test_prepare_rerun_rewrites_only_a_damaged_file(damaged):
    victim = damaged[0] / "layer-0001.s0.experts"
    flip_bit(victim, victim.stat().st_size - 2 * ALIGN)
    inodes = {p: p.stat().st_ino for d in damaged for p in d.glob("*.experts")}
    prepare_store(Q4KM, damaged, progress=False)
    changed = [p for p, ino in inodes.items() if p.stat().st_ino != ino]
    assert changed == [victim]
    with ExpertStore.open(damaged, Q4KM) as store:
        store.read_many(all_keys(store))


# --- O_DIRECT and its fallback ---------------------------------------------------------------------


def test_o_direct_refused_at_open_falls_back_once_without_error(striped, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    source = gguf_source(Q4KM)
    with caplog.at_level(logging.INFO, logger="fomoepy.experts.store_reader"), ExpertStore.open(striped, Q4KM) as store:
        assert not store.direct
        for key, got in zip(all_keys(store), store.read_many(all_keys(store))):
            assert_same_expert(got, source.read(*key), key)
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_o_direct_refused_at_read_falls_back_without_error(striped, monkeypatch):
    if not O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_preadv = os.preadv

    def no_direct_reads(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", no_direct_reads)
    source = gguf_source(Q4KM)
    with ExpertStore.open(striped, Q4KM, threads=4) as store:
        for key, got in zip(all_keys(store), store.read_many(all_keys(store))):
            assert_same_expert(got, source.read(*key), key)
        assert not store.direct


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable tmpfs at /dev/shm")
def test_store_on_tmpfs_reads_back():
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="fomoe-test-"))
    try:
        dirs = make_store(root, Q4KM, n_dirs=2)
        source = gguf_source(Q4KM)
        with ExpertStore.open(dirs, Q4KM) as store:
            for key, got in zip(all_keys(store), store.read_many(all_keys(store))):
                assert_same_expert(got, source.read(*key), key)
    finally:
        shutil.rmtree(root)


# --- command line --------------------------------------------------------------------------------


def test_cli_prepare_and_verify_store(tmp_path, capsys):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]
    assert main(["prepare", str(Q35), *dirs, "--mirror", "-q"]) == 0
    assert "store ready (mirrored x3" in capsys.readouterr().out
    assert main(["verify-store", str(Q35), *dirs[::-1], "-q"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("store OK (mirrored x3") and "32 experts of 4 layers x 3 copies" in out


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    cases = [
        (["prepare", str(tmp_path / "missing.gguf"), str(tmp_path / "s")], "missing.gguf: no such file"),
        (["prepare", str(tmp_path / "file"), str(tmp_path / "s")], "file: truncated GGUF file"),
        (["prepare", str(Q4KM), str(tmp_path / "file")], "cannot create the store directory"),
        (["prepare", str(Q4KM), str(tmp_path / "s"), str(tmp_path / "s")], "the same directory is given twice"),
        (["verify-store", str(Q4KM), str(tmp_path / "nothing")], "nothing: no such directory"),
        (["verify-store", str(Q4KM), str(tmp_path / "file")], "file: not a directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fomoe: error: ") and message in err[0], err


def test_a_refused_model_leaves_no_store_directory_behind(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for model in (tmp_path / "missing.gguf", tmp_path / "file"):
        assert main(["prepare", "-q", str(model), str(tmp_path / "s" / "deeper")]) == 1
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_prepare_tool_is_fomoe_prepare(tmp_path):
    r = subprocess.run([str(PREPARE_TOOL), str(tmp_path / "missing.gguf"), str(tmp_path / "s")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"fomoe: error: {tmp_path / 'missing.gguf'}: no such file"]
    r = subprocess.run([str(PREPARE_TOOL), str(Q4KM), str(tmp_path / "s"), "-q"], check=False, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("store ready (striped over 1")
    with ExpertStore.open([tmp_path / "s"], Q4KM) as store:
        assert store.layers == expert_index(GGUFFile(Q4KM), ModelSpec.from_gguf(GGUFFile(Q4KM)))
