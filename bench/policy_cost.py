"""Host time of the cache policies' bookkeeping per MoE layer step, at the size of a real model.

A synthetic decode trace of Qwen3.5-397B-A17B's routing shape (60 layers x 512 experts, top-10; skew
and reuse fitted to the demo model's trace, as `fomoe plan` does) is replayed through the two-tier
expert cache (`fomoepy.experts.simulate`, the engine's own ExpertCache and policies) with VRAM + DRAM at
10 % + 25 % of the expert bytes. What is timed is the whole replay: per layer step, both tiers' plan and
commit for the step's experts, and each policy's own counting. What is reported is the CPU time of
the replaying thread, the fastest of `--repeats` runs, with the machine's load at the start: on a
shared machine wall time would count the waits for a core as well.

Each policy runs twice: on the C cache core the engine uses (fomoepy.experts.fast_cache) and on the
Python ExpertCache it is checked against; the two must make the same decisions (the script compares
their counters) and the table shows what each costs.

    python bench/policy_cost.py [--tokens 64] [--repeats 3] [--record]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from pathlib import Path

from results import load_line, publish

from fomoepy.experts import simulate as replay
from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.fast_cache import core_available
from fomoepy.experts.simulate import simulate
from fomoepy.plan.commands import DEMO_TRACE
from fomoepy.plan.routing import fit_routing, load_traces, synthetic_trace
from fomoepy.plan.shapes import SHAPES, model_bytes

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("lfu-cooc", "lfu-admit", "lfu-demote")
FRACTIONS = (0.10, 0.25)  # VRAM, DRAM: shares of all routed-expert bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens in the synthetic trace")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    shape = model_bytes(SHAPES["qwen3.5-397b-a17b"])
    n_layer, n_expert, k = shape.n_layer, shape.n_expert, shape.n_expert_used
    fit = fit_routing(load_traces([str(DEMO_TRACE)]))
    fit_line = fit.line().replace(str(ROOT) + "/", "")
    trace = synthetic_trace(n_layer, n_expert, k, args.tokens, fit, shape.expert_bytes)
    expert_bytes = [shape.expert_bytes] * n_layer
    total = shape.expert_bytes * n_layer * n_expert
    device, host = (int(f * total) for f in FRACTIONS)
    steps = args.tokens * n_layer
    lines = [
        f"### policy_cost — {date.today()} — {load_line()}",
        "",
        (
            f"`python bench/policy_cost.py --tokens {args.tokens} --repeats {args.repeats}`; {n_layer} layers x "
            f"{n_expert} experts, top-{k}, {args.tokens} synthetic tokens ({fit_line}); VRAM + DRAM "
            f"{FRACTIONS[0]:.0%} + {FRACTIONS[1]:.0%} of the expert bytes; fastest of {args.repeats} replays; "
            "CPU time of the replaying thread (on a shared machine, wall time also counts waits for a core)"
        ),
        "",
        f"| policy | C core: µs per layer step | Python: µs per layer step | C core: ms per token ({n_layer} layers) | memory hit rate |",
        "|---|---|---|---|---|",
    ]
    if not core_available():
        raise SystemExit("bench/policy_cost.py: the C cache core is not built (pip install -e . builds it)")
    for policy in POLICIES:
        per_step, results = {}, {}
        for name in ("core", "python"):
            best = float("inf")
            for _ in range(args.repeats):
                real = replay.make_cache
                if name == "python":  # the reference: the same replay on ExpertCache
                    replay.make_cache = lambda *a, **kw: ExpertCache(*a, **kw)
                try:
                    t0 = time.thread_time()
                    results[name] = simulate(trace, expert_bytes, device, host, policy)
                    best = min(best, time.thread_time() - t0)
                finally:
                    replay.make_cache = real
            per_step[name] = best / steps
        if results["core"].summary != results["python"].summary:
            raise SystemExit(f"bench/policy_cost.py: {policy}: the C core and the Python cache decided differently")
        lines.append(f"| {policy} | {per_step['core'] * 1e6:.1f} | {per_step['python'] * 1e6:.0f} | "
                     f"{per_step['core'] * n_layer * 1e3:.2f} | {results['core'].memory_hit_rate:.1%} |")  # fmt: skip
    report = "\n".join(lines)
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
