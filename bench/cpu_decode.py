"""CPU backend speed: prefill and decode tok/s on a mid-size qwen3moe test model.

The model (n_embd 1024, 8 layers, 16 q / 4 kv heads of 64, 64 experts top-8, expert_ff 512, gate/up
Q4_K, down Q6_K, dense Q8_0, ≈ 0.55 GB) is written once under bench/models/. Two passes are timed:
`cold` starts with an empty compute-ready expert tier (every first touch of an expert dequantises it),
`warm` repeats the same work with the tier filled. Reference on this machine kind (2 cores):
llama.cpp decodes this model at ≈ 174 tok/s and prefills at ≈ 260 tok/s.

    python bench/cpu_decode.py [--prompt 128] [--decode 64] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from fomoepy.devtools.make_test_model import make_model
from fomoepy.engine import Engine, EngineOptions
from results import record

HERE = Path(__file__).parent
MODEL = HERE / "models" / "bench-qwen3moe.gguf"
LLAMA_CPP = {"decode": 174.0, "prefill": 260.0}


def ensure_model() -> Path:
    if not MODEL.exists():
        MODEL.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        make_model(MODEL, preset="bench-qwen3moe")
        print(f"wrote {MODEL} ({MODEL.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return MODEL


def timed_run(engine: Engine, prompt: np.ndarray, n_decode: int) -> tuple[float, float]:
    state = engine.new_state()
    t0 = time.perf_counter()
    logits = engine.eval(state, prompt)
    t1 = time.perf_counter()
    token = int(np.argmax(logits[-1]))
    for _ in range(n_decode):
        token = int(np.argmax(engine.eval(state, [token])[-1]))
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_decode / (t2 - t1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads (default: the engine's choice)")
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()

    path = ensure_model()
    t = time.perf_counter()
    engine = Engine(path, EngineOptions(threads=args.threads))
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, engine.spec.n_vocab - 3, size=args.prompt)
    cold = timed_run(engine, prompt, args.decode)
    warm = timed_run(engine, prompt, args.decode)
    rows = [
        f"| cold (empty expert tier) | {cold[0]:.1f} | {cold[1]:.1f} |",
        f"| warm (experts compute-ready) | {warm[0]:.1f} | {warm[1]:.1f} |",
        f"| llama.cpp, same model and machine kind | {LLAMA_CPP['prefill']:.0f} | {LLAMA_CPP['decode']:.0f} |",
    ]
    header = (
        f"### cpu_decode — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/cpu_decode.py --prompt {args.prompt} --decode {args.decode}"
        + (f" --threads {args.threads}" if args.threads else "")
        + f"`; BLAS threads {engine.ops.threads}; model load {load_s:.1f} s, "
        f"compute-ready experts held: {len(engine.experts.ready)}\n\n"
        "| run | prefill tok/s | decode tok/s |\n|---|---|---|\n"
    )
    report = header + "\n".join(rows) + "\n"
    print(report)
    if args.record:
        record(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
