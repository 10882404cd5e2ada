"""Cache-aware routing (CAR) quality on the demo model: what substituting cached experts costs in PPL and KL.

The expert tiers are capped (by default a quarter of all experts compute-ready in the device tier and a
quarter more in the host tier), so the router asks for uncached experts and CAR has something to do.
The held-out text (fomoepy/data/demo-heldout.txt) is cut into chunks of --ctx tokens; each chunk is decoded
one token at a time from an empty state, as generation runs (the expert cache carries over from chunk to
chunk), and the logits of the second half of each chunk are scored (llama-perplexity's positions).
The exact run (CAR off, same caps: the exact model's logits) is the base of the KL divergence.

Columns: substitution rate = substituted expert slots / routed slots; device/host hit = share of expert
uses served by that tier; PPL ratio = PPL / exact PPL; KL = mean KL(exact ‖ run) per scored token;
same top = share of positions whose most probable token is the exact run's.

    python bench/car_quality.py [--ctx 256] [--chunks 16] [--device-share 0.25] [--host-share 0.25] [--record]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
from results import publish

from fomoepy.data import demo_heldout_path, demo_model_path
from fomoepy.engine import Engine, EngineOptions
from fomoepy.eval import kl as klm
from fomoepy.eval.ppl import plan_chunks, token_nll
from fomoepy.experts.car import CarConfig
from fomoepy.runtime.cpu_experts import ready_expert_nbytes

HERE = Path(__file__).parent
THRESHOLDS = (0.05, 0.1, 0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Setting:
    threshold: float | None  # None: CAR off (the exact model)
    dampen: bool = False
    backfill: str = "off"

    @property
    def label(self) -> str:
        if self.threshold is None:
            return "exact (CAR off)"
        return f"{self.threshold:g} | {'yes' if self.dampen else 'no'} | {self.backfill}"


@dataclass(frozen=True)
class Outcome:
    setting: Setting
    logits: np.ndarray  # float32 [n_scored_total, V]
    substitution_rate: float
    device_hit: float
    host_hit: float
    seconds: float


def tier_bytes(model: Path, device_share: float, host_share: float) -> tuple[int, int]:
    """Device and host tier budgets holding those shares of all experts (device: compute-ready form)."""
    probe = Engine(model, EngineOptions(vram_cache=0, ram_cache=0))
    layers = probe.source.layers
    n_expert = probe.spec.moe.n_expert
    device = sum(ready_expert_nbytes(layer) for layer in layers) * n_expert
    host = sum(layer.expert_nbytes for layer in layers) * n_expert
    probe.close()
    return int(device * device_share), int(host * host_share)


def run(model: Path, tokens: np.ndarray, ctx: int, n_chunks: int, setting: Setting, device: int, host: int) -> Outcome:
    options = EngineOptions(
        vram_cache=device,
        ram_cache=host,
        car=CarConfig(threshold=setting.threshold, dampen=setting.dampen),
        backfill=setting.backfill,
        prefetch=False,  # CAR and backfill alone decide what the tiers hold
    )
    engine = Engine(model, options)
    plan = plan_chunks(len(tokens), ctx, n_chunks)
    t = time.perf_counter()
    rows = []
    for i in range(plan.n_chunks):
        chunk = plan.eval_tokens(tokens, i)
        state = engine.new_state()
        for pos, token in enumerate(chunk[: plan.first + plan.n_scored].tolist()):
            logits = engine.decode_token(state, token)
            if pos >= plan.first:
                rows.append(logits)
    seconds = time.perf_counter() - t
    stats = engine.stats()
    cache = stats["cache"]
    rate = stats["car"]["substitution_rate"] if "car" in stats else 0.0
    engine.close()
    return Outcome(setting, np.stack(rows), rate, cache["device"]["hit_rate"], cache["host"]["hit_rate"], seconds)


def targets_of(tokens: np.ndarray, ctx: int, n_chunks: int) -> np.ndarray:
    plan = plan_chunks(len(tokens), ctx, n_chunks)
    return np.concatenate([plan.targets(tokens, i) for i in range(plan.n_chunks)])


def table(outcomes: list[Outcome], targets: np.ndarray) -> str:
    exact = outcomes[0]
    base = klm.base_rows(exact.logits, targets, top_k=0)  # full rows: the demo vocabulary is small
    exact_ppl = math.exp(float(np.mean(token_nll(exact.logits, targets))))
    lines = [
        "| CAR threshold | dampen | backfill | substitution rate | device hit | host hit | PPL | PPL ratio | KL | same top |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        ppl = math.exp(float(np.mean(token_nll(o.logits, targets))))
        cmp = klm.compare(o.logits, targets, base)
        label = o.setting.label if o.setting.threshold is not None else "exact (CAR off) | | "
        lines.append(
            f"| {label} | {100 * o.substitution_rate:.1f}% | {100 * o.device_hit:.1f}% | {100 * o.host_hit:.1f}% | "
            f"{ppl:.3f} | {ppl / exact_ppl:.4f} | {float(np.mean(cmp.kld)):.5f} | {100 * float(np.mean(cmp.same_top)):.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF model (default: the demo model)")
    ap.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: the demo held-out text)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--chunks", type=int, default=16, help="chunks evaluated")
    ap.add_argument("--device-share", type=float, default=0.25, help="share of all experts the device tier holds")
    ap.add_argument("--host-share", type=float, default=0.25, help="share of all experts the host tier holds")
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS), help="comma-separated")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args(argv)

    model = args.model or demo_model_path()
    text = (args.text or demo_heldout_path()).read_text(encoding="utf-8").removesuffix("\n")
    probe = Engine(model, EngineOptions(vram_cache=0, ram_cache=0))
    tokens = np.asarray(probe.tokenizer.encode(text, add_special=True, parse_special=False), dtype=np.int64)
    probe.close()
    device, host = tier_bytes(model, args.device_share, args.host_share)
    settings = [Setting(None)] + [
        Setting(float(t), dampen, backfill)
        for t in args.thresholds.split(",")
        for dampen in (False, True)
        for backfill in ("off", "sync")
    ]
    outcomes = []
    for s in settings:
        o = run(model, tokens, args.ctx, args.chunks, s, device, host)
        print(f"{s.label}: substitution {100 * o.substitution_rate:.1f}%, {o.seconds:.1f} s", file=sys.stderr, flush=True)
        outcomes.append(o)
    targets = targets_of(tokens, args.ctx, args.chunks)
    n_scored = len(targets)
    command = "python bench/car_quality.py " + shlex.join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--record")
    report = (
        f"### car_quality — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`{command.strip()}`; model {model.name}, text {len(tokens):,} tokens, {args.chunks} chunks of {args.ctx} "
        f"decoded token by token, {n_scored:,} scored; tiers capped: device {args.device_share:.0%} of experts "
        f"({device:,} B compute-ready), host {args.host_share:.0%} ({host:,} B); prefetch off; backfill sync = "
        f"{EngineOptions().backfill_per_token} reads per token into the host tier\n\n"
        + table(outcomes, targets)
        + "\n"
    )
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
