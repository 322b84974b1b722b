"""4.3: a token's time from the engine's step to a client, with the engine in a process of its
own (issue 40) and, with --before DIR, an older checkout's serve.py (the engine on a thread)
run alternately with it.

serve.py runs with TINY_LLM_STAMP_TOKENS=1: every stream chunk carries `tiny_llm_sampled_at`,
the engine's time.monotonic() when the step that sampled its tokens ended. A run: --streams
streams at once ("concurrent"), then --sequential one after the other. A chunk's delivery time
is its arrival minus its stamp. --load N runs N busy processes beside the server.

    pdm run bench-token-delivery [--model tiny] [--streams 8] [--before DIR] [--load N]
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benches import harness
from tiny_llm_support.cli import int_at_least
from tiny_llm_support.demo_prompts import DEMO_PROMPTS

NO_OPENBLAS = True  # the tiny model: python -m benches runs it on the bundled BLAS
QUESTIONS = [p.question for p in DEMO_PROMPTS if p.context is None]  # short chat prompts
PHASES = ("concurrent", "sequential")
JSON_NAME = "token-delivery-<model>-<host>.json"
BURST_ARRIVAL_S, BURST_SAMPLED_S = 0.001, 0.005
SPIN = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass"  # --load

Chunks = list[tuple[float, float | None]]  # (arrival, sampled) of each event of a stream


def run_server(root: Path, args, tmp: Path) -> dict[str, Any]:
    """One run: serve.py of the checkout `root`; its streams at once, then one at a time."""
    env = {**os.environ, "TINY_LLM_STAMP_TOKENS": "1", "PYTHONPATH": str(root / "src")}
    flags = {"model": args.model, "batch_size": args.streams, "max_seq_len": 512}
    with harness.serve(tmp / "serve.log", env, root, **flags) as server:

        def ask(i: int, max_tokens: int = args.max_tokens) -> Chunks:
            return stream(server.port, QUESTIONS[i % len(QUESTIONS)], max_tokens, args.model)

        ask(0, 4)  # warm-up
        busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
        try:
            concurrent = harness.at_once(ask, range(args.streams))
            sequential = [ask(i) for i in range(args.sequential)]
        finally:
            for p in busy:
                p.terminate()
                p.wait(timeout=30)
    return {"concurrent": phase(concurrent), "sequential": phase(sequential)}


def stream(port: int, question: str, max_tokens: int, model: str) -> Chunks:
    """(arrival, sampled) of every data event of one chat stream (the first, the role: None)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": question}], "stream": True,
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    response, chunks = conn.getresponse(), []
    while line := response.readline():
        arrived = time.monotonic()
        if line.startswith(b"data: {"):
            chunks.append((arrived, json.loads(line[6:]).get("tiny_llm_sampled_at")))
    conn.close()
    return chunks


def burst_start(chunks: Chunks) -> bool:
    """The first two events arrived within 1 ms: the role, sent on acceptance, and the first
    token, sampled after the prefill; or the first two tokens although sampled apart."""
    if len(chunks) < 2:
        return False
    (a0, s0), (a1, s1) = chunks[:2]
    return a1 - a0 < BURST_ARRIVAL_S and (s0 is None or s1 - s0 >= BURST_SAMPLED_S)


def phase(streams: list[Chunks]) -> dict[str, Any]:
    delays = [a - s for chunks in streams for a, s in chunks if s is not None]
    return {"delivery_ms": harness.summarize(delays, 1000),
            "burst_starts": sum(burst_start(chunks) for chunks in streams),
            "streams": len(streams), "delays_ms": [round(d * 1000, 3) for d in delays]}  # fmt: skip


def merged(runs: list[dict], server: str, phase: str) -> dict[str, Any]:
    """One phase of one server over every repeat."""
    mine = [r[phase] for r in runs if r["server"] == server]
    delays = [d / 1000 for r in mine for d in r["delays_ms"]]
    return {"delivery_ms": harness.summarize(delays, 1000),
            "burst_starts": sum(r["burst_starts"] for r in mine),
            "streams": sum(r["streams"] for r in mine)}  # fmt: skip


def main(argv=None) -> int:
    p = harness.served_bench_parser("bench-token-delivery", __doc__, repeats_of="server")
    p.add_argument("--streams", type=int_at_least(1), default=8, help="streams started at once")
    p.add_argument("--sequential", type=int_at_least(1), default=8, help="streams one at a time")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64, help="tokens per stream")
    p.add_argument("--before", type=Path, help="a checkout whose serve.py runs alternately")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the server")
    harness.add_output_arguments(p, JSON_NAME)
    args = p.parse_args(argv)
    if not 0 <= args.load <= 64:
        p.error("--load must be in 0..64")
    if args.before is not None and not (args.before / "serve.py").is_file():
        p.error(f"--before {args.before}: no serve.py there")
    harness.check_served_args(p, args, JSON_NAME)
    servers = {"process": harness.ROOT}  # the engine in a process of its own
    if args.before is not None:
        servers["thread"] = args.before.resolve()  # the engine on a thread (before issue 40)
    started, runs = time.time(), []
    progress = harness.Progress(args.repeats * len(servers))
    with tempfile.TemporaryDirectory() as tmp, progress:
        for repeat in range(args.repeats):
            for name, root in servers.items():
                progress.start(f"repeat {repeat + 1}/{args.repeats}: {name} ({root})")
                run = run_server(root, args, Path(tmp))
                runs.append({"server": name, "repeat": repeat, **run})
                progress.done()
    summary = {name: {p: merged(runs, name, p) for p in PHASES} for name in servers}
    settings = harness.arguments_json(args, ("json_output",))
    targets = {"delivery_p95_ms_at_most": 5, "burst_starts": 0}
    report = harness.report("token-delivery", started, settings, runs, summary, targets)
    harness.write_report(args, report, summary_table)
    return 0


def summary_table(report: dict[str, Any]) -> str:
    rows = [
        [name, p, *(f"{s['delivery_ms'][k]:.2f}" for k in ("median", "p95", "max")),
         f"{s['burst_starts']}/{s['streams']}"]
        for name, phases in report["summary"].items() for p, s in phases.items()
    ]  # fmt: skip
    head = ["engine", "phase", "delivery p50 (ms)", "p95", "max", "burst starts"]
    return harness.table(head, rows)
