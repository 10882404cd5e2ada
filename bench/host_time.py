"""Host time per MoE layer step: the host's own work, where no device and no disk hide it.

GPU path, at Qwen3.5-397B-A17B's shape (60 layers x 512 experts, top-10, every expert's true bytes at
Q4_K_M in every tier's bookkeeping), through the real hip-python (or cuda-python) binding over the
stand-in driver in its null mode: allocations reserve address space only, copies and launches are
checked and complete at once, events are ready at once; the store is a null store (reads complete at
once, carrying no bytes). The engine's own MoE step (fomoepy.experts.step.MoEStep) runs it with the
default cache policy and capped tiers (the fomoe-rig's share: 11.3 % device, 12.9 % host), so there
are misses, copies, evictions and prefetches. Routing follows a synthetic decode trace fitted to the
demo model's (fomoepy.plan.routing); each step makes the router's launches and read-back as the model
does, then routes by the trace. A step is timed from the router launch to the step's return.

cpu backend, on the bench model (bench/decode.py's; its one tier, ggml slot tensors sized by --ram-cache, at
25 % of the experts), through the engine: the same step records, less the time inside ggml's products
(the experts', and the next layer's router product that predicts its experts), the slot fills (a miss's store bytes set into its slot, repacked where the slots are: this backend's
making ready, as a copy up is a GPU's) and the time blocked on reads.

Prints median and p90 µs per step; on the GPU path also the median of its part in series with the
step's reads (before they are issued, after the last lands: `[host] serial` in a rig file; the part
before them is `[host] before_reads`), of the part before the step's first launch (`[host] before_launch`:
the device computes the experts it holds from then) and before its copies up (`[host] before_copies`:
they start after its cache plan), split into
routing (the router's launches and read-back, CAR), plan (the reads issued; then, while they are in
flight, the usage counts, the trace and the next layer's prediction; the cache plan and policy, host
bytes), binding calls (every driver call's time, counted) and the rest of Python. The GPU path runs
twice: with the step's hot driver calls through the binding's C functions (fomoepy/runtime/
_driver_calls.c; the figure), and, beside it in the same run, with every call through the binding's
Python functions (what those C calls save; `gpu_python_calls` in --json). Each kind runs `--repeats`
times, the two taking turns, and the fastest run is reported with the others' medians beside it: on
a shared machine a run's median moves 10-20 % with its neighbours' load, never below what the code
costs (bench/policy_cost.py reports the fastest of its runs the same way). The cpu path runs `--repeats`
times too, after the GPU runs, and is reported the same way (one run's products moved from ~800 to
~1,040 µs a step with the machine's neighbours, and its host time with them).

    python bench/host_time.py [--json] [--record] [--vendor hip|cuda] [--tokens 48] [--warm 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = "qwen3.5-397b-a17b"
DEVICE_SHARE, HOST_SHARE = 0.113, 0.129  # fomoe plan's tiers on the fomoe-rig, as shares of the store


def percentiles(us: list[float]) -> tuple[float, float]:
    return float(np.median(us)), float(np.percentile(us, 90))


# -- the GPU path, in a child process that loads the stand-in driver ------------------------------------
def gpu_child(args: argparse.Namespace) -> dict:
    from trace_routing import TraceRouting

    from fomoepy.devtools.null_store import NullStore, shape_layers
    from fomoepy.experts.device import Phase
    from fomoepy.experts.fast_cache import make_cache
    from fomoepy.experts.policy import DEFAULT_POLICY, make_policy, policy_demotes
    from fomoepy.experts.step import MoEStep
    from fomoepy.experts.streamer import ExpertStreamer
    from fomoepy.plan.shapes import model_bytes, shape_by_name
    from fomoepy.quants import GGMLQuantizationType
    from fomoepy.runtime.gpu import GpuBackend
    from fomoepy.runtime.gpu_experts import GpuExperts
    from fomoepy.runtime.pinned import reserve_bytes
    from fomoepy.runtime.shim import DIRECT_CALLS, DriverShim

    shape = shape_by_name(SHAPE)
    layers = shape_layers(shape)
    n_layer, n_expert, k = shape.n_layer, shape.n_expert, shape.n_expert_used
    store_bytes = model_bytes(shape).store_bytes
    dev = GpuBackend(args.vendor)
    device_name = dev.rt.device_name
    routers_host = np.zeros((n_expert, shape.n_embd), np.float32)  # one host array: the null device copies nothing
    # in the router's GGUF form, as the model loads it (GpuBackend.load_weight): a weight, not an array
    routers = [dev.weight_from_bytes(routers_host.view(np.uint8), GGMLQuantizationType.F32, routers_host.shape,
                                     f"blk.{il}.ffn_gate_inp.weight") for il in range(n_layer)]  # fmt: skip
    device = GpuExperts(layers, dev, routers)
    unit = [device.expert_nbytes(il) for il in range(n_layer)]
    policy = args.policy or DEFAULT_POLICY
    cache = make_cache(n_expert, [layer.expert_nbytes for layer in layers], int(DEVICE_SHARE * store_bytes),
                        int(HOST_SHARE * store_bytes), make_policy(policy), make_policy(policy), device_expert_bytes=unit)  # fmt: skip
    source = NullStore(layers)
    streamer = ExpertStreamer(source, cache, k, download=device.download if policy_demotes(policy) else None,
                              buffers=device.host_buffer, read_ahead_pays=device.read_ahead_pays,
                              plans_beside=device.plans_beside)  # as the engine builds it (fomoepy.engine)
    # the host tier's pinned read buffers taken ahead, as the engine does (fomoepy.engine)
    device.reserve_reads(reserve_bytes(int(HOST_SHARE * store_bytes), [source.slot_nbytes(il) for il in range(n_layer)]))
    step = MoEStep(streamer, device)

    n_tokens = args.warm + args.tokens
    routing = TraceRouting(dev, n_layer, n_expert, k, n_tokens, layers[0].expert_nbytes)

    calls = {"n": 0, "s": 0.0, "pack": 0.0, "wait": 0.0, "launched_n": 0, "launched_s": 0.0}
    by_name: dict[str, list] = {}  # driver function -> [calls, seconds], over the instrumented run
    real_call = DriverShim.call
    real_pack = GpuExperts._pack

    def timed_pack(view, layout, parts):  # the host memcpy of a copied expert into pinned staging
        t = time.perf_counter()
        try:
            real_pack(view, layout, parts)
        finally:
            calls["pack"] += time.perf_counter() - t

    def counted_as(name: str, dt: float, n: int = 1) -> None:
        calls["s"] += dt
        calls["n"] += n
        if "Synchronize" in name:  # the host waiting for the device: on a real one, not host work
            calls["wait"] += dt
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += n
        entry[1] += dt

    def counted(self, name, *a):
        t = time.perf_counter()
        try:
            return real_call(self, name, *a)
        finally:
            counted_as(name, time.perf_counter() - t)

    # the calls made through the binding's C functions (fomoepy/runtime/_driver_calls.c), counted the same
    real_direct = None if args.python_calls else dev.rt.direct
    dev.rt.direct = real_direct
    counted_direct = None if real_direct is None else CountedDirect(real_direct, dev.rt.names, counted_as)

    h = dev.upload(np.zeros((1, shape.n_embd), np.float32))

    def launched() -> tuple[int, float]:
        """The compiled launchers' timed launches so far (they time their own driver calls): count, seconds."""
        fast = dev._compiled.values()
        return sum(f.count for f in fast), sum(f.seconds for f in fast)

    made_so_far: dict[str, tuple[int, float]] = {}

    def count_made() -> None:
        """The calls the compiled steps made themselves since the last count (the decode tables' copy, the
        routing's read-back and wait: fomoepy/runtime/_driver_calls.c), counted as the shim's are."""
        for call, (n_made, s_made) in real_direct.made_calls().items():
            n_was, s_was = made_so_far.get(call, (0, 0.0))
            made_so_far[call] = (n_made, s_made)
            if n_made > n_was:
                counted_as(getattr(dev.rt.names, DIRECT_CALLS[call]), s_made - s_was, n_made - n_was)

    def run(tokens: range, instrumented: bool) -> list[tuple]:
        samples = []
        DriverShim.call = counted if instrumented else real_call  # type: ignore[method-assign]
        dev.rt.direct = counted_direct if instrumented else real_direct
        for fast in dev._compiled.values():
            fast.timed = instrumented
        if real_direct is not None:
            real_direct.timed = instrumented
        GpuExperts._pack = staticmethod(timed_pack) if instrumented else staticmethod(real_pack)  # type: ignore[method-assign]
        try:
            for t in tokens:
                step.begin_step(Phase.DECODE)
                for il in range(n_layer):
                    routing.queue(t, il)
                    c0, s0, p0, w0 = calls["n"], calls["s"], calls["pack"], calls["wait"]
                    cpu0 = time.thread_time()
                    t0 = time.perf_counter()
                    exact = step.route(dev, il, h, routers[il], "softmax", k)  # the model's router, as moe.py runs it
                    t1 = time.perf_counter()
                    step(il, h, exact)
                    t2 = time.perf_counter()
                    cpu = time.thread_time() - cpu0
                    if instrumented:  # the compiled launchers' driver calls, counted as the shim's are
                        n0, s0_ = launched()
                        calls["n"] += n0 - calls["launched_n"]
                        calls["s"] += s0_ - calls["launched_s"]
                        calls["launched_n"], calls["launched_s"] = n0, s0_
                        if real_direct is not None:
                            count_made()
                    rec = step.records[-1] if step.records else None
                    samples.append((t2 - t0, t1 - t0, rec, calls["n"] - c0, calls["s"] - s0, calls["pack"] - p0, cpu, calls["wait"] - w0))
                step.end_step(1)
        finally:
            DriverShim.call = real_call  # type: ignore[method-assign]
            dev.rt.direct = real_direct
            GpuExperts._pack = staticmethod(real_pack)  # type: ignore[method-assign]
            for fast in dev._compiled.values():
                fast.timed = False
            if real_direct is not None:
                real_direct.timed = False
        return samples

    run(range(args.warm), False)
    plain = run(range(args.warm, n_tokens), False)
    step.records = []
    reads, uploads = source.reads, device.uploads
    split = run(range(args.warm, n_tokens), True)
    reads, uploads = source.reads - reads, device.uploads - uploads
    n_launched, s_launched = launched()
    if n_launched:  # the compiled launchers' launches, under the driver function's name
        entry = by_name.setdefault(dev.rt.names.launch, [0, 0.0])
        entry[0] += n_launched
        entry[1] += s_launched
    totals = [s[0] * 1e6 for s in plain]
    median, p90 = percentiles(totals)
    # the inference thread's CPU time: the host's own work, without the waits for a core that a busy
    # machine adds to wall time (in null mode nothing else works for a step)
    cpu_median, cpu_p90 = percentiles([s[6] * 1e6 for s in plain])
    n = len(split)
    route_us = float(np.median([(s[1] + s[2].route) * 1e6 for s in split]))
    # the part in series with the step's reads: from the router's launch until they were issued, and from
    # the last one's landing to the step's return (the rest, copies and launches, runs while they are read;
    # fomoe plan's engine schedule overlaps it with them: `[host] serial`)
    serial_us = float(np.median([(s[1] + s[2].before_reads + s[2].after_landed) * 1e6 for s in split]))
    # of it, the part before the reads are issued (the next layer's guesses go to the drives after them:
    # `[host] before_reads`)
    before_us = float(np.median([(s[1] + s[2].before_reads) * 1e6 for s in split]))
    # from the router's launch to the step's first launch: the device computes the experts it holds from
    # then on (`[host] before_launch`)
    launch_us = float(np.median([(s[1] + s[2].before_launch) * 1e6 for s in split]))
    # to the step's device part after its plan: its copies up start then (`[host] before_copies`)
    copies_us = float(np.median([(s[1] + s[2].route + s[2].plan) * 1e6 for s in split]))
    plan_us = float(np.median([(s[2].plan + s[2].wait) * 1e6 for s in split]))
    binding_us = float(np.median([s[4] * 1e6 for s in split]))
    calls_per_step = float(np.median([s[3] for s in split]))
    pack_us = float(np.mean([s[5] * 1e6 for s in split]))
    # the step less its waits for the device (event and stream synchronisations): on a real device the
    # host's own time; on the null stand-in the waits cost a call each
    unwaited = [(s[0] - s[7]) * 1e6 for s in split]
    unwaited_median, unwaited_p90 = percentiles(unwaited)
    calls_by_name = {name: {"per_step": c / n, "mean_us": sec / c * 1e6}
                     for name, (c, sec) in sorted(by_name.items(), key=lambda kv: -kv[1][1])}  # fmt: skip
    total_split = float(np.median([s[0] * 1e6 for s in split]))
    stats = cache.stats.summary()
    return {
        "shape": SHAPE, "median_us": median, "p90_us": p90, "cpu_median_us": cpu_median, "cpu_p90_us": cpu_p90,
        "steps": len(totals), "vendor": args.vendor, "policy": policy,
        "device": device_name,
        "serial_median_us": serial_us,
        "before_reads_median_us": before_us,
        "before_launch_median_us": launch_us,
        "before_copies_median_us": copies_us,
        "split_median_us": {"total (instrumented)": total_split, "routing": route_us, "plan": plan_us,
                            "binding calls": binding_us, "calls per step": calls_per_step,
                            "staging copies (mean)": pack_us},
        "tiers": {"device_hit": stats["device"]["hit_rate"], "host_hit": stats["host"]["hit_rate"]},
        "less_waits_median_us": unwaited_median, "less_waits_p90_us": unwaited_p90,
        "waits_median_us": float(np.median([s[7] * 1e6 for s in split])), "calls_by_name": calls_by_name,
        "reads_per_step": reads / n, "uploads_per_step": uploads / n, "direct_uploads": device.direct_uploads,
        "calls_through": "python" if real_direct is None else "c",
    }  # fmt: skip


class CountedDirect:
    """A shim's direct calls (the binding's C functions), each timed and counted under the driver
    function's name, as bench/host_time.py counts the calls made through the binding's Python ones."""

    def __init__(self, real, names, counted_as):
        from fomoepy.runtime.shim import DIRECT_CALLS

        for method, api in DIRECT_CALLS.items():
            setattr(self, method, self._timed(getattr(real, method), getattr(names, api), counted_as))

    @staticmethod
    def _timed(fn, name, counted_as):
        def call(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                counted_as(name, time.perf_counter() - t)

        return call


def gpu_path(args: argparse.Namespace, python_calls: bool = False) -> dict:
    """Runs gpu_child in a process whose loader finds the stand-in driver (LD_LIBRARY_PATH is read at start);
    python_calls: every driver call through the binding's Python functions, none through its C ones."""
    from standin import standin_env

    env = standin_env("bench/host_time.py", args.vendor, "null", 64 << 30)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-gpu", "--vendor", args.vendor,
           "--tokens", str(args.tokens), "--warm", str(args.warm)] + (["--policy", args.policy] if args.policy else [])  # fmt: skip
    if python_calls:
        cmd.append("--python-calls")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"bench/host_time.py: the GPU path failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the cpu backend on the bench model ------------------------------------------------------------------
def cpu_path(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(HERE))
    from decode import ensure_model

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.runtime import ggml_buffers
    from fomoepy.timing import MATMUL

    model, store = ensure_model("bench")
    probe = Engine(model, EngineOptions(backend="cpu", store=(str(store),), vram_cache=0, ram_cache=0))
    host_all = sum(layer.expert_nbytes for layer in probe.source.layers) * probe.spec.moe.n_expert
    probe.close()
    engine = Engine(model, EngineOptions(backend="cpu", threads=args.threads, store=(str(store),), vram_cache=0,
                                         ram_cache=int(0.25 * host_all)))  # fmt: skip
    step = engine.experts
    products: list[float] = []
    repacks: list[float] = []
    repack = [0.0]
    real_set = ggml_buffers.set_tensor

    def set_tensor(*a):  # a miss set into its slot (ggml repacks it there if the slots are repacked), the cpu's "copy up"
        t = time.perf_counter()
        try:
            return real_set(*a)
        finally:
            repack[0] += time.perf_counter() - t

    step_class = type(step)
    real_call = step_class.__call__

    def call(self, *a):  # ggml's products and slot fills inside the step (the device's, and the next layer's
        # router product that predicts its experts): arithmetic and making ready, not host time
        before, filled = MATMUL.seconds, repack[0]
        try:
            return real_call(self, *a)
        finally:
            products.append(MATMUL.seconds - before)
            repacks.append(repack[0] - filled)

    step_class.__call__ = call  # type: ignore[method-assign]
    ggml_buffers.set_tensor = set_tensor
    state = engine.new_state()
    token = int(np.argmax(engine.eval(state, [1, 2, 3, 4])[-1]))
    for _ in range(args.cpu_warm):
        token = int(np.argmax(engine.decode_token(state, token)))
    step.records, products[:], repacks[:] = [], [], []
    for _ in range(args.cpu_tokens):
        token = int(np.argmax(engine.decode_token(state, token)))
    ggml_buffers.set_tensor = real_set
    step_class.__call__ = real_call  # type: ignore[method-assign]
    host = [(r.total - r.wait - p - f) * 1e6 for r, p, f in zip(step.records, products, repacks)]
    median, p90 = percentiles(host)
    rec = step.records
    stats = engine.experts.streamer.cache.stats.summary()
    engine.close()
    return {
        "shape": "bench (8 layers x 64 experts, top-8, Q4_K/Q6_K)", "median_us": median, "p90_us": p90, "steps": len(host),
        "split_median_us": {"routing": float(np.median([r.route * 1e6 for r in rec])),
                            "plan": float(np.median([r.plan * 1e6 for r in rec])),
                            "products": float(np.median([p * 1e6 for p in products])),
                            "slot fills": float(np.median([f * 1e6 for f in repacks])),
                            "wait": float(np.median([r.wait * 1e6 for r in rec]))},
        "tiers": {"host_hit": stats["host"]["hit_rate"], "device_hit": stats["device"]["hit_rate"]},
    }  # fmt: skip


def fastest_of(result: dict) -> str:
    """' (the fastest of n runs: their medians)' where the result is the fastest of several runs."""
    runs = result.get("run_medians_us")
    return f" (the fastest of {len(runs)} runs: {', '.join(f'{m:.1f}' for m in runs)})" if runs and len(runs) > 1 else ""


def gpu_cells(gpu: dict, driver: str) -> str:
    """The GPU path's row up to its split: the path, the shape, median and p90 (wall and CPU), steps."""
    of = fastest_of(gpu)
    return (f"| GPU, {gpu['vendor']} {driver}, {gpu['policy']} | {gpu['shape']} | {gpu['median_us']:.1f} wall{of}, "
            f"{gpu['cpu_median_us']:.1f} CPU | {gpu['p90_us']:.1f} wall, {gpu['cpu_p90_us']:.1f} CPU | {gpu['steps']} | ")  # fmt: skip


def gpu_split(gpu: dict) -> str:
    """The GPU path's split: its parts in series with the reads, routing, plan, binding calls and the rest."""
    g = gpu["split_median_us"]
    rest = g["total (instrumented)"] - g["routing"] - g["plan"] - g["binding calls"]
    return (f"in series with the reads {gpu['serial_median_us']:.1f} (before they are issued {gpu['before_reads_median_us']:.1f}); "
            f"before the first launch {gpu['before_launch_median_us']:.1f}, before the copies up {gpu['before_copies_median_us']:.1f}; routing {g['routing']:.1f}, plan {g['plan']:.1f}, binding calls {g['binding calls']:.1f} ({g['calls per step']:.0f} calls), "
            f"staging copies {g['staging copies (mean)']:.1f} (mean), rest {rest:.1f} (instrumented total {g['total (instrumented)']:.1f}); "
            f"device hits {gpu['tiers']['device_hit']:.1%}, host {gpu['tiers']['host_hit']:.1%}")  # fmt: skip


def report(gpu: dict, cpu: dict, args: argparse.Namespace, gpu_python: dict) -> str:
    from results import processor

    c = cpu["split_median_us"]
    lines = [
        f"### host_time — {date.today()} — {processor()}, {os.cpu_count()} cores",  # (its figures hold for this processor)
        "",
        f"`python bench/host_time.py --tokens {args.tokens} --warm {args.warm} --repeats {args.repeats}`: µs of host time per MoE layer step",
        "",
        "| path | shape | median µs | p90 µs | steps | split (medians, µs) |",
        "|---|---|---|---|---|---|",
        gpu_cells(gpu, "binding (its C functions) over the null stand-in") + gpu_split(gpu) + " |",
        gpu_cells(gpu_python, "binding (its Python functions) over the null stand-in") + gpu_split(gpu_python) + " |",
        f"| cpu backend, tier 25 % | {cpu['shape']} | {cpu['median_us']:.1f}{fastest_of(cpu)} | {cpu['p90_us']:.1f} | {cpu['steps']} | "
        f"routing {c['routing']:.1f}, plan {c['plan']:.1f}; not host: ggml products {c['products']:.1f}, slot fills "
        f"(setting misses into slots) {c['slot fills']:.1f}, reads {c['wait']:.1f}; tier hits {cpu['tiers']['device_hit']:.1%} |",
    ]
    return "\n".join(lines) + "\n"


def report_real(gpu: dict, args: argparse.Namespace) -> str:
    """The GPU path on a real device: wall time includes the waits for the device at each read-back;
    the thread's CPU time is the host's own work (a spinning wait counts in it too)."""
    from results import processor

    g = gpu["split_median_us"]
    lines = [
        f"### host_time on a real GPU — {date.today()} — {gpu['device']}, host {processor()}, "
        f"{os.cpu_count()} cores",
        "",
        f"`python bench/host_time.py --real-gpu --vendor {gpu['vendor']} --tokens {args.tokens} --warm {args.warm} --record`: "
        "µs per MoE layer step, the null store's reads (no disk), the device's work and the driver real; beside it the same trace and tiers over the null stand-in on the same host, in the same run",
        "",
        "| path | shape | median µs | p90 µs | steps | split (medians, µs) |",
        "|---|---|---|---|---|---|",
        gpu_cells(gpu, "binding, real driver") + f"less the waits for the device (instrumented) {gpu['less_waits_median_us']:.1f} median, {gpu['less_waits_p90_us']:.1f} p90 "
        f"(waits {gpu['waits_median_us']:.1f}); "
        f"in series with the reads {gpu['serial_median_us']:.1f} (before they are issued {gpu['before_reads_median_us']:.1f}); "
        f"before the first launch {gpu['before_launch_median_us']:.1f}, before the copies up {gpu['before_copies_median_us']:.1f}; routing {g['routing']:.1f}, plan {g['plan']:.1f}, binding calls {g['binding calls']:.1f} "
        f"({g['calls per step']:.0f} calls), staging copies {g['staging copies (mean)']:.1f} (mean); "
        f"uploads {gpu['uploads_per_step']:.2f} a step ({gpu['direct_uploads']} direct from pinned reads); "
        f"device hits {gpu['tiers']['device_hit']:.1%}, host {gpu['tiers']['host_hit']:.1%} |",
        "",
        "| driver call | per step | mean µs |",
        "|---|---|---|",
        *(f"| {name} | {c['per_step']:.2f} | {c['mean_us']:.1f} |" for name, c in gpu["calls_by_name"].items()),
    ]
    null = gpu.get("null_same_host")
    if isinstance(null, dict):
        lines[7:7] = [gpu_cells(null, "binding (its C functions) over the null stand-in, same host, same run") + gpu_split(null) + " |"]
    elif null:
        lines += ["", f"The null stand-in beside it on this host did not run: {null}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object: {gpu: {...}, cpu: {...}}")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    ap.add_argument("--vendor", default="hip", choices=["hip", "cuda"], help="the binding the GPU path runs through")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens measured on the GPU path (x 60 layers)")
    ap.add_argument("--warm", type=int, default=32, help="tokens decoded first, to fill the tiers")
    ap.add_argument("--cpu-tokens", type=int, default=48)
    ap.add_argument("--cpu-warm", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="ggml threads on the cpu path")
    ap.add_argument("--policy", default=None, help="cache policy (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each GPU kind and of the cpu path; the fastest of each is reported")
    ap.add_argument("--real-gpu", action="store_true",
                    help="the GPU path on this machine's real GPU and driver (--vendor's), not the null stand-in: "
                         "the step's wall time then includes waiting for the device at each read-back")  # fmt: skip
    ap.add_argument("--python-calls", action="store_true", help=argparse.SUPPRESS)  # (the child's comparison row)
    ap.add_argument("--child-gpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_gpu or args.real_gpu:
        result = gpu_child(args)
        if args.real_gpu:
            result["driver"] = "real"
            # the same trace and tiers over the null stand-in, on this host, in this run: what the real
            # driver and device add to the step, apart from the host's own speed
            try:
                result["null_same_host"] = gpu_path(args)
            except (SystemExit, OSError, subprocess.SubprocessError) as e:
                result["null_same_host"] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        print(json.dumps(result))
        if args.real_gpu and args.record:
            from results import record

            record(report_real(result, args))
        return 0
    # each GPU run repeated, the two kinds taking turns, and the fastest kept (as bench/policy_cost.py
    # does): on a shared machine a run's median moves 10-20 % with its neighbours' load, never below
    # what the code costs
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for python_calls in (False, True):  # with every driver call through the binding's Python functions: what the C ones save
            runs[python_calls].append(gpu_path(args, python_calls=python_calls))
    gpu, gpu_python = (min(runs[k], key=lambda r: r["median_us"]) for k in (False, True))
    for result, kind in ((gpu, False), (gpu_python, True)):
        result["run_medians_us"] = [r["median_us"] for r in runs[kind]]
    cpu_runs = [cpu_path(args) for _ in range(args.repeats)]
    cpu = min(cpu_runs, key=lambda r: r["median_us"])
    cpu["run_medians_us"] = [r["median_us"] for r in cpu_runs]
    if args.json:
        print(json.dumps({"gpu": gpu, "cpu": cpu, "gpu_python_calls": gpu_python}))
    else:
        print(report(gpu, cpu, args, gpu_python))
    if args.record:
        from results import record

        record(report(gpu, cpu, args, gpu_python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
