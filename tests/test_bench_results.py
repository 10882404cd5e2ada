"""bench/results.py: every report a bench records names the processor it ran on and the load at its start in
its heading line, whether or not the script wrote them there (a speed holds for its processor alone)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import results


@pytest.fixture
def results_file(tmp_path, monkeypatch):
    path = tmp_path / "RESULTS.md"
    monkeypatch.setattr(results, "RESULTS", path)
    monkeypatch.setattr(results, "processor", lambda: "Some CPU (cpu family 25, model 1)")
    return path


def test_a_recorded_heading_gets_the_processor_and_the_load_it_lacks(results_file):
    results.record("### cpu_decode — 2026-11-28 — x86_64, 2 cores\n\n| a | b |\n")
    heading = results_file.read_text().splitlines()[2]
    assert heading.startswith("### cpu_decode — 2026-11-28 — x86_64, 2 cores — Some CPU (cpu family 25, model 1) — load average ")
    assert results_file.read_text().endswith("| a | b |\n")


def test_a_heading_that_names_them_is_kept_as_it_is(results_file, capsys):
    report = "### host_time — 2026-11-28 — Some CPU (cpu family 25, model 1), 2 cores — load average 1.00 (1 min)\n\nbody"
    assert results.publish(report, True) == 0
    assert capsys.readouterr().out.splitlines()[0] == report.splitlines()[0]  # (what is printed is what is kept)
    assert results_file.read_text().splitlines()[2] == report.splitlines()[0]
