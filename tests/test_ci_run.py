"""`.ci/run` under CI (CI=true) fails when the kernel compilers could not be set up, instead of letting
the tests that need them skip; on a developer's machine it says so and goes on.

The script runs in a copy of the repository's shape with stand-ins: a set-up script that exits with a
given status, and a `python3` that only logs what it was asked to run (no install, no test run).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_ci(tmp_path: Path, *, setup_status: int, ci: bool, clang: bool) -> tuple[int, str, list[str]]:
    """(exit status, stderr + stdout, the python3 command lines it ran)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "setup_kernel_compilers.sh").write_text(f"exit {setup_status}\n")
    (tmp_path / "tools" / "build_ggml.sh").write_text("exit 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id"):  # only these from the machine: its clang-19 stays out of sight
        (bin_dir / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "python3.log"
    stubs = {"python3": f'echo "$*" >> {log}\n', "chromedriver": ""}  # chromedriver: no apt-get as root
    if clang:
        stubs["clang-19"] = ""
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!" + shutil.which("bash") + "\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), **({"CI": "true"} if ci else {})}
    r = subprocess.run([shutil.which("bash"), str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60, check=False)
    ran = log.read_text().splitlines() if log.exists() else []
    return r.returncode, r.stderr + r.stdout, ran


def test_a_failed_compiler_setup_fails_the_run_under_ci(tmp_path):
    status, out, ran = run_ci(tmp_path, setup_status=3, ci=True, clang=True)
    assert status == 1 and "under CI the compile checks must run" in out, out
    assert not any("pytest" in line for line in ran), ran


def test_without_ci_a_failed_setup_is_a_message_and_the_tests_run(tmp_path):
    status, out, ran = run_ci(tmp_path, setup_status=3, ci=False, clang=False)
    assert status == 0 and "will say why they skip" in out, out
    assert ran[-1] == "-m pytest -q", ran


def test_under_ci_a_setup_without_clang_fails_the_run(tmp_path):
    # the set-up script goes on without clang-19 (its code generation checks would skip)
    status, out, ran = run_ci(tmp_path, setup_status=0, ci=True, clang=False)
    assert status == 1 and "no clang-19" in out, out
    assert not any("pytest" in line for line in ran), ran
