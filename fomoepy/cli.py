"""The `fomoe` command: parse, call the engine, print. Command names and flags are a contract."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fomoepy import __version__
from fomoepy.argtypes import RANDOM_SEED, UINT64_MAX, int_in, utf8_text
from fomoepy.engine import open_engine
from fomoepy.errors import FomoeError
from fomoepy.options import add_engine_options
from fomoepy.outputs import atomic_output, check_output


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # (argument types raise FomoeError: fomoepy.argtypes)
        return args.handler(args)
    except FomoeError as e:
        print(f"fomoe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fomoe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fomoe", description="Mixture-of-Experts inference with streamed experts.")
    parser.add_argument("--version", action="version", version=f"fomoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="architecture, sizes, quant mix and parameter counts of a GGUF model")
    p.add_argument("model")
    p.set_defaults(handler=cmd_info)

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", help="UTF-8 file, tokenized byte for byte (no newline is stripped)")
    src.add_argument("--text", type=utf8_text("--text"), help="the text itself")
    p.add_argument("--no-special", action="store_true", help="treat control-token text as plain text")
    p.add_argument("--no-bos", action="store_true", help="add no BOS/EOS even where the model asks for them")
    p.add_argument("--json", action="store_true", help="print the ids as one JSON list")
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("logits", help="float32 logits [n_tokens, n_vocab] of a token sequence, every position")
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens-npy", help="int array of token ids (.npy)")
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="where to write the .npy")
    add_engine_options(p)
    p.set_defaults(handler=cmd_logits)

    p = sub.add_parser("generate", help="stream generated text to stdout")
    p.add_argument("model", nargs="?", help="the GGUF model (default: the embedded demo model)")
    p.add_argument("-p", "--prompt", type=utf8_text("--prompt"), required=True)
    p.add_argument("-n", "--n-predict", type=int, default=128, help="maximum tokens to generate")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", type=utf8_text("--system"), help="system message (with --chat)")
    p.add_argument("--seed", type=int_in("--seed", RANDOM_SEED, UINT64_MAX), default=None,
                   help="random seed for sampling; -1 or none: a random one (as llama.cpp's -1)")  # fmt: skip
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-generation token")
    add_engine_options(p)
    p.set_defaults(handler=cmd_generate)
    register_subsystem_commands(sub)
    return parser


# Commands that live with their subsystem: each module has register(subparsers), which adds its
# parsers with set_defaults(handler=...). Imported here only, so subsystems never import the CLI.
SUBSYSTEM_COMMANDS = (
    "fomoepy.experts.commands",
    "fomoepy.serve.commands",
    "fomoepy.eval.commands",
    "fomoepy.plan.commands",
)


def register_subsystem_commands(sub) -> None:
    import importlib

    for module in SUBSYSTEM_COMMANDS:
        importlib.import_module(module).register(sub)


# -- commands --------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from fomoepy.experts.source import expert_index
    from fomoepy.model.gguf_file import GGUFFile
    from fomoepy.model.spec import ModelSpec

    gf = GGUFFile(args.model)
    spec = ModelSpec.from_gguf(gf)
    a, m = spec.attention, spec.moe
    layers = expert_index(gf, spec)
    expert_params = sum(m.n_expert * sum(p.shape[0] * p.shape[1] for p in layer.parts) for layer in layers)
    all_params = sum(int(np.prod(t.shape)) for t in gf.tensors.values())
    active = all_params - expert_params + expert_params * m.n_expert_used // m.n_expert
    types = Counter(t.qtype.name for t in gf.tensors.values())
    type_bytes = Counter()
    for t in gf.tensors.values():
        type_bytes[t.qtype.name] += t.nbytes
    kinds = Counter(spec.layer_kinds)
    out = [
        f"model:        {gf.path} ({spec.name})",
        f"architecture: {spec.arch}",
        f"layers:       {spec.n_layer} ({', '.join(f'{n} {k}' for k, n in kinds.items())})",
        f"n_embd:       {spec.n_embd}   n_vocab: {spec.n_vocab}   context: {spec.context_length}",
        f"attention:    {a.n_head} q heads / {a.n_head_kv} kv heads x {a.head_dim}, rope base {a.rope_base:g}, "
        f"rotary dims {a.rotary_dim}{', gated' if a.gated else ''}",
        f"experts:      {m.n_expert} per layer, top-{m.n_expert_used}, expert_ff {m.expert_ff}"
        + (f", shared expert ff {m.shared_ff}" if m.shared_ff else ""),
    ]
    if spec.deltanet:
        dn = spec.deltanet
        out.append(
            f"deltanet:     {dn.n_k_heads} qk heads x {dn.state_size}, {dn.n_v_heads} v heads x {dn.v_head_dim}, "
            f"conv kernel {dn.conv_kernel}"
        )
    out.append(f"expert bytes: {layers[0].expert_nbytes:,} per expert; per layer:")
    for layer in layers:
        kinds_of = "/".join(p.qtype.name for p in layer.parts)
        out.append(f"  layer {layer.layer:3d}: {layer.expert_nbytes * m.n_expert:>14,} bytes ({kinds_of})")
    out.append("quant mix:    " + ", ".join(f"{k} {types[k]} tensors {type_bytes[k]:,} B" for k in sorted(types)))
    out.append(f"parameters:   {all_params:,} total, {active:,} active per token")
    print("\n".join(out))
    return 0


def read_text_file(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FomoeError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FomoeError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None


def cmd_tokenize(args: argparse.Namespace) -> int:
    from fomoepy.model.tokenizer import Tokenizer

    text = read_text_file(args.text_file) if args.text_file is not None else args.text
    tok = Tokenizer.from_gguf(args.model)
    ids = tok.encode(text, add_special=not args.no_bos, parse_special=not args.no_special)
    if args.json:
        print(json.dumps(ids))
    else:
        for i in ids:
            print(f"{i:8d} -> {tok.token_text(i)!r}")
    return 0


def parse_token_list(text: str) -> np.ndarray:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise FomoeError(f"--tokens must be comma-separated integers, got {text!r}") from None
    # refused here, as no int64 holds them; ids that do are checked against the vocabulary later
    for i in ids:
        if not -(1 << 63) <= i < 1 << 63:
            raise FomoeError(f"token id {i} is out of range (no vocabulary is that large)")
    return np.array(ids, dtype=np.int64)


def load_token_npy(path: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise FomoeError(f"{path}: cannot read as .npy ({e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise FomoeError(f"{path}: expected a 1-D integer array of token ids, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64)


def cmd_logits(args: argparse.Namespace) -> int:
    tokens = load_token_npy(args.tokens_npy) if args.tokens_npy else parse_token_list(args.tokens)
    if tokens.size == 0:
        raise FomoeError("no tokens given")
    out = check_output(args.out, "--out")
    engine = open_engine(args)
    bad = tokens[(tokens < 0) | (tokens >= engine.spec.n_vocab)]
    if bad.size:
        raise FomoeError(f"token id {int(bad[0])} is outside the vocabulary [0, {engine.spec.n_vocab})")
    if tokens.size > engine.n_ctx:
        raise FomoeError(f"{tokens.size} tokens exceed the context of {engine.n_ctx} (raise --ctx-size)")
    t0 = time.perf_counter()
    logits = engine.logits(tokens).astype(np.float32)
    elapsed = time.perf_counter() - t0
    with atomic_output(out) as f:  # (a file object: np.save given a name would add ".npy" to it)
        np.save(f, logits)
    print(f"fomoe: {tokens.size} tokens in {elapsed:.2f} s ({tokens.size / elapsed:.1f} tok/s) -> {out}", file=sys.stderr)
    report_streaming(engine)
    engine.close()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from fomoepy.model.chat import render_chat
    from fomoepy.model.tokenizer import StreamDecoder
    from fomoepy.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=None if args.seed == RANDOM_SEED else args.seed,
    )
    if args.n_predict < 0:
        raise FomoeError(f"-n must be >= 0, got {args.n_predict}")
    engine = open_engine(args)
    tok = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        text = render_chat(
            messages,
            template=engine.file.get("tokenizer.chat_template"),
            bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        )
        prompt = tok.encode(text, add_special=True, parse_special=True)
    else:
        prompt = tok.encode(args.prompt, add_special=True, parse_special=True)
    if not args.chat:
        write(args.prompt)
    decoder = StreamDecoder(tok)
    eog = set(tok.eog_ids)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for token in engine.generate(prompt, args.n_predict, params, stop_at_eog=not args.ignore_eos):
        if t_first is None:
            t_first = time.perf_counter()
        n += 1
        if token in eog and not args.ignore_eos:
            break
        write(decoder.feed(token))
    write(decoder.flush() + "\n")
    t_end = time.perf_counter()
    report_speed(len(prompt), n, t0, t_first, t_end)
    report_streaming(engine)
    engine.close()
    return 0


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def report_streaming(engine) -> None:
    for line in engine.stats_lines():
        print(f"fomoe: {line}", file=sys.stderr)


def report_speed(n_prompt: int, n_gen: int, t0: float, t_first: float | None, t_end: float) -> None:
    if t_first is None:
        return
    prefill = t_first - t0
    decode = t_end - t_first
    decode_rate = (n_gen - 1) / decode if n_gen > 1 and decode > 0 else float("nan")
    print(
        f"fomoe: prompt {n_prompt} tokens in {prefill:.2f} s ({n_prompt / prefill:.1f} tok/s), "
        f"generated {n_gen} tokens ({decode_rate:.1f} tok/s)",
        file=sys.stderr,
    )


Handler = Callable[[argparse.Namespace], int]

if __name__ == "__main__":
    sys.exit(main())
