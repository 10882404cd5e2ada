"""Clients of the daemon for programs: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client() as c:                                  # $XDG_RUNTIME_DIR/fomoe.sock or /run/fomoe/fomoe.sock
        print(c.complete(prompt="Hello", max_tokens=32, temperature=0).text)
        for msg in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(msg.get("text", ""), end="")           # "queued" and "delta" messages, then "done"

    async with await AsyncClient.connect() as c:         # many requests at once on one connection
        answers = await asyncio.gather(*(c.complete(prompt=p, max_tokens=16) for p in prompts))

Request fields are the protocol's (see fomoepy.serve.protocol); an `error` reply raises ServerError.
"""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fomoepy.errors import FomoeError
from fomoepy.serve.protocol import (
    CLIENT_MAX_FRAME,
    PROGRESS,
    FrameDecoder,
    RequestId,
    decode_payload,
    default_socket_path,
    encode_frame,
)


class DaemonUnavailable(FomoeError):
    """No daemon accepts on the socket (or the connection broke)."""


class ServerError(FomoeError):
    """The daemon answered a request with an error."""

    def __init__(self, reply: dict[str, Any]):
        self.code = reply.get("code")
        self.id = reply.get("id")
        super().__init__(f"{reply.get('message')} ({self.code})")


@dataclass
class Completion:
    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    tokens: list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_done(cls, done: dict[str, Any], text: str | None = None) -> Completion:
        return cls(
            text=done.get("text", "") if text is None else text,
            finish_reason=done["finish_reason"],
            usage=done["usage"],
            timings=done["timings"],
            tokens=done.get("tokens"),
            raw=done,
        )


def _unavailable(path: str, e: OSError) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"cannot connect to the fomoe daemon at {path}: {e.strerror or e} (is `fomoe serve` running?)"
    )


def _generate_fields(prompt: str | None, messages: list[dict[str, str]] | None, fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    if prompt is not None:
        out["prompt"] = prompt
    if messages is not None:
        out["messages"] = messages
    return out


def _message(payload: bytes) -> dict[str, Any]:
    try:
        msg = decode_payload(payload)
    except ValueError as e:
        raise FomoeError(f"the daemon sent a bad frame: {e}") from None
    if not isinstance(msg, dict) or "type" not in msg:
        raise FomoeError(f"the daemon sent a message that is not a reply map: {str(msg)[:80]}")
    return msg


class Client:
    """One blocking connection. `timeout`: seconds to wait for any one message (None: forever)."""

    def __init__(self, path: str | None = None, timeout: float | None = None):
        self.path = path or default_socket_path()
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise _unavailable(self.path, e) from None
        self._frames = FrameDecoder(CLIENT_MAX_FRAME)
        self._inbox: deque[dict[str, Any]] = deque()  # received, not yet taken
        self._ignored: set[RequestId] = set()  # ids whose replies nobody waits for (until a final one)
        self._ids = itertools.count(1)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    # -- requests ----------------------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> RequestId:
        """Send one request; its id."""
        id = next(self._ids)
        try:
            self._sock.sendall(encode_frame({"op": op, "id": id, **fields}))
        except OSError as e:
            raise DaemonUnavailable(f"connection to the daemon at {self.path} failed: {e.strerror or e}") from None
        return id

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send a request and return its one reply."""
        return self._check(self.receive(self.send(op, **fields)))

    def ping(self) -> float:
        """Round-trip seconds."""
        t0 = time.perf_counter()
        self.request("ping")
        return time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return self.request("stats")["stats"]

    def tokenize(self, text: str | None = None, messages: list[dict[str, str]] | None = None, **fields: Any) -> list[int]:
        if text is not None:
            fields["text"] = text
        if messages is not None:
            fields["messages"] = messages
        return self.request("tokenize", **fields)["tokens"]

    def cancel(self, target: RequestId, wait: bool = False) -> bool | None:
        """Ask to cancel a generation; with `wait`, whether it was still running."""
        id = self.send("cancel", target=target)
        if not wait:
            self._ignored.add(id)
            return None
        return self._check(self.receive(id))["cancelled"]

    def stream(
        self,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        *,
        cancel_when: Callable[[], bool] | None = None,
        **fields: Any,
    ) -> Iterator[dict[str, Any]]:
        """`queued` and `delta` messages as they come, then the `done` message. `cancel_when` is polled every 0.1 s
        (and between messages); once it returns true the generation is cancelled (it still ends with done)."""
        id = self.send("generate", **_generate_fields(prompt, messages, {**fields, "stream": True}))
        cancelled = finished = False
        try:
            while True:
                poll = None
                if cancel_when is not None and not cancelled:
                    if cancel_when():
                        self.cancel(id)
                        cancelled = True
                    else:
                        poll = 0.1
                msg = self.receive(id, poll=poll)
                if msg is None:
                    continue
                finished = msg["type"] not in PROGRESS
                self._check(msg)
                yield msg
                if finished:
                    return
        finally:
            if not finished:  # abandoned (a break, an exception): stop it, drop what still comes
                self._abandon(id)

    def complete(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None, **fields: Any) -> Completion:
        """The whole answer at once."""
        id = self.send("generate", **_generate_fields(prompt, messages, {**fields, "stream": False}))
        while True:
            msg = self._check(self.receive(id))
            if msg["type"] not in PROGRESS:
                return Completion.from_done(msg)

    def _abandon(self, id: RequestId) -> None:
        self._inbox = deque(m for m in self._inbox if m.get("id") != id)
        self._ignored.add(id)
        try:
            self.cancel(id)
        except DaemonUnavailable:
            pass

    # -- receiving ---------------------------------------------------------------------------------

    def receive(self, id: RequestId, poll: float | None = None) -> dict[str, Any] | None:
        """The next message for request `id` (others are kept for their own receive); None after `poll` s."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            for i, msg in enumerate(self._inbox):
                if msg.get("id") == id:
                    del self._inbox[i]
                    return msg
                if msg.get("id") is None and msg.get("type") == "error":
                    raise ServerError(msg)  # a reply to a frame the daemon could not read
            wait = poll
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonUnavailable(f"no reply from the daemon at {self.path} within {self.timeout} s")
                wait = left if wait is None else min(wait, left)
            if not self._read(wait) and poll is not None:
                return None

    def _read(self, wait: float | None) -> bool:
        """Read what is there (waiting up to `wait` s, None: forever) into the inbox; False on timeout."""
        ready, _, _ = select.select([self._sock], [], [], wait)
        if not ready:
            return False
        try:
            data = self._sock.recv(1 << 16)
        except OSError as e:
            raise DaemonUnavailable(f"connection to the daemon at {self.path} failed: {e.strerror or e}") from None
        if not data:
            raise DaemonUnavailable(f"the daemon at {self.path} closed the connection")
        for payload in self._frames.feed(data):
            msg = _message(payload)
            if msg.get("id") in self._ignored:
                if msg.get("type") not in PROGRESS:
                    self._ignored.discard(msg.get("id"))
                continue
            self._inbox.append(msg)
        return True

    @staticmethod
    def _check(msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("type") == "error":
            raise ServerError(msg)
        return msg


class AsyncClient:
    """One asyncio connection; requests may run concurrently (replies are routed by id)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str):
        self.path = path
        self._reader, self._writer = reader, writer
        self._frames = FrameDecoder(CLIENT_MAX_FRAME)
        self._queues: dict[RequestId, asyncio.Queue[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._lost: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, path: str | None = None) -> AsyncClient:
        path = path or default_socket_path()
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as e:
            raise _unavailable(path, e) from None
        return cls(reader, writer, path)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._writer.close()
        self._task.cancel()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def send(self, op: str, **fields: Any) -> RequestId:
        id = next(self._ids)
        self._queues[id] = asyncio.Queue()
        self._writer.write(encode_frame({"op": op, "id": id, **fields}))
        await self._writer.drain()
        return id

    async def receive(self, id: RequestId) -> dict[str, Any]:
        queue = self._queues[id]
        if queue.empty() and self._lost is not None:
            raise DaemonUnavailable(f"connection to the daemon at {self.path} lost: {self._lost}")
        msg = await queue.get()
        if msg.get("type") == "lost":
            raise DaemonUnavailable(f"connection to the daemon at {self.path} lost: {self._lost}")
        return msg

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        id = await self.send(op, **fields)
        try:
            return Client._check(await self.receive(id))
        finally:
            self._queues.pop(id, None)

    async def ping(self) -> None:
        await self.request("ping")

    async def stats(self) -> dict[str, Any]:
        return (await self.request("stats"))["stats"]

    async def tokenize(self, text: str, **fields: Any) -> list[int]:
        return (await self.request("tokenize", text=text, **fields))["tokens"]

    async def cancel(self, target: RequestId) -> bool:
        return (await self.request("cancel", target=target))["cancelled"]

    async def stream(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                     **fields: Any) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """`queued` and `delta` messages, then `done`. The request id is in each message (for `cancel`)."""
        id = await self.send("generate", **_generate_fields(prompt, messages, {**fields, "stream": True}))
        finished = False
        try:
            while True:
                msg = await self.receive(id)
                finished = msg["type"] not in PROGRESS
                yield Client._check(msg)
                if finished:
                    return
        finally:
            self._queues.pop(id, None)  # later messages for it are dropped
            if not finished and self._lost is None and not self._writer.is_closing():  # abandoned: stop it
                self._writer.write(encode_frame({"op": "cancel", "id": next(self._ids), "target": id}))

    async def complete(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                       **fields: Any) -> Completion:  # fmt: skip
        """The whole answer (streamed underneath, so the text is the deltas joined)."""
        parts: list[str] = []
        async for msg in self.stream(prompt, messages, **fields):
            if msg["type"] == "delta":
                parts.append(msg["text"])
            else:
                return Completion.from_done(msg, "".join(parts))
        raise DaemonUnavailable("the stream ended without a final message")

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    raise ConnectionResetError("closed by the daemon")
                for payload in self._frames.feed(data):
                    msg = _message(payload)
                    queue = self._queues.get(msg.get("id"))
                    if queue is not None:
                        queue.put_nowait(msg)
        except (OSError, ValueError, FomoeError) as e:
            self._lost = e
            for queue in self._queues.values():
                queue.put_nowait({"type": "lost"})
