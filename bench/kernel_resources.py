"""Per-kernel resources of hip_kernels/ on AMD targets: VGPRs, SGPRs, scratch, static LDS and occupancy,
from clang's AMDGPU back end (fomoepy/devtools/amdgpu_codegen.py), one table per target.

Kernels that differ only in the weight type share a row when their figures are equal (`mv_*_t1` for the
nine types), so the table shows what differs. The device libraries are linked as hiprtc links them
(fomoepy/devtools/amdgpu_device_libs.py); each table's last line counts the kernels that still call a
function or use a dynamic stack (both 0 for code a run-time compiler would produce).

    python bench/kernel_resources.py [--target gfx1201 ...] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from results import publish

from fomoepy.devtools import amdgpu_codegen as ag
from fomoepy.devtools import amdgpu_device_libs as devlibs
from fomoepy.runtime import kernels

TYPE_SUFFIXES = sorted(kernels.KERNEL_TYPE_NAMES.values(), key=len, reverse=True)


def family(name: str) -> tuple[str, str]:
    """mv_q4_k_t1 -> ("mv_*_t1", "q4_k"): the kernel's name with its weight type replaced by *, and the type."""
    for suffix in TYPE_SUFFIXES:
        generic, n = re.subn(rf"_{re.escape(suffix)}(?=_t\d+$|$)", "_*", name)
        if n:
            return generic, suffix
    return name, ""


def table(target: str, resources: list[ag.KernelResources]) -> str:
    rows: dict[tuple, list[str]] = defaultdict(list)
    for k in resources:
        figures = (family(k.name)[0], k.vgprs, k.sgprs, k.vgpr_spills + k.sgpr_spills, k.scratch_bytes, k.lds_bytes,
                   k.max_block, k.occupancy)  # fmt: skip
        rows[figures].append(k.name)
    lines = [f"#### {target}", "", "| kernel | types | VGPRs | SGPRs | spills | scratch B | static LDS B | max block | occupancy (waves/SIMD) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for figures, names in sorted(rows.items()):
        name, types = (figures[0], ", ".join(family(n)[1] for n in names)) if len(names) > 1 else (names[0], "")
        lines.append("| " + " | ".join([name, types, *map(str, figures[1:])]) + " |")
    occ = [k.occupancy for k in resources]
    lines.append("")
    lines.append(f"{len(resources)} kernels; occupancy min {min(occ)}, median {sorted(occ)[len(occ) // 2]}; "
                 f"{sum(k.scratch_bytes > 0 for k in resources)} use scratch; {sum(k.spills for k in resources)} spill; "
                 f"{sum(k.calls > 0 for k in resources)} call a function; {sum(k.dynamic_stack for k in resources)} use a dynamic stack")  # fmt: skip
    return "\n".join(lines)


def shown_command(target: str, clang: str) -> list[str]:
    """The compile command with the library directories as $DEVLIBS (Debian's) and $CACHE (written here)."""
    shown = {devlibs.library_dir(): "$DEVLIBS", devlibs.default_cache_dir(): "$CACHE"}
    libs = devlibs.libraries(target, clang)
    named = {str(p): f"{shown[p.parent]}/{p.name}" for p in libs}
    return [named.get(c, c) for c in ag.compile_command("clang", target, Path("X.hip"), Path("hip_kernels"), libs)]


def linked_line(targets: list[str], clang: str) -> str:
    cache = devlibs.default_cache_dir()
    written = [t for t in targets if devlibs.isa_version_library(t, clang, cache).parent == cache]
    line = f"Device libraries linked: $DEVLIBS = {devlibs.library_dir()} ({devlibs.package_version()})"
    if written:
        line += f"; oclc_isa_version for {', '.join(written)} written into $CACHE (Debian's set has none)"
    return line + "."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", choices=ag.TARGETS, help="default: all of them")
    ap.add_argument("--record", action="store_true", help="append the tables to bench/RESULTS.md")
    args = ap.parse_args()
    targets = args.target or list(ag.TARGETS)
    clang = ag.find_clang()
    sources = kernels.load_sources()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = {(t, s.name): pool.submit(ag.compile_to_assembly, s.name, t, clang) for t in targets for s in sources}
    tables = [table(t, [k for s in sources for k in ag.parse_resources(jobs[t, s.name].result())]) for t in targets]
    cmd = "python bench/kernel_resources.py " + shlex.join(sys.argv[1:])
    report = "\n".join([
        f"### kernel_resources — {date.today()} — {platform.machine()}",
        "",
        f"`{cmd.strip()}`; {ag.clang_version(clang)}; `{shlex.join(shown_command(targets[0], clang))}`",
        "",
        linked_line(targets, clang),
        "",
        "\n\n".join(tables),
    ])  # fmt: skip
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
