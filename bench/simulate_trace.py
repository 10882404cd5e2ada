"""Cache policies against Belady's optimum on token-by-token routing traces of the demo model.

The traces are the packed ones in profiles/traces/ (tools/record_traces.py records them, deterministic):
`demo-project` (the demo model over this project's Python sources) is what the default policy was tuned
on; `demo-heldout` (over the 22 standard-library files the model never trained on) is what it is scored
on. Each is replayed with `fomoe simulate --policy all` at several capacities, given as fractions of all
routed-expert bytes (store form), every policy starting from the tiers seeded by the shipped profile
(profiles/demo-qwen3moe.freq, made from other prompts), which the `*-pinned` policies pin half of.

    python bench/simulate_trace.py [--trace profiles/traces/X.npz ...] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import sys
from datetime import date
from pathlib import Path

from results import record

from fomoepy.cli import main as fomoe
from fomoepy.experts import trace_pack
from fomoepy.experts.policy import DEFAULT_POLICY

TRACES = Path(__file__).resolve().parents[1] / "profiles" / "traces"
PROFILE = TRACES.parent / "demo-qwen3moe.freq"
FRACTIONS = [(0.05, 0.10), (0.10, 0.25), (0.25, 0.25), (0.50, 0.25)]


def table(path: Path) -> list[str]:
    trace = trace_pack.load(path)
    total = sum(trace.header.expert_bytes) * trace.header.n_expert
    lines = [f"#### {path.name}: {len(trace.records) // trace.header.n_layer} tokens, {trace.header.n_layer} layers x "
             f"{trace.header.n_expert} experts (top-{trace.header.n_expert_used}), {total / 1e6:.1f} MB of experts", "",
             "| VRAM + DRAM | policy | device hit | Belady | memory hit | Belady | of Belady |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for dev_frac, host_frac in FRACTIONS:
        vram, ram = int(total * dev_frac), int(total * host_frac)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            fomoe(["simulate", str(path), "--vram", str(vram), "--ram", str(ram), "--policy", "all", "--json",
                   "--profile", str(PROFILE)])  # fmt: skip
        out = json.loads(buf.getvalue())
        best = out["belady_memory_hit_rate"]
        for name, p in out["policies"].items():
            mark = " (default)" if name == DEFAULT_POLICY else ""
            lines.append(f"| {dev_frac:.0%} + {host_frac:.0%} | {name}{mark} | {p['device']['hit_rate']:.1%} | "
                         f"{out['belady_device_hit_rate']:.1%} | {p['memory_hit_rate']:.1%} | {best:.1%} | "
                         f"{p['memory_hit_rate'] / best:.2f} |")  # fmt: skip
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, action="append", help="packed traces (default: demo-heldout and demo-project)")
    ap.add_argument("--record", action="store_true", help="append the tables to bench/RESULTS.md")
    args = ap.parse_args()
    paths = args.trace or [TRACES / "demo-heldout.npz", TRACES / "demo-project.npz"]
    cmd = "python bench/simulate_trace.py " + shlex.join(sys.argv[1:])
    report = [f"### simulate_trace — {date.today()} — {platform.machine()}, load {os.getloadavg()[0]:.2f} at start", "",
              f"`{cmd.strip()}`; memory = served by device or host; Belady memory uses device + host capacity; "
              "`of Belady` = memory hit / Belady's."]  # fmt: skip
    for path in paths:
        report += ["", *table(path)]
    text = "\n".join(report)
    print(text)
    if args.record:
        record(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
