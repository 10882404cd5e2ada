"""GPU kernel bandwidth: the routed-expert FFN of one decoded token (and a dense matvec) per weight type,
as achieved GB/s and as a share of the device's measured copy bandwidth.

A decode step is memory-bound: the expert kernels should stream weight bytes at close to the rate
the device copies memory. Shapes are Qwen3.5-397B's (n_embd 4096, expert_ff 1024, top-10 experts;
a 4096 x 16384 dense matrix); weights are random bytes of each format (speed does not depend on values).

    python bench/gpu_kernels.py [--vendor auto|cuda|hip] [--reps 50] [--record]

Needs a GPU: without one it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date

import numpy as np
from results import RESULTS, publish

from fomoepy import quants
from fomoepy.errors import FomoeError
from fomoepy.experts.source import ExpertMatrix, LayerExperts
from fomoepy.runtime import kernels
from fomoepy.runtime.backends import open_gpu
from fomoepy.runtime.gpu_experts import SlotLayout
from fomoepy.runtime.moe_tables import EXPERT_WORK_DTYPE, PAIR_DTYPE

D, F, K_USED, DENSE_ROWS = 4096, 1024, 10, 16384


def timed(dev, reps: int, launch) -> float:
    """Seconds per call of `launch`, from device events around `reps` calls (after one warm-up)."""
    rt = dev.rt
    launch()
    start, end = rt.event(timing=True), rt.event(timing=True)
    rt.record(start, dev.stream)
    for _ in range(reps):
        launch()
    rt.record(end, dev.stream)
    rt.event_sync(end)
    return rt.elapsed_ms(start, end) / 1e3 / reps


def copy_bandwidth(dev, reps: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    free, _ = dev.rt.mem_info()
    nbytes = min(1 << 30, free // 4) // 4 * 4
    src, dst = dev.zeros((nbytes // 4,)), dev.zeros((nbytes // 4,))
    seconds = timed(dev, reps, lambda: dev.rt.dtod(dst.ptr, src.ptr, nbytes, dev.stream))
    return 2 * nbytes / seconds


def random_bytes(rng, qtype, shape) -> np.ndarray:
    return rng.integers(0, 256, quants.nbytes_for(qtype, shape), dtype=np.uint8)


def expert_bandwidth(dev, qtype, reps: int, rng) -> float:
    parts = tuple(
        ExpertMatrix(name, qtype, shape, quants.nbytes_for(qtype, shape), 0)
        for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))
    )
    layout = SlotLayout.of(LayerExperts(0, parts))  # type: ignore[arg-type]
    slots = []
    for _ in range(K_USED):
        host = np.zeros(layout.nbytes, np.uint8)
        for offset, p in zip(layout.offsets, parts):
            host[offset : offset + p.nbytes] = random_bytes(rng, qtype, p.shape)
        slots.append(dev.upload(host, exact=True))
    work = np.zeros(K_USED, EXPERT_WORK_DTYPE)
    pairs = np.zeros(K_USED, PAIR_DTYPE)
    for j, s in enumerate(slots):
        work[j] = (s.ptr + layout.offsets[0], s.ptr + layout.offsets[1], s.ptr + layout.offsets[2], 1, 0, [j] + [0] * 7)
        pairs[j] = (s.ptr + layout.offsets[2], 1.0 / K_USED, 0)
    work_d, pairs_d = dev.upload(work.view(np.uint8), exact=True), dev.upload(pairs.view(np.uint8), exact=True)
    x, act, out = dev.upload(rng.standard_normal((1, D)).astype(np.float32)), dev.empty((K_USED, F)), dev.empty((1, D))
    gate_up = kernels.kernel_name("moe_gate_up", qtype) + "_t1"
    down = kernels.kernel_name("moe_down_sum", qtype)
    gu_rb, d_rb = parts[0].nbytes // F, parts[2].nbytes // D

    def step():
        dev.launch(gate_up, (F // 4, K_USED), 128, work_d.ptr, x.ptr, D, F, K_USED, gu_rb, act.ptr)
        dev.launch(down, (D // 4, 1), 128, pairs_d.ptr, act.ptr, D, F, K_USED, d_rb, out.ptr)

    seconds = timed(dev, reps, step)
    dev.synchronize()
    return K_USED * sum(p.nbytes for p in parts) / seconds


def dense_bandwidth(dev, qtype, reps: int, rng) -> float:
    W = dev.weight_from_bytes(random_bytes(rng, qtype, (DENSE_ROWS, D)), qtype, (DENSE_ROWS, D))
    x = dev.upload(rng.standard_normal((1, D)).astype(np.float32))
    seconds = timed(dev, reps, lambda: dev.linear(x, W))
    return W.nbytes / seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vendor", default="auto", choices=["auto", "cuda", "hip"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--record", action="store_true", help=f"append the table to {RESULTS}")
    args = ap.parse_args(argv)
    try:
        dev = open_gpu(args.vendor)
    except FomoeError as e:
        print(f"bench/gpu_kernels.py needs a GPU: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    copy = copy_bandwidth(dev, 10)
    lines = [
        f"### gpu_kernels — {date.today()} — {dev.rt.device_name} ({dev.rt.vendor}, {dev.rt.arch})",
        "",
        (
            f"`python bench/gpu_kernels.py --vendor {args.vendor} --reps {args.reps}`; device copy bandwidth (read + write) "
            f"{copy / 1e9:.0f} GB/s; experts: one decoded token, top-{K_USED} of n_embd {D} x expert_ff {F} "
            f"(gate+up+SwiGLU launch, then down + weighted sum); dense: {DENSE_ROWS} x {D} matvec"
        ),
        "",
        "| type | experts GB/s | experts / copy | dense GB/s | dense / copy |",
        "|---|---|---|---|---|",
    ]
    for qtype in kernels.KERNEL_TYPE_NAMES:
        e = expert_bandwidth(dev, qtype, args.reps, rng)
        d = dense_bandwidth(dev, qtype, args.reps, rng)
        lines.append(f"| {qtype.name} | {e / 1e9:.0f} | {e / copy:.2f} | {d / 1e9:.0f} | {d / copy:.2f} |")
        print(lines[-1], flush=True)
    # (stamped with the host's processor and load, and appended with --record, as every bench's report)
    return publish("\n".join(lines) + "\n", args.record)


if __name__ == "__main__":
    sys.exit(main())
