"""`fomoe demo`: the whole product in one command, for a first look.

Starts the chat daemon on the embedded demo model (its expert store prepared on first use) on a
private socket, asks it a few questions through the ordinary client as `fomoe chat -p` would,
streaming the answers, prints the daemon's statistics, and shuts it down.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

DEFAULT_PROMPTS = ("def fibonacci(n):", "What does the os module do?")


def add_demo_command(sub) -> None:
    from fomoepy.options import add_engine_options

    p = sub.add_parser("demo", help="start the daemon on the demo model, chat with it, stop it")
    p.add_argument("model", nargs="?", help="the GGUF model (default: the embedded demo model)")
    p.add_argument("-p", "--prompt", action="append", help="a message to send (repeatable; default: two examples)")
    p.add_argument("-n", "--n-predict", type=int, default=48, help="maximum tokens per answer")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat-penalty", type=float, default=1.15)
    add_engine_options(p)
    p.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from fomoepy.engine import open_engine
    from fomoepy.serve.client import Client
    from fomoepy.serve.thread import DaemonThread

    engine = open_engine(args)
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="fomoe-demo-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "fomoe.sock")
        with DaemonThread(engine, path) as daemon, Client(daemon.path) as client:
            print(f"fomoe demo: daemon up on {path} with {Path(args.model).name}", file=sys.stderr)
            for i, prompt in enumerate(args.prompt or DEFAULT_PROMPTS):
                out.write(f"\n>>> {prompt}\n")
                completion = None
                for msg in client.stream(
                    prompt=prompt, max_tokens=args.n_predict, temperature=args.temp, seed=args.seed,
                    repeat_penalty=args.repeat_penalty, session=f"demo-{i}",
                ):
                    if msg.get("type") == "delta":
                        out.write(msg["text"])
                        out.flush()
                    elif msg.get("type") == "done":
                        completion = msg
                out.write("\n")
                if completion is not None:
                    usage = completion.get("usage", {})
                    print(
                        f"fomoe demo: {usage.get('completion_tokens', '?')} tokens, finish: {completion.get('finish_reason')}",
                        file=sys.stderr,
                    )
            stats = client.stats()
            engine_stats = stats.get("engine", {})
            print(f"fomoe demo: daemon stats: {_short(stats, engine_stats)}", file=sys.stderr)
    engine.close()
    return 0


def _short(stats: dict, engine_stats: dict) -> str:
    parts = [f"uptime {stats.get('uptime_s', 0):.1f} s"]
    cache = engine_stats.get("cache") if isinstance(engine_stats, dict) else None
    if cache:
        parts.append(
            f"expert uses {cache['accesses']}, device hit {cache['device']['hit_rate']:.1%}, "
            f"host hit {cache['host']['hit_rate']:.1%}, disk reads {cache['disk']['reads']}"
        )
    return "; ".join(parts)
