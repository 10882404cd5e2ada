"""tools/build_ggml.sh's contract with the set-up commands: it never builds twice, and when it cannot build
(offline, no compiler) it keeps ggml-python's own ggml and says so in one line, exiting 0, except under
CI=true, where the tests must run on the ggml the benchmarks were recorded with, so it fails the run.

The script runs with a stand-in `python3` (the interpreter it drives for pip and for the installed
library's version) and the machine's shell tools."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path: Path, python3: str, ci: bool) -> tuple[int, str, list[str]]:
    """(exit status, its output, the python3 command lines it ran)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "mktemp", "rm", "date", "tail", "tar", "grep", "cut", "nproc", "mv", "echo", "cat"):
        path = shutil.which(tool)
        if path:
            (bin_dir / tool).symlink_to(path)
    log = tmp_path / "python3.log"
    stub = bin_dir / "python3"
    stub.write_text(f"#!{shutil.which('bash')}\necho \"$*\" >> {log}\n{python3}\n")
    stub.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), **({"CI": "true"} if ci else {})}
    r = subprocess.run([shutil.which("bash"), str(ROOT / "tools" / "build_ggml.sh")], env=env, capture_output=True, text=True,
                       timeout=60, check=False)  # fmt: skip
    ran = log.read_text().splitlines() if log.exists() else []
    return r.returncode, r.stdout + r.stderr, ran


# a python3 whose library check prints the installed version (it reads its script from stdin) and
# whose pip fails, as offline
OFFLINE = 'if [ "$1" = - ]; then cat >/dev/null; echo 0.15.3; else echo "ERROR: no network" >&2; exit 1; fi'
BUILT = 'if [ "$1" = - ]; then cat >/dev/null; echo 0.25.3+llamafile; else exit 1; fi'
# llama.cpp's ggml built without llamafile (this script's build until the ninth stop), and offline
BUILT_WITHOUT_LLAMAFILE = 'if [ "$1" = - ]; then cat >/dev/null; echo 0.25.3; else echo "ERROR: no network" >&2; exit 1; fi'


def test_a_failed_download_keeps_the_installed_ggml_and_says_so(tmp_path):
    status, out, ran = run_script(tmp_path, OFFLINE, ci=False)
    assert status == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ggml: kept ggml-python's own ggml (0.15.3): could not download"), out
    assert any(line.startswith("-m pip download") for line in ran) and not any("pip install" in line for line in ran), ran


def test_under_ci_a_failed_build_fails_the_run(tmp_path):
    status, out, _ = run_script(tmp_path, OFFLINE, ci=True)
    assert status == 1 and "under CI the build must succeed" in out, out


def test_an_installed_build_is_not_built_again(tmp_path):
    status, out, ran = run_script(tmp_path, BUILT, ci=True)
    assert status == 0 and "already" in out, out
    assert ran == ["-"], ran  # only the version check


def test_a_build_without_llamafile_is_built_again(tmp_path):
    status, out, ran = run_script(tmp_path, BUILT_WITHOUT_LLAMAFILE, ci=False)
    assert status == 0 and "kept ggml-python's own ggml (0.25.3): could not download" in out, out
    assert any(line.startswith("-m pip download") for line in ran), ran
