"""Output files of the commands: checked before any work is done, then written whole or not at all.

A command that computes for minutes and only then finds it cannot write its result has wasted the
minutes, and one that dies half-way through a write leaves a file that looks like a result. So every
output path goes through `check_output` before the work starts, and through `atomic_output` after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from fomoepy.errors import FomoeError

PARTIAL_SUFFIX = ".partial"  # a result being written; renamed to its own name only once complete


def check_output(path: str | os.PathLike[str], flag: str) -> Path:
    """`path` as a Path if a file can be written there; else a FomoeError naming `flag`. Creates nothing
    that outlives the call."""
    out = Path(path)
    if out.is_dir():
        raise FomoeError(f"{flag} {out}: is a directory")
    if not out.parent.is_dir():  # (Path("x").parent is ".")
        raise FomoeError(f"{flag} {out}: no such directory {out.parent}")
    try:
        _probe(out)
    except OSError as e:
        raise FomoeError(f"{flag} {out}: cannot write ({e.strerror or e})") from None
    return out


def _probe(out: Path) -> None:
    # Writing is the only true test: root passes os.access on a read-only mount or an immutable file.
    if out.exists():
        with open(out, "ab"):  # (appends nothing: the file is unchanged)
            return
    probe = _partial(out)
    with open(probe, "wb"):
        pass
    probe.unlink()


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file whose bytes appear at `path` only when the block completes; on an error nothing
    is left behind. A device or pipe (/dev/null, /dev/stdout) is written in place: it cannot be renamed over."""
    out = Path(path)
    if out.exists() and not out.is_file():
        with open(out, "wb") as f:
            yield f
        return
    partial = _partial(out)
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    except BaseException:
        with suppress(OSError):
            partial.unlink()
        raise


def _partial(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)
