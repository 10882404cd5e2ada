"""`fomoe demo` starts the daemon, streams answers through the client, and stops cleanly."""

from __future__ import annotations

import os

from conftest import ORACLE

from fomoepy.cli import main


def test_demo_runs_daemon_and_chat(capsys):
    code = main(["demo", str(ORACLE / "qwen3moe_q4_k_m.gguf"), "-p", "hello", "-n", "5"])
    out, err = capsys.readouterr()
    assert code == 0
    assert ">>> hello" in out
    assert "daemon up on" in err and "daemon stats: uptime" in err
    sock = err.split("daemon up on ")[1].split(" ")[0]
    assert not os.path.exists(sock)  # shut down and cleaned up
