"""Read experts from a store (format: store_format): a drop-in expert source with a pool of reader threads.

Every read is one `os.preadv` of a record's whole 4 KiB-aligned slot, from a file opened with O_DIRECT
(no page-cache copy, no cache pollution: the caches above us decide what stays in memory) into a 4 KiB-
aligned buffer, followed by a CRC-32C of that slot. Where the file system refuses O_DIRECT (at open or at
the first read), the store says so once in the log and uses buffered reads from then on. Both preadv and
crc32c release the GIL, so `threads` reads really are in flight together.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fomoepy.errors import StoreError
from fomoepy.experts.reads import Read, ReadPool
from fomoepy.experts.source import LayerExperts, expert_index
from fomoepy.experts.store_format import (
    ALIGN,
    FILE_HEADER_SIZE,
    StoreManifest,
    bind_gguf,
    check_file_header,
    read_manifest,
    record_checksum,
)
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec

log = logging.getLogger(__name__)

ExpertBytes = tuple[np.ndarray, np.ndarray, np.ndarray]
MAX_THREADS = 8
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: plain buffered reads


def default_threads() -> int:
    """Reader threads a store starts by default: two for each CPU this process may run on, at most eight.

    A reader thread is Python's: it takes the GIL three times a read, between its preadv and its CRC, and
    each read's bytes then cost the CPU that ran it. On a 2-vCPU machine eight of them cost more than the
    reads they overlap gain (`fomoe generate`'s decode of the bench model, 128 tokens, its host tier at
    25 %, six runs each, alternating, by hand: 40.9-45.0 tok/s with eight against 44.8-49.9 with four, the
    faster in every pair; `bench/over_memory.py` at 2x the cap 30.9-36.6 against 30.4-39.5, at 4x
    7.5-11.5 against 7.0-10.9; one thread was slower, two no faster than eight). Four is two a CPU there;
    a machine of four CPUs or more keeps the eight a drive's queue was given before (not measured here)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, 2 * cpus))


def aligned_empty(nbytes: int, alignment: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` whose first byte sits at a multiple of `alignment`."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]


class _Copy:
    """One record file in one directory, opened for reading; the fd may be swapped for a buffered one."""

    def __init__(self, path: Path, fd: int, direct: bool):
        self.path, self.fd, self.direct = path, fd, direct
        self.lock = threading.Lock()
        self.warned = False
        self.retired: list[int] = []  # fds replaced while other threads may still read them: closed at close()


class ExpertStore:
    """Experts of one GGUF read from its store. `read(layer, expert)` is GGUFExpertSource.read's contract.

    Thread-safe: `read`/`read_into` may be called from any thread; `submit`/`read_many` use the pool.
    """

    def __init__(self, manifest: StoreManifest, dirs: dict[int, Path], layers: tuple[LayerExperts, ...],
                 threads: int, verify: bool, direct: bool):
        self.manifest = manifest
        self.dirs = dirs  # slot -> directory, only the slots given
        self.layers = layers
        self.verify = verify
        self.threads = threads
        self.direct = direct and O_DIRECT != 0
        self._copies: list[list[_Copy]] = []
        self._rr = itertools.count()  # round-robin over mirrored copies; next() is atomic in CPython
        self._pool: ReadPool | None = None
        self._pool_lock = threading.Lock()
        base = manifest.layer_base()
        idx = manifest.index
        # (file, offset, crc) per expert, as Python ints: the hot path does no numpy indexing
        self._where = [
            list(zip(idx["file"][base[ll]:base[ll + 1]].tolist(), idx["offset"][base[ll]:base[ll + 1]].tolist(),
                     idx["crc"][base[ll]:base[ll + 1]].tolist()))
            for ll in range(len(manifest.layers))
        ]
        self._splits = [np.cumsum([p.nbytes for p in ll.parts]).tolist() for ll in manifest.layers]

    @classmethod
    def open(cls, dirs: Sequence[str | os.PathLike[str]], gguf_file: GGUFFile | str | os.PathLike[str], *,
             threads: int | None = None, verify: bool = True, direct: bool = True) -> ExpertStore:
        """Open the store in `dirs` (any order; a mirrored store needs only some of its copies) for `gguf_file`.

        Raises StoreError if a directory holds no complete store, the directories are not one store, the
        store was prepared from another GGUF, or a record file is missing, truncated or not the one expected.
        """
        if threads is None:
            threads = default_threads()
        if threads < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        gf = gguf_file if isinstance(gguf_file, GGUFFile) else GGUFFile(gguf_file)
        layers = expert_index(gf, ModelSpec.from_gguf(gf))
        by_slot: dict[int, Path] = {}
        manifest: StoreManifest | None = None
        for d in (Path(x) for x in dirs):
            m = read_manifest(d)
            if manifest is None:
                manifest = m
            elif not m.same_store(manifest):
                raise StoreError(f"{d}: holds a different store than {by_slot[manifest.slot]}")
            if m.slot in by_slot:
                raise StoreError(f"{d}: the same store directory (slot {m.slot}) is given twice, also as {by_slot[m.slot]}")
            by_slot[m.slot] = d
        if manifest is None:
            raise StoreError("no store directory given")
        missing = sorted(set(range(manifest.n_dirs)) - set(by_slot))
        if missing and not manifest.mirror:
            raise StoreError(
                f"{by_slot[manifest.slot]}: the store is striped over {manifest.n_dirs} directories, "
                f"{len(by_slot)} given (missing slot {', '.join(map(str, missing))})"
            )
        _check_binding(manifest, gf, layers, by_slot[manifest.slot])
        store = cls(manifest, dict(sorted(by_slot.items())), layers, threads, verify, direct)
        try:
            store._open_files()
        except BaseException:
            store.close()
            raise
        return store

    # --- reading ---------------------------------------------------------------------------------

    @property
    def read_ahead_depth(self) -> int:
        """Reads made ahead in flight at most (fomoepy.experts.read_ahead): half the reader threads, so a
        step's own reads always find readers free. Fewer starve a real drive: `bench/over_memory.py`'s 4x
        case on a 2-vCPU virtual machine's disk decoded 2.2-2.4 tok/s with 2, 2.7 with 4 and 2.6-2.8 with 16
        (runs not recorded, alternating)."""
        return max(1, self.threads // 2)

    @property
    def n_copies(self) -> int:
        """Copies of each record that can be read: the mirrored directories given, else 1."""
        return len(self.dirs) if self.manifest.mirror else 1

    def slot_nbytes(self, layer: int) -> int:
        """The buffer size `read_into` needs for an expert of `layer`."""
        return self.manifest.layers[layer].slot_nbytes

    def read(self, layer: int, expert: int) -> ExpertBytes:
        """(gate, up, down) bytes of one expert, in their GGUF quant types, in a fresh aligned buffer."""
        return self.read_into(layer, expert)

    def read_into(self, layer: int, expert: int, out: np.ndarray | None = None, copy: int | None = None) -> ExpertBytes:
        """Read one expert into `out` (uint8, >= slot_nbytes(layer), 4 KiB-aligned) and return views of it.

        `copy` picks one mirrored copy (no fallback); by default copies take turns, and a failed copy
        falls back to the next. Raises StoreError naming the layer, expert and file.
        """
        ll = self.manifest.layers[layer]
        if not 0 <= expert < ll.n_expert:
            raise IndexError(f"layer {layer}: expert {expert} outside [0, {ll.n_expert})")
        slot = ll.slot_nbytes
        if out is None:
            out = aligned_empty(slot)
        elif out.dtype != np.uint8 or out.nbytes < slot or out.ctypes.data % ALIGN or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a contiguous 4 KiB-aligned uint8 buffer of >= {slot} bytes")
        file_id, offset, crc = self._where[layer][expert]
        copies = self._copies[file_id]
        if copy is not None:
            order = [copies[copy]]
        else:
            first = next(self._rr) % len(copies) if len(copies) > 1 else 0
            order = copies[first:] + copies[:first]
        buf = out[:slot]
        errors: list[StoreError] = []
        failed: list[_Copy] = []
        for c in order:
            try:
                self._pread(c, buf, offset, layer, expert)
                if self.verify:
                    got = record_checksum(layer, expert, [buf])
                    if got != crc:
                        raise StoreError(
                            f"layer {layer} expert {expert}: checksum mismatch in {c.path} at offset {offset:,} "
                            f"(expected {crc:08x}, got {got:08x}); the store is damaged, run `fomoe prepare` again"
                        )
            except StoreError as e:
                errors.append(e)
                failed.append(c)
                continue
            for bad, e in zip(failed, errors):
                if not bad.warned:  # once per damaged copy: the caller got good bytes
                    bad.warned = True
                    log.warning("%s; reading the copy in %s instead", e, c.path.parent)
            g, u, d = self._splits[layer]
            return out[:g], out[g:u], out[u:d]
        if len(errors) == 1:
            raise errors[0]
        raise StoreError(f"every copy failed: {'; '.join(map(str, errors))}")

    def submit(self, layer: int, expert: int, out: np.ndarray | None = None, copy: int | None = None) -> Read:
        """Queue one read on the pool's threads; the Read's result is read_into's, its exception a StoreError."""
        pool = self._pool
        if pool is None:
            pool = self._reader_pool()
        return pool.submit(self.read_into, layer, expert, out, copy)

    def read_many(self, keys: Iterable[tuple[int, int]]) -> list[ExpertBytes]:
        """Read many (layer, expert) at once, all in flight together; results in the order of `keys`."""
        futures = [self.submit(layer, expert) for layer, expert in keys]
        return [f.result() for f in futures]

    def record_path(self, layer: int, expert: int, copy: int = 0) -> Path:
        """The file that holds copy `copy` of an expert's record."""
        return self._copies[self._where[layer][expert][0]][copy].path

    def drop_cache(self) -> None:
        """Ask the kernel to forget cached pages of every record file (cold reads without O_DIRECT)."""
        for copies in self._copies:
            for c in copies:
                os.posix_fadvise(c.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for copies in self._copies:
            for c in copies:
                for fd in (c.fd, *c.retired):
                    os.close(fd)
        self._copies = []

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------

    def _reader_pool(self) -> ReadPool:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ReadPool(self.threads, "fomoe-store")
            return self._pool

    def _open_files(self) -> None:
        m = self.manifest
        header = aligned_empty(FILE_HEADER_SIZE)
        for fid, f in enumerate(m.files):
            copies: list[_Copy] = []
            self._copies.append(copies)  # before opening, so that close() after a failure closes them
            for slot in m.slots_of(fid):
                if slot not in self.dirs:
                    continue
                path = self.dirs[slot] / f.name
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    raise StoreError(f"{path}: missing record file of layer {f.layer}; run `fomoe prepare` again") from None
                if size != m.file_size(fid):
                    raise StoreError(
                        f"{path}: record file of layer {f.layer} has {size:,} bytes, expected {m.file_size(fid):,} "
                        f"({'truncated' if size < m.file_size(fid) else 'too long'}); run `fomoe prepare` again"
                    )
                c = self._open(path)
                copies.append(c)
                self._pread(c, header, 0, f.layer, None)
                check_file_header(header.tobytes(), m, fid, path)

    def _open(self, path: Path) -> _Copy:
        if self.direct:
            try:
                return _Copy(path, os.open(path, os.O_RDONLY | O_DIRECT), True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise StoreError(f"{path}: cannot open ({e.strerror})") from None
                self.direct = False
                log.info("%s: O_DIRECT is not supported here; using buffered reads", path.parent)
        try:
            return _Copy(path, os.open(path, os.O_RDONLY), False)
        except OSError as e:
            raise StoreError(f"{path}: cannot open ({e.strerror})") from None

    def _pread(self, c: _Copy, buf: np.ndarray, offset: int, layer: int, expert: int | None) -> None:
        what = f"layer {layer} expert {expert}" if expert is not None else f"layer {layer} file header"
        got = 0
        while got < len(buf):
            fd, direct = c.fd, c.direct
            try:
                n = os.preadv(fd, [buf[got:]], offset + got)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:  # open accepted O_DIRECT, reads do not
                    self._to_buffered(c, fd)
                    continue
                raise StoreError(f"{what}: read failed in {c.path} at offset {offset + got:,} ({e.strerror})") from None
            if n == 0:
                raise StoreError(
                    f"{what}: {c.path} is truncated (expected {len(buf):,} bytes at offset {offset:,}, got {got:,})"
                )
            got += n

    def _to_buffered(self, c: _Copy, old_fd: int) -> None:
        with c.lock:
            if c.fd != old_fd:
                return  # another thread swapped it already
            try:
                c.fd = os.open(c.path, os.O_RDONLY)
            except OSError as e:
                raise StoreError(f"{c.path}: cannot open ({e.strerror})") from None
            c.direct = False
            c.retired.append(old_fd)
        if self.direct:
            self.direct = False
            log.info("%s: O_DIRECT reads are refused here; using buffered reads", c.path.parent)


def _check_binding(m: StoreManifest, gf: GGUFFile, layers: tuple[LayerExperts, ...], directory: Path) -> None:
    binding = bind_gguf(gf, layers)
    if binding.digest != m.binding.digest:
        raise StoreError(
            f"{directory}: this store was prepared from another GGUF, {m.binding.describe()}, not from {gf.path} "
            f"({binding.model_name or 'unnamed'}, {binding.file_size:,} bytes); run `fomoe prepare` for this one"
        )
    for ll, le in zip(m.layers, layers, strict=True):
        got = tuple((p.tensor, p.qtype, p.shape, p.nbytes) for p in le.parts)
        if tuple((p.tensor, p.qtype, p.shape, p.nbytes) for p in ll.parts) != got:
            raise StoreError(f"{directory}: layer {ll.layer} of the store does not match {gf.path}")
