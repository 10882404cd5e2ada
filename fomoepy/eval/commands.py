"""`fomoe` subcommands of this subsystem (registered by fomoepy.cli): ppl, and profile (fomoepy.eval.profile_cli)."""

from __future__ import annotations

import argparse

from fomoepy.argtypes import int_in
from fomoepy.engine import open_engine, resolve_model
from fomoepy.errors import FomoeError
from fomoepy.eval.ppl import DEFAULT_BATCH, DEFAULT_CTX, check_ctx
from fomoepy.options import add_engine_options
from fomoepy.outputs import check_output

PPL_DESCRIPTION = """\
Perplexity of a text file by llama.cpp's llama-perplexity method, with its flags and output: the text (minus one
trailing newline) is tokenized once, cut into chunks of --ctx tokens, each chunk evaluated from an empty state
(batched prefill), and the logits of its second half scored. stdout: "[1]x,[2]y,..." as chunks finish, then
"Final estimate: PPL = x +/- y"; everything else goes to stderr.

KL divergence: run once with --kl-base FILE on the reference model (it also prints its perplexity), then with
--kl FILE on the model to compare; that prints llama-perplexity's --kl-divergence table and summary. The spellings
--kl-divergence-base FILE [--kl-divergence] work as in llama-perplexity; its base files can be read too.
"""


def register(sub) -> None:
    """Add this subsystem's subcommands to the `fomoe` parser."""
    p = sub.add_parser(
        "ppl",
        help="perplexity / KL divergence of a text file (llama-perplexity's method, flags and output)",
        description=PPL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="the GGUF model")
    p.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the model (llama-perplexity spelling)")
    p.add_argument("-f", "--file", help="UTF-8 text, e.g. WikiText-2's wiki.test.raw (optional with --kl)")
    p.add_argument(
        "--ctx", dest="ctx_size", type=int, default=None, help=f"tokens per chunk (same as -c; default {DEFAULT_CTX})"
    )
    p.add_argument("--chunks", type=int, default=-1, help="evaluate at most N chunks (default: all whole chunks)")
    p.add_argument(
        "-b",
        "--batch",
        "--batch-size",
        dest="batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"tokens per eval call (default {DEFAULT_BATCH}): B >= ctx evaluates each chunk in one call; "
        "B < ctx in ceil(ctx/B) calls of B tokens continuing the same state, as llama-perplexity's n_batch",
    )
    p.add_argument("--resume", metavar="FILE", help="record finished chunks in FILE; rerun to continue after a kill")
    kl = p.add_mutually_exclusive_group()
    kl.add_argument("--kl-base", metavar="FILE", help="save this run's log-probs as a KL base")
    kl.add_argument("--kl", metavar="FILE", help="compare this run against the KL base FILE")
    p.add_argument("--kl-divergence-base", metavar="FILE", help="llama-perplexity spelling of --kl-base")
    p.add_argument(
        "--kl-divergence", action="store_true", help="with --kl-divergence-base FILE: read it, as --kl FILE"
    )
    p.add_argument(
        "--kl-top-k",
        type=int_in("--kl-top-k", 0),
        default=None,
        metavar="K",
        help="tokens kept per position by --kl-base: 0 = all (exact KL); default all up to a 4096-token "
        "vocabulary, else 256 plus the remaining mass (a lower bound of the KL)",
    )
    p.add_argument(
        "--reset-cache-per-chunk",
        action="store_true",
        help="cold start for every chunk: reset the expert caches too, not only the KV cache",
    )
    add_engine_options(p)
    p.set_defaults(handler=cmd_ppl)

    from fomoepy.eval.profile_cli import add_profile_command

    add_profile_command(sub)


def engine_option_values(args: argparse.Namespace) -> dict:
    """The engine's settings (EngineOptions.settings), for the resume file: a resumed run must match them."""
    from fomoepy.options import EngineOptions

    return {k: _plain(v) for k, v in EngineOptions.from_args(args).settings().items()}


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def cmd_ppl(args: argparse.Namespace) -> int:
    from fomoepy.eval.klfile import KlBase
    from fomoepy.eval.ppl_run import PplRequest, PplRun

    if args.model and args.model_flag and args.model != args.model_flag:
        raise FomoeError(f"two models given: {args.model} and -m {args.model_flag}")
    args.model = args.model or args.model_flag
    if resolve_model(args) and args.file is None and args.kl is None and args.kl_divergence_base is None:
        from fomoepy.data import demo_heldout_path

        args.file = str(demo_heldout_path())  # the demo model's held-out text
    kl_out, kl_in = args.kl_base, args.kl
    if args.kl_divergence_base is not None:
        if kl_out is not None or kl_in is not None:
            raise FomoeError("give --kl-divergence-base or --kl-base/--kl, not both")
        kl_in, kl_out = (args.kl_divergence_base, None) if args.kl_divergence else (None, args.kl_divergence_base)
    elif args.kl_divergence:
        raise FomoeError("--kl-divergence needs --kl-divergence-base FILE (the base run's log-probs)")
    if args.kl_top_k is not None and kl_out is None:
        raise FomoeError("--kl-top-k sets what --kl-base saves; give --kl-base FILE too")
    if args.batch < 1:
        raise FomoeError(f"--batch must be >= 1, got {args.batch}")
    if args.resume and getattr(args, "car_threshold", None) is not None and not args.reset_cache_per_chunk:
        # the tiers carry over from chunk to chunk, and CAR's substitutions depend on what they hold: a
        # resumed run starts them empty, so its later chunks would not be the uninterrupted run's
        raise FomoeError("--resume with --car-threshold needs --reset-cache-per-chunk (each chunk from empty tiers): "
                         "a resumed run cannot restore what the tiers held, which CAR's choices depend on")  # fmt: skip

    base = None
    if kl_in is not None:
        base = KlBase(kl_in)
        if args.ctx_size is not None and args.ctx_size != base.n_ctx:
            raise FomoeError(f"{kl_in} was computed with --ctx {base.n_ctx}, not {args.ctx_size}")
        args.ctx_size = base.n_ctx
    elif args.file is None:
        raise FomoeError("no text given: --file TEXT (or --kl BASE, which holds its tokens)")
    if args.ctx_size is None:
        args.ctx_size = DEFAULT_CTX
    check_ctx(args.ctx_size)
    if args.file is not None:
        from fomoepy.eval.ppl_run import read_text

        read_text(args.file)  # a missing or non-UTF-8 file fails here, before the model loads
    for flag, path in (("--resume", args.resume), ("--kl-base", kl_out)):
        if path is not None:
            check_output(path, flag)  # (as the input: before the model loads, not after a chunk)

    request = PplRequest(
        model=args.model,
        text_file=args.file,
        n_ctx=args.ctx_size,
        n_batch=args.batch,
        max_chunks=args.chunks,
        resume=args.resume,
        kl_base_out=kl_out,
        kl_top_k=args.kl_top_k,
        reset_cache_per_chunk=args.reset_cache_per_chunk,
        engine_options=engine_option_values(args),
    )
    engine = open_engine(args)
    try:
        return PplRun(engine, request, base).run()
    finally:
        close = getattr(engine, "close", None)  # background threads, trace files
        if close is not None:
            close()
