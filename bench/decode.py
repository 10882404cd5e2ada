"""Decode speed against the bandwidth bound, with the expert tiers capped.

Builds (or reuses) a synthetic qwen3moe model — `--shape qwen3-30b-a3b` is the real shape of
Qwen3-30B-A3B at Q4_K_M (48 layers, 128 experts top-8, n_embd 2048, expert_ff 768; ≈ 17 GB, for a
GPU machine), `--shape bench` the 0.6 GB model of bench/cpu_decode.py — prepares its expert store
on local disk, and decodes with the device tier capped to `--vram-frac` of all experts and the host
tier to `--ram-frac`. It prints tok/s, per-tier hit rates, bytes moved per tier per token, and

    bound = resident time per token + Σ_tier bytes(tier) / bandwidth(tier)

where resident time is measured with every expert already in the device tier, and each tier's
bandwidth is measured in the same run (disk: O_DIRECT reads of the store's records, as the engine reads them; host → device:
on the CPU backend, dequantising store bytes into compute-ready form; on a GPU, H2D copies).
achieved / bound = bound / measured time per token (1.0 = the tiers cost nothing beyond bytes/bandwidth).
llama.cpp's `--n-cpu-moe` on the same GGUF is run when `--llama-bench PATH` points to a llama-bench.

    python bench/decode.py --shape bench --vram-frac 0.25 --ram-frac 0.25 [--backend cpu] [--record]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
from results import processor, publish

from fomoepy.devtools.make_test_model import make_model
from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.profile import ENTRY, FreqProfile, write_freq
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store
from fomoepy.plan.measure import timed_reads

HERE = Path(__file__).parent
SHAPES = {
    "bench": dict(preset="bench-qwen3moe"),
    "qwen3-30b-a3b": dict(
        preset="bench-qwen3moe", n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, expert_ff=768, context_length=4096,
    ),  # fmt: skip
}


def ensure_model(shape: str) -> tuple[Path, Path]:
    model = HERE / "models" / f"decode-{shape}.gguf"
    store = HERE / "models" / f"decode-{shape}.store"
    model.parent.mkdir(parents=True, exist_ok=True)
    if not model.exists():
        t = time.perf_counter()
        make_model(model, **SHAPES[shape])
        print(f"wrote {model} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not (store / "fomoe-store.manifest").exists():
        prepare_store(model, [store], progress=False)
    return model, store


def decode_tokens(engine: Engine, n: int) -> float:
    """Seconds per decoded token after a short prompt (greedy)."""
    state = engine.new_state()
    token = int(np.argmax(engine.eval(state, [1, 2, 3, 4])[-1]))
    t = time.perf_counter()
    for _ in range(n):
        token = int(np.argmax(engine.decode_token(state, token)))
    return (time.perf_counter() - t) / n


def disk_bandwidth(model: Path, store: Path, n: int = 64) -> float:
    rng = np.random.default_rng(1)
    with ExpertStore.open([store], model) as s:
        keys = [(int(rng.integers(len(s.layers))), int(rng.integers(s.manifest.layers[0].n_expert))) for _ in range(n)]
        s.drop_cache()
        nbytes, seconds = timed_reads(s, keys)  # (as the engine reads: several in flight, buffers reused)
    return nbytes / seconds


def host_to_device_bandwidth(engine: Engine, n: int = 16) -> float:
    """Store bytes per second made device-ready (reference backend: dequantised; GPU: copied up from
    pinned memory on the copy stream, as a miss is)."""
    layout = engine.source.layers[0]
    dev = engine.ops
    rt = getattr(dev, "rt", None)
    if rt is None:  # the reference backend: its "copy up" is dequantising into compute-ready arrays
        from fomoepy.runtime.cpu_experts import make_ready

        raw = [engine.source.read(0, e % engine.spec.moe.n_expert) for e in range(n)]
        t = time.perf_counter()
        for r in raw:
            make_ready(layout, r)
        return n * layout.expert_nbytes / (time.perf_counter() - t)
    nbytes = layout.expert_nbytes
    host, device = rt.host_alloc(nbytes * n), rt.malloc(nbytes * n)
    try:
        rt.htod(device, host, nbytes, dev.copy_stream)  # the first copy pays the driver's set-up
        rt.sync(dev.copy_stream)
        t = time.perf_counter()
        for i in range(n):
            rt.htod(device + i * nbytes, host + i * nbytes, nbytes, dev.copy_stream)
        rt.sync(dev.copy_stream)
        return n * nbytes / (time.perf_counter() - t)
    finally:
        rt.free(device)
        rt.host_free(host)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--vram-frac", type=float, default=0.25)
    ap.add_argument("--ram-frac", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-bench", default=None, help="path to llama.cpp's llama-bench for the --n-cpu-moe comparison")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    model, store = ensure_model(args.shape)
    probe = Engine(model, EngineOptions(backend=args.backend, store=(str(store),), vram_cache=0, ram_cache=0))
    layers = probe.source.layers
    n_expert = probe.spec.moe.n_expert
    # the cpu backend (ggml) has one tier, its slot tensors in host memory, sized by --ram-cache: so
    # "resident" is every expert in it, a hit there moves nothing, and no bytes are copied up
    has_device_tier = args.backend != "cpu"
    dev_all = sum(probe.experts.streamer.cache.device_expert_bytes) * n_expert if has_device_tier else 0  # under the run's policy
    host_all = sum(layer.expert_nbytes for layer in layers) * n_expert
    disk_bw = disk_bandwidth(model, store)
    h2d_bw = host_to_device_bandwidth(probe) if has_device_tier else float("inf")
    rt = getattr(probe.ops, "rt", None)
    device = f", {rt.device_name}" if rt is not None else ""
    probe.close()

    # every expert seeded into the device tier at start-up: the resident-compute part of the bound
    every = HERE / "models" / f"decode-{args.shape}.all.freq"
    n = len(layers) * n_expert
    entries = np.zeros(n, dtype=ENTRY)
    entries["layer"] = np.repeat(np.arange(len(layers)), n_expert)
    entries["expert"] = np.tile(np.arange(n_expert), len(layers))
    entries["freq"] = 1.0
    write_freq(every, FreqProfile(len(layers), entries))
    resident = Engine(model, EngineOptions(backend=args.backend, store=(str(store),), vram_cache=dev_all,
                                           ram_cache=0 if has_device_tier else host_all, freq_profile=str(every)))  # fmt: skip
    t_resident = decode_tokens(resident, args.tokens)
    resident.close()

    engine = Engine(
        model,
        EngineOptions(backend=args.backend, store=(str(store),), vram_cache=int(dev_all * args.vram_frac),
                      ram_cache=int(host_all * args.ram_frac), profile_timing=True),
    )  # fmt: skip
    decode_tokens(engine, 8)  # warm the tiers to their steady state
    before = engine.stats()["cache"]
    t_token = decode_tokens(engine, args.tokens)
    after = engine.stats()["cache"]
    per_token = lambda key, tier: (after[tier][key] - before[tier][key]) / args.tokens  # noqa: E731
    host_bytes = per_token("hit_bytes", "host") if has_device_tier else 0.0  # copied up from DRAM
    disk_bytes = (after["disk"]["read_bytes"] - before["disk"]["read_bytes"]) / args.tokens
    bound = t_resident + host_bytes / h2d_bw + disk_bytes / (disk_bw) + disk_bytes / h2d_bw
    timing = engine.timer.report()[-2]  # the mean over all layers
    split = engine.timer.host_line()
    summary = engine.stats_lines()[0]
    engine.close()

    # the exact engine at the same tier fractions, in the same run (its device tier holds float32)
    reference = ""
    if args.backend == "cpu":
        probe = Engine(model, EngineOptions(backend="reference", store=(str(store),), vram_cache=0, ram_cache=0))
        ref_dev_all = sum(probe.experts.streamer.cache.device_expert_bytes) * n_expert
        probe.close()
        ref = Engine(model, EngineOptions(backend="reference", store=(str(store),), vram_cache=int(ref_dev_all * args.vram_frac),
                                          ram_cache=int(host_all * args.ram_frac)))  # fmt: skip
        decode_tokens(ref, 8)
        t_ref = decode_tokens(ref, args.tokens)
        ref.close()
        reference = f"| reference backend, same fractions, same run | {1 / t_ref:.2f} tok/s; cpu / reference = {t_ref / t_token:.1f}x |\n"

    llama = "not run (no --llama-bench given)"
    if args.llama_bench:
        proc = subprocess.run([args.llama_bench, "-m", str(model), "-p", "0", "-n", str(args.tokens), "--n-cpu-moe", "99"],
                              capture_output=True, text=True)  # fmt: skip
        llama = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else f"failed: {proc.stderr.strip()[:200]}"

    report = (
        f"### decode — {date.today()} — {args.backend} backend{device}, host {processor()}, {os.cpu_count()} cores\n\n"
        f"`python bench/decode.py --shape {args.shape} --vram-frac {args.vram_frac} --ram-frac {args.ram_frac} "
        f"--tokens {args.tokens}`\n\n"
        f"| measure | value |\n|---|---|\n"
        f"| decode | {1 / t_token:.2f} tok/s ({t_token * 1e3:.1f} ms/token) |\n"
        f"| all experts resident | {1 / t_resident:.2f} tok/s |\n"
        f"| tiers | {summary} |\n"
        f"| bytes per token | host→device {host_bytes / 1e6:.2f} MB, disk→host {disk_bytes / 1e6:.2f} MB |\n"
        f"| bandwidth (measured) | disk {disk_bw / 1e9:.2f} GB/s, host→device "
        + (f"{h2d_bw / 1e9:.2f} GB/s" if has_device_tier else "none (a miss is set into its slot: host time, not in the bound)") + " |\n"
        f"| bound | {bound * 1e3:.1f} ms/token; achieved / bound = {bound / t_token:.2f} |\n"
        f"| host µs per MoE layer step (total, router, plan, experts, attn+dense) | {timing.split(None, 2)[2]} |\n"
        f"| {split.split(':')[0]} | {split.split(':', 1)[1].strip()} |\n"
        + reference
        + f"| llama.cpp --n-cpu-moe | {llama} |\n"
    )
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
