"""bench/RESULTS.md: every benchmark appends its report here with --record (the scripts run as
`python bench/NAME.py`, so this module is importable from them as `results`).

The machine's load when the script started is part of every entry: a benchmark run beside other
work measures the other work too. It is taken when a script imports this module, before it measures
anything, and added to the report's first line unless the script already states it; so is the
processor the script ran on (`stamped`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"
LOAD_AT_START = os.getloadavg()  # 1, 5 and 15 minute load averages when the script started


def processor() -> str:
    """The host processor's name: a host-time or CPU-speed figure holds for it alone. A virtual machine's
    name may be a bare family ("AMD EPYC" names Zen 3, 4 and 5 alike), so its family and model numbers
    follow it: two records of one name on different generations are told apart."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                break  # (the first processor's block is enough)
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            numbers = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
            return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def describe_fs(path) -> str:
    """The device and file system holding `path` ("/dev/vda ext4"), as df names them; "?" where it cannot."""
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True, check=True)
        return " ".join(out.stdout.split()[2:])
    except (OSError, subprocess.CalledProcessError):
        return "?"


def gpu_name(backend: str) -> str:
    """", NVIDIA H200" for a cuda run (nvidia-smi's name of the first GPU), "" for the cpu backend or where none is named."""
    if backend != "cuda":
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return f", {out.stdout.splitlines()[0].strip()}" if out.stdout.strip() else ""


def load_line() -> str:
    one, five, _ = LOAD_AT_START
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) at start on {os.cpu_count()} cores"


def stamped(report: str) -> str:
    """The report with the processor it ran on and the load at its start in its first line, where that line
    does not state them already: a speed holds for its processor alone (AVX2 or AVX-512 moves a ratio to
    llama.cpp), and a report's heading line is where a reader looks for it."""
    first, _, rest = report.partition("\n")
    host = processor()
    if host not in first:
        first = f"{first} — {host}"
    if "load" not in first.lower():
        first = f"{first} — {load_line()}"
    return first + "\n" + rest


def record(report: str) -> None:
    """Append one report (a markdown section that names the command that made it), stamped."""
    existing = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(existing.rstrip("\n") + "\n\n" + stamped(report).rstrip("\n") + "\n")


def publish(report: str, keep: bool) -> int:
    """A bench script's last step: print its report (stamped), append it here when `keep` (--record); its
    exit code."""
    report = stamped(report)
    print(report)
    if keep:
        record(report)
    return 0
