"""The engine thread of serve.py: the only thread that touches MLX.

The HTTP handlers run on an asyncio event loop and must never wait for the model, so they talk
to the engine through two kinds of queues. Handlers put commands (add a request, abort one,
stop) on one thread-safe queue; the engine thread takes them between steps, runs `step()`, and
hands each request's outputs to that request's own `Channel`, which the handler reads. With no
work the engine thread sleeps on the command queue instead of spinning.

A request is known to the engine thread by its Channel: the handler never needs the engine's
request id, and since commands are taken in order, an abort always arrives after the add it
cancels.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .server_api import ApiError

RETRY_AFTER_SECONDS = 1


@dataclass
class Accepted:
    """The engine took the request: outputs follow."""


class Channel:
    """One request on its way through the engine: what to run, and an asyncio queue, read by
    the request's handler, that the engine thread fills with Accepted, the engine's
    RequestOutputs, and at most one ApiError (a refusal or a failure)."""

    def __init__(self, prompt: list[int], params: Any) -> None:
        self.prompt, self.params = prompt, params
        self.request_id: int | None = None  # the engine's id; the engine thread's business
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

    def put(self, event: Any) -> None:
        """Hand an event to the handler (any thread may call this)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass

    async def next(self) -> Any:
        """The next event; an ApiError is raised rather than returned."""
        event = await self._events.get()
        if isinstance(event, ApiError):
            raise event
        return event


class EngineService:
    """Runs an engine on a thread of its own.

    `build` runs first, on that thread, and returns the engine (so that loading the model is
    MLX work of the same thread). `max_waiting` refuses a request that would make more than
    that many wait for a decode slot (HTTP 429); None lets the queue grow.
    """

    def __init__(
        self,
        build: Callable[[], Any],
        batch_size: int,
        max_waiting: int | None = None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._build, self._batch_size, self._max_waiting = build, batch_size, max_waiting
        self.on_failure = on_failure  # called on the engine thread if the engine fails
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders a last submit against the thread's exit
        self._closed = False
        self._live: dict[int, Channel] = {}  # engine id -> channel, on the engine thread only
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self.engine: Any = None
        self.error: BaseException | None = None  # why the engine thread stopped, if it failed
        self.snapshot: dict[str, Any] = {}  # engine.stats() after the latest step
        self.refused_busy = 0  # requests turned away by max_waiting

    # --- called from other threads ----------------------------------------------------------

    def start(self) -> Any:
        """Start the thread and wait for `build`; its exception is raised here."""
        self._thread.start()
        while not self._ready.wait(0.1):  # a short wait: Ctrl-C is still heard meanwhile
            pass
        if self.error is not None:
            raise self.error
        return self.engine

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, channel: Channel) -> None:
        """Ask for a request to be added; its channel receives Accepted or an ApiError."""
        self._send(("add", channel), channel)

    def cancel(self, channel: Channel) -> None:
        """Abort a request (its client is gone); nothing happens once it has finished."""
        self._send(("abort", channel), None)

    def close(self) -> None:
        """Stop the thread after its current step; every request in flight gets a 503."""
        self._send(("close", None), None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _send(self, command: tuple[str, Channel | None], channel: Channel | None) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return
        if channel is not None:
            channel.put(_unavailable())

    # --- the engine thread --------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as e:  # reported by start(), on the main thread
            self.error = e
            self._closed = True
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except Exception as e:  # a bug in the engine: fail what is in flight, stop serving
            self.error = e
            if not isinstance(e, NotImplementedError):  # an exercise not written yet is not a bug
                traceback.print_exc()
            print(f"error: the engine failed: {e}; stopping", file=sys.stderr, flush=True)
            self._fail_all(ApiError(500, f"the engine failed: {e}", kind="server_error"))
            self.on_failure()
        finally:
            self._shut()

    def _serve(self) -> None:
        """Commands, then one step, until a close command: the engine's whole life."""
        self.snapshot = self.engine.stats()
        while True:
            for kind, channel in self._take_commands():
                if kind == "close":
                    self._fail_all(_unavailable())
                    return
                if kind == "add":
                    self._add(channel)
                else:
                    self._abort(channel)
            if self.engine.has_work:
                self._deliver(self.engine.step())
            self.snapshot = self.engine.stats()

    def _take_commands(self) -> list[tuple[str, Channel | None]]:
        """The commands waiting, up to a close (what follows it is for _shut to refuse); when
        the engine has nothing to do, sleep until one comes."""
        commands = [] if self.engine.has_work else [self._commands.get()]
        while not commands or commands[-1][0] != "close":
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        return commands

    def _add(self, channel: Channel) -> None:
        if self._would_wait_too_long():
            self.refused_busy += 1
            channel.put(_busy(self._max_waiting))
            return
        try:
            channel.request_id = self.engine.add_request(channel.prompt, channel.params)
        except ValueError as e:  # what only the engine can check; it allocated nothing
            channel.put(ApiError(400, str(e)))
            return
        self._live[channel.request_id] = channel
        channel.put(Accepted())

    def _would_wait_too_long(self) -> bool:
        """Whether one more request would leave more than max_waiting without a slot."""
        if self._max_waiting is None:
            return False
        stats = self.engine.stats()
        waiting = stats["running"] + stats["waiting"] + 1 - self._batch_size
        return waiting > self._max_waiting

    def _abort(self, channel: Channel) -> None:
        if channel.request_id in self._live:
            self.engine.abort(channel.request_id)  # its final output comes with the next step

    def _deliver(self, outputs: list[Any]) -> None:
        for output in outputs:
            channel = self._live.get(output.request_id)
            if channel is None:
                continue
            if output.finish_reason is not None:
                del self._live[output.request_id]
            channel.put(output)

    def _fail_all(self, error: ApiError) -> None:
        """Every request in flight gets `error` (the engine stops with them: nothing to free)."""
        for channel in self._live.values():
            channel.put(error)
        self._live.clear()

    def _shut(self) -> None:
        """No more commands are taken: the requests still queued are told so."""
        with self._lock:
            self._closed = True
        while True:
            try:
                kind, channel = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                channel.put(_unavailable())


def _unavailable() -> ApiError:
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
