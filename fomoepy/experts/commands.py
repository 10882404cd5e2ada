"""`fomoe` subcommands of this subsystem (registered by fomoepy.cli)."""

from __future__ import annotations


def register(sub) -> None:
    """Add this subsystem's subcommands to the `fomoe` parser."""
