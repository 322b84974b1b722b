"""A server in a process of its own, for the benchmarks that measure one over HTTP: `Server`
(any command on a free loopback port), `serve` (a checkout's serve.py as a Server), clients on
threads that start together (`at_once`), a process's memory (`rss_bytes`, and `sampling_rss`
while a load runs), and the command line of a bench that serves a checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benches.harness.cli import bench_parser, check_checkpoint_arg, set_output_paths
from benches.harness.machine import host_slug
from benches.harness.report import RESULTS
from benches.harness.runs import ROOT
from tiny_llm_support.cli import int_at_least

__all__ = [
    "READY_TIMEOUT_S", "Server", "serve", "at_once", "rss_bytes", "sampling_rss",
    "served_bench_parser", "check_served_args",
]  # fmt: skip

READY_TIMEOUT_S = 300  # a server that does not answer GET /v1/models by then failed to start


class Server:
    """`command --port PORT` on a free loopback port, a fresh process in a session of its own
    (Ctrl-C reaches the bench, which stops it), its output in `log_path`: ready once GET
    /v1/models answers, stopped with SIGTERM (SIGKILL after 10 s)."""

    def __init__(self, name: str, command: list[str], env: dict | None, log_path: Path, cwd=ROOT):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{self.port}"
        self.cmd = [*command, "--port", str(self.port)]
        self.env, self.log_path, self.cwd = env, log_path, cwd

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.cwd,
                                         start_new_session=True)  # fmt: skip
        self.pid, deadline = self.proc.pid, time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.25)
        self.__exit__()
        last = (self.log_path.read_text().strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {self.name} did not start: {last}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """tiny-llm's GET /metrics as {name: value} (Prometheus text, comments skipped)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        pairs = (line.split() for line in text.splitlines() if line and line[0] != "#")
        return {name: float(value) for name, value in pairs}


def serve(log_path: Path, env: dict | None = None, root: Path = ROOT, **flags: Any) -> Server:
    """serve.py of the checkout `root` (this one unless given), run there in `env` (this
    process's unless given) with `flags` (batch_size=4 is --batch-size 4; None leaves a flag
    out): a Server named after it."""
    command = [sys.executable, str(root / "serve.py")]
    for name, value in flags.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return Server("serve.py", command, env, log_path, cwd=root)


def at_once(ask: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """ask(item) for every item, each on a thread of its own, the threads let go together:
    what each call returned, in the order of `items`."""
    start = threading.Barrier(len(items))

    def one(item: Any) -> Any:
        start.wait()
        return ask(item)

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(one, items))


def rss_bytes(pid: int | None) -> int | None:
    """VmRSS of a process, from /proc (None where there is no such file)."""
    try:
        found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except (OSError, TypeError):
        return None
    return int(found[1]) * 1024 if found else None


async def sampling_rss(pid: int | None, work: Awaitable[Any], every_s: float) -> tuple[Any, list]:
    """Await `work` while the RSS of process `pid` is sampled every `every_s` seconds: what
    `work` returned, and the samples as (time.perf_counter(), RSS in bytes)."""
    samples = []

    async def sample() -> None:
        while True:
            samples.append((time.perf_counter(), rss_bytes(pid)))
            await asyncio.sleep(every_s)

    sampler = asyncio.create_task(sample())
    try:
        return await work, samples
    finally:
        sampler.cancel()


def served_bench_parser(prog: str, doc: str, repeats_of: str) -> argparse.ArgumentParser:
    """The parser of a bench that serves a checkpoint in repeated runs: the first paragraph of
    its `doc` as the description, --model (the shipped tiny chat model unless given) and
    --repeats (runs of each `repeats_of`)."""
    p = bench_parser(prog, doc.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (the shipped chat model) or a path")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help=f"runs of each {repeats_of}")
    return p


def check_served_args(p: argparse.ArgumentParser, args: argparse.Namespace, json_name: str) -> None:
    """Before the first run: --model names a checkpoint that can be read, and --json-output
    (default: benches/results/`json_name`, <model> the checkpoint's folder name and <host> this
    machine's) can be written."""
    check_checkpoint_arg(p, args.model)
    name = json_name.replace("<model>", Path(args.model).name).replace("<host>", host_slug())
    set_output_paths(p, args, RESULTS / name)
