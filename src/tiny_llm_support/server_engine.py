"""The engine thread of serve.py: the only thread that touches MLX.

The HTTP handlers run on an asyncio event loop and must never wait for the model, so they talk
to the engine through two kinds of queues. Handlers put commands (add a request, abort one,
stop) on one thread-safe queue; the engine thread takes them between steps, runs `step()`, and
hands each request's outputs to that request's own `Channel`, which the handler reads. With no
work the engine thread sleeps on the command queue instead of spinning.

A request is known to the engine thread by its Channel: the handler never needs the engine's
request id, and since commands are taken in order, an abort always arrives after the add it
cancels.

The live page (GET / and GET /events) watches the same thread: the engine reports every
scheduler event to an EngineWatch (Engine(on_step=...)), which after each step turns the
engine's state into a small JSON snapshot for every /events client (a Subscriber: a bounded
queue whose oldest snapshots are dropped when its client reads too slowly). The engine never
waits for a client, and no handler ever reads the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .server_api import ApiError
from .server_ranks import add_op, with_seed

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

    `build(on_step)` runs first, on that thread, and returns the engine, made with
    Engine(on_step=on_step) so that the live page sees its events (and so that loading the
    model is MLX work of the same thread). `max_waiting` refuses a request that would make more
    than that many wait for a decode slot (HTTP 429); None lets the queue grow. `relay` (serve
    --tp, server_ranks.py) gets each turn's operations on the engine, before its step, so that
    the other ranks can apply them too.
    """

    def __init__(
        self,
        build: Callable[[Callable[[Any], None]], Any],
        batch_size: int,
        max_waiting: int | None = None,
        on_failure: Callable[[], None] = lambda: None,
        relay: Callable[[list], None] | None = None,
    ) -> None:
        self._build, self._batch_size, self._max_waiting = build, batch_size, max_waiting
        self._relay = relay
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
        self.watch = EngineWatch()  # the live page's view of the engine

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

    def subscribe(self) -> Subscriber:
        """A queue of live snapshots for one /events client (call on the event loop). The
        engine thread is woken to send the current state at once; once it has stopped, the
        queue ends at once."""
        subscriber = Subscriber()
        self.watch.add(subscriber)
        self._send(("watch", None), None)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.watch.remove(subscriber)

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
            self.engine = self._build(self.watch.on_step)
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
        """Commands, then one step, until a close command: the engine's whole life. After
        each turn the live page gets a snapshot (at most MIN_INTERVAL_S apart while the engine
        works; always when it goes idle, and when a new client asked for one)."""
        self.snapshot = self.engine.stats()
        while True:
            asked = False  # a new /events client waits for its first snapshot
            ops = []  # what reached the engine this turn, for the other ranks
            for kind, channel in self._take_commands():
                if kind == "close":
                    self._pass_on([["close"]])
                    self._fail_all(_unavailable())
                    return
                if kind == "add":
                    ops += self._add(channel)
                elif kind == "abort":
                    ops += self._abort(channel)
                else:  # "watch"
                    asked = True
            if ops or self.engine.has_work:
                self._pass_on(ops)
            if self.engine.has_work:
                self._deliver(self.engine.step())
            self.snapshot = self.engine.stats()
            self.watch.publish(self.engine, self.snapshot, now=asked or not self.engine.has_work)

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

    def _pass_on(self, ops: list) -> None:
        if self._relay is not None:
            self._relay(ops)

    def _add(self, channel: Channel) -> list:
        """Add the request; returns the operations that reached the engine."""
        if self._would_wait_too_long():
            self.refused_busy += 1
            channel.put(_busy(self._max_waiting))
            return []
        if self._relay is not None:
            channel.params = with_seed(channel.params)
        op = add_op(channel.prompt, channel.params)
        try:
            channel.request_id = self.engine.add_request(channel.prompt, channel.params)
        except ValueError as e:  # what only the engine can check; it allocated nothing
            channel.put(ApiError(400, str(e)))
            return [op]  # the other ranks' engines refuse it too, and count its id alike
        self._live[channel.request_id] = channel
        channel.put(Accepted())
        return [op]

    def _would_wait_too_long(self) -> bool:
        """Whether one more request would leave more than max_waiting without a slot."""
        if self._max_waiting is None:
            return False
        stats = self.engine.stats()
        waiting = stats["running"] + stats["waiting"] + 1 - self._batch_size
        return waiting > self._max_waiting

    def _abort(self, channel: Channel) -> list:
        if channel.request_id not in self._live:
            return []
        self.engine.abort(channel.request_id)  # its final output comes with the next step
        self.watch.note("abort", channel.request_id)
        return [["abort", channel.request_id]]

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
        """No more commands are taken: the requests still queued are told so, and every
        /events stream ends."""
        with self._lock:
            self._closed = True
        self.watch.close()
        while True:
            try:
                kind, channel = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                channel.put(_unavailable())


# --- the live page's view of the engine ---------------------------------------------------------

MIN_INTERVAL_S = 1 / 20  # while the engine works, at most 20 snapshots a second
PASSES_KEPT = 16  # the latest forward passes in each snapshot
EVENTS_KEPT = 12  # the latest scheduling events in each snapshot
SNAPSHOTS_QUEUED = 8  # per client: a slower one loses the oldest (each snapshot is whole)


class Subscriber:
    """One /events client: its latest snapshots (JSON text), read by its handler on the event
    loop. The queue is bounded: when the client reads too slowly the oldest snapshot is dropped,
    so the engine thread never waits for it. None at the end: the engine has stopped."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: deque[str | None] = deque(maxlen=SNAPSHOTS_QUEUED)
        self._ready = asyncio.Event()

    def put(self, snapshot: str | None) -> None:
        """Queue a snapshot (any thread may call this; it never blocks)."""
        self._queue.append(snapshot)  # a full deque drops its oldest
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass

    async def next(self, timeout: float) -> str | None:
        """The oldest snapshot queued; "" if none came within `timeout` seconds; None once
        the engine has stopped."""
        while not self._queue:  # a wake-up may come late, for a snapshot already taken
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return ""
        return self._queue.popleft()


class EngineWatch:
    """What the live page shows, kept by the engine thread.

    `on_step` is the engine's on_step hook: it records each forward pass (its decode rows and
    prompt chunks, from the "decode" and "prefill" events that share a pass number) and each
    scheduling event ("admit", "wait", "preempt", "refuse", "finish"; the service adds
    "abort"). `publish`, after a step, reads the engine's slots, queue and page pool, and sends
    every subscriber the same snapshot (see `snapshot` for its fields). Only the engine thread
    calls these two; `add`, `remove` and `close` may come from any thread.
    """

    def __init__(self) -> None:
        self.passes: deque[dict[str, Any]] = deque(maxlen=PASSES_KEPT)
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.events_seen = 0
        self.started = time.monotonic()
        self.last_sent = -math.inf
        self._subscribers: set[Subscriber] = set()
        self._lock = threading.Lock()
        self._closed = False

    # --- subscribers (any thread) ------------------------------------------------------------

    def add(self, subscriber: Subscriber) -> None:
        with self._lock:
            if not self._closed:
                self._subscribers.add(subscriber)
                return
        subscriber.put(None)  # the engine has stopped: nothing will come

    def remove(self, subscriber: Subscriber) -> None:
        with self._lock:
            self._subscribers.discard(subscriber)

    def close(self) -> None:
        """The engine has stopped: every stream ends."""
        with self._lock:
            self._closed = True
            subscribers, self._subscribers = self._subscribers, set()
        for subscriber in subscribers:
            subscriber.put(None)

    # --- the engine thread -------------------------------------------------------------------

    def on_step(self, step: Any) -> None:
        """Record one BatchStep (Week 3's scheduler events)."""
        if step.kind in ("prefill", "decode"):
            if not self.passes or self.passes[-1]["n"] != step.forward_pass:
                self.passes.append({"n": step.forward_pass, "decode": 0, "chunks": []})
            this = self.passes[-1]
            if step.kind == "decode":
                this["decode"] += step.tokens  # rows (tokens, with speculative decoding)
            else:
                this["chunks"].append([step.request.prompt_idx, step.tokens])
            return
        request = step.request  # "admit": `tokens` found in the prefix cache
        self.note(
            step.kind,
            None if request is None else request.prompt_idx,
            tokens=step.tokens,
            generated=0 if request is None else len(request.generated),
            detail=getattr(step, "detail", ""),
        )

    def note(self, kind: str, request_id: int | None, **fields: Any) -> None:
        """A scheduling event for the page's list."""
        self.events_seen += 1
        self.events.append({"n": self.events_seen, "kind": kind, "request": request_id, **fields})

    def publish(self, engine: Any, stats: dict[str, Any], now: bool = False) -> None:
        """Send every subscriber a snapshot, unless the last one left less than MIN_INTERVAL_S
        ago (`now`: send it anyway). Never raises: the page is not worth stopping the engine
        for, so a failure here ends the streams and serving goes on."""
        with self._lock:
            subscribers = list(self._subscribers)
        if not subscribers or (not now and time.monotonic() - self.last_sent < MIN_INTERVAL_S):
            return
        try:
            text = json.dumps(self.snapshot(engine, stats), separators=(",", ":"))
        except Exception:
            traceback.print_exc()
            print("error: the live view failed; /events is closed", file=sys.stderr, flush=True)
            self.close()
            return
        self.last_sent = time.monotonic()
        for subscriber in subscribers:
            subscriber.put(text)

    def snapshot(self, engine: Any, stats: dict[str, Any]) -> dict[str, Any]:
        """The engine as the page draws it:

        config    policy, batch_size, budget (prefill_step: a pass's rows under the hybrid
                  policy, a chunk's under the alternate one), max_seq_len, speculative
        slots     one entry per decode slot: null (free) or a request (see `request_view`)
        outside   the alternate policy's prompt being prefilled before it takes a slot, or null
        queue     the requests waiting for a slot: "waiting" (never admitted) or "preempted"
        passes    the latest forward passes, oldest first: {n, decode rows, chunks [[request,
                  tokens], ...], padding rows, budget: the rows it may hold}
        pages     the first layer's page pool (every layer's is used alike): {total (null:
                  unbounded), page_size, in_use, cached, free}, or null with dense caches
        stats     engine.stats(): the counters of /metrics
        events    the latest scheduling events, oldest first: {n, kind, request, tokens, ...}
        """
        scheduler = engine.scheduler
        waiting_for_pages = getattr(scheduler, "waiting", None)
        queue = [
            request_view(r, "preempted" if r.admitted else "waiting", r is waiting_for_pages)
            for r in scheduler.pending
        ]
        outside = getattr(scheduler, "prefilling", None)
        return {
            "uptime": round(time.monotonic() - self.started, 3),
            "config": {
                "policy": engine.policy,
                "batch_size": len(scheduler.slots),
                "budget": engine.prefill_step,
                "max_seq_len": engine.max_seq_len,
                "speculative": getattr(engine, "speculative", None) is not None,
            },
            "slots": [None if r is None else request_view(r) for r in scheduler.slots],
            "outside": None if outside is None else request_view(outside),
            "queue": queue,
            "passes": [pass_view(engine, p) for p in self.passes],
            "pages": page_view(engine.pools, stats),
            "stats": stats,
            "events": list(self.events),
        }


def request_view(request: Any, state: str | None = None, for_pages: bool = False) -> dict:
    """A request as the page shows it. state: "prefilling" (offset of prefill tokens in the
    cache), "decoding", or in the queue "waiting" / "preempted"; for_pages: the queue's head,
    waiting for free pages rather than for a slot."""
    if state is None:
        state = "decoding" if request.is_prefill_done else "prefilling"
    return {
        "id": request.prompt_idx,
        "state": state,
        "offset": request.offset,
        "prefill": len(request.prompt_tokens) + max(0, len(request.generated) - 1),
        "prompt": len(request.prompt_tokens),
        "generated": len(request.generated),
        "max_tokens": request.max_new_tokens,
        "cached": getattr(request, "cached_tokens", 0),
        "for_pages": for_pages,
    }


def pass_view(engine: Any, recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded pass with its padding and its budget: under the hybrid policy every pass may
    hold prefill_step rows; under the alternate one a chunk may, and a decode pass one row per
    slot."""
    chunks = [tokens for _, tokens in recorded["chunks"]]
    budget = engine.prefill_step
    if engine.policy != "hybrid" and not chunks:
        budget = len(engine.scheduler.slots)
    return {**recorded, "padding": padding(engine, recorded["decode"], chunks), "budget": budget}


def padding(engine: Any, decode: int, chunks: list[int]) -> int:
    """The rows a pass ran beyond its real ones. The engine reports only the real rows; the
    padding follows from the policy's rule (Week 3 Day 3), which pads only with a ladder (a
    compiled model): the hybrid policy widens a pass that holds a chunk to a ladder width of
    the budget, and a pass of decode rows alone to the batch size; the alternate policy widens
    a chunk to a ladder width of prefill_step (unless the padded rows would not fit the context
    or the free pages, which this leaves out). Speculative passes are not counted."""
    ladder = getattr(engine, "ladder", None)
    if ladder is None or getattr(engine, "speculative", None) is not None:
        return 0
    rows = decode + sum(chunks)
    if engine.policy == "hybrid":
        width = ladder(rows, engine.prefill_step) if chunks else len(engine.scheduler.slots)
    else:
        width = ladder(sum(chunks), engine.prefill_step) if chunks else rows
    return max(0, width - rows)


def page_view(pools: list | None, stats: dict[str, Any]) -> dict[str, Any] | None:
    """The page pool's counts (engine.stats() counts cached pages as free; here they are not)."""
    if not pools:
        return None
    pool, cached = pools[0], stats.get("pages_cached", 0)
    free = stats.get("pages_free")
    return {
        "total": pool.max_pages,
        "page_size": pool.page_size,
        "in_use": stats.get("pages_in_use", 0),
        "cached": cached,
        "free": None if free is None else free - cached,
    }


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
