"""What a batch_generate run did and how long it took, from its on_step events alone.

`BatchRecorder.on_step` takes every `BatchStep` a solution's `batch_generate` reports and reads
its own clock at each one. Events that share `forward_pass` come from one model call (a pass):
the pass's work is done when its first event is reported, and it began when the previous
pass's last event was. From that come, per pass, its prefill chunks and decode rows; per
request, its chunks, its time to first token and the time of every token; and for the run, the
decode gaps of the chunked-prefill chapter (week3-02): the wall-clock time between two
consecutive decode completions while at least one request keeps a decode slot, prefill work in
between included, stretches with nobody decoding left out.

"prefill", "decode" and "finish" report work; "admit", "wait", "preempt" and "refuse" (a
bounded page pool, Week 3 Day 6) report scheduling and carry the number of the last pass.

The demo (batch-main.py) and the chunked-prefill benchmark both measure through this module.
Time inside `paused()` (drawing a view) is left out of every number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchRecorder", "DecodeGap", "PassRecord", "RequestRecord", "StepError"]

WORK = ("prefill", "decode", "finish")  # what a model call did
KINDS = (*WORK, "admit", "wait", "preempt", "refuse")


class StepError(ValueError):
    """A BatchStep that does not say what the public API promises (kind, rows, pass number)."""


@dataclass
class PassRecord:
    """One model call: the prefill chunks and the decode rows it ran."""

    number: int  # BatchStep.forward_pass
    start: float  # seconds since the requests arrived: the previous pass's last event
    end: float  # its first event: its work is done
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (prompt_idx, tokens)
    decode_rows: int = 0
    decoding_after: bool = False  # a request still holds a decode slot after this pass

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RequestRecord:
    """One request as the events showed it."""

    idx: int
    prompt_tokens: int
    admitted: float  # when it was admitted (or the pass of its first chunk began)
    chunks: list[int] = field(default_factory=list)  # tokens of each prefill chunk, in order
    token_times: list[float] = field(default_factory=list)  # the end of the pass of each token
    finished: float | None = None
    stop: str = ""  # "eos", "length" or "refused" once it is over
    preemptions: int = 0
    recomputed: int = 0  # tokens prefilled again after its preemptions
    waits: int = 0  # times it had to wait for free pages before being admitted
    to_prefill: int = 0  # tokens its current prefill must put in the cache
    restart: int = 0  # chunks before its current prefill (which began at its last preemption)

    def __post_init__(self) -> None:
        self.to_prefill = self.to_prefill or self.prompt_tokens

    @property
    def prefilled(self) -> int:
        """Tokens its current prefill has put in the cache so far."""
        return sum(self.chunks[self.restart :])

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def generated(self) -> int:
        return len(self.token_times)

    def decode_rate(self) -> float | None:
        """Tokens per second after the first one (which its last prefill chunk made)."""
        if self.finished is None or self.generated < 2 or self.finished <= self.token_times[0]:
            return None
        return (self.generated - 1) / (self.finished - self.token_times[0])

    def longest_token_gap(self) -> float:
        """The longest wait between two of its consecutive tokens."""
        return max(intervals(self.token_times), default=0.0)


@dataclass
class DecodeGap:
    seconds: float
    start: float  # one decode completion
    end: float  # the next
    chunks: int  # prefill chunks that ran in between (or in the pass that ended it)


class BatchRecorder:
    """Pass `recorder.on_step` to batch_generate; read the record once it returns."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started = clock()  # the requests arrive now
        self.paused_s = 0.0
        self.wall: float | None = None  # set by stop()
        self.passes: list[PassRecord] = []
        self.requests: dict[int, RequestRecord] = {}
        self.last_event = 0.0

    def now(self) -> float:
        """Seconds since the requests arrived, without the time spent paused."""
        return self.clock() - self.started - self.paused_s

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of every measurement."""
        t = self.clock()
        try:
            yield
        finally:
            self.paused_s += self.clock() - t

    def stop(self) -> float:
        """Call when batch_generate has returned; the run's wall time."""
        self.wall = self.now()
        return self.wall

    def on_step(self, step: Any) -> None:
        """Record one event (pass this method to batch_generate as on_step)."""
        t = self.now()
        this = self._pass_of(step, t)
        self.last_event = t
        if step.kind == "decode":
            this.decode_rows += step.tokens
            this.decoding_after = any(r is not None for r in step.slots)
            for request in step.slots:
                if request is not None:
                    self._new_tokens(request, this)
            return
        record = self.requests.get(step.request.prompt_idx)
        if record is None:
            admitted = this.start if step.kind == "prefill" else t
            record = RequestRecord(
                step.request.prompt_idx, len(step.request.prompt_tokens), admitted
            )
            self.requests[record.idx] = record
        if step.kind == "prefill":
            record.chunks.append(step.tokens)
            this.chunks.append((record.idx, step.tokens))
            self._new_tokens(step.request, this)
        elif step.kind == "finish":
            self._new_tokens(step.request, this)
            record.finished = this.end
            last = step.request.generated[-1] if step.request.generated else None
            record.stop = "eos" if last in step.request.eos_token_ids else "length"
        elif step.kind == "admit" and not record.chunks:  # admitted at last, after any waits
            record.admitted = t
        elif step.kind == "wait":
            record.waits += 1
        elif step.kind == "preempt":  # its cache is gone; the generated tokens are kept
            record.preemptions += 1
            record.restart = len(record.chunks)
            record.to_prefill = record.prompt_tokens + max(0, len(step.request.generated) - 1)
            record.recomputed += record.to_prefill
        elif step.kind == "refuse":
            record.finished, record.stop = t, "refused"

    def _pass_of(self, step: Any, t: float) -> PassRecord | None:
        """The pass of this event: the current one, a new one that ended at `t`, or None for
        scheduling before the first pass."""
        if step.kind not in KINDS:
            raise StepError(f"BatchStep kind {step.kind!r} is not one of {', '.join(KINDS)}")
        work = step.kind in WORK
        if step.kind in ("prefill", "decode") and step.tokens < 1:
            raise StepError(
                f"a {step.kind!r} BatchStep reports tokens={step.tokens}: it must give the rows "
                "the event ran (the chunk's length, or the decode rows)"
            )
        current = self.passes[-1].number if self.passes else 0
        if step.forward_pass < current or (work and step.forward_pass < 1):
            raise StepError(
                f"a {step.kind!r} BatchStep with forward_pass {step.forward_pass} after pass "
                f"{current}: batch_generate must number its model calls 1, 2, 3, ... (the events "
                "of one call share its number)"
            )
        if step.forward_pass > current:
            self.passes.append(PassRecord(step.forward_pass, self.last_event, t))
        return self.passes[-1] if self.passes else None

    def _new_tokens(self, request: Any, this: PassRecord) -> RequestRecord:
        """Time-stamp the tokens of `request` not seen before with the end of this pass."""
        record = self.requests[request.prompt_idx]
        record.token_times += [this.end] * (len(request.generated) - record.generated)
        return record

    # --- what the run measured ------------------------------------------------------------

    def decode_passes(self) -> list[PassRecord]:
        return [p for p in self.passes if p.decode_rows]

    def prefill_passes(self) -> list[PassRecord]:
        return [p for p in self.passes if p.chunks]

    def decode_gaps(self) -> list[DecodeGap]:
        """Between consecutive decode completions, while someone kept a decode slot."""
        gaps = []
        chunks = 0  # prefill chunks since the last decode completion
        last: PassRecord | None = None
        for p in self.passes:
            chunks += len(p.chunks)
            if not p.decode_rows:
                continue
            if last is not None and last.decoding_after:
                gaps.append(DecodeGap(p.end - last.end, last.end, p.end, chunks))
            last, chunks = p, 0
        return gaps

    def decode_tokens(self) -> int:
        return sum(p.decode_rows for p in self.passes)

    def prefill_tokens(self) -> int:
        return sum(tokens for p in self.passes for _, tokens in p.chunks)

    def output_tokens(self) -> int:
        return sum(r.generated for r in self.requests.values())

    def prefill_time(self) -> float:
        return sum(p.duration for p in self.prefill_passes())

    def decode_time(self) -> float:
        return sum(p.duration for p in self.decode_passes())

    def output_tokens_per_s(self) -> float:
        """Every generated token over the run's wall time (call stop() first)."""
        return self.output_tokens() / self.wall if self.wall else 0.0

    def decode_tokens_per_s(self) -> float:
        """Tokens made by decode steps over the time those steps took."""
        time_s = self.decode_time()
        return self.decode_tokens() / time_s if time_s else 0.0


def intervals(times: list[float]) -> list[float]:
    """The differences of consecutive times."""
    return [b - a for a, b in zip(times, times[1:])]
