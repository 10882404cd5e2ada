"""Write the expert store of a GGUF (format: store_format): `prepare_store(gguf, dirs, mirror=False)`.

Placement. Striped (the default), expert (l, e) goes to directory (l·n_expert + e) mod n_dirs. Decoding
reads one layer's top-k experts at a time, so spreading every layer over all drives lets those k reads
run on all drives at once; striping by layer would queue them on one drive. The l·n_expert term rotates
the pattern from layer to layer, so when n_expert is not a multiple of n_dirs no drive gets the extra
expert of every layer. `mirror=True` writes a full copy to every directory instead (reads then spread
over the copies and survive a damaged one).

Atomic and resumable. The manifests are deleted first and written last, so a directory is a store only
once everything in it is complete. Each record file is written as `<name>.partial`, fsynced, renamed, and
its directory fsynced. A rerun after a kill keeps every final-named file whose header is the expected one
and whose every record matches the checksum computed from the GGUF, and rewrites everything else, so it
ends with the same bytes as an uninterrupted run (nothing in a store depends on time or chance).

Test hook: FOMOE_TEST_WRITE_DELAY=<seconds> sleeps that long after each record written, so that a test
can kill `fomoe prepare` half-way.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fomoepy.errors import FomoeError, StoreError
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.experts.store_format import (
    FILE_HEADER_SIZE,
    INDEX_DTYPE,
    MANIFEST_NAME,
    LayerLayout,
    RecordFile,
    StoreManifest,
    bind_gguf,
    encode_manifest,
    record_checksum,
    record_file_name,
)
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

PARTIAL_SUFFIX = ".partial"
WRITE_DELAY_ENV = "FOMOE_TEST_WRITE_DELAY"


def stripe_of(layer: int, expert: int, n_expert: int, n_stripes: int) -> int:
    return (layer * n_expert + expert) % n_stripes


def plan_store(gf: GGUFFile, source: GGUFExpertSource, n_dirs: int, mirror: bool) -> StoreManifest:
    """The store's layout for this GGUF, with every checksum still 0."""
    layouts = tuple(LayerLayout.of(gf, le) for le in source.layers)
    n_stripes = 1 if mirror else n_dirs
    files: list[RecordFile] = []
    rows = []
    for ll in layouts:
        members: list[list[int]] = [[] for _ in range(n_stripes)]
        for e in range(ll.n_expert):
            members[stripe_of(ll.layer, e, ll.n_expert, n_stripes)].append(e)
        for stripe, experts in enumerate(members):
            if not experts:
                continue  # more drives than experts
            files.append(RecordFile(record_file_name(ll.layer, stripe), ll.layer, stripe, len(experts)))
            for k, e in enumerate(experts):
                rows.append((ll.layer, e, len(files) - 1, 0, FILE_HEADER_SIZE + k * ll.slot_nbytes, ll.record_nbytes))
    rows.sort(key=lambda r: (r[0], r[1]))
    return StoreManifest(bind_gguf(gf, source.layers), n_dirs, mirror, layouts, tuple(files), np.array(rows, dtype=INDEX_DTYPE))


def prepare_store(
    gguf_path: str | os.PathLike[str], dirs: list[Path], mirror: bool = False, progress: bool = True
) -> StoreManifest:
    """Write (or finish) the expert store of `gguf_path` across `dirs` (one per drive); return its manifest.

    With `progress`, a tqdm bar and a final throughput line go to stderr. Raises StoreError for
    unusable directories, lack of space or a failed write; ModelFileError for a bad GGUF.
    """
    gf = GGUFFile(gguf_path)  # the model first: a bad one must leave no empty store directories behind
    source = GGUFExpertSource(gf, ModelSpec.from_gguf(gf))
    dirs = _check_dirs(dirs)
    plan = plan_store(gf, source, len(dirs), mirror)
    jobs = {d: [fid for fid in range(len(plan.files)) if slot in plan.slots_of(fid)] for slot, d in enumerate(dirs)}
    _check_space(plan, jobs)
    for d in dirs:  # from here on no directory claims to hold a complete store
        _remove(d / MANIFEST_NAME)
    total = sum(plan.file_size(fid) for fids in jobs.values() for fid in fids)
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress, file=sys.stderr) as bar:
        writer = _Writer(source, plan, bar, _write_delay())
        with ThreadPoolExecutor(max_workers=len(dirs), thread_name_prefix="fomoe-prepare") as pool:
            futures = [pool.submit(writer.fill, d, fids) for d, fids in jobs.items()]
            try:
                for f in as_completed(futures):
                    f.result()
            except BaseException:
                writer.stop.set()
                raise
    manifest = dataclasses.replace(plan, index=writer.final_index())
    for slot, d in enumerate(dirs):
        _write_atomic(d / MANIFEST_NAME, encode_manifest(dataclasses.replace(manifest, slot=slot)))
    if progress:
        seconds = time.perf_counter() - t0
        line = f"fomoe: wrote {writer.written / 1e9:.2f} GB in {seconds:.1f} s ({writer.written / 1e9 / seconds:.2f} GB/s)"
        if writer.kept_files:
            line += f"; kept {writer.kept_files} complete files ({writer.kept / 1e9:.2f} GB) after checking them"
        print(line, file=sys.stderr)
    return manifest


class _Writer:
    """Fills directories with record files; one thread per directory, sharing the checksum table."""

    def __init__(self, source: GGUFExpertSource, plan: StoreManifest, bar: tqdm, delay: float):
        self.source, self.plan, self.bar, self.delay = source, plan, bar, delay
        self.crcs = np.zeros(len(plan.index), dtype=np.uint32)
        self.known = np.zeros(len(plan.index), dtype=bool)
        self.rows_of = [np.flatnonzero(plan.index["file"] == fid) for fid in range(len(plan.files))]
        self.base = plan.layer_base()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.written = self.kept = self.kept_files = 0

    def fill(self, directory: Path, file_ids: list[int]) -> None:
        for fid in file_ids:
            if self.stop.is_set():
                return
            path = directory / self.plan.files[fid].name
            if not (path.exists() and self._is_complete(path, fid)):
                self._write(path, fid)

    def final_index(self) -> np.ndarray:
        assert self.known.all(), "every record has been written or checked"
        index = self.plan.index.copy()
        index["crc"] = self.crcs
        return index

    def _record(self, row: int) -> tuple[int, int, list]:
        """(layer, expert, [gate, up, down, zero padding]) of index row `row`, from the GGUF."""
        layer, expert = int(self.plan.index["layer"][row]), int(self.plan.index["expert"][row])
        ll = self.plan.layers[layer]
        chunks = [*self.source.read(layer, expert), bytes(ll.slot_nbytes - ll.record_nbytes)]
        if not self.known[row]:
            self.crcs[row] = record_checksum(layer, expert, chunks)
            self.known[row] = True
        return layer, expert, chunks

    def _is_complete(self, path: Path, fid: int) -> bool:
        """Whether a final-named file left by an earlier run has exactly the bytes this run would write."""
        done = 0
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != self.plan.file_size(fid) or f.read(FILE_HEADER_SIZE) != self.plan.file_header(fid):
                    return False
                for row in self.rows_of[fid]:
                    layer, expert, _ = self._record(row)
                    slot = os.pread(f.fileno(), self.plan.layers[layer].slot_nbytes, int(self.plan.index["offset"][row]))
                    if record_checksum(layer, expert, [slot]) != self.crcs[row]:
                        return False
                    done += len(slot)
                    self.bar.update(len(slot))
        except OSError:
            return False
        finally:
            if done and done + FILE_HEADER_SIZE != self.plan.file_size(fid):
                self.bar.update(-done)  # it will be rewritten: count its bytes once
        with self.lock:
            self.kept += self.plan.file_size(fid)
            self.kept_files += 1
        self.bar.update(FILE_HEADER_SIZE)
        return True

    def _write(self, path: Path, fid: int) -> None:
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        try:
            with open(partial, "wb") as f:
                f.write(self.plan.file_header(fid))
                self.bar.update(FILE_HEADER_SIZE)
                for row in self.rows_of[fid]:
                    if self.stop.is_set():
                        return
                    _, _, chunks = self._record(row)
                    f.writelines(chunks)
                    n = sum(len(c) for c in chunks)
                    with self.lock:
                        self.written += n
                    self.bar.update(n)
                    if self.delay:
                        time.sleep(self.delay)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
            _fsync_dir(path.parent)
        except OSError as e:
            raise StoreError(f"{partial}: write failed ({e.strerror or e})") from None
        with self.lock:
            self.written += FILE_HEADER_SIZE


def _check_dirs(dirs: list[Path]) -> list[Path]:
    if not dirs:
        raise StoreError("no store directory given")
    out = [Path(d) for d in dirs]
    seen: dict[Path, Path] = {}
    for d in out:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{d}: cannot create the store directory ({e.strerror or e})") from None
        real = d.resolve()
        if real in seen:
            raise StoreError(f"{d}: the same directory is given twice (also as {seen[real]})")
        seen[real] = d
    return out


def _check_space(plan: StoreManifest, jobs: dict[Path, list[int]]) -> None:
    for d, fids in jobs.items():
        need = reclaimable = 0
        for fid in fids:
            final = d / plan.files[fid].name
            partial = final.with_name(final.name + PARTIAL_SUFFIX)
            if not final.exists():
                need += plan.file_size(fid)
            if partial.exists():
                reclaimable += partial.stat().st_size
        free = shutil.disk_usage(d).free + reclaimable
        if need > free:
            raise StoreError(f"{d}: the store needs {need / 1e9:.2f} GB more here, {free / 1e9:.2f} GB are free")


def _write_delay() -> float:
    text = os.environ.get(WRITE_DELAY_ENV, "")
    try:
        return float(text) if text else 0.0
    except ValueError:
        raise FomoeError(f"{WRITE_DELAY_ENV} must be a number of seconds, got {text!r}") from None


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise StoreError(f"{partial}: write failed ({e.strerror or e})") from None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as e:
        raise StoreError(f"{path}: cannot remove the old manifest ({e.strerror or e})") from None
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink durable: it lives in the directory, not in the file."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
