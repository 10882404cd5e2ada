"""The daemon's sans-I/O pieces without sockets: framing, request schema, stop strings, session reuse."""

from __future__ import annotations

import re
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fomoepy.serve.chat import InputAssembler
from fomoepy.serve.jobs import Sessions, StopMatcher, reusable_prefix
from fomoepy.serve.protocol import (
    OPS,
    Cancel,
    FrameDecoder,
    FrameTooLarge,
    Generate,
    Ping,
    ProtocolError,
    RequestError,
    ServerProtocol,
    Stats,
    Tokenize,
    encode_frame,
    parse_request,
)
from fomoepy.serve.worker import plain


def frame(obj) -> bytes:
    return encode_frame(obj)


def raw_frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


# -- framing ---------------------------------------------------------------------------------------


def test_frames_split_at_any_byte_come_out_whole_and_in_order():
    data = b"".join(frame({"op": "ping", "id": i}) for i in range(5))
    for cut in range(1, 7):
        dec = FrameDecoder(1024)
        payloads = []
        for k in range(0, len(data), cut):
            payloads += dec.feed(data[k : k + cut])
        assert [msgpack.unpackb(p)["id"] for p in payloads] == list(range(5))
        assert dec.buffered == 0


def test_frame_over_the_limit_is_refused_from_its_header():
    dec = FrameDecoder(16)
    assert dec.feed(raw_frame(b"x" * 16)) == [b"x" * 16]
    with pytest.raises(FrameTooLarge, match="17 bytes exceeds the limit of 16"):
        dec.feed(struct.pack(">I", 17))


def test_oversized_frame_is_a_fatal_error_and_later_bytes_are_ignored():
    proto = ServerProtocol(max_frame=64)
    events = proto.receive_data(frame({"op": "ping", "id": 1}) + struct.pack(">I", 1 << 31) + b"junk")
    assert isinstance(events[0], Ping)
    assert isinstance(events[1], ProtocolError) and events[1].fatal and events[1].code == "frame_too_large"
    assert proto.closed
    assert proto.receive_data(frame({"op": "ping", "id": 2})) == []


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"", "incomplete"),
        (b"\xc1", "FormatError"),
        (b"\x01\x02", "ExtraData"),
        (b"\xa1\xff", "UnicodeDecodeError"),
        (b"\x81\x01\x02", "map key"),
        (b"\x91" * 5000 + b"\x01", "StackError"),
    ],
)
def test_undecodable_payload_is_a_bad_frame_and_the_connection_goes_on(payload, fragment):
    proto = ServerProtocol()
    bad, ping = proto.receive_data(raw_frame(payload) + frame({"op": "ping", "id": 9}))
    assert isinstance(bad, ProtocolError) and bad.code == "bad_frame" and not bad.fatal
    assert fragment in bad.message
    assert ping == Ping(9)
    assert not proto.closed


# -- the schema ------------------------------------------------------------------------------------


def test_every_op_parses_with_its_defaults():
    g = parse_request({"op": "generate", "id": 1, "prompt": "hi"})
    assert isinstance(g, Generate) and g.max_tokens == 256 and g.stream and g.stop == () and g.session is None
    assert g.sampling == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                          "repeat_penalty": 1.0, "repeat_last_n": 64, "seed": None}  # fmt: skip
    assert parse_request({"op": "cancel", "id": "c", "target": 1}) == Cancel("c", 1)
    assert parse_request({"op": "tokenize", "id": 2, "text": "a"}) == Tokenize(2, "a", None)
    assert parse_request({"op": "stats", "id": 3}) == Stats(3)
    assert parse_request({"op": "ping", "id": 4}) == Ping(4)
    assert set(OPS) == {"generate", "cancel", "tokenize", "stats", "ping"}


def test_generate_with_messages_stop_list_and_session():
    m = [{"role": "user", "content": "hi"}]
    g = parse_request({"op": "generate", "id": "a", "messages": m, "stop": ["\n", "##"], "session": "s1",
                       "max_tokens": 0, "temperature": 0, "seed": 7, "stream": False})  # fmt: skip
    assert g.messages == m and g.prompt is None and g.stop == ("\n", "##") and g.session == "s1"
    assert g.max_tokens == 0 and g.sampling["temperature"] == 0.0 and g.sampling["seed"] == 7 and not g.stream
    assert parse_request({"op": "generate", "id": 1, "prompt": "x", "stop": "END"}).stop == ("END",)


GEN = {"op": "generate", "id": 5, "prompt": "hi"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
        ({"max_tokens": "10"}, "max_tokens must be an integer, got str"),
        ({"max_tokens": True}, "max_tokens must be an integer, got bool"),
        ({"max_tokens": 1 << 63}, "max_tokens is too large"),
        ({"temperature": "hot"}, "temperature must be a number, got str"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_k": 1.5}, "top_k must be an integer, got float"),
        ({"seed": -1}, "seed must be in [0, 2**64)"),
        ({"seed": 1.0}, "seed must be an integer or nil"),
        ({"stream": 1}, "stream must be true or false, got int"),
        ({"stop": 3}, "stop must be a string or a list of strings, got int"),
        ({"stop": ["a"] * 9}, "at most 8"),
        ({"stop": [""]}, "stop[0] must have 1..256 characters"),
        ({"stop": ["ok", None]}, "stop[1] must be a string, got nil"),
        ({"session": ""}, "session must have 1..128 characters"),
        ({"session": 12}, "session must be a string, got int"),
        ({"prompt": 12}, "prompt must be a string, got int"),
        ({"prompt": None}, "give exactly one of prompt and messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "give exactly one of prompt and messages"),
        ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ],
)
def test_generate_field_errors_name_the_field(change, message):
    req = {**GEN, **change}
    with pytest.raises(RequestError) as e:
        parse_request(req)
    assert message in str(e.value) and e.value.id == 5 and e.value.code == "bad_request"


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hi", "messages must be a list, got str"),
        ([], "messages must have 1.."),
        (["hi"], "messages[0] must be a map"),
        ([{"role": "user"}], "messages[0] must have exactly the keys role and content"),
        ([{"role": "user", "content": 1}], "messages[0].content must be a string, got int"),
        ([{"role": "", "content": "x"}], "messages[0].role is empty"),
    ],
)
def test_bad_messages(messages, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        parse_request({"op": "generate", "id": 1, "messages": messages})


@pytest.mark.parametrize(
    "obj, code, message, id",
    [
        ([1, 2], "bad_frame", "a request must be a map, got list", None),
        ({"op": "ping"}, "bad_request", "id is missing", None),
        ({"op": "ping", "id": 1.5}, "bad_request", "id must be an integer or a string, got float", None),
        ({"op": "ping", "id": ""}, "bad_request", "id must have 1..128 characters", None),
        ({"op": "ping", "id": (1 << 64) - 1}, "bad_request", "id is out of range", None),
        ({"id": 3}, "bad_request", "op must be a string, got nil", 3),
        ({"id": 3, "op": "__class__"}, "bad_request", "unknown op '__class__'", 3),
        ({"id": 3, "op": "ping", "x": 1}, "bad_request", "ping: unknown field 'x'", 3),
        ({"id": 3, "op": "cancel"}, "bad_request", "target is missing", 3),
        ({"id": 3, "op": "cancel", "target": [1]}, "bad_request", "cancel: target must be an integer or a string", 3),
        ({"id": 3, "op": "tokenize", "text": b"x"}, "bad_request", "text must be a string, got bytes", 3),
    ],
)
def test_request_errors(obj, code, message, id):
    (event,) = ServerProtocol().receive_data(frame(obj))
    assert isinstance(event, ProtocolError)
    assert (event.code, event.id) == (code, id)
    assert message in event.message
    reply = event.reply()
    assert reply["type"] == "error" and reply["id"] == id


@pytest.mark.parametrize(
    "target, message",
    [
        (1.5, "cancel: target must be an integer or a string, got float"),
        (None, "cancel: target must be an integer or a string, got nil"),
        ("", "cancel: target must have 1..128 characters, got 0"),
        ([1], "cancel: target must be an integer or a string, got list"),
        ("x" * 129, "cancel: target must have 1..128 characters, got 129"),
        (1 << 63, "cancel: target is out of range"),
    ],
)
def test_a_bad_cancel_target_is_answered_with_the_requests_own_id(target, message):
    # the frame's id was usable, so the client must be able to tell which of its requests failed
    (event,) = ServerProtocol().receive_data(frame({"op": "cancel", "id": 1, "target": target}))
    assert isinstance(event, ProtocolError)
    assert (event.code, event.id) == ("bad_request", 1)
    assert event.message.startswith(message), event.message


# -- fuzz: any bytes give requests or errors, never an exception -------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20),
)  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=5)  # fmt: skip
FIELDS = ["prompt", "messages", "max_tokens", "stream", "stop", "session", "temperature", "top_k", "top_p",
          "min_p", "repeat_penalty", "repeat_last_n", "seed", "return_tokens", "ignore_eos", "target", "text",
          "add_special", "parse_special", "bogus"]  # fmt: skip
requests = st.builds(
    lambda op, id, fields: {**fields, "op": op, "id": id},
    st.sampled_from([*OPS, "nope"]) | scalars,
    st.integers(-3, 3) | st.text(max_size=3) | scalars,
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=4),
)
frames = st.one_of(
    requests.map(frame),
    values.map(lambda v: raw_frame(msgpack.packb(v, use_bin_type=True))),
    st.binary(max_size=64).map(raw_frame),
    st.binary(max_size=64),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, max_size=6), st.integers(1, 40), st.integers(16, 256))
def test_fuzz_sans_io_never_raises_and_stays_in_sync(chunks, cut, max_frame):
    proto = ServerProtocol(max_frame=max_frame)
    data = b"".join(chunks)
    events = []
    for k in range(0, len(data), cut):
        events += proto.receive_data(data[k : k + cut])
    for event in events:
        assert isinstance(event, (ProtocolError, Generate, Cancel, Tokenize, Stats, Ping))
        if isinstance(event, ProtocolError):
            msgpack.packb(event.reply())  # the reply is always sendable
            assert event.fatal == (event.code == "frame_too_large")
    assert sum(isinstance(e, ProtocolError) and e.fatal for e in events) <= 1
    if not proto.closed and not proto.mid_frame:
        # framing stayed in step: a well-formed request still parses
        assert proto.receive_data(frame({"op": "ping", "id": 1})) == [Ping(1)]


# -- stop strings ----------------------------------------------------------------------------------


def reference_stop(pieces, stops) -> tuple[str, bool]:
    """Generation stops once the text holds a stop string; the answer ends before the earliest one."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("abc", max_size=4), max_size=10), st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_matcher_cuts_where_the_text_so_far_first_holds_a_stop_string(pieces, stops):
    m = StopMatcher(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    assert ("".join(out), stopped) == reference_stop(pieces, stops)


def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</en") == ("", False)
    assert m.feed("d>tail") == ("", True)


def test_a_stop_string_ends_the_answer_even_if_a_longer_one_could_have_started_earlier():
    m = StopMatcher(["b", "cbb"])
    assert m.feed("cb") == ("c", True)  # generation stops here: "cbb" can no longer happen


# -- session reuse ---------------------------------------------------------------------------------


def test_reusable_prefix_rewinds_a_kv_cache_to_the_common_prefix():
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 9], can_rewind=True) == 2
    assert reusable_prefix([1, 2, 3], [1, 2, 3], can_rewind=True) == 2  # one token is always evaluated
    assert reusable_prefix([1, 2, 3], [1, 2, 3, 4, 5], can_rewind=True) == 3
    assert reusable_prefix([7], [1, 2], can_rewind=True) == 0


def test_reusable_prefix_keeps_a_recurrent_state_only_when_the_prompt_extends_it():
    assert reusable_prefix([1, 2, 3], [1, 2, 3, 4], can_rewind=False) == 3
    assert reusable_prefix([1, 2, 3], [1, 2, 3], can_rewind=False) is None
    assert reusable_prefix([1, 2, 3], [1, 2, 4, 5], can_rewind=False) is None
    assert reusable_prefix([], [1], can_rewind=False) == 0


def test_sessions_drop_the_least_recently_used():
    s = Sessions(2)
    s.checkin("a", "A")
    s.checkin("b", "B")
    s.checkin("a", s.checkout("a"))  # a is now the most recent
    s.checkin("c", "C")
    assert len(s) == 2 and s.checkout("b") is None and s.checkout("a") == "A" and s.checkout("c") == "C"
    assert s.checkout("a") is None  # checked out: a concurrent request of the session starts fresh


# -- chat input and stats ---------------------------------------------------------------------------


def feed_lines(lines):
    a, out = InputAssembler(), []
    for line in lines:
        text = a.feed(line)
        if text is not None:
            out.append(text)
    return out, a.continuing


def test_chat_input_backslash_continues_and_triple_quotes_make_a_block():
    assert feed_lines(["one", "two"]) == (["one", "two"], False)
    assert feed_lines(["first \\", "second"]) == (["first \nsecond"], False)
    assert feed_lines(['"""', "a", "", "b", '"""']) == (["a\n\nb"], False)
    assert feed_lines(['"""start', "middle", 'end"""']) == (["start\nmiddle\nend"], False)
    assert feed_lines(['"""one line"""']) == (["one line"], False)
    assert feed_lines(['"""', "open"]) == ([], True)


def test_plain_makes_engine_stats_msgpack_data():
    import dataclasses

    import numpy as np

    @dataclasses.dataclass
    class Tier:
        hits: int
        rate: float

    data = plain({"vram": Tier(3, 0.5), "n": np.int64(4), "ids": (1, 2), "obj": object})
    assert data["vram"] == {"hits": 3, "rate": 0.5} and data["n"] == 4 and data["ids"] == [1, 2]
    msgpack.packb(data)
