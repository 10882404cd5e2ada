"""`fomoe profile`: count the router's original choices over a prompt set into a .freq profile.

The profile seeds the caches at start-up (`--freq-profile`): the most frequent experts go to VRAM,
the next ones to DRAM. Counts are of the exact router's choices, whatever CAR later substitutes.
"""

from __future__ import annotations

import argparse
import sys
import time

from fomoepy.errors import FomoeError
from fomoepy.outputs import check_output


def add_profile_command(sub) -> None:
    from fomoepy.options import add_engine_options

    p = sub.add_parser("profile", help="expert frequency profile (.freq) of a model over a prompt file")
    p.add_argument("model", help="the GGUF model")
    p.add_argument("store_dirs", nargs="*", metavar="STORE", help="expert store directories (optional)")
    p.add_argument("--prompts", required=True, help="UTF-8 file, one prompt per non-empty line")
    p.add_argument("--out", required=True, help="the .freq file to write")
    p.add_argument("-n", "--n-predict", type=int, default=16, help="greedy tokens generated after each prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_engine_options(p)
    p.set_defaults(handler=cmd_profile)


def read_prompts(path: str) -> list[str]:
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise FomoeError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise FomoeError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise FomoeError(f"{path}: no prompts (one per non-empty line)")
    return prompts


def cmd_profile(args: argparse.Namespace) -> int:
    from fomoepy.engine import open_engine
    from fomoepy.experts.profile import write_freq
    from fomoepy.model.chat import render_chat
    from fomoepy.sampling import SamplingParams

    if args.n_predict < 0:
        raise FomoeError(f"-n must be >= 0, got {args.n_predict}")
    prompts = read_prompts(args.prompts)
    check_output(args.out, "--out")
    args.store = list(args.store_dirs) + list(args.store)
    engine = open_engine(args)
    tok = engine.tokenizer
    t0 = time.perf_counter()
    n_tokens = 0
    for text in prompts:
        if args.chat:
            text = render_chat(
                [{"role": "user", "content": text}],
                template=engine.file.get("tokenizer.chat_template"),
                bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            )
        ids = tok.encode(text)[: engine.n_ctx - args.n_predict] or [tok.bos_id or 0]
        out = list(engine.generate(ids, args.n_predict, SamplingParams.greedy()))
        n_tokens += len(ids) + len(out)
    profile = engine.experts.streamer.counter.profile()
    write_freq(args.out, profile)
    elapsed = time.perf_counter() - t0
    print(
        f"fomoe: profiled {len(prompts)} prompts, {n_tokens} tokens in {elapsed:.1f} s; "
        f"{len(profile)} (layer, expert) entries -> {args.out}",
        file=sys.stderr,
    )
    engine.close()
    return 0
