"""How serve.py runs its app: the listening socket, and uvicorn with the stop signals handled
so that requests in flight end with an error rather than hang or vanish, and with every
connection bounded in time: idle after a response (uvicorn's keep-alive timeout) and before a
request's headers are whole (HeaderTimeout, which uvicorn lacks); a request body has its own
limit in server.read_body."""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .server_engine import EngineClient

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
KEEP_ALIVE_S = 5  # an idle connection is closed this long after its last response
HEADERS_S = 10  # a connection must send a request's whole headers within this


class HeaderTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that has not sent a whole request
    head within HEADERS_S of opening or of its last response (a client that connects and says
    nothing, or a byte a minute, would otherwise hold a file descriptor forever)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived: its handler runs now
            self._timer.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(HEADERS_S, self._expire)

    def _expire(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            self.transport.close()


class StoppableServer(uvicorn.Server):
    """uvicorn's server, with SIGINT and SIGTERM handled here.

    The first signal calls `on_stop` (which fails the requests in flight, so that their
    streams end with an error chunk rather than hang) and lets uvicorn finish its connections;
    a second one stops at once. Unlike uvicorn's own handler, the signal is not raised again
    afterwards: `stop_signal` tells the caller which one came, and it chooses the exit status.
    """

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop
        self.stop_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.stop_signal = sig
        self.should_exit = True
        self.on_stop()

    def stop(self) -> None:
        """Stop from another thread (the engine's, when it fails): uvicorn checks this flag
        ten times a second."""
        self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port), made before the model loads so that a
    port in use is reported at once. OSError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def serve(app: FastAPI, sock: socket.socket, service: EngineClient) -> StoppableServer:
    """Serve on `sock` until a signal, or until the engine is gone for good; returns the
    stopped server (its stop_signal says which signal, if any, stopped it)."""
    config = uvicorn.Config(
        app,
        log_level="info",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=HeaderTimeout,
    )
    server = StoppableServer(config, on_stop=service.close)
    service.on_failure = server.stop
    server.run(sockets=[sock])
    return server
