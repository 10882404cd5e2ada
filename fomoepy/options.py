"""Engine options shared by every command that opens a model (generate, logits, serve, ppl, ...).

The flag names are a contract: other programs pass them.
"""

from __future__ import annotations

import argparse


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=["cpu"], help="compute backend")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default: the model's)")


def open_engine(args: argparse.Namespace):
    """An Engine for args.model with the options add_engine_options parsed."""
    from fomoepy.engine import Engine, EngineOptions

    return Engine(args.model, EngineOptions(backend=args.backend, n_ctx=args.ctx_size))
