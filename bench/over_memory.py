"""Decode a model larger than the memory it is given: fomoepy and llama.cpp, each in its own memory
cgroup under the same cap, after the page cache is dropped, in one run.

- fomoepy: the cpu backend (ggml) with the model's expert store, its tier sized as a user's run sizes
  it (the engine's default: half of what the cap leaves once the mapped dense weights have their
  pages; fomoepy.runtime.available_memory), or by `--ram-cache`; the dense weights come from the
  mapped GGUF.
- llama.cpp (llama-cpp-python, the `bench` extra): the mapped GGUF with `--no-repack`, so its weights
  stay in the file's pages, which the kernel may drop and reread under the cap.

The cap charges the page cache too, so what a run reads back after eviction shows as disk bytes
(each child reports its own read_bytes from /proc/self/io). The disk's O_DIRECT bandwidth is measured
beside them (random 1 MiB reads of the GGUF, two threads). Needs root, for the cgroup and for dropping
the page cache; prints why not otherwise.

    python bench/over_memory.py [--cap 320M] [--ram-cache auto] [--ratios 2,4] [--layers 8] [--routing demo]
                                [--decode 16] [--threads 2] [--record]

Models: the bench model's shape (bench/cpu_decode.py: Q4_K_M mix, 64 experts top-8) with as many layers
as make the file `--ratios` times the cap or more (counted from the tensors' sizes; the table gives the
files' sizes), and the `--layers` counts besides, 8 being the bench model's size (the mid-size model
under a 320 MiB cap). Each is written once under bench/models/ with its expert store beside it.

Routing (`--routing demo`): the routers carry the expert-usage skew measured on the embedded demo model
(a trained qwen3moe) over its held-out text: each layer's selection counts sorted, averaged over the
layers and resampled to 64 experts. Router row scales are calibrated to it on Gaussian logits, then
each layer's spread of them is corrected in rounds on the model itself (fomoepy.devtools.router_skew).
A digest of the scales, the target and the calibration's code names the files, so other routers make
other models and stores. The script prints the target beside the usage the synthetic models show: on
random tokens the calibration did not see (measured once per model) and in this run's prompt and
continuation (the fomoepy child), with the demo's usage over pieces as long as this run beside it.
The skew is static popularity: the demo's usage is more concentrated within a short piece than over
the whole text (its routing has locality in time too), which no router scale reproduces.
`--routing uniform` keeps the generator's near-uniform routers (the hard case for a cache) and the
older files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import llama_peer
import numpy as np
from results import publish
from store_read import MODEL, RawReader, ensure_model

from fomoepy.devtools import router_skew
from fomoepy.devtools.make_test_model import make_model, make_spec, tensor_plan
from fomoepy.errors import StoreError
from fomoepy.experts.sizes import parse_size
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store

PROMPT_TOKENS = 16
PRESET = "bench-qwen3moe"
# random tokens a new model's usage is judged on (and each calibration round runs on): sequences of 512,
# enough selections per expert that sampling noise barely adds skew; judged 32 tokens at a time too
USAGE_SEQUENCES, USAGE_TOKENS, USAGE_PIECE = 4, 512, 32


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


def fomoepy_child(model: str, store: str, ram_cache: int | None, threads: int, n_decode: int) -> dict:
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
        token = int(np.argmax(engine.decode_token(state, token)))
    decode_s = time.perf_counter() - t1
    counts = engine.experts.streamer.counter.counts  # the router's own choices, whatever the cache did
    return {"prefill": len(prompt) / prefill_s, "decode": n_decode / decode_s, "read_bytes": llama_peer.read_bytes(),
            "expert_counts": counts.tolist(), "tier_bytes": engine.experts.streamer.cache.device.capacity}  # fmt: skip


def layers_for_ratio(ratio: float, cap: int) -> int:
    """Fewest layers of the bench shape whose tensors alone take `ratio` times `cap` (the file, with its
    header and metadata, is then at least that large)."""
    n_layer = 1
    while sum(t.nbytes for t in tensor_plan(make_spec(PRESET, n_layer=n_layer))) < ratio * cap:
        n_layer += 1
    return n_layer


def demo_routing(n_expert: int, run_tokens: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The demo model's expert usage over its held-out text, in pieces of `run_tokens`: (the usage
    curve of the whole text resampled to `n_expert` experts: the target; the curve of a piece as long
    as this run's, averaged over whole pieces; tokens in all; whole pieces)."""
    model, sequences = router_skew.demo_sequences()
    pieces = router_skew.model_counts(model, sequences, piece=run_tokens)
    whole = [p for p in pieces if p[0].sum() == pieces[0, 0].sum()]
    target = router_skew.resample(router_skew.mean_curve(pieces.sum(axis=0)), n_expert)
    window = np.mean([router_skew.mean_curve(p) for p in whole], axis=0)
    return target, window, sum(len(s) for s in sequences), len(whole)


CALIBRATION_ROUNDS = 3  # on the model itself, each on random tokens of its own


def model_with_layers(
    n_layer: int, skew: tuple[float, ...] = (), target: np.ndarray | None = None, threads: int = 2
) -> tuple[Path, Path]:
    """The bench-shaped model with `n_layer` layers and its expert store, written once. With `skew`: the
    generator's routers scaled by it, then calibrated on the model towards `target`; a digest of both
    and of the calibration names the files, so other routers get other files and stores. Without: the
    generator's routers."""
    if skew:
        # the calibration's code is part of the key: a changed calibration makes other routers
        calibration = Path(router_skew.__file__).read_bytes()
        key = repr((skew, [f"{x:.4g}" for x in target], CALIBRATION_ROUNDS, USAGE_SEQUENCES, USAGE_TOKENS, calibration))
        model = MODEL.with_name(f"bench-qwen3moe-{n_layer}l-skew{hashlib.sha256(key.encode()).hexdigest()[:10]}.gguf")
    else:
        model = ensure_model() if n_layer == 8 else MODEL.with_name(f"bench-qwen3moe-{n_layer}l.gguf")
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        partial = model.with_suffix(".calibrating.gguf")  # renamed once its routers are final
        make_model(partial, preset=PRESET, n_layer=n_layer, router_skew=skew)
        if skew:
            calibrate(partial, target, threads)
        os.replace(partial, model)
    store = model.with_suffix(".store")
    try:
        ExpertStore.open([store], model).close()
    except StoreError:
        prepare_store(model, [store], progress=False)
    return model, store


def calibrate(model: Path, target: np.ndarray, threads: int) -> None:
    """CALIBRATION_ROUNDS rounds of router_skew.calibrate_in_model, on random tokens other than the
    prompt's and model_usage's; what each round measured goes to stderr."""
    rounds = [random_sequences(100 + r) for r in range(CALIBRATION_ROUNDS)]
    for r, curve in enumerate(router_skew.calibrate_in_model(model, target, rounds, threads)):
        print(f"over_memory: {model.name} calibration round {r + 1}: {router_skew.shares_line(curve)}", file=sys.stderr)


def random_sequences(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30000, size=USAGE_TOKENS).tolist() for _ in range(USAGE_SEQUENCES)]


def model_usage(model: Path, threads: int) -> np.ndarray:
    """[pieces, n_layer, n_expert] router choices of `model` over random tokens (neither the prompt's nor
    the calibration's), USAGE_PIECE at a time; measured once and kept beside the model (it depends on
    its bytes only)."""
    saved = model.with_suffix(".usage.npy")
    if not saved.exists():
        counts = router_skew.model_counts(model, random_sequences(1), piece=USAGE_PIECE, threads=threads)
        partial = saved.with_name(saved.name + ".partial.npy")
        np.save(partial, counts)
        os.replace(partial, saved)
    return np.load(saved)


def usage_row(what: str, tokens: str, curve: np.ndarray) -> str:
    shares = " | ".join(f"{router_skew.top_share(curve, f):.1%}" for f in router_skew.FRACTIONS)
    return f"| {what} | {tokens} | {shares} | {curve[0]:.2f}x |"


def disk_bandwidth(path: Path) -> float:
    """GB/s of random O_DIRECT 1 MiB reads of `path` on two threads (one pass over a quarter of it)."""
    reader = RawReader(path, 1 << 20, 2)
    try:
        order = np.random.default_rng(0).permutation(reader.n_blocks)[: max(1, reader.n_blocks // 4)]
        nbytes, seconds = reader.run(order, 2)
    finally:
        reader.close()
    return nbytes / seconds / 1e9


def row(model: str, name: str, child: subprocess.CompletedProcess, peak: int | None, n_decode: int) -> tuple[str, dict | None]:
    """The table row of one capped run, and what the child reported (None if it failed)."""
    peak_mb = f"{peak / 2**20:.0f}" if peak is not None else "?"
    if child.returncode != 0:
        why = "killed (out of memory)" if child.returncode in (-9, 137) else (child.stderr.strip().splitlines() or ["?"])[-1][:120]
        return f"| {model} | {name} | {why} | | | {peak_mb} |", None
    r = json.loads(child.stdout.strip().splitlines()[-1])
    per_token = r["read_bytes"] / (PROMPT_TOKENS + n_decode) / 2**20
    if "tier_bytes" in r:  # fomoepy's: the tier its run had
        name += f" ({r['tier_bytes'] / 2**20:.0f} MiB)"
    return f"| {model} | {name} | {r['prefill']:.1f} | {r['decode']:.2f} | {per_token:.1f} | {peak_mb} |", r


def model_layers(args: argparse.Namespace, cap: int) -> list[int]:
    """--layers as given, and the fewest layers for each of --ratios ('none': no ratios)."""
    layers = {int(n) for n in args.layers.split(",") if n}
    if args.ratios != "none":
        layers |= {layers_for_ratio(float(r), cap) for r in args.ratios.split(",") if r}
    return sorted(layers)


def calibrated_skew(target: np.ndarray, n_used: int) -> tuple[tuple[float, ...], np.ndarray]:
    """Router row scales for `target` (rounded: they name the files), and the curve they give on the
    Gaussian logits they were calibrated on."""
    skew = tuple(float(f"{x:.4g}") for x in router_skew.row_scales(target, n_used))
    return skew, router_skew.gaussian_curve(np.array(skew), n_used)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", default="320M", help="memory cap of each run, page cache included")
    ap.add_argument("--ram-cache", default="auto", help="fomoepy's tier (the cpu backend's one tier); auto: the engine's default")
    ap.add_argument("--ratios", default="2,4", help="models at least these multiples of the cap ('none': only --layers)")
    ap.add_argument("--layers", default="8", help="layer counts of further models (8: the bench model's size)")
    ap.add_argument("--routing", choices=("demo", "uniform"), default="demo", help="router skew: the demo model's, or none")
    ap.add_argument("--decode", type=int, default=16, help="decoded tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    ap.add_argument("--child", nargs=5, metavar=("MODEL", "STORE", "RAM_CACHE", "THREADS", "DECODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, store, ram, threads, n = args.child
        print(json.dumps(fomoepy_child(model, store, None if ram == "auto" else int(ram), int(threads), int(n))))
        return 0

    cap, ram_cache = parse_size(args.cap), "auto" if args.ram_cache == "auto" else parse_size(args.ram_cache)
    try:
        limiter = MemoryCap(cap)
        drop_page_cache()
    except OSError as e:
        print(f"over_memory: not run: {e} (this benchmark needs root: a memory cgroup and /proc/sys/vm/drop_caches)", file=sys.stderr)
        return 1
    spec = make_spec(PRESET)
    run_tokens = PROMPT_TOKENS + args.decode
    target, demo_window, demo_tokens, demo_pieces = demo_routing(spec.n_expert, run_tokens)
    usage = [
        usage_row("demo model, held-out text (the target of --routing demo)", f"{demo_tokens}", target),
        usage_row(f"demo model, held-out text in {run_tokens}-token pieces (mean of {demo_pieces})", f"{run_tokens}", demo_window),
    ]
    skew: tuple[float, ...] = ()
    if args.routing == "demo":
        skew, calibrated = calibrated_skew(target, spec.n_expert_used)
        usage.append(usage_row("router scales on Gaussian logits (the starting point, before the model's rounds)", "20000", calibrated))
    prompt = json.dumps(np.random.default_rng(0).integers(0, 30000, size=PROMPT_TOKENS).tolist())
    models = [model_with_layers(n, skew, target, args.threads) for n in model_layers(args, cap)]
    for model, _ in models:
        pieces = model_usage(model, args.threads)
        usage.append(usage_row(f"{model.name}, random tokens (not the calibration's)", f"{len(pieces) * USAGE_PIECE}",
                               router_skew.mean_curve(pieces.sum(axis=0))))  # fmt: skip
        usage.append(usage_row(f"{model.name}, random tokens in {USAGE_PIECE}-token pieces (mean of {len(pieces)})",
                               f"{USAGE_PIECE}", np.mean([router_skew.mean_curve(p) for p in pieces], axis=0)))  # fmt: skip
    bandwidth = disk_bandwidth(models[0][0])
    rows = []
    for model, store in models:
        size = f"{model.name}, {model.stat().st_size / 2**20:.0f} MiB = {model.stat().st_size / cap:.1f}x the cap"
        cmd = [sys.executable, __file__, "--child", str(model), str(store), str(ram_cache), str(args.threads), str(args.decode)]
        tier = "tier automatic" if ram_cache == "auto" else "--ram-cache " + args.ram_cache
        line, child = row(size, f"fomoepy cpu, store + {tier}", *limiter.run(cmd, prompt), args.decode)
        rows.append(line)
        if child is not None:
            curve = router_skew.mean_curve(np.array(child["expert_counts"]))
            usage.append(usage_row(f"{model.name}, this run's prompt and continuation (fomoepy child)", f"{run_tokens}", curve))
        cmd = llama_peer.command(model, args.decode, args.threads, no_repack=True)
        rows.append(row(size, "llama.cpp (mmap, --no-repack)", *limiter.run(cmd, prompt), args.decode)[0])
    routing = (
        "routers with the demo model's measured expert-usage skew (per layer, sorted, averaged over layers)"
        if skew else "the generator's routers (near-uniform usage)"
    )  # fmt: skip
    report = (
        f"### over_memory — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/over_memory.py --cap {args.cap} --ram-cache {args.ram_cache} --ratios {args.ratios} --layers {shlex.quote(args.layers)} "
        f"--routing {args.routing} --decode {args.decode} --threads {args.threads}`; "
        f"bench-shaped models (n_embd 1024, 64 experts top-8, Q4_K/Q6_K experts, Q8_0 dense), {routing}, {PROMPT_TOKENS}-token prompt; each run in its own memory "
        f"cgroup of {cap / 2**20:.0f} MiB (page cache charged) after the page cache is dropped; disk: {bandwidth:.2f} GB/s random O_DIRECT "
        "1 MiB reads, 2 threads, this run\n\n"
        "| model | run | prefill tok/s | decode tok/s | disk MiB per token | peak MiB (cgroup) |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n\n"
        "Expert usage, per layer sorted and averaged over the layers: the share of all selections taken by the most used "
        "10%, 25% and 50% of the experts, and the most used expert's usage over the mean (uniform routing: 10%, 25%, 50%, 1x; "
        "short pieces read more skewed than their source, by chance alone)\n\n"
        "| measured on | tokens | top 10% | top 25% | top 50% | most used expert |\n|---|---|---|---|---|---|\n"
        + "\n".join(usage) + "\n"
    )  # fmt: skip
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
