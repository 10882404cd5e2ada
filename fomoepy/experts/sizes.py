"""Byte sizes as users write them ("48K", "512M", "16G", "0") and as we print them.

Units are binary (K = 1024): memory budgets are carved from power-of-two pages and devices report
them that way, so "16G" of VRAM means 16 GiB. A trailing "B" or "iB" is accepted ("512MiB").
"""

from __future__ import annotations

import re
from fractions import Fraction

from fomoepy.errors import FomoeError

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# Far above any memory, and below int64's 2**63, which the cache core and the trace format hold sizes in
MAX_SIZE = 1 << 62

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Text → bytes: "48K" → 49152, "1.5G" → 1610612736, "0" → 0 (a tier of size 0 is off). Fractions round down."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m is None or (m.group(3) and m.group(3).upper() == "IB" and not m.group(2)):
        raise FomoeError(f"expected a size such as 48K, 512M, 16G or 0, got {text!r}")
    whole, _, decimals = m.group(1).partition(".")
    if len(whole.lstrip("0")) > len(str(MAX_SIZE)):  # (before int(): it refuses numbers of 4300+ digits)
        raise _too_large(text)
    # exact arithmetic: a float would round large byte counts; decimals past the 30th weigh under 1e-17 bytes
    size = int(Fraction(f"{whole or 0}.{decimals[:30] or 0}") * UNITS[m.group(2).upper()])
    if size > MAX_SIZE:
        raise _too_large(text)
    return size


def _too_large(text: str) -> FomoeError:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return FomoeError(f"size {shown!r} is too large: at most {MAX_SIZE >> 40}T ({MAX_SIZE} bytes)")


def format_size(n: int) -> str:
    """1610612736 → "1.5 GiB"; small numbers stay exact ("512 B")."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")
