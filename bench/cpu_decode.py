"""CPU speed: prefill and decode tok/s on a mid-size qwen3moe test model, fomoepy's backends and
llama.cpp (llama-cpp-python, the `bench` extra) on the same GGUF, in the same run, on the same threads.

The model (n_embd 1024, 8 layers, 16 q / 4 kv heads of 64, 64 experts top-8, expert_ff 512, gate/up
Q4_K, down Q6_K, dense Q8_0, ≈ 0.55 GB) is written once under bench/models/. Rows:
- `cpu` (ggml on the quantized bytes): its default tier holds every expert in slot tensors, repacked
  where ggml has kernels for the type (filled at load, as llama.cpp repacks at load; the row says which
  form the run's slots had); a long prefill's routed experts (ggml_experts.grouped_from) are a product
  per expert over its tokens, a decode token is one ggml graph (every
  layer's attention, routing and its routed experts, then the output head: fomoepy.runtime.ggml_decode),
  whose experts are fomoepy's batched kernel's nodes where it serves (--expert-kernel auto: Q4_K/Q6_K
  experts, a CPU with AVX-512; its slots then plain), else one `mul_mat_id` over the slots;
- `reference cold`: the compute-ready tier is emptied after the prefill, so the first decoded token
  meets an empty tier (every first touch of an expert dequantises it);
- `reference warm`: the same work again with the tier filled;
- `llama.cpp` when llama_cpp imports (else the row says why not).

fomoepy's cpu rows and llama.cpp's are medians of `--rounds` turns taken alternately; beside the
wall-clock rates, the CPU milliseconds each process spent per decoded token.

    python bench/cpu_decode.py [--prompt 128] [--decode 64] [--threads N | --default-threads] [--rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import llama_peer
import numpy as np
from results import load_line, publish

from fomoepy.devtools.make_test_model import make_model
from fomoepy.engine import Engine, EngineOptions
from fomoepy.runtime import ggml_threads

HERE = Path(__file__).parent
MODEL = HERE / "models" / "bench-qwen3moe.gguf"


def ensure_model() -> Path:
    if not MODEL.exists():
        MODEL.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        make_model(MODEL, preset="bench-qwen3moe")
        print(f"wrote {MODEL} ({MODEL.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return MODEL


def timed_run(engine: Engine, prompt: np.ndarray, n_decode: int, cold: bool = False) -> tuple[float, float, float]:
    """(prefill tok/s, decode tok/s, CPU ms of this process per decoded token: every thread's)."""
    state = engine.new_state()
    t0 = time.perf_counter()
    logits = engine.eval(state, prompt)
    prefill_s = time.perf_counter() - t0
    if cold:
        engine.reset_expert_cache()  # an empty tier at the first decoded token
    token = int(np.argmax(logits[-1]))
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        token = int(np.argmax(engine.decode_token(state, token)))
    t2, c2 = time.perf_counter(), time.process_time()
    return len(prompt) / prefill_s, n_decode / (t2 - t1), (c2 - c1) / n_decode * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens")
    ap.add_argument("--threads", type=int, default=None, help="threads for every run (default: all cores)")
    ap.add_argument("--default-threads", action="store_true",
                    help="fomoepy without a thread count (its default: the cores free at start, each kind of decode-row "
                         "product on 1 or all of them as measured); llama.cpp on all cores")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="turns of fomoepy's cpu backend and llama.cpp (medians reported)")
    ap.add_argument("--expert-kernel", default="auto", choices=["auto", "ggml"],
                    help="fomoepy's --expert-kernel (auto: a decode step's experts by its batched kernel where it serves)")
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()

    path = ensure_model()
    threads = args.threads or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    cpu = Engine(path, EngineOptions(backend="cpu", threads=None if args.default_threads else threads, expert_kernel=args.expert_kernel))
    load_s = time.perf_counter() - t
    prompt = rng.integers(0, cpu.spec.n_vocab - 3, size=args.prompt)
    # fomoepy's cpu backend and llama.cpp take turns, `--rounds` each: load from other work on a shared
    # machine comes and goes, and turns give both the same share of it; each row is its rounds' median
    ours: list[tuple] = []
    peers: list = []
    for _ in range(args.rounds):
        ours.append(timed_run(cpu, prompt, args.decode))
        peers.append(llama_peer.run(path, prompt, args.decode, threads, cpu=True))
    ours_threads = cpu.devices[0].threads
    tuned = cpu.devices[0].row_threads
    chosen = sorted(set(tuned.chosen.values())) if tuned is not None else []
    form = "repacked" if any(any(pool.layer.repacked) for pool in cpu.experts.device.pools.values()) else "plain"
    kernel = "fomoepy's batched kernel" if any(cpu.experts.device.kernel_layers) else "ggml's mul_mat_id"
    cpu.close()
    name = f"fomoepy cpu (ggml; experts in the tier's slots, {form}, a decode step's by {kernel}; a decode token one graph)"
    rows = [f"| {name} | {_median(ours, 0):.1f} | {_median(ours, 1):.1f} | {_median(ours, 2):.2f} |"]
    ref = Engine(path, EngineOptions(backend="reference", threads=threads))
    cold = timed_run(ref, prompt, args.decode, cold=True)
    warm = timed_run(ref, prompt, args.decode)
    rows.append(f"| fomoepy reference, cold (empty tier at the first decoded token) | {cold[0]:.1f} | {cold[1]:.1f} | {cold[2]:.2f} |")
    rows.append(f"| fomoepy reference, warm (experts compute-ready) | {warm[0]:.1f} | {warm[1]:.1f} | {warm[2]:.2f} |")
    ref.close()
    failed = [p for p in peers if isinstance(p, str)]
    if failed:
        rows.append(f"| llama.cpp | {failed[0]} | | |")
    else:
        rows.append(f"| llama.cpp (llama-cpp-python, same file, same run) | {_median(peers, 0):.1f} | {_median(peers, 1):.1f} | "
                    f"{_median(peers, 2):.2f} |")  # fmt: skip
    rounds = "; ".join(f"fomoepy {a[1]:.1f}" + ("" if isinstance(b, str) else f", llama.cpp {b[1]:.1f}") for a, b in zip(ours, peers))
    one, five, _ = os.getloadavg()
    header = (
        f"### cpu_decode — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/cpu_decode.py --prompt {args.prompt} --decode {args.decode} --rounds {args.rounds}"
        + (f" --threads {args.threads}" if args.threads else "") + (" --default-threads" if args.default_threads else "")
        + (f" --expert-kernel {args.expert_kernel}" if args.expert_kernel != "auto" else "")
        + ("`; fomoepy on its default threads: " + f"{ours_threads}"
           + (f", a decode row's products on {' or '.join(map(str, chosen))} as measured" if chosen else "")
           + f"; llama.cpp and the reference engine on {threads}" if args.default_threads else f"`; threads {threads} for every run")
        + f"; cpu model load {load_s:.1f} s (the tier filled: every expert set into its slot, "
        f"{form}); ggml {ggml_version()}; OpenMP wait policy: fomoepy {ggml_threads.in_force()}, llama.cpp "
        f"{llama_peer.peer_env().get('OMP_WAIT_POLICY', 'default')}; {load_line()}, {one:.2f} (1 min) / {five:.2f} (5 min) at the end\n\n"
        f"Decode tok/s by round: {rounds}. CPU ms per decoded token: the process's CPU time (every thread's, spinning "
        "included) over the decoded tokens, less sensitive to other work than the wall-clock rates.\n\n"
        "| run | prefill tok/s | decode tok/s | decode CPU ms/token |\n|---|---|---|---|\n"
    )
    report = header + "\n".join(rows) + "\n"
    return publish(report, args.record)


def ggml_version() -> str:
    """The ggml library the cpu backend ran on (imported once an engine has chosen ggml's threads)."""
    from fomoepy.runtime import ggml_buffers

    return ggml_buffers.library_version()


def _median(runs: list, i: int) -> float:
    return float(np.median([r[i] for r in runs]))


if __name__ == "__main__":
    sys.exit(main())
