"""`fomoe plan`: projected decode speed for a model on stated hardware (registered by fomoepy.cli)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.experts.policy import DEFAULT_POLICY, POLICIES
from fomoepy.experts.read_ahead import GPU_READ_AHEAD_PAYS, ReadAheadGate
from fomoepy.experts.sizes import parse_size
from fomoepy.outputs import check_output
from fomoepy.plan.capacity import Capacity, capacity_for
from fomoepy.plan.hardware import Hardware, load_hardware, shipped_rigs
from fomoepy.plan.rates import TierRates, parse_hit_rates
from fomoepy.plan.report import describe, steps_table, sweep_table
from fomoepy.plan.routing import (
    fit_routing,
    load_traces,
    popularity_seed,
    rates_from_trace,
    read_ahead_from_trace,
    synthetic_trace,
)
from fomoepy.plan.shapes import (
    SHAPES,
    model_bytes,
    model_bytes_from_gguf,
    shape_by_name,
)
from fomoepy.plan.timemodel import SCHEDULES, TERMS, Projection, Workload, project

DEMO_TRACE = Path(__file__).parent / "traces" / "demo-qwen3moe.trace"
# the demo model's next-layer predictions over held-out text (tools/record_traces.py): where the
# engine schedule's share of misses read ahead comes from when neither --prefetch nor a trace with
# predictions is given
PREDICTION_TRACE = Path(__file__).parent / "traces" / "demo-predictions.trace"
SWEEP_KINDS = ("vram", "ram", "policy", "car")


def register(sub) -> None:
    p = sub.add_parser("plan", help="projected decode speed of a model on stated hardware (no GPU needed)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("model", nargs="?", help="a GGUF model: sizes read from the file")
    what.add_argument("--shape", help=f"a real model shape instead ({', '.join(SHAPES)})")
    p.add_argument("--mix", help="quant mix for --shape (default: the shape's usual, e.g. Q4_K_M)")
    p.add_argument("--hardware", required=True, help=f"a hardware TOML file, or a shipped rig ({', '.join(shipped_rigs())})")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hit-rates", help="DEVICE,HOST,DISK[,SUBSTITUTED] shares (fractions or percent)")
    src.add_argument("--trace", help="a recorded routing trace, replayed through the simulator")
    p.add_argument("--fit-trace", nargs="+", metavar="TRACE",
                   help="traces the synthetic routing's skew and reuse are fitted to (default: the demo model's)")
    p.add_argument("--tokens", type=int, default=128, help="synthetic trace length in tokens (default 128)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"cache policy for trace replay ({', '.join(POLICIES)}; default the engine's, {DEFAULT_POLICY})")  # fmt: skip
    p.add_argument("--car-threshold", type=float, default=None, help="replay cache-aware routing (needs --trace with probs)")
    p.add_argument("--vram", help="expert cache on the devices (default: VRAM left after resident weights)")
    p.add_argument("--ram", help="expert cache in DRAM (default: RAM less a 4 GiB reserve)")
    p.add_argument("--measure", metavar="DIR", help="replace the file's host and drive figures with this machine's (drive: DIR's)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="with --measure: the CPU threads its products and its run of the engine take, as a run with -t N "
                        "would (default: all cores for the products, the engine's own choice for the run)")  # fmt: skip
    p.add_argument("--schedule", choices=SCHEDULES, default="engine", help="engine (ours) or fomoe (FOMOE's)")
    p.add_argument("--efficiency", help="kernel efficiency per family, e.g. dense=0.5,experts=0.4 or one number")
    p.add_argument("--prefetch", type=float, default=None,
                   help="share of misses read ahead off the critical path (default, engine schedule: the engine's "
                        "next-layer predictions replayed through tiers that serve the projection's hit rates, from "
                        "--trace if it records predictions, else, with --measure on a model file, the model's own in the decode it "
                        "measures, else the demo model's; FOMOE's schedule reads nothing ahead)")  # fmt: skip
    p.add_argument("--drop", default="", help=f"zero these terms to see what they cost ({', '.join(TERMS)})")
    p.add_argument("--sweep", help="vram=8G,16G | ram=32G,64G | policy=lru,lfu-decay|all | car=0.2,0.35")
    p.add_argument("--what-if", action="store_true", help="rank upgrades: a drive, 2x RAM, 2x VRAM, a GPU")
    p.add_argument("--png", help="write tok/s against device cache size per policy (needs matplotlib)")
    p.add_argument("--steps", action="store_true",
                   help="from FOMOE's schedule, one change at a time: prefetch, no router round trip, both GPUs on every layer; then ours")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(handler=cmd_plan)


def _efficiency(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        if "=" not in text:
            out = {"dense": float(text), "experts": float(text)}
        else:
            out = {k.strip(): float(v) for k, v in (part.split("=", 1) for part in text.split(","))}
    except ValueError:
        raise FomoeError(f"--efficiency: expected dense=X,experts=Y or one number, got {text!r}") from None
    # (0 would divide by zero, NaN fails every comparison and would be printed as a projection)
    bad = [k for k in out if k not in ("dense", "experts")] + [k for k, v in out.items() if not 0 < v <= 1]
    if bad:
        raise FomoeError(f"--efficiency: families are dense and experts, each in (0, 1]; got {text!r}")
    return out


@dataclass(frozen=True)
class ReadAheadFigures:
    """The engine schedule's reads a layer ahead, as a projection takes them: `share` of the misses read
    ahead by a right guess; where it comes from; the share of right guesses along the reading order and the
    wrong ones read per miss, where a replay counted them; the predictor's own accuracy by rank."""

    share: float
    source: str
    along: tuple[float, ...] = ()
    wrong: float | None = None
    by_rank: tuple[float, ...] = ()
    right: float | None = None  # of the guesses read, the share their step read (the engine's gate judges it)


class Planner:
    """Everything one `fomoe plan` run varies: capacity, policy, CAR threshold, hardware."""

    def __init__(self, args: argparse.Namespace, work: Workload):
        self.args, self.work = args, work
        self.trace = load_traces([args.trace])[0] if args.trace else None
        self.synthetic = None
        if not args.hit_rates and not self.trace:
            fits = load_traces(args.fit_trace or [str(DEMO_TRACE)])
            self.fit = fit_routing(fits)
            m = work.model
            self.synthetic = synthetic_trace(m.n_layer, m.n_expert, m.n_expert_used, args.tokens, self.fit, m.expert_bytes)
            self.seed = popularity_seed(self.synthetic)
        drop = frozenset(t.strip() for t in args.drop.split(",") if t.strip())
        unknown = sorted(drop - set(TERMS))
        if unknown:
            raise FomoeError(f"--drop: unknown term {unknown[0]!r}; expected some of {', '.join(TERMS)}")
        self.drop = drop
        self.efficiency = _efficiency(args.efficiency)
        # the trace whose recorded predictions the engine schedule's reads ahead are replayed from
        self.predictions = self.trace if self.trace is not None and self.trace.prediction_accuracy() else None
        self._replays: dict[tuple[float, float], ReadAheadFigures] = {}

    def read_ahead(self, hw: Hardware, rates: TierRates) -> ReadAheadFigures:
        """The share of misses read ahead by a right guess, and how: given (--prefetch), none (FOMOE's
        schedule), or the engine's predictions replayed through tiers that serve as many accesses as `rates`
        say (the guesses read are those no tier holds: the more the tiers hold, the fewer of the likeliest)."""
        a = self.args
        if a.prefetch is not None:
            return ReadAheadFigures(a.prefetch, "given")
        if a.schedule != "engine":
            return ReadAheadFigures(0.0, "FOMOE's schedule reads nothing ahead")
        device, host = self.capacity(hw).shares(self.work.model)
        memory = rates.device + rates.host + rates.substituted
        split = device / (device + host) if device + host else 0.0
        key = (round(memory, 6), round(split, 6))
        if key not in self._replays:
            if self.predictions is None:
                self.predictions = load_traces([str(PREDICTION_TRACE)])[0]
            replay = read_ahead_from_trace(self.predictions, memory, split, a.policy)
            by_rank = tuple(self.predictions.prediction_accuracy_by_rank())
            gate = ReadAheadGate(GPU_READ_AHEAD_PAYS)
            if hw.device.count and not gate.keeps_reading(replay.right):
                # the GPU engine's gate turns reading ahead off at this share of its guesses right
                why = (f"the engine reads nothing ahead: {100 * replay.right:.0f} % of the guesses it would read are right, "
                       f"below the {100 * (gate.pays_above - gate.margin):.0f} % at which its GPU schedule stops reading ahead "
                       f"(it pays above {100 * gate.pays_above:.0f} %); {replay.line()}")  # fmt: skip
                self._replays[key] = ReadAheadFigures(0.0, why, by_rank=by_rank, right=replay.right)
            else:
                self._replays[key] = ReadAheadFigures(replay.share, replay.line(), replay.along, replay.wrong, by_rank, replay.right)
        return self._replays[key]

    def capacity(self, hw: Hardware, vram: int | None = None, ram: int | None = None) -> Capacity:
        cap = capacity_for(self.work.model, hw)
        a = self.args
        vram = vram if vram is not None else (parse_size(a.vram) if a.vram else None)
        ram = ram if ram is not None else (parse_size(a.ram) if a.ram else None)
        return Capacity(cap.device if vram is None else vram, cap.host if ram is None else ram)

    def rates(self, cap: Capacity, policy: str | None = None, car: float | None = None) -> TierRates:
        a = self.args
        if a.hit_rates:
            return parse_hit_rates(a.hit_rates)
        policy = policy or a.policy
        if policy not in POLICIES:
            raise FomoeError(f"unknown cache policy {policy!r}; expected one of {', '.join(POLICIES)}")
        car = a.car_threshold if car is None else car
        dev, host = cap.shares(self.work.model)
        if self.trace is not None:
            return rates_from_trace(self.trace, dev, host, policy, car)
        if car is not None:
            raise FomoeError("CAR needs routing probabilities: give --trace with a trace recorded by the engine")
        r = rates_from_trace(self.synthetic, dev, host, policy, None, seed=self.seed)
        return replace(r, source=r.source + "; " + self.fit.line() + ", tiers warm-started by popularity")

    def project(self, hw: Hardware, rates: TierRates):
        ahead = self.read_ahead(hw, rates)
        if ahead.wrong is not None and not rates.ahead:  # the wrong guesses the replay read, per access
            rates = replace(rates, ahead=min(1.0, ahead.wrong * rates.disk))
        return project(self.work, hw, rates, self.args.schedule, efficiency=self.efficiency, prefetch=ahead.share,
                       by_rank=ahead.along, drop=self.drop)  # fmt: skip

    def fomoe_schedule(self, hw: Hardware, rates: TierRates):
        """FOMOE's schedule under the same figures (it reads nothing ahead), to print beside ours."""
        return project(self.work, hw, rates, "fomoe", efficiency=self.efficiency, drop=self.drop)


def _sweep(planner: Planner, hw: Hardware, cap: Capacity, spec: str) -> list:
    kind, _, values = spec.partition("=")
    if kind not in SWEEP_KINDS or not values:
        raise FomoeError(f"--sweep: expected KIND=V1,V2,... with KIND one of {', '.join(SWEEP_KINDS)}, got {spec!r}")
    rows = []
    names = list(POLICIES) if kind == "policy" and values == "all" else [v.strip() for v in values.split(",")]
    for v in names:
        if kind == "vram":
            r = planner.rates(Capacity(parse_size(v), cap.host))
        elif kind == "ram":
            r = planner.rates(Capacity(cap.device, parse_size(v)))
        elif kind == "policy":
            r = planner.rates(cap, policy=v)
        else:
            try:
                r = planner.rates(cap, car=float(v))
            except ValueError:
                raise FomoeError(f"--sweep car: expected thresholds, got {v!r}") from None
        rows.append((f"{kind} {v}", r, planner.project(hw, r)))
    return rows


UPGRADES = {
    "another drive": lambda hw: hw.with_changes(drives={"count": hw.drives.count + 1}),
    "2x RAM": lambda hw: hw.with_changes(host={"memory": 2 * hw.host.memory}),
    "2x VRAM per GPU": lambda hw: hw.with_changes(device={"memory": 2 * hw.device.memory}),
    "a second GPU": lambda hw: hw.with_changes(device={"count": hw.device.count + 1}),
}


def _what_if(planner: Planner, hw: Hardware, base_tps: float) -> list:
    rows = []
    for name, change in UPGRADES.items():
        if hw.device.count == 0 and ("VRAM" in name or "GPU" in name):
            continue  # a CPU-only box's file states no GPU figures to add a second one from
        new = change(hw)
        r = planner.rates(planner.capacity(new))
        p = planner.project(new, r)
        rows.append((name, r, p, p.tokens_per_s / base_tps - 1))
    return sorted(rows, key=lambda row: -row[3])


STEP_PREFETCH = 0.85  # FOMOE's next-layer prediction accuracy, as the issue worked its steps


def _steps(planner: Planner, hw: Hardware, rates: TierRates) -> list[tuple[str, Projection]]:
    """FOMOE's schedule, then cumulatively: reads a layer ahead (--prefetch, default 85 % of misses),
    no router round trip per layer, every GPU computing a share of every layer; then our engine's
    schedule with the same reads ahead. Hit rates held fixed: only the schedule changes."""
    ahead = planner.args.prefetch or STEP_PREFETCH
    base = {"efficiency": planner.efficiency, "drop": planner.drop}
    no_sync = planner.drop | {"sync"}
    rows = [
        ("FOMOE's schedule", {}),
        (f"+ reads one layer ahead ({100 * ahead:.0f} % of misses)", {"prefetch": ahead}),
        ("+ no router round trip per layer", {"prefetch": ahead, "drop": no_sync}),
    ]
    if hw.device.count > 1:
        split = {"prefetch": ahead, "drop": no_sync, "devices_per_layer": hw.device.count}
        rows.append((f"+ {hw.device.count} GPUs computing every layer", split))
    out = [(label, project(planner.work, hw, rates, "fomoe", **{**base, **kw})) for label, kw in rows]
    out.append(("our engine's schedule", project(planner.work, hw, rates, "engine", **base)))
    out.append((f"our engine's, reads one layer ahead ({100 * ahead:.0f} %)", project(planner.work, hw, rates, "engine", **base, prefetch=ahead)))
    return out


def _png(planner: Planner, hw: Hardware, cap: Capacity, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FomoeError("--png needs matplotlib: pip install 'fomoepy[plot]'") from None
    store = planner.work.model.store_bytes
    sizes = [int(store * f) for f in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        tps = [planner.project(hw, planner.rates(Capacity(s, cap.host), policy=policy)).tokens_per_s for s in sizes]
        ax.plot([s / (1 << 30) for s in sizes], tps, marker="o", label=policy)
    ax.set_xlabel("device expert cache (GiB)")
    ax.set_ylabel("projected decode tok/s")
    ax.set_title(f"{planner.work.model.name} on {hw.name}"[:80], fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.tokens < 2:
        raise FomoeError(f"--tokens must be >= 2, got {args.tokens}")
    if args.threads is not None and args.threads < 1:
        raise FomoeError(f"-t must be >= 1, got {args.threads}")
    if args.prefetch is not None and not 0.0 <= args.prefetch <= 1.0:
        raise FomoeError(f"--prefetch must be in [0, 1], got {args.prefetch}")
    if args.png:
        check_output(args.png, "--png")
    m = model_bytes(shape_by_name(args.shape), args.mix) if args.shape else model_bytes_from_gguf(args.model)
    work = Workload(m)
    hw = load_hardware(args.hardware)
    hw_source = args.hardware
    if args.measure:
        from fomoepy.plan.measure import measured

        found = measured(hw, args.measure, None if args.shape else args.model, args.threads)
        hw = found.hardware
        hw_source += f"; host and drive figures measured here ({args.measure})" + "".join(f"; {n}" for n in found.notes)
    planner = Planner(args, work)
    if args.measure and found.predictions is not None and planner.predictions is None:
        planner.predictions = found.predictions  # the model's own, from the decode --measure ran
    cap = planner.capacity(hw)
    rates = planner.rates(cap)
    p = planner.project(hw, rates)
    ahead_taken = planner.read_ahead(hw, rates)
    # FOMOE is a GPU system: its schedule is printed beside ours on a rig with GPUs
    theirs = planner.fomoe_schedule(hw, rates) if args.schedule == "engine" and hw.device.count else None
    sweep = _sweep(planner, hw, cap, args.sweep) if args.sweep else []
    what_if = _what_if(planner, hw, p.tokens_per_s) if args.what_if else []
    steps = _steps(planner, hw, rates) if args.steps else []
    if args.png:
        _png(planner, hw, cap, args.png)
    if args.json:
        out = {
            "model": {**asdict(m), "store_bytes": m.store_bytes, "resident_bytes": m.resident_bytes},
            "hardware": {"source": hw_source, **asdict(hw)},
            "capacity": asdict(cap),
            "routing": rates.as_dict(),
            "projection": p.as_dict(),
            "prefetch": asdict(ahead_taken),
            "fomoe_schedule": theirs.as_dict() if theirs is not None else None,
            "sweep": [{"setting": s, "routing": r.as_dict(), "projection": q.as_dict()} for s, r, q in sweep],
            "what_if": [{"upgrade": n, "routing": r.as_dict(), "projection": q.as_dict(), "gain": g} for n, r, q, g in what_if],
            "steps": [{"step": label, "projection": q.as_dict()} for label, q in steps],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(describe(work, hw, hw_source, rates, p, cap))
    ahead = f"reads a layer ahead: {100 * ahead_taken.share:.0f} % of misses ({ahead_taken.source})"
    if ahead_taken.share and args.schedule == "engine" and (p.backend == "gpu" or not hw.host.make_ready):
        # what the drives make of it: the right guesses that land before their step, the wrong ones' time
        misses = m.n_expert_used * rates.disk
        ahead += (f"; {p.landed_ahead:.2f} of a layer's {misses:.2f} misses land before their step asks, the wrong "
                  f"guesses take {1e3 * p.wrong_reads:.1f} ms of the drives' idle time a token")
    print(ahead)
    if theirs is not None:
        print(f"FOMOE's schedule, same figures: {theirs.tokens_per_s:.2f} tok/s; ours {p.tokens_per_s:.2f} "
              f"= {p.tokens_per_s / theirs.tokens_per_s:.2f}x")  # fmt: skip
    if sweep:
        print(f"\nsweep ({args.schedule} schedule):\n" + sweep_table(sweep))
    if steps:
        print("\nsteps (cumulative; the same hit rates throughout):\n" + steps_table(steps))
    if what_if:
        given = " (hit rates given: capacity upgrades cannot change them)" if args.hit_rates else ""
        print(f"\nwhat if{given}:")
        for name, _, q, gain in what_if:
            print(f"  {name:<18} {q.tokens_per_s:7.2f} tok/s  ({100 * gain:+.1f}%)")
    return 0
