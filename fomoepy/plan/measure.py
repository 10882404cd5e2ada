"""`fomoe plan --measure DIR`: this machine's host and drive figures from short measurements, and, for a
model file, the host's own time per layer step as the engine spends it (`host.plan`), the rate at
which the cpu backend sets a miss into its tier's slots (`host.fill`), the share of the experts it
reads that it sets there (`host.fill_share`: a decode step computes the others where they landed) and
the model's own next-layer predictions (for the reads made ahead).

Each figure is the median of a few passes. The drive is measured in DIR (on the drive the store
would live on) with O_DIRECT reads, so the page cache does not answer for it. Where DIR holds the
model's store, its bandwidth is the store's records read as the engine reads them (in a random order,
through the store's own reader, several in flight): a scratch file read in order, one 4 MiB block at a
time, gave 1.15-1.94 GB/s on this project's virtual disk where the engine's pattern gave 1.08-1.56 in
the same minutes; or, where it is higher, the rate at which the model's decode under --measure read the
disk (its bytes over its time: a drive is at least that fast, and a virtual disk whose rate depends on what
read before it can serve a decode faster than passes made right before and after it). Otherwise a
scratch file is written there, read, and removed. Where the file system
refuses O_DIRECT the figure is the page cache's, and the returned notes say so.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.trace import Trace, read_trace
from fomoepy.plan.hardware import Hardware

SCRATCH_BYTES = 256 << 20
CHUNK = 4 << 20


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def host_figures(threads: int | None = None) -> dict:
    """Memory bandwidth (numpy copy), and the CPU backend's own products as it runs them: ggml on a
    Q4_K matrix, one token (matvec: weight bytes/s) and a prompt batch (flops: 2 per multiply-add)."""
    from gguf import GGMLQuantizationType

    from fomoepy import quants
    from fomoepy.runtime.ggml_matmul import QuantMatrix, mul_mat

    threads = threads or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    src = rng.standard_normal(SCRATCH_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy = 2 * src.nbytes / _median_seconds(lambda: np.copyto(dst, src), 3)  # read + write
    n, k, batch = 2048, 4096, 128
    qtype = GGMLQuantizationType.Q4_K
    w = QuantMatrix.of(quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype).reshape(-1), qtype, (n, k))
    one = rng.standard_normal((1, k), dtype=np.float32)
    prompt = rng.standard_normal((batch, k), dtype=np.float32)
    matvec = w.nbytes / _median_seconds(lambda: mul_mat(one, w, threads), 9)
    flops = 2 * n * k * batch / _median_seconds(lambda: mul_mat(prompt, w, threads), 3)
    # make_ready is left as the file states it: whether a backend converts store bytes at all is the
    # backend's property, not this machine's
    return {"bandwidth": copy, "matvec": matvec, "flops": flops}


def drive_figures(directory: str) -> tuple[dict, list[str]]:
    path = Path(directory) / ".fomoe-plan-measure.tmp"
    notes = []
    try:
        with open(path, "wb") as f:
            block = os.urandom(CHUNK)
            f.writelines(block for _ in range(SCRATCH_BYTES // CHUNK))
            f.flush()
            os.fsync(f.fileno())
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
            notes.append(f"{directory}: no O_DIRECT here, the drive figures are the page cache's")
        try:
            buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
            view = memoryview(buf)

            def sequential() -> None:
                for off in range(0, SCRATCH_BYTES, CHUNK):
                    os.preadv(fd, [view], off)

            sequential()  # unmeasured: the drive may still be writing the scratch file back
            bandwidth = SCRATCH_BYTES / _median_seconds(sequential, 3)
        finally:
            os.close(fd)
        latency = _small_read_latency([path], np.random.default_rng(0))
    except OSError as exc:
        raise FomoeError(f"--measure {directory}: {exc.strerror}") from None
    finally:
        path.unlink(missing_ok=True)
    return {"bandwidth": bandwidth, "latency": latency}, notes


def store_figures(directory: str, model: str, passes: int = 3, between: Callable[[], Any] | None = None) -> tuple[dict, list[str]]:
    """The drive figures of the store in `directory` as the engine reads it: bandwidth, the bytes/s of its
    expert records read in a random order through its own reader (the engine's default threads, 2 reads a
    thread in flight), up to SCRATCH_BYTES a pass; latency, 4 KiB O_DIRECT reads at random offsets of its
    files, one at a time. Medians over `passes` (each pass reads a different sample); with `between`, as
    many passes again after calling it (what else is measured meanwhile: a virtual disk's rate moves by a
    quarter within seconds, so the passes are spread over the whole measurement, not taken in one burst)."""
    from fomoepy.errors import StoreError
    from fomoepy.experts.store_reader import ExpertStore

    notes = []
    try:
        store = ExpertStore.open([directory], model)
    except StoreError as e:
        raise FomoeError(f"--measure {directory}: {e}") from None
    with store:
        if not store.direct:
            notes.append(f"{directory}: no O_DIRECT here, the drive figures are the page cache's")
        keys = [(il, e) for il, layer in enumerate(store.manifest.layers) for e in range(layer.n_expert)]
        per_pass = max(1, min(len(keys), SCRATCH_BYTES // max(1, store.layers[0].expert_nbytes)))
        rng = np.random.default_rng(0)

        def rates() -> list[float]:
            return [n / seconds for n, seconds in
                    (timed_reads(store, [keys[i] for i in rng.permutation(len(keys))[:per_pass]]) for _ in range(passes))]  # fmt: skip

        measured = rates()
        if between is not None:
            between()
            measured += rates()
    files = sorted(Path(directory).glob("*.experts"))
    latency = _small_read_latency(files, rng) if files else 0.0
    return {"bandwidth": float(np.median(measured)), "latency": latency}, notes


def timed_reads(store, keys: list[tuple[int, int]]) -> tuple[int, float]:
    """(bytes, seconds) of every key's record read through the store's reader, 2 reads a reader thread in
    flight (a sliding window, the oldest waited for first), into buffers reused from read to read, their
    pages mapped before the clock starts, as the engine's reads land (a pinned pool, a read arena, reused
    read buffers). A buffer new to the process costs its page faults in the read: passes into fresh ones
    read 1.39-1.43 GB/s on this project's virtual disk where the same passes into reused ones read
    1.81-1.93, in the same minutes."""
    from fomoepy.experts.store_reader import aligned_empty

    window, nbytes, in_flight = 2 * store.threads, 0, deque()
    rings: dict[int, list[np.ndarray]] = {}  # a buffer size -> `window` buffers, taken in turn
    for layer in sorted({key[0] for key in keys}):
        size = store.slot_nbytes(layer)
        if size not in rings:
            rings[size] = [aligned_empty(size) for _ in range(window)]
            for buf in rings[size]:
                buf[:] = 0
    turns = dict.fromkeys(rings, 0)
    t = time.perf_counter()
    for key in keys:
        # (a buffer's last read was `window` reads of its size ago, or more: waited for, below)
        size = store.slot_nbytes(key[0])
        buf, turns[size] = rings[size][turns[size] % window], turns[size] + 1
        in_flight.append(store.submit(*key, out=buf))
        if len(in_flight) >= window:
            nbytes += sum(part.nbytes for part in in_flight.popleft().result())
    nbytes += sum(part.nbytes for read in in_flight for part in read.result())
    return nbytes, time.perf_counter() - t


def _small_read_latency(files: list[Path], rng: np.random.Generator, reads: int = 64) -> float:
    """Seconds of one 4 KiB read at a random offset of one of `files`, one at a time (O_DIRECT where allowed)."""
    fds = []
    try:
        for f in files:
            try:
                fds.append((os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), f.stat().st_size))
            except OSError:
                fds.append((os.open(f, os.O_RDONLY), f.stat().st_size))
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        picks = [(fds[int(rng.integers(len(fds)))]) for _ in range(reads)]
        offsets = [(fd, int(rng.integers(0, max(1, size // 4096))) * 4096) for fd, size in picks]
        return _median_seconds(lambda: [os.preadv(fd, [view], o) for fd, o in offsets], 3) / reads
    finally:
        for fd, _ in fds:
            os.close(fd)


def engine_figures(model: str, store: str | None = None, threads: int | None = None, tokens: int = 48, warm: int = 32,
                   trace: str | None = None, seen: dict | None = None) -> tuple[float, float, float]:  # fmt: skip
    """(seconds of the host's own work per layer step, store bytes/s set into the tier's slots, the share of
    the experts read that are set into them) of a decode on `model` with the cpu backend. The first is what
    `--profile-timing` reports as `host`: the step's time less ggml's products and the waits for expert
    reads, with the host tier at a quarter of the experts, as bench/host_time.py measures it; reading the
    experts from `store` when given (its reader pool and host-tier admissions are host work too). The
    first `warm` tokens fill the tiers and are not counted. The second is the backend's making ready of a
    miss (slot_fill_rate), on the same engine; the third, of the run's reads, those its tier admitted (the
    others a decode step computes where they landed). The first leaves out the time the second puts on
    the run's admissions, which the projection counts apart.
    `trace`: a file the decode's routing and its next-layer predictions are recorded in. `seen`, given, gets
    "drive": the bytes the process read from the disk over the counted tokens' time (None where the system
    does not say): a floor of the rate the decode's reads came at."""
    from fomoepy.engine import Engine, EngineOptions

    stores = (store,) if store else ()
    probe = Engine(model, EngineOptions(backend="cpu", store=stores, vram_cache=0, ram_cache=0))
    experts = sum(layer.expert_nbytes for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    options = EngineOptions(backend="cpu", store=stores, threads=threads, vram_cache=0, ram_cache=experts // 4,
                            profile_timing=True, trace=trace)  # fmt: skip
    engine = Engine(model, options)
    try:
        state = engine.new_state()
        token = int(np.argmax(engine.eval(state, [1, 2, 3, 4])[-1]))
        timer, cache = engine.timer, engine.experts.streamer.cache
        for i in range(warm + tokens):
            if i == warm:  # the tiers have filled: measure from here
                before = (sum(timer.total), sum(timer.matmul), sum(timer.io_wait), sum(timer.steps))
                counts_before = _reads_and_admissions(cache.stats)
                disk_before, started = disk_read_bytes(), time.perf_counter()
            token = int(np.argmax(engine.decode_token(state, token)))
        if seen is not None:
            disk_after, seconds = disk_read_bytes(), time.perf_counter() - started
            seen["drive"] = (disk_after - disk_before) / seconds if disk_before is not None and disk_after is not None else None
        total, matmul, wait, steps = (sum(timer.total), sum(timer.matmul), sum(timer.io_wait), sum(timer.steps))
        reads, admitted, admitted_bytes = (b - a for a, b in zip(counts_before, _reads_and_admissions(cache.stats)))
        fill = slot_fill_rate(engine)
        # the admitted misses' slot fills happen inside the step, outside ggml's products: the projection has
        # them as a term of their own (their bytes at `fill`), so the host's share leaves out that same time
        fills = admitted_bytes / fill
        host = ((total - before[0]) - (matmul - before[1]) - (wait - before[2]) - fills) / max(1, steps - before[3])
        return host, fill, admitted / reads if reads else 1.0
    finally:
        engine.close()


def disk_read_bytes() -> int | None:
    """Bytes this process has had read from storage so far (Linux's /proc/self/io `read_bytes`: O_DIRECT reads
    too, not the page cache's answers); None where the system does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return None


def _reads_and_admissions(stats) -> tuple[int, int, int]:
    """(experts read from the drives, of the misses those the device tier admitted, their bytes) so far."""
    device = stats.total("device")
    return stats.total_disk().reads, device.admitted, device.admitted_bytes


def slot_fill_rate(engine, experts: int = 8) -> float:
    """Store bytes/s the cpu backend's `engine` sets into a slot of its tier (in the form its slots hold:
    a memcpy when plain, ggml's repacking when repacked; its making ready of a miss), over layer 0's
    first `experts` experts read from its source first (the median of their times)."""
    pool, source = engine.experts.device.pool_of[0], engine.source
    parts = [source.read(0, e) for e in range(min(experts, engine.spec.moe.n_expert))]
    nbytes = source.layers[0].expert_nbytes
    times = []
    for raw in parts:
        t = time.perf_counter()
        pool.stage(0, raw)
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times))


@dataclass
class Measured:
    """What --measure found: the hardware with this machine's figures, a note on each, and (given a model)
    a trace of its decode with its own next-layer predictions, for the reads made ahead."""

    hardware: Hardware
    notes: list[str]
    predictions: Trace | None = None


def measured(hw: Hardware, directory: str, model: str | None = None, threads: int | None = None) -> Measured:
    """`hw` with its host and drive figures replaced by this machine's (drive count kept); given a model
    file, its host time per layer step and its predictions too (otherwise the hardware file's stated host
    figure stays); given a model whose store is in `directory`, the drive as the engine reads that store.
    `threads`: the products' and the engine's CPU threads (None: all cores, and the engine's choice)."""
    store = directory if model is not None and (Path(directory) / "fomoe-store.manifest").exists() else None
    host = host_figures(threads)
    predictions = None
    if model is not None:
        # the host's time per step, and the cpu backend's setting of each miss into a tier slot (its copy
        # up: a term of its own, after the step's reads land), both on the model as the engine runs it;
        # the decode's trace carries the model's own predictions. Where the store is the model's, its drive
        # is measured before and after that decode (store_figures' `between`)
        with tempfile.TemporaryDirectory(prefix="fomoe-measure-") as scratch:
            trace = str(Path(scratch) / "measure.trace")

            seen: dict = {}

            def decode() -> None:
                host["plan"], host["fill"], host["fill_share"] = engine_figures(model, store, threads, trace=trace, seen=seen)

            if store:
                drive, notes = store_figures(directory, model, between=decode)
            else:
                drive, notes = drive_figures(directory)
                decode()
            recorded = read_trace(trace)
        # (named for the line that states where the reads ahead come from: the file itself is gone)
        predictions = replace(recorded, path=f"{Path(model).name}'s decode under --measure") if recorded.prediction_accuracy() else None
        host["serial"] = None  # measured whole: the cpu backend's step is not split at its reads
        if store:
            # the decode's own reads came at least this fast (its bytes over its time, compute and all): a disk
            # whose rate depends on what read before it (a virtual one: its passes right after a decode have
            # read 1.3 GB/s where the decode's reads came at 1.8-2.1, by hand) is at least that fast
            decoded = seen.get("drive")
            if decoded is not None and decoded > drive["bandwidth"]:
                notes.append(f"drive {decoded / 1e9:.2f} GB/s as the engine reads the store in {directory}: the rate that decode's "
                             f"own reads came at (its bytes over its time), above the {drive['bandwidth'] / 1e9:.2f} GB/s the "
                             "store's records read in passes before and after it")  # fmt: skip
                drive = {**drive, "bandwidth": decoded}
            else:
                notes.append(f"drive {drive['bandwidth'] / 1e9:.2f} GB/s as the engine reads the store in {directory}, before and after that decode")
        where = f"{Path(model).name}, experts from the store in {directory}" if store else Path(model).name
        notes.append(f"host time per layer step {host['plan'] * 1e6:.0f} us and slot fills {host['fill'] / 1e9:.2f} GB/s "
                     f"({100 * host['fill_share']:.0f}% of the experts read set into slots), "
                     f"measured on {where} (cpu backend)")  # fmt: skip
    else:
        drive, notes = drive_figures(directory)
        notes.append(f"host time per layer step {hw.host.plan * 1e6:.0f} us, as the hardware file states it")
    return Measured(hw.with_changes(host=host, drives=drive), notes, predictions)
