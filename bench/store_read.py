"""Expert store read bandwidth next to the raw O_DIRECT bandwidth of the same disk, in one run.

The model is the bench-qwen3moe test model (≈ 0.6 GB, 8 layers x 64 experts of ≈ 1 MB), written once under
bench/models/ like bench/cpu_decode.py; its store is prepared (or reused, if it opens and matches) in
bench/models/bench-qwen3moe.store/ or the --dir directories. A plain file of the store's size is written
beside it and read with O_DIRECT in the same block size as a record slot, sequentially and at random
slot-aligned offsets; the store is read through its reader pool in a random expert order. Reads are
cold: O_DIRECT bypasses the page cache (where a file system refuses it, every pass starts with
posix_fadvise DONTNEED instead, and the table says so).

    python bench/store_read.py [--dir DIR ...] [--mirror] [--threads 8] [--passes 3] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
from results import describe_fs, record

from fomoepy.devtools.make_test_model import make_model
from fomoepy.errors import StoreError
from fomoepy.experts.store_reader import O_DIRECT, ExpertStore, aligned_empty
from fomoepy.experts.store_writer import prepare_store
from fomoepy.plan.measure import timed_reads

HERE = Path(__file__).parent
MODEL = HERE / "models" / "bench-qwen3moe.gguf"
STORE = HERE / "models" / "bench-qwen3moe.store"


def ensure_model() -> Path:
    if not MODEL.exists():
        MODEL.parent.mkdir(parents=True, exist_ok=True)
        make_model(MODEL, preset="bench-qwen3moe")
    return MODEL


def ensure_store(dirs: list[Path], mirror: bool, threads: int) -> ExpertStore:
    try:
        store = ExpertStore.open(dirs, MODEL, threads=threads)
        if store.manifest.mirror == mirror and store.manifest.n_dirs == len(dirs):
            return store
        store.close()
    except StoreError:
        pass
    prepare_store(MODEL, dirs, mirror=mirror, progress=True)
    return ExpertStore.open(dirs, MODEL, threads=threads)


def ensure_raw_file(path: Path, nbytes: int) -> Path:
    """A file of random bytes (no zero pages a drive or VM could short-cut), written once."""
    if path.exists() and path.stat().st_size == nbytes:
        return path
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        os.fsync(f.fileno())
    return path


class RawReader:
    """O_DIRECT block reads of one file from a thread pool, each thread with its own aligned buffer."""

    def __init__(self, path: Path, block: int, threads: int):
        self.block, self.threads = block, threads
        self.direct = bool(O_DIRECT)
        try:
            self.fd = os.open(path, os.O_RDONLY | O_DIRECT)
        except OSError:
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)
        self.n_blocks = os.fstat(self.fd).st_size // block
        self.local = threading.local()

    def _read(self, i: int) -> int:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = aligned_empty(self.block)
        return os.preadv(self.fd, [buf], i * self.block)

    def run(self, order: np.ndarray, threads: int) -> tuple[int, float]:
        if not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        if threads == 1:
            total = sum(self._read(int(i)) for i in order)
        else:
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(self._read, order.tolist(), chunksize=4))
        return total, time.perf_counter() - t0

    def close(self) -> None:
        os.close(self.fd)


def store_pass(store: ExpertStore, keys: list[tuple[int, int]], verify: bool) -> tuple[int, float]:
    """All `keys` through the reader pool, keeping 2 reads per thread in flight (a sliding window: the
    `fomoe plan --measure` drive figure's pass)."""
    if not store.direct:
        store.drop_cache()
    store.verify = verify
    return timed_reads(store, keys)


def caller_pass(store: ExpertStore, keys: list[tuple[int, int]]) -> tuple[int, float]:
    """All `keys` read one after another in this thread: queue depth 1."""
    if not store.direct:
        store.drop_cache()
    store.verify = True
    t0 = time.perf_counter()
    total = sum(v.nbytes for key in keys for v in store.read(*key))
    return total, time.perf_counter() - t0


def over_passes(passes: int, run) -> tuple[int, float]:
    """Bytes and seconds summed over all passes: a mean bandwidth, not a lucky one."""
    results = [run(p) for p in range(passes)]
    return sum(r[0] for r in results), sum(r[1] for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", action="append", type=Path, help="store directory (repeat for several drives)")
    ap.add_argument("--mirror", action="store_true", help="a mirrored store over the --dir directories")
    ap.add_argument("--threads", type=int, default=8, help="largest reader pool measured (1, 2 and 4 too)")
    ap.add_argument("--passes", type=int, default=3, help="passes over all experts per measurement")
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()
    command = " ".join(["python bench/store_read.py", *(shlex.quote(a) for a in sys.argv[1:])])

    ensure_model()
    dirs = args.dir or [STORE]
    store = ensure_store(dirs, args.mirror, args.threads)
    m = store.manifest
    keys = [(ll.layer, e) for ll in m.layers for e in range(ll.n_expert)]
    slot = m.layers[0].slot_nbytes
    raw = RawReader(ensure_raw_file(dirs[0] / "raw-read.bin", m.total_bytes()), slot, args.threads)
    rng = np.random.default_rng(1)

    def shuffled_keys() -> list[tuple[int, int]]:
        return [keys[i] for i in rng.permutation(len(keys))]

    sequential = np.arange(raw.n_blocks)
    passes = args.passes
    rows = [
        ("raw O_DIRECT, sequential", 1, over_passes(passes, lambda p: raw.run(sequential, 1))),
        ("store `read()` in the caller, random experts, CRC-32C", 1, over_passes(passes, lambda p: caller_pass(store, shuffled_keys()))),
    ]  # fmt: skip
    pools = {}
    for n in sorted({1, 2, 4, args.threads}):  # the thread count that serves best depends on the disk
        pool = ExpertStore.open(dirs, MODEL, threads=n)
        pools[n] = pool
        rows += [
            ("raw O_DIRECT, random", n, over_passes(passes, lambda p: raw.run(rng.permutation(raw.n_blocks), n))),
            ("store pool, random experts, CRC-32C", n, over_passes(passes, lambda p: store_pass(pool, shuffled_keys(), True))),
            ("store pool, random experts, no checksum", n, over_passes(passes, lambda p: store_pass(pool, shuffled_keys(), False))),
        ]  # fmt: skip
    for pool in pools.values():
        pool.close()
    cold = "O_DIRECT" if store.direct and raw.direct else "posix_fadvise DONTNEED (O_DIRECT refused)"
    header = (
        f"### store_read — {date.today()} — {platform.machine()}, {os.cpu_count()} cores, {describe_fs(dirs[0])}\n\n"
        f"`{command}`; store: {len(keys)} experts of {len(m.layers)} layers, {m.total_bytes() / 1e9:.2f} GB, "
        f"{'mirrored' if m.mirror else 'striped'} over {m.n_dirs} dir(s); block = one record slot = {slot:,} B; "
        f"cold reads by {cold}; {args.passes} passes each\n\n"
        "| read | threads | GB | s | GB/s |\n|---|---|---|---|---|\n"
    )
    table = "\n".join(f"| {name} | {threads} | {n / 1e9:.2f} | {s:.2f} | {n / 1e9 / s:.2f} |" for name, threads, (n, s) in rows)
    rate = {(name, threads): n / s for name, threads, (n, s) in rows}
    best_raw = max(v for (name, _), v in rate.items() if name.startswith("raw"))
    (best_pool, at) = max((v, t) for (name, t), v in rate.items() if name == "store pool, random experts, CRC-32C")
    summary = (f"\nBest store pool with checksums: {best_pool / 1e9:.2f} GB/s at {at} thread(s) = "
               f"{best_pool / best_raw:.2f} of the best raw O_DIRECT configuration ({best_raw / 1e9:.2f} GB/s).\n")
    report = header + table + "\n" + summary
    print(report)
    raw.close()
    store.close()
    if args.record:
        record(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
