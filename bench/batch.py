"""Continuous batching: the same requests served one at a time, then by 1, 2, 4 and 8 concurrent clients.

`fomoe serve` runs in its own process on the bench model of bench/decode.py (`--shape bench`, its
expert store beside it), cpu backend unless `--backend` names a GPU, in two configurations:
- all resident: every expert in the host tier from the start (seeded by a profile listing them all);
- host tier at 25 % of the experts (`--ram-frac`): misses are read from the store.

In each, one daemon with `--max-batch 1` serves the request set from one client (one at a time, as
before batching), then a daemon with `--max-batch B` serves the same set from 1, 2, 4 and 8 clients,
each client on its own connection taking the next request when its last one is done, then a daemon
with `--max-batch 1` again: this machine's later runs are slower than its first (the same one-at-a-time
daemon, run second, measured 0.91x of its first run), so the baseline is the mean of the one-at-a-time
runs before and after the batched ones. Every request
is greedy, ignores end-of-generation and streams its tokens. Per run it prints:
- aggregate tok/s: generated tokens of all requests / wall time from the first send to the last done;
- inter-token latency p50 / p99 over every gap between two streamed messages of one request;
- time to first token p50 (from each request's send);
- expert bytes per generated token: bytes of the experts the steps computed from (each expert once
  per step, whatever its rows: the daemon's cache statistics' accessed bytes), and of those, bytes
  read from the store;
- speed-up: aggregate tok/s over the mean of the one-at-a-time runs of the same configuration;
- the decode steps' own rate (their tokens over the engine's seconds in them, the daemon's stats) and
  the share of the wall the engine spent on prompts: a request's prompt costs the same batched or not,
  so the aggregate gains only in the rest;
- where misses are read from the store, the store's bound: the fastest it was seen to read in the
  configuration, over the run's bytes read from the store per token: the most tok/s the run could
  reach if reading were all it did. That rate is the highest of the store's own rate, measured before
  and after the runs as the engine reads it (`fomoe plan --measure`'s figure: records in a random
  order through the store's reader, several in flight), and the rate each run read at (several in
  flight can beat the measure: a run once read at 1479 MB/s where the measure gave 1211), so no run
  exceeds its bound. A configuration bound by its reads gains from batching only as its bytes read
  per token fall;
- and how far they could fall: the fewest bytes per token a cache of the tiers' size could read over
  the run's steps had it known their routing in advance (Belady from the best start: no policy reads
  less), from the daemon's routing trace (`--trace`, capped runs only), with the store's bound at those
  reads; and over the one-at-a-time figure, the most each batched run could gain were reading all it did.

(bench/batch_step.py times the engine's step over B sequences itself, and the bound these runs could
reach were every step full.)

    python bench/batch.py [--requests 16] [--tokens 48] [--clients 1,2,4,8] [--max-batch 8] [--backend cpu] [--store-dir DIR] [--record]

With `--backend cuda` (or hip) the daemon computes on the GPU: all resident is every expert in its
device tier; capped is its device and host tiers at `--ram-frac` each. `--store-dir DIR` puts the store
on another drive (prepared there once): the capped runs are bound by that drive's reads (a tmpfs
directory stands for a drive faster than any here; its reads are buffered copies, O_DIRECT refused).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np
from decode import ensure_model
from results import describe_fs, gpu_name, load_line, publish
from soak import Conn, pct

from fomoepy.experts.profile import ENTRY, FreqProfile, write_freq
from fomoepy.experts.simulate import fewest_reads
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store
from fomoepy.experts.trace import read_trace
from fomoepy.plan.measure import store_figures

HERE = Path(__file__).parent
WORDS = ["river", "stone", "light", "garden", "window", "morning", "paper", "music", "winter", "silver", "market",
         "bridge", "forest", "letter"]


def prompts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS, 12)) for i in range(n)]


def start(sock: str, model: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fomoepy.cli", "serve", str(model), "--socket", sock, "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise SystemExit("the daemon did not start within 600 s")
        if os.path.exists(sock):
            try:
                c = Conn(sock)
                c.final(c.send("ping"))
                c.close()
                return proc
            except OSError:
                pass
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def daemon_counts(sock: str) -> tuple[int, int, float, float, int, int]:
    """So far: accessed expert bytes, bytes read from the store, the engine's seconds in prompts and in
    decode steps, the decode steps' tokens, and the engine's token index (every row it has computed: its
    trace's records are numbered by it)."""
    c = Conn(sock)
    stats = c.final(c.send("stats"))["stats"]
    c.close()
    engine = stats["engine"]
    cache = engine["cache"]
    return (cache["accessed_bytes"], cache["disk"]["read_bytes"], stats["prefill_s"], stats["decode_s"], stats["decode_tokens"],
            engine["tokens"])  # fmt: skip


class Stream:
    """One request's streamed messages: the time to its first, then the gaps between them."""

    def __init__(self, t_send: float, firsts: list[float]):
        self.t_send, self.firsts = t_send, firsts
        self.last: float | None = None
        self.gaps: list[float] = []

    def __call__(self, m: dict) -> None:
        if m["type"] != "delta":
            return
        now = time.perf_counter()
        if self.last is None:
            self.firsts.append(now - self.t_send)
        else:
            self.gaps.append(now - self.last)
        self.last = now


def serve_all(sock: str, texts: list[str], n_tokens: int, n_clients: int) -> dict:
    """Every request once, by n_clients concurrent clients; the run's measures."""
    todo = list(range(len(texts)))
    lock = threading.Lock()
    gaps: list[float] = []
    firsts: list[float] = []
    produced = [0]
    errors: list[str] = []

    def client() -> None:
        c = Conn(sock, timeout=600)
        while True:
            with lock:
                if not todo:
                    break
                i = todo.pop(0)
            watch = Stream(time.perf_counter(), firsts)
            done = c.final(c.send("generate", prompt=texts[i], max_tokens=n_tokens, temperature=0, ignore_eos=True), watch)
            with lock:
                if done["type"] != "done" or done["usage"]["completion_tokens"] != n_tokens:
                    errors.append(str(done)[:200])
                produced[0] += done.get("usage", {}).get("completion_tokens", 0)
                gaps.extend(watch.gaps)
        c.close()

    before = daemon_counts(sock)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = daemon_counts(sock)
    if errors:
        raise SystemExit(f"{len(errors)} requests did not complete: {errors[0]}")
    n = produced[0]
    return {
        "tok_s": n / wall, "itl50": pct(gaps, 0.5), "itl99": pct(gaps, 0.99), "ttft50": pct(firsts, 0.5),
        "used_per_tok": (after[0] - before[0]) / n, "disk_per_tok": (after[1] - before[1]) / n, "wall": wall,
        "prompt_share": (after[2] - before[2]) / wall, "step_tok_s": (after[4] - before[4]) / max(after[3] - before[3], 1e-9),
        "generated": n, "rows": range(before[5], after[5]),
    }  # fmt: skip


def fewest_read_per_token(trace_path: str, runs: list[dict], capacity: int) -> None:
    """Each run's fewest bytes read per generated token (`floor_per_tok`): what a cache of the run's tiers'
    size that knew the run's routing in advance would read from the store (Belady from the best start,
    fomoepy.experts.simulate.fewest_reads) over the run's steps in its daemon's trace."""
    trace = read_trace(trace_path)
    last = max((r.token + r.n_tokens for r in trace.records), default=0)
    for r in runs:
        if last < r["rows"].stop:
            raise SystemExit(f"the daemon's trace {trace_path} ends at row {last}, before its run's last ({r['rows'].stop})")
        r["floor_per_tok"] = fewest_reads(trace, trace.header.expert_bytes, capacity, r["rows"]) / r["generated"]


def store_rate(model: Path, store: Path) -> float:
    """Bytes per second the store's reader delivers as the daemon reads it: the rate a run whose misses come
    from the store is bound by."""
    return store_figures(str(store), str(model), passes=1)[0]["bandwidth"]


def every_expert_profile(model: Path, store: Path) -> tuple[Path, int]:
    """A profile naming every expert (to seed the host tier with all of them), and their total bytes."""
    with ExpertStore.open([store], model) as s:
        layers, n_expert = s.layers, s.manifest.layers[0].n_expert
        total = sum(layer.expert_nbytes for layer in layers) * n_expert
    path = HERE / "models" / "decode-bench.all.freq"
    entries = np.zeros(len(layers) * n_expert, dtype=ENTRY)
    entries["layer"] = np.repeat(np.arange(len(layers)), n_expert)
    entries["expert"] = np.tile(np.arange(n_expert), len(layers))
    entries["freq"] = 1.0
    write_freq(path, FreqProfile(len(layers), entries))
    return path, total


def read_rate(r: dict) -> float:
    """Bytes per second the run read from the store."""
    return r["tok_s"] * r["disk_per_tok"]


def bound(r: dict, peak: float | None) -> str:
    """The run's store bound: the fastest the store was seen to read (`peak`) over the bytes the run read per token."""
    if not peak or r["disk_per_tok"] <= 0:
        return "—"
    return f"{peak / r['disk_per_tok']:.2f} ({read_rate(r) / 1e6:.0f} MB/s read)"


def floor_bound(r: dict, peak: float | None) -> str:
    """The run's fewest reads per token, and the store's bound at them: the most any cache of its size lets it reach."""
    if not peak or "floor_per_tok" not in r:
        return "—"
    return f"{r['floor_per_tok'] / 1e6:.2f}, {peak / r['floor_per_tok']:.2f}" if r["floor_per_tok"] > 0 else "0.00, —"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-batch", type=int, default=8, help="the batching daemon's --max-batch")
    ap.add_argument("--ram-frac", type=float, default=0.25, help="host tier of the second configuration")
    ap.add_argument("--threads", type=int, default=None, help="ggml threads (default: all cores)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip"],
                    help="cpu: the tiers are the host's (ggml's slots); cuda/hip: all resident is every expert in "
                         "the device tier, capped is device and host tiers at --ram-frac each")  # fmt: skip
    ap.add_argument("--only", choices=["resident", "capped"], default=None, help="run one configuration")
    ap.add_argument("--store-dir", default=None, help="prepare (or reuse) the bench store here instead of beside the model: "
                                                      "another drive's, whose reads the capped runs are then bound by")  # fmt: skip
    ap.add_argument("--expert-kernel", default="auto", choices=["auto", "ggml"],
                    help="cpu backend: the daemons' --expert-kernel (auto: fomoepy's batched kernel where it serves)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    model, store = ensure_model("bench")
    if args.store_dir:
        store = Path(args.store_dir)
        if not (store / "fomoe-store.manifest").exists():
            prepare_store(model, [store], progress=False)
    profile, all_bytes = every_expert_profile(model, store)
    threads = args.threads or os.cpu_count() or 1
    clients = [int(c) for c in args.clients.split(",")]
    texts = prompts(args.requests)
    base = ["--backend", args.backend, "-t", str(threads), "--store", str(store), "--expert-kernel", args.expert_kernel]
    share = str(int(all_bytes * args.ram_frac))
    if args.backend == "cpu":
        configs = {
            "resident": ("all experts resident", ["--ram-cache", str(all_bytes), "--freq-profile", str(profile)]),
            "capped": (f"host tier {args.ram_frac:.0%}, misses from the store", ["--ram-cache", share]),
        }  # fmt: skip
    else:  # a GPU's device tier holds store bytes (fomoepy.runtime.gpu_experts): every expert fits in all_bytes
        configs = {
            "resident": ("all experts resident on the device", ["--vram-cache", str(all_bytes), "--ram-cache", "0", "--freq-profile", str(profile)]),
            "capped": (f"device and host tiers {args.ram_frac:.0%} each, misses from the store", ["--vram-cache", share, "--ram-cache", share]),
        }  # fmt: skip
    capacity = {"resident": 0, "capped": int(share) * (1 if args.backend == "cpu" else 2)}  # the tiers the store's reads fill
    rows, ceilings, capped = [], [], []
    rates: list[float] = []  # the store's read rate, before and after the runs that read from it
    for key, (title, flags) in configs.items():
        if args.only and key != args.only:
            continue
        runs = []
        if key == "capped":
            rates.append(store_rate(model, store))
        with tempfile.TemporaryDirectory(dir="/tmp", prefix="fomoe-batch-") as d:
            daemons = [("one at a time", 1, [1]), ("batched", args.max_batch, clients), ("one at a time, again", 1, [1])]
            for i, (label, max_batch, n_clients) in enumerate(daemons):
                sock, trace = f"{d}/{i}.sock", f"{d}/{i}.trace"
                # where reads come from the store, the daemon traces its routing: the floor under each run's reads
                # (a capped step runs layer by layer whether traced or not: the trace costs a record a layer, and a
                # prediction a layer where the read-ahead gate had stopped them; by hand, two rounds each way of one
                # at a time and 8 clients, traced runs were within this machine's noise of untraced ones)
                traced = ["--trace", trace] if capacity[key] else []
                proc = start(sock, model, [*base, *flags, "--max-batch", str(max_batch), *traced])
                mine = []
                try:
                    serve_all(sock, texts[:4], args.tokens, min(4, max_batch))  # warm: caches, graphs, pages
                    for n in n_clients:
                        r = serve_all(sock, texts, args.tokens, n)
                        mine.append((label if label != "batched" else f"{n} client{'s' * (n > 1)}", r))
                        print(f"{title}: {mine[-1][0]}: {r['tok_s']:.2f} tok/s; {os.getloadavg()[0]:.2f} load", file=sys.stderr)
                finally:
                    stop(proc)
                if traced:
                    fewest_read_per_token(trace, [r for _, r in mine], capacity[key])
                runs += mine
        if key == "capped":
            rates.append(store_rate(model, store))
        one = (runs[0][1]["tok_s"] + runs[-1][1]["tok_s"]) / 2  # (before and after the batched runs)
        # the fastest the store was seen to deliver: measured on its own, or as a run read it (a bound none exceeds)
        peak = max(rates + [read_rate(r) for _, r in runs]) if key == "capped" else None
        capped = runs if key == "capped" else capped
        for label, r in runs:
            rows.append(
                f"| {title} | {label} | {r['tok_s']:.2f} | {r['tok_s'] / one:.2f}x | {r['itl50'] * 1e3:.0f} / {r['itl99'] * 1e3:.0f} "
                f"| {r['ttft50'] * 1e3:.0f} | {r['used_per_tok'] / 1e6:.2f} | {r['disk_per_tok'] / 1e6:.2f} | {bound(r, peak)} "
                f"| {floor_bound(r, peak)} | {r['step_tok_s']:.1f} | {r['prompt_share']:.0%} |"
            )
            if "floor_per_tok" in r and r["floor_per_tok"] > 0 and label.endswith(("client", "clients")):
                ceilings.append(f"{label}: {peak / r['floor_per_tok'] / one:.2f}x")
    report = (
        f"### batch — {date.today()} — {args.backend} backend{gpu_name(args.backend)}, {platform.machine()}, {os.cpu_count()} cores — {load_line()}; "
        f"load {os.getloadavg()[0]:.2f} at the end\n\n"
        f"`python bench/batch.py --requests {args.requests} --tokens {args.tokens} --clients {args.clients} "
        f"--max-batch {args.max_batch} --ram-frac {args.ram_frac}" + (f" --threads {args.threads}" if args.threads else "")
        + (f" --only {args.only}" if args.only else "") + (f" --backend {args.backend}" if args.backend != "cpu" else "")
        + (f" --store-dir {args.store_dir}" if args.store_dir else "")
        + (f" --expert-kernel {args.expert_kernel}" if args.expert_kernel != "auto" else "")
        + f"`; bench model, -t {threads}, greedy, {args.tokens} tokens per request; its store on {describe_fs(store)}\n\n"
        "| configuration | served by | aggregate tok/s | vs one at a time (mean of before and after) | inter-token p50 / p99 ms | first token p50 ms "
        "| expert MB used / token | of which read from store MB / token | store's bound tok/s (its MB/s ÷ MB read / token) "
        "| fewest MB / token a cache of the tiers' size could read (Belady on the run's own routing), and the store's bound there "
        "| decode steps' own tok/s (their tokens over the engine's time in them) | share of the wall in prompts "
        "|\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n"
        + (f"\nThe store's read rate, measured before and after the runs that read from it: "
           f"{rates[0] / 1e6:.0f} and {rates[1] / 1e6:.0f} MB/s; the fastest a run read it: {max(read_rate(r) for _, r in capped) / 1e6:.0f} MB/s; "
           f"each bound is from the highest of these.\n" if rates else "")
        + (f"\nWhere misses come from the store, the most a run could gain over one at a time with no work but its reads, and "
           f"those the fewest a cache of the tiers' size could make of its routing (the store's bound at them over the "
           f"one-at-a-time figure): {'; '.join(ceilings)}.\n" if ceilings else "")
    )  # fmt: skip
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
