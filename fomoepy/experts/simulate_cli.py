"""`fomoe simulate`: replay a routing trace against the expert cache, per policy, next to Belady."""

from __future__ import annotations

import argparse
import json

from fomoepy.errors import FomoeError
from fomoepy.experts import trace_pack
from fomoepy.experts.cache import PIN_FRACTION
from fomoepy.experts.car import CarConfig
from fomoepy.experts.policy import DEFAULT_POLICY, POLICIES
from fomoepy.experts.profile import read_freq, seed_order
from fomoepy.experts.simulate import belady_for, report, simulate
from fomoepy.experts.sizes import MAX_SIZE, parse_size
from fomoepy.experts.trace import expert_sizes, read_trace

MIB = 1 << 20


def add_simulate_command(sub) -> None:
    p = sub.add_parser("simulate", help="replay a routing trace against the expert cache; compare with Belady")
    p.add_argument("trace", help="a routing trace: .trace recorded by the engine (--trace), or .npz packed (profiles/traces/)")
    vram = p.add_mutually_exclusive_group(required=True)
    vram.add_argument("--vram-mb", type=float, help="device tier capacity in MiB (0 = off)")
    vram.add_argument("--vram", help="device tier capacity as a size, e.g. 512M, 16G (0 = off)")
    ram = p.add_mutually_exclusive_group(required=True)
    ram.add_argument("--ram-mb", type=float, help="host tier capacity in MiB (0 = off)")
    ram.add_argument("--ram", help="host tier capacity as a size, e.g. 48G (0 = off)")
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"eviction policy, several comma-separated, or 'all' ({', '.join(POLICIES)}; default {DEFAULT_POLICY})",
    )
    p.add_argument("--half-life", type=float, default=256.0, help="lfu-decay half-life in tokens (default 256)")
    p.add_argument("--expert-bytes", help="bytes of one expert in every layer (overrides the trace header)")
    p.add_argument("--profile", help="a .freq profile that seeds VRAM then DRAM before replay")
    p.add_argument(
        "--pin-fraction", type=float, default=PIN_FRACTION, help=f"with *-pinned policies: share of each tier pinned ({PIN_FRACTION}, as the engine)"
    )
    CarConfig.add_arguments(p.add_argument_group("cache-aware routing replayed (off by default)"))
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(handler=cmd_simulate)


def _capacity(mb: float | None, text: str | None, flag: str) -> int:
    if text is not None:
        return parse_size(text)
    if mb is None or not 0 <= mb * MIB <= MAX_SIZE:  # (NaN and inf fail too)
        raise FomoeError(f"--{flag}-mb must be in [0, {MAX_SIZE // MIB}], got {mb}")
    return int(mb * MIB)


def cmd_simulate(args: argparse.Namespace) -> int:
    trace = trace_pack.load(args.trace) if str(args.trace).endswith(".npz") else read_trace(args.trace)
    sizes = expert_sizes(trace.header, parse_size(args.expert_bytes) if args.expert_bytes else None)
    vram = _capacity(args.vram_mb, args.vram, "vram")
    ram = _capacity(args.ram_mb, args.ram, "ram")
    if not 0.0 <= args.pin_fraction <= 1.0:
        raise FomoeError(f"--pin-fraction must be in [0, 1], got {args.pin_fraction}")
    names = list(POLICIES) if args.policy == "all" else [n.strip() for n in args.policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        bad = unknown[0] if unknown else args.policy
        raise FomoeError(f"unknown cache policy {bad!r}; expected one of {', '.join(POLICIES)} or all")
    seed = []
    if args.profile:
        seed = seed_order(read_freq(args.profile, trace.header.n_layer, trace.header.n_expert))
    car = CarConfig.from_args(args)
    results = [
        simulate(trace, sizes, vram, ram, name, half_life_tokens=args.half_life, seed=seed,
                 pin_fraction=args.pin_fraction, car=car)
        for name in names
    ]
    if args.json:
        dev_seed, host_seed = results[0].seeded
        out = {
            "trace": args.trace,
            "truncated": trace.truncated,
            "device_bytes": vram,
            "host_bytes": ram,
            "belady_device_hit_rate": belady_for(trace, sizes, vram, dev_seed).hit_rate if vram else 0.0,
            "belady_memory_hit_rate": belady_for(trace, sizes, vram + ram, dev_seed + host_seed).hit_rate
            if vram + ram
            else 0.0,
            "policies": {
                r.policy: {
                    **r.summary,
                    "memory_hit_rate": r.memory_hit_rate,
                    **({"car_substitution_rate": r.car.rate} if r.car else {}),
                }
                for r in results
            },
        }
        print(json.dumps(out, indent=1))
    else:
        print(report(trace, sizes, results))
    return 0
