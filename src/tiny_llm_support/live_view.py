"""The live page's view of the engine, made in the engine process (engine_process.py).

The engine reports every scheduler event to an EngineWatch (Engine(on_step=...)); after each turn
of the engine loop that reports its state (at most MIN_INTERVAL_S apart while the engine works,
always when it goes idle or when asked), `publish` turns the engine's state into a small JSON
snapshot, which the engine process sends to the HTTP process. There the latest snapshot is kept for GET / (drawn at
once) and handed to every /events client (server_channels.Subscriber).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections import deque
from typing import Any

MIN_INTERVAL_S = 1 / 20  # while the engine works, at most 20 snapshots a second
PASSES_KEPT = 16  # the latest forward passes in each snapshot
EVENTS_KEPT = 12  # the latest scheduling events in each snapshot


class EngineWatch:
    """What the live page shows, kept by the engine loop.

    `on_step` is the engine's on_step hook: it records each forward pass (its decode rows and
    prompt chunks, from the "decode" and "prefill" events that share a pass number) and each
    scheduling event ("admit", "wait", "preempt", "refuse", "finish"; the loop adds "abort"
    and "failure"). `publish`, after a step, reads the engine's slots, queue and page pool
    into one snapshot (see `snapshot` for its fields).
    """

    def __init__(self) -> None:
        self.passes: deque[dict[str, Any]] = deque(maxlen=PASSES_KEPT)
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.events_seen = 0
        self.started = time.monotonic()
        self.broken = False  # a snapshot failed once: the page is not worth more tries

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

    def publish(self, engine: Any, stats: dict[str, Any]) -> str | None:
        """A snapshot as JSON text. Never raises: the page is not worth stopping the engine
        for, so after a failure it gets no more snapshots (None) and serving goes on."""
        if self.broken:
            return None
        try:
            return json.dumps(self.snapshot(engine, stats), separators=(",", ":"))
        except Exception:
            traceback.print_exc()
            print("error: the live view failed; /events gets no more snapshots", file=sys.stderr)
            self.broken = True
            return None

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
