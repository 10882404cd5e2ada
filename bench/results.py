"""bench/RESULTS.md: every benchmark appends its report here with --record (the scripts run as
`python bench/NAME.py`, so this module is importable from them as `results`)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


def record(report: str) -> None:
    """Append one report (a markdown section that names the command that made it)."""
    existing = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(existing.rstrip("\n") + "\n\n" + report.rstrip("\n") + "\n")
