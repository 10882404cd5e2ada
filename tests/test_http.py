"""The OpenAI-compatible HTTP front, driven by the official `openai` client against a live daemon on
loopback, and compared with what the engine itself generates."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from conftest import ORACLE
from prometheus_client.parser import text_string_to_metric_families
from test_serve import raw_connect
from test_serve_fairness import GatedEngine, held

from fomoepy.engine import Engine
from fomoepy.errors import FomoeError
from fomoepy.sampling import SamplingParams
from fomoepy.serve.commands import parse_host_port
from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.http import check_exposure
from fomoepy.serve.jobs import prompt_text
from fomoepy.serve.protocol import encode_frame
from fomoepy.serve.thread import DaemonThread

MODEL = "qwen3moe_q4_k_m"
KEY = "test-key"


@pytest.fixture(scope="module")
def ref() -> Engine:
    return Engine(ORACLE / f"{MODEL}.gguf")


@pytest.fixture(scope="module")
def served():
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-h-")
    with DaemonThread(Engine(ORACLE / f"{MODEL}.gguf"), f"{d}/d.sock", http=("127.0.0.1", 0), api_key=KEY) as t:
        yield t
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def expected_text(ref: Engine, n: int, prompt: str | None = None, messages=None) -> str:
    ids = ref.tokenizer.encode(prompt_text(ref, prompt, messages))
    tokens = list(ref.generate(ids, n, SamplingParams.greedy()))
    if tokens and tokens[-1] in ref.tokenizer.eog_ids:
        tokens = tokens[:-1]
    return ref.tokenizer.decode(tokens)


def post(url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"fox {i}"}]


# -- routes -----------------------------------------------------------------------------------------


def test_models_and_health(served, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [f"{MODEL}.gguf"]
    with urllib.request.urlopen(served.http_url + "/health") as r:  # no key needed
        assert json.loads(r.read()) == {"status": "ok"}


def test_chat_completion_plain_and_streamed_give_the_engines_text(client, ref):
    want = expected_text(ref, 12, messages=chat(1))
    whole = client.chat.completions.create(model="m", messages=chat(1), max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="m", messages=chat(1), max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completion(client, ref):
    r = client.completions.create(model="m", prompt="fox 7", max_tokens=6, temperature=0)
    assert r.choices[0].text == expected_text(ref, 6, prompt="fox 7")
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6


@pytest.mark.parametrize("n", [8, 32])
def test_concurrent_greedy_streams_each_give_the_engines_text(served, ref, n):
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(model="m", messages=chat(i), max_tokens=6, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    assert asyncio.run(run()) == [expected_text(ref, 6, messages=chat(i)) for i in range(n)]


def test_a_wrong_or_missing_key_gets_401(served):
    bad = openai.OpenAI(base_url=served.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = post(served.http_url + "/v1/completions", b'{"prompt": "x"}', key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


# an agent's history: an assistant turn that called a tool (OpenAI's shape)
CALLED_A_TOOL = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip


def raw_http(served, request: bytes) -> tuple[int, bytes]:
    """Send bytes no HTTP client library would; (status, body) of the reply."""
    with socket.create_connection((served.http.host, served.http.port), timeout=30) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def get_models(authorization: bytes) -> bytes:
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization + b"\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("authorization", [b"Bearer \xff\xfe", "Bearer cl\u00e9".encode(), b"\xff " + KEY.encode(), b"Basic " + KEY.encode()])
def test_a_key_that_is_not_ascii_or_not_bearer_is_a_wrong_key(served, authorization):
    # non-UTF-8 bytes reach the key check as lone surrogates, which a strict encode refuses (was a 500)
    status, body = raw_http(served, get_models(authorization))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body


@pytest.mark.parametrize("scheme", [b"bearer", b"BEARER", b"Bearer"])
def test_the_auth_scheme_is_case_insensitive(served, scheme):
    status, body = raw_http(served, get_models(scheme + b" " + KEY.encode()))  # RFC 7235, section 2.1
    assert status == 200, body


def test_a_malformed_request_gets_400_and_no_traceback_in_the_log(served, caplog):
    # a client's bad Content-Length or oversized header is its mistake, not the daemon's: aiohttp
    # answers 400 and, left alone, logged an ERROR with a traceback at the default level
    caplog.set_level(logging.INFO)
    for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n"):  # fmt: skip
        assert raw_http(served, raw)[0] == 400
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert sum(r.getMessage().startswith("bad HTTP request") for r in caplog.records) == 2


def test_a_body_that_cannot_be_read_gets_400_and_no_traceback_in_the_log(served, caplog):
    # the body's framing or encoding is the client's mistake: a gzip body that is not gzip reached the
    # handler as aiohttp's RequestPayloadError, a 500 with two ERROR tracebacks
    caplog.set_level(logging.INFO)
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
           b"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\nConnection: close\r\n\r\nabcde")  # fmt: skip
    status, body = raw_http(served, raw)
    assert status == 400 and "could not be read" in json.loads(body)["error"]["message"], body
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


def test_a_failure_in_one_of_our_handlers_is_still_logged_with_its_traceback(served, caplog, monkeypatch):
    def broken() -> dict:
        raise RuntimeError("a bug")

    monkeypatch.setattr(served.daemon, "stats", broken)
    req = urllib.request.Request(served.http_url + "/v1/fomoe/stats", headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 500
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert errors and isinstance(errors[-1].exc_info[1], RuntimeError)


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
        (json.dumps({"messages": chat(0), "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"messages": chat(0), "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"messages": "hi"}).encode(), "messages"),
        (json.dumps({"messages": chat(0), "n": 2}).encode(), "n = 1"),
        (json.dumps({"messages": [{"role": "user", "content": "fox " * 3000}]}).encode(), "context"),
        # what would change the answer and the daemon cannot do is refused, never ignored
        (json.dumps({"messages": chat(0), "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(), "tools is not supported"),
        (json.dumps({"messages": chat(0), "tool_choice": "auto"}).encode(), "tool_choice is not supported"),
        (json.dumps({"messages": chat(0), "functions": [{"name": "f"}]}).encode(), "functions is not supported"),
        (json.dumps({"messages": [*chat(0), CALLED_A_TOOL]}).encode(), "messages[1].tool_calls is not supported"),
        (json.dumps({"messages": chat(0), "response_format": {"type": "json_object"}}).encode(), "response_format is not supported"),
        (json.dumps({"messages": chat(0), "logprobs": True}).encode(), "logprobs is not supported"),
        (json.dumps({"messages": chat(0), "top_logprobs": 2}).encode(), "top_logprobs is not supported"),
    ],
)
def test_bad_input_gets_400_and_the_server_goes_on(served, client, body, says):
    status, reply = post(served.http_url + "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and says in reply["error"]["message"]
    assert client.chat.completions.create(model="m", messages=chat(2), max_tokens=2, temperature=0).choices


def test_null_and_empty_optional_fields_are_accepted(served):
    # clients that serialize every optional field send these; none asks for anything
    body = {"messages": chat(0), "max_tokens": 2, "n": None, "stop": None, "temperature": None, "tools": None,
            "tool_choice": None, "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": None,
            "stream": None, "stream_options": None}  # fmt: skip
    status, reply = post(served.http_url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply


def test_metrics_parse_as_prometheus_text(served, client):
    client.chat.completions.create(model="m", messages=chat(3), max_tokens=3, temperature=0)
    req = urllib.request.Request(served.http_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("fomoe_tokens_per_second", "fomoe_queue_length", "fomoe_expert_tier_hit_rate",
                 "fomoe_car_substitution_rate", "fomoe_prefetch_accuracy", "fomoe_requests"):  # fmt: skip
        assert name in families, name
    tiers = {s.labels["tier"]: s.value for s in families["fomoe_expert_tier_hit_rate"].samples}
    stats = served.call(served.daemon.stats)
    assert tiers["device"] == pytest.approx(stats["engine"]["cache"]["device"]["hit_rate"])
    done = {s.labels["outcome"]: s.value for s in families["fomoe_requests"].samples if s.name == "fomoe_requests_total"}
    assert sum(done.values()) >= 1


def http_responses(served) -> dict[tuple[str, str], float]:
    """fomoe_http_responses_total by (route, status), as a scrape reads it."""
    req = urllib.request.Request(served.http_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    samples = families["fomoe_http_responses"].samples
    return {(s.labels["route"], s.labels["status"]): s.value for s in samples if s.name == "fomoe_http_responses_total"}


def test_metrics_count_every_http_response_by_route_and_status(served, client):
    # The refusals never become generations, so the outcome counts miss them (32 clients sending
    # max_tokens: -5 left fomoe_requests_total unmoved): each must show here
    before = http_responses(served)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=chat(0), max_tokens=-5)
    assert post(served.http_url + "/v1/completions", b'{"prompt": "x"}', key=None)[0] == 401
    assert post(served.http_url + "/v1/nowhere", b"{}")[0] == 404
    client.models.list()
    after = http_responses(served)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    want = {("/v1/chat/completions", "400"): 1, ("/v1/completions", "401"): 1, ("unmatched", "404"): 1,
            ("/v1/models", "200"): 1, ("/metrics", "200"): 1}  # fmt: skip  # the first scrape, counted once sent
    assert {k: n for k, n in moved.items() if n} == want, moved


def test_metrics_count_the_full_queue_and_shutdown_refusals():
    # a daemon whose queue holds one generation: a socket client's, held inside its first step, fills it,
    # so an HTTP request gets 429; once the daemon is stopping, 503
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-h-")
    engine = GatedEngine(Engine(ORACLE / f"{MODEL}.gguf"))
    try:
        with DaemonThread(engine, f"{d}/d.sock", DaemonConfig(max_queue=1), http=("127.0.0.1", 0), api_key=KEY) as t:
            s = raw_connect(t.path)
            with held(engine):
                s.sendall(encode_frame({"op": "generate", "id": 1, "prompt": "fox", "max_tokens": 4}))
                assert engine.in_step.wait(10)
                body = json.dumps({"prompt": "fox", "max_tokens": 1}).encode()
                assert post(t.http_url + "/v1/completions", body)[0] == 429
                t.call(lambda: setattr(t.daemon, "stopping", True))
                assert post(t.http_url + "/v1/completions", body)[0] == 503
                t.call(lambda: setattr(t.daemon, "stopping", False))
            counted = http_responses(t)
            s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert counted[("/v1/completions", "429")] == 1 and counted[("/v1/completions", "503")] == 1, counted


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(served):
    # The generation holds after 32 tokens until the daemon has seen the client go: otherwise a
    # reply that ends (400 tokens, or an end-of-generation token) before the disconnect is noticed
    # would finish as "length" or "stop", and the test would pass or fail by timing.
    engine, hold = served.daemon.engine, threading.Event()
    decode = engine.decode

    def held(gens):
        if any(g.produced == 32 for g in gens):
            assert hold.wait(30), "the disconnect was not seen"
        return decode(gens)

    engine.decode = held
    try:
        before = served.call(lambda: served.daemon.outcomes["cancelled"])
        host, port = served.http.host, served.http.port
        body = json.dumps({"messages": chat(4), "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
        s = socket.create_connection((host, port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        s.close()
        deadline = time.monotonic() + 20
        while served.call(lambda: served.daemon.outcomes["cancelled"]) == before:
            if served.call(lambda: any(j.cancel_requested for j in served.daemon.worker.batch)):
                hold.set()  # seen: the held generation may take its next step, and stop there
            assert time.monotonic() < deadline, "the generation was not cancelled"
            time.sleep(0.02)
        stats = served.call(served.daemon.stats)
        assert stats["running"] == 0 and stats["completion_tokens"] < 10_000
    finally:
        hold.set()
        del engine.decode  # the class's method again


@pytest.mark.slow
def test_bounded_load_every_request_completes_or_is_cancelled_by_its_client(served):
    # 8 clients for 3 s: streams read to the end, or dropped by the client after a few chunks
    async def worker(c: openai.AsyncOpenAI, k: int, until: float, tally: dict) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            stream = await c.chat.completions.create(model="m", messages=chat(k * 100 + i), max_tokens=12,
                                                     temperature=0.7, stream=True)  # fmt: skip
            if (k + i) % 3 == 0:
                async for _ in stream:
                    break
                await stream.close()
                tally["cancelled"] += 1
            else:
                chunks = [ch async for ch in stream]
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                tally["completed"] += 1

    async def run() -> dict:
        tally = {"completed": 0, "cancelled": 0}
        until = time.monotonic() + 3.0
        async with openai.AsyncOpenAI(base_url=served.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            await asyncio.gather(*(worker(c, k, until, tally) for k in range(8)))
        gc.collect()  # (on the loop's thread, which closes their async generators)
        return tally

    # A dropped stream leaves the client's async generators suspended in reference cycles. The cyclic
    # collector finalizes them on whichever thread it runs: on the in-process daemon's engine thread that
    # is "async generator already executing" (an unraisable warning, the test's own garbage). Collected
    # here, on the client's loop, instead.
    gc.disable()
    try:
        tally = asyncio.run(run())
    finally:
        gc.enable()
    assert tally["completed"] > 0 and tally["cancelled"] > 0
    deadline = time.monotonic() + 20
    while served.call(lambda: (len(served.daemon.generations), served.daemon.worker.queue_length)) != (0, 0):
        assert time.monotonic() < deadline, "requests left behind"
        time.sleep(0.05)


# -- the CLI -------------------------------------------------------------------------------------


def test_host_port_and_exposure_rules():
    assert parse_host_port("8080") == ("127.0.0.1", 8080)
    assert parse_host_port("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_host_port("[::1]:9000") == ("::1", 9000)
    for bad in ("x", ":80", "1.2.3.4:99999"):
        with pytest.raises(FomoeError):
            parse_host_port(bad)
    check_exposure("127.0.0.1", None, False)
    check_exposure("0.0.0.0", "k", False)
    check_exposure("0.0.0.0", None, True)
    with pytest.raises(FomoeError, match="--http-allow-unauthenticated"):
        check_exposure("0.0.0.0", None, False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_http_port_in_use_is_a_one_line_error_and_the_daemon_stops_cleanly():
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-h-")
    sock = f"{d}/d.sock"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            proc = subprocess.run([sys.executable, "-m", "fomoepy.cli", "serve", str(ORACLE / f"{MODEL}.gguf"), "--socket", sock,
                                   "--http", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
            assert not os.path.exists(sock)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fomoe: error: ") and f"127.0.0.1:{port}" in last and "in use" in last, last
    assert "INFO: stopped" in proc.stderr  # the worker and the socket went through the graceful shutdown


def test_sigterm_ends_open_streams_with_a_final_chunk_exits_0_and_removes_the_socket(tmp_path):
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-h-")
    sock, port = f"{d}/d.sock", free_port()
    env = {**os.environ, "FOMOE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "fomoepy.cli", "serve", str(ORACLE / f"{MODEL}.gguf"), "--socket", sock,
                             "--http", f"127.0.0.1:{port}", "--log-level", "warning"], env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        stream = c.chat.completions.create(model="m", messages=chat(5), max_tokens=2000, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # ends: the final chunk, then [DONE]
        assert rest[-1].choices[0].finish_reason == "cancelled"
        assert proc.wait(30) == 0
        assert not os.path.exists(sock)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


# -- the page ------------------------------------------------------------------------------------


def chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture
def page(served):
    """Headless Chromium on the daemon's page."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(served.http_url + "/")
        yield driver
    finally:
        driver.quit()


NO_CHROMIUM = "no chromium + chromedriver (Debian: apt-get install chromium chromium-driver)"


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason=NO_CHROMIUM)
def test_the_page_streams_an_answer_and_its_charts_update(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page.find_element(By.ID, "key").send_keys(KEY)
    page.find_element(By.ID, "msg").send_keys("fox fox")
    page.find_element(By.ID, "send").click()
    wait = WebDriverWait(page, 60)
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant").text.strip() != "")
    wait.until(lambda d: "tokens" in d.find_element(By.ID, "status").text)  # the stream's usage chunk
    wait.until(lambda d: int(d.find_element(By.ID, "speed").get_attribute("data-points") or 0) >= 1)
    assert int(page.find_element(By.ID, "hits").get_attribute("data-points")) >= 1
    wait.until(lambda d: f"{MODEL}.gguf" in d.find_element(By.ID, "model").text)


# The page's fetch, wrapped: each chat request's messages are kept in `sent`, and while `brokenStream`
# is set a chat request gets that server-sent-event body instead of the daemon's (an error midway)
RECORD_FETCH = """
window.sent = []; window.brokenStream = null;
const real = window.fetch;
window.fetch = (url, opts) => {
  if (url !== "/v1/chat/completions") return real(url, opts);
  window.sent.push(JSON.parse(opts.body).messages);
  if (window.brokenStream) return Promise.resolve(new Response(window.brokenStream, {headers: {"Content-Type": "text/event-stream"}}));
  return real(url, opts);
};
"""
MIDWAY_ERROR = ('data: {"choices":[{"index":0,"delta":{"content":"half an"}}]}\n\n'
                'data: {"error":{"message":"internal error: boom","type":"server_error","code":"internal"}}\n\n'
                "data: [DONE]\n\n")  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason=NO_CHROMIUM)
def test_the_page_shows_a_failed_answer_and_leaves_its_turn_out_of_the_context(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(page, 60)
    page.execute_script(RECORD_FETCH)

    def ask(text: str, ends: str) -> str:
        page.find_element(By.ID, "msg").send_keys(text)
        page.find_element(By.ID, "send").click()
        wait.until(lambda d: ends in d.find_element(By.ID, "status").text)
        return page.find_element(By.ID, "status").text

    assert "wrong API key" in ask("fox one", "error")  # refused before any answer: no key typed yet
    page.find_element(By.ID, "key").send_keys(KEY)
    page.execute_script("window.brokenStream = arguments[0];", MIDWAY_ERROR)
    assert ask("fox two", "error") == "error: internal error: boom"
    page.execute_script("window.brokenStream = null;")
    ask("fox three", "tokens")
    sent = page.execute_script("return window.sent;")
    assert sent[-1] == [{"role": "user", "content": "fox three"}], sent  # neither failed turn went back
    assert len(page.find_elements(By.CSS_SELECTOR, ".user.failed")) == 2
