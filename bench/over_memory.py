"""Decode a model larger than the memory it is given: fomoepy and llama.cpp, each in its own memory
cgroup under the same cap, after the page cache is dropped, in one run.

- fomoepy: the cpu backend (ggml) with the model's expert store and `--ram-cache`; the dense weights
  come from the mapped GGUF.
- llama.cpp (llama-cpp-python, the `bench` extra): the mapped GGUF with `--no-repack`, so its weights
  stay in the file's pages, which the kernel may drop and reread under the cap.

The cap charges the page cache too, so what a run reads back after eviction shows as disk bytes
(each child reports its own read_bytes from /proc/self/io). The disk's O_DIRECT bandwidth is measured
beside them (random 1 MiB reads of the GGUF, two threads). Needs root, for the cgroup and for dropping
the page cache; prints why not otherwise.

    python bench/over_memory.py [--cap 320M] [--ram-cache 128M] [--layers 8,18] [--decode 16] [--threads 2] [--record]

Models: the bench model's shape (bench/cpu_decode.py) with `--layers` layers each, 8 being the bench
model itself (1.8x a 320 MiB cap) and 18 about 4x; each gets its store beside it under bench/models/.
Not yet: routing with the demo model's measured skew (these routers are the generator's, close to
uniform, which is the hard case for a cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

import llama_peer
from fomoepy.experts.sizes import parse_size
from results import record
from fomoepy.devtools.make_test_model import make_model
from fomoepy.errors import StoreError
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store
from store_read import MODEL, RawReader, ensure_model

PROMPT_TOKENS = 16


class MemoryCap:
    """A fresh memory cgroup per run (v2 `memory.max`, or v1 `memory.limit_in_bytes`)."""

    def __init__(self, cap: int):
        self.cap = cap
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text().split():
            self.root, self.limit, self.peak = v2, "memory.max", "memory.peak"
        elif (v1 / "memory.limit_in_bytes").exists():
            self.root, self.limit, self.peak = v1, "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        else:
            raise OSError("no memory cgroup controller mounted")
        self.runs = 0

    def run(self, cmd: list[str], stdin: str) -> tuple[subprocess.CompletedProcess, int | None]:
        self.runs += 1
        group = self.root / f"fomoe-over-memory-{os.getpid()}-{self.runs}"
        group.mkdir()
        try:
            (group / self.limit).write_text(str(self.cap))
            procs = group / "cgroup.procs"
            drop_page_cache()
            child = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False,
                                   preexec_fn=lambda: procs.write_text(str(os.getpid())))  # fmt: skip
            peak = group / self.peak
            return child, int(peak.read_text()) if peak.exists() else None
        finally:
            for _ in range(50):  # the group empties once the child is reaped
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def fomoepy_child(model: str, store: str, ram_cache: int, threads: int, n_decode: int) -> dict:
    """Runs in the capped process: greedy decode through the engine, as llama_peer does."""
    from fomoepy.engine import Engine, EngineOptions

    engine = Engine(model, EngineOptions(backend="cpu", threads=threads, store=(store,), ram_cache=ram_cache))
    prompt = json.loads(sys.stdin.read())
    state = engine.new_state()
    t0 = time.perf_counter()
    token = int(np.argmax(engine.eval(state, prompt)[-1]))
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(engine.eval(state, [token])[-1]))
    decode_s = time.perf_counter() - t1
    return {"prefill": len(prompt) / prefill_s, "decode": n_decode / decode_s, "read_bytes": llama_peer.read_bytes()}


def model_with_layers(n_layer: int) -> tuple[Path, Path]:
    """The bench-shaped model with `n_layer` layers and its expert store, written once."""
    model = ensure_model() if n_layer == 8 else MODEL.with_name(f"bench-qwen3moe-{n_layer}l.gguf")
    if not model.exists():
        make_model(model, preset="bench-qwen3moe", n_layer=n_layer)
    store = model.with_suffix(".store")
    try:
        ExpertStore.open([store], model).close()
    except StoreError:
        prepare_store(model, [store], progress=False)
    return model, store


def disk_bandwidth(path: Path) -> float:
    """GB/s of random O_DIRECT 1 MiB reads of `path` on two threads (one pass over a quarter of it)."""
    reader = RawReader(path, 1 << 20, 2)
    try:
        order = np.random.default_rng(0).permutation(reader.n_blocks)[: max(1, reader.n_blocks // 4)]
        nbytes, seconds = reader.run(order, 2)
    finally:
        reader.close()
    return nbytes / seconds / 1e9


def row(model: str, name: str, child: subprocess.CompletedProcess, peak: int | None, n_decode: int) -> str:
    peak_mb = f"{peak / 2**20:.0f}" if peak is not None else "?"
    if child.returncode != 0:
        why = "killed (out of memory)" if child.returncode in (-9, 137) else (child.stderr.strip().splitlines() or ["?"])[-1][:120]
        return f"| {model} | {name} | {why} | | | {peak_mb} |"
    r = json.loads(child.stdout.strip().splitlines()[-1])
    per_token = r["read_bytes"] / (PROMPT_TOKENS + n_decode) / 2**20
    return f"| {model} | {name} | {r['prefill']:.1f} | {r['decode']:.2f} | {per_token:.1f} | {peak_mb} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", default="320M", help="memory cap of each run, page cache included")
    ap.add_argument("--ram-cache", default="128M", help="fomoepy's host tier")
    ap.add_argument("--layers", default="8,18", help="layers of each model (8: the bench model)")
    ap.add_argument("--decode", type=int, default=16, help="decoded tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    ap.add_argument("--child", nargs=5, metavar=("MODEL", "STORE", "RAM_CACHE", "THREADS", "DECODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, store, ram, threads, n = args.child
        print(json.dumps(fomoepy_child(model, store, int(ram), int(threads), int(n))))
        return 0

    cap, ram_cache = parse_size(args.cap), parse_size(args.ram_cache)
    try:
        limiter = MemoryCap(cap)
        drop_page_cache()
    except OSError as e:
        print(f"over_memory: not run: {e} (this benchmark needs root: a memory cgroup and /proc/sys/vm/drop_caches)", file=sys.stderr)
        return 1
    prompt = json.dumps(np.random.default_rng(0).integers(0, 30000, size=PROMPT_TOKENS).tolist())
    models = [model_with_layers(int(n)) for n in args.layers.split(",")]
    bandwidth = disk_bandwidth(models[0][0])
    rows = []
    for model, store in models:
        size = f"{model.name}, {model.stat().st_size / 2**20:.0f} MiB = {model.stat().st_size / cap:.1f}x the cap"
        cmd = [sys.executable, __file__, "--child", str(model), str(store), str(ram_cache), str(args.threads), str(args.decode)]
        rows.append(row(size, "fomoepy cpu, store + --ram-cache " + args.ram_cache, *limiter.run(cmd, prompt), args.decode))
        cmd = llama_peer.command(model, args.decode, args.threads, no_repack=True)
        rows.append(row(size, "llama.cpp (mmap, --no-repack)", *limiter.run(cmd, prompt), args.decode))
    report = (
        f"### over_memory — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/over_memory.py --cap {args.cap} --ram-cache {args.ram_cache} --layers {args.layers} --decode {args.decode} --threads {args.threads}`; "
        f"bench-shaped models (n_embd 1024, 64 experts top-8, Q4_K/Q6_K experts, Q8_0 dense), {PROMPT_TOKENS}-token prompt; each run in its own memory "
        f"cgroup of {cap / 2**20:.0f} MiB (page cache charged) after the page cache is dropped; disk: {bandwidth:.2f} GB/s random O_DIRECT "
        "1 MiB reads, 2 threads, this run\n\n"
        "| model | run | prefill tok/s | decode tok/s | disk MiB per token | peak MiB (cgroup) |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n"
    )  # fmt: skip
    print(report)
    if args.record:
        record(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
