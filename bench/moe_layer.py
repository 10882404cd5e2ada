"""One MoE layer's routed experts on the ggml CPU backend: the per-expert graph of the earlier path
(ggml_experts.per_expert_ffn: gate, up, down of each picked expert as separate products in one graph) against one
`mul_mat_id` product over the layer's slots (fomoepy.runtime.ggml_slots.SlotLayer), plain and repacked,
and, for many tokens, one product per used slot over either (SlotLayer.ffn_grouped).

Shapes of the bench model (bench/cpu_decode.py): n_embd 1024, expert_ff 512, 64 experts top-8, gate/up
Q4_K, down Q6_K; random weights and routing (each token's 8 experts distinct, in ascending id). All
64 experts are at hand (every slot set), so this times the product alone, no reads; and, apart, the
time to set one expert's bytes into a slot (what a miss read into its slot costs beyond the read). The variants run
interleaved, `--repeats` rounds of `--calls` calls each; the table gives the median µs per layer call.

    python bench/moe_layer.py [--threads N] [--tokens 1,128] [--repeats 5] [--calls 40] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import date
from types import SimpleNamespace

import numpy as np
from results import record

from fomoepy import quants
from fomoepy.runtime.ggml_experts import per_expert_ffn
from fomoepy.runtime.ggml_slots import SlotLayer

K, F, N_EXPERT, TOP_K = 1024, 512, 64, 8
PARTS = [(12, (F, K)), (12, (F, K)), (14, (K, F))]  # gate, up Q4_K [F, K]; down Q6_K [K, F]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", default="1,128", help="token counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    raw = {e: [quants.quantize(rng.standard_normal(s).astype(np.float32), q).reshape(-1) for q, s in PARTS] for e in range(N_EXPERT)}
    parts = [SimpleNamespace(qtype=q, shape=s) for q, s in PARTS]
    layers = {}
    for name, repack in (("mul_mat_id, plain", False), ("mul_mat_id, repacked", True)):
        layer = SlotLayer(PARTS, N_EXPERT, repack=repack)
        for e in range(N_EXPERT):
            layer.set_slot(e, raw[e])  # slot e holds expert e
        layers[name] = layer

    def variants(T, h, ids, w):
        yield "per-expert graphs (earlier path)", lambda: per_expert_ffn(parts, h, ids, w, raw, args.threads)
        for name, layer in layers.items():
            yield name, lambda layer=layer: layer.ffn(h, ids, w, args.threads)
        if T > 1:  # each slot's tokens as the rows of one product (GEMM kernels)
            yield "per-slot products, plain", lambda: layers["mul_mat_id, plain"].ffn_grouped(h, ids, w, args.threads)
            yield "per-slot products, repacked", lambda: layers["mul_mat_id, repacked"].ffn_grouped(h, ids, w, args.threads)

    admit = {name: [] for name in layers}  # seconds to set one expert's bytes into a slot (a miss's copy)
    for _ in range(args.repeats):
        for name, layer in layers.items():
            t = time.perf_counter()
            for e in range(N_EXPERT):
                layer.set_slot(e, raw[e])
            admit[name].append((time.perf_counter() - t) / N_EXPERT)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        h = rng.standard_normal((T, K)).astype(np.float32)
        ids = np.stack([np.sort(rng.choice(N_EXPERT, TOP_K, replace=False)) for _ in range(T)])
        w = rng.random((T, TOP_K)).astype(np.float32)
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for name, call in variants(T, h, ids, w):
                call()  # warm: graphs built, caches filled
                t = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times.setdefault(name, []).append((time.perf_counter() - t) / args.calls)
        base = statistics.median(times["per-expert graphs (earlier path)"])
        expert_bytes = sum(quants_nbytes(q, s) for q, s in PARTS)
        touched = len(np.unique(ids)) * expert_bytes
        for name, ts in times.items():
            m = statistics.median(ts)
            rows.append(f"| {T} | {name} | {m * 1e6:.0f} | {base / m:.2f}x | {touched / m / 1e9:.1f} |")
    report = (
        f"### moe_layer — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/moe_layer.py --threads {args.threads} --tokens {args.tokens} --repeats {args.repeats} "
        f"--calls {args.calls}`; one layer of the bench model (64 experts top-8, Q4_K/Q6_K), every expert at hand, "
        f"median of {args.repeats} interleaved rounds\n\n"
        "| tokens | routed experts as | µs per layer | speed-up | GB/s of expert bytes |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n\nsetting one expert into its slot (a miss's copy into the tier): "
        + ", ".join(f"{name} {statistics.median(ts) * 1e6:.0f} µs" for name, ts in admit.items()) + "\n"
    )  # fmt: skip
    print(report)
    if args.record:
        record(report)
    for layer in layers.values():
        layer.close()
    return 0


def quants_nbytes(qtype: int, shape: tuple[int, int]) -> int:
    import ggml

    return ggml.ggml_row_size(qtype, shape[1]) * shape[0]


if __name__ == "__main__":
    sys.exit(main())
