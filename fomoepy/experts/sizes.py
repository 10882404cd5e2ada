"""Byte sizes as users write them ("48K", "512M", "16G", "0") and as we print them.

Units are binary (K = 1024): memory budgets are carved from power-of-two pages and devices report
them that way, so "16G" of VRAM means 16 GiB. A trailing "B" or "iB" is accepted ("512MiB").
"""

from __future__ import annotations

import re

from fomoepy.errors import FomoeError

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Text → bytes: "48K" → 49152, "1.5G" → 1610612736, "0" → 0 (a tier of size 0 is off). Fractions round down."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m is None or (m.group(3) and m.group(3).upper() == "IB" and not m.group(2)):
        raise FomoeError(f"expected a size such as 48K, 512M, 16G or 0, got {text!r}")
    number, unit = m.group(1), UNITS[m.group(2).upper()]
    # integers stay exact (no float rounding of large byte counts)
    return int(number) * unit if "." not in number else int(float(number) * unit)


def format_size(n: int) -> str:
    """1610612736 → "1.5 GiB"; small numbers stay exact ("512 B")."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")
