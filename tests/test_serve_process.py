"""`fomoe serve` as a process: readiness via sd_notify, 0600 socket, SIGTERM, socket activation."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import ORACLE, open_oracle_engine

from fomoepy.sampling import SamplingParams
from fomoepy.serve.client import Client

MODEL = str(ORACLE / "qwen3moe_q4_k_m.gguf")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-p-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Notifications:
    """A stand-in for systemd's notify socket."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.seen: list[str] = []

    def wait_for(self, line: str, proc: subprocess.Popen, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.seen:
            assert time.monotonic() < deadline, f"no {line!r} from the daemon; got {self.seen}"
            if proc.poll() is not None and proc.returncode != 0:
                pytest.fail(f"the daemon exited with {proc.returncode}: {proc.stderr.read()}")
            self.sock.settimeout(0.1)
            try:
                self.seen += self.sock.recv(4096).decode().split("\n")
            except TimeoutError:
                pass

    def close(self) -> None:
        self.sock.close()


def serve(args: list[str], notify: Notifications | None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def serve_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "fomoepy.cli", "serve", MODEL, *extra]


def test_sigterm_cancels_in_flight_work_with_a_final_message_and_removes_the_socket(workdir):
    path = f"{workdir}/fomoe.sock"
    notes = Notifications(f"{workdir}/notify")
    proc = serve(serve_cmd("--socket", path), notes)
    try:
        notes.wait_for("READY=1", proc)
        assert any(line.startswith("STATUS=ready") for line in notes.seen)
        assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600

        second = subprocess.run(serve_cmd("--socket", path), capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 1 and "already listening" in second.stderr

        chat = subprocess.run(
            [sys.executable, "-m", "fomoepy.cli", "chat", "--socket", path, "-p", "Hi", "-n", "4", "--temp", "0"],
            capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": ROOT},
        )  # fmt: skip
        assert chat.returncode == 0, chat.stderr
        ref = open_oracle_engine("qwen3moe_q4_k_m")
        tok = ref.tokenizer
        ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        tokens = list(ref.generate(ids, 4, SamplingParams.greedy()))
        shown = [t for t in tokens if t not in tok.eog_ids]
        assert chat.stdout == tok.decode(shown) + "\n"

        with Client(path, timeout=30) as c:
            stream = c.stream(prompt="fox", max_tokens=450, ignore_eos=True)
            assert [next(stream)["type"] for _ in range(2)] == ["queued", "delta"]
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "cancelled"
        assert rest[-1]["usage"]["completion_tokens"] < 450
        assert proc.wait(timeout=30) == 0
        notes.wait_for("STOPPING=1", proc)
        assert not os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        notes.close()


def test_socket_activation_uses_fd_3_and_leaves_systemds_socket_alone(workdir):
    path = f"{workdir}/activated.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(16)
    fd = listening.fileno()
    notes = Notifications(f"{workdir}/notify")
    # what systemd does: the socket as fd 3, LISTEN_PID = the daemon's own pid (exec keeps the pid)
    activate = (
        f"import os, sys; os.dup2({fd}, 3); os.close({fd}); "
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); os.execv(sys.executable, sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", activate, *serve_cmd("--socket", f"{workdir}/not-used.sock")]
    proc = serve(cmd, notes, pass_fds=(fd,))
    try:
        notes.wait_for("READY=1", proc)
        with Client(path, timeout=30) as c:
            assert c.complete(prompt="hi", max_tokens=2).usage["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert os.path.exists(path)  # the .socket unit's file: not ours to remove
        assert not os.path.exists(f"{workdir}/not-used.sock")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        listening.close()
        notes.close()


SYSTEMD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "systemd")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_units_pass_systemd_analyze_verify(tmp_path):
    # the units as shipped, but for ExecStart's path (the unit expects /usr/local/bin/fomoe; verify checks
    # that it is executable): every key known, the service startable, the socket's service found
    for name in ("fomoe.service", "fomoe.socket"):
        with open(os.path.join(SYSTEMD, name)) as f:
            text = f.read()
        (tmp_path / name).write_text(text.replace("/usr/local/bin/fomoe", sys.executable))
    run = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "fomoe.socket"), str(tmp_path / "fomoe.service")],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr
