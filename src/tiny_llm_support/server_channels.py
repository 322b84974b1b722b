"""What the engine's messages become on serve.py's event loop, where EngineClient
(server_engine.py) puts them: a request's Channel, read by its handler, and an /events client's
Subscriber, read by the live page's stream. Putting never blocks the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from .server_api import ApiError

SNAPSHOTS_QUEUED = 8  # per /events client: a slower one loses the oldest (each is whole)


@dataclass
class Accepted:
    """The engine took the request: outputs follow."""


@dataclass
class Scored:
    """A prompt's logprob entries (server_formats.Entry; the first token's logprob None), the
    answer to a score Channel."""

    entries: list


@dataclass
class Output:
    """What one engine step produced for one request (the engine's RequestOutput, as the pipe
    carries it). sampled_at: time.monotonic() in the engine process when that step ended;
    logprobs: an entry (server_formats.Entry) per token of token_ids, if the request asked."""

    key: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    sampled_at: float
    logprobs: list | None = None


class Channel:
    """One request on its way through the engine: what to run, and a queue, read by its
    handler, that receives Accepted, then Outputs, or at most one ApiError (a refusal or a
    failure). Lives on the event loop. With `score` = k, the request is a prompt to score (its
    logprobs with the k most likely tokens, Engine.score) instead: Scored, or an ApiError."""

    def __init__(self, prompt: list[int], params: Any, score: int | None = None) -> None:
        self.prompt, self.params, self.score = prompt, params, score
        self.key: int | None = None
        self._events: asyncio.Queue = asyncio.Queue()

    def put(self, event: Any) -> None:
        self._events.put_nowait(event)

    async def next(self) -> Any:
        """The next event; an ApiError is raised rather than returned."""
        event = await self._events.get()
        if isinstance(event, ApiError):
            raise event
        return event


class Subscriber:
    """One /events client: its latest snapshots (JSON text), read by its handler on the event
    loop. The queue is bounded: when the client reads too slowly the oldest snapshot is dropped,
    so nobody waits for it. None at the end: the engine has stopped."""

    def __init__(self) -> None:
        self._queue: deque[str | None] = deque(maxlen=SNAPSHOTS_QUEUED)
        self._ready = asyncio.Event()

    def put(self, snapshot: str | None) -> None:
        """Queue a snapshot (on the event loop; it never blocks)."""
        self._queue.append(snapshot)  # a full deque drops its oldest
        self._ready.set()

    async def next(self, timeout: float) -> str | None:
        """The oldest snapshot queued; "" if none came within `timeout` seconds; None once
        the engine has stopped."""
        while not self._queue:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return ""
        return self._queue.popleft()
