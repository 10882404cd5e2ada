"""The daemon's wire protocol: framing, request schema and limits, as a sans-I/O class fed bytes.

Frame layout (both directions)::

    +----------------------+--------------------------------------+
    | N: u32, big-endian   | N bytes: one msgpack map, str keys   |
    +----------------------+--------------------------------------+

N is at most the receiver's frame limit (the daemon's `--max-frame-bytes`, 4 MiB by default). A longer
N gets an error reply (code `frame_too_large`) and the connection is closed: the stream cannot be
trusted after it. Any other bad frame (not msgpack, not a map, a bad field) gets an error reply and the
connection lives on.

Requests (client → daemon). Every request is a map with `op` and `id`; `id` is an int (|id| < 2**63) or
a str of 1..128 characters, unique among the connection's unfinished requests, and every reply to the
request carries it. Unknown keys are errors.

| op | fields (default) |
|---|---|
| `generate` | exactly one of `prompt` (str, tokenized with special-token parsing, BOS where the GGUF asks for one) or `messages` ([{role: str, content: str}], rendered by the model's chat template with the assistant turn opened); `max_tokens` int ≥ 0 (256); `stream` bool (true); `stop` str or [str] (≤ 8 strings of 1..256 chars); `session` str 1..128 chars (none); `return_tokens` bool (false); `ignore_eos` bool (false); sampling (ranges and edges in fomoepy.sampling.SamplingParams): `temperature` (0.8; finite ≥ 0, below 1e-6 greedy), `top_k` (40), `top_p` (0.95; (0, 1]), `min_p` (0.05; [0, 1]), `repeat_penalty` (1.0; [1e-6, 1e6]), `repeat_last_n` (64), `seed` (int ≥ 0 or nil) |
| `cancel` | `target`: the id of an unfinished `generate` of this connection |
| `tokenize` | `text` (str) or `messages` (as above); `add_special` bool (true); `parse_special` bool (true) |
| `stats` | — |
| `ping` | — |

Replies (daemon → client), each a map with `type` and `id`:

| type | fields | in answer to |
|---|---|---|
| `queued` | `position`: how many requests will start before this one (clients take turns, one request each); sent when it is queued and when the position moves by a quarter, or within the last four places | `generate`, zero or more, before its first `delta` |
| `delta` | `text`: the next piece of text (complete UTF-8 characters only) | `generate` with `stream` on, zero or more |
| `done` | `finish_reason` (`eog` end-of-generation token, `length` max_tokens or context full, `stop` a stop string, `cancelled`); `usage` {`prompt_tokens`, `completion_tokens`, `cached_tokens`}; `timings` {`queued_s`, `prefill_s`, `decode_s`, `decode_tok_per_s`}; `text` (stream off); `tokens` (return_tokens) | `generate`, last (or an `error`) |
| `tokens` | `tokens` [int], `count` | `tokenize` |
| `stats` | `stats` map: `uptime_s`, `model`, `n_ctx`, `queue_length`, `running`, `paused`, `connections`, `sessions`, `requests`, `prompt_tokens`, `completion_tokens`, `prefill_tok_per_s`, `decode_tok_per_s`, `prefill_s` and `decode_s` (the engine's seconds in prompt and in decode steps), `decode_tokens` (the decode steps' tokens: a request's first comes with its prompt), `engine` (the engine's own statistics: tiers, hit rates; nil until it has them), `engine_lines` (the engine's summary lines, as `fomoe generate` prints them), `outcomes` {finish reason or error code: count}, `engine_stats_age_s` (answered without waiting for the engine: while a step runs, the copy taken after the previous one) | `stats` |
| `pong` | — | `ping` |
| `ok` | `cancelled` bool (false: the target had already finished) | `cancel` |
| `error` | `code`, `message` (one line naming the problem); `id` nil when the frame had no usable id | anything |

Error codes: `bad_frame` (not a msgpack map), `frame_too_large` (then closed), `bad_request` (a field is
missing, unknown, of the wrong type or out of range; an unknown op; a prompt longer than the context,
refused before tokenizing when its byte count already rules it out; a prompt + max_tokens whose KV cache
exceeds the daemon's KV budget), `busy` (too many unfinished requests
on the connection, or `max_queue` unfinished generations, or as many unfinished tokenize/stats requests,
daemon-wide), `shutting_down`, `internal` (a bug: logged by the daemon).

Closing the connection (or half-closing it) cancels its unfinished generations. A client that does not
read its replies has its generation paused, not the engine (see fomoepy.serve.worker).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fomoepy.errors import FomoeError

HEADER = struct.Struct(">I")
# messages that report progress on a request; any other type is its final reply
PROGRESS = frozenset({"queued", "delta"})

DEFAULT_MAX_FRAME = 4 << 20  # what the daemon accepts by default: a 256k-token prompt is ~1 MiB of text
CLIENT_MAX_FRAME = 256 << 20  # what a client accepts: a non-streamed answer or a token list can be long

MAX_ID_LEN = 128
MAX_STOP = 8
MAX_STOP_LEN = 256
MAX_SESSION_LEN = 128
MAX_MESSAGES = 100_000
DEFAULT_MAX_TOKENS = 256
INT_LIMIT = 1 << 63

RequestId = int | str


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/fomoe.sock for a user's daemon, else the system daemon's /run/fomoe/fomoe.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "fomoe.sock") if runtime else "/run/fomoe/fomoe.sock"


# -- framing ---------------------------------------------------------------------------------------


def encode_frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


class FrameTooLarge(FomoeError):
    """A frame header announced more bytes than the receiver accepts; `frames`: the whole frames before it."""

    def __init__(self, message: str, frames: list[bytes]):
        super().__init__(message)
        self.frames = frames


class FrameDecoder:
    """Bytes in, payloads out: `feed(data)` returns every complete frame's payload (bytes), in order.

    Raises FrameTooLarge at the first header over `max_frame` (carrying the frames before it); the
    decoder is then unusable.
    """

    def __init__(self, max_frame: int):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # payload length of the frame being read; None: reading a header

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return frames
                (n,) = HEADER.unpack_from(self._buf)
                if n > self.max_frame:
                    self._buf.clear()
                    raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {self.max_frame} bytes", frames)
                del self._buf[: HEADER.size]
                self._need = n
            if len(self._buf) < self._need:
                return frames
            frames.append(bytes(self._buf[: self._need]))
            del self._buf[: self._need]
            self._need = None

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (a connection that ends with some was cut mid-frame)."""
        return len(self._buf) + (HEADER.size if self._need is not None else 0)


def decode_payload(payload: bytes) -> Any:
    """One msgpack object, or ValueError naming what is wrong."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        # msgpack's own errors subclass ValueError; TypeError/OverflowError guard odd ext payloads
        raise ValueError(f"not a msgpack object ({type(e).__name__}: {str(e) or 'malformed'})") from None


# -- requests --------------------------------------------------------------------------------------


class RequestError(FomoeError):
    """A request that breaks the schema; `id` is the request's id when it had a usable one."""

    def __init__(self, message: str, id: RequestId | None = None, code: str = "bad_request"):
        super().__init__(message)
        self.id = id
        self.code = code


@dataclass(frozen=True)
class Generate:
    id: RequestId
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stream: bool = True
    stop: tuple[str, ...] = ()
    session: str | None = None
    return_tokens: bool = False
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments


@dataclass(frozen=True)
class Cancel:
    id: RequestId
    target: RequestId


@dataclass(frozen=True)
class Tokenize:
    id: RequestId
    text: str | None
    messages: list[dict[str, str]] | None
    add_special: bool = True
    parse_special: bool = True


@dataclass(frozen=True)
class Stats:
    id: RequestId


@dataclass(frozen=True)
class Ping:
    id: RequestId


Request = Generate | Cancel | Tokenize | Stats | Ping


def _type_name(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """The fields of one request map, read once each; leftovers are unknown keys."""

    def __init__(self, op: str, id: RequestId, fields: dict[str, Any]):
        self.op, self.id = op, id
        self._left = dict(fields)

    def fail(self, message: str) -> RequestError:
        return RequestError(f"{self.op}: {message}", self.id)

    def has(self, key: str) -> bool:
        return key in self._left

    def take(self, key: str, default: Any = None) -> Any:
        return self._left.pop(key, default)

    def integer(self, key: str, default: int, lo: int = 0) -> int:
        value = self.take(key, default)
        if not _is_int(value):
            raise self.fail(f"{key} must be an integer, got {_type_name(value)}")
        if not lo <= value < INT_LIMIT:
            raise self.fail(f"{key} must be >= {lo}, got {value}" if value < lo else f"{key} is too large: {value}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.take(key, default)
        if not (_is_int(value) or isinstance(value, float)):
            raise self.fail(f"{key} must be a number, got {_type_name(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(f"{key} must be finite, got {value}")
        if abs(value) > 1e30:
            raise self.fail(f"{key} is out of range: {value}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.take(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, got {_type_name(value)}")
        return value

    def text(self, key: str, max_len: int) -> str | None:
        """An optional string of 1..max_len characters."""
        value = self.take(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(f"{key} must be a string, got {_type_name(value)}")
        if not 1 <= len(value) <= max_len:
            raise self.fail(f"{key} must have 1..{max_len} characters, got {len(value)}")
        return value

    def messages(self) -> list[dict[str, str]] | None:
        value = self.take("messages")
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.fail(f"messages must be a list, got {_type_name(value)}")
        if not 1 <= len(value) <= MAX_MESSAGES:
            raise self.fail(f"messages must have 1..{MAX_MESSAGES} entries, got {len(value)}")
        for i, m in enumerate(value):
            if not isinstance(m, dict):
                raise self.fail(f"messages[{i}] must be a map with role and content, got {_type_name(m)}")
            if set(m) != {"role", "content"}:
                raise self.fail(f"messages[{i}] must have exactly the keys role and content, got {sorted(map(repr, m))}")
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise self.fail(f"messages[{i}].{key} must be a string, got {_type_name(m[key])}")
            if not m["role"]:
                raise self.fail(f"messages[{i}].role is empty")
        return value

    def stop(self) -> tuple[str, ...]:
        value = self.take("stop")
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            raise self.fail(f"stop must be a string or a list of strings, got {_type_name(value)}")
        if len(stops) > MAX_STOP:
            raise self.fail(f"stop has {len(stops)} strings, at most {MAX_STOP} allowed")
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise self.fail(f"stop[{i}] must be a string, got {_type_name(s)}")
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise self.fail(f"stop[{i}] must have 1..{MAX_STOP_LEN} characters, got {len(s)}")
        return tuple(stops)

    def done(self) -> None:
        if self._left:
            key = min(map(repr, self._left))
            raise self.fail(f"unknown field {key}")


def _one_of(f: _Fields, text_key: str) -> tuple[str | None, list[dict[str, str]] | None]:
    text = f.take(text_key)
    messages = f.messages()
    if (text is None) == (messages is None):
        raise f.fail(f"give exactly one of {text_key} and messages")
    if text is not None and not isinstance(text, str):
        raise f.fail(f"{text_key} must be a string, got {_type_name(text)}")
    return text, messages


def _parse_generate(f: _Fields) -> Generate:
    prompt, messages = _one_of(f, "prompt")
    seed = f.take("seed")
    if seed is not None:
        if not _is_int(seed):
            raise f.fail(f"seed must be an integer or nil, got {_type_name(seed)}")
        if not 0 <= seed < 1 << 64:
            raise f.fail(f"seed must be in [0, 2**64), got {seed}")
    sampling = {
        "temperature": f.number("temperature", 0.8),
        "top_k": f.integer("top_k", 40),
        "top_p": f.number("top_p", 0.95),
        "min_p": f.number("min_p", 0.05),
        "repeat_penalty": f.number("repeat_penalty", 1.0),
        "repeat_last_n": f.integer("repeat_last_n", 64),
        "seed": seed,
    }
    req = Generate(
        id=f.id,
        prompt=prompt,
        messages=messages,
        max_tokens=f.integer("max_tokens", DEFAULT_MAX_TOKENS),
        stream=f.flag("stream", True),
        stop=f.stop(),
        session=f.text("session", MAX_SESSION_LEN),
        return_tokens=f.flag("return_tokens", False),
        ignore_eos=f.flag("ignore_eos", False),
        sampling=sampling,
    )
    f.done()
    return req


def _parse_cancel(f: _Fields) -> Cancel:
    if not f.has("target"):
        raise f.fail("target is missing (the id of the generate to cancel)")
    try:
        target = _check_id(f.take("target"), "target")
    except RequestError as e:  # a field error like any other: prefixed, and answered with the request's id
        raise f.fail(str(e)) from None
    f.done()
    return Cancel(f.id, target)


def _parse_tokenize(f: _Fields) -> Tokenize:
    text, messages = _one_of(f, "text")
    req = Tokenize(f.id, text, messages, f.flag("add_special", True), f.flag("parse_special", True))
    f.done()
    return req


def _parse_stats(f: _Fields) -> Stats:
    f.done()
    return Stats(f.id)


def _parse_ping(f: _Fields) -> Ping:
    f.done()
    return Ping(f.id)


# The allow-list of operations: the only way a client's `op` reaches code.
OPS: dict[str, Callable[[_Fields], Request]] = {
    "generate": _parse_generate,
    "cancel": _parse_cancel,
    "tokenize": _parse_tokenize,
    "stats": _parse_stats,
    "ping": _parse_ping,
}


def _check_id(value: Any, key: str = "id") -> RequestId:
    if _is_int(value):
        if -INT_LIMIT < value < INT_LIMIT:
            return value
        raise RequestError(f"{key} is out of range: {value}")
    if isinstance(value, str) and 1 <= len(value) <= MAX_ID_LEN:
        return value
    if isinstance(value, str):
        raise RequestError(f"{key} must have 1..{MAX_ID_LEN} characters, got {len(value)}")
    raise RequestError(f"{key} must be an integer or a string, got {_type_name(value)}")


def parse_request(obj: Any) -> Request:
    """A decoded frame → a validated request, or RequestError naming the first problem."""
    if not isinstance(obj, dict):
        raise RequestError(f"a request must be a map, got {_type_name(obj)}", code="bad_frame")
    if "id" not in obj:
        raise RequestError("id is missing")
    id = _check_id(obj["id"])
    op = obj.get("op")
    if not isinstance(op, str):
        raise RequestError(f"op must be a string, got {_type_name(op)}", id)
    parse = OPS.get(op)
    if parse is None:
        raise RequestError(f"unknown op {op[:64]!r} (expected one of {', '.join(OPS)})", id)
    fields = {k: v for k, v in obj.items() if k not in ("id", "op")}
    return parse(_Fields(op, id, fields))


# -- the sans-I/O server side ----------------------------------------------------------------------


@dataclass(frozen=True)
class ProtocolError:
    """A frame that could not become a request; `fatal`: reply, then close the connection."""

    id: RequestId | None
    code: str
    message: str
    fatal: bool = False

    def reply(self) -> dict[str, Any]:
        return error_reply(self.id, self.code, self.message)


Event = Request | ProtocolError


class ServerProtocol:
    """Bytes from a client → requests or protocol errors, in order. No sockets, no clock.

    After a fatal error the connection is `closed`: later bytes are ignored.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self._frames = FrameDecoder(max_frame)
        self.closed = False

    def receive_data(self, data: bytes) -> list[Event]:
        if self.closed:
            return []
        events: list[Event] = []
        try:
            payloads = self._frames.feed(data)
        except FrameTooLarge as e:
            payloads = e.frames
            self.closed = True
            fatal = ProtocolError(None, "frame_too_large", str(e), fatal=True)
        else:
            fatal = None
        for payload in payloads:
            events.append(self._event(payload))
        if fatal is not None:
            events.append(fatal)
        return events

    @property
    def mid_frame(self) -> bool:
        return self._frames.buffered > 0

    @staticmethod
    def _event(payload: bytes) -> Event:
        try:
            obj = decode_payload(payload)
        except ValueError as e:
            return ProtocolError(None, "bad_frame", str(e))
        try:
            return parse_request(obj)
        except RequestError as e:
            return ProtocolError(e.id, e.code, str(e))


def error_reply(id: RequestId | None, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "id": id, "code": code, "message": message}
