"""The daemon under load, as a new user would try it: `fomoe serve` on the demo model in its own process,
driven over its Unix socket only, for a bounded time.

Three parts, all in one run:
1. Turns: connection A pipelines 16 streamed 256-token requests; once A's first is running, B sends one
   8-token request. B's wait is bounded by the one request running when it arrived (clients take turns,
   one request each): printed next to that bound, A's first request's own time. Where A's requests fill
   the batch, one of them gives its place to B at the next token, so B's wait is about its own time.
2. A large prompt: a 4,000,000-character generate (under the default 4 MiB frame limit) against the
   512-token context, while another connection pings every 5 ms: the refusal time and the longest ping.
3. Mixed soak for --seconds: --clients threads, each on its own connection, draw actions: streamed
   generate (time to first token, longest gap between its messages = stall), cancel mid-stream, abrupt
   disconnect mid-stream, tokenize, stats, ping, a malformed frame. The daemon's RSS and open fds are
   sampled every second. Any `internal` error or a lost request is counted and printed.

    python bench/soak.py [--seconds 60] [--clients 8] [--seed 0] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from datetime import date
from pathlib import Path

import msgpack
from results import gpu_name, record

from fomoepy.serve.protocol import FrameDecoder, encode_frame

PROGRESS = ("queued", "delta")


class Conn:
    """One raw connection: send requests, read messages by id (others kept)."""

    def __init__(self, path: str, timeout: float = 60.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(timeout)
        self.dec = FrameDecoder(1 << 28)
        self.inbox: list[dict] = []
        self.ids = 0

    def send(self, op: str, **fields) -> int:
        self.ids += 1
        self.sock.sendall(encode_frame({"op": op, "id": self.ids, **fields}))
        return self.ids

    def next_for(self, id: int) -> dict:
        while True:
            for i, m in enumerate(self.inbox):
                if m.get("id") == id:
                    return self.inbox.pop(i)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed by the daemon")
            self.inbox += [msgpack.unpackb(p, raw=False) for p in self.dec.feed(data)]

    def final(self, id: int, on_message=None) -> dict:
        while True:
            m = self.next_for(id)
            if on_message is not None:
                on_message(m)
            if m["type"] not in PROGRESS:
                return m

    def close(self) -> None:
        self.sock.close()


def start_daemon(path: str, model: str | None, backend: str = "cpu") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fomoepy.cli", "serve", *([model] if model else []), "--socket", path, "--backend", backend,
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise SystemExit("the daemon did not start within 300 s")
        time.sleep(0.1)
    for _ in range(100):
        try:
            c = Conn(path)
            c.final(c.send("ping"))
            c.close()
            return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the daemon does not answer")


def rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- 1. turns -------------------------------------------------------------------------------------


def turns(path: str) -> list[str]:
    a, b = Conn(path), Conn(path)
    first_started = threading.Event()
    times: dict[str, float] = {}

    def on_a(m: dict) -> None:
        if m["type"] == "delta":
            first_started.set()

    t0 = time.perf_counter()
    ids = [a.send("generate", prompt=f"def f{i}(x):", max_tokens=256, ignore_eos=True, temperature=0) for i in range(16)]
    reader = threading.Thread(target=lambda: (a.final(ids[0], on_a), times.setdefault("a0", time.perf_counter() - t0)))
    reader.start()
    first_started.wait(120)
    tb = time.perf_counter()
    done_b = b.final(b.send("generate", prompt="import os", max_tokens=8, ignore_eos=True, temperature=0))
    wait_b = time.perf_counter() - tb
    reader.join()
    for i in ids[1:]:
        a.send("cancel", target=i)
    a.close()
    b.close()
    ok = wait_b <= times["a0"] + done_b["timings"]["prefill_s"] + done_b["timings"]["decode_s"] + 0.5
    return [
        "| part | figure |",
        "|---|---|",
        f"| A: 16 pipelined 256-token requests; A's first took | {times['a0']:.2f} s |",
        f"| B: one 8-token request sent once A's first was running, answered after | {wait_b:.2f} s |",
        f"| bound: the rest of A's first + B's own time (within it: {'yes' if ok else 'NO'}) | ≤ {times['a0'] + done_b['timings']['prefill_s'] + done_b['timings']['decode_s']:.2f} s |",
    ]


# -- 2. a large prompt ----------------------------------------------------------------------------


def large_prompt(path: str) -> list[str]:
    big, pinger = Conn(path), Conn(path)
    stop = threading.Event()
    pings: list[float] = []

    def ping_loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            pinger.final(pinger.send("ping"))
            pings.append(time.perf_counter() - t)
            time.sleep(0.005)

    th = threading.Thread(target=ping_loop)
    th.start()
    time.sleep(0.2)
    text = ("x = 1\n" * 700_000)[:4_000_000]
    t = time.perf_counter()
    reply = big.final(big.send("generate", prompt=text, max_tokens=1))
    refused = time.perf_counter() - t
    time.sleep(0.2)
    stop.set()
    th.join()
    big.close()
    pinger.close()
    return [
        "| part | figure |",
        "|---|---|",
        f"| 4,000,000-character prompt answered ({reply['type']}: {reply.get('message', '')[:80]}) after | {refused * 1e3:.1f} ms |",
        f"| pings on another connection meanwhile: {len(pings)}, longest | {max(pings) * 1e3:.1f} ms |",
    ]


# -- 3. mixed soak ----------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)  # per op, round trip
        self.stall: list[float] = []  # per generation: longest gap between its messages
        self.ttft: list[float] = []
        self.per_conn_stall: dict[int, float] = {}
        self.lost = 0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.outcomes[key] += n


def client(path: str, k: int, until: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + k)
    conn = Conn(path)
    worst = 0.0
    while time.monotonic() < until:
        r = rng.random()
        try:
            if r < 0.35:  # a streamed generation, read to the end
                t = last = time.perf_counter()
                gaps, first = [], None

                def on(m: dict) -> None:  # a stall is a gap once the stream runs, not the wait in the queue
                    nonlocal last, first
                    now = time.perf_counter()
                    if first is None:
                        if m["type"] == "delta":
                            first, last = now - t, now
                        return
                    gaps.append(now - last)
                    last = now

                m = conn.final(conn.send("generate", prompt=rng.choice(["import os", "def f(x):", "class A:"]),
                                         max_tokens=rng.randint(4, 48), temperature=0.7, seed=rng.randint(0, 99)), on)  # fmt: skip
                tally.add(f"generate {m['type']}" + (f" {m.get('code')}" if m["type"] == "error" else ""))
                with tally.lock:
                    if first is not None:
                        tally.ttft.append(first)
                    if gaps:
                        tally.stall.append(max(gaps))
                        worst = max(worst, max(gaps))
            elif r < 0.45:  # cancel mid-stream
                id = conn.send("generate", prompt="import sys", max_tokens=200, ignore_eos=True)
                while conn.next_for(id)["type"] != "delta":
                    pass
                conn.send("cancel", target=id)
                m = conn.final(id)
                tally.add(f"cancel → {m.get('finish_reason', m['type'])}")
            elif r < 0.52:  # abrupt disconnect mid-stream
                id = conn.send("generate", prompt="import re", max_tokens=200, ignore_eos=True)
                conn.next_for(id)
                conn.close()
                conn = Conn(path)
                tally.add("disconnect mid-stream")
            elif r < 0.82:  # cheap requests: round-trip latency
                op = rng.choice(["tokenize", "stats", "ping"])
                fields = {"text": "def main():\n    pass\n" * rng.randint(1, 50)} if op == "tokenize" else {}
                t = time.perf_counter()
                m = conn.final(conn.send(op, **fields))
                with tally.lock:
                    tally.latency[op].append(time.perf_counter() - t)
                tally.add(f"{op} {m['type']}")
            else:  # a malformed frame: garbage in a frame, or msgpack that is not a request
                payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 30)))
                conn.sock.sendall(struct.pack(">I", len(payload)) + payload)
                id = conn.send("ping")
                conn.final(id)
                tally.add("malformed frame")
        except (OSError, ConnectionError):
            tally.lost += 1
            conn = Conn(path)
    conn.close()
    with tally.lock:
        tally.per_conn_stall[k] = worst


def soak(path: str, pid: int, seconds: float, clients: int, seed: int) -> list[str]:
    tally = Tally()
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(path, k, until, seed, tally)) for k in range(clients)]
    samples: list[tuple[int, int]] = [rss_and_fds(pid)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        samples.append(rss_and_fds(pid))
    for t in threads:
        t.join()
    samples.append(rss_and_fds(pid))
    rss = [s[0] / 2**20 for s in samples]
    fds = [s[1] for s in samples]
    lines = ["| measure | p50 | p99 | max |", "|---|---|---|---|"]
    for op, values in sorted(tally.latency.items()):
        lines.append(f"| {op} round trip (ms, {len(values)}) | {pct(values, .5) * 1e3:.1f} | {pct(values, .99) * 1e3:.1f} | {max(values) * 1e3:.1f} |")
    lines.append(f"| time to first token (ms, {len(tally.ttft)}) | {pct(tally.ttft, .5) * 1e3:.1f} | {pct(tally.ttft, .99) * 1e3:.1f} | {max(tally.ttft, default=0) * 1e3:.1f} |")
    lines.append(f"| stall: longest gap inside one stream (ms, {len(tally.stall)}) | {pct(tally.stall, .5) * 1e3:.1f} | {pct(tally.stall, .99) * 1e3:.1f} | {max(tally.stall, default=0) * 1e3:.1f} |")
    per_conn = ", ".join(f"{v * 1e3:.0f}" for _, v in sorted(tally.per_conn_stall.items()))
    lines += ["", f"Longest stall per connection (ms): {per_conn}.",
              f"Daemon RSS {min(rss):.0f}–{max(rss):.0f} MiB; open fds {min(fds)}–{max(fds)} ({len(samples)} samples, first {rss[0]:.0f} MiB / {fds[0]}, last {rss[-1]:.0f} MiB / {fds[-1]}).",
              f"Outcomes ({sum(tally.outcomes.values())} actions): " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())) + ".",
              f"Requests lost (a connection error without a final message): {tally.lost}; `internal` errors: "
              f"{sum(v for k, v in tally.outcomes.items() if 'internal' in k)}."]  # fmt: skip
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the embedded demo model)")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the mixed soak (default 60)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "reference", "cuda", "hip", "sim"],
                    help="the daemon's (cpu, as fomoe serve's default; cuda or hip: the batched steps on a GPU; sim: the GPU path on the simulated device)")
    ap.add_argument("--record", action="store_true", help="append the report to bench/RESULTS.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fomoe-soak-", dir="/tmp") as tmp:
        path = f"{tmp}/fomoe.sock"
        proc = start_daemon(path, args.model, args.backend)
        try:
            parts = [("Turns", turns(path)), ("A large prompt", large_prompt(path)),
                     (f"Mixed soak: {args.clients} clients for {args.seconds:.0f} s", soak(path, proc.pid, args.seconds, args.clients, args.seed))]  # fmt: skip
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    cmd = "python bench/soak.py " + shlex.join(sys.argv[1:])
    title = f"### soak — {date.today()} — {args.backend} backend{gpu_name(args.backend)}, {platform.machine()}, {os.cpu_count()} cores"
    report = [f"{title}, load {load:.2f} at start", "",
              f"`{cmd.strip()}`; the demo model unless --model; `fomoe serve` in its own process, driven over its Unix socket; SIGTERM at the end: exit {code}"]  # fmt: skip
    for title, lines in parts:
        report += ["", f"#### {title}", "", *lines]
    text = "\n".join(report)
    print(text)
    if args.record:
        record(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
