"""The stand-in driver for the benches that run the engine's GPU path with no GPU (bench/host_time.py,
bench/plan_fidelity_emulated.py): the environment of a child process whose loader finds it (the loader
reads LD_LIBRARY_PATH when the process starts, so the stand-in is loaded by a child, not by the bench)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def standin_env(who: str, vendor: str, mode: str, memory: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ for a child that loads the stand-in driver built for `mode` ("null", "timed"), one device
    of `memory` bytes, in null mode, with the kernel modules in `vendor`'s spellings; for hip, Debian's
    hiprtc beside it. `who` names the bench in the one error line."""
    from fomoepy.runtime.kernels import cache_root
    from fomoepy.runtime.sim.build import standin_drivers

    standin = standin_drivers(cache_root() / f"standin-{mode}")
    paths = [str(standin)]
    if vendor == "hip":
        setup = subprocess.run(["bash", str(ROOT / "tools" / "setup_kernel_compilers.sh")], capture_output=True, text=True, check=False)
        found = [line.split(": ", 1)[1] for line in setup.stdout.splitlines() if line.startswith("hiprtc: ")]
        if not found:
            raise SystemExit(f"{who}: Debian's hiprtc is not available for --vendor hip:\n{setup.stderr[-1500:]}")
        paths.append(found[0])
    return os.environ | {
        "LD_LIBRARY_PATH": ":".join(paths + [os.environ.get("LD_LIBRARY_PATH", "")]),
        "FOMOE_STANDIN_MODULES": str(standin / ("modules-hip" if vendor == "hip" else "modules")),
        "FOMOE_STANDIN_NULL": "1", "FOMOE_STANDIN_DEVICES": "1", "FOMOE_STANDIN_MEMORY": str(memory), **(extra or {}),
    }  # fmt: skip
