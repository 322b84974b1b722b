"""Week 3 Day 3, shape-stable prefill: five prompts of the seed's lengths, served twice over by a
compiled model (Qwen3Model(compiled=True), `cap` variants per CompileCache) under each padding
ladder of CONFIGS and by the eager model, each configuration in a fresh process: per forward pass
its rows, padded width, compiles and evictions; per prompt its latency, memory and greedy tokens
(which must be the eager model's). A last run times prefill and decode: eager, compiled, mlx-lm.

    pdm run bench-shape-stable --model qwen3-0.6b --num-layers 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness
from benches.model_impls import MlxLmImpl
from benches.trace_run import NoTextTokenizer, make_trace
from tiny_llm_support import choose_device
from tiny_llm_support.cli import default_dtype, int_at_least, load_solution

PROMPT_LENGTHS = (104, 146, 311, 37, 1137)  # the seed's widths; 1137 = 512 + 512 + 113
CONFIGS = {  # name: (ladder, compile cache capacity); ladder None: no padding
    "eager": ("eager", None),
    "no padding, cap 4": (None, 4),
    "8 steps, cap 4": ("steps-8", 4),
    "8 steps, cap 10": ("steps-8", 10),
    "3 steps, cap 4": ("steps-3", 4),
    "powers of two, cap 4": ("pow2", 4),
}


class WidthSpy:
    """The model, remembering how many rows its last call ran (padded rows included)."""

    def __init__(self, model):
        self.model, self.width = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, *args, **kwargs):  # tokens: [1, width]
        self.width = tokens.shape[1]
        return self.model(tokens, *args, **kwargs)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one configuration's passes and prompts, or the speeds."""
    args = argparse.Namespace(**spec["args"])
    choose_device(args.device)
    _, ckpt = harness.load_weights(spec["model"], args.dtype)
    api = load_solution(args.solution)
    if spec["config"] == "speeds":
        return time_speeds(api, ckpt, spec["prompts"][-1][: args.chunk_width], args)
    return serve_prompts(api, ckpt, spec["config"], spec["prompts"], args)


def serve_prompts(api, ckpt, config: str, prompts: list[list[int]], args) -> dict[str, Any]:
    """Every prompt through batch_generate, twice over: each pass and each prompt."""
    ladder, capacity = CONFIGS[config]
    if ladder in (None, "eager"):  # batch_generate's query_padding: never pad
        padding = False
    elif ladder == "pow2":  # the smallest power of two >= rows, capped at the chunk width
        padding = lambda rows, chunk_width: min(1 << (rows - 1).bit_length(), chunk_width)
    else:  # "steps-N"
        padding = partial(api.prefill_query_width, steps=int(ladder.split("-")[1]))
    compiled = {"compiled": True, "compile_capacity": capacity} if ladder != "eager" else {}
    model = WidthSpy(api.Qwen3Model(ckpt, **compiled))
    compile_stats = model.compile_stats if compiled else lambda: {"compiles": 0, "evictions": 0}
    passes, records, tokens, compiles = [], [], [], 0

    def on_step(step) -> None:
        nonlocal compiles
        if step.kind == "finish":
            tokens.append(list(step.request.generated))
        elif step.kind in ("prefill", "decode"):
            now = compile_stats()
            passes.append({
                "round": len(records) // len(prompts), "kind": step.kind, "rows": step.tokens,
                "width": model.width, "compiles": now["compiles"] - compiles,
                "evictions": now["evictions"],
            })  # fmt: skip
            compiles = now["compiles"]

    mx.reset_peak_memory()
    for round_ in range(2):
        for prompt in prompts:
            t = time.perf_counter()
            api.batch_generate(
                model, NoTextTokenizer(), [prompt], max_seq_len=model.max_seq_len, batch_size=1,
                prefill_step=args.chunk_width, max_new_tokens=args.new_tokens, ignore_eos=True,
                query_padding=padding, on_step=on_step,
            )  # fmt: skip
            records.append({
                "round": round_, "prompt_tokens": len(prompt),
                "latency_s": time.perf_counter() - t, "tokens": tokens[-1],
                "active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory(),
                "peak_bytes": mx.get_peak_memory(),
            })  # fmt: skip
    return {"config": config, "ladder": ladder, "capacity": capacity, "passes": passes,
            "prompts": records}  # fmt: skip


def time_speeds(api, ckpt, tokens: list[int], args) -> dict[str, Any]:
    """Prefill of one chunk-wide prompt, and decode steps after it: the eager model, the
    compiled one and mlx-lm, in alternating order after a first round that warms up."""
    prompt = mx.array([tokens])  # [1, L]
    seq_len = len(tokens) + args.decode_steps + 1

    def ours(model):
        def prefill():
            cache = model.create_kv_cache()
            mx.eval(model(prompt, 0, cache, logits_to_keep=1))
            return cache

        return prefill, lambda cache: mx.eval(model(prompt[:, -1:], cache[0].offset, cache))

    def theirs(impl: MlxLmImpl):
        def prefill():  # the last row through the head only, as logits_to_keep=1 does for ours
            logits, cache = impl.prefill(prompt)
            mx.eval(logits)
            return cache

        return prefill, lambda cache: mx.eval(impl.model(prompt[:, -1:], cache=cache))

    impls = {
        "eager": ours(api.Qwen3Model(ckpt, max_seq_len=seq_len)),
        "compiled": ours(api.Qwen3Model(ckpt, max_seq_len=seq_len, compiled=True)),
        "mlx-lm": theirs(MlxLmImpl(ckpt)),
    }
    times = {name: {"prefill_s": [], "decode_ms": []} for name in impls}
    for repeat, _, name in harness.plan_runs(list(impls), args.repeats + 1):
        prefill, decode = impls[name]
        t = time.perf_counter()
        cache = prefill()
        prefill_s, steps = time.perf_counter() - t, []
        for _ in range(args.decode_steps):
            t = time.perf_counter()
            decode(cache)
            steps.append((time.perf_counter() - t) * 1e3)
        if repeat:  # the first round warms up (and compiles)
            times[name]["prefill_s"].append(prefill_s)
            times[name]["decode_ms"] += steps
    return {"config": "speeds", "prompt_tokens": len(tokens), "decode_steps": args.decode_steps,
            "times": times}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = harness.bench_parser("bench-shape-stable", "Compiles, evictions and memory of a "
                             "compiled model under padding ladders.")  # fmt: skip
    harness.add_model_arguments(p, default_model="tiny")
    b = p.add_argument_group("the experiment")
    # fmt: off
    b.add_argument("--chunk-width", type=int_at_least(1), default=512, help="prefill chunk (W)")
    b.add_argument("--seed", type=int_at_least(0), default=0, help="random weights")
    b.add_argument("--new-tokens", type=int_at_least(1), default=8, help="decoded per prompt")
    b.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   metavar="NAME")
    b.add_argument("--decode-steps", type=int_at_least(1), default=16, help="timed decode steps")
    b.add_argument("--repeats", type=int_at_least(1), default=3, help="timed rounds of speeds")
    b.add_argument("--no-speeds", action="store_true", help="skip the speed comparison")
    # fmt: on
    harness.add_output_arguments(b, "shape-stable-<model>-<layers>l.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or default_dtype("cpu")  # float32 unless --dtype, whatever --device
    model = harness.bench_model_from_args(p, args)
    name = f"shape-stable-{harness.model_slug(model)}-{model.num_layers}l.json"
    harness.set_output_paths(p, args, harness.RESULTS / name)
    started = time.time()
    limit = int(model.config["max_position_embeddings"]) - 64
    lengths = [min(n, limit) for n in PROMPT_LENGTHS]
    ids = (model.token_ids, model.excluded_ids)
    prompts = [make_trace(i, 1, (n, n), (1, 1), *ids).prompts[0] for i, n in enumerate(lengths)]
    env, _ = harness.runs_environment(args.no_openblas)
    shared = {"args": harness.arguments_json(args), "solution": args.solution,
              "model": model.to_dict(), "prompts": prompts}  # fmt: skip
    configs = [*args.configs, *([] if args.no_speeds else ["speeds"])]
    with tempfile.TemporaryDirectory(prefix="bench-shape-stable-") as tmp:
        harness.write_random_weights(model, Path(tmp), args.dtype)
        specs = [{**shared, "config": config} for config in configs]
        line = lambda run: f"{run['config']}: {run['process_s']:.1f} s"
        runs = harness.run_plan(__name__, specs, Path(tmp), env, lambda s: s["config"], line)
    settings = {"arguments": harness.arguments_json(args), "model": model.describe(),
                "prompt_lengths": lengths}  # fmt: skip
    report = harness.report("shape-stable", started, settings, runs, summary_of(runs))
    harness.write_report(args, report, summary_table)
    return 0


def summary_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: prefill widths, compiles (all, on the second pass), evictions, latency
    per round, peak memory, whether it gave the eager model's tokens; the speeds' medians."""
    served = [run for run in runs if run["config"] != "speeds"]
    eager = next((run for run in served if run["ladder"] == "eager"), None)
    tokens = lambda run: [p["tokens"] for p in run["prompts"]]
    configs = {}
    for run in served:
        passes, prompts = run["passes"], run["prompts"]
        configs[run["config"]] = {
            "prefill_widths": sorted({p["width"] for p in passes if p["kind"] == "prefill"}),
            "compiles": sum(p["compiles"] for p in passes),
            "second_pass_compiles": sum(p["compiles"] for p in passes if p["round"] == 1),
            "evictions": passes[-1]["evictions"] if passes else 0,
            "latency_s_by_round": [
                sum(p["latency_s"] for p in prompts if p["round"] == r) for r in (0, 1)
            ],
            "peak_bytes": max(p["peak_bytes"] for p in prompts),
            "tokens_equal_eager": eager is not None and tokens(run) == tokens(eager),
        }
    timed = next((run for run in runs if run["config"] == "speeds"), None)
    if timed is None:
        return {"configs": configs, "speeds": None}
    median, length = harness.median, timed["prompt_tokens"]
    impls = {
        name: {"prefill_tokens_per_s": length / median(t["prefill_s"]),
               "prefill_s_median": median(t["prefill_s"]),
               "decode_ms_median": median(t["decode_ms"])}
        for name, t in timed["times"].items()
    }  # fmt: skip
    speeds = {"prompt_tokens": length, "decode_steps": timed["decode_steps"], "impls": impls}
    return {"configs": configs, "speeds": speeds}


def summary_table(report: dict[str, Any]) -> str:
    configs, speeds = report["summary"]["configs"], report["summary"]["speeds"]
    head = ["config", "prefill widths", "compiles", "2nd pass", "evictions", "latency s",
            "peak MiB", "eager's tokens"]  # fmt: skip
    rows = [
        [name, str(c["prefill_widths"]), str(c["compiles"]), str(c["second_pass_compiles"]),
         str(c["evictions"]), " / ".join(f"{s:.1f}" for s in c["latency_s_by_round"]),
         f"{c['peak_bytes'] / 2**20:.0f}", "yes" if c["tokens_equal_eager"] else "no"]
        for name, c in configs.items()
    ]  # fmt: skip
    text = harness.table(head, rows, "per configuration (latency: first / second round)")
    if speeds:
        head = ["model", "prefill tok/s", "prefill s", "decode ms/step"]
        rows = [
            [name, f"{s['prefill_tokens_per_s']:.0f}", f"{s['prefill_s_median']:.2f}",
             f"{s['decode_ms_median']:.1f}"]
            for name, s in speeds["impls"].items()
        ]  # fmt: skip
        title = f"speeds at a {speeds['prompt_tokens']}-token prompt (medians)"
        text += "\n" + harness.table(head, rows, title)
    return text
