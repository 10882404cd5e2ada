"""What unmapping the GGUF's experts after each use costs the `cpu` backend without a store.

Without `--store` the experts are computed from the memory-mapped GGUF. Given `--ram-cache` (any size,
0 included) each expert's pages are given back after its use, so the process holds only what it computes
from (the page cache keeps the file); without it they stay mapped and a later use finds them. This
decodes the bench model of bench/cpu_decode.py both ways, alternating, `--rounds` times each, after
reading the whole file once so that both refault from the page cache, not from the disk (the machine's
load at the start is in the report; a shared machine slows both alike only on average).

    python bench/mapped_experts.py [--decode 32] [--threads 2] [--rounds 2] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import date

import numpy as np
from cpu_decode import ensure_model, timed_run
from results import publish

from fomoepy.engine import Engine, EngineOptions

MODES = (("kept mapped (no --ram-cache)", None), ("unmapped after each use (--ram-cache 0)", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    path = ensure_model()
    with path.open("rb") as f:  # the whole file into the page cache first: both modes then refault from memory
        while f.read(64 << 20):
            pass
    runs: dict[str, list[float]] = {name: [] for name, _ in MODES}
    for _ in range(args.rounds):
        for name, ram_cache in MODES:
            engine = Engine(path, EngineOptions(backend="cpu", threads=args.threads, ram_cache=ram_cache))
            prompt = np.random.default_rng(0).integers(0, engine.spec.n_vocab - 3, size=args.prompt)
            runs[name].append(timed_run(engine, prompt, args.decode)[1])
            engine.close()
    kept, unmapped = (statistics.median(runs[name]) for name, _ in MODES)
    lines = [
        f"### mapped_experts — {date.today()} — bench model, no store",
        "",
        (
            f"`python bench/mapped_experts.py --decode {args.decode} --threads {args.threads} --rounds {args.rounds}`; "
            f"{path.name} read into the page cache first, {args.prompt}-token prompt, decode tok/s per run and their median"
        ),
        "",
        "| experts | decode tok/s (runs) | median |",
        "|---|---|---|",
        *(f"| {name} | {', '.join(f'{v:.1f}' for v in runs[name])} | {statistics.median(runs[name]):.1f} |" for name, _ in MODES),
        "",
        f"Unmapping after each use costs {1 - unmapped / kept:.0%} of the decode speed ({unmapped:.1f} against {kept:.1f} tok/s).",
    ]
    report = "\n".join(lines)
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
