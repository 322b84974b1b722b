"""The HTTP process's end of the engine: serve.py runs its engine in a process of its own
(engine_process.py), the way vLLM runs its engine core, and this module starts it, sends it work
and hands back what it produces.

    HTTP process (asyncio: parse, tokenize, stream)          engine process (owns MLX)
      handler --submit--> outbox --writer thread--> pipe --> commands, one step, outputs
      handler <--Channel-- event loop <-------------- pipe <------------------------'

The event loop reads the pipe itself whenever it is readable (add_reader), and every request's
Channel and every /events Subscriber lives on it; a writer thread sends the handlers' commands,
so that a long prompt never blocks the loop while the engine is busy. No handler ever waits for
the engine, and the engine never waits for a client. A request is known to both sides by a key the HTTP side chooses; the
pipe keeps commands in order, so an abort always arrives after the add it cancels.

This module holds EngineClient, what the handlers call. One engine process with its pipe and
writer thread is an EngineProcess (engine_pipe.py); a request's Channel and an /events client's
Subscriber, the queues the handlers read, are in server_channels.py.

When the engine process ends unasked (killed, crashed, or exiting to be restarted), every request
in flight gets a 500, /health says so, and a fresh process is started (at most MAX_RESTARTS in
RESTART_WINDOW_S; under --tp, whose other ranks cannot follow a new process, never); past that
the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from . import engine_process
from .engine_pipe import EngineProcess
from .server_api import ApiError
from .server_channels import Accepted, Channel, Output, Scored, Subscriber

RETRY_AFTER_SECONDS = 1
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600


class EngineClient:
    """The engine as the HTTP handlers see it: submit, cancel, subscribe, health, stats.

    `max_waiting` refuses at once (429) a request that would make more than that many wait for
    a decode slot; None lets the queue grow. `on_failure` is called when the engine is gone for
    good (the server then stops). Call start() first, and attach() on the event loop."""

    def __init__(
        self,
        args: argparse.Namespace,
        path: Path,
        draft_path: Path | None = None,
        max_waiting: int | None = None,
    ) -> None:
        self._spawn_args = (args, path, draft_path)
        self._batch_size, self._max_waiting = args.batch_size, max_waiting
        self._restartable = args.tp <= 1
        self.on_failure = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: EngineProcess | None = None
        self._channels: dict[int, Channel] = {}  # key -> channel, on the event loop only
        self._subscribers: set[Subscriber] = set()
        self._keys = itertools.count()
        self._restarts: deque[float] = deque()
        self._closed = False
        self.state = "starting"  # "ok", "restarting", "stopped"
        self.info: dict[str, Any] = {}  # what the engine said when ready (vocab_size)
        self.stats: dict[str, Any] = {}  # engine.stats() after its latest turn
        self.snapshot: str | None = None  # the live page's latest snapshot (JSON text)
        self.failures: list[str] = []  # why requests were failed by the engine, latest last
        self.error: str | None = None  # why the engine is gone for good
        self.refused_busy = 0  # requests turned away by max_waiting

    # --- life ----------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the engine process and wait until it is ready (EngineStartError if not)."""
        self._engine = EngineProcess(*self._spawn_args)
        try:
            self.info = self._engine.wait_ready()
        except BaseException:
            self.state = "stopped"
            self._engine.stop(timeout=5)
            raise
        self._engine.start_writer()
        self.state = "ok"
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the handlers run on (at the app's start-up): from now on it reads
        the engine's messages as they come."""
        self._loop = loop
        self._listen(self._engine)

    def close(self) -> None:
        """Stop serving: every request in flight gets a 503, every /events stream ends, and the
        engine process is told to stop. Any thread, and a signal handler: while the event loop
        runs, the work is done there (a handler must not take the outbox's lock, which the code
        it interrupted may hold)."""
        if self._loop is not None and self._loop.is_running():
            self._on_loop(self._close)
        else:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed, self.state = True, "stopped"
        if self._engine is not None:
            self._engine.outbox.put(("close",))
        self._end_all(_unavailable())

    def join(self, timeout: float) -> None:
        """Close (the event loop has stopped), and wait for the engine process to end (killed
        after `timeout` seconds)."""
        self._close()
        if self._engine is not None:
            self._engine.stop(timeout)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of GET /health."""
        running = self.state == "ok"
        body = {"status": self.state, "engine_pid": self._engine.process.pid if running else None}
        body |= {"engine_failures": len(self.failures), "restarts": len(self._restarts)}
        if self.failures:
            body["last_failure"] = self.failures[-1]
        if self.error:
            body["error"] = self.error
        return (200 if self.state == "ok" else 503), body

    # --- requests (on the event loop) --------------------------------------------------------

    def submit(self, *channels: Channel) -> None:
        """Send a request to the engine, or with several channels (one prompt, one
        SamplingParams) that many answers to it, added by one command (Engine.add_choices);
        each channel receives Accepted or an ApiError. A 503 while the engine is not running,
        a 429 past max_waiting, raised here at once. A score channel's prompt is scored between
        two steps (it takes no slot: no max_waiting); it receives Scored or an ApiError."""
        if self.state != "ok":
            raise _unavailable(self.state)
        first = channels[0]
        if first.score is not None:
            first.key = next(self._keys)
            self._channels[first.key] = first
            self._engine.outbox.put(("score", first.key, first.prompt, first.score))
            return
        if self._would_wait_too_long(len(channels)):
            self.refused_busy += 1
            raise _busy(self._max_waiting)
        for channel in channels:
            channel.key = next(self._keys)
            self._channels[channel.key] = channel
        keys = [channel.key for channel in channels]
        self._engine.outbox.put(("add", keys, first.prompt, first.params))

    def cancel(self, channel: Channel) -> None:
        """Abort a request (its client is gone); nothing happens once it has finished. (A
        score is not aborted: one forward pass, its answer dropped.)"""
        if channel.key in self._channels and channel.score is None:
            self._engine.outbox.put(("abort", channel.key))

    def subscribe(self) -> Subscriber:
        """A queue of live snapshots for one /events client: the latest at once, then each
        new one; it ends at once when the engine is gone for good."""
        subscriber = Subscriber()
        if self.state == "stopped":
            subscriber.put(None)
            return subscriber
        if self.snapshot is not None:
            subscriber.put(self.snapshot)
        self._subscribers.add(subscriber)
        self._engine.outbox.put(("watch",))  # a fresh one, even if the engine is idle
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def _would_wait_too_long(self, more: int) -> bool:
        """Whether `more` requests would leave more than max_waiting without a slot."""
        if self._max_waiting is None:
            return False
        requests = sum(c.score is None for c in self._channels.values())
        return requests + more - self._batch_size > self._max_waiting

    # --- what the engine sends (on the event loop) -------------------------------------------

    def _listen(self, engine: EngineProcess) -> None:
        """Read `engine`'s pipe whenever it is readable: no thread between the pipe and the
        handlers, so a token costs one wake-up of the event loop."""
        self._loop.add_reader(engine.conn.fileno(), self._readable, engine)

    def _readable(self, engine: EngineProcess) -> None:
        """Every message waiting on the pipe; its end means the engine process has ended."""
        try:
            while engine.conn.poll(0):
                self._dispatch(engine.conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(engine.conn.fileno())
            self._ended(engine)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "accepted":
            self._to(message[1], Accepted(), last=False)
        elif kind == "refused":
            _, key, status, text = message
            self._to(key, ApiError(status, text, kind=_error_kind(status)), last=True)
        elif kind == "scored":
            self._to(message[1], Scored(message[2]), last=True)
        elif kind == "turn":
            self.stats = message[2]
            for fields in message[1]:
                output = Output(*fields)
                self._to(output.key, output, last=output.finish_reason is not None)
        elif kind == "state":  # read by /metrics and GET / as plain values
            snapshot, self.stats = message[1], message[2]
            if snapshot is not None:
                self.snapshot = snapshot
                for subscriber in self._subscribers:
                    subscriber.put(snapshot)
        elif kind == "failure":
            _, keys, text, self.stats = message
            self.failures.append(text)
            for key in keys:
                self._to(key, ApiError(500, text, kind="server_error"), last=True)

    def _to(self, key: int, event: Any, last: bool) -> None:
        channel = self._channels.pop(key, None) if last else self._channels.get(key)
        if channel is not None:
            channel.put(event)

    def _ended(self, engine: EngineProcess) -> None:
        """The engine process has ended, unasked (on the event loop): every request in flight
        fails, and a thread waits for the process, then starts a new one or gives up."""
        engine.outbox.put(None)  # its writer thread ends
        if self._closed:
            return
        message = "the engine process ended while it ran this request"
        self._end_all(ApiError(500, message, kind="server_error"))
        self.state = "restarting" if self._may_restart() else "stopped"
        threading.Thread(target=self._replace, args=(engine,), daemon=True).start()

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        return self._restartable and len(self._restarts) < MAX_RESTARTS

    def _replace(self, ended: EngineProcess) -> None:
        """(A thread of its own.) Why it ended, then a new engine process, or give up."""
        ended.process.join(5)
        status = ended.process.exitcode
        reason = f"the engine process ended (exit status {status})"
        if status == engine_process.RESTART_STATUS:
            reason = "the engine restarted after a failed step left pages in use"
        self.failures.append(reason)
        if self.state != "restarting":
            self._give_up(reason)
            return
        self._restarts.append(time.monotonic())
        print(f"error: {reason}; starting a new one", file=sys.stderr, flush=True)
        try:
            engine = EngineProcess(*self._spawn_args)
            engine.wait_ready()
        except Exception as e:
            self._give_up(f"{reason}, and a new one did not start: {e}")
            return
        self._on_loop(self._replaced, engine)

    def _replaced(self, engine: EngineProcess) -> None:
        """The new engine process is ready (on the event loop)."""
        if self._closed:
            engine.stop(timeout=5)
            return
        self._engine = engine
        engine.start_writer()
        self._listen(engine)
        self.state = "ok"

    def _give_up(self, reason: str) -> None:
        self.error = reason
        print(f"error: {reason}; stopping", file=sys.stderr, flush=True)
        self.close()
        self.on_failure()

    def _end_all(self, error: ApiError) -> None:
        """Every request in flight gets `error`; with the engine gone for good, every /events
        stream ends."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.put(error)
        if self.state == "stopped":
            for subscriber in self._subscribers:
                subscriber.put(None)
            self._subscribers.clear()

    def _on_loop(self, function, *args: Any) -> None:
        """Run `function` on the event loop (now, if there is none yet: nothing waits then)."""
        if self._loop is None:
            function(*args)
            return
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass


def _error_kind(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _unavailable(state: str = "stopped") -> ApiError:
    if state == "restarting":
        message = "the engine is restarting after a failure: retry in a few seconds"
        return ApiError(503, message, kind="server_error", code="engine_restarting")
    return ApiError(
        503, "the server is shutting down", kind="server_error", code="server_shutting_down"
    )


def _busy(max_waiting: int | None) -> ApiError:
    return ApiError(
        429,
        f"too many requests are waiting (--max-waiting {max_waiting}): retry later",
        kind="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )
