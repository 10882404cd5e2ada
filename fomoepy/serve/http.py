"""An OpenAI-compatible HTTP front on the daemon: the same engine, queue, turns, limits and validation as
the Unix socket, for the clients that speak only that API (chat UIs, editors, LiteLLM, agents).

Why aiohttp: it is an HTTP/1.1 server and client on asyncio that runs on the daemon's own uvloop loop,
so an HTTP request is one more task beside the socket connections and reaches the worker without a
thread hop; it streams server-sent events from a plain handler and cancels the handler when its client
disconnects (`handler_cancellation`). starlette + uvicorn would bring a second server with its own loop
and lifecycle to coordinate with the daemon's.

Routes (`Authorization: Bearer KEY` on all but /health and the static page when --api-key is set):
  GET  /health               liveness, never authenticated
  GET  /v1/models            the one model served
  POST /v1/chat/completions  messages through the model's chat template; stream (SSE, `data: [DONE]`)
  POST /v1/completions       a raw prompt
  GET  /metrics              Prometheus text: tok/s, queue, per-tier hit rates, substitution rate,
                             prefetch accuracy, generations by outcome, and every HTTP response by
                             route and status (`fomoe_http_responses_total`: the 400s, 401s, 404s,
                             429s and 503s too, which never become generations)
  GET  /v1/fomoe/stats       the daemon's statistics as JSON (what `fomoe chat --stats --json` prints)
  GET  /                     a small page: a chat box that streams, live charts of tok/s and hit rates
                             (a static file: it holds no data, so it is served without the key; every
                             call it makes sends the key typed into it)

Each HTTP request is one generation on a sink of its own (`HttpSink`); its messages reach the handler
through a queue. A queued request's place becomes an SSE comment (`: queued N ahead`), which clients
ignore. Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input
(including a prompt longer than the context, and a field the daemon cannot honour, such as tools, which
is refused rather than ignored), 401 for a missing or wrong key, 429 when the queue is
full, 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections import Counter
from importlib import resources
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fomoepy.errors import FomoeError
from fomoepy.serve.protocol import RequestError, parse_request

log = logging.getLogger("fomoe.serve")

LOOPBACK = ("127.0.0.1", "::1", "localhost")
HIGH_WATER, LOW_WATER = 256, 64  # messages queued for one HTTP client before its generation pauses
STATUS = {"bad_request": 400, "busy": 429, "shutting_down": 503}
FINISH = {"eog": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}
# passed through to the socket protocol: OpenAI's sampling fields, and llama-server's extensions
PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "ignore_eos")
# OpenAI fields that would change the answer or what it holds, which the daemon cannot do: refused, since
# ignoring one would answer another question than the one asked. Each: the values that ask for nothing
# (null always does, and is not listed), and what is missing.
NO_FUNCTION_CALLING = "the daemon has no function calling"
NO_LOGPROBS = "the daemon returns no log-probabilities"
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": (([],), NO_FUNCTION_CALLING),
    "tool_choice": (("none",), NO_FUNCTION_CALLING),
    "functions": (([],), NO_FUNCTION_CALLING),
    "function_call": (("none",), NO_FUNCTION_CALLING),
    "response_format": (({"type": "text"},), 'only {"type": "text"} is'),
    "logprobs": ((False,), NO_LOGPROBS),
    "top_logprobs": ((0,), NO_LOGPROBS),
    "frequency_penalty": ((0, 0.0), "repeat_penalty is"),
    "presence_penalty": ((0, 0.0), "repeat_penalty is"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self) -> web.Response:
        kind = "authentication_error" if self.status == 401 else "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


class HttpSink:
    """What the daemon sees of one HTTP generation: a Connection's duck (pending, closed, send, finished,
    write_paused). Messages queue for the handler; past HIGH_WATER the generation pauses like a socket
    client that does not read, and resumes below LOW_WATER."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.pending: dict[Any, Any] = {}
        self.closed = False
        self.write_paused = False
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def send(self, message: dict[str, Any]) -> None:
        self._queue.put_nowait(message)
        if self._queue.qsize() > HIGH_WATER:
            self.write_paused = True

    def finished(self, id: Any) -> None:
        self.pending.pop(id, None)

    async def next(self) -> dict[str, Any]:
        message = await self._queue.get()
        if self.write_paused and self._queue.qsize() < LOW_WATER:
            self.write_paused = False
            self.daemon.worker.resume(self)
        return message

    def cancel(self) -> None:
        """The client went away: stop its generation at the next token."""
        self.closed = True
        for job in list(self.pending.values()):
            self.daemon.worker.cancel(job)


# -- request bodies ---------------------------------------------------------------------------------


def _content(value: Any, where: str) -> str:
    """OpenAI message content: a string, or a list of {type: "text", text} parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _asks_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    # compared with their types too: False == 0, and logprobs 0 asks for the chosen tokens' log-probabilities
    return value is None or any(value == h and type(value) is type(h) for h in harmless)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, (harmless, missing) in UNSUPPORTED.items():
        if not _asks_nothing(body.get(key), harmless):
            raise ApiError(400, f"{key} is not supported ({missing})", param=key)


def _refuse_message_tools(message: dict[str, Any], where: str) -> None:
    """An agent's history (an assistant turn that called tools) cannot be rendered without tools."""
    for key in ("tool_calls", "function_call"):
        if message.get(key) not in (None, []):
            raise ApiError(400, f"{where}.{key} is not supported ({NO_FUNCTION_CALLING})", param=f"{where}.{key}")


def generate_request(body: Any, *, chat: bool, n_ctx: int) -> tuple[dict[str, Any], bool, bool]:
    """An OpenAI request body → (a `generate` request of the socket protocol, stream, include_usage).
    The protocol's parser then checks every field as it does for the socket."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not _asks_nothing(body.get("n"), (1,)):
        raise ApiError(400, "only n = 1 is supported", param="n")
    _refuse_unsupported(body)
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = n_ctx  # OpenAI's default: until the end of the answer or of the context
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
    request: dict[str, Any] = {"op": "generate", "id": "http", "max_tokens": max_tokens, "stream": True}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
            _refuse_message_tools(m, f"messages[{i}]")
            out.append({"role": m["role"], "content": _content(m.get("content", ""), f"messages[{i}]")})
        request["messages"] = out
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        request["prompt"] = prompt
    if body.get("stop") is not None:
        request["stop"] = body["stop"]
    for key in PASSED:
        if body.get(key) is not None:
            request[key] = body[key]
    try:
        parse_request(request)  # the socket protocol's own checks, so both fronts accept the same
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    return request, stream, include_usage


# -- the front ------------------------------------------------------------------------------------


class RequestLog(logging.LoggerAdapter):
    """aiohttp's server log, as its request handler writes it. A malformed request (a negative
    Content-Length, an oversized header line, a body whose chunks or gzip are not) is its client's
    mistake, which aiohttp answers 400 but logs as an ERROR with a traceback (a body's, once more as it
    reads what is left of it after the answer): here it is one INFO line. Anything else, a failure in
    one of our handlers included, is logged as aiohttp logs it."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        # raised only by aiohttp's parser of the request, and by its reads of a body it could not parse
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):
            said = exc.message if isinstance(exc, HttpProcessingError) else exc
            log.log(min(level, logging.INFO), "bad HTTP request: %s", " ".join(str(said).split()))
            return
        super().log(level, msg, *args, **kwargs)


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Anyone who can reach a non-loopback address could use the model: refuse that without a key."""
    if api_key is None and host not in LOOPBACK and not allow_unauthenticated:
        raise FomoeError(
            f"refusing to serve HTTP on {host}, which is not a loopback address, without --api-key "
            "(or FOMOE_API_KEY); --http-allow-unauthenticated overrides this"
        )


def key_matches(authorization: str, key: str) -> bool:
    """`Bearer KEY`, the scheme in any case (RFC 7235); the key compared in constant time."""
    scheme, _, token = authorization.strip().partition(" ")
    # aiohttp keeps a header's non-UTF-8 bytes as lone surrogates, which a strict encode refuses;
    # surrogatepass encodes any str, one to one
    given, wanted = (t.encode("utf-8", "surrogatepass") for t in (token.strip(" "), key))
    return hmac.compare_digest(given, wanted) and scheme.lower() == "bearer"


class HttpFront:
    def __init__(self, daemon, host: str, port: int, api_key: str | None, allow_unauthenticated: bool = False):
        check_exposure(host, api_key, allow_unauthenticated)
        self.daemon, self.host, self.port, self.api_key = daemon, host, port, api_key
        self.model_name = str(getattr(getattr(daemon.engine, "file", None), "path", "model")).rsplit("/", 1)[-1]
        self.runner: web.AppRunner | None = None
        self.streams: set[asyncio.Task] = set()
        # (route, status) → responses sent; a request the router matched nothing for is one route,
        # "unmatched", so that clients cannot grow the label set with made-up paths
        self.responses: Counter[tuple[str, int]] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(MetricsCollector(daemon, self.responses))

    @property
    def description(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=self.daemon.config.max_frame)
        app.router.add_get("/health", self.health)
        app.router.add_get("/", self.page)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/fomoe/stats", self.stats)
        # counted as each response's status line is sent: whatever produced it (a route, the key check,
        # the router's 404, a refusal), and a stream once, when it starts
        app.on_response_prepare.append(self._count_response)
        return app

    async def _count_response(self, request: web.Request, response: web.StreamResponse) -> None:
        resource = request.match_info.route.resource
        self.responses[(resource.canonical if resource is not None else "unmatched", response.status)] += 1

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                                    logger=RequestLog(logging.getLogger("aiohttp.server")))  # fmt: skip
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:  # a port in use, an address not on this host: the user's to fix, in one line
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise FomoeError(f"--http: cannot listen on {self.host}:{self.port}: {reason}") from None
        if self.port == 0:  # an ephemeral port: say which one was bound
            self.port = self.runner.addresses[0][1]
        log.info("HTTP: listening on %s%s", self.description, "" if self.api_key else " (no API key)")

    async def stop(self) -> None:
        """After the worker has ended every generation: let open streams write their last chunk, close."""
        if self.streams:
            await asyncio.wait(self.streams, timeout=5.0)
        if self.runner is not None:
            await self.runner.cleanup()

    # -- middleware ---------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            open_route = request.path in ("/health", "/")
            if self.api_key is not None and not open_route and not key_matches(request.headers.get("Authorization", ""), self.api_key):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status >= 400:
                return ApiError(e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_")).response()
            raise

    # -- routes ---------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if not self.daemon.stopping else "stopping"})

    async def page(self, request: web.Request) -> web.Response:
        html = resources.files("fomoepy.serve").joinpath("static/index.html").read_text()
        return web.Response(text=html, content_type="text/html")

    async def models(self, request: web.Request) -> web.Response:
        started = int(time.time() - (time.monotonic() - self.daemon.state.started))
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": started, "owned_by": "fomoepy"}]})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.daemon.stats())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except web.RequestPayloadError as e:  # its framing or encoding (a bad chunk, gzip that is not): the client's
            raise ApiError(400, f"the body could not be read: {' '.join(str(e).split())}") from None
        fields, stream, include_usage = generate_request(body, chat=chat, n_ctx=self.daemon.engine.n_ctx)
        generate = parse_request(fields)
        sink = HttpSink(self.daemon)
        self.daemon.on_generate(sink, generate)
        task = asyncio.current_task()
        if task is not None:
            self.streams.add(task)
        try:
            first = await sink.next()
            if first["type"] == "error":  # refused, or bad input found while preparing: nothing was sent yet
                raise ApiError(STATUS.get(first["code"], 500), first["message"], code=first["code"])
            shape = Shape(chat, self.model_name, body.get("model"))
            if stream:
                return await self._stream(request, sink, first, shape, include_usage)
            return await self._whole(sink, first, shape)
        except (asyncio.CancelledError, ConnectionResetError):
            sink.cancel()  # the client went away
            raise
        finally:
            if task is not None:
                self.streams.discard(task)

    async def _whole(self, sink: HttpSink, message: dict[str, Any], shape: Shape) -> web.Response:
        parts: list[str] = []
        while message["type"] in ("queued", "delta"):
            if message["type"] == "delta":
                parts.append(message["text"])
            message = await sink.next()
        if message["type"] == "error":
            raise ApiError(STATUS.get(message["code"], 500), message["message"], code=message["code"])
        return web.json_response(shape.whole("".join(parts), message))

    async def _stream(self, request: web.Request, sink: HttpSink, message: dict[str, Any], shape: Shape,
                      include_usage: bool) -> web.StreamResponse:  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(shape.event(shape.chunk({"role": "assistant", "content": ""} if shape.chat else "", None)))
        while True:
            kind = message["type"]
            if kind == "queued":
                await resp.write(f": queued {message['position']} ahead\n\n".encode())
            elif kind == "delta":
                await resp.write(shape.event(shape.chunk({"content": message["text"]} if shape.chat else message["text"], None)))
            elif kind == "done":
                await resp.write(shape.event(shape.chunk({} if shape.chat else "", FINISH.get(message["finish_reason"], "stop"))))
                if include_usage:
                    await resp.write(shape.event({**shape.chunk({}, None), "choices": [], "usage": usage(message)}))
                break
            else:  # an error after the stream began: an error event, then the end
                await resp.write(shape.event({"error": {"message": message["message"], "type": "server_error", "code": message["code"]}}))
                break
            message = await sink.next()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def usage(done: dict[str, Any]) -> dict[str, int]:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}  # fmt: skip


class Shape:
    """OpenAI's response objects for one request: chat or text completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str, asked: Any):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = asked if isinstance(asked, str) and asked else model

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {**self._head("chat.completion.chunk"), "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return {**self._head("text_completion"), "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]}

    def whole(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        finish = FINISH.get(done["finish_reason"], "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(done)}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(done)}

    @staticmethod
    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class MetricsCollector:
    """The daemon's statistics, read at each scrape (prometheus_client formats them)."""

    def __init__(self, daemon, responses: Counter[tuple[str, int]]):
        self.daemon = daemon
        self.responses = responses

    def collect(self):
        s = self.daemon.stats()
        speed = GaugeMetricFamily("fomoe_tokens_per_second", "Average speed since start", labels=["phase"])
        speed.add_metric(["prefill"], s["prefill_tok_per_s"])
        speed.add_metric(["decode"], s["decode_tok_per_s"])
        yield speed
        yield GaugeMetricFamily("fomoe_queue_length", "Generations waiting for the engine", value=s["queue_length"])
        yield GaugeMetricFamily("fomoe_running", "Generations in the batch (0 to --max-batch)", value=s["running"])
        yield GaugeMetricFamily("fomoe_paused", "Generations paused: their client is not reading", value=s["paused"])
        yield GaugeMetricFamily("fomoe_connections", "Open socket connections", value=s["connections"])
        tokens = CounterMetricFamily("fomoe_tokens", "Tokens processed", labels=["kind"])
        tokens.add_metric(["prompt"], s["prompt_tokens"])
        tokens.add_metric(["completion"], s["completion_tokens"])
        yield tokens
        engine = s.get("engine") or {}
        cache = engine.get("cache") or {}
        hits = GaugeMetricFamily("fomoe_expert_tier_hit_rate", "Share of expert uses served by each tier", labels=["tier"])
        for tier in ("device", "host"):
            if isinstance(cache.get(tier), dict):
                hits.add_metric([tier], float(cache[tier].get("hit_rate", 0.0)))
        if isinstance(cache.get("disk"), dict):
            hits.add_metric(["disk"], float(cache["disk"].get("rate", 0.0)))
        yield hits
        car = engine.get("car") or {}
        yield GaugeMetricFamily("fomoe_car_substitution_rate", "Share of expert slots CAR substituted", value=float(car.get("substitution_rate", 0.0)))
        prefetch = engine.get("prefetch") or {}
        yield GaugeMetricFamily("fomoe_prefetch_accuracy", "Next-layer expert prediction accuracy", value=float(prefetch.get("accuracy", 0.0)))
        outcomes = CounterMetricFamily("fomoe_requests", "Generation requests by how they ended", labels=["outcome"])
        for outcome, n in sorted(s.get("outcomes", {}).items()):
            outcomes.add_metric([outcome], n)
        yield outcomes
        # read on the loop thread, which alone writes it (a scrape counts itself at the next one)
        http = CounterMetricFamily("fomoe_http_responses", "HTTP responses by route and status", labels=["route", "status"])
        for (route, status), n in sorted(self.responses.items()):
            http.add_metric([route, str(status)], n)
        yield http
