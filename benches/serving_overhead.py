"""4.3: what the server adds around the engine, and what the engine's bookkeeping costs.

The same greedy workload (chat prompts of the demo, all arriving at once) runs two ways,
alternately, each in a fresh process:

- engine: the reference Engine stepped in a loop in one process; each step is timed in two
  parts, the scheduler iteration (the forward passes) and the collection of every request's
  new text (detokenizing, stop strings, outputs);
- server: `serve.py` on a free loopback port, every prompt sent at once as a stream by the
  official openai client, one thread per request.

Reported: tokens/s, time to first token, time per step and the share of the step spent in
collection; and the server's tokens/s as a fraction of the engine's.

    pdm run bench-serving-overhead [--model tiny] [--prompts 8] [--max-tokens 48] [--repeats 3]

Writes benches/results/serving-overhead-<model>-linux-2cpu.json (or --json-output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
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
    log,
    median,
    mlx_info,
    summarize,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
SERVING = re.compile(r"serving '.*' at http://127\.0\.0\.1:(\d+)/v1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="tiny", help="tiny (the shipped chat model) or a path")
    p.add_argument("--prompts", type=int, default=8, help="requests, all sent at once")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    p.add_argument("--batch-size", type=int, default=4, help="decode slots")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating")
    add_output_arguments(p, "serving-overhead-<model>-linux-2cpu.json")
    p.add_argument("--run", choices=["engine"], help=argparse.SUPPRESS)  # one engine run
    args = p.parse_args(argv)
    for name in ("prompts", "max_tokens", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    check_checkpoint_arg(p, args.model)
    if args.json_output is None:
        name = Path(args.model).name
        args.json_output = RESULTS / f"serving-overhead-{name}-linux-2cpu.json"
    check_outputs(p, args.json_output)
    return args


def chat_prompts(tokenizer, n: int) -> list[list[dict]]:
    from tiny_llm_support.demo_prompts import DEMO_PROMPTS

    chosen = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(n)]
    return [[{"role": "user", "content": p.content()}] for p in chosen]


# --- the engine alone, in this process ----------------------------------------------------------


def run_engine(args: argparse.Namespace) -> dict:
    import tiny_llm_ref as ref
    from tiny_llm_support import load_checkpoint
    from tiny_llm_support.cli import model_path

    ckpt = load_checkpoint(model_path(args.model))
    model, tokenizer = ref.Qwen3Model(ckpt), ckpt.tokenizer
    prompts = [tokenizer.apply_chat_template(m) for m in chat_prompts(tokenizer, args.prompts)]
    params = ref.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine = ref.Engine(model, tokenizer, max_seq_len=1024, batch_size=args.batch_size)
    warm_up(engine, ref, prompts[0])
    iterate_s, collect_s = [], []
    timed(engine, "iterate", iterate_s)
    timed(engine, "collect", collect_s, per_call=False)
    start, first, tokens = time.perf_counter(), {}, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_work:
        collect_s.append(0.0)
        for out in engine.step():
            tokens += len(out.token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    wall = time.perf_counter() - start
    return {
        "mode": "engine",
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_ms": summarize(list(first.values()), 1000),
        "iterate_ms": summarize(iterate_s, 1000),
        "collect_ms": summarize(collect_s, 1000),
        "collect_share": sum(collect_s) / (sum(collect_s) + sum(iterate_s)),
    }


def warm_up(engine, ref, prompt) -> None:
    """One short request first: the first forward pass pays for MLX's one-time set-up."""
    engine.add_request(prompt, ref.SamplingParams(max_tokens=2))
    while engine.has_work:
        engine.step()


def timed(engine, name: str, times: list[float], per_call: bool = True) -> None:
    """Wrap engine.<name> to record its time: one entry per call, or (per_call False) added to
    the entry of the current step."""
    real = getattr(engine, name)

    def wrapper(*args):
        t0 = time.perf_counter()
        out = real(*args)
        if per_call:
            times.append(time.perf_counter() - t0)
        else:
            times[-1] += time.perf_counter() - t0
        return out

    setattr(engine, name, wrapper)


# --- the server, driven by the openai client -------------------------------------------------------


def run_server(args: argparse.Namespace, workdir: Path) -> dict:
    import openai

    from tiny_llm_support import load_checkpoint
    from tiny_llm_support.cli import model_path

    tokenizer = load_checkpoint(model_path(args.model)).tokenizer
    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--max-seq-len", "1024"]
    with serve_running(flags, workdir) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        messages = chat_prompts(tokenizer, args.prompts)
        stream(client, messages[0], 2, args.model)  # warm-up, as for the engine
        return measure_streams(client, messages, args)


@contextlib.contextmanager
def serve_running(flags: list[str], workdir: Path, root: Path = ROOT, **env: str) -> Iterator[int]:
    """serve.py of the checkout `root` on a free loopback port with `flags` (and `env` added to
    the environment), its output in workdir: its port, and the server stopped afterwards."""
    out = workdir / "serve.out"
    with open(out, "w") as stdout, open(workdir / "serve.err", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(root / "serve.py"), "--port", "0", *flags],
            cwd=root,
            env={**os.environ, **env},
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # stopped by this process, in `finally` below
        )
    try:
        yield wait_for_port(proc, out)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_port(proc, out: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = SERVING.search(out.read_text())
        if found:
            time.sleep(0.5)  # uvicorn binds right after the line
            return int(found[1])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    errors = (out.parent / "serve.err").read_text().strip().splitlines() or ["(no output)"]
    raise SystemExit(f"error: serve.py did not start: {errors[-1]}")


def stream(client, messages, max_tokens: int, model: str, start: float = 0.0) -> tuple:
    """(time to the first text, tokens) of one streamed chat completion."""
    first, tokens = None, 0
    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first, tokens


def measure_streams(client, messages, args) -> dict:
    results = [None] * len(messages)
    start = time.perf_counter()

    def one(i):
        results[i] = stream(client, messages[i], args.max_tokens, args.model, start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {
        "mode": "server",
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_ms": summarize([f for f, _ in results if f is not None], 1000),
    }


# --- the whole comparison ------------------------------------------------------------------------


def engine_in_fresh_process(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--run", "engine", "--model", args.model]
    cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    cmd += ["--batch-size", str(args.batch_size)]
    # a session of its own: Ctrl-C reaches this process alone, which stops the run
    done = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: the engine run failed (exit status {done.returncode}): {last}")
    return json.loads(done.stdout)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run == "engine":
        print(json.dumps(run_engine(args)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in ("engine", "server"):
                log(f"repeat {repeat + 1}/{args.repeats}: {mode}")
                run = engine_in_fresh_process(args) if mode == "engine" else None
                run = run or run_server(args, Path(tmp))
                runs.append({"repeat": repeat, **run})
    summary = {
        mode: {
            "tokens_per_s": median(r["tokens_per_s"] for r in runs if r["mode"] == mode),
            "ttft_ms_median": median(r["ttft_ms"]["median"] for r in runs if r["mode"] == mode),
        }
        for mode in ("engine", "server")
    }
    engine_runs = [r for r in runs if r["mode"] == "engine"]
    summary["engine"]["collect_share"] = median(r["collect_share"] for r in engine_runs)
    summary["engine"]["collect_ms_median"] = median(r["collect_ms"]["median"] for r in engine_runs)
    summary["engine"]["iterate_ms_median"] = median(r["iterate_ms"]["median"] for r in engine_runs)
    summary["server_over_engine"] = (
        summary["server"]["tokens_per_s"] / summary["engine"]["tokens_per_s"]
    )
    settings = {k: getattr(args, k) for k in ("model", "prompts", "max_tokens", "batch_size")}
    report = {"host": host_info(), "mlx": mlx_info(), "settings": settings, "runs": runs}
    report["summary"] = summary
    write_json(args.json_output, report)
    for mode in ("engine", "server"):
        s = summary[mode]
        print(f"{mode:7s} {s['tokens_per_s']:8.1f} tok/s  TTFT p50 {s['ttft_ms_median']:7.1f} ms")
    print(f"server / engine: {summary['server_over_engine']:.2f}; collection is "
          f"{summary['engine']['collect_share']:.1%} of an engine step")  # fmt: skip
    print(f"wrote {args.json_output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TINY_LLM_NO_OPENBLAS", "1")  # the tiny model needs no fast BLAS
    sys.exit(startup.run(main))
