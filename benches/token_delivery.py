"""4.3: how long a token takes from the engine to a client, with the engine off the HTTP
process's interpreter (issue 40) and, with --before DIR, on a thread beside it (an older
checkout, run alternately in the same way).

serve.py runs on a free loopback port with TINY_LLM_STAMP_TOKENS=1, so every stream chunk also
carries `tiny_llm_sampled_at`: the engine's time.monotonic() when the step that sampled its
tokens ended (CLOCK_MONOTONIC is one clock for every process of the machine). Each run has two
phases: `--streams` greedy chat streams started at once ("concurrent"), then `--sequential`
streams one after the other ("sequential", a client at concurrency 1). A chunk's delivery time is
its arrival here minus its stamp. A "burst start" is a stream whose first two events (the role,
sent as soon as the request is accepted, and the first token, after the prompt's prefill)
arrived within 1 ms of each other: they were held back and sent together.

    pdm run bench-token-delivery [--model tiny] [--streams 8] [--sequential 8] [--max-tokens 64]
                                 [--repeats 3] [--before DIR] [--load N]

--load N runs N busy processes beside the server during the measurement (each stops by itself
after 600 s at most), for a machine under CPU load.

Writes benches/results/token-delivery-<model>-<host>.json (or --json-output).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from common import (
    add_output_arguments,
    check_checkpoint_arg,
    check_outputs,
    host_info,
    host_slug,
    log,
    summarize,
    write_json,
)
from serving_overhead import serve_running

from tiny_llm_support.demo_prompts import DEMO_PROMPTS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
QUESTIONS = [p.question for p in DEMO_PROMPTS if p.context is None]  # short chat prompts
BURST_ARRIVAL_S, BURST_SAMPLED_S = 0.001, 0.005
SPIN = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass"  # --load


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="tiny", help="tiny (the shipped chat model) or a path")
    p.add_argument("--streams", type=int, default=8, help="streams started at once")
    p.add_argument("--sequential", type=int, default=8, help="streams sent one at a time")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--repeats", type=int, default=3, help="runs of each server, alternating")
    p.add_argument("--before", type=Path, help="a checkout whose serve.py runs alternately")
    p.add_argument(
        "--load", type=int, default=0, help="busy processes beside the server (CPU load)"
    )
    add_output_arguments(p, "token-delivery-<model>-<host>.json")
    args = p.parse_args(argv)
    for name in ("streams", "sequential", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.load <= 64:
        p.error("--load must be in 0..64")
    if args.before is not None and not (args.before / "serve.py").is_file():
        p.error(f"--before {args.before}: no serve.py there")
    check_checkpoint_arg(p, args.model)
    if args.json_output is None:
        name = Path(args.model).name
        args.json_output = RESULTS / f"token-delivery-{name}-{host_slug()}.json"
    check_outputs(p, args.json_output)
    return args


def run_server(root: Path, args: argparse.Namespace, tmp: Path) -> dict:
    """One run: serve.py of `root`; its streams at once, then one at a time."""
    flags = ["--model", args.model, "--batch-size", str(args.streams), "--max-seq-len", "512"]
    stamped = {"TINY_LLM_STAMP_TOKENS": "1", "PYTHONPATH": str(root / "src")}
    with serve_running(flags, tmp, root, **stamped) as port:
        stream(port, QUESTIONS[0], 4, args.model)  # warm-up
        busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
        try:
            concurrent = at_once(port, args)
            sequential = [
                stream(port, QUESTIONS[i % len(QUESTIONS)], args.max_tokens, args.model)
                for i in range(args.sequential)
            ]
        finally:
            for p in busy:
                p.terminate()
                p.wait(timeout=30)
    return {"concurrent": phase(concurrent), "sequential": phase(sequential)}


def at_once(port: int, args: argparse.Namespace) -> list[list[tuple[float, float]]]:
    """`--streams` streams started together, one thread each."""
    streams = [None] * args.streams
    start = threading.Barrier(args.streams)

    def one(i: int) -> None:
        start.wait()
        streams[i] = stream(port, QUESTIONS[i % len(QUESTIONS)], args.max_tokens, args.model)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams


def phase(streams: list[list[tuple[float, float]]]) -> dict:
    delays = [a - s for chunks in streams for a, s in chunks if s is not None]
    return {
        "delivery_ms": summarize(delays, 1000),
        "burst_starts": sum(burst_start(chunks) for chunks in streams),
        "streams": len(streams),
        "delays_ms": [round(d * 1000, 3) for d in delays],
    }


def stream(port: int, question: str, max_tokens: int, model: str) -> list[tuple[float, float]]:
    """(arrival, sampled) of every data event of one streamed chat, read raw (sampled: None
    for the first, which carries the role and no token)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": question}], "stream": True,
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response, chunks = conn.getresponse(), []
    while line := response.readline():
        arrived = time.monotonic()
        if line.startswith(b"data: {"):
            chunks.append((arrived, json.loads(line[6:]).get("tiny_llm_sampled_at")))
    conn.close()
    return chunks


def burst_start(chunks: list[tuple[float, float | None]]) -> bool:
    """The first two events arrived together: the role, sent when the request was accepted,
    and the first token, sampled after the prompt's prefill (as a client that counts events
    sees it), or the first two tokens although they were sampled apart."""
    if len(chunks) < 2:
        return False
    (a0, s0), (a1, s1) = chunks[:2]
    return a1 - a0 < BURST_ARRIVAL_S and (s0 is None or s1 - s0 >= BURST_SAMPLED_S)


PHASES = ("concurrent", "sequential")


def merged(runs: list[dict], server: str, phase: str) -> dict:
    """One phase of one server over every repeat."""
    mine = [r[phase] for r in runs if r["server"] == server]
    delays = [d / 1000 for r in mine for d in r["delays_ms"]]
    return {
        "delivery_ms": summarize(delays, 1000),
        "burst_starts": sum(r["burst_starts"] for r in mine),
        "streams": sum(r["streams"] for r in mine),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = {"process": ROOT}  # the engine in a process of its own
    if args.before is not None:
        servers["thread"] = args.before.resolve()  # the engine on a thread (before issue 40)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, root in servers.items():
                log(f"repeat {repeat + 1}/{args.repeats}: {name} ({root})")
                run = run_server(root, args, Path(tmp))
                runs.append({"server": name, "repeat": repeat, **run})
    summary = {name: {p: merged(runs, name, p) for p in PHASES} for name in servers}
    settings = {
        k: getattr(args, k) for k in ("model", "streams", "sequential", "max_tokens", "load")
    }
    settings |= {
        "repeats": args.repeats,
        "before": None if args.before is None else str(args.before),
    }
    report = {"host": host_info(), "settings": settings, "runs": runs, "summary": summary}
    report["targets"] = {"delivery_p95_ms_at_most": 5, "burst_starts": 0}
    write_json(args.json_output, report)
    for name, phases in summary.items():
        for p, s in phases.items():
            d = s["delivery_ms"]
            print(
                f"engine {name:7s} {p:10s} delivery p50 {d['median']:5.2f} ms  p95 {d['p95']:5.2f}"
                f" ms  max {d['max']:6.2f} ms  burst starts {s['burst_starts']}/{s['streams']}"
            )
    print(f"wrote {args.json_output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TINY_LLM_NO_OPENBLAS", "1")  # the tiny model needs no fast BLAS
    sys.exit(startup.run(main))
