"""One client must not stall the others: turns across connections, limits that count what is unfinished,
stats that never wait for the engine, prompts refused before tokenizing, a tokenizer off the interpreter
lock, sampling values that cannot break, and 10,000 fuzzed frames with a ping answered after each.

The engine is gated (`GatedEngine`): its steps wait on an event, so what is queued while it is held is
exact, and the assertions are about order and counts, not about time.
"""

from __future__ import annotations

import math
import random
import shutil
import socket
import struct
import sys
import tempfile
import threading
import weakref
from collections import Counter
from contextlib import contextmanager

import msgpack
import pytest
from conftest import ORACLE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import raw_connect

from fomoepy.engine import Engine
from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.protocol import FrameDecoder, encode_frame
from fomoepy.serve.thread import DaemonThread
from fomoepy.serve.worker import FairQueue

MODEL = "qwen3moe_q4_k_m"


class GatedEngine:
    """The real engine, whose steps (prompt chunks, decode steps) wait while `open` is clear; `started`
    lists the prompts of the generations in the order the engine began them."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.open = threading.Event()
        self.open.set()
        self.in_step = threading.Event()
        self.started: list[tuple[int, ...]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start(self, prompt, *args, **kw):
        self.started.append(tuple(prompt))
        return self._engine.start(prompt, *args, **kw)

    def _gate(self) -> None:
        self.in_step.set()
        self.open.wait()

    def prefill(self, gen):
        self._gate()
        return self._engine.prefill(gen)

    def prefill_many(self, gens):
        self._gate()
        return self._engine.prefill_many(gens)

    def decode(self, gens):
        self._gate()
        return self._engine.decode(gens)


@pytest.fixture(scope="module")
def engine() -> GatedEngine:
    return GatedEngine(Engine(ORACLE / f"{MODEL}.gguf"))


@contextmanager
def daemon(engine, **config):
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-f-")
    try:
        with DaemonThread(engine, f"{d}/d.sock", DaemonConfig(**config)) as t:
            yield t
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def held(engine: GatedEngine):
    engine.open.clear()
    engine.in_step.clear()
    try:
        yield
    finally:
        engine.open.set()


def send(s: socket.socket, **request) -> None:
    s.sendall(encode_frame(request))


# each decoder's messages read but not yet returned, gone with the decoder (keyed by id, a new decoder at a
# freed one's address took over its leftovers: a queue-limit test then counted one socket's message as the
# next one's, a rare flake)
_inboxes: weakref.WeakKeyDictionary[FrameDecoder, list[dict]] = weakref.WeakKeyDictionary()


def read_until(s: socket.socket, dec: FrameDecoder, pred) -> list[dict]:
    """Messages up to and including the first that satisfies `pred`; later ones stay for the next call."""
    inbox = _inboxes.setdefault(dec, [])
    while True:
        for i, m in enumerate(inbox):
            if pred(m):
                out, inbox[:] = inbox[: i + 1], inbox[i + 1 :]
                return out
        data = s.recv(1 << 16)
        assert data, "connection closed early"
        inbox += [msgpack.unpackb(p, raw=False) for p in dec.feed(data)]


def told_place(s: socket.socket, dec: FrameDecoder, ids) -> list[dict]:
    """Messages up to the one that completes a `queued` message for each of `ids`: what the daemon sends
    once it has queued them, so the queue holds them all when this returns (no sleep to wait them out)."""
    waiting = set(ids)

    def last_one(m: dict) -> bool:
        if m["type"] == "queued":
            waiting.discard(m["id"])
        return not waiting

    return read_until(s, dec, last_one)


def final(s: socket.socket, dec: FrameDecoder, id) -> tuple[dict, list[dict]]:
    """(the final reply to `id`, every message read on the way)."""
    seen = read_until(s, dec, lambda m: m.get("id") == id and m["type"] not in ("queued", "delta"))
    return seen[-1], seen


# -- turns ------------------------------------------------------------------------------------------


class Sink:
    def __init__(self, name):
        self.name = name


class Item:
    def __init__(self, sink, n):
        self.sink, self.n = sink, n


def test_fair_queue_alternates_a_pipeline_with_one_request_at_a_time():
    y, x = Sink("y"), Sink("x")
    q = FairQueue()
    for i in range(5):
        q.push(Item(y, i))
    q.push(Item(x, 0))
    served = []
    for _ in range(6):
        job = q.pop()
        served.append((job.sink.name, job.n))
        if job.sink is x:
            q.push(Item(x, job.n + 1))  # x sends its next request when the last one started
    assert served == [("y", 0), ("x", 0), ("y", 1), ("x", 1), ("y", 2), ("x", 2)]


def test_fair_queue_a_newcomer_goes_before_the_client_just_served_and_order_predicts_pops():
    a, b, c = Sink("a"), Sink("b"), Sink("c")
    q = FairQueue()
    for i in range(3):
        q.push(Item(a, i))
    assert q.pop().n == 0
    q.push(Item(b, 0))
    q.push(Item(c, 0))
    q.push(Item(b, 1))
    predicted = [(j.sink.name, j.n) for j in q.order()]
    assert predicted == [("b", 0), ("c", 0), ("a", 1), ("b", 1), ("a", 2)]
    assert [(j.sink.name, j.n) for j in (q.pop() for _ in range(5))] == predicted
    assert len(q) == 0


def test_a_short_request_waits_for_one_long_one_not_for_a_whole_pipeline(engine):
    # A pipelines 16 requests of 256 tokens; B's 8-token request arrives while A's first runs. B must
    # start right after it (first come first served made it wait for all 16: 14.7 s measured)
    encode = engine.tokenizer.encode
    with daemon(engine, max_pending=32) as d:
        a, b = raw_connect(d.path), raw_connect(d.path)
        dec_a, dec_b = FrameDecoder(1 << 24), FrameDecoder(1 << 24)
        engine.started.clear()
        with held(engine):
            for i in range(16):
                send(a, op="generate", id=i, prompt=f"fox {i}", max_tokens=256, ignore_eos=True, temperature=0, stream=False)
            assert engine.in_step.wait(10)  # A's first request is in its prefill
            told_place(a, dec_a, range(1, 16))  # the other 15 are queued
            send(b, op="generate", id="b", prompt="fox", max_tokens=8, ignore_eos=True, temperature=0, stream=False)
            queued = read_until(b, dec_b, lambda m: m["type"] == "queued")[-1]
            assert queued["position"] == 0  # next, ahead of A's queued ones
            # what had joined the batch before B came (the held step's: A's first, and with a batch,
            # whichever of A's were queued by then); nothing joins while the step is held
            before = d.call(lambda: len(engine.started))
        done_b, _ = final(b, dec_b, "b")
        assert done_b["type"] == "done" and done_b["usage"]["completion_tokens"] == 8
        assert engine.started[0] == tuple(encode("fox 0"))
        assert all(p != tuple(encode("fox")) for p in engine.started[:before])
        assert engine.started[before] == tuple(encode("fox"))  # B joined at the next step, before A's others
        a.close()  # cancels A's other requests
        b.close()


def test_queued_requests_are_told_their_place_and_told_again_as_it_moves(engine):
    with daemon(engine, max_pending=64) as d:
        s = raw_connect(d.path)
        dec = FrameDecoder(1 << 24)
        with held(engine):
            for i in range(40):
                send(s, op="generate", id=i, prompt="fox", max_tokens=1, temperature=0)
            assert engine.in_step.wait(10)
            seen = told_place(s, dec, range(40))  # all 40 queued before any moves
        seen += read_until(s, dec, lambda m: m.get("id") == 39 and m["type"] == "done")
        positions: dict[int, list[int]] = {}
        for m in seen:
            if m["type"] == "queued":
                positions.setdefault(m["id"], []).append(m["position"])
        # every request was told its place when it was queued, and each place only ever shrank
        assert sorted(positions) == list(range(40))
        for id, places in positions.items():
            assert places == sorted(places, reverse=True) and len(set(places)) == len(places), (id, places)
        # the last one heard its place first (behind those queued before it, less those a step's batch
        # took at once) and then, moving by a quarter or within the last four places, far fewer messages
        # than the moves it made; its last place was within a batch (8) of the front (a step's prompts are
        # evaluated together, so up to a batch of one-token requests ends, and as many join, at once)
        last = positions[39]
        assert last[-1] < 8 and 3 <= len(last) <= 15, last
        s.close()


# -- limits -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_queue_limit_counts_every_unfinished_generation_once(engine):
    # 300 connections send one generate each while the engine is held and 20 tokenize requests keep the
    # tokenizer thread busy: exactly 300 - 256 are refused, as no generation has finished (the old count
    # added unfinished tokenize requests and finished preparation tasks: 69-72 refused)
    with daemon(engine, max_queue=256) as d, held(engine):
        busy = [raw_connect(d.path) for _ in range(2)]
        for k in range(20):
            send(busy[k % 2], op="tokenize", id=k, text="fox " * 50_000)
        socks = [raw_connect(d.path) for _ in range(300)]
        for k, s in enumerate(socks):
            send(s, op="generate", id=k, prompt="fox", max_tokens=1, temperature=0)
        refused = 0
        for k, s in enumerate(socks):
            dec = FrameDecoder(1 << 20)
            first = read_until(s, dec, lambda m: True)[0]
            if first["type"] == "error":
                assert first["code"] == "busy" and "queue is full" in first["message"]
                refused += 1
            else:
                assert first["type"] == "queued"
        assert refused == 300 - 256
        # cheap requests have their own count: a stats request is answered while 256 generations wait
        send(socks[0], op="stats", id="s")
        stats = read_until(socks[0], FrameDecoder(1 << 20), lambda m: m.get("id") == "s")[-1]
        assert stats["type"] == "stats" and stats["stats"]["queue_length"] + stats["stats"]["running"] == 256
        for s in socks + busy:
            s.close()


def test_tokenize_and_stats_obey_the_per_connection_limit(engine):
    with daemon(engine, max_pending=4) as d:
        s = raw_connect(d.path)
        text = "fox " * 200_000  # keeps the tokenizer busy while the rest arrive
        for k in range(12):
            send(s, op="tokenize", id=k, text=text)
        dec, replies = FrameDecoder(1 << 26), []
        while len({m["id"] for m in replies}) < 12:
            replies += read_until(s, dec, lambda m: True)
        busy = [m["id"] for m in replies if m["type"] == "error" and m["code"] == "busy"]
        answered = [m["id"] for m in replies if m["type"] == "tokens"]
        assert len(answered) >= 4 and len(busy) >= 1 and sorted(busy + answered) == list(range(12))
        s.close()


def test_stats_are_answered_while_an_engine_step_is_in_flight(engine):
    with daemon(engine) as d:
        s = raw_connect(d.path)
        dec = FrameDecoder(1 << 24)
        with held(engine):
            send(s, op="generate", id="g", prompt="fox", max_tokens=2, temperature=0)
            assert engine.in_step.wait(10)  # the inference thread is inside a step, held
            send(s, op="stats", id="s")
            reply = read_until(s, dec, lambda m: m.get("id") == "s")[-1]
            assert reply["type"] == "stats" and reply["stats"]["running"] == 1
            assert not engine.open.is_set()  # answered while the step was still held
        assert final(s, dec, "g")[0]["type"] == "done"
        s.close()


# -- large input ----------------------------------------------------------------------------------


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(engine):
    calls = []
    real = engine.tokenizer.encode
    with daemon(engine) as d:
        d.call(lambda: setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k)))
        try:
            s = raw_connect(d.path)
            dec = FrameDecoder(1 << 24)
            big = "def f(x):\n    return x\n" * 150_000  # 3.6 MB
            send(s, op="generate", id=1, prompt=big, max_tokens=1)
            reply, _ = final(s, dec, 1)
            assert reply["type"] == "error" and reply["code"] == "bad_request"
            assert "more than the context" in reply["message"] and not calls
            # within the bound it still tokenizes and answers
            send(s, op="generate", id=2, prompt="fox", max_tokens=1, temperature=0)
            assert final(s, dec, 2)[0]["type"] == "done" and calls
            s.close()
        finally:
            d.call(lambda: delattr(engine.tokenizer, "encode"))


def test_min_token_count_is_a_lower_bound(engine):
    tok = engine.tokenizer
    rng = random.Random(0)
    pieces = ["fox", " ", "é", "漢字", "🙂", "<|im_start|>", "\n", "def", "0123"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        assert tok.min_token_count(text) <= len(tok.encode(text))
        assert tok.min_token_count(text, add_special=False) <= len(tok.encode(text, add_special=False))


def test_a_generations_prompt_never_waits_behind_a_tokenize_request(engine):
    # a tokenize request held inside the tokenizer (as a 4 MB text keeps it for seconds): a generation
    # that arrives after it is still prepared and served, and the tokenize request is answered after
    tokenizer = engine.tokenizer
    inside, release = threading.Event(), threading.Event()
    real = tokenizer.encode

    def encode(text, *args, **kw):
        if text.startswith("HELD"):
            inside.set()
            release.wait(30)
        return real(text, *args, **kw)

    with daemon(engine) as d:
        tokenizer.encode = encode
        try:
            s, g = raw_connect(d.path), raw_connect(d.path)
            g.settimeout(10)
            send(s, op="tokenize", id="t", text="HELD over the hill")
            assert inside.wait(10)
            send(g, op="generate", id="g", prompt="the quick fox", max_tokens=2, temperature=0)
            done, _ = final(g, FrameDecoder(1 << 20), "g")
            assert done["type"] == "done" and not release.is_set()  # served while the tokenize request was held
            release.set()
            reply, _ = final(s, FrameDecoder(1 << 20), "t")
            assert reply["type"] == "tokens" and reply["tokens"] == real("HELD over the hill")
            s.close(), g.close()
        finally:
            release.set()
            del tokenizer.encode


def test_tokenizing_a_large_text_lets_other_threads_run(engine):
    # Decided by order, not time. With the switch interval raised far past the test's length, the
    # interpreter never takes its lock from a running thread: another thread runs only where one gives
    # the lock up. This thread starts the encoder and waits for the lock; if encode gives it up while it
    # works, this thread runs while the encoder is still inside encode; if encode holds it throughout
    # (4 MB took 3.4 s so before the fix), this thread runs next only once encode has returned.
    text = "def f(x):\n    return x + 1  # 漢字\n" * 40_000  # 1.4 MB
    tokenizer = engine.tokenizer  # built here: building it gives the lock up too
    where = ["not started"]
    ids: list[int] = []

    def encoder():
        where[0] = "inside encode"
        ids.extend(tokenizer.encode(text))
        where[0] = "returned"

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e6)
    try:
        t = threading.Thread(target=encoder)
        t.start()  # gives up the lock until the encoder has started; this returns when it gives it up
        seen = where[0]
    finally:
        sys.setswitchinterval(interval)
    t.join()
    assert seen == "inside encode", seen
    assert where[0] == "returned" and len(ids) > 40_000


# -- sampling values --------------------------------------------------------------------------------

# Values that break the arithmetic pass validation, so the profile draws each parameter inside its
# valid range three times in four (edges included) and anything at all otherwise, and a quarter of the
# temperatures below the smallest normal float: a subnormal temperature makes z / temperature overflow to
# inf and the probabilities NaN unless it is greedy. Of the 200 draws, 93 pass validation and 18 of those
# have a subnormal temperature (18-28 under other seeds, about 1 in 10: 200 draws all miss with odds near
# 1e-9). The draws are derandomized (one fixed sequence for this pinned hypothesis and this test), so
# every run tests the same 200; with the greedy edge reverted, each of 15 other seeds found it too.
any_float = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    [5e-324, -5e-324, 1e-308, 1e-7, 1e-6, 1e6, 1e308, -0.0, 0.0, 1.0, math.inf, -math.inf, math.nan]
)
any_int = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry


def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy = any_float) -> st.SearchStrategy:
    """`valid` three times in four, `wild` otherwise."""
    return st.integers(0, 3).flatmap(lambda k: valid if k else wild)


subnormal_or_zero = st.floats(0, sys.float_info.min)  # zero, the subnormals and the smallest normal float
sampling_values = {
    "temperature": st.integers(0, 3).flatmap(lambda k: (subnormal_or_zero, st.floats(0, 2), any_float, any_float)[k]),
    "top_p": mostly(st.floats(0, 1, exclude_min=True)),
    "min_p": mostly(st.floats(0, 1)),
    "repeat_penalty": mostly(st.floats(1e-6, 1e6)),
    "top_k": mostly(st.integers(0, 200), any_int),
    "repeat_last_n": mostly(st.integers(0, 200), any_int),
}


@pytest.fixture(scope="module")
def sampling_daemon(engine):
    with daemon(engine) as d:
        yield d


@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(**sampling_values)
def test_any_number_gives_tokens_or_bad_request_never_internal(sampling_daemon, **sampling):
    s = raw_connect(sampling_daemon.path)
    try:
        send(s, op="generate", id=1, prompt="fox fox", max_tokens=3, seed=1, **sampling)
        reply, _ = final(s, FrameDecoder(1 << 20), 1)
    finally:
        s.close()
    assert reply["type"] in ("done", "error"), reply
    if reply["type"] == "error":
        assert reply["code"] == "bad_request", reply
    else:
        assert reply["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "sampling, outcome",
    [
        ({"temperature": 5e-324}, "done"),  # was "Probabilities contain NaN": now greedy
        ({"temperature": 1e-7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, "done"),
        ({"temperature": 0.5, "repeat_penalty": 5e-324}, "error"),  # was "zero-size array": out of range
        ({"temperature": 0.5, "repeat_penalty": 1e-6}, "done"),  # the edge of the range samples
        ({"temperature": 0.5, "repeat_penalty": 1e6}, "done"),
        ({"temperature": math.inf}, "error"),
    ],
)
def test_sampling_edges(sampling_daemon, sampling, outcome):
    s = raw_connect(sampling_daemon.path)
    send(s, op="generate", id=1, prompt="fox fox fox", max_tokens=4, seed=3, **sampling)
    reply, _ = final(s, FrameDecoder(1 << 20), 1)
    s.close()
    assert reply["type"] == outcome, reply
    if outcome == "error":
        assert reply["code"] == "bad_request"
    else:
        assert reply["usage"]["completion_tokens"] == 4 or reply["finish_reason"] == "eog"


# -- fuzz -----------------------------------------------------------------------------------------

N_FUZZ = 10_000  # frames, each followed by a ping round trip: 3-4 s here, well under a minute on 2 cores
CODES = {"bad_frame", "bad_request", "busy", "frame_too_large"}  # what a fuzzed frame may be refused with


def fuzz_frame(rng: random.Random) -> tuple[str, bytes]:
    """(what kind of frame, its bytes)."""
    kind = rng.random()
    scalars = [None, True, -1, 0, 7, 2**63, 1.5, math.nan, "", "x" * rng.randint(0, 300), b"\x00\xff", [], {}]
    if kind < 0.45:  # a request with random fields
        op = rng.choice(["generate", "cancel", "tokenize", "stats", "ping", "nope", 3, None])
        fields = {rng.choice(["prompt", "messages", "max_tokens", "stream", "stop", "session", "temperature",
                              "top_k", "top_p", "min_p", "repeat_penalty", "seed", "target", "text", "bogus"]):
                  rng.choice(scalars) for _ in range(rng.randint(0, 4))}  # fmt: skip
        return "request", encode_frame({**fields, "op": op, "id": rng.choice([rng.randint(-5, 5), "i", None, 1.5])})
    if kind < 0.5:  # a small valid generation
        return "generation", encode_frame({"op": "generate", "id": f"g{rng.random()}", "prompt": "fox", "max_tokens": rng.randint(0, 2)})
    if kind < 0.75:  # msgpack that is not a map
        payload = msgpack.packb(rng.choice(scalars), use_bin_type=True)
        return "not a map", struct.pack(">I", len(payload)) + payload
    if kind < 0.95:  # garbage in a frame
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        return "garbage", struct.pack(">I", len(payload)) + payload
    return "too large", struct.pack(">I", rng.choice([0x7FFFFFFF, 1 << 30]))  # the daemon replies, then closes


class Closed(Exception):
    pass


class Conn:
    """One connection; every reply read on it is kept in `replies`, in order."""

    def __init__(self, path: str):
        self.sock, self.dec = raw_connect(path), FrameDecoder(1 << 26)
        self.replies: list[dict] = []
        self._unread = 0  # replies[_unread:] are read from the socket but not yet returned

    def until(self, pred) -> list[dict]:
        """The replies up to and including the first that satisfies `pred`; `Closed` if the daemon closes first."""
        while True:
            for i in range(self._unread, len(self.replies)):
                if pred(self.replies[i]):
                    out, self._unread = self.replies[self._unread : i + 1], i + 1
                    return out
            data = self.sock.recv(1 << 16)
            if not data:
                raise Closed(f"closed after {self.replies[self._unread :]}")
            self.replies += [msgpack.unpackb(p, raw=False) for p in self.dec.feed(data)]

    def rest(self) -> list[dict]:
        """The replies until the daemon closes the connection."""
        try:
            self.until(lambda m: False)
        except Closed:
            out, self._unread = self.replies[self._unread :], len(self.replies)
            return out


@pytest.mark.slow
def test_ten_thousand_fuzzed_frames_the_daemon_answers_a_ping_after_each(engine):
    # Every frame but one over the size limit leaves the connection open: the ping sent after it is
    # answered on the same connection (a daemon that closed after a bad frame fails here). A frame over
    # the limit is answered `frame_too_large` and closed, nothing after it; the next frame uses a new
    # connection. Every reply on every connection is kept and checked.
    rng = random.Random(1234)
    kinds: Counter[str] = Counter()
    with daemon(engine, max_frame=1 << 16) as d:
        conns = [Conn(d.path)]
        for k in range(N_FUZZ):
            kind, frame = fuzz_frame(rng)
            kinds[kind] += 1
            c = conns[-1]
            c.sock.sendall(frame)
            if kind == "too large":
                rest = c.rest()
                assert rest and rest[-1]["type"] == "error" and rest[-1]["code"] == "frame_too_large", (k, rest)
                c.sock.close()
                conns.append(Conn(d.path))
                continue
            ping = f"p{k}"
            send(c.sock, op="ping", id=ping)
            try:
                replies = c.until(lambda m, ping=ping: m.get("id") == ping)
            except Closed as e:
                pytest.fail(f"frame {k} ({kind}, {frame[:40]!r}) closed the connection: {e}")
            assert replies[-1]["type"] == "pong", (k, replies)
            if kind in ("not a map", "garbage"):  # answered in order, before the ping
                assert any(m["type"] == "error" and m["id"] is None for m in replies), (k, kind, replies)
        conns[-1].sock.close()
        assert d.alive
    assert kinds["too large"] > 100 and len(conns) == kinds["too large"] + 1  # the close was exercised
    replies = [m for c in conns for m in c.replies]
    errors = Counter(m["code"] for m in replies if m["type"] == "error")
    assert set(errors) <= CODES, errors  # no `internal`, nothing unexpected
    assert errors["bad_frame"] >= kinds["not a map"] and errors["frame_too_large"] == kinds["too large"], errors
    types = Counter(m["type"] for m in replies)
    assert set(types) <= {"error", "pong", "queued", "delta", "done", "ok", "tokens", "stats"}, types
