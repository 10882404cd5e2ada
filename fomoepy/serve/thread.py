"""A daemon on a background thread with its own uvloop loop: for programs that embed it, and for tests.

    with DaemonThread(engine, "/tmp/x/fomoe.sock") as d:
        Client(d.path).complete(prompt="Hi")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import uvloop

from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.daemon import Daemon
from fomoepy.serve.listen import bind_unix


class DaemonThread:
    def __init__(self, engine, path: str, config: DaemonConfig | None = None, group: str | None = None, *,
                 http: tuple[str, int] | None = None, api_key: str | None = None):  # fmt: skip
        """http: (host, port) of an HTTP front too (port 0: any free one; `http_url` says which)."""
        self.path = path
        self.listener = bind_unix(path, group)
        self.daemon = Daemon(engine, config)
        self.http = None
        if http is not None:
            from fomoepy.serve.http import HttpFront

            self.http = HttpFront(self.daemon, *http, api_key=api_key)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fomoe-daemon", daemon=True)

    def start(self, timeout: float = 30.0) -> DaemonThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the daemon did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown (as on SIGTERM); waits for the thread."""
        self.daemon.request_exit()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the daemon did not stop")

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run fn on the daemon's loop thread and return its result (to inspect or tune live state)."""
        async def run() -> Any:
            return fn()

        assert self.daemon.loop is not None
        return asyncio.run_coroutine_threadsafe(run(), self.daemon.loop).result(timeout)

    @property
    def http_url(self) -> str:
        assert self.http is not None
        return self.http.description

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> DaemonThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            uvloop.run(self._serve())
        except Exception as e:  # reported to start(); the thread ends either way
            self._error = e
            self._ready.set()
        finally:
            self.listener.remove_file()
            self.listener.sock.close()

    async def _serve(self) -> None:
        await self.daemon.serve(self.listener, on_ready=self._ready.set, fronts=[self.http] if self.http else [])
