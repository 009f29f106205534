"""Serving the app: uvicorn with a deadline for request headers, the drain at shutdown, a port bound before the model
loads, and a background server for tests, benchmarks and notebooks."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def _protocol_with_header_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers, counted from the connection (or the end of
    the previous response): a client that has not sent them in ``seconds`` is disconnected."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before the next request is read, which may already be here (it disarms)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


class _DrainingServer(uvicorn.Server):
    """uvicorn's server that starts the chat server's drain (`JobQueue.begin_shutdown`) as soon as it begins to shut
    down (SIGTERM, Ctrl-C or ``should_exit``), not after every connection closed."""

    def __init__(self, config: uvicorn.Config, chat):
        super().__init__(config)
        self.chat = chat

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if sockets is not None and self.started:  # uvicorn says where it runs only for the sockets it binds itself
            self._log_started_message(sockets)

    async def shutdown(self, sockets=None) -> None:
        self.chat.queue.begin_shutdown()
        await super().shutdown(sockets=sockets)


def uvicorn_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app`` (from `create_app`): h11 with a deadline for request headers (the app's
    ``read_timeout``), idle connections closed after 5 s, and at shutdown the drain of `JobQueue.begin_shutdown`
    (connections still open ``drain_timeout`` + 5 s later are cancelled). Run it with ``.run()``, or ``.run(sockets=
    [sock])`` on a socket bound before the model loaded.

    Example:
        >>> uvicorn_server(create_app(engine, tokenizer), port=8000).run()   # doctest: +SKIP
    """
    chat = app.state.server
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=_protocol_with_header_deadline(chat.limits.read_timeout), timeout_keep_alive=5,
                            timeout_graceful_shutdown=max(0.0, chat.limits.drain_timeout) + 5)
    return _DrainingServer(config, chat)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``SO_REUSEADDR``, as uvicorn binds); ``OSError`` if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> Iterator[str]:
    """Serve ``app`` with `uvicorn_server` in a background thread (tests, benchmarks, notebooks); yields its base URL
    (``http://127.0.0.1:PORT``; ``port=0``: a free port) and stops the server on exit.

    Example:
        >>> with running(create_app(engine, tokenizer)) as url:                              # doctest: +SKIP
        ...     OpenAI(base_url=url + "/v1", api_key="-").models.list()
    """
    sock = bind(host, port)
    server = uvicorn_server(app, host, sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="peft-kvcache-http")
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


__all__ = ["bind", "running", "uvicorn_server"]
