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


def test_the_default_thread_count_leaves_out_the_cores_other_processes_keep_busy(monkeypatch):
    from types import SimpleNamespace

    from fomoepy.runtime import backends

    monkeypatch.setattr(backends.os, "cpu_count", lambda: 4)
    large = SimpleNamespace(n_embd=1024, moe=SimpleNamespace(expert_ff=512))

    def seen(*counts):
        it = iter(counts)
        return lambda: next(it)

    assert backends.cpu_threads(large, None, seen(1, 1, 1, 1, 1)) == 4  # only this thread runnable
    assert backends.cpu_threads(large, None, seen(2, 3, 2, 2, 3)) == 3  # one other busy throughout
    assert backends.cpu_threads(large, None, seen(3, 1, 3, 3, 3)) == 4  # busy for an instant only
    assert backends.cpu_threads(large, None, seen(9, 9, 9, 9, 9)) == 1  # never below one
    assert backends.cpu_threads(large, 3, seen()) == 3  # -t wins, nothing sampled
    small = SimpleNamespace(n_embd=64, moe=SimpleNamespace(expert_ff=64))
    assert backends.cpu_threads(small, None, seen()) == 1


def test_the_machines_runnable_threads_count_this_one():
    from fomoepy.runtime import backends

    assert backends._runnable() >= 1
