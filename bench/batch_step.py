"""One batched decode step, taken apart: its products (ggml's, and fomoepy's expert kernel) against the
host's own time, at 1, 2, 4 and 8 sequences, and what the products alone allow bench/batch.py's ratios
to reach.

The bench model of bench/decode.py (`--shape bench`, its expert store beside it), cpu backend, every
expert resident (the tier holds the model, as bench/batch.py's first configuration), `--threads`
ggml threads (1 by default, as batch.py's recorded runs). B sequences, each after a short prompt of
its own, decode together: `Transformer.forward_batch` with B rows, blocks of `--steps` steps, the
row counts interleaved, `--repeats` blocks each. Per B it prints the fastest block's step time (the
least disturbed by other work on the machine; medians beside) and, of it:
- products: seconds inside ggml's graph computations, whose nodes include fomoepy's batched expert kernel,
  its Q8_0 dense kernel and its decode rows' attention (every product of the step: q/k/v, output,
  router, routed experts, output head; norms, RoPE and attention ride in the same graphs; where ggml's
  threads spin, as they do with a free core each, the whole step is one graph), fomoepy.timing.MATMUL
  (`--expert-kernel ggml`: the routed experts by ggml's products, as before the kernel);
- host: the rest (Python: the step's inputs, its routing's bookkeeping, its results handed out; where
  the step is a graph a layer, what runs between them);
- per row: the step over B.

Then two bounds on the aggregate speed-up over one sequence at a time, B·t(1)/t(B):
- `step`: as measured;
- `products only`: were the host's time zero at B rows, B·t(1)/products(B).

And the request set of bench/batch.py (`--requests` prompts, `--tokens` generated each): the time its
prompts take to prefill one after the other (the daemon prefills one newcomer's chunk per step, never
several prompts in one product) against decoding their tokens one sequence at a time, and the best
ratio bench/batch.py can show at B clients if every decode step held B rows and cost t(B):
(prefill + n·t(1)) / (prefill + n·t(B)/B).

    python bench/batch_step.py [--batches 1,2,4,8] [--steps 4] [--repeats 12] [--threads 1] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import date

import numpy as np
from batch import prompts
from decode import ensure_model
from results import publish

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.timing import MATMUL


def step_times(engine: Engine, batches: list[int], steps: int, repeats: int) -> dict[int, list[tuple[float, float]]]:
    """{B: [(seconds per step, of which in products), one per block]}."""
    rng = np.random.default_rng(0)
    states = {}
    for B in batches:
        states[B] = [engine.new_state() for _ in range(B)]
        for i, s in enumerate(states[B]):
            engine.eval(s, rng.integers(10, 1000, 4 + i))  # prompts of different lengths: each its own position
        for _ in range(2):  # warm: each row count's graphs are built on its first step
            engine.model.forward_batch(rng.integers(10, 1000, B), states[B])
    out: dict[int, list[tuple[float, float]]] = {B: [] for B in batches}
    for _ in range(repeats):
        for B in batches:
            tokens = [rng.integers(10, 1000, B) for _ in range(steps)]
            m0, t0 = MATMUL.seconds, time.perf_counter()
            for t in tokens:
                engine.model.forward_batch(t, states[B])
            out[B].append(((time.perf_counter() - t0) / steps, (MATMUL.seconds - m0) / steps))
    return out


def prefill_seconds(engine: Engine, n_requests: int) -> tuple[float, int]:
    """Seconds to prefill bench/batch.py's prompts one after the other (the faster of two passes), and
    their tokens."""
    ids = [engine.tokenizer.encode(t) for t in prompts(n_requests)]
    best = None
    for _ in range(2):
        t0 = time.perf_counter()
        for p in ids:
            engine.eval(engine.new_state(), p)
        best = min(best or 1e9, time.perf_counter() - t0)
    return best, sum(len(p) for p in ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8", help="sequences per step, comma-separated (1 first: the baseline)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed block")
    ap.add_argument("--repeats", type=int, default=12, help="timed blocks per row count")
    ap.add_argument("--threads", type=int, default=1, help="ggml threads")
    ap.add_argument("--requests", type=int, default=16, help="bench/batch.py's request set: its prompts")
    ap.add_argument("--tokens", type=int, default=48, help="bench/batch.py's tokens generated per request")
    ap.add_argument("--expert-kernel", default="auto", choices=["auto", "ggml"],
                    help="a decode step's experts by fomoepy's batched kernel where it serves (auto), or ggml's")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    if not batches or batches[0] != 1 or min(batches) < 1:
        raise SystemExit(f"--batches: expected 1 first and every count >= 1, got {args.batches!r}")
    if min(args.steps, args.repeats, args.threads, args.requests, args.tokens) < 1:
        raise SystemExit("--steps, --repeats, --threads, --requests and --tokens must be >= 1")

    model, store = ensure_model("bench")
    with ExpertStore.open([store], model) as s:
        all_bytes = sum(layer.expert_nbytes for layer in s.layers) * s.manifest.layers[0].n_expert
    engine = Engine(model, EngineOptions(backend="cpu", threads=args.threads, store=(str(store),), ram_cache=all_bytes,
                                         expert_kernel=args.expert_kernel))
    try:
        times = step_times(engine, batches, args.steps, args.repeats)
        prefill, prompt_tokens = prefill_seconds(engine, args.requests)
    finally:
        engine.close()

    best = {B: min(times[B]) for B in batches}  # the fastest block, and its products' share
    t1 = best[1][0]
    rows = []
    for B in batches:
        step, ggml = best[B]
        med_step = statistics.median(t for t, _ in times[B])
        med_ggml = statistics.median(g for _, g in times[B])
        rows.append(
            f"| {B} | {step * 1e3:.2f} ({med_step * 1e3:.2f}) | {ggml * 1e3:.2f} ({med_ggml * 1e3:.2f}) | {(step - ggml) * 1e3:.2f} "
            f"| {step / B * 1e3:.2f} | {ggml / B * 1e3:.2f} | {B * t1 / step:.2f}x | {B * t1 / ggml:.2f}x |"
        )
    n = args.requests * args.tokens
    lines = [
        (f"- prefill of bench/batch.py's {args.requests} prompts ({prompt_tokens} tokens), one after the other: {prefill:.2f} s; "
         f"decoding their {n} tokens one sequence at a time: {n * t1:.2f} s (at t(1))")
    ]  # fmt: skip
    for B in batches[1:]:
        tb = best[B][0]
        lines.append(f"- best bench/batch.py ratio at {B} clients, every step of {B} rows at t({B}): "
                     f"{(prefill + n * t1) / (prefill + n * tb / B):.2f}x")  # fmt: skip
    report = (
        f"### batch step — {date.today()} — cpu backend, {platform.machine()}, {os.cpu_count()} cores; "
        f"load {os.getloadavg()[0]:.2f} at the end\n\n"
        f"`python bench/batch_step.py --batches {args.batches} --steps {args.steps} --repeats {args.repeats} "
        f"--threads {args.threads} --requests {args.requests} --tokens {args.tokens}"
        + (f" --expert-kernel {args.expert_kernel}" if args.expert_kernel != "auto" else "")
        + "`; bench model, every expert resident, "
        "fastest block (median) per row count\n\n"
        "| sequences B | step ms | of which products ms | host ms | step ms / row | products ms / row | B·t(1)/t(B) step "
        "| B·t(1)/products(B) products only |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n" + "\n".join(lines) + "\n"
    )  # fmt: skip
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
