"""Progress on stderr, so that stdout holds only a benchmark's table: `log` for a line, and
`Progress` for runs that take more than a few seconds each (a live bar from rich on a terminal,
one line per run with the time left otherwise)."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

__all__ = ["log", "Progress"]


def log(message: str) -> None:
    """One line of progress, on stderr."""
    print(message, file=sys.stderr, flush=True)


class Progress:
    """Where `total` runs stand. Call `start(label)` as each run starts and `done(line)` when it
    ends (the line, if any, is logged: what the run measured)."""

    def __init__(self, total: int):
        self.total, self.started, self.count = total, time.perf_counter(), 0
        self.bar = None
        if sys.stderr.isatty():
            console = Console(stderr=True)
            columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            self.bar = RichProgress(*columns, TimeRemainingColumn(), console=console)
            self.task = self.bar.add_task("", total=total)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, label: str) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(self.task, description=label)
        else:
            log(f"[{self.count}/{self.total}] {label}{self._left()}")

    def done(self, line: str | None = None) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)
            if line:
                self.bar.console.print(line, highlight=False, markup=False)
        elif line:
            log(f"[{self.count}/{self.total}] {line}")

    def _left(self) -> str:
        """The time the runs left should take, at the mean of those done (after the first)."""
        if self.count < 2:
            return ""
        per_run = (time.perf_counter() - self.started) / (self.count - 1)
        return f" (about {per_run * (self.total - self.count + 1):.0f} s left)"
