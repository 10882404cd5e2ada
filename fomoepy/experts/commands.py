"""`fomoe` subcommands of this subsystem (registered by fomoepy.cli): prepare, verify-store, simulate."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    """Add this subsystem's subcommands to the `fomoe` parser."""
    p = sub.add_parser("prepare", help="write the expert store of a GGUF model into one or more directories")
    p.add_argument("model", help="the GGUF model")
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="store directory, one per drive; experts are striped across several")
    p.add_argument("--mirror", action="store_true", help="write a full copy to every DIR instead of striping")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or throughput line")
    p.set_defaults(handler=cmd_prepare)

    p = sub.add_parser("verify-store", help="check every record of an expert store against its checksum and the GGUF")
    p.add_argument("model", help="the GGUF model the store was prepared from")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="the store's directories, in any order")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_verify_store)

    from fomoepy.experts.simulate_cli import add_simulate_command

    add_simulate_command(sub)


def cmd_prepare(args: argparse.Namespace) -> int:
    from fomoepy.experts.store_writer import prepare_store

    m = prepare_store(args.model, [Path(d) for d in args.dirs], mirror=args.mirror, progress=not args.quiet)
    layout = f"mirrored x{m.n_dirs}" if m.mirror else f"striped over {m.n_dirs}"
    print(
        f"store ready ({layout}: {', '.join(args.dirs)}): {len(m.index)} experts of {len(m.layers)} layers, "
        f"{m.total_bytes() / 1e9:.3f} GB per copy"
    )
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:
    from fomoepy.experts.store_verify import verify_store

    print(verify_store(args.model, args.dirs, progress=not args.quiet).line())
    return 0
