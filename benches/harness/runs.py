"""Runs in fresh processes: the order of the runs (`plan_runs`), one run in a process of its
own (`run_fresh`: `python -m benches NAME --child-spec FILE`), and, inside that process, how a
run reports an error (`child_errors`) and where it stands in the plan (`planned_run`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from benches.harness.progress import Progress
from tiny_llm_support.checkpoint_files import CheckpointError
from tiny_llm_support.cli import unfinished_message

__all__ = [
    "ROOT", "EXIT_REPORTED", "plan_runs", "run_in_own_session", "bench_command", "run_fresh",
    "run_plan", "child_main", "child_errors", "planned_run",
]  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: `benches` imports here
EXIT_REPORTED = 3  # a child stopped with a one-line error it printed itself


def plan_runs(items: Sequence[Any], repeats: int) -> list[tuple[int, str, Any]]:
    """(repeat, order, item) in launch order: repeat 0 forward, 1 reverse, 2 forward... so that
    no mode always runs first or last."""
    plan = []
    for r in range(repeats):
        order = "forward" if r % 2 == 0 else "reverse"
        for item in items if order == "forward" else list(reversed(items)):
            plan.append((r, order, item))
    return plan


def run_in_own_session(command: list[str], **popen) -> int:
    """Run `command` in a session of its own (so Ctrl-C reaches this process alone) and wait:
    its exit status. Ctrl-C or SIGTERM here kills it before this process cleans up, even one
    that arrives while it starts (the signals wait until the child is known), so it never reads
    its files after they are gone."""
    stops = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        proc = subprocess.Popen(command, start_new_session=True, **popen)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a stop held back arrives here
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def bench_command(module: str, *args: str) -> list[str]:
    """The command line that runs benchmark `module` (its __name__, e.g. benches.moe) with
    `args`: `python -m benches NAME ARGS` (run from the repository, see ROOT)."""
    return [sys.executable, "-m", "benches", module.rpartition(".")[2].replace("_", "-"), *args]


def run_fresh(module: str, tmp: Path, k: int, total: int, env: dict, spec: dict, what: str):
    """Run one measurement in a fresh process (`python -m benches NAME --child-spec FILE`, which
    calls the module's child_main(FILE) and writes its
    JSON to spec["output"]) and return that JSON with process_s, the time the whole process
    took. A failed run stops the benchmark: quietly when the child printed its own one-line
    error (exit status EXIT_REPORTED), else naming the run (`what`)."""
    spec_path, out_path = tmp / f"run-{k}.json", tmp / f"result-{k}.json"
    spec_path.write_text(json.dumps({**spec, "sequence": k, "output": str(out_path)}))
    t = time.perf_counter()
    status = run_in_own_session(
        bench_command(module, "--child-spec", str(spec_path)),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - t
    if status == EXIT_REPORTED:
        raise SystemExit(1)  # the run said what went wrong, on one line
    if status != 0:
        raise SystemExit(
            f"run {k + 1}/{total} ({what}) failed with exit status {status}; its error is above"
        )
    run = json.loads(out_path.read_text())
    run["process_s"] = elapsed
    return run


def run_plan(
    module: str,
    specs: list[dict[str, Any]],
    tmp: Path,
    env: dict[str, str],
    label: Callable[[dict[str, Any]], str],
    line: Callable[[dict[str, Any]], str] | None = None,
    pause_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Every spec in a fresh process of its own, in order (run_fresh), `pause_s` apart (a
    machine that cools down between runs), with where the runs stand on stderr: label(spec) as
    a run starts, line(record) once it has measured. The records."""
    records = []
    with Progress(len(specs)) as progress:
        for k, spec in enumerate(specs):
            if k and pause_s:
                time.sleep(pause_s)
            progress.start(label(spec))
            records.append(run_fresh(module, tmp, k, len(specs), env, spec, label(spec)))
            progress.done(line(records[-1]) if line else None)
    return records


def child_main(module: ModuleType, spec_path: str) -> int:
    """In a run's own process (`python -m benches NAME --child-spec FILE`): module.measure(spec)
    and its record, with planned_run's fields, written as JSON to spec["output"]. A solution
    not finished yet, an error of the module's own (its RUN_ERRORS, after RUN_ERROR_PREFIX) or a checkpoint that cannot
    be read ends the run with one line (child_errors)."""
    spec = json.loads(Path(spec_path).read_text())
    own = getattr(module, "RUN_ERRORS", ()), getattr(module, "RUN_ERROR_PREFIX", "")
    with child_errors(spec.get("solution", "ref"), *own):
        record = module.measure(spec)
    Path(spec["output"]).write_text(json.dumps({**planned_run(spec), **record}))
    return 0


@contextlib.contextmanager
def child_errors(solution: str, own_errors: tuple[type[Exception], ...] = (), what: str = ""):
    """In a run's fresh process: a solution that is not finished yet (NotImplementedError), one
    of the bench's `own_errors` (said as "error: {what}{the error}") or a checkpoint that cannot
    be read ends the process with one line on stderr and exit status EXIT_REPORTED, which
    tells run_fresh in the parent that the error has been said."""
    try:
        yield
    except NotImplementedError as e:
        print(unfinished_message(solution, e), file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None
    except own_errors as e:
        print(f"error: {what}{e}", file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None
    except CheckpointError as e:  # weights the parent could not check without loading them
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None


def planned_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Where a run stands in the plan (its repeat, order and place, where the spec has them),
    and its process."""
    keys = ("repeat", "order", "sequence")
    return {**{k: spec[k] for k in keys if k in spec}, "pid": os.getpid()}
