"""`fomoe ppl` speed: batched prefill (one eval call per chunk) against token-by-token evaluation.

Both rows run the real ppl loop (`PplRun`) on the same backend, model, text and chunks; only `--batch`
differs: B = ctx evaluates each chunk in one call, B = 1 feeds it one token at a time (decode steps).
One chunk is evaluated first, untimed, so both rows find the expert tier warm (`--backend reference`:
compute-ready float32 experts; `cpu`, the default: ggml on the quantized bytes). The PPLs of
the two rows are the same function evaluated two ways: on `reference`, summed in another order (the
logits within float32 rounding); on `cpu` over llama.cpp's ggml (tools/build_ggml.sh), a chunk's
products are ggml's GEMM kernels, which round the activations to Q8 as llama.cpp's prompt products do,
and a token's are its one-row kernels, as llama.cpp's decode steps: the logits differ at that rounding's
level, as llama.cpp's own do (on the bench model, whose random routers have many near ties, about 1 % of
the largest logit at the median, llama.cpp's prefill against its own decode 1.6 %: a comparison run by
hand, not a recorded bench), and so do the PPLs.

Beside them, llama.cpp (llama-cpp-python, the `bench` extra) on the same file and threads in the same
run: the text's first chunk as one batch with the output head on the rows a perplexity scores (from
n_ctx/2 on, as ours; `llama-perplexity` asks for every row's), the same work as our batched pass; then
the chunk as one prompt (the last row's logits only) and as many tokens decoded one at a time. Its
prompt/token ratio is the peer's own gain from many rows over one on this CPU (an upper bound of its
batched perplexity's), against which the batched pass's ratio is to be read.

"in ggml's products" is the share of each row's evaluation time spent inside ggml's graph
computations (fomoepy.timing.MATMUL: every product of the cpu backend, dense and routed); the rest
is host work (Python, numpy attention and glue; all of it on `--backend reference`, whose products
are numpy's). Where both rows are mostly products, their ratio is the kernels' own gain from many
rows over one, whatever the host code does.

The default model is the mid-size qwen3moe of bench/cpu_decode.py (n_embd 1024, 8 layers, 64 experts
top-8, Q4_K/Q6_K experts, ≈ 0.6 GB, written once under bench/models/).

    python bench/ppl_speed.py [--model M.gguf] [--ctx 128] [--chunks 2] [--backend cpu|reference] [--threads N] [--record]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path

import llama_peer
import numpy as np
from cpu_decode import ensure_model
from results import load_line, publish

from fomoepy.engine import Engine, EngineOptions
from fomoepy.eval.ppl_run import PplRequest, PplRun
from fomoepy.timing import MATMUL

HERE = Path(__file__).parent
TEXT = HERE.parent / "tests" / "fixtures" / "oracle" / "ppl.txt"


def timed_ppl(engine: Engine, model: str, text: str, ctx: int, chunks: int, batch: int) -> tuple[float, float, float]:
    """(tokens per second of chunk evaluation, final PPL, share of the evaluation inside ggml's products)
    of one `fomoe ppl` run."""
    req = PplRequest(model=model, text_file=text, n_ctx=ctx, n_batch=batch, max_chunks=chunks)
    run = PplRun(engine, req, out=io.StringIO(), err=io.StringIO())
    products = MATMUL.seconds
    run.run()  # nothing outside the chunks' evaluation runs a ggml graph (the scoring is numpy's)
    products = MATMUL.seconds - products
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", run.out.getvalue())
    assert final is not None
    return run.n_evaluated * ctx / run.eval_seconds, float(final.group(1)), products / run.eval_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the bench-qwen3moe model)")
    ap.add_argument("--text", default=str(TEXT), help="UTF-8 text (default: the oracle's ppl.txt)")
    ap.add_argument("--ctx", type=int, default=128, help="tokens per chunk")
    ap.add_argument("--chunks", type=int, default=2, help="chunks per row")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "reference"), help="CPU engine (default: cpu, ggml)")
    ap.add_argument("--threads", type=int, help="ggml threads (default: the engine's, by the cores found idle)")
    ap.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = ap.parse_args()

    model = Path(args.model) if args.model else ensure_model()
    t = time.perf_counter()
    engine = Engine(model, EngineOptions(n_ctx=args.ctx, backend=args.backend, threads=args.threads))
    load_s = time.perf_counter() - t
    timed_ppl(engine, str(model), args.text, args.ctx, 1, args.ctx)  # warm the compute-ready expert tier
    batched = timed_ppl(engine, str(model), args.text, args.ctx, args.chunks, args.ctx)
    stepped = timed_ppl(engine, str(model), args.text, args.ctx, args.chunks, 1)
    chosen = "" if args.threads else " (the engine's default)"
    rows = [
        f"| batched prefill (`--batch {args.ctx}`) | 1 | {batched[0]:.1f} | {100 * batched[2]:.0f}% | {batched[1]:.4f} |",
        f"| token by token (`--batch 1`) | {args.ctx} | {stepped[0]:.1f} | {100 * stepped[2]:.0f}% | {stepped[1]:.4f} |",
    ]
    # the peer's own gain from many rows over one on this CPU: llama.cpp on the same file and threads, the
    # text's first chunk as one prompt, then as many tokens decoded one at a time
    threads = engine.model.ops.threads
    text = Path(args.text).read_text(encoding="utf-8")
    chunk = np.asarray(engine.tokenizer.encode(text, add_special=False, parse_special=False)[: args.ctx])
    peer = llama_peer.run(model, chunk, args.ctx, threads)
    scored = llama_peer.run_scored(model, chunk, args.ctx // 2, threads)
    if isinstance(peer, str):
        rows.append(f"| llama.cpp | {peer} | | | |")
    else:
        same = scored if isinstance(scored, str) else f"{scored:.1f}"
        rows += [f"| llama.cpp, same file and threads: the chunk as one batch, output head on the scored rows (our batched pass's work) | 1 | {same} | | |",
                 f"| llama.cpp: the chunk as one prompt (the last row's logits only) | 1 | {peer[0]:.1f} | | |",
                 f"| llama.cpp: as many tokens decoded one at a time | {args.ctx} | {peer[1]:.1f} | | |"]  # fmt: skip
    header = (
        f"### ppl_speed — {date.today()} — {platform.machine()}, {os.cpu_count()} cores\n\n"
        f"`python bench/ppl_speed.py --ctx {args.ctx} --chunks {args.chunks} --backend {args.backend}"
        f"{' --threads ' + str(args.threads) if args.threads else ''}`{' --model ' + str(model) if args.model else ''}; "
        f"model {model.name} ({engine.spec.n_embd} embd, {engine.spec.n_layer} layers, "
        f"{engine.spec.moe.n_expert} experts top-{engine.spec.moe.n_expert_used}), load {load_s:.1f} s, "
        f"text {Path(args.text).name}, {args.backend} backend on {engine.model.ops.threads} threads{chosen}, "
        f"experts warm, {load_line()}\n\n"
        "| evaluation | eval calls per chunk | tok/s | in ggml's products | PPL |\n|---|---|---|---|---|\n"
    )
    footer = f"\nbatched / token by token: {batched[0] / stepped[0]:.1f}x"
    if isinstance(scored, float):
        footer += f"; batched / llama.cpp's same pass: {batched[0] / scored:.2f}x"
        if not isinstance(peer, str):  # the peer's own gain from many rows over one, on the same work as ours
            footer += f"; llama.cpp's same pass / its tokens one at a time: {scored / peer[1]:.1f}x"
    if not isinstance(peer, str):
        # its prompt computes the last row's logits only, ours every scored row's: its ratio is the larger
        footer += f"; llama.cpp's prompt / its tokens one at a time, same CPU and threads: {peer[0] / peer[1]:.1f}x"
    footer += "\n"
    report = header + "\n".join(rows) + "\n" + footer
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
