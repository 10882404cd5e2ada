"""`fomoe chat` and the client classes against an in-process daemon."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest
from conftest import ORACLE, open_oracle_engine

from fomoepy import cli
from fomoepy.engine import Engine
from fomoepy.errors import FomoeError
from fomoepy.sampling import SamplingParams
from fomoepy.serve import chat
from fomoepy.serve.client import Client, DaemonUnavailable
from fomoepy.serve.daemon import Daemon
from fomoepy.serve.thread import DaemonThread

MODEL = "qwen3moe_q4_k_m"


@pytest.fixture(scope="module")
def served():
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-c-")
    with DaemonThread(Engine(ORACLE / f"{MODEL}.gguf"), f"{d}/c.sock") as dt:
        yield dt
    shutil.rmtree(d, ignore_errors=True)


def chat_answer(messages: list[dict], n: int) -> str:
    ref = open_oracle_engine(MODEL)
    tok = ref.tokenizer
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    tokens = list(ref.generate(tok.encode(text), n, SamplingParams.greedy()))
    return tok.decode(t for t in tokens if t not in tok.eog_ids)


def test_one_shot_prints_the_answer_and_exits_0(served, capsys):
    assert cli.main(["chat", "--socket", served.path, "-p", "Hi", "-n", "5", "--temp", "0", "--system", "Be brief"]) == 0
    out = capsys.readouterr().out
    assert out == chat_answer([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}], 5) + "\n"


def test_no_daemon_is_one_error_line_and_exit_1(capsys):
    assert cli.main(["chat", "--socket", "/tmp/fomoe-no-such-dir/x.sock", "-p", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("fomoe: error: cannot connect to the fomoe daemon at /tmp/fomoe-no-such-dir/x.sock")
    with pytest.raises(DaemonUnavailable):
        Client("/tmp/fomoe-no-such-dir/x.sock")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-p", "a\udcffb"], "--prompt is not valid UTF-8 text (bad byte at offset 1)"),
        (["-p", "hi", "--system", "\udcfe"], "--system is not valid UTF-8 text (bad byte at offset 0)"),
        (["-p", "hi", "--seed", "99999999999999999999999"], "--seed must be in [-1, 18446744073709551615], got 99999999999999999999999"),
        (["-p", "hi", "--seed", "-2"], "--seed must be in [-1, 18446744073709551615], got -2"),
        (["-p", "hi", "-n", "99999999999999999999"], "-n must be in [0, 18446744073709551615], got 99999999999999999999"),
        (["-p", "hi", "-n", "-1"], "-n must be in [0, 18446744073709551615], got -1"),
        (["-p", "hi", "--top-k", str(1 << 64)], "--top-k must be in [0, 18446744073709551615]"),
    ],
)  # fmt: skip
def test_what_a_request_cannot_carry_is_refused_before_connecting(capsys, flags, message):
    # (no daemon at this socket: the flags are refused before the client tries to connect)
    assert cli.main(["chat", "--socket", "/tmp/fomoe-no-such-dir/x.sock", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fomoe: error: ") and message in err


def test_seed_minus_one_sends_no_seed():
    import argparse

    args = argparse.Namespace(n_predict=4, temp=0.8, seed=-1, top_k=None, top_p=None, min_p=None, repeat_penalty=None)
    assert chat.sampling_fields(args) == {"max_tokens": 4, "temperature": 0.8}
    assert chat.sampling_fields(argparse.Namespace(**{**vars(args), "seed": 7}))["seed"] == 7


def test_stats_as_lines_and_as_json(served, capsys):
    import json

    assert cli.main(["chat", "--socket", served.path, "--stats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("speed: prefill") and lines[1].startswith("queue: ") and len(lines) <= 8
    assert cli.main(["chat", "--socket", served.path, "--stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["n_ctx"] > 0 and "cache" in stats["engine"] and stats["engine_lines"] == lines[2:]


def test_interactive_keeps_history_in_one_session_and_handles_commands(served, capsys, monkeypatch):
    lines = iter(["Hi", "/stats", "tell me \\", "more", "/reset", '"""', "block", '"""', "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    sent: list[dict] = []
    real_stream = Client.stream

    def spy(self, *args, **kw):
        sent.append({**kw, "messages": list(kw["messages"])})
        done = None
        for msg in real_stream(self, *args, **kw):
            done = msg
            yield msg
        sent[-1]["done"] = done

    monkeypatch.setattr(Client, "stream", spy)
    assert cli.main(["chat", "--socket", served.path, "-n", "3", "--temp", "0"]) == 0
    out = capsys.readouterr().out
    # /stats: readable lines (speed, queue, the engine's tier line), not a dump of the dict
    assert "speed: prefill" in out and "queue: 0 waiting" in out and "experts:" in out and "queue_length" not in out
    assert "(conversation reset)" in out
    assert [m["content"] for m in sent[0]["messages"]] == ["Hi"]
    assert [m["content"] for m in sent[1]["messages"]][::2] == ["Hi", "tell me \nmore"]
    assert sent[1]["messages"][1]["role"] == "assistant"
    assert sent[0]["session"] == sent[1]["session"] != sent[2]["session"]
    assert sent[1]["done"]["usage"]["cached_tokens"] > 0  # the history was not prefilled again
    assert [m["content"] for m in sent[2]["messages"]] == ["block"]


def test_ctrl_c_cancels_the_answer_but_not_the_chat(served, capsys, monkeypatch):
    # Ctrl-C as the answer's first words are written (a timer could fire after a fast machine's whole answer)
    real_write, sent = chat.write, []

    def write(text):
        real_write(text)
        if not sent:
            sent.append(text)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(chat, "write", write)
    with Client(served.path, timeout=30) as c:
        _, reason = chat.stream_answer(c, [{"role": "user", "content": "go"}], "ctrl-c", {"max_tokens": 450, "ignore_eos": True})
        assert reason == "cancelled" and sent
        assert c.ping() >= 0  # the same connection goes on
    assert capsys.readouterr().out.endswith(" [cancelled]\n")


def test_sync_client_stream_cancel_when(served):
    with Client(served.path, timeout=30) as c:
        seen: list[dict] = []
        for msg in c.stream(prompt="fox", max_tokens=450, ignore_eos=True, cancel_when=lambda: len(seen) >= 2):
            seen.append(msg)  # noqa: PERF402  (cancel_when reads seen while the stream runs)
        assert seen[-1]["finish_reason"] == "cancelled" and seen[-1]["usage"]["completion_tokens"] < 450
        assert c.tokenize("fox") == open_oracle_engine(MODEL).tokenizer.encode("fox")


def test_an_abandoned_stream_is_cancelled_and_the_connection_stays_usable(served):
    ref = open_oracle_engine(MODEL)
    want = list(ref.generate(ref.tokenizer.encode("fox"), 3, SamplingParams.greedy()))
    with Client(served.path, timeout=30) as c:
        for msg in c.stream(prompt="fox", max_tokens=450, ignore_eos=True):
            if msg["type"] == "delta":
                break
        assert msg["type"] == "delta"
        assert c.complete(prompt="fox", max_tokens=3, temperature=0, return_tokens=True).tokens == want
        assert c.stats()["running"] == 0  # the abandoned generation was cancelled, not left running


def test_second_signal_forces_the_exit():
    forced: list[int] = []
    daemon = Daemon(open_oracle_engine(MODEL))
    daemon._on_force_exit = lambda: forced.append(1)
    daemon.handle_exit(signal.SIGTERM)
    assert daemon.should_exit.is_set() and forced == []
    daemon.handle_exit(signal.SIGTERM)
    assert forced == [1]


def test_daemon_config_is_validated():
    from fomoepy.serve.config import DaemonConfig

    with pytest.raises(FomoeError, match="max_sessions must be >= 1, got 0"):
        DaemonConfig(max_sessions=0)
    for timeout in (0.0, -1.0, float("nan"), float("inf")):  # (nan passed a `<= 0` check)
        with pytest.raises(FomoeError, match="pause_timeout must be a finite number of seconds > 0"):
            DaemonConfig(pause_timeout=timeout)


def test_a_kv_budget_no_state_fits_in_is_refused_at_start():
    from fomoepy.serve.worker import InferenceWorker

    engine = open_oracle_engine(MODEL)
    with pytest.raises(FomoeError, match="less than the smallest state"):
        InferenceWorker(engine, kv_budget=engine.kv_nbytes(1) - 1)
    InferenceWorker(engine, kv_budget=engine.kv_nbytes(1)).close()  # one chunk: short requests run
