"""Week 4 Day 3: the served engine against mlx_lm.server, under open-loop load.

A load generator replays a committed trace against OpenAI-compatible servers, each request a
streaming client (the official `openai` AsyncOpenAI client) sent at its arrival time, the
arrivals a seeded Poisson process at a fixed rate (requests/s), whether or not the server keeps
up (open loop: a slow server builds a queue, it does not slow the clients down).

Two traces, both text (mlx_lm.server takes text prompts only) made of corpus words that are one
token each in the tiny tokenizer, so that a trace of N words is N tokens for the 0.6B shape:

- chat   independent prompts of 64-512 tokens, each asking for 32-128 tokens
         (benches/traces/chat-requests.json, made by --write-chat-trace);
- agent  the prefix-caching day's trace (benches/traces/prefix-agent.json): a shared system
         prompt, conversations of several turns; each turn sends the system prompt, the earlier
         turns with the server's own answers, and a new user message, so a turn is sent at its
         arrival time or when the previous turn's answer is complete, whichever is later.
         Its token ids become words (id modulo the number of words).

Servers, each a fresh process on a free port of 127.0.0.1, started and stopped by the bench, all
loading one local checkpoint directory, in turn for each rate:

- tiny-llm      serve.py with its defaults (hybrid policy, a paged pool read in place and sized
                from memory, the prefix cache, the model's context) and --batch-size 8; the
                engine flags below, where given, are passed on;
- mlx-lm        mlx_lm.server with its defaults;
- mlx-lm-batch  mlx_lm.server with --decode-concurrency and --prompt-concurrency set to our
                --batch-size.

Or --url: any OpenAI-compatible server already running (no RSS, no soak).

Per request: time to first token, every gap between content chunks, end-to-end time, output
tokens (the stream's usage), errors; per run: output tokens/s, requests completed and failed,
p50/p95/p99 of each latency, the server's RSS before and after. Greedy (temperature 0) text
is compared request by request with tiny-llm's. Then a soak against tiny-llm: --soak N requests
at the highest rate, one client in four hanging up mid-stream: every request completed or
cancelled (the server's own counters agree), every page back, RSS growth after warm-up.

    pdm run bench-serving                                  # the full run (8-layer 0.6B shape)
    pdm run bench-serving --model tiny --requests 4 --rates 0.5 --soak 8    # a quick look
    pdm run bench-serving --url http://127.0.0.1:8000/v1 --model-id tiny --traces chat
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from common import (
    EMBEDDED_CONFIGS,
    RESULTS,
    add_output_arguments,
    arguments_json,
    bench_parser,
    blas_info,
    check_checkpoint_arg,
    check_outputs,
    host_slug,
    log,
    openblas_hint,
    package_version,
    percentile,
    probe_openblas_core,
    pyplot,
    relative_path,
    replace_file,
    report_start,
    runs_environment,
    save_figure,
    set_output_paths,
    slug,
    write_report,
)

from tiny_llm_support.cli import int_at_least

SCHEMA = "tiny-llm/bench-serving/v1"
CHAT_SCHEMA = "tiny-llm/chat-trace/v1"
ROOT = Path(__file__).resolve().parent.parent
TRACES = {
    "chat": Path(__file__).resolve().parent / "traces" / "chat-requests.json",
    "agent": Path(__file__).resolve().parent / "traces" / "prefix-agent.json",
}
SERVERS = ("tiny-llm", "mlx-lm", "mlx-lm-batch")
DEFAULT_LAYERS = 8  # a shortcut with an embedded config: "the 8-layer Qwen3-0.6B shape"
ENGINE_FLAGS = ("--prefill-step", "--max-seq-len", "--page-size", "--max-pages")
DEFAULT_RATES = (0.05, 0.2, 0.8)  # requests/s: light, near and past saturation (0.6B shape)
READY_TIMEOUT_S = 300  # a server that does not answer GET /v1/models by then failed to start
IDLE_TIMEOUT_S = 60  # after a soak: how long the server may take to abort what was hung up

DEFINITIONS = {
    "scheduled_s": "the request's Poisson arrival time, from the run's start",
    "sent_s": "when the client sent it: scheduled_s, or for an agent turn the moment the "
    "previous turn's answer was complete, if later",
    "ttft_s": "first content chunk - sent_s",
    "gaps_s": "time between consecutive content chunks of one request (inter-token gaps; a "
    "chunk normally holds one token)",
    "e2e_s": "end of the stream - sent_s",
    "output_tokens": "completion_tokens of the stream's usage (stream_options.include_usage), "
    "else the number of content chunks",
    "output_tokens_per_s": "output tokens of completed requests / (last finish - first send)",
    "sustained": "no request failed, and requests completed / (last finish - first send - "
    "p50 e2e) is at least 90% of the offered rate: the queue did not keep growing",
    "rss_bytes": "VmRSS of the server process in /proc/<pid>/status",
    "text_matches_tiny_llm": "the request's text equals tiny-llm's for the same request",
    "text_matches_but_leading_space": "it equals tiny-llm's with the first leading space "
    "dropped (mlx-lm's streaming detokenizer trims it: same tokens, one space less)",
}

# The targets, recorded (never asserted): tiny-llm against mlx_lm.server at the highest
# rate both sustain.
TARGET_TOKENS_PER_S_RATIO = 1.0  # ours / theirs, at least
TARGET_GAP_P95_RATIO = 0.5  # ours / theirs, at most
TARGET_TTFT_P95_RATIO_AGENT = 0.5  # ours / theirs on the agent trace, at most


# --- traces --------------------------------------------------------------------------------


def trace_words() -> list[str]:
    """Words of the tiny tokenizer's corpus that are one token each with their leading space,
    sorted: " w1 w2 ..." is then exactly one token per word for the tiny tokenizer."""
    import tokenizers

    from tiny_llm_support.tiny_tokenizer import CORPUS, tiny_tokenizer_json

    vocab = tokenizers.Tokenizer.from_str(tiny_tokenizer_json()).get_vocab()
    corpus = set(re.findall(r"[A-Za-z]+", CORPUS))
    return sorted(w for w in corpus if len(w) > 1 and "Ġ" + w in vocab)


def words_text(ids: list[int], words: list[str]) -> str:
    """Token ids of a trace as text: each id one word (id modulo the number of words)."""
    return "".join(" " + words[i % len(words)] for i in ids)


def make_chat_trace(seed: int, requests: int, prompt: tuple, output: tuple) -> dict[str, Any]:
    """A new chat trace: prompt lengths uniform in `prompt`, output lengths in `output`, the
    words drawn uniformly, all from random.Random(seed)."""
    rng, words = random.Random(seed), trace_words()
    items = []
    for _ in range(requests):
        n = rng.randint(*prompt)
        text = "".join(" " + rng.choice(words) for _ in range(n))
        items.append({"prompt": text, "prompt_words": n, "max_tokens": rng.randint(*output)})
    return {
        "schema": CHAT_SCHEMA,
        "about": "independent chat requests for bench-serving: text prompts of corpus words "
        "that are one token each in the tiny tokenizer, and the tokens each asks for",
        "generator": {
            "seed": seed,
            "requests": requests,
            "prompt_words": list(prompt),
            "max_tokens": list(output),
            "command": f"python benches/serving.py --write-chat-trace PATH --seed {seed} "
            f"--trace-requests {requests}",
        },
        "requests": items,
    }


@dataclass
class Job:
    """One request of a trace. An agent turn's prompt is the conversation so far (the system
    prompt, earlier messages and answers) then `user`; a chat request's is `user` alone."""

    index: int
    conversation: int
    turn: int  # from 0
    user: str
    max_tokens: int


@dataclass
class Trace:
    name: str
    path: Path
    sha256: str  # of the file's bytes
    system: str  # "" for chat
    jobs: list[Job]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": relative_path(self.path),
            "file_sha256": self.sha256,
            "requests": len(self.jobs),
            "conversations": len({j.conversation for j in self.jobs}),
            "system_words": len(self.system.split()),
            "max_tokens": sorted({j.max_tokens for j in self.jobs}),
        }


def read_trace(name: str, path: Path, limit: int | None) -> Trace:
    """The first `limit` requests of a trace file (agent: whole conversations, turn by turn)."""
    raw = path.read_bytes()
    data = json.loads(raw)
    sha = hashlib.sha256(raw).hexdigest()
    if name == "chat":
        items = data["requests"][:limit]
        jobs = [Job(i, i, 0, r["prompt"], r["max_tokens"]) for i, r in enumerate(items)]
        return Trace(name, path, sha, "", jobs)
    words = trace_words()
    conversations = data["conversations"]
    if limit is not None:  # enough conversations for `limit` turns, then the first turns
        turns = max(len(c) for c in conversations)
        conversations = conversations[: max(1, -(-limit // turns))]
    order = sorted(
        (t, c) for c, turns in enumerate(conversations) for t in range(len(turns))
    )  # every first turn, then every second turn...
    jobs = [
        Job(i, c, t, words_text(conversations[c][t], words), data["max_tokens"])
        for i, (t, c) in enumerate(order[:limit])
    ]
    return Trace(name, path, sha, words_text(data["system"], words), jobs)


# --- one request -----------------------------------------------------------------------------


@dataclass
class Record:
    """What one client saw of its request (times in seconds from the run's start)."""

    index: int
    conversation: int
    turn: int
    scheduled_s: float
    prompt_chars: int = 0
    sent_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    finish_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    status: str = "pending"  # completed, cancelled (we hung up), failed
    error: str | None = None
    hangup_after_chunks: int | None = None

    def summary(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ttft_s"] = self.chunk_s[0] - self.sent_s if self.chunk_s else None
        d["e2e_s"] = self.finish_s - self.sent_s if self.finish_s is not None else None
        d["gaps_s"] = [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]
        del d["chunk_s"]
        return d


async def stream_one(client, model_id: str, prompt: str, max_tokens: int, rec: Record, clock):
    """Send one streaming completion and record every content chunk's arrival; hang up after
    `rec.hangup_after_chunks` chunks when set (the stream is closed: the server sees the
    client leave)."""
    rec.sent_s, rec.prompt_chars = clock(), len(prompt)
    try:
        stream = await client.completions.create(
            model=model_id,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = clock()
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or []:
                if choice.text:
                    rec.chunk_s.append(now)
                    rec.text += choice.text
                rec.finish_reason = choice.finish_reason or rec.finish_reason
            if rec.hangup_after_chunks is not None and len(rec.chunk_s) >= rec.hangup_after_chunks:
                await stream.close()
                rec.status = "cancelled"
                break
        else:
            rec.status = "completed"
    except Exception as e:  # noqa: BLE001 - any failure is the request's result
        rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
    rec.finish_s = clock()
    if rec.output_tokens is None and rec.status == "completed":
        rec.output_tokens = len(rec.chunk_s)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """A Poisson process of `rate` requests/s: exponential gaps of mean 1/rate, from `seed`."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def replay(url, model_id, trace: Trace, jobs, times, hangups=None) -> list[Record]:
    """Every job at its arrival time (an agent turn also after the previous turn's answer);
    `hangups`: job index -> content chunks after which the client hangs up."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0
    history: dict[int, str] = {}  # conversation -> prompt + answer so far
    done: dict[tuple[int, int], asyncio.Event] = {}

    async def run(k: int, job: Job) -> Record:
        rec = Record(job.index, job.conversation, job.turn, times[k])
        rec.hangup_after_chunks = (hangups or {}).get(k)
        await asyncio.sleep(max(0.0, times[k] - clock()))
        if job.turn > 0:  # the previous turn's answer is part of this prompt
            await done[(job.conversation, job.turn - 1)].wait()
        prompt = history.get(job.conversation, trace.system) + job.user
        await stream_one(client, model_id, prompt, job.max_tokens, rec, clock)
        history[job.conversation] = prompt + rec.text
        done[(job.conversation, job.turn)].set()
        return rec

    for job in jobs:
        done[(job.conversation, job.turn)] = asyncio.Event()
    try:
        return list(await asyncio.gather(*(run(k, j) for k, j in enumerate(jobs))))
    finally:
        await client.close()


# --- the numbers of one run --------------------------------------------------------------------


def quantiles(values: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 in milliseconds (None without values)."""
    out = {}
    for q in (50, 95, 99):
        p = percentile(values, q)
        out[f"p{q}_ms"] = None if p is None else p * 1000
    return out


def run_metrics(records: list[Record], rate: float) -> dict[str, Any]:
    """Per run: counts, output tokens/s and latency quantiles over the completed requests."""
    done = [r for r in records if r.status == "completed"]
    s = [r.summary() for r in done]
    first_sent = min((r.sent_s for r in records if r.sent_s is not None), default=0.0)
    last_finish = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    span = max(last_finish - first_sent, 1e-9)
    e2e = [x["e2e_s"] for x in s]
    tokens = sum(r.output_tokens or 0 for r in done)
    drain = percentile(e2e, 50) or 0.0  # the last request's own time, not queueing
    served = len(done) / max(span - drain, 1e-9)
    failed = sum(r.status == "failed" for r in records)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": failed,
        "cancelled": sum(r.status == "cancelled" for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": span,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / span,
        "served_requests_per_s": served,
        "sustained": failed == 0 and len(done) == len(records) and served >= 0.9 * rate,
        "ttft": quantiles([x["ttft_s"] for x in s if x["ttft_s"] is not None]),
        "inter_token_gap": quantiles([g for x in s for g in x["gaps_s"]]),
        "e2e": quantiles(e2e),
        "queue_wait": quantiles([r.sent_s - r.scheduled_s for r in done]),
    }


# --- servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int | None) -> int | None:
    """VmRSS of a process, from /proc (None where there is no such file)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def server_command(name: str, ckpt: Path, port: int, args) -> list[str]:
    """The command line of one server on `port`, loading the checkpoint directory `ckpt`."""
    if name == "tiny-llm":
        cmd = [
            sys.executable, str(ROOT / "serve.py"), "--model", str(ckpt), "--port", str(port),
            "--dtype", "float32", "--batch-size", str(args.batch_size), "--solution", args.solution,
        ]  # fmt: skip
        for flag in ENGINE_FLAGS:
            value = getattr(args, flag[2:].replace("-", "_"))
            cmd += [] if value is None else [flag, str(value)]
        return cmd
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(ckpt), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--log-level", "WARNING"]
    if name == "mlx-lm-batch":  # its batch size set to ours
        cmd += ["--decode-concurrency", str(args.batch_size)]
        cmd += ["--prompt-concurrency", str(args.batch_size)]
    return cmd


class Server:
    """A fresh server process on a free port: started, waited for, stopped (SIGTERM, then
    SIGKILL after 10 s). Its output goes to a log file, shown when it fails to start."""

    def __init__(self, name: str, ckpt: Path, args, env: dict, log_dir: Path):
        self.name, self.port = name, free_port()
        self.cmd = server_command(name, ckpt, self.port, args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_id = str(ckpt) if name == "tiny-llm" else "default_model"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.env, self.proc = env, None

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,  # Ctrl-C reaches the bench, which stops the server
            )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.25)
        self.stop()
        tail = self.log_path.read_text()[-3000:]
        raise SystemExit(f"error: server {self.name} did not start ({self.cmd}):\n{tail}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def metrics(self) -> dict[str, float]:
        """tiny-llm's GET /metrics as {name: value} (Prometheus text, comments skipped)."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        pairs = (line.split() for line in text.splitlines() if line and line[0] != "#")
        return {name: float(value) for name, value in pairs}


# --- runs ----------------------------------------------------------------------------------


def measure(server_name: str, url: str, model_id: str, trace: Trace, rate, args, pid=None):
    """One (server, trace, rate) run: every request of the trace, and the run's numbers."""
    times = arrival_times(len(trace.jobs), rate, args.seed)
    rss_before = rss_bytes(pid)
    records = asyncio.run(replay(url + "/v1", model_id, trace, trace.jobs, times))
    m = run_metrics(records, rate)
    m["rss_before_bytes"], m["rss_after_bytes"] = rss_before, rss_bytes(pid)
    log(
        f"  {server_name:>12} {trace.name:>5} {rate:g} req/s: {m['completed']}/{m['requests']} "
        f"completed, {m['output_tokens_per_s']:.2f} tok/s, TTFT p95 {_ms(m['ttft']['p95_ms'])}, "
        f"gap p95 {_ms(m['inter_token_gap']['p95_ms'])}, e2e p95 {_ms(m['e2e']['p95_ms'])}"
    )
    return {
        "server": server_name,
        "trace": trace.name,
        "rate": rate,
        "metrics": m,
        "requests": [r.summary() for r in records],
    }


def warm_up(server: Server, trace: Trace) -> None:
    """One short request, so that the run does not pay for the first compiles and loads."""
    job = Job(0, 0, 0, trace.jobs[0].user[:200], 4)
    asyncio.run(replay(server.url + "/v1", server.model_id, trace, [job], [0.0]))


def compare_texts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mark every request whose text equals tiny-llm's in the same (trace, rate) run; count.
    Also counted: texts equal once a leading space is dropped (mlx-lm's streaming detokenizer
    trims the first token's leading space, trim_space=True, where the tokens are the same)."""
    base = {(r["trace"], r["rate"]): r for r in runs if r["server"] == "tiny-llm"}
    counts = {}
    for run in runs:
        ref = base.get((run["trace"], run["rate"]))
        if ref is None or run is ref:
            continue
        want = {q["index"]: q for q in ref["requests"] if q["status"] == "completed"}
        n = {"compared": 0, "identical": 0, "identical_but_leading_space": 0}
        for q in run["requests"]:
            other = want.get(q["index"])
            if other is None or q["status"] != "completed":
                q["text_matches_tiny_llm"] = None
                continue
            q["text_matches_tiny_llm"] = q["text"] == other["text"]
            q["text_matches_but_leading_space"] = q["text"] == other["text"].removeprefix(" ")
            n["compared"] += 1
            n["identical"] += q["text_matches_tiny_llm"]
            n["identical_but_leading_space"] += (
                q["text_matches_but_leading_space"] and not q["text_matches_tiny_llm"]
            )
        run["text_match"] = n
        total = counts.setdefault(run["server"], dict.fromkeys(n, 0))
        for k, v in n.items():
            total[k] += v
    return counts


def run_soak(args, ckpt: Path, env: dict, tmp: Path) -> dict[str, Any]:
    """--soak N requests (the whole chat trace, whatever --requests says, cycled) at the
    highest rate against a fresh tiny-llm; one client in four hangs up after a random number
    of chunks."""
    trace = read_trace("chat", TRACES["chat"], None)
    rate = max(args.rates)
    rng = random.Random(args.seed + 1)
    jobs = [
        Job(i, i, 0, trace.jobs[i % len(trace.jobs)].user, trace.jobs[i % len(trace.jobs)].max_tokens)
        for i in range(args.soak)
    ]  # fmt: skip
    hangups = {i: rng.randint(1, max(1, jobs[i].max_tokens - 1)) for i in range(3, args.soak, 4)}
    times = arrival_times(args.soak, rate, args.seed + 2)
    log(f"soak: {args.soak} requests at {rate:g} req/s, {len(hangups)} clients hang up")
    with Server("tiny-llm", ckpt, args, env, tmp) as server:
        warm_up(server, trace)
        before = server.metrics()
        rss, samples = [], []

        async def go():
            async def watch():
                while True:
                    samples.append((time.perf_counter(), rss_bytes(server.pid)))
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch())
            try:
                return await replay(
                    server.url + "/v1", server.model_id, trace, jobs, times, hangups
                )
            finally:
                watcher.cancel()

        t0 = time.perf_counter()
        records = asyncio.run(go())
        after = wait_idle(server, before, len(jobs))
        rss = rss_bytes(server.pid)
    return {"distinct_prompts": len(trace.jobs)} | soak_report(
        args, records, hangups, before, after, samples, t0, rss
    )


def wait_idle(server: Server, before: dict, sent: int) -> dict[str, float]:
    """/metrics once nothing runs or waits and every request sent is finished or aborted."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        m = server.metrics()
        ended = _delta(m, before, "tiny_llm_requests_finished_total") + _delta(
            m, before, "tiny_llm_requests_aborted_total"
        )
        busy = m.get("tiny_llm_requests_running", 0) + m.get("tiny_llm_requests_waiting", 0)
        if (busy == 0 and ended >= sent) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def soak_report(args, records, hangups, before, after, samples, t0, rss_end) -> dict[str, Any]:
    completed = sum(r.status == "completed" for r in records)
    cancelled = sum(r.status == "cancelled" for r in records)
    failed = [r.summary() for r in records if r.status not in ("completed", "cancelled")]
    finished = _delta(after, before, "tiny_llm_requests_finished_total")
    aborted = _delta(after, before, "tiny_llm_requests_aborted_total")
    # RSS after warm-up: the sample taken when the first tenth of the requests had finished
    ends = sorted(r.finish_s for r in records if r.finish_s is not None)
    warm_at = t0 + ends[max(0, len(ends) // 10 - 1)] if ends else t0
    rss_warm = next((b for t, b in samples if t >= warm_at and b), rss_end)
    growth = (rss_end - rss_warm) / rss_warm if rss_warm and rss_end else None
    # and over the second half of the run alone: caches that fill early stop counting there
    middle = (samples[0][0] + samples[-1][0]) / 2 if samples else t0
    rss_middle = next((b for t, b in samples if t >= middle and b), rss_end)
    late = (rss_end - rss_middle) / rss_middle if rss_middle and rss_end else None
    pages_in_use = after.get("tiny_llm_kv_pages_in_use")
    return {
        "requests": len(records),
        "rate": max(args.rates),
        "hangups_planned": len(hangups),
        "completed": completed,
        "cancelled_by_client": cancelled,
        "failed": failed[:10],
        "server_finished": finished,  # the engine's own counters over the soak
        "server_aborted": aborted,
        # every request either completed or was cancelled by us, and the server ended each
        # exactly once (a hang-up that came after the last token counts as finished there)
        "no_request_lost_or_duplicated": not failed
        and completed + cancelled == len(records) == len({r.index for r in records})
        and finished + aborted == len(records),
        "pages_in_use_end": pages_in_use,
        "pages_free_end": after.get("tiny_llm_kv_pages_free"),
        "pages_cached_end": after.get("tiny_llm_kv_pages_cached"),
        "max_pages": args.max_pages,
        "every_page_back": pages_in_use == 0,
        "requests_running_end": after.get("tiny_llm_requests_running"),
        "requests_waiting_end": after.get("tiny_llm_requests_waiting"),
        "rss_after_warmup_bytes": rss_warm,
        "rss_end_bytes": rss_end,
        "rss_growth_after_warmup": growth,
        "rss_growth_target": 0.05,
        "rss_growth_met": growth is not None and growth < 0.05,
        "rss_growth_second_half": late,
        "rss_samples": [[round(t - t0, 2), b] for t, b in samples[:: max(1, len(samples) // 200)]],
        "server_metrics_end": after,
    }


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


# --- the checkpoint both servers load -------------------------------------------------------


def write_model(args, directory: Path) -> dict[str, Any]:
    """The checkpoint directory both servers load, in float32: --model tiny (the trained tiny
    chat model, cast), a shortcut (random weights of its shape, --num-layers layers, with the
    tiny tokenizer), or a directory of one's own (used as it is). Returns its description."""
    import mlx.core as mx

    from tiny_llm_support import Qwen3Config, random_weights, resolve_model
    from tiny_llm_support.tiny import write_checkpoint
    from tiny_llm_support.tiny_tokenizer import tiny_tokenizer_json

    key = args.model.lower()
    if key in EMBEDDED_CONFIGS and not Path(args.model).exists():
        import tokenizers

        tok_json = tiny_tokenizer_json()
        tok = tokenizers.Tokenizer.from_str(tok_json)
        layers = args.num_layers or DEFAULT_LAYERS
        config = {**EMBEDDED_CONFIGS[key], "num_hidden_layers": layers, "torch_dtype": "float32"}
        config["bos_token_id"] = tok.token_to_id("<|endoftext|>")
        config["eos_token_id"] = tok.token_to_id("<|im_end|>")
        weights = random_weights(Qwen3Config.from_dict(config), args.seed, "float32")
        # Embedding rows past the tokenizer's vocabulary are padding, as in the published
        # checkpoint: zero, so that their logits (0) never win the greedy argmax and every
        # generated token has text. Same shapes, so the same FLOPs and bytes.
        emb = weights["model.embed_tokens.weight"]
        keep = mx.arange(emb.shape[0])[:, None] < tok.get_vocab_size()
        weights["model.embed_tokens.weight"] = mx.where(keep, emb, 0.0)
        write_checkpoint(directory, config, weights, tok_json)
        return {"name": key, "random_weights": True, "num_layers": layers, "config": config}
    source = resolve_model(args.model)
    if key != "tiny":
        return {"name": args.model, "random_weights": False, "path": str(source)}
    shutil.copytree(source, directory)
    weights = mx.load(str(directory / "model.safetensors"))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    layers = config["num_hidden_layers"]
    return {"name": "tiny", "random_weights": False, "cast_to": "float32", "num_layers": layers,
            "config": config}  # fmt: skip


# --- the report -------------------------------------------------------------------------------


def targets(runs: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    """Per trace and mlx-lm variant: the issue's ratios at the highest rate both sustain."""
    out = {}
    for theirs in (s for s in servers if s != "tiny-llm"):
        for trace in sorted({r["trace"] for r in runs}):
            pair = {}
            for r in runs:
                if r["trace"] == trace and r["server"] in ("tiny-llm", theirs):
                    pair.setdefault(r["rate"], {})[r["server"]] = r["metrics"]
            both = [
                rate
                for rate, p in pair.items()
                if len(p) == 2 and all(m["sustained"] for m in p.values())
            ]
            if not both:
                out[f"{trace} vs {theirs}"] = {"checked": False, "why": "no rate both sustain"}
                continue
            rate = max(both)
            ours, other = pair[rate]["tiny-llm"], pair[rate][theirs]
            out[f"{trace} vs {theirs}"] = {
                "checked": True,
                "rate": rate,
                "output_tokens_per_s": _ratio(ours, other, ("output_tokens_per_s",),
                                              at_least=TARGET_TOKENS_PER_S_RATIO),
                "inter_token_gap_p95": _ratio(ours, other, ("inter_token_gap", "p95_ms"),
                                              at_most=TARGET_GAP_P95_RATIO),
                "ttft_p95": _ratio(ours, other, ("ttft", "p95_ms"),
                                   at_most=TARGET_TTFT_P95_RATIO_AGENT if trace == "agent" else None),
            }  # fmt: skip
    return out


def _ratio(ours, theirs, keys, at_least=None, at_most=None) -> dict[str, Any]:
    """ours / theirs of one number, and whether the bound (if any) is met."""
    a, b = ours, theirs
    for k in keys:
        a, b = a[k], b[k]
    value = a / b if a is not None and b else None
    met = None
    if value is not None and at_least is not None:
        met = value >= at_least
    if value is not None and at_most is not None:
        met = value <= at_most
    return {"tiny_llm": a, "mlx_lm": b, "ratio": value, "at_least": at_least, "at_most": at_most,
            "met": met}  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Latency against load, one line per server, solid chat and dashed agent: p95 TTFT, p95
    inter-token gap (both log scale) and output tokens/s, against the offered rate."""
    plt = pyplot()
    if plt is None:
        return None
    colors = {"tiny-llm": "tab:green", "mlx-lm": "tab:blue", "mlx-lm-batch": "tab:purple"}
    styles = {"chat": "o-", "agent": "s--"}
    panels = [
        (("ttft", "p95_ms"), "time to first token, p95 (ms)", True),
        (("inter_token_gap", "p95_ms"), "inter-token gap, p95 (ms)", True),
        (("output_tokens_per_s",), "output tokens/s", False),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), dpi=120)
    for ax, (keys, label, log_y) in zip(axes, panels):
        for (server, trace), runs in _series(report["runs"]).items():
            values = []
            for r in runs:
                v = r["metrics"]
                for k in keys:
                    v = v[k]
                values.append(v)
            ax.plot([r["rate"] for r in runs], values, styles.get(trace, "o-"),
                    color=colors.get(server), label=f"{server}, {trace}")  # fmt: skip
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    m = report["model"]
    title = (
        f"serving under load: {m['name']} ({m.get('num_layers', '?')} layers), float32, "
        f"tiny-llm (serve's defaults, batch "
        f"{report['settings']['batch_size']}) against mlx_lm.server; "
        f"{report['arguments']['requests'] or 'all'} requests per trace; "
        f"{report['host']['machine']}, {report['host']['cpu_count']} CPUs"
    )
    return save_figure(fig, path, title)


def _series(runs):
    out: dict[tuple[str, str], list] = {}
    for r in sorted(runs, key=lambda r: r["rate"]):
        out.setdefault((r["server"], r["trace"]), []).append(r)
    return out


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def summary_table(report: dict[str, Any]) -> str:
    lines = [
        f"{'server':>12} {'trace':>5} {'req/s':>6} {'done':>7} {'tok/s':>7} {'TTFT p50':>9} "
        f"{'p95':>8} {'gap p50':>8} {'p95':>8} {'e2e p95':>8} {'same text':>9} {'sustained':>9}"
    ]
    for r in report["runs"]:
        m = r["metrics"]
        match = r.get("text_match")
        same = (
            f"{match['identical']}+{match['identical_but_leading_space']}/{match['compared']}"
            if match
            else "-"
        )
        lines.append(
            f"{r['server']:>12} {r['trace']:>5} {r['rate']:>6g} "
            f"{m['completed']:>3}/{m['requests']:<3} {m['output_tokens_per_s']:>7.2f} "
            f"{_num(m['ttft']['p50_ms']):>9} {_num(m['ttft']['p95_ms']):>8} "
            f"{_num(m['inter_token_gap']['p50_ms']):>8} {_num(m['inter_token_gap']['p95_ms']):>8} "
            f"{_num(m['e2e']['p95_ms']):>8} {same:>9} {str(m['sustained']):>9}"
        )
    lines.append(
        "(times in ms; same text: identical + identical but mlx-lm's trimmed leading space, "
        "of those compared)"
    )
    soak = report.get("soak")
    if soak:
        growth = soak["rss_growth_after_warmup"]
        lines.append(
            f"soak: {soak['requests']} requests, {soak['completed']} completed, "
            f"{soak['cancelled_by_client']} hung up; server finished {soak['server_finished']:.0f}"
            f", aborted {soak['server_aborted']:.0f}; nothing lost or duplicated: "
            f"{soak['no_request_lost_or_duplicated']}; every page back: {soak['every_page_back']}"
            f"; RSS growth after warm-up: {'n/a' if growth is None else f'{growth:.1%}'}"
        )
    return "\n".join(lines)


def _num(v):
    return "n/a" if v is None else f"{v:.0f}"


# --- the command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(
        "bench-serving",
        "Open-loop load test of OpenAI-compatible servers: tiny-llm's serve and mlx_lm.server "
        "side by side on one checkpoint, or any --url.",
    )
    p.add_argument("--model", default="qwen3-0.6b",
                   help="tiny (the trained tiny chat model), a shortcut (random weights of its "
                   "shape, with the tiny tokenizer) or a checkpoint directory")  # fmt: skip
    p.add_argument("--num-layers", type=int_at_least(1), default=None,
                   help=f"layers of a shortcut's shape (default {DEFAULT_LAYERS})")  # fmt: skip
    p.add_argument("--solution", choices=("ref", "tiny_llm"), default="ref")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--url", default=None,
                   help="instead of starting servers: the base URL of one (e.g. "
                   "http://127.0.0.1:8000/v1); no RSS, no soak")  # fmt: skip
    p.add_argument("--model-id", default=None, help="with --url: the model name to send")
    p.add_argument("--traces", nargs="+", choices=tuple(TRACES), default=list(TRACES))
    p.add_argument("--requests", type=int_at_least(1), default=None,
                   help="use the first N requests of each trace (default all)")  # fmt: skip
    p.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES),
                   help="arrival rates, requests/s (Poisson)")  # fmt: skip
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="arrivals, hang-ups, random weights")  # fmt: skip
    p.add_argument("--soak", type=int_at_least(0), default=2000,
                   help="requests of the soak at the highest rate (0: none)")  # fmt: skip
    e = p.add_argument_group("tiny-llm's server")
    e.add_argument("--batch-size", type=int_at_least(1), default=8, help="decode slots")
    for flag in ENGINE_FLAGS:  # serve's own defaults unless given
        e.add_argument(flag, type=int_at_least(1), default=None, help="default: serve's")
    o = p.add_argument_group("output")
    add_output_arguments(o, "serving-<model>-<os>-<arch>-<N>cpu.json", plot=True)
    o.add_argument("--note", default=None, help="a note recorded in the JSON")
    o.add_argument("--no-openblas", action="store_true",
                   help="keep the mlx[cpu] wheel's reference BLAS in the servers")  # fmt: skip
    t = p.add_argument_group("making the chat trace")
    t.add_argument("--write-chat-trace", type=Path, default=None, metavar="PATH",
                   help="write a new chat trace and exit")  # fmt: skip
    t.add_argument("--trace-requests", type=int_at_least(1), default=64)
    return p


def default_json_path(args) -> Path:
    name = Path(args.model).name if Path(args.model).exists() else args.model.lower()
    if name in EMBEDDED_CONFIGS:
        name += f"-{args.num_layers or DEFAULT_LAYERS}layers"
    return RESULTS / f"serving-{slug(name) or 'model'}-{host_slug()}.json"


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.write_chat_trace is not None:
        check_outputs(p, args.write_chat_trace)
        data = make_chat_trace(args.seed, args.trace_requests, (64, 512), (32, 128))
        replace_file(args.write_chat_trace, json.dumps(data, indent=1) + "\n")
        log(f"wrote {args.write_chat_trace}")
        return 0
    if any(r <= 0 for r in args.rates):
        p.error("--rates must be positive")
    if args.url and not args.model_id:
        p.error("--url needs --model-id, the model name that server expects")
    set_output_paths(p, args, default_json_path(args))
    if not args.url and not (
        args.model.lower() in EMBEDDED_CONFIGS and not Path(args.model).exists()
    ):
        check_checkpoint_arg(p, args.model)  # a shortcut's random weights are the bench's own
    traces = [read_trace(name, TRACES[name], args.requests) for name in args.traces]
    report = run_benchmark(args, traces)
    write_report(args, report, summary_table, plot)
    return 0


def run_benchmark(args, traces: list[Trace]) -> dict[str, Any]:
    started = time.time()
    env, preloaded = runs_environment(args.no_openblas)
    core = probe_openblas_core(env, preloaded)
    if hint := openblas_hint(core):
        log(hint)
    runs: list[dict[str, Any]] = []
    servers = ["url"] if args.url else args.servers
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        tmp = Path(tmp)
        model = {"name": args.url} if args.url else write_model(args, tmp / "model")
        ckpt = Path(model.get("path", tmp / "model"))
        for rate in args.rates:  # for each rate, each server in turn, each a fresh process
            for name in servers:
                if args.url:
                    for trace in traces:
                        runs.append(measure("url", args.url.rstrip("/").removesuffix("/v1"),
                                            args.model_id, trace, rate, args))  # fmt: skip
                    continue
                with Server(name, ckpt, args, env, tmp) as server:
                    warm_up(server, traces[0])
                    for trace in traces:
                        runs.append(measure(name, server.url, server.model_id, trace, rate,
                                            args, server.pid))  # fmt: skip
        soak = run_soak(args, ckpt, env, tmp) if args.soak and not args.url else None
    matches = compare_texts(runs)
    return {
        **report_start(SCHEMA, started, arguments_json(args)),
        "note": args.note,
        "blas": {"parent": blas_info(), "preloaded_in_servers": preloaded, "openblas_core": core},
        "versions": {p: package_version(p) for p in ("mlx", "mlx-lm", "openai", "fastapi")},
        "model": model,
        "settings": {
            "tiny-llm": "serve.py with its defaults, float32",
            "batch_size": args.batch_size,
            "prefill_step": args.prefill_step,
            "max_seq_len": args.max_seq_len,
            "page_size": args.page_size,
            "max_pages": args.max_pages,
            "mlx-lm": "mlx_lm.server, its defaults (--decode-concurrency 32, "
            "--prompt-concurrency 8, --prefill-step-size 2048)",
            "mlx-lm-batch": f"mlx_lm.server --decode-concurrency {args.batch_size} "
            f"--prompt-concurrency {args.batch_size}",
            "sampling": "temperature 0 (greedy), stream, stream_options.include_usage",
        },
        "traces": [t.describe() for t in traces],
        "definitions": DEFINITIONS,
        "runs": runs,
        "text_match": matches,
        "targets": targets(runs, servers),
        "soak": soak,
    }


if __name__ == "__main__":
    sys.exit(startup.run(main))
