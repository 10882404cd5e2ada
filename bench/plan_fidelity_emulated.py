"""`fomoe plan`'s GPU schedule against the real engine step on an emulated-cost device.

The device is the stand-in driver in its timed null mode (fomoepy/runtime/sim/sim_timing.h), under the
real cuda-python (or hip-python) binding: nothing is computed, but each stream is a timeline on which a
launch takes the bytes it reads / the kernel rate, a host <-> device copy its bytes / the link rate,
events order the timelines, and every synchronisation (the router's read-back, an event sync) makes the
host wait until the device would be done. The store is a timed null store (fomoepy/devtools/null_store.py):
a read lands latency + bytes / drive bandwidth after it is issued, its bytes queued behind the drive's
other reads. The rates are a rig file's (default the fomoe-rig): kernel rate = its device bandwidth x
the kernel efficiency `fomoe plan` assumes (GPU_EFFICIENCY), its link, its drives.

At Qwen3.5-397B-A17B's shape (60 layers x 512 experts, top-10, every expert's true Q4_K_M bytes), each
setting decodes tokens through the engine's own MoE step (fomoepy.experts.step.MoEStep, the default cache
policy; prefetch off so every miss is read when its layer asks, or with --prefetch the engine's default
reading ahead, whose effect the run's hit counts then carry). Per layer the bench launches what a decode
step reads: the layer's dense weights (attention, shared expert; one launch of their bytes: the device
charges bytes, not arithmetic), the router and its top-k with the read-back, the step (its prediction of
the next layer's experts, reads, copies up, the grouped expert launches); per token the output head and
the sampler's read-back. Routing follows a synthetic trace fitted to the demo model's (as
bench/host_time.py); the next layer's prediction gets 80 % of its experts right at every rank, or with
--predictor demo as often as the demo model's does at each rank (most confident first), which the
projection then takes rank by rank as `fomoe plan` takes a trace's.

In the same run, from the same figures (the emulated rates; the host's own time per layer step, measured
in this run as bench/host_time.py times it, less its waits for the device and for reads; this run's tier
hit and demotion counts), the projection of `fomoe plan --schedule engine` and FOMOE's schedule's (its own
stated host time, FOMOE_HOST_PLAN) are computed by fomoepy.plan.timemodel.project, which `fomoe plan`
calls. The emulation's own lateness (a thread of a busy machine waking after its time) is measured and
stated; a setting whose lateness exceeds EMULATION_ERROR of its time is run again (--tries).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = "qwen3.5-397b-a17b"
# (name, device share, host share) of the store's bytes; the last leaves over 25 % of accesses to the disk
SETTINGS = [("40% + 30%", 0.40, 0.30), ("11.3% + 12.9% (fomoe-rig's tiers)", 0.113, 0.129), ("4% + 4%", 0.04, 0.04)]
WITHIN = 0.10
EMULATION_ERROR = 0.02  # a run whose syncs and reads came back late by more than this share of its time is retried


@dataclass(frozen=True)
class EmulatedRates:
    """The emulated device's and drives' rates (bytes/s, seconds)."""

    kernel: float
    link: float
    drive: float
    latency: float
    drives: int

    @classmethod
    def of_rig(cls, name: str) -> EmulatedRates:
        from fomoepy.plan.hardware import load_hardware
        from fomoepy.plan.timemodel import GPU_EFFICIENCY

        hw = load_hardware(name)
        return cls(hw.device.bandwidth * GPU_EFFICIENCY, hw.device.link, hw.drives.bandwidth, hw.drives.latency, hw.drives.count)

    def describe(self) -> str:
        return (f"kernels {self.kernel / 1e9:.1f} GB/s of the bytes they read, link {self.link / 1e9:.2f} GB/s, "
                f"{self.drives} drive(s) of {self.drive / 1e9:.2f} GB/s + {self.latency * 1e6:.0f} µs per read, many in flight")  # fmt: skip


# -- the child: one setting's decode on the emulated device ------------------------------------------------
def child(args: argparse.Namespace) -> dict:
    from trace_routing import PREDICT_ACCURACY, TraceRouting, demo_accuracy_by_rank

    from fomoepy.devtools.null_store import TimedNullStore, shape_layers
    from fomoepy.experts.device import Phase
    from fomoepy.experts.fast_cache import make_cache
    from fomoepy.experts.policy import DEFAULT_POLICY, make_policy, policy_demotes
    from fomoepy.experts.step import MoEStep
    from fomoepy.experts.streamer import ExpertStreamer
    from fomoepy.options import EngineOptions
    from fomoepy.plan.shapes import MIXES, model_bytes, shape_by_name
    from fomoepy.quants import GGMLQuantizationType, row_nbytes
    from fomoepy.runtime.gpu import GpuBackend
    from fomoepy.runtime.gpu_experts import GpuExperts

    rates = EmulatedRates(**json.loads(args.rates))
    shape = shape_by_name(SHAPE)
    mb = model_bytes(shape)
    layers = shape_layers(shape)
    n_layer, n_expert, k, e = shape.n_layer, shape.n_expert, shape.n_expert_used, shape.n_embd
    dev = GpuBackend(args.vendor)
    # weights are address space on the null device; a launch is charged the bytes of the matrices it names
    router_bytes = n_expert * row_nbytes(MIXES[shape.default_mix].router, e)
    zeros = np.zeros((n_expert, e), np.float32)  # in the router's GGUF form, as the model loads it (load_weight)
    routers = [dev.weight_from_bytes(zeros.view(np.uint8), GGMLQuantizationType.F32, zeros.shape, f"blk.{il}.ffn_gate_inp.weight")
               for il in range(n_layer)]  # fmt: skip
    dense = dev.upload(np.zeros(((mb.dense_layer_bytes - router_bytes) // (4 * e), e), np.float32), exact=True)
    head = dev.upload(np.zeros((mb.head_bytes // (4 * e), e), np.float32), exact=True)
    device = GpuExperts(layers, dev, routers)
    unit = [device.expert_nbytes(il) for il in range(n_layer)]
    policy = args.policy or DEFAULT_POLICY
    store_bytes = mb.store_bytes
    cache = make_cache(n_expert, [layer.expert_nbytes for layer in layers], int(args.device_share * store_bytes),
                        int(args.host_share * store_bytes), make_policy(policy), make_policy(policy), device_expert_bytes=unit)  # fmt: skip
    source = TimedNullStore(layers, rates.drive, rates.latency, rates.drives)
    streamer = ExpertStreamer(source, cache, k, EngineOptions(prefetch=args.prefetch),
                              download=device.download if policy_demotes(policy) else None, buffers=device.host_buffer,
                              read_ahead_pays=device.read_ahead_pays)  # fmt: skip
    step = MoEStep(streamer, device, predicts=args.prefetch)  # as the engine: a prediction only to read ahead

    n_tokens = args.warm + args.tokens
    # the device's routing makes its launches and its one read-back (the router's choice and the next
    # layer's prediction together); what it returns is the trace's choice (the null device computes nothing)
    accuracy = demo_accuracy_by_rank(k) if args.predictor == "demo" else PREDICT_ACCURACY
    routing = TraceRouting(dev, n_layer, n_expert, k, n_tokens, layers[0].expert_nbytes, accuracy)
    h = dev.upload(np.zeros((1, e), np.float32))
    dev.rt.sync(dev.stream)  # the uploads above: setting up, not decoding

    lib = ctypes.CDLL("libamdhip64.so" if args.vendor == "hip" else "libcuda.so.1")  # the stand-in, already loaded
    lib.sim_timed_waited_ns.restype = lib.sim_timed_late_ns.restype = ctypes.c_longlong
    step.records = []
    in_step = [0.0]  # host seconds inside the steps' windows, less their waits
    serial = [0.0]  # of those, the seconds in series with each step's reads (before them, after the last)
    first = [0.0]  # of those, the seconds before them (the next layer's guesses go to the drives after)
    launch = [0.0]  # of those, the seconds before the step's first launch (the device computes from then)
    copies = [0.0]  # of those, the seconds before the step's device part after its plan (its copies up start)
    reads_late = [0.0]  # seconds the steps' reads were handed over late (the latest of each step's)

    def decode(tokens: range) -> None:
        for t in tokens:
            step.begin_step(Phase.DECODE)
            for il in range(n_layer):
                routing.queue(t, il)
                dev.linear(h, dense)  # attention and the shared expert: their bytes
                # the host's time per layer step as bench/host_time.py times it, from the router's launch to
                # the step's return, less what it waited there for the device and for reads
                t0, w0 = time.perf_counter(), lib.sim_timed_waited_ns()
                exact = step.route(dev, il, h, routers[il], "softmax", k)  # as moe.py runs it
                t1, w1 = time.perf_counter(), lib.sim_timed_waited_ns()
                step(il, h, exact)
                in_step[0] += time.perf_counter() - t0 - (lib.sim_timed_waited_ns() - w0) * 1e-9 - step.records[-1].wait
                # of it, the part in series with the step's reads (the router's, less its read-back's wait; the
                # step's before its reads were issued and after the last landed)
                routed, r = t1 - t0 - (w1 - w0) * 1e-9, step.records[-1]
                first[0] += routed + r.before_reads
                serial[0] += routed + r.before_reads + r.after_landed
                launch[0] += routed + r.before_launch
                copies[0] += routed + r.route + r.plan
                reads_late[0] += source.late_max  # the step waited for its last read: at most this late
                source.late_max = 0.0
            dev.argmax(dev.linear(h, head))  # the output head and the sampler's read-back
            step.end_step(1)

    decode(range(args.warm))
    before = cache.stats.summary()
    step.records, in_step[0], reads_late[0], serial[0], first[0], launch[0], copies[0] = [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    w0, late0, reads0, down0, sync_late0 = lib.sim_timed_waited_ns(), source.late, source.reads, device.downloads, lib.sim_timed_late_ns()
    ahead_counts = streamer.read_ahead.counts if streamer.read_ahead is not None else None
    ahead0 = asdict(ahead_counts) if ahead_counts is not None else {}
    t0 = time.perf_counter()
    decode(range(args.warm, n_tokens))
    wall = time.perf_counter() - t0
    device_wait = (lib.sim_timed_waited_ns() - w0) * 1e-9
    read_wait = sum(r.wait for r in step.records)
    store = {"reads": source.reads - reads0, "late_s": source.late - late0, "late_max_s": reads_late[0],
             "sync_late_s": (lib.sim_timed_late_ns() - sync_late0) * 1e-9}
    # the emulation's own error: syncs that returned after the device's time, reads handed over after
    # theirs (a thread of a busy machine wakes late), each an upper bound of what it added to the wall time
    late = (lib.sim_timed_late_ns() - sync_late0) * 1e-9 + reads_late[0]
    after = cache.stats.summary()
    source.close()
    counts = {"device": after["device"]["hits"] - before["device"]["hits"], "host": after["host"]["hits"] - before["host"]["hits"],
              "disk": after["disk"]["reads"] - before["disk"]["reads"]}  # fmt: skip
    parts = {p: sum(getattr(r, p) for r in step.records) for p in ("route", "plan", "wait", "compute", "release")}
    # the reads made ahead in the measured tokens: issued, used by their step (among its disk reads), wrong,
    # dropped unread
    ahead = {c: _less(v, ahead0[c]) for c, v in asdict(ahead_counts).items()} if ahead_counts is not None else None
    return {"ahead": ahead, "wall_s": wall, "tokens": args.tokens, "device_wait_s": device_wait, "read_wait_s": read_wait, "host_step_s": in_step[0], "host_serial_s": serial[0], "host_before_s": first[0], "host_launch_s": launch[0], "host_copies_s": copies[0], "late_s": late,
            "counts": counts, "prediction_accuracy": streamer.prefetch_stats.accuracy, "by_rank": routing.accuracy_by_rank(), "step_parts_s": parts, "store": store, "demotions": device.downloads - down0, "device": dev.rt.device_name,
            "gate": {k: v for k, v in streamer.stats()["prefetch"].items() if k in ("reading", "right_share", "turned", "guessed", "guessed_right")}}  # fmt: skip


def _less(now, before):
    """A count since `before`; per position, position by position."""
    if isinstance(now, list):
        return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]
    return now - before


def reading_order_accuracy(ahead: dict) -> tuple[float, ...]:
    """The run's share of right guesses along its reading order (ReadAheadCounts.along_reading_order, from
    the counts the child sent): what the read-ahead model's `by_rank` is (the guesses read are those no tier
    holds, which the tiers make less likely than the predictor's own first choices)."""
    from fomoepy.experts.read_ahead import ReadAheadCounts

    return ReadAheadCounts(read_at=ahead["read_at"], used_at=ahead["used_at"]).along_reading_order()


def run_setting(args: argparse.Namespace, rates: EmulatedRates, device_share: float, host_share: float) -> dict:
    """One setting in a child process whose loader finds the stand-in driver, timed."""
    from standin import standin_env

    env = standin_env("bench/plan_fidelity.py --emulated", args.vendor, "timed", 1 << 40,
                      {"FOMOE_STANDIN_KERNEL_BW": repr(rates.kernel), "FOMOE_STANDIN_LINK_BW": repr(rates.link)})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--vendor", args.vendor, "--tokens", str(args.tokens),
           "--warm", str(args.warm), "--device-share", repr(device_share), "--host-share", repr(host_share),
           "--rates", json.dumps(asdict(rates)), "--predictor", args.predictor] + (["--prefetch"] if args.prefetch else []) + (["--policy", args.policy] if args.policy else [])  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench/plan_fidelity.py --emulated: the decode failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def projections(rates: EmulatedRates, rig: str, measured: dict, prefetch: bool) -> tuple:
    """fomoe plan's engine schedule and FOMOE's for this run's figures: (tier shares, engine, fomoe, host
    s/layer, of it in series and before the first launch, (the read-ahead share, reads landed ahead a step
    measured and projected))."""
    from fomoepy.plan.hardware import load_hardware
    from fomoepy.plan.rates import TierRates
    from fomoepy.plan.shapes import model_bytes, shape_by_name
    from fomoepy.plan.timemodel import GPU_EFFICIENCY, Workload, project

    mb = model_bytes(shape_by_name(SHAPE))
    n = sum(measured["counts"].values())
    shares = {tier: c / n for tier, c in measured["counts"].items()}
    shares["demoted"] = measured["demotions"] / n  # a demoting policy's (the default's) copies down are a term too
    # the store's reads beyond the steps' own misses: the wrong guesses read ahead, which took the drive's
    # time beside the step before theirs (the right ones are among the disk reads: the cache counts them so)
    shares["ahead"] = max(0, measured["store"]["reads"] - measured["counts"]["disk"]) / n
    tier_rates = TierRates(shares["device"], shares["host"], shares["disk"], source="this run's hit counts", demoted=shares["demoted"],
                           ahead=shares["ahead"])  # fmt: skip
    steps = measured["tokens"] * mb.n_layer
    host = measured["host_step_s"] / steps
    in_series = min(host, measured["host_serial_s"] / steps)
    before_reads = min(in_series, measured["host_before_s"] / steps)
    before_launch = min(host, measured["host_launch_s"] / steps)
    before_copies = min(host, measured["host_copies_s"] / steps)
    # the rig, one device (the bench places every layer on one), no stated round trip (the emulated device
    # answers at once; the host's side of a read-back is in `host`), the host time measured here
    hw = load_hardware(rig)
    hw = hw.with_changes(device={"count": 1, "sync": 0.0, "bandwidth": rates.kernel / GPU_EFFICIENCY}, host={"plan": host, "serial": in_series, "before_reads": before_reads, "before_launch": before_launch, "before_copies": before_copies})
    work = Workload(mb)
    # Reading ahead, the share of the run's disk reads that its step took from a read made ahead is the
    # projection's read-ahead share (`fomoe plan` assumes its predictor's accuracy instead); the wrong
    # guesses read are `ahead`. FOMOE's schedule reads none ahead.
    share = measured["ahead"]["used"] / measured["counts"]["disk"] if prefetch and measured["counts"]["disk"] else 0.0
    # the share of right guesses along the order the engine read them in, as the run counted it
    engine = project(work, hw, tier_rates, "engine", prefetch=share, by_rank=reading_order_accuracy(measured["ahead"]) if prefetch else ())
    # right guesses landed before their step asked, per layer step: measured, and as the projection has it
    landed = (measured["ahead"]["landed"] / steps if prefetch else 0.0, engine.landed_ahead)
    return shares, engine, project(work, hw, tier_rates, "fomoe"), (host, in_series, before_launch), (share, landed)


def measure(args: argparse.Namespace, rates: EmulatedRates, device_share: float, host_share: float) -> dict:
    """The setting's run whose emulation erred least, of up to args.tries: on a shared machine a thread
    may wake late, and what it adds is the emulation's error, not the engine's time (chosen by that error,
    never by the comparison)."""
    best = None
    for _ in range(args.tries):
        run = run_setting(args, rates, device_share, host_share)
        if best is None or run["late_s"] / run["wall_s"] < best["late_s"] / best["wall_s"]:
            best = run
        if best["late_s"] / best["wall_s"] <= EMULATION_ERROR:
            break
    return best


def main(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.warm < 0 or args.tries < 1:
        raise SystemExit(f"bench/plan_fidelity.py --emulated: expected --tokens >= 1, --warm >= 0, --tries >= 1; got "
                         f"{args.tokens}, {args.warm}, {args.tries}")  # fmt: skip
    from fomoepy.errors import FomoeError

    try:
        rates = EmulatedRates.of_rig(args.rig)
    except FomoeError as e:
        raise SystemExit(f"bench/plan_fidelity.py --emulated: {e}") from None
    rows = []
    for name, device_share, host_share in SETTINGS:
        measured = measure(args, rates, device_share, host_share)
        shares, engine, fomoe, (host, in_series, launch), (ahead_share, landed) = projections(rates, args.rig, measured, args.prefetch)
        rows.append({
            "setting": name, "measured_tok_s": measured["tokens"] / measured["wall_s"],
            # the emulation's own lateness (see child) is the busy machine's, not the engine's; this bound
            # leaves it out (an upper bound of it: a late read may not have delayed the step by all of it)
            "measured_less_late_tok_s": measured["tokens"] / (measured["wall_s"] - measured["late_s"]),
            "projected_tok_s": engine.tokens_per_s, "fomoe_schedule_tok_s": fomoe.tokens_per_s,
            "hit_rates": shares, "host_us_per_layer": host * 1e6, "host_serial_us_per_layer": in_series * 1e6, "host_launch_us_per_layer": launch * 1e6, "emulation_late": measured["late_s"] / measured["wall_s"],
            "waits_s": {"device": measured["device_wait_s"], "reads": measured["read_wait_s"]}, "wall_s": measured["wall_s"],
            "host_step_s": measured["host_step_s"], "demotions": measured["demotions"], "store": measured["store"],
            "prediction_accuracy": measured["prediction_accuracy"], "by_rank": measured["by_rank"],
            "read_ahead": measured["ahead"], "read_ahead_share": ahead_share,
            "reading_order_accuracy": reading_order_accuracy(measured["ahead"]) if args.prefetch else [],
            # right guesses landed before their step asked, per step: measured, and as the projection has it
            "landed_ahead": landed, "gate": measured["gate"],
            "terms_ms_per_token": {t: v * 1e3 for t, v in engine.terms.items()}, "device": measured["device"],
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    report = table(rows, rates, args)
    if not args.json:
        print(report)
    if args.record:
        from results import record

        record(report)
    return 0


def table(rows: list[dict], rates: EmulatedRates, args: argparse.Namespace) -> str:
    worst = max(abs(r["projected_tok_s"] / r["measured_tok_s"] - 1) for r in rows)
    policy_text = f"cache policy {args.policy}" if args.policy else "the engine's default cache policy"
    by_rank = ", ".join(f"{100 * a:.0f}" for a in rows[0]["by_rank"])
    ahead = (f"reads ahead (prediction accuracy {rows[0]['prediction_accuracy']:.0%}; by rank {by_rank} %)" if args.prefetch
             else "prefetch off")  # fmt: skip
    lines = [
        f"### plan fidelity, emulated GPU — {date.today()} — {platform.machine()}, {os.cpu_count()} cores",
        "",
        (f"`python bench/plan_fidelity.py --emulated --vendor {args.vendor} --tokens {args.tokens} --warm {args.warm} "
         f"--rig {args.rig}{' --prefetch' if args.prefetch else ''}{' --predictor demo' if args.predictor == 'demo' else ''}{' --policy ' + args.policy if args.policy else ''}` ({SHAPE} shape, {args.vendor} binding over the stand-in "
         f"driver's timed null mode: {rates.describe()}; {policy_text}, {ahead}, one device)"),
        "",
        ("| setting (device + host) | device | host | disk | demoted | read ahead | host µs / layer (in series with the reads; before the first launch) | emulation late | "
         "measured tok/s (less its lateness) | engine schedule tok/s | projected / measured − 1 | FOMOE's schedule tok/s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["hit_rates"]
        lines.append(
            f"| {r['setting']} | {100 * s['device']:.1f}% | {100 * s['host']:.1f}% | {100 * s['disk']:.1f}% | "
            f"{100 * s['demoted']:.1f}% | {100 * s['ahead']:.1f}% | {r['host_us_per_layer']:.0f} ({r['host_serial_us_per_layer']:.0f}; {r['host_launch_us_per_layer']:.0f}) | "
            f"{100 * r['emulation_late']:.1f}% | "
            f"{r['measured_tok_s']:.2f} ({r['measured_less_late_tok_s']:.2f}) | {r['projected_tok_s']:.2f} | "
            f"{100 * (r['projected_tok_s'] / r['measured_tok_s'] - 1):+.1f}% | {r['fomoe_schedule_tok_s']:.2f} |"
        )
    verdict = "within" if worst <= WITHIN else "NOT within"
    slower = sum(r["fomoe_schedule_tok_s"] < r["measured_tok_s"] for r in rows)
    lines += [
        "",
        (f"- worst setting: {100 * worst:.1f}% off, {verdict} {100 * WITHIN:.0f}%; FOMOE's schedule projects slower than "
         f"measured at {slower} of {len(rows)} settings"),
        ("- host µs / layer: measured in the run as bench/host_time.py times a step (router launch to the step's return), "
         "less its waits for the device and the reads, and of it the part in series with the step's reads (before they are "
         "issued, after the last lands; the engine schedule overlaps the rest with the step's device work), and the part before its first launch (the device computes the experts it holds from then); emulation late: syncs that returned, and reads handed over, after "
         f"their time (a busy machine's, not the engine's; an upper bound); load average at the end {os.getloadavg()[0]:.2f} (1 min)"),
    ]
    if args.prefetch:
        lines += [("- reads made ahead (two in flight per drive, most confident first; a guess its layer did not choose "
                   "and that was never issued is dropped unread): ") + "; ".join(
                      f"{r['setting']}: {r['read_ahead']['issued']} issued, {r['read_ahead']['used']} used by their step "
                      f"({100 * r['read_ahead_share']:.0f}% of its disk reads, the projection's read-ahead share; "
                      f"{r['read_ahead']['landed']} of them landed before it asked: {r['landed_ahead'][0]:.2f} a step, "
                      f"projected {r['landed_ahead'][1]:.2f}), {r['read_ahead']['wasted']} wrong "
                      f"({r['read_ahead']['in_the_way']} still in flight when their layer routed), "
                      f"{r['read_ahead']['skipped']} dropped unread; right along the reading order (the projection's "
                      f"accuracy by position) {', '.join(f'{100 * a:.0f}' for a in r['reading_order_accuracy'])} %"
                      for r in rows)]  # fmt: skip
        lines += [("- the engine's gate on reading ahead (off while fewer of the guesses it would read are right than pay "
                   "on the GPU schedule; one token in eight still predicts, scored as if read): ") + "; ".join(
                      f"{r['setting']}: {'reading' if r['gate']['reading'] else 'off'} at the end, "
                      f"{100 * r['gate']['guessed_right'] / max(1, r['gate']['guessed']):.0f}% of {r['gate']['guessed']} guesses right, "
                      f"turned {r['gate']['turned']} time(s)" for r in rows if r["gate"])]  # fmt: skip
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    # cuda-python lets go of the GIL while a sync waits (hip-python 7.2 holds it, so the store's thread could
    # not hand over a read that lands meanwhile, which the emulation would then count as the drive's time)
    ap.add_argument("--vendor", default="cuda", choices=["hip", "cuda"], help="--emulated: the binding the engine runs through")
    ap.add_argument("--rig", default="fomoe-rig", help="--emulated: the rig file whose rates the device emulates")
    ap.add_argument("--warm", type=int, default=24, help="--emulated: tokens decoded first, to fill the tiers")
    ap.add_argument("--prefetch", action="store_true",
                    help="--emulated: the engine reads the next layer's predicted experts ahead (its default); off, every "
                         "miss is read when its layer asks")  # fmt: skip
    ap.add_argument("--predictor", default="uniform", choices=["uniform", "demo"],
                    help="--emulated --prefetch: the emulated predictor right 80 %% of the time at every rank, or at the demo "
                         "model's measured accuracy rank by rank (most confident first: 83 %% down to 40 %%)")  # fmt: skip
    from fomoepy.experts.policy import POLICIES

    ap.add_argument("--policy", default=None, choices=POLICIES, help="--emulated: the cache policy (default: the engine's; a demoting one copies its device evictees down)")
    ap.add_argument("--tries", type=int, default=3,
                    help=f"--emulated: runs of a setting at most, until its emulation error is under {100 * EMULATION_ERROR:.0f} %% of its time")  # fmt: skip


if __name__ == "__main__":  # the child process of one setting
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--device-share", type=float, required=True)
    ap.add_argument("--host-share", type=float, required=True)
    ap.add_argument("--rates", required=True)
    add_arguments(ap)
    print(json.dumps(child(ap.parse_args())))
