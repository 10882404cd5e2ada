"""ggml's OpenMP threads spin while they wait only where each has a free core (fomoepy.runtime.ggml_threads),
unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

UNSET_SPINS = 300000  # libgomp's spins before a waiting thread sleeps when no policy is set


def openmp_spin_count(env_policy: str | None, code: str = "import fomoepy.runtime.ggml_matmul") -> int:
    """How long libgomp's waiting threads spin (GOMP_SPINCOUNT, as it reports at its start with
    OMP_DISPLAY_ENV=VERBOSE: 0 under the passive policy) in a process running `code`, which loads ggml."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert lines, out.stderr
    return int(lines[0].split("=")[1].strip().strip("'"))


def test_ggml_loaded_without_a_thread_count_sleeps_while_it_waits():
    assert openmp_spin_count(None) == 0


def opened_with(threads: int, runnable: int) -> str:
    """Code that opens the cpu backend on `threads` on a 2-core machine where /proc/loadavg counts
    `runnable` threads (this one included) at every sample."""
    return ("from fomoepy.runtime import backends\n"
            "backends.os.cpu_count = lambda: 2\n"
            f"backends._runnable = lambda: {runnable}\n"
            f"backends.make_backend('cpu', {threads})\n")  # fmt: skip


@pytest.mark.parametrize("threads, runnable, spins", [
    (2, 1, UNSET_SPINS),  # idle: each thread has a core, they spin as OpenMP's default (llama.cpp's)
    (2, 2, 0),  # another process busy throughout: one thread would spin on the core the other needs
    (1, 1, 0),  # one thread never waits for another: nothing to choose
])  # fmt: skip
def test_the_cpu_backend_spins_only_where_each_thread_has_a_free_core(threads, runnable, spins):
    assert openmp_spin_count(None, opened_with(threads, runnable)) == spins


def test_a_choice_made_after_ggml_loaded_reports_the_policy_libgomp_read():
    code = ("import fomoepy.runtime.ggml_matmul\n"
            "from fomoepy.runtime import ggml_threads\n"
            "print(ggml_threads.choose(2, lambda: 2))\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "passive"


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


def test_this_processs_own_runnable_threads_are_not_counted_as_other_processes_load(tmp_path):
    from fomoepy.runtime import backends

    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 4/120 999\n")
    tasks = tmp_path / "self" / "task"
    for tid, state in ((10, "R"), (11, "R"), (12, "S")):  # this thread and a spinning BLAS thread; one asleep
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (python3 (x) y) {state} 1 1 1 0 -1 0\n")
    assert backends._own_runnable(str(tmp_path)) == 2
    assert backends._runnable(str(tmp_path)) == 3  # 2 threads of other processes, and this one


@pytest.mark.parametrize("env, spins", [
    ({}, True),  # OpenMP's default: spin, then sleep
    ({"OMP_WAIT_POLICY": "passive"}, False),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
    ({"OMP_WAIT_POLICY": "active"}, True),
    ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "3000"}, True),  # libgomp: the count wins
    ({"GOMP_SPINCOUNT": "0"}, False),
])  # fmt: skip
def test_whether_waiting_threads_spin_follows_the_environment_libgomp_reads(monkeypatch, env, spins):
    from fomoepy.runtime import ggml_threads

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ggml_threads.spins() == spins
