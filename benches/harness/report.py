"""What a benchmark writes: its report as JSON in one schema (`report`), whole files through
a rename, plots, and tables on stdout (rich)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from benches.harness.machine import environment, host_info, mlx_info, process_blas
from benches.harness.progress import log

__all__ = [
    "RESULTS", "canonical_json", "canonical_sha256", "replace_file", "write_json",
    "relative_path", "report", "write_report", "pyplot",
    "save_figure", "table", "number", "met",
]  # fmt: skip

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where the benchmarks write JSON


def canonical_json(data: Any) -> str:
    """Sorted keys, no spaces: the same data always gives the same bytes (for checksums)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_sha256(data: Any) -> str:
    """The SHA-256 of canonical_json(data): one name for the same data everywhere."""
    return hashlib.sha256(canonical_json(data).encode("ascii")).hexdigest()


def replace_file(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` whole: into a file beside it, renamed over it once complete, so
    that an interrupted run leaves the old file (or none), never part of one. Says so on
    stderr when a file is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding=encoding)
        if path.exists():
            log(f"replacing {path}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON in `path` (replace_file)."""
    return replace_file(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def relative_path(path: Path) -> str:
    root = Path(__file__).resolve().parent.parent.parent  # the repository
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def report(
    benchmark: str,
    started: float,
    settings: dict[str, Any],
    runs: list[Any],
    summary: dict[str, Any],
    targets: dict[str, Any] | None = None,
    blas: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The one schema of every report: `benchmark` (its name); `host` (the machine, MLX, the
    BLAS, the command, when it started and how long it took); `settings` (what was asked and
    what it came to); `runs` (one record per measured run); `summary` (what the runs come to);
    `targets` (each stated target: the bound, what was measured, met or not)."""
    host = {
        **host_info(),
        "mlx": mlx_info(),
        "blas": {**(blas or process_blas()), "environment": environment()},
        "command": ["python", "-m", "benches", sys.argv[0].removeprefix("bench-"), *sys.argv[1:]],
        "created_unix": started,
        "duration_s": time.time() - started,
    }
    return {"benchmark": benchmark, "host": host, "settings": settings, "runs": runs,
            "summary": summary, "targets": targets or {}}  # fmt: skip


def write_report(
    args: argparse.Namespace,
    report: dict[str, Any],
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path | None] | None = None,
    seconds: float | None = None,
) -> None:
    """The end of a benchmark: the report as JSON in --json-output and, given a `plot` function
    and no --no-plot, its plot in --plot-output, with a line on stderr for each file written
    (and the run's `seconds`, if given); then table(report) on stdout."""
    write_json(args.json_output, report)
    log(f"wrote {args.json_output}" + ("" if seconds is None else f" ({seconds:.0f} s)"))
    if plot is not None and not args.no_plot and plot(report, args.plot_output):
        log(f"wrote {args.plot_output}")
    print(table(report))


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend), or None with a line saying that
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pdm sync -G dev installs it)")
        return None
    return plt


def save_figure(fig, path: Path, title: str | None = None, rect=(0, 0, 1, 1)) -> Path:
    """Finish a figure: its `title` (if any) above the panels, laid out within `rect` (of the
    figure: left, bottom, right, top), written to `path` (its folders made), closed."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def table(head: Sequence[str], rows: list[Sequence[str]], title: str | None = None) -> str:
    """A text table (rich): the head, then every row; the first column left-aligned, the others
    (numbers) right-aligned."""
    grid = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, name in enumerate(head):
        grid.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        grid.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=240, color_system=None).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines() if line.strip())


def number(value: float | None, spec: str = ".0f") -> str:
    """A number for a table: format(value, spec), or "n/a" for None (nothing measured)."""
    return "n/a" if value is None else format(value, spec)


def met(ok: bool) -> str:
    """How a table says whether a target was met."""
    return "met" if ok else "NOT met"
