"""`fomoe serve` and `fomoe chat` (registered by fomoepy.cli)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fomoepy.argtypes import RANDOM_SEED, UINT64_MAX, int_in, utf8_text
from fomoepy.engine import open_engine, resolve_model
from fomoepy.errors import FomoeError
from fomoepy.options import add_engine_options


def register(sub) -> None:
    """Add this subsystem's subcommands to the `fomoe` parser."""
    from fomoepy.serve.config import DaemonConfig

    d = DaemonConfig()
    p = sub.add_parser("serve", help="run the chat daemon on a Unix socket (systemd socket activation and notify aware)")
    p.add_argument("model", nargs="?", help="the GGUF model (default: the embedded demo model)")
    p.add_argument("--socket", help="socket path (default: $XDG_RUNTIME_DIR/fomoe.sock, else /run/fomoe/fomoe.sock)")
    p.add_argument("--socket-group", help="make the socket 0660 and owned by this group (default: 0600, owner only)")
    p.add_argument("--max-frame-bytes", type=int, default=d.max_frame, help=f"largest request frame (default {d.max_frame})")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions, help=f"chat sessions whose cache is kept, LRU (default {d.max_sessions})")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=d.max_queue, help=f"unfinished generation requests, all clients (default {d.max_queue}; as many tokenize/stats, counted apart)")  # fmt: skip
    p.add_argument("--max-pending", type=int, default=d.max_pending, help=f"unfinished requests per connection (default {d.max_pending})")  # fmt: skip
    p.add_argument("--pause-timeout", type=float, default=d.pause_timeout,
                   help=f"seconds a generation paused by a client that does not read waits before it is cancelled (default {d.pause_timeout:g})")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"generations decoded together in one step (default {d.max_batch}; 1: one at a time)")  # fmt: skip
    p.add_argument("--kv-budget", metavar="SIZE", default=None,
                   help="KV cache the batch may reserve, e.g. 512M (default: --max-batch full contexts within a quarter "
                        "of the available memory, at least one); a request whose prompt + max_tokens cannot fit is "
                        "refused, one that fits waits its turn")  # fmt: skip
    p.add_argument("--http", metavar="[HOST:]PORT", help="also serve the OpenAI-compatible HTTP API (HOST default 127.0.0.1; off by default)")
    p.add_argument("--api-key", default=os.environ.get("FOMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every HTTP route but /health (default: $FOMOE_API_KEY)")  # fmt: skip
    p.add_argument("--http-allow-unauthenticated", action="store_true",
                   help="serve HTTP on a non-loopback address without an API key (refused otherwise)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_options(p)
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("chat", help="chat with the daemon (interactive, or one answer with -p)")
    p.add_argument("--socket", help="socket path (default: as fomoe serve)")
    # (the request's integers in the protocol's ranges, its text UTF-8: refused before connecting)
    p.add_argument("-p", "--prompt", type=utf8_text("--prompt"), help="send this one message, print the answer, exit")
    p.add_argument("-n", "--n-predict", type=int_in("-n", 0, UINT64_MAX), default=512, help="maximum tokens per answer (default 512)")
    p.add_argument("--system", type=utf8_text("--system"), help="system message")
    p.add_argument("--raw", action="store_true", help="with -p: send the text as a raw prompt, not a chat message")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy")
    p.add_argument("--seed", type=int_in("--seed", RANDOM_SEED, UINT64_MAX), default=None, help="-1 or none: the daemon picks one")
    p.add_argument("--top-k", type=int_in("--top-k", 0, UINT64_MAX), default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None)
    p.add_argument("--stats", action="store_true", help="print the daemon's statistics and exit")
    p.add_argument("--json", action="store_true", help="with --stats: the whole statistics as JSON, for scripts")
    p.set_defaults(handler=cmd_chat)

    from fomoepy.serve.demo import add_demo_command

    add_demo_command(sub)


def parse_host_port(value: str) -> tuple[str, int]:
    """"8080" → ("127.0.0.1", 8080); "0.0.0.0:8080"; "[::1]:8080"."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise FomoeError(f"--http: expected [HOST:]PORT, got {value!r}")
    return host, int(port)


def cmd_chat(args: argparse.Namespace) -> int:
    from fomoepy.serve.chat import cmd_chat as run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from fomoepy.experts.sizes import parse_size
    from fomoepy.serve.config import DaemonConfig
    from fomoepy.serve.daemon import Daemon
    from fomoepy.serve.listen import (
        Listener,
        bind_unix,
        check_not_live,
        inherited_socket,
        notify,
    )
    from fomoepy.serve.protocol import default_socket_path

    logging.basicConfig(level=args.log_level.upper(), format="fomoe serve: %(levelname)s: %(message)s", stream=sys.stderr)
    log = logging.getLogger("fomoe.serve")
    config = DaemonConfig(
        max_frame=args.max_frame_bytes,
        max_sessions=args.max_sessions,
        max_queue=args.max_queue,
        max_pending=args.max_pending,
        pause_timeout=args.pause_timeout,
        max_batch=args.max_batch,
        kv_budget=None if args.kv_budget is None else parse_size(args.kv_budget),
    )
    http = parse_host_port(args.http) if args.http else None
    if http is not None:
        from fomoepy.serve.http import check_exposure

        check_exposure(http[0], args.api_key, args.http_allow_unauthenticated)  # before a long model load
    path = args.socket or default_socket_path()
    inherited = inherited_socket()
    if inherited is None:
        check_not_live(path)  # cheap, before a long model load
    resolve_model(args)
    notify(f"STATUS=loading {args.model}")
    log.info("loading %s", args.model)
    engine = open_engine(args)  # the model is loaded before the socket is bound
    listener = Listener(inherited, None) if inherited is not None else bind_unix(path, args.socket_group)

    def force_exit() -> None:
        listener.remove_file()
        logging.shutdown()
        os._exit(1)  # the inference thread may be inside a long step; do not wait for it

    daemon = Daemon(engine, config)
    fronts = []
    if http is not None:
        from fomoepy.serve.http import HttpFront

        fronts.append(HttpFront(daemon, *http, api_key=args.api_key, allow_unauthenticated=args.http_allow_unauthenticated))
    try:
        uvloop.run(daemon.serve(listener, on_force_exit=force_exit, fronts=fronts))
    finally:
        listener.remove_file()
        listener.sock.close()
        close = getattr(engine, "close", None)  # our own engine: its expert tiers and I/O threads
        if close is not None:
            close()
    return 0
