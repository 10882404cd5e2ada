"""The daemon: startup → serve connections → shutdown, like uvicorn's server.

The model is loaded before the socket is bound (by the caller); `Daemon.serve` then runs on an asyncio
loop (uvloop in `fomoe serve`). `ServerState` tracks connections and tasks; each `Connection` feeds the
sans-I/O `ServerProtocol` and dispatches its requests through an explicit handler table; generation
goes through the `InferenceWorker`. First SIGTERM/SIGINT: graceful (stop accepting, cancel every
request with its final message, flush, close, remove the socket); a second one: forced.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fomoepy.errors import FomoeError
from fomoepy.sampling import SamplingParams
from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.jobs import Job, check_fits_context, prompt_text
from fomoepy.serve.listen import Listener, notify
from fomoepy.serve.protocol import (
    Cancel,
    Generate,
    Ping,
    ProtocolError,
    RequestId,
    ServerProtocol,
    Stats,
    Tokenize,
    encode_frame,
    error_reply,
)
from fomoepy.serve.worker import InferenceWorker

log = logging.getLogger("fomoe.serve")


@dataclass
class ServerState:
    """What the daemon tracks: open connections, background tasks, and how long it has run."""

    started: float = field(default_factory=time.monotonic)
    connections: set[Connection] = field(default_factory=set)
    tasks: set[asyncio.Task] = field(default_factory=set)
    total_connections: int = 0


class Connection(asyncio.Protocol):
    """One client: bytes → ServerProtocol → handler; replies as frames. Also a job's Sink."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.protocol = ServerProtocol(daemon.config.max_frame)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[RequestId, Job | asyncio.Task] = {}
        self.write_paused = False
        self.closed = False

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's do not subclass asyncio.Transport
        high = self.daemon.config.write_buffer
        transport.set_write_buffer_limits(high=high, low=high // 4)
        self.daemon.state.connections.add(self)
        self.daemon.state.total_connections += 1

    def data_received(self, data: bytes) -> None:
        for event in self.protocol.receive_data(data):
            if self.closed:
                return
            self.handle(event)

    def eof_received(self) -> bool:
        if self.protocol.mid_frame:
            log.info("client closed mid-frame")
        return False  # a client's EOF ends the connection (and cancels its generations)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.daemon.state.connections.discard(self)
        for item in list(self.pending.values()):
            if isinstance(item, Job):
                self.daemon.worker.cancel(item)
            else:
                item.cancel()
        self.pending.clear()

    def pause_writing(self) -> None:
        # the client is not reading: stop reading its requests too, so replies cannot pile up
        self.write_paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        self.daemon.worker.resume(self)

    # -- Sink --------------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(encode_frame(message))

    def finished(self, id: RequestId) -> None:
        self.pending.pop(id, None)

    def close(self) -> None:
        """Flush what was written, then close."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- requests ----------------------------------------------------------------------------------

    def handle(self, event: Any) -> None:
        if isinstance(event, ProtocolError):
            log.info("bad request: %s", event.message)
            self.send(event.reply())
            if event.fatal:
                self.close()
            return
        if event.id in self.pending:
            self.send(error_reply(event.id, "bad_request", f"id {event.id!r} is in use by an unfinished request"))
            return
        handler = self.daemon.handlers[type(event)]
        try:
            handler(self, event)
        except Exception as e:  # a bug in a handler answers this request, never ends the daemon
            log.exception("handler for %s failed", type(event).__name__)
            self.send(error_reply(event.id, "internal", f"internal error: {type(e).__name__}: {e}"))


class Daemon:
    def __init__(self, engine, config: DaemonConfig | None = None):
        self.engine = engine
        self.config = config = config if config is not None else DaemonConfig()
        self.state = ServerState()
        self.worker = InferenceWorker(engine, max_sessions=config.max_sessions, pause_timeout=config.pause_timeout,
                                      max_batch=config.max_batch, kv_budget=config.kv_budget)  # fmt: skip
        self.should_exit = asyncio.Event()
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_force_exit: Callable[[], None] | None = None
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fomoe-prep")  # a generation's prompt: render, tokenize
        # `tokenize` requests apart: their texts are bounded by the frame only (a prompt is by the context),
        # and a pipeline of 4 MB ones took 16-19 s, which no generation's prompt may wait behind
        self._tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fomoe-tokenize")
        # what the limits count: every generation from its arrival to its final message, each once, and
        # apart from it the cheap requests (tokenize, stats) that are still being answered
        self.generations: set[Job] = set()
        self.cheap_pending = 0
        self.outcomes: Counter[str] = Counter()  # how generations ended: done reasons, error codes
        self.fronts: list[Any] = []
        # the allow-list: request type → handler; nothing a client sends names code
        self.handlers: dict[type, Callable[[Connection, Any], None]] = {
            Generate: self.on_generate,
            Cancel: self.on_cancel,
            Tokenize: self.on_tokenize,
            Stats: self.on_stats,
            Ping: self.on_ping,
        }

    # -- lifecycle ---------------------------------------------------------------------------------

    async def serve(self, listener: Listener, *, on_force_exit: Callable[[], None] | None = None,
                    on_ready: Callable[[], None] | None = None, fronts: Sequence[Any] = ()) -> None:  # fmt: skip
        """Serve until `should_exit` (set by `handle_exit` or a caller), then shut down gracefully.

        With `on_force_exit`, SIGTERM/SIGINT are handled (main thread only): the first is graceful, the
        second calls on_force_exit. `on_ready` is called once connections are accepted. `fronts` are more
        listeners on the same daemon (the HTTP front): started with it, stopped after its generations end.
        """
        loop = self.loop = asyncio.get_running_loop()
        self._on_force_exit = on_force_exit
        if on_force_exit is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.handle_exit, sig)
        self.worker.start()
        server = await loop.create_unix_server(lambda: Connection(self), sock=listener.sock)
        self.fronts = list(fronts)
        try:
            for front in self.fronts:  # one that cannot start (its port in use) ends the daemon as a signal would
                await front.start()
            log.info("ready: listening on %s (context %d tokens)", listener.description, self.engine.n_ctx)
            notify("READY=1", f"STATUS=ready: listening on {listener.description}")
            if on_ready is not None:
                on_ready()
            await self.should_exit.wait()
        finally:
            await self.shutdown(server, listener)
            if on_force_exit is not None:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int | None = None) -> None:
        if self.should_exit.is_set() and self._on_force_exit is not None:
            log.warning("second signal: forced exit")
            self._on_force_exit()
            return
        log.info("shutting down (%s)", signal.Signals(sig).name if sig else "requested")
        self.should_exit.set()

    def request_exit(self) -> None:
        """From any thread: shut down gracefully (for programs that run the daemon in a thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.should_exit.set)

    async def shutdown(self, server: asyncio.AbstractServer, listener: Listener) -> None:
        notify("STOPPING=1", "STATUS=stopping")
        self.stopping = True
        server.close()
        listener.remove_file()  # new clients fail at once instead of waiting on a dying daemon
        for task in list(self.state.tasks):
            task.cancel()
        await asyncio.gather(*self.state.tasks, return_exceptions=True)
        await self.worker.stop()  # every generation ends with its final message
        for front in self.fronts:
            await front.stop()  # its open streams write that last message first
        for conn in list(self.state.connections):
            conn.close()
        deadline = time.monotonic() + self.config.drain_timeout
        while self.state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.state.connections):
            if conn.transport is not None:
                conn.transport.abort()
        self.worker.close()
        self._prep.shutdown(wait=True)
        self._tokenize_thread.shutdown(wait=True)
        log.info("stopped")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)
        return task

    # -- handlers ----------------------------------------------------------------------------------

    def on_ping(self, conn: Connection, req: Ping) -> None:
        conn.send({"type": "pong", "id": req.id})

    def on_cancel(self, conn: Connection, req: Cancel) -> None:
        item = conn.pending.get(req.target)
        cancelled = isinstance(item, Job) and self.worker.cancel(item)
        conn.send({"type": "ok", "id": req.id, "cancelled": cancelled})

    def on_generate(self, conn: Connection, req: Generate) -> None:
        refusal = self._refusal(conn, len(self.generations), "generation requests")
        if refusal is not None:
            self.outcomes[f"refused_{refusal[0]}"] += 1
            conn.send(error_reply(req.id, *refusal))
            return
        try:
            params = SamplingParams(**req.sampling)
        except FomoeError as e:
            conn.send(error_reply(req.id, "bad_request", f"generate: {e}"))
            return
        job = Job(req, conn, params, on_end=self._generation_ended)
        self.generations.add(job)
        conn.pending[req.id] = job
        self._spawn(self._prepare(conn, job))

    def _generation_ended(self, job: Job) -> None:
        self.generations.discard(job)
        self.outcomes[job.outcome or "unknown"] += 1

    def _refusal(self, conn: Connection, in_flight: int, what: str) -> tuple[str, str] | None:
        if self.stopping:
            return "shutting_down", "the daemon is shutting down"
        if len(conn.pending) >= self.config.max_pending:
            return "busy", f"too many unfinished requests on this connection (limit {self.config.max_pending})"
        if in_flight >= self.config.max_queue:
            return "busy", f"the queue is full ({self.config.max_queue} unfinished {what})"
        return None

    async def _prepare(self, conn: Connection, job: Job) -> None:
        req = job.request
        loop = asyncio.get_running_loop()

        def tokenize() -> list[int]:
            text = prompt_text(self.engine, req.prompt, req.messages)
            check_fits_context(self.engine, text)  # before the tokenizer spends seconds on it
            return self.engine.tokenizer.encode(text)

        try:
            ids = await loop.run_in_executor(self._prep, tokenize)
            self._check_prompt(ids)
        except FomoeError as e:
            job.fail("bad_request", f"generate: {e}")
            return
        except ValueError as e:  # the tokenizer refuses text it cannot encode (a lone surrogate)
            job.fail("bad_request", f"generate: cannot tokenize the prompt: {e}")
            return
        except asyncio.CancelledError:
            job.finish("cancelled", None)
            raise
        job.prompt = ids
        if job.cancel_requested or self.stopping or conn.closed:
            job.finish("cancelled", None)
        else:
            self.worker.submit(job)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise FomoeError("the prompt is empty (0 tokens)")
        if len(ids) > self.engine.n_ctx:
            raise FomoeError(f"the prompt has {len(ids)} tokens, more than the context of {self.engine.n_ctx}")

    def _cheap(self, conn: Connection, req: Any, answer) -> None:
        """tokenize and stats: the same limits as a generation, counted apart from generations."""
        refusal = self._refusal(conn, self.cheap_pending, "tokenize/stats requests")
        if refusal is not None:
            conn.send(error_reply(req.id, *refusal))
            return
        self.cheap_pending += 1

        async def run() -> None:
            try:
                await answer(conn, req)
            finally:
                self.cheap_pending -= 1
                conn.finished(req.id)

        conn.pending[req.id] = self._spawn(run())

    def on_tokenize(self, conn: Connection, req: Tokenize) -> None:
        self._cheap(conn, req, self._tokenize)

    async def _tokenize(self, conn: Connection, req: Tokenize) -> None:
        loop = asyncio.get_running_loop()

        def tokenize() -> list[int]:
            text = prompt_text(self.engine, req.text, req.messages)
            return self.engine.tokenizer.encode(text, add_special=req.add_special, parse_special=req.parse_special)

        try:
            ids = await loop.run_in_executor(self._tokenize_thread, tokenize)
        except (FomoeError, ValueError) as e:
            conn.send(error_reply(req.id, "bad_request", f"tokenize: {e}"))
        else:
            conn.send({"type": "tokens", "id": req.id, "tokens": ids, "count": len(ids)})

    def on_stats(self, conn: Connection, req: Stats) -> None:
        self._cheap(conn, req, self._stats)

    async def _stats(self, conn: Connection, req: Stats) -> None:
        conn.send({"type": "stats", "id": req.id, "stats": self.stats()})

    def stats(self) -> dict[str, Any]:
        """The daemon's and the engine's statistics, never waiting for an engine step."""
        engine_stats, engine_lines, age = self.worker.engine_stats()
        t = self.worker.totals
        return {
            "uptime_s": round(time.monotonic() - self.state.started, 3),
            "model": str(self.engine.file.path),
            "n_ctx": self.engine.n_ctx,
            "queue_length": self.worker.queue_length,
            "running": self.worker.running,
            "paused": self.worker.paused_count,
            "preempted": t.preempted,
            "yielded": t.yielded,
            "connections": len(self.state.connections),
            "sessions": len(self.worker.sessions),
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "prefill_tok_per_s": round(t.prompt_tokens / t.prefill_s, 3) if t.prefill_s > 0 else 0.0,
            "decode_tok_per_s": round(t.decode_tokens / t.decode_s, 3) if t.decode_s > 0 else 0.0,
            # the engine's own time in each kind of step, and the decode steps' tokens: what a batch gains
            # in its steps, apart from the time its prompts take
            "prefill_s": round(t.prefill_s, 6),
            "decode_s": round(t.decode_s, 6),
            "decode_tokens": t.decode_tokens,
            "engine": engine_stats,
            "engine_lines": engine_lines,
            "engine_stats_age_s": round(age, 3),
            "outcomes": dict(self.outcomes),
        }
