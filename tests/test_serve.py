"""The daemon in-process (a thread with its own uvloop loop), against the engine run directly."""

from __future__ import annotations

import asyncio
import grp
import os
import shutil
import socket
import stat
import struct
import tempfile
import time

import msgpack
import pytest
import uvloop
from conftest import ORACLE, open_oracle_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocol import frames

from fomoepy.engine import Engine
from fomoepy.errors import FomoeError
from fomoepy.sampling import SamplingParams
from fomoepy.serve.client import AsyncClient, Client, ServerError
from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.listen import bind_unix
from fomoepy.serve.protocol import FrameDecoder, encode_frame
from fomoepy.serve.thread import DaemonThread

MODEL = "qwen3moe_q4_k_m"
REPLY_TYPES = {"queued", "delta", "done", "tokens", "stats", "pong", "ok", "error"}


@pytest.fixture(scope="module")
def ref() -> Engine:
    return open_oracle_engine(MODEL)


@pytest.fixture(scope="module")
def tmpdir_short():
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-t-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmpdir_short):
    # a small write buffer, so a client that does not read is noticed after a few frames
    config = DaemonConfig(write_buffer=1024, max_sessions=4, pause_timeout=30.0)
    with DaemonThread(Engine(ORACLE / f"{MODEL}.gguf"), f"{tmpdir_short}/d.sock", config) as d:
        yield d
    assert not os.path.exists(f"{tmpdir_short}/d.sock")  # removed on shutdown


def expected(ref: Engine, prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    tokens = list(ref.generate(prompt_ids, n, SamplingParams.greedy()))
    shown = tokens[:-1] if tokens and tokens[-1] in ref.tokenizer.eog_ids else tokens
    return tokens, ref.tokenizer.decode(shown)


def prompt_text(i: int) -> str:
    return f"fox {i * 7}{' ok' * (i % 3)}"  # short: a prefill costs more than its tokens in decode steps


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(20)
    return s


def read_all(s: socket.socket) -> list[dict]:
    """Every reply until the daemon closes the connection."""
    dec, out = FrameDecoder(1 << 30), []
    while True:
        try:
            data = s.recv(1 << 16)
        except ConnectionResetError:
            break
        if not data:
            break
        out += [msgpack.unpackb(p, raw=False) for p in dec.feed(data)]
    return out


def read_until(s: socket.socket, dec: FrameDecoder, pred) -> list[dict]:
    out: list[dict] = []
    while not out or not pred(out[-1]):
        data = s.recv(1 << 16)
        assert data, "connection closed early"
        out += [msgpack.unpackb(p, raw=False) for p in dec.feed(data)]
    return out


# -- concurrent clients ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_clients", [2, 16])
def test_concurrent_clients_get_the_streams_engine_generate_gives(served, ref, n_clients):
    async def one(i: int):
        async with await AsyncClient.connect(served.path) as c:
            deltas, done = [], None
            async for msg in c.stream(prompt=prompt_text(i), max_tokens=6 + i % 5, temperature=0, return_tokens=True):
                if msg["type"] == "delta":
                    deltas.append(msg["text"])
                else:
                    done = msg
            return "".join(deltas), done

    async def all_clients():
        return await asyncio.gather(*(one(i) for i in range(n_clients)))

    results = uvloop.run(all_clients())
    for i, (text, done) in enumerate(results):
        ids = ref.tokenizer.encode(prompt_text(i))
        tokens, want_text = expected(ref, ids, 6 + i % 5)
        assert done["tokens"] == tokens, f"client {i}"
        assert text == want_text
        assert done["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "cached_tokens": 0}
        assert done["finish_reason"] in ("length", "eog")
        assert set(done["timings"]) == {"queued_s", "prefill_s", "decode_s", "decode_tok_per_s"}


def test_non_streamed_answer_and_a_stop_string(served, ref):
    ids = ref.tokenizer.encode(prompt_text(3))
    _, text = expected(ref, ids, 12)
    with Client(served.path, timeout=30) as c:
        whole = c.complete(prompt=prompt_text(3), max_tokens=12, temperature=0)
        assert whole.text == text and whole.finish_reason in ("length", "eog")
        stop = text[3:5]
        cut = c.complete(prompt=prompt_text(3), max_tokens=12, temperature=0, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


# -- sessions --------------------------------------------------------------------------------------


def test_a_chat_session_does_not_prefill_its_history_again(served, ref):
    turn1 = [{"role": "user", "content": "Hi"}]
    with Client(served.path, timeout=30) as c:
        a1 = c.complete(messages=turn1, session="chat-1", max_tokens=4, temperature=0, return_tokens=True)
        turn2 = turn1 + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "so?"}]
        a2 = c.complete(messages=turn2, session="chat-1", max_tokens=4, temperature=0, return_tokens=True)
        ids1, ids2 = c.tokenize(messages=turn1), c.tokenize(messages=turn2)
    assert a1.usage["cached_tokens"] == 0
    assert len(ids1) <= a2.usage["cached_tokens"] < a2.usage["prompt_tokens"] == len(ids2)
    assert a2.tokens == expected(ref, ids2, 4)[0]  # the same tokens as a fresh prefill of the whole chat


def test_the_same_prompt_again_reuses_all_but_its_last_token(served, ref):
    with Client(served.path, timeout=30) as c:
        first = c.complete(prompt="abc abc abc", session="same", max_tokens=5, temperature=0, return_tokens=True)
        again = c.complete(prompt="abc abc abc", session="same", max_tokens=5, temperature=0, return_tokens=True)
    assert again.usage["cached_tokens"] == again.usage["prompt_tokens"] - 1
    assert again.tokens == first.tokens


def test_sessions_are_bounded(served):
    with Client(served.path, timeout=30) as c:
        for i in range(6):
            c.complete(prompt=f"session {i}", session=f"bounded-{i}", max_tokens=0)
        assert c.stats()["sessions"] == 4  # max_sessions of the fixture


def test_recurrent_state_is_reused_only_when_the_prompt_extends_it(tmpdir_short):
    ref35 = open_oracle_engine("qwen35moe_f32")
    config = DaemonConfig(max_sessions=2)
    with DaemonThread(Engine(ORACLE / "qwen35moe_f32.gguf"), f"{tmpdir_short}/dn.sock", config) as d, \
            Client(d.path, timeout=30) as c:  # fmt: skip
        p1 = "<|im_start|>user"
        p2 = p1 + "<|im_end|>"  # special tokens: the ids of p2 are those of p1 and one more
        ids1, ids2 = ref35.tokenizer.encode(p1), ref35.tokenizer.encode(p2)
        assert ids2[: len(ids1)] == ids1
        c.complete(prompt=p1, session="dn", max_tokens=0)
        r2 = c.complete(prompt=p2, session="dn", max_tokens=6, temperature=0, return_tokens=True)
        assert r2.usage["cached_tokens"] == len(ids1)
        assert r2.tokens == expected(ref35, ids2, 6)[0]
        r3 = c.complete(prompt=p1, session="dn", max_tokens=6, temperature=0, return_tokens=True)  # a rewind
        assert r3.usage["cached_tokens"] == 0
        assert r3.tokens == expected(ref35, ids1, 6)[0]


# -- cancel, disconnect, slow readers --------------------------------------------------------------


def test_cancel_stops_a_generation_at_the_next_token(served):
    async def run():
        async with await AsyncClient.connect(served.path) as c:
            stream = c.stream(prompt=prompt_text(1), max_tokens=400, temperature=0, ignore_eos=True)
            queued = await stream.__anext__()
            assert (queued["type"], queued["position"]) == ("queued", 0)  # nothing else waits
            first = await stream.__anext__()
            assert first["type"] == "delta"
            assert await c.cancel(first["id"]) is True
            rest = [m async for m in stream]
            assert await c.cancel(first["id"]) is False  # finished: nothing to cancel
            return rest[-1]

    done = uvloop.run(run())
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < 400


def test_disconnect_mid_generation_cancels_it_and_the_queue_moves_on(served):
    before = served.call(served.daemon.stats)["completion_tokens"]
    a = raw_connect(served.path)
    a.sendall(encode_frame({"op": "generate", "id": 1, "prompt": prompt_text(2), "max_tokens": 500, "ignore_eos": True}))
    first = read_until(a, FrameDecoder(1 << 20), lambda m: m["type"] == "delta")
    assert [m["type"] for m in first] == ["queued", "delta"]
    a.close()
    t0 = time.monotonic()
    with Client(served.path, timeout=30) as b:
        done = b.complete(prompt="next", max_tokens=3, temperature=0)
    assert done.finish_reason in ("length", "eog")
    assert time.monotonic() - t0 < 20
    produced = served.call(served.daemon.stats)["completion_tokens"] - before
    assert produced < 500 + 3  # A stopped early
    assert served.call(lambda: served.daemon.worker.running) == 0


def slow_reader(served) -> socket.socket:
    """A connection whose client does not read, with small kernel buffers on both sides, so the
    daemon's own write buffer fills after a few frames."""
    before = served.call(lambda: set(served.daemon.state.connections))
    a = raw_connect(served.path)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    deadline = time.monotonic() + 10
    while not (new := served.call(lambda: set(served.daemon.state.connections) - before)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (conn,) = new
    served.call(lambda: conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096))
    return a


def wait_paused(served, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while served.call(served.daemon.stats)["paused"] != n:
        assert time.monotonic() < deadline, f"never {n} paused generations"
        time.sleep(0.02)


def test_a_client_that_does_not_read_is_paused_and_others_go_on(served, ref):
    a = slow_reader(served)
    a.sendall(encode_frame({"op": "generate", "id": "slow", "prompt": prompt_text(4), "max_tokens": 300,
                            "temperature": 0, "ignore_eos": True, "return_tokens": True}))  # fmt: skip
    wait_paused(served, 1)
    with Client(served.path, timeout=30) as b:
        assert b.complete(prompt="meanwhile", max_tokens=3).finish_reason in ("length", "eog")
    replies = read_until(a, FrameDecoder(1 << 20), lambda m: m["type"] == "done")
    a.close()
    done = replies[-1]
    ids = ref.tokenizer.encode(prompt_text(4))
    want = list(ref.generate(ids, 300, SamplingParams.greedy(), stop_at_eog=False))
    assert done["finish_reason"] == "length" and done["tokens"] == want
    assert "".join(m["text"] for m in replies if m["type"] == "delta") == ref.tokenizer.decode(want)


def test_a_paused_generation_is_cancelled_after_the_pause_timeout(served):
    served.call(lambda: setattr(served.daemon.worker, "pause_timeout", 0.2))
    try:
        a = slow_reader(served)
        a.sendall(encode_frame({"op": "generate", "id": 1, "prompt": prompt_text(5), "max_tokens": 450, "ignore_eos": True}))
        wait_paused(served, 1)
        wait_paused(served, 0)
        replies = read_until(a, FrameDecoder(1 << 20), lambda m: m["type"] == "done")
        a.close()
    finally:
        served.call(lambda: setattr(served.daemon.worker, "pause_timeout", 30.0))
    assert replies[-1]["finish_reason"] == "cancelled"
    assert replies[-1]["usage"]["completion_tokens"] < 450


# -- bad input -------------------------------------------------------------------------------------


def test_each_bad_request_gets_an_error_naming_the_problem_and_the_connection_lives(served):
    s = raw_connect(served.path)
    dec = FrameDecoder(1 << 20)
    cases = [
        ({"op": "generate", "id": 1, "prompt": 5}, "prompt must be a string, got int"),
        ({"op": "launch", "id": 2}, "unknown op 'launch'"),
        ({"op": "generate", "id": 3, "prompt": "x" * 3000}, "the prompt has 3000 tokens, more than the context of 512"),
        ({"op": "generate", "id": 4, "prompt": "x", "max_tokens": -2}, "max_tokens must be >= 0, got -2"),
        ({"op": "generate", "id": 5, "messages": [{"role": "user"}]}, "messages[0] must have exactly the keys"),
        ({"op": "generate", "id": 6, "prompt": "x", "top_p": 0}, "top_p must be in (0, 1]"),
        ({"op": "generate", "id": 7, "prompt": ""}, "the prompt is empty"),
        ({"op": "tokenize", "id": 8, "text": 1}, "text must be a string"),
        ({"op": "cancel", "id": 9}, "target is missing"),
        ([1, 2, 3], "a request must be a map"),
    ]
    for request, message in cases:
        s.sendall(encode_frame(request))
        (reply,) = read_until(s, dec, lambda m: True)
        assert reply["type"] == "error" and message in reply["message"], (request, reply)
        assert reply["id"] == (request.get("id") if isinstance(request, dict) else None)
    s.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
    (reply,) = read_until(s, dec, lambda m: True)
    assert reply["code"] == "bad_frame"
    s.sendall(encode_frame({"op": "ping", "id": "still here"}))
    assert read_until(s, dec, lambda m: True) == [{"type": "pong", "id": "still here"}]
    s.sendall(struct.pack(">I", (4 << 20) + 1))
    replies = read_all(s)
    assert [r["code"] for r in replies] == ["frame_too_large"]
    s.close()
    with Client(served.path, timeout=30) as c:
        assert c.ping() >= 0


def test_duplicate_ids_and_the_per_connection_limit(served):
    s = raw_connect(served.path)
    burst = b"".join(encode_frame({"op": "generate", "id": i, "prompt": "hi", "max_tokens": 0}) for i in range(20))
    s.sendall(burst + encode_frame({"op": "ping", "id": 0}))
    replies = []
    dec = FrameDecoder(1 << 20)
    while sum(r["type"] in ("done", "error") for r in replies) < 21:
        replies += read_until(s, dec, lambda m: True)
    s.close()
    busy = [r for r in replies if r.get("code") == "busy"]
    dup = [r for r in replies if r["type"] == "error" and "in use" in r["message"]]
    assert len(busy) == 4 and {r["id"] for r in busy} == {16, 17, 18, 19}
    assert len(dup) == 1 and dup[0]["id"] == 0
    assert sorted(r["id"] for r in replies if r["type"] == "done") == list(range(16))


def test_stats_and_tokenize(served, ref):
    with Client(served.path, timeout=30) as c:
        stats = c.stats()
        assert c.tokenize("hello world") == ref.tokenizer.encode("hello world")
        with pytest.raises(ServerError, match="tokenize: messages"):
            c.tokenize(messages="nope")
    for key in ("uptime_s", "model", "n_ctx", "queue_length", "running", "paused", "connections", "sessions",
                "requests", "prompt_tokens", "completion_tokens", "prefill_tok_per_s", "decode_tok_per_s", "engine"):  # fmt: skip
        assert key in stats
    assert stats["n_ctx"] == 512 and stats["connections"] >= 1
    assert stats["engine"] is None or isinstance(stats["engine"], dict)  # the engine's cache statistics


def test_stats_count_the_engines_own_seconds_and_decode_tokens(served):
    """A request's prompt is one prefill, its first token comes with it, each later token is a decode step's:
    the stats' engine seconds and decode tokens grow so (bench/batch.py reads them)."""
    with Client(served.path, timeout=60) as c:
        before = c.stats()
        done = c.complete(prompt_text(1), max_tokens=6, ignore_eos=True, temperature=0)
        after = c.stats()
    assert done.usage["completion_tokens"] == 6
    assert after["decode_tokens"] - before["decode_tokens"] == 5
    assert after["prompt_tokens"] - before["prompt_tokens"] == done.usage["prompt_tokens"]
    assert after["prefill_s"] > before["prefill_s"] and after["decode_s"] > before["decode_s"]
    assert after["decode_tok_per_s"] == pytest.approx(after["decode_tokens"] / after["decode_s"], rel=1e-3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(frames, min_size=1, max_size=5))
def test_fuzz_live_daemon_answers_or_closes_and_never_dies(served, chunks):
    s = raw_connect(served.path)
    try:
        s.sendall(b"".join(chunks))
        s.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # it closed on an oversized frame already
    for reply in read_all(s):
        assert isinstance(reply, dict) and reply["type"] in REPLY_TYPES
        if reply["type"] == "error":
            assert isinstance(reply["message"], str) and reply["message"]
    s.close()
    assert served.alive


def test_after_the_fuzz_a_good_request_still_gets_the_right_answer(served, ref):
    ids = ref.tokenizer.encode(prompt_text(9))
    with Client(served.path, timeout=30) as c:
        done = c.complete(prompt=prompt_text(9), max_tokens=5, temperature=0, return_tokens=True)
    assert done.tokens == expected(ref, ids, 5)[0]


# -- the socket file -------------------------------------------------------------------------------


def test_socket_is_0600_a_group_makes_it_0660_and_a_stale_one_is_replaced(served, tmpdir_short):
    assert stat.S_IMODE(os.stat(served.path).st_mode) == 0o600
    path = f"{tmpdir_short}/g.sock"
    group = grp.getgrgid(os.getgid()).gr_name
    listener = bind_unix(path, group)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660 and os.stat(path).st_gid == os.getgid()
    listener.sock.close()  # the file stays: a stale socket
    again = bind_unix(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again.remove_file()
    again.sock.close()
    assert not os.path.exists(path)


def test_refuses_a_live_socket_and_a_file_that_is_not_a_socket(served, tmpdir_short):
    with pytest.raises(FomoeError, match="already listening"):
        bind_unix(served.path)
    plain = f"{tmpdir_short}/plain"
    open(plain, "w").close()
    with pytest.raises(FomoeError, match="not a socket"):
        bind_unix(plain)
    with pytest.raises(FomoeError, match="does not exist"):
        bind_unix(f"{tmpdir_short}/missing/x.sock")
    with Client(served.path, timeout=30) as c:
        assert c.ping() >= 0
