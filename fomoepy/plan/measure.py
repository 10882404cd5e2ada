"""`fomoe plan --measure DIR`: this machine's host and drive figures from short measurements, and, for a
model file, the host's own time per layer step as the engine spends it (`host.plan`) and the rate at
which the cpu backend sets a miss into its tier's slots (`host.fill`).

Each figure is the median of a few passes. The drive is measured in DIR (on the drive the store
would live on) with O_DIRECT reads of a scratch file, so the page cache does not answer for it; the
file is removed afterwards. Where the file system refuses O_DIRECT the figure is the page cache's,
and the returned notes say so.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from fomoepy.errors import FomoeError
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
            rng = np.random.default_rng(0)
            offsets = rng.integers(0, SCRATCH_BYTES // 4096, 64) * 4096
            small = view[:4096]
            latency = _median_seconds(lambda: [os.preadv(fd, [small], int(o)) for o in offsets], 3) / len(offsets)
        finally:
            os.close(fd)
    except OSError as exc:
        raise FomoeError(f"--measure {directory}: {exc.strerror}") from None
    finally:
        path.unlink(missing_ok=True)
    return {"bandwidth": bandwidth, "latency": latency}, notes


def engine_figures(model: str, store: str | None = None, threads: int | None = None, tokens: int = 48, warm: int = 32) -> tuple[float, float]:
    """(seconds of the host's own work per layer step, store bytes/s set into the tier's slots) of a decode
    on `model` with the cpu backend. The first is what `--profile-timing` reports as `host`: the step's
    time less ggml's products and the waits for expert reads, with the host tier at a quarter of the
    experts, as bench/host_time.py measures it; reading the experts from `store` when given (its reader
    pool and host-tier admissions are host work too). The first `warm` tokens fill the tiers and are not
    counted. The second is the backend's making ready of a miss (slot_fill_rate), on the same engine."""
    from fomoepy.engine import Engine, EngineOptions

    stores = (store,) if store else ()
    probe = Engine(model, EngineOptions(backend="cpu", store=stores, vram_cache=0, ram_cache=0))
    experts = sum(layer.expert_nbytes for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    options = EngineOptions(backend="cpu", store=stores, threads=threads, vram_cache=0, ram_cache=experts // 4,
                            profile_timing=True)  # fmt: skip
    engine = Engine(model, options)
    try:
        state = engine.new_state()
        token = int(np.argmax(engine.eval(state, [1, 2, 3, 4])[-1]))
        timer = engine.timer
        for i in range(warm + tokens):
            if i == warm:  # the tiers have filled: measure from here
                before = (sum(timer.total), sum(timer.matmul), sum(timer.io_wait), sum(timer.steps))
            token = int(np.argmax(engine.decode_token(state, token)))
        total, matmul, wait, steps = (sum(timer.total), sum(timer.matmul), sum(timer.io_wait), sum(timer.steps))
        host = ((total - before[0]) - (matmul - before[1]) - (wait - before[2])) / max(1, steps - before[3])
        return host, slot_fill_rate(engine)
    finally:
        engine.close()


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


def measured(hw: Hardware, directory: str, model: str | None = None) -> tuple[Hardware, list[str]]:
    """`hw` with its host and drive figures replaced by this machine's (drive count kept); given a model
    file, its host time per layer step too (otherwise the hardware file's stated figure stays)."""
    drive, notes = drive_figures(directory)
    host = host_figures()
    if model is not None:
        store = directory if (Path(directory) / "fomoe-store.manifest").exists() else None
        # the host's time per step, and the cpu backend's setting of each miss into a tier slot (its copy
        # up: a term of its own, after the step's reads land), both on the model as the engine runs it
        host["plan"], host["fill"] = engine_figures(model, store)
        host["serial"] = None  # measured whole: the cpu backend's step is not split at its reads
        where = f"{Path(model).name}, experts from the store in {directory}" if store else Path(model).name
        notes.append(f"host time per layer step {host['plan'] * 1e6:.0f} us and slot fills {host['fill'] / 1e9:.2f} GB/s, "
                     f"measured on {where} (cpu backend)")  # fmt: skip
    else:
        notes.append(f"host time per layer step {hw.host.plan * 1e6:.0f} us, as the hardware file states it")
    return hw.with_changes(host=host, drives=drive), notes
