"""ggml's OpenMP threads sleep while they wait (fomoepy.runtime.ggml_threads), unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

UNSET_SPINS = 300000  # libgomp's spins before a waiting thread sleeps when no policy is set


def openmp_spin_count(env_policy: str | None) -> int:
    """How long libgomp's waiting threads spin (GOMP_SPINCOUNT, as it reports at its start with
    OMP_DISPLAY_ENV=VERBOSE: 0 under the passive policy) in a process importing the cpu backend."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", "import fomoepy.runtime.ggml_matmul"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert lines, out.stderr
    return int(lines[0].split("=")[1].strip().strip("'"))


def test_the_cpu_backends_openmp_threads_sleep_while_they_wait():
    assert openmp_spin_count(None) == 0


@pytest.mark.parametrize("chosen", ["active", "passive"])
def test_a_wait_policy_the_user_set_is_kept(chosen):
    spins = openmp_spin_count(chosen)
    assert spins > UNSET_SPINS if chosen == "active" else spins == 0
