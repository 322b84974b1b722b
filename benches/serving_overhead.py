"""4.3: what the server adds around the engine, and what the engine's bookkeeping costs.

One greedy workload (the demo's chat prompts, all at once), each run in a fresh process, two ways
in turn: "engine", the reference Engine stepped in a loop, each step timed in two parts (the
scheduler's iteration: the forward passes; collecting the new text: detokenizing, stop strings,
outputs); "server", serve.py with every prompt streamed at once by `openai` clients. Reported:
tokens/s, time to first token, the step's parts, and the server's tokens/s over the engine's.

    pdm run bench-serving-overhead [--model tiny] [--prompts 8] [--max-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benches import harness
from tiny_llm_support.cli import int_at_least

NO_OPENBLAS = True  # the tiny model: python -m benches runs it on the bundled BLAS
MODES = ("engine", "server")
JSON_NAME = "serving-overhead-<model>-linux-2cpu.json"


def chat_prompts(n: int) -> list[list[dict]]:
    """n chat conversations of one user message: the demo's prompts, cycled."""
    from tiny_llm_support.demo_prompts import DEMO_PROMPTS

    chosen = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(n)]
    return [[{"role": "user", "content": p.content()}] for p in chosen]


def timed(owner, name: str, times: list[float] | None = None, per_call=True) -> list[float]:
    """Wrap owner.<name> to record its times: one entry per call, or (per_call False) added to the
    last entry of `times` (a new list unless given). The list of times."""
    real, times = getattr(owner, name), [] if times is None else times

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = real(*args, **kwargs)
        if per_call:
            times.append(time.perf_counter() - start)
        else:
            times[-1] += time.perf_counter() - start
        return out

    setattr(owner, name, wrapper)
    return times


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in its own process: the engine alone, or the server and its clients."""
    if spec["mode"] == "server":
        return run_server(spec)
    import tiny_llm_ref as ref
    from tiny_llm_support import load_checkpoint
    from tiny_llm_support.cli import model_path

    ckpt = load_checkpoint(model_path(spec["model"]))
    tokenizer = ckpt.tokenizer
    engine = ref.Engine(ref.Qwen3Model(ckpt), tokenizer, max_seq_len=1024,
                        batch_size=spec["batch_size"])  # fmt: skip
    prompts = [tokenizer.apply_chat_template(m) for m in chat_prompts(spec["prompts"])]
    engine.add_request(prompts[0], ref.SamplingParams(max_tokens=2))  # warm-up: MLX's set-up
    while engine.has_work:
        engine.step()
    iterate_s, collect_s = timed(engine, "iterate"), timed(engine, "collect", per_call=False)
    params = ref.SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    start, first, tokens = time.perf_counter(), {}, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_work:
        collect_s.append(0.0)  # this step's collection, added up over its calls
        for out in engine.step():
            tokens += len(out.token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    wall = time.perf_counter() - start
    return {"mode": "engine", "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_ms": harness.summarize(list(first.values()), 1000),
            "iterate_ms": harness.summarize(iterate_s, 1000),
            "collect_ms": harness.summarize(collect_s, 1000),
            "collect_share": sum(collect_s) / (sum(collect_s) + sum(iterate_s))}  # fmt: skip


def run_server(spec: dict[str, Any]) -> dict[str, Any]:
    import openai

    log_path = Path(spec["output"]).with_suffix(".serve.log")
    flags = {"model": spec["model"], "batch_size": spec["batch_size"], "max_seq_len": 1024}
    with harness.serve(log_path, **flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = chat_prompts(spec["prompts"])
        stream(client, messages[0], 2, spec["model"])  # warm-up, as for the engine
        start = time.perf_counter()
        ask = lambda m: stream(client, m, spec["max_tokens"], spec["model"], start)
        results = harness.at_once(ask, messages)  # (time to first text, tokens) of each
        wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"mode": "server", "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_ms": harness.summarize([f for f, _ in results if f is not None], 1000)}  # fmt: skip


def stream(client, messages, max_tokens: int, model: str, start: float = 0.0) -> tuple:
    """(time from `start` to the first text, tokens) of one streamed chat completion."""
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


def main(argv=None) -> int:
    p = harness.served_bench_parser("bench-serving-overhead", __doc__, repeats_of="mode")
    p.add_argument("--prompts", type=int_at_least(1), default=8, help="requests, all at once")
    p.add_argument("--max-tokens", type=int_at_least(1), default=48, help="tokens per request")
    p.add_argument("--batch-size", type=int_at_least(1), default=4, help="decode slots")
    harness.add_output_arguments(p, JSON_NAME)
    args = p.parse_args(argv)
    harness.check_served_args(p, args, JSON_NAME)
    started, settings = time.time(), harness.arguments_json(args, ("json_output",))
    specs = [{"mode": m, "repeat": r, **settings} for r in range(args.repeats) for m in MODES]
    label = lambda spec: f"{spec['mode']}, repeat {spec['repeat'] + 1}"
    with tempfile.TemporaryDirectory(prefix="bench-serving-overhead-") as tmp:
        runs = harness.run_plan(__name__, specs, Path(tmp), dict(os.environ), label, run_line)
    report = harness.report("serving-overhead", started, settings, runs, summarize(runs))
    harness.write_report(args, report, summary_table)
    return 0


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, the medians over its runs; and the server's tokens/s over the engine's."""
    median = lambda mode, key, part=None: harness.median(
        r[key] if part is None else r[key][part] for r in runs if r["mode"] == mode
    )
    summary = {mode: {"tokens_per_s": median(mode, "tokens_per_s"),
                      "ttft_ms_median": median(mode, "ttft_ms", "median")} for mode in MODES}  # fmt: skip
    summary["engine"] |= {"collect_share": median("engine", "collect_share"),
                          "collect_ms_median": median("engine", "collect_ms", "median"),
                          "iterate_ms_median": median("engine", "iterate_ms", "median")}  # fmt: skip
    summary["server_over_engine"] = (
        summary["server"]["tokens_per_s"] / summary["engine"]["tokens_per_s"]
    )
    return summary


def run_line(run: dict[str, Any]) -> str:
    ttft = run["ttft_ms"]["median"]
    return f"{run['mode']}: {run['tokens_per_s']:.1f} tok/s, TTFT p50 {ttft:.1f} ms"


def summary_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    rows = [[mode, f"{s[mode]['tokens_per_s']:.1f}", f"{s[mode]['ttft_ms_median']:.1f}"]
            for mode in MODES]  # fmt: skip
    return (
        harness.table(["mode", "tok/s", "TTFT p50 (ms)"], rows)
        + f"\nserver / engine: {s['server_over_engine']:.2f}; collection is "
        f"{s['engine']['collect_share']:.1%} of an engine step"
    )
