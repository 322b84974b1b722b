"""What the batch-main demo shows while batch_generate runs, and its closing summary.

Both views are handed every `BatchStep` together with the `BatchRecorder` that has just
recorded it, and show what the events say happened: a prompt's chunks are counted as they are
reported, with the tokens each one ran, never derived from the chunk budget. Each model call is
a pass (`rec.passes[-1]` is the latest); a pass lists its chunks and its decode rows, so a pass
that holds both (the hybrid policy of Week 3 Day 4) shows as one.

    PlainView   one line per prefill chunk, per finished request, per `every` decode steps,
                each with the number of its pass; preemptions, waits and refusals as they come
    LiveView    a rich.live screen: header (with the page pool when it is bounded), the last
                passes, prefills in progress, the slots, the latest scheduling events
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .batch_recorder import BatchRecorder, PassRecord, RequestRecord
from .cli import printable

FRAME_INTERVAL_S = 1 / 10  # the live view redraws at most this often
SUMMARY_TITLE = (
    "Per request (all arrive at t = 0): prompt tokens, prefill chunks, wait before its first "
    "chunk, time to first token, tokens generated, decode tokens/s, longest gap between two "
    "of its tokens, why it stopped (eos, length: max-seq-len, or refused: larger than the page "
    "pool)"
)
PREEMPTED_TITLE = ", and before it how many times it was preempted (its pages taken back)"


def chunk_text(record: RequestRecord) -> str:
    """Its latest chunk as reported: 'chunk 3: 64 tokens'."""
    return f"chunk {len(record.chunks)}: {record.chunks[-1]} tokens"


def pass_text(p: PassRecord) -> str:
    """What one model call ran: its decode rows and its prefill chunks, and their sum when it
    ran both ("pass 7: decode 3 rows + prefill req 4 (13 tokens) = 16 rows")."""
    parts = [f"decode {p.decode_rows} rows"] if p.decode_rows else []
    parts += [f"prefill req {idx} ({tokens} tokens)" for idx, tokens in p.chunks]
    rows = p.decode_rows + sum(tokens for _, tokens in p.chunks)
    total = f" = {rows} rows" if len(parts) > 1 else ""
    return f"pass {p.number}: " + " + ".join(parts) + total


def event_text(step: Any, record: RequestRecord) -> str | None:
    """A line for a request's finish or for a scheduling event worth showing (None: not)."""
    if step.kind == "finish":
        return (
            f"request {record.idx} finished: {record.generated} tokens ({record.stop}), "
            f"first token after {record.ttft:.2f} s"
        )
    if step.kind == "preempt":
        return (
            f"request {record.idx} preempted: its pages went back; {record.generated} "
            f"generated tokens kept, {record.to_prefill} to prefill again"
        )
    if step.kind == "wait":
        return f"request {record.idx} waits for free pages"
    if step.kind == "refuse":
        return f"request {record.idx} refused: {getattr(step, 'detail', '')}"
    return None


class PlainView:
    """One line per prefill chunk, per finished request and per `every` decode steps."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, step: Any, rec: BatchRecorder) -> None:
        t = rec.passes[-1].end if rec.passes else 0.0
        number = rec.passes[-1].number if rec.passes else 0
        if step.kind == "prefill":
            r = rec.requests[step.request.prompt_idx]
            line = f"prefill req {r.idx:>2}  {chunk_text(r)}  {r.prefilled}/{r.to_prefill}"
            if step.request.is_prefill_done:
                line += "  -> first token" if r.ttft == t else "  -> decoding again"
        elif step.kind == "finish":
            r = rec.requests[step.request.prompt_idx]
            line = f"finish  req {r.idx:>2}  {r.generated} tokens ({r.stop})"
        elif step.kind == "decode":
            steps = len(rec.decode_passes())
            if steps % self.every:
                return
            where = " ".join(f"{r.prompt_idx}@{r.offset}" for r in step.slots if r is not None)
            line = f"decode  step {steps:>4}  {rec.passes[-1].decode_rows} rows  [req@position] {where}"
        else:
            line = event_text(step, rec.requests[step.request.prompt_idx])
            if line is None:
                return
        print(f"{t:8.3f}s pass {number:>4}  {line}", flush=True)


class LiveView:
    """A rich.live.Live screen: header, the last pass, prefills in progress, decode slots."""

    def __init__(
        self, console: Any, title: str, total: int, batch_size: int, pools: list | None = None
    ) -> None:
        from rich.live import Live

        self.console = console
        self.title = title
        self.total = total
        self.pools = pools  # a paged KV pool per layer, or None for dense caches
        self.slots: list[Any] = [None] * batch_size
        self.prefills: dict[int, Any] = {}  # prompt_idx -> Request, chunks in the latest passes
        self.recent: deque[str] = deque(maxlen=4)
        self.done = 0
        self.open_pass = 1  # passes before this one have reported all their events
        self.last_draw = 0.0
        self.live = Live(console=console, auto_refresh=False, transient=True)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)

    def show(self, step: Any, rec: BatchRecorder) -> None:
        self.slots = step.slots
        # the events of a pass come one after another once it has run; scheduling events
        # come between passes, after every event of the last one
        self.open_pass = step.forward_pass + (step.kind not in ("prefill", "decode", "finish"))
        if step.kind == "prefill":
            if step.request.prompt_idx not in self.prefills:  # a new prompt: drop finished ones
                self.prefills = {i: r for i, r in self.prefills.items() if not r.is_prefill_done}
            self.prefills[step.request.prompt_idx] = step.request
        elif step.kind != "decode":
            self.done += step.kind in ("finish", "refuse")
            line = event_text(step, rec.requests[step.request.prompt_idx])
            self.recent.extend([line] if line else [])
        if time.perf_counter() - self.last_draw >= FRAME_INTERVAL_S or self.done == self.total:
            self.live.update(self.render(rec), refresh=True)
            self.last_draw = time.perf_counter()

    def header(self, rec: BatchRecorder) -> list[str]:
        """The header's fields: time, passes, requests, speed, and the page pool if any."""
        started = sum(1 for r in rec.requests.values() if r.chunks or r.stop)
        fields = [
            f"{rec.now():.1f} s",
            f"passes {len(rec.passes)}",
            f"decode steps {len(rec.decode_passes())}",
            f"not started {self.total - started}",
            f"finished {self.done}/{self.total}",
            f"decode {rec.decode_tokens_per_s():.1f} tokens/s",
        ]
        if self.pools:  # every layer has its own pool, all used alike: the first stands for all
            pool = self.pools[0]
            fields.append(f"pages in use {pool.num_in_use}/{pool.max_pages or 'unbounded'}")
        preempted = sum(r.preemptions for r in rec.requests.values())
        if preempted:
            fields.append(f"preemptions {preempted}")
        return fields

    def finished_passes(self, rec: BatchRecorder, count: int = 3) -> list[PassRecord]:
        """The latest passes whose events have all been reported, newest first."""
        over = self.done == self.total
        complete = [p for p in rec.passes[-count - 1 :] if over or p.number < self.open_pass]
        return complete[::-1][:count]

    def render(self, rec: BatchRecorder) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        header = Text.assemble((self.title, "bold"), "\n" + "   ".join(self.header(rec)))
        passes = Text("\n".join(pass_text(p) for p in self.finished_passes(rec)), style="dim")
        prefill = Table.grid(padding=(0, 1))
        if not self.prefills:
            prefill.add_row(Text("prefill: waiting for the first request", style="dim"))
        for request in self.prefills.values():
            r = rec.requests[request.prompt_idx]
            state = "done, now decoding" if request.is_prefill_done else "in progress"
            prefill.add_row(
                Text(f"prefill request {r.idx}", style="bold cyan"),
                Text(chunk_text(r)),
                ProgressBar(total=r.to_prefill, completed=r.prefilled, width=30),
                Text(f"{r.prefilled}/{r.to_prefill} tokens, {state}"),
            )
        slots = Table(box=None, pad_edge=False, expand=False, header_style="bold")
        for name in ("slot", "request", "position", "tokens"):
            slots.add_column(name, justify="right")
        slots.add_column("text (tail)", no_wrap=True)
        width = max(20, self.console.width - 40)
        for i, req in enumerate(self.slots):
            if req is None:
                slots.add_row(str(i), "-", "-", "-", Text("free", style="dim"))
            else:
                cells = (str(i), str(req.prompt_idx), str(req.offset), str(len(req.generated)))
                slots.add_row(*cells, Text(tail(req.text(), width), style="green"))
        recent = Text("\n".join(self.recent), style="dim")
        return Group(header, passes, Text(""), prefill, Text(""), slots, Text(""), recent)


def tail(text: str, width: int) -> str:
    """The last `width` characters on one line."""
    if len(text) > width:
        text = "\u2026" + text[-(width - 1) :]
    return printable(text, one_line=True)


def answer_text(text: str, tokenizer: Any) -> str:
    """The detokenized answer without the end-of-sequence token it stopped on."""
    stops = [tokenizer.eos_token, "<|endoftext|>", "<|im_end|>"]
    changed = True
    while changed:
        changed = False
        for stop in stops:
            if stop and text.endswith(stop):
                text, changed = text[: -len(stop)], True
    return printable(text.strip())


def print_answers(
    out: Callable[[str], None], labels: list[str], answers: list[str], console: Any | None
) -> None:
    """Each prompt and its answer; `console` (a rich Console) draws them with rules."""
    out("")
    for idx, (label, answer) in enumerate(zip(labels, answers)):
        if console is not None:
            from rich.text import Text

            console.rule(f"request {idx}")
            console.print(Text.assemble(("prompt: ", "bold"), label))
            console.print(Text.assemble(("answer: ", "bold green"), answer or "(empty)"))
        else:
            out(f"prompt {idx}: {label}")
            lines = (answer or "(empty)").splitlines() or [""]
            out(f"answer {idx}: {lines[0]}")
            for line in lines[1:]:
                out(" " * len(f"answer {idx}: ") + line)


def print_summary(out: Callable[[str], None], rec: BatchRecorder, console: Any | None) -> None:
    """A row per request, then the run's prefill, decode, TTFT and longest decode gap."""
    headers = ["req", "prompt", "chunks", "wait s", "TTFT s", "tokens", "tok/s", "gap ms", "stop"]
    records = rec.requests.values()
    preempted = any(r.preemptions for r in records)
    if preempted:  # a bounded page pool (Week 3 Day 6) took requests' pages back
        headers.insert(-1, "preempted")
    title = SUMMARY_TITLE + (PREEMPTED_TITLE if preempted else "")
    rows = []
    for idx, r in sorted(rec.requests.items()):
        rate = r.decode_rate()
        rows.append(
            [
                str(idx),
                str(r.prompt_tokens),
                str(len(r.chunks)),
                f"{r.admitted:.3f}",
                f"{r.ttft:.3f}" if r.ttft is not None else "-",
                str(r.generated),
                f"{rate:.1f}" if rate is not None else "-",
                f"{r.longest_token_gap() * 1000:.1f}",
                *([str(r.preemptions)] if preempted else []),
                r.stop,
            ]
        )
    out("")
    if console is not None:
        from rich import box
        from rich.table import Table

        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for h in headers:
            table.add_column(h, justify="left" if h == "stop" else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    else:
        out(title)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        for row in [headers, *rows]:
            out("  ".join(v.rjust(w) for v, w in zip(row, widths)))

    prefill_s = rec.prefill_time()
    prefill_rate = rec.prefill_tokens() / prefill_s if prefill_s else 0.0
    chunks = sum(len(r.chunks) for r in rec.requests.values())
    out(
        f"prefill: {rec.prefill_tokens()} tokens in {prefill_s:.2f} s "
        f"({prefill_rate:.1f} tokens/s), {chunks} chunks"
    )
    out(
        f"decode: {rec.decode_tokens()} tokens in {len(rec.decode_passes())} steps, "
        f"{rec.decode_time():.2f} s ({rec.decode_tokens_per_s():.1f} tokens/s)"
    )
    ttfts = [r.ttft for r in rec.requests.values() if r.ttft is not None]
    if ttfts:
        out(
            f"time to first token: min {min(ttfts):.3f} s, mean {sum(ttfts) / len(ttfts):.3f} s, "
            f"max {max(ttfts):.3f} s"
        )
    waits = sum(r.waits for r in records)
    refused = sum(r.stop == "refused" for r in records)
    if preempted or waits or refused:
        out(
            f"page pool: {sum(r.preemptions for r in records)} preemptions "
            f"({sum(r.recomputed for r in records)} tokens prefilled again), {waits} waits for "
            f"free pages, {refused} requests refused"
        )
    gap = max(rec.decode_gaps(), key=lambda g: g.seconds, default=None)
    if gap is not None:
        out(
            f"longest decode gap: {gap.seconds * 1000:.1f} ms, from {gap.start:.3f} s "
            f"({gap.chunks} prefill chunk{'s' if gap.chunks != 1 else ''} ran inside it)"
        )
    out(
        f"total: {rec.wall + rec.paused_s:.2f} s wall, of which {rec.paused_s:.2f} s drawing "
        "the view (the times above leave it out)"
    )
