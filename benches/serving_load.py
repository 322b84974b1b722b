"""bench-serving's load: the committed traces, streaming clients that replay them at their arrival
times, the servers they run against (tiny-llm, mlx-lm, or one at --url) and the float32 checkpoint
the servers load (which bench-ragged-step shares)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benches import harness

TRACE_DIR = Path(__file__).resolve().parent / "traces"
TRACES = {"chat": TRACE_DIR / "chat-requests.json", "agent": TRACE_DIR / "prefix-agent.json"}
DEFAULT_LAYERS = 8  # a shortcut's shape: "the 8-layer Qwen3-0.6B shape"
SERVERS = ("tiny-llm", "mlx-lm", "mlx-lm-batch")
ENGINE_FLAGS = ("prefill_step", "max_seq_len", "page_size", "max_pages")  # serve's, as in args


@dataclass
class Job:
    """One request: its prompt is the conversation so far (system, earlier turns), then `user`."""

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
        return {"name": self.name, "path": harness.relative_path(self.path),
                "file_sha256": self.sha256, "requests": len(self.jobs),
                "conversations": len({j.conversation for j in self.jobs}),
                "system_words": len(self.system.split()),
                "max_tokens": sorted({j.max_tokens for j in self.jobs})}  # fmt: skip


def read_trace(name: str, path: Path, limit: int | None, max_tokens: int | None = None) -> Trace:
    """The first `limit` requests of a trace (agent: every first turn, then every second...),
    each asking for `max_tokens` tokens if given; an agent trace's token ids as words of the tiny
    corpus that are one token each."""
    raw = path.read_bytes()
    data, sha = json.loads(raw), hashlib.sha256(raw).hexdigest()
    if name == "chat":
        jobs = [Job(i, i, 0, r["prompt"], max_tokens or r["max_tokens"])
                for i, r in enumerate(data["requests"][:limit])]  # fmt: skip
        return Trace(name, path, sha, "", jobs)
    words = trace_words()
    text = lambda ids: "".join(" " + words[i % len(words)] for i in ids)
    conversations = data["conversations"]
    if limit is not None:  # enough conversations for `limit` turns
        conversations = conversations[: max(1, -(-limit // max(map(len, conversations))))]
    order = sorted((t, c) for c, turns in enumerate(conversations) for t in range(len(turns)))
    jobs = [Job(i, c, t, text(conversations[c][t]), max_tokens or data["max_tokens"])
            for i, (t, c) in enumerate(order[:limit])]  # fmt: skip
    return Trace(name, path, sha, text(data["system"]), jobs)


def trace_words() -> list[str]:
    """The words of the tiny corpus that are one token each (with their leading space)."""
    import tokenizers

    from tiny_llm_support.tiny_tokenizer import CORPUS, tiny_tokenizer_json

    vocab = tokenizers.Tokenizer.from_str(tiny_tokenizer_json()).get_vocab()
    return sorted({w for w in re.findall(r"[A-Za-z]+", CORPUS) if len(w) > 1 and "Ġ" + w in vocab})


@dataclass
class Record:
    """What one client saw of its request, in seconds from the run's start. sent_s: its Poisson
    arrival (scheduled_s) or, for an agent turn, the end of the previous answer if later;
    chunk_s: each content chunk's arrival; output_tokens: the stream's usage, else the chunks."""

    index: int
    conversation: int
    turn: int
    scheduled_s: float
    hangup_after_chunks: int | None = None  # the client hangs up after so many chunks
    prompt_chars: int = 0
    sent_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    status: str = "pending"  # completed, cancelled (we hung up), failed
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """The record, with ttft_s and e2e_s (from sent_s) and the gaps between chunks."""
        d = {k: v for k, v in self.__dict__.items() if k != "chunk_s"}
        d["ttft_s"] = self.chunk_s[0] - self.sent_s if self.chunk_s else None
        d["e2e_s"] = self.finish_s - self.sent_s if self.finish_s is not None else None
        d["gaps_s"] = [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]
        return d


async def stream_one(client, model_id: str, prompt: str, max_tokens: int, rec: Record, clock):
    """One greedy streaming completion into `rec`, hanging up after rec.hangup_after_chunks."""
    rec.sent_s, rec.prompt_chars = clock(), len(prompt)
    try:
        stream = await client.completions.create(
            model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
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
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


async def replay(server, trace: Trace, jobs, times, hangups=None) -> list[Record]:
    """Every job at its arrival time, an agent turn also after the previous turn's answer;
    `hangups`: job position -> content chunks after which its client hangs up."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0
    history: dict[int, str] = {}  # conversation -> prompt + answer so far
    done = {(j.conversation, j.turn): asyncio.Event() for j in jobs}

    async def run(k: int, job: Job) -> Record:
        rec = Record(job.index, job.conversation, job.turn, times[k], (hangups or {}).get(k))
        await asyncio.sleep(max(0.0, times[k] - clock()))
        if job.turn > 0:  # the previous turn's answer is part of this prompt
            await done[(job.conversation, job.turn - 1)].wait()
        prompt = history.get(job.conversation, trace.system) + job.user
        await stream_one(client, server.model_id, prompt, job.max_tokens, rec, clock)
        history[job.conversation] = prompt + rec.text
        done[(job.conversation, job.turn)].set()
        return rec

    try:
        return list(await asyncio.gather(*(run(k, j) for k, j in enumerate(jobs))))
    finally:
        await client.close()


def quantiles(values: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 in milliseconds (None without values)."""
    return {f"p{q}_ms": harness.percentile(values, q) * 1000 if values else None
            for q in (50, 95, 99)}  # fmt: skip


def run_metrics(records: list[Record], rate: float) -> dict[str, Any]:
    """Counts, output tokens/s and latency quantiles of the completed requests. Sustained: none
    failed, and completed / (last finish - first send - p50 e2e) is at least 90% of the offered
    rate (the queue did not keep growing)."""
    done = [r.summary() for r in records if r.status == "completed"]
    first_sent = min((r.sent_s for r in records if r.sent_s is not None), default=0.0)
    last_finish = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    span = max(last_finish - first_sent, 1e-9)
    e2e = [q["e2e_s"] for q in done]
    tokens = sum(q["output_tokens"] or 0 for q in done)
    served = len(done) / max(span - (harness.percentile(e2e, 50) or 0.0), 1e-9)
    failed = sum(r.status == "failed" for r in records)
    return {
        "requests": len(records), "completed": len(done), "failed": failed,
        "cancelled": sum(r.status == "cancelled" for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": span, "output_tokens": tokens, "output_tokens_per_s": tokens / span,
        "served_requests_per_s": served,
        "sustained": failed == 0 and len(done) == len(records) and served >= 0.9 * rate,
        "ttft": quantiles([q["ttft_s"] for q in done if q["ttft_s"] is not None]),
        "inter_token_gap": quantiles([g for q in done for g in q["gaps_s"]]),
        "e2e": quantiles(e2e),
        "queue_wait": quantiles([q["sent_s"] - q["scheduled_s"] for q in done]),
    }  # fmt: skip


def start_server(name: str, ckpt: Path, args, env: dict, tmp: Path):
    """The server `name` loading `ckpt` (a context manager), or --url's, already running."""
    if name == "url":
        url = args.url.rstrip("/").removesuffix("/v1")
        return contextlib.nullcontext(SimpleNamespace(url=url, model_id=args.model_id, pid=None))
    if name == "tiny-llm":  # serve's own defaults for the engine flags not given
        flags = {flag: getattr(args, flag) for flag in ("batch_size", "solution", *ENGINE_FLAGS)}
        server = harness.serve(tmp / f"{name}.log", env, model=ckpt, dtype="float32", **flags)
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(ckpt),
               "--host", "127.0.0.1", "--log-level", "WARNING"]  # fmt: skip
        if name == "mlx-lm-batch":  # its batch size set to ours
            cmd += ["--decode-concurrency", str(args.batch_size),
                    "--prompt-concurrency", str(args.batch_size)]  # fmt: skip
        server = harness.Server(name, cmd, env, tmp / f"{name}.log")
    server.model_id = str(ckpt) if name == "tiny-llm" else "default_model"
    return server


def warm_up(server, trace: Trace) -> None:
    """One short request, so that the run does not pay for the first compiles and loads."""
    asyncio.run(replay(server, trace, [Job(0, 0, 0, trace.jobs[0].user[:200], 4)], [0.0]))


def run_load(name: str, server, trace: Trace, rate: float, seed: int) -> dict[str, Any]:
    """One (server, trace, rate) run: every request of the trace, and the run's numbers."""
    rss_before = harness.rss_bytes(server.pid)
    times = arrival_times(len(trace.jobs), rate, seed)
    records = asyncio.run(replay(server, trace, trace.jobs, times))
    metrics = {**run_metrics(records, rate), "rss_before_bytes": rss_before,
               "rss_after_bytes": harness.rss_bytes(server.pid)}  # fmt: skip
    return {"server": name, "trace": trace.name, "rate": rate, "metrics": metrics,
            "requests": [r.summary() for r in records]}  # fmt: skip


def write_model(args, directory: Path) -> dict[str, Any]:
    """The float32 checkpoint every server loads, and its description: tiny (cast), a shortcut
    (random weights of its shape, the tiny tokenizer) or a directory of one's own (as it is)."""
    import mlx.core as mx
    import tokenizers

    from tiny_llm_support import Qwen3Config, random_weights, resolve_model
    from tiny_llm_support.tiny import write_checkpoint
    from tiny_llm_support.tiny_tokenizer import tiny_tokenizer_json

    key = args.model.lower()
    if is_shape(args.model):
        tok_json = tiny_tokenizer_json()
        tok = tokenizers.Tokenizer.from_str(tok_json)
        layers = args.num_layers or DEFAULT_LAYERS
        config = {**harness.EMBEDDED_CONFIGS[key], "num_hidden_layers": layers,
                  "torch_dtype": "float32", "bos_token_id": tok.token_to_id("<|endoftext|>"),
                  "eos_token_id": tok.token_to_id("<|im_end|>")}  # fmt: skip
        weights = random_weights(Qwen3Config.from_dict(config), args.seed, "float32")
        # Embedding rows past the tokenizer are padding, as in the published checkpoint: zero,
        # so that their logits (0) never win the greedy argmax. Same shapes, same FLOPs.
        emb = weights["model.embed_tokens.weight"]  # [vocab, hidden]
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
    config = {**json.loads((directory / "config.json").read_text()), "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"name": "tiny", "random_weights": False, "cast_to": "float32",
            "num_layers": config["num_hidden_layers"], "config": config}  # fmt: skip


def is_shape(model: str) -> bool:
    """A shortcut with an embedded config (and no such folder): random weights of its shape."""
    return model.lower() in harness.EMBEDDED_CONFIGS and not Path(model).exists()
