"""Batched decode against llama.cpp's, engine to engine: how much one step over B sequences gains over
B = 1, ours and llama.cpp's on the same GGUF, the same threads, in the same run.

bench/batch.py measures the daemon (its sockets, its scheduling, a client per request); this one
takes the daemon out, so the ratio it prints is the engines' own: fomoepy's `Engine.decode` over B
generations (the cpu backend, every expert in its tier) and llama.cpp's `llama_decode` over a batch
holding one token of each of B sequences (llama-cpp-python's C API, as llama.cpp's server batches its
slots). Each sequence has its own random prompt, prefilled first (not timed); then `--decode` greedy
steps are timed. Per B it prints the aggregate decode tok/s (B x steps / seconds) of each engine,
its ratio to its own B = 1, and whether each sequence's greedy tokens in the batch equal its tokens
decoded alone (ours: must; llama.cpp: its batched kernels may round otherwise).

    python bench/batch_decode.py [--batches 1,2,4,8] [--prompt 32] [--decode 48] [--threads N] [--rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import date

import llama_peer
import numpy as np
from cpu_decode import ensure_model
from results import load_line, processor, publish

from fomoepy.engine import Engine, EngineOptions
from fomoepy.sampling import SamplingParams


def ours(engine: Engine, prompts: list[np.ndarray], n_decode: int) -> tuple[float, list[list[int]]]:
    """Aggregate decode tok/s of one batched step per token over the prompts' generations, and each
    generation's tokens (the first, sampled after its prompt, included: llama.cpp's are counted so too)."""
    gens = [engine.start(p, n_decode + 1, SamplingParams.greedy(), stop_at_eog=False) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for g, out in zip(gens, tokens):
        first = None
        while g.pending:
            first = engine.prefill(g)
        out.append(first)
    t0 = time.perf_counter()
    for _ in range(n_decode):
        for out, token in zip(tokens, engine.decode(gens)):
            out.append(token)
    seconds = time.perf_counter() - t0
    return len(prompts) * n_decode / seconds, [out[:n_decode] for out in tokens]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8", help="sequences per step, comma-separated (1 is always run)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--decode", type=int, default=48, help="timed decode steps")
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: all cores)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of each engine per batch size (medians reported)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    sizes = sorted({1, *(int(b) for b in args.batches.split(","))})
    threads = args.threads or os.cpu_count() or 1
    path = ensure_model()
    engine = Engine(path, EngineOptions(backend="cpu", threads=threads))
    if not engine.batches:
        raise SystemExit("bench/batch_decode.py: this engine does not batch decode steps")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.spec.n_vocab - 3, size=args.prompt) for _ in range(max(sizes))]
    alone_ours = [ours(engine, [p], args.decode)[1][0] for p in prompts]  # each sequence decoded alone
    alone_peer = [llama_peer.run_batched(path, [p], args.decode, threads) for p in prompts]
    alone_peer = [r["tokens"][0] if isinstance(r, dict) else None for r in alone_peer]
    rows, base = [], {}
    for b in sizes:
        mine, peer, same_ours, same_peer = [], [], True, True
        for _ in range(args.rounds):  # the engines take turns: load from other work falls on both alike
            rate, toks = ours(engine, prompts[:b], args.decode)
            mine.append(rate)
            same_ours &= toks == alone_ours[:b]
            result = llama_peer.run_batched(path, prompts[:b], args.decode, threads)
            if isinstance(result, str):
                peer.append(result)
                continue
            peer.append(result["decode"])
            same_peer &= result["tokens"] == alone_peer[:b]
        ours_rate = float(np.median(mine))
        failed = [p for p in peer if isinstance(p, str)]
        peer_rate = None if failed else float(np.median(peer))
        base.setdefault("ours", ours_rate)
        if peer_rate is not None:
            base.setdefault("peer", peer_rate)
        peer_cells = (f"{failed[0]} | | " if failed else f"{peer_rate:.1f} | {peer_rate / base['peer']:.2f}x | "
                      f"{'yes' if same_peer else 'no'}")  # fmt: skip
        rows.append(f"| {b} | {ours_rate:.1f} | {ours_rate / base['ours']:.2f}x | {'yes' if same_ours else 'no'} | {peer_cells} |")
    engine.close()
    one, five, _ = os.getloadavg()
    report = (
        f"### batch_decode — {date.today()} — {processor()}, {os.cpu_count()} cores — {load_line()}, "
        f"{one:.2f} (1 min) / {five:.2f} (5 min) at the end\n\n"
        f"`python bench/batch_decode.py --batches {','.join(map(str, sizes))} --prompt {args.prompt} --decode {args.decode} "
        f"--threads {threads} --rounds {args.rounds}`; bench model (bench/cpu_decode.py's), cpu backend with every expert "
        "in its tier, llama.cpp on the same file; aggregate decode tok/s (sequences x steps / seconds), medians of the rounds\n\n"
        "| sequences per step | fomoepy tok/s | vs B = 1 | each as alone | llama.cpp tok/s | vs B = 1 | each as alone |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
