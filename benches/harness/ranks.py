"""Runs on several ranks of this machine: one run of a plan as N processes under mlx.launch
(`run_ranks`), every run of a plan that way (`run_rank_plan`), and, in a rank's own process,
its group and its own output file (`join_group`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches.harness.progress import Progress
from benches.harness.runs import bench_command, run_fresh
from tiny_llm_support import launch
from tiny_llm_support.startup import RANK_ENV

__all__ = ["RANKS_TIMEOUT_S", "run_ranks", "run_rank_plan", "join_group"]

RANKS_TIMEOUT_S = 3600  # a run on several ranks stopped after this long


def run_ranks(module: str, tmp: Path, k: int, total: int, spec: dict, what: str) -> list[dict]:
    """Run k of a plan as spec["ranks"] fresh processes: 1 rank as a plain one (run_fresh),
    more under mlx.launch, every rank running `python -m benches NAME --child-spec FILE` and
    writing its record where spec["output"] says, with {rank} filled in (join_group does it).
    Every rank's record, in rank order, with process_s: the time the whole launch took."""
    if spec["ranks"] == 1:
        return [run_fresh(module, tmp, k, total, dict(os.environ), spec, what)]
    spec_path, output = tmp / f"run-{k}.json", str(tmp / f"result-{k}-rank{{rank}}.json")
    spec_path.write_text(json.dumps({**spec, "sequence": k, "output": output}))
    command = bench_command(module, "--child-spec", str(spec_path))[1:]  # less the python
    start = time.perf_counter()
    failure = launch.run_ranks(command, spec["ranks"], timeout=RANKS_TIMEOUT_S)
    if failure:
        raise SystemExit(f"error: run {k + 1}/{total} ({what}): {failure}")
    process_s = time.perf_counter() - start
    records = [json.loads(Path(output.format(rank=r)).read_text()) for r in range(spec["ranks"])]
    return [{**r, "process_s": process_s} for r in records]


def run_rank_plan(
    module: str,
    specs: list[dict[str, Any]],
    tmp: Path,
    label: Callable[[dict[str, Any]], str],
    line: Callable[[list[dict[str, Any]]], str],
) -> list[list[dict[str, Any]]]:
    """Every spec on its spec["ranks"] ranks (run_ranks), in order, with where the runs stand
    on stderr: label(spec) as a run starts, line(its records) once it has measured. Each run's
    records, one per rank."""
    runs = []
    with Progress(len(specs)) as progress:
        for k, spec in enumerate(specs):
            progress.start(label(spec))
            runs.append(run_ranks(module, tmp, k, len(specs), spec, label(spec)))
            progress.done(line(runs[-1]))
    return runs


def join_group(spec: dict[str, Any]) -> mx.distributed.Group:
    """In a rank's own process: the group of its spec["ranks"] ranks (the ring backend; a group
    of one for 1 rank), with spec["output"] made this rank's file: {rank} filled in from
    MLX_RANK, which mlx.launch sets (child_main writes the record there)."""
    spec["output"] = spec["output"].format(rank=os.environ.get(RANK_ENV, "0"))
    if spec["ranks"] == 1:
        return mx.distributed.init()
    return mx.distributed.init(strict=True, backend="ring")
