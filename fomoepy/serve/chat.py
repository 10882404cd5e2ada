"""`fomoe chat`: an interactive (or one-shot) client of the daemon.

Interactive: the conversation is kept and sent whole each turn under one session id, so the daemon
re-evaluates only the new turn. A line ending in a backslash continues on the next line; a line
starting with \"\"\" opens a block that a line ending in \"\"\" closes. Ctrl-C cancels the answer being
written (what was written stays in the history) or clears the input; /quit or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import uuid
from collections.abc import Callable
from typing import Any

from fomoepy.argtypes import RANDOM_SEED
from fomoepy.serve.client import Client, ServerError
from fomoepy.serve.summary import summary_lines

HELP = """commands:
  /stats   the daemon's statistics: speed, queue, expert tiers, CAR, prefetch
  /reset   forget the conversation (a new session)
  /quit    leave (also Ctrl-D)
  /help    this text
input: end a line with \\ to continue it; \"\"\" opens and closes a multi-line block.
Ctrl-C stops the answer being written."""

BLOCK = '"""'


class InputAssembler:
    """Typed lines → one message. `feed` returns the message once complete, else None (more to read)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._block = False

    @property
    def continuing(self) -> bool:
        return self._block or bool(self._lines)

    def reset(self) -> None:
        self._lines, self._block = [], False

    def feed(self, line: str) -> str | None:
        if self._block:
            if line.rstrip().endswith(BLOCK):
                rest = line.rstrip()[: -len(BLOCK)]
                if rest:
                    self._lines.append(rest)
                return self._done()
            self._lines.append(line)
            return None
        if not self._lines and line.lstrip().startswith(BLOCK):
            rest = line.lstrip()[len(BLOCK) :]
            if rest.rstrip().endswith(BLOCK):  # """one line"""
                self._lines.append(rest.rstrip()[: -len(BLOCK)])
                return self._done()
            self._block = True
            if rest:
                self._lines.append(rest)
            return None
        if line.endswith("\\"):
            self._lines.append(line[:-1])
            return None
        self._lines.append(line)
        return self._done()

    def _done(self) -> str:
        text = "\n".join(self._lines)
        self.reset()
        return text


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": args.n_predict, "temperature": args.temp}
    for key in ("seed", "top_k", "top_p", "min_p", "repeat_penalty"):
        value = getattr(args, key)
        if value is not None and not (key == "seed" and value == RANDOM_SEED):
            fields[key] = value
    return fields


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    with Client(args.socket) as client:
        if args.stats:
            stats = client.stats()
            print(json.dumps(stats, indent=1, sort_keys=True) if args.json else "\n".join(summary_lines(stats)))
            return 0
        if args.prompt is not None:
            return one_shot(client, args)
        return interactive(client, args)


def one_shot(client: Client, args: argparse.Namespace) -> int:
    if args.raw:
        request: dict[str, Any] = {"prompt": args.prompt}
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        request = {"messages": system + [{"role": "user", "content": args.prompt}]}
    for msg in client.stream(**request, **sampling_fields(args)):
        if msg["type"] == "delta":
            write(msg["text"])
    write("\n")
    return 0


def stream_answer(client: Client, messages: list[dict[str, str]], session: str, fields: dict[str, Any]) -> tuple[str, str]:
    """Write the answer as it comes; Ctrl-C cancels it. (text, finish reason)."""
    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True

    previous: Callable | int | None = signal.signal(signal.SIGINT, on_sigint)
    parts: list[str] = []
    reason = "cancelled"
    try:
        for msg in client.stream(messages=messages, session=session, cancel_when=lambda: interrupted, **fields):
            if msg["type"] == "delta":
                parts.append(msg["text"])
                write(msg["text"])
            elif msg["type"] == "done":
                reason = msg["finish_reason"]
    finally:
        signal.signal(signal.SIGINT, previous)
    write("\n" if reason != "cancelled" else " [cancelled]\n")
    return "".join(parts), reason


def interactive(client: Client, args: argparse.Namespace) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    session = uuid.uuid4().hex
    fields = sampling_fields(args)
    lines = InputAssembler()
    print(f"fomoe chat: connected to {client.path}. /help for commands, /quit to leave.", file=sys.stderr)
    while True:
        try:
            text = lines.feed(input("... " if lines.continuing else ">>> "))
        except KeyboardInterrupt:
            lines.reset()
            write("\n")
            continue
        except EOFError:
            write("\n")
            return 0
        if text is None:
            continue
        command = text.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command == "/help":
            print(HELP)
            continue
        if command == "/reset":
            history, session = list(system), uuid.uuid4().hex
            print("(conversation reset)")
            continue
        if command == "/stats":
            for line in summary_lines(client.stats()):
                print(f"  {line}")
            continue
        if not command:
            continue
        history.append({"role": "user", "content": text})
        try:
            answer, _ = stream_answer(client, history, session, fields)
        except ServerError as e:
            history.pop()
            print(f"fomoe chat: error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})
