"""serve --tp N: one engine, its model sharded over N ranks (Week 4 Day 2), behind one server.

Every rank holds the same engine over its share of every block, and every forward pass is a
collective: all ranks must run the same passes, in the same order. Rank 0 serves HTTP and
decides; the other ranks follow. The engine is deterministic, so what rank 0 must tell them is
only what reached its engine from outside in each turn of its loop: the requests added (prompt
tokens and sampling settings, with a seed fixed on rank 0 for a sampled request, so that every
rank draws the same tokens) and the requests aborted. Each rank applies them in the same order
and takes the same step; the scheduler then makes the same decisions everywhere.

One turn's operations travel as JSON through two all_sums (its length, then its bytes, which
only rank 0 fills in). A rank that dies makes mlx.launch stop the others, and the command
exits naming it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import mlx.core as mx
import numpy as np


def broadcast(group: mx.distributed.Group, ops: list | None) -> list:
    """Rank 0's `ops` on every rank (the others pass None)."""
    data = json.dumps(ops).encode() if group.rank() == 0 else b""
    length = mx.distributed.all_sum(mx.array([len(data)]), group=group).item()
    mine = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(length, dtype=np.uint8)
    total = mx.distributed.all_sum(mx.array(mine.astype(np.int32)), group=group)
    return json.loads(np.array(total).astype(np.uint8).tobytes())


def add_op(prompt: list[int], params: Any, n: int = 1) -> list:
    """The operation that adds a request (or n answers to one prompt), as JSON can carry it."""
    return ["add", list(prompt), dataclasses.asdict(params), n]


def with_seed(params: Any) -> Any:
    """A sampled request's settings with a seed of its own, chosen here on rank 0: every rank
    then draws the same tokens (without one, each rank's own generator would)."""
    if params.greedy or params.seed is not None:
        return params
    return dataclasses.replace(params, seed=random.randrange(2**63))


def apply(engine: Any, op: list, params_class: type) -> None:
    """One operation of rank 0's turn, on a following rank's engine. An add that rank 0's
    engine refused is refused here the same way (the request id it took is taken here too),
    whatever it raised. A score (echo's prompt logprobs) is a forward pass: every rank takes it,
    in the same order (rank 0 after its relay), and only rank 0 sends what it found."""
    if op[0] == "abort":
        engine.abort(op[1])
        return
    if op[0] == "score":
        try:
            engine.score(op[1], op[2])
        except Exception:
            pass
        return
    settings = op[2] | {"stop": tuple(op[2]["stop"])}
    try:
        engine.add_choices(op[1], params_class(**settings), op[3])  # as rank 0 added it
    except Exception:
        pass


def follow(engine: Any, group: mx.distributed.Group, params_class: type) -> None:
    """A following rank's whole life: rank 0's operations of each turn, then the same step,
    until rank 0 says close. A step that fails here fails on rank 0 too (the same pass): both
    give every page back and go on (engine_process.EngineLoop.fail_in_flight)."""
    while True:
        ops = broadcast(group, None)
        for op in ops:
            if op[0] == "close":
                engine.release()
                return
            apply(engine, op, params_class)
        if engine.has_work:
            try:
                engine.step()
            except Exception:
                engine.release()
