"""Week 3 Day 2: decode stalls against throughput, for several chunked-prefill budgets.

One seeded trace (random prompt ids, an output budget per request) is served once per setting:
a prefill budget (--prefill-steps), a scheduler (--policy) and, with --pool-fractions, a page
pool sized from the pages an unbounded run held at its peak (Week 3 Day 6). Every (setting,
repeat) runs in a fresh process after --warmup unmeasured runs.

    pdm run bench-chunked-prefill --model qwen3-0.6b --num-layers 4 --prefill-steps 32 128 512
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness
from benches.trace_run import Trace, WrongOutput, make_trace, serve, serve_mlx_lm
from tiny_llm_support import choose_device, mlx_lm_qwen3
from tiny_llm_support.batch_recorder import StepError
from tiny_llm_support.cli import SOLUTIONS, float_at_least, int_at_least, load_solution

POLICIES = ("alternate", "hybrid", "mlx-lm")  # batch_generate's policies, and mlx-lm's server
RUN_ERRORS = (StepError, WrongOutput)  # a scheduler that broke batch_generate's promises
WARMUP_OUTPUT_BUDGET = 4
# The per-run numbers that are aggregated (median, min, max over runs) for each setting.
SCALAR_METRICS = (
    "output_tokens_per_s", "requests_per_s", "wall_s", "decode_step_ms_median",
    "decode_step_ms_p95", "decode_step_ms_max", "decode_gap_ms_median", "decode_gap_ms_p95",
    "decode_gap_ms_max", "ttft_ms_median", "ttft_ms_p95", "prefill_chunks", "decode_steps",
    "preemptions", "recomputed_tokens", "refused", "peak_pages",
)  # fmt: skip
COLUMNS = {  # the table's medians: head -> (metric, format)
    "tok/s": ("output_tokens_per_s", ".2f"), "req/s": ("requests_per_s", ".3f"),
    "wall s": ("wall_s", ".2f"), "step p50": ("decode_step_ms_median", ".1f"),
    "gap p50": ("decode_gap_ms_median", ".1f"), "gap p95": ("decode_gap_ms_p95", ".1f"),
    "gap max": ("decode_gap_ms_max", ".1f"), "ttft p50": ("ttft_ms_median", ".1f"),
    "chunks": ("prefill_chunks", ".0f"), "refused": ("refused", ".0f"),
    "preempt": ("preemptions", ".0f"),
}  # fmt: skip


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In a run's own process: load the model, warm up, serve the trace once."""
    args, setting = argparse.Namespace(**spec["args"]), spec["setting"]
    t0 = time.perf_counter()
    device = choose_device(args.device)
    trace, warm = Trace(**spec["trace"]), Trace(**spec["warmup_trace"])
    _, ckpt = harness.load_weights(spec["model"], args.dtype)
    options, pools = {}, None  # pools None: dense caches
    if setting["policy"] == "mlx-lm":
        model = mlx_lm_qwen3(ckpt)
        run = lambda t: serve_mlx_lm(model, t, args.batch_size, setting["prefill_step"])
    else:
        api = load_solution(args.solution)
        compiled = {"compiled": True} if args.compile else {}
        seq_len = max(trace.max_seq_len, warm.max_seq_len)
        model = api.Qwen3Model(ckpt, max_seq_len=seq_len, **compiled)
        options = {"batch_size": args.batch_size, "prefill_step": setting["prefill_step"]}
        if setting["policy"] != "alternate":  # a solution before Week 3 Day 4 has no policy
            options["policy"] = setting["policy"]
        if args.page_size:  # max_pages None: an unbounded pool
            in_place = {"read_in_place": True} if args.read_in_place else {}
            pools = model.create_kv_pools(args.page_size, setting["max_pages"], **in_place)
        run = lambda t: serve(api, model, t, options, pools=pools)
    load_s = time.perf_counter() - t0
    warmup_s = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        run(warm)
        warmup_s.append(time.perf_counter() - t)
    mx.reset_peak_memory()
    if pools is not None:
        pools[0].peak_in_use = pools[0].num_in_use  # count the measured run's peak only
    result = run(trace)
    result["metrics"]["peak_pages"] = pools[0].peak_in_use if pools is not None else None
    return {
        **result, **setting, "batch_generate": options, "device": device,
        "blas": harness.process_blas(), "peak_memory_bytes": mx.get_peak_memory(),
        "load_s": load_s, "warmup_s": warmup_s,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = harness.bench_parser(
        "bench-chunked-prefill",
        "Decode stalls against throughput for several chunked-prefill budgets. Each (budget, "
        "repeat) runs in a fresh process; repeats alternate forward and reverse budget order.",
    )
    harness.add_model_arguments(p, "tiny")
    t = p.add_argument_group("trace and schedule")
    # fmt: off
    t.add_argument("--prefill-steps", type=int_at_least(1), nargs="+", default=[32, 128, 512],
                   metavar="N", help="prefill budgets to compare (prompt tokens per iteration)")
    t.add_argument("--num-seqs", type=int_at_least(1), default=8, help="requests in the trace")
    t.add_argument("--batch-size", type=int_at_least(1), default=4, help="decode slots")
    for name, default in (("min-input", 64), ("max-input", 512), ("min-output", 32),
                          ("max-output", 32)):
        t.add_argument(f"--{name}-len", type=int_at_least(1), default=default)
    t.add_argument("--seed", type=int_at_least(0), default=0, help="the trace (and random weights)")
    t.add_argument("--policy", nargs="+", choices=POLICIES, default=["alternate"],
                   help="schedulers to compare: batch_generate's policies (hybrid: Week 3 Day 4), "
                   "and mlx-lm's BatchGenerator on the same weights (one prompt at a time, its "
                   "prefill_step_size set to the budget)")
    t.add_argument("--compile", action="store_true", help="Qwen3Model(compiled=True): compiled "
                   "token-parallel halves, padded passes (Week 3 Day 3)")
    t.add_argument("--page-size", type=int_at_least(0), default=0,
                   help="0: dense caches; N: N-token pages")
    t.add_argument("--pool-fractions", type=float_at_least(0.01), nargs="+", metavar="F",
                   help="with --page-size: pool sizes as fractions of the pages the trace holds "
                   "at its peak, measured first by a run with an unbounded pool (Week 3 Day 6)")
    t.add_argument("--read-in-place", action="store_true",
                   help="paged pools read their pages in place (Week 3 Day 5)")
    r = p.add_argument_group("runs and output")
    r.add_argument("--warmup", type=int_at_least(0), default=1,
                   help="warm-up runs per process, unmeasured")
    r.add_argument("--cooldown-seconds", type=float_at_least(0), default=0.0,
                   help="pause between runs")
    # fmt: on
    harness.add_repeats_argument(r, "budget", 2)
    harness.add_output_arguments(r, "chunked-prefill-<model>.json", plot=True)
    args = p.parse_args(argv)
    model = check_args(p, args)
    slug = harness.model_slug(model)
    if model.num_layers != model.original_num_layers:
        slug += f"-{model.num_layers}l"
    if model.random_weights and model.source != "tiny":
        slug += "-random"
    harness.set_output_paths(p, args, harness.RESULTS / f"chunked-prefill-{slug}.json")
    harness.write_report(args, run_benchmark(args, model), summary_table, plot)
    return 0


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> harness.BenchModel:
    """Every check that needs no weights, before any run."""
    if args.min_input_len > args.max_input_len:
        p.error(f"--min-input-len {args.min_input_len} > --max-input-len {args.max_input_len}")
    if args.min_output_len > args.max_output_len:
        p.error(f"--min-output-len {args.min_output_len} > --max-output-len {args.max_output_len}")
    if args.pool_fractions and not args.page_size:
        p.error("--pool-fractions needs --page-size")
    if "mlx-lm" in args.policy and (args.page_size or args.compile or args.solution != "ref"):
        p.error(
            "the mlx-lm policy runs mlx-lm's own server: no --page-size, --compile, or tiny_llm"
        )
    if dupes := sorted({s for s in args.prefill_steps if args.prefill_steps.count(s) > 1}):
        p.error(f"--prefill-steps lists {', '.join(map(str, dupes))} more than once")
    model = harness.bench_model_from_args(p, args)
    longest = args.max_input_len + args.max_output_len
    if longest > (limit := int(model.config["max_position_embeddings"])):
        p.error(
            f"--max-input-len + --max-output-len = {longest} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    return model


def warmup_trace(args: argparse.Namespace, model: harness.BenchModel) -> Trace:
    """A short trace from another seed: one longest prompt (so that the largest chunks and
    caches are allocated once), the rest of a batch at the shortest length, few output tokens."""
    n, ids = min(args.num_seqs, args.batch_size), (model.token_ids, model.excluded_ids)
    budget, seed = (min(args.max_output_len, WARMUP_OUTPUT_BUDGET),) * 2, args.seed + 1_000_003
    longest = make_trace(seed, 1, (args.max_input_len,) * 2, budget, *ids)
    rest = make_trace(seed + 1, n - 1, (args.min_input_len,) * 2, budget, *ids)
    return Trace(longest.prompts + rest.prompts, longest.output_budgets + rest.output_budgets)


def setting_name(setting: dict[str, Any]) -> str:
    pool = f" pool {setting['max_pages']}" if setting["max_pages"] else ""
    return f"{setting['policy']} prefill step {setting['prefill_step']}{pool}"


def run_line(run: dict[str, Any]) -> str:
    """What one run measured, for the progress lines."""
    m, gap = run["metrics"], harness.number(run["metrics"]["decode_gap_ms_p95"], ".1f")
    return (
        f"{setting_name(run)}: {run['process_s']:.1f} s in process, run {m['wall_s']:.2f} s, "
        f"{m['output_tokens_per_s']:.2f} tok/s, p95 gap {gap} ms"
    )


def run_benchmark(args: argparse.Namespace, model: harness.BenchModel) -> dict[str, Any]:
    """A fresh process per (setting, repeat), after a probe of the trace's peak pages if asked."""
    started = time.time()
    trace = make_trace(
        args.seed, args.num_seqs, (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len), model.token_ids, model.excluded_ids,
    )  # fmt: skip
    warm = warmup_trace(args, model)
    env, preloaded = harness.runs_environment(args.no_openblas)
    core = harness.runs_openblas_core(env, preloaded)
    harness.log_model(model, args)
    harness.log(
        f"trace seed {args.seed}: {args.num_seqs} requests, {trace.prompt_tokens} prompt tokens, "
        f"{trace.output_tokens} output tokens, sha256 {trace.sha256()[:16]}..."
    )
    harness.log_runs_blas(preloaded, core)
    with tempfile.TemporaryDirectory(prefix="bench-chunked-prefill-") as tmp:
        harness.write_random_weights(model, Path(tmp), args.dtype)
        shared = {"args": harness.arguments_json(args), "solution": args.solution,
                  "model": model.to_dict(), "trace": trace.to_dict(),
                  "warmup_trace": warm.to_dict()}  # fmt: skip

        def launch(plan: list[tuple[int, str, dict]]) -> list[dict[str, Any]]:
            specs = [{**shared, "setting": s, "repeat": r, "order": o} for r, o, s in plan]
            label = lambda spec: f"{setting_name(spec['setting'])}, repeat {spec['repeat'] + 1}"
            return harness.run_plan(__name__, specs, Path(tmp), env, label, run_line,
                                    args.cooldown_seconds)  # fmt: skip

        peak, pools = None, [None]  # max_pages None: an unbounded pool, or dense caches
        if args.pool_fractions:
            probe = {"policy": args.policy[0], "prefill_step": args.prefill_steps[0]}
            peak = launch([(0, "probe", {**probe, "max_pages": None})])[0]["metrics"]["peak_pages"]
            pools = [max(1, math.ceil(f * peak)) for f in args.pool_fractions]
            harness.log(f"the trace holds {peak} pages at its peak: pools of {pools} pages")
        settings = [
            {"policy": policy, "prefill_step": step, "max_pages": pages}
            for policy in args.policy for pages in pools for step in args.prefill_steps
        ]  # fmt: skip
        plan = harness.plan_runs(settings, args.repeats)
        harness.log(f"{len(plan)} runs, {args.warmup} warm-up run(s) each")
        runs = launch(plan)
    summary = {"peak_pages_unbounded": peak, "budgets": aggregate(runs, settings)}
    report_settings = {
        "arguments": harness.arguments_json(args), "device": runs[0]["device"],
        "dtype": args.dtype, "solution": SOLUTIONS[args.solution], "model": model.describe(),
        "trace": {
            "seed": args.seed, "sha256": trace.sha256(), "num_requests": len(trace.prompts),
            "prompt_lengths": [len(p) for p in trace.prompts],
            "output_budgets": trace.output_budgets, "prompt_tokens": trace.prompt_tokens,
            "output_tokens": trace.output_tokens, "prompts": trace.prompts,
        },
        "warmup_trace": {"sha256": warm.sha256(), **warm.to_dict()},
        "plan": [{"repeat": r, "order": o, **setting} for r, o, setting in plan],
    }  # fmt: skip
    blas = harness.runs_blas(runs, env, preloaded, core)
    return harness.report("chunked-prefill", started, report_settings, runs, summary, blas=blas)


def aggregate(runs: list[dict[str, Any]], settings: list[dict]) -> list[dict[str, Any]]:
    """Per setting: the median, min and max over its runs of every scalar metric."""
    stats = {"median": harness.median, "min": harness.least, "max": harness.greatest}
    rows = []
    for setting in settings:
        mine = [run["metrics"] for run in runs if all(run[k] == v for k, v in setting.items())]
        row: dict[str, Any] = {**setting, "runs": len(mine)}
        for stat, fn in stats.items():
            row[stat] = {k: fn(m.get(k) for m in mine) for k in SCALAR_METRICS}
        rows.append(row)
    return rows


def summary_table(report: dict[str, Any]) -> str:
    rows = [
        [row["policy"], str(row["max_pages"] or "-"), str(row["prefill_step"]), str(row["runs"]),
         *(harness.number(row["median"][metric], spec) for metric, spec in COLUMNS.values())]
        for row in report["summary"]["budgets"]
    ]  # fmt: skip
    return harness.table(["policy", "pool", "prefill", "runs", *COLUMNS], rows) + (
        "\n(times in ms, medians over runs; req/s counts served requests; refused: requests "
        "the page pool could never hold; preempt: requests sent back to the queue)"
    )


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """p95 decode gap against throughput, a line per scheduler and pool, a point per budget."""
    if (plt := harness.pyplot()) is None:
        return None
    series: dict[tuple, list[dict[str, Any]]] = {}
    unplotted = []  # a pool that refused every request has no point to draw: say so instead
    for row in report["summary"]["budgets"]:
        if row["median"]["decode_gap_ms_p95"] is None:
            refused = row["median"]["refused"]
            unplotted.append(f"{setting_name(row)}: no decode ({refused:.0f} requests refused)")
            harness.log(f"not plotted: {unplotted[-1]}")
        else:
            series.setdefault((row["policy"], row["max_pages"]), []).append(row)
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for (policy, pages), rows in series.items():
        xs, xerr = spread(rows, "output_tokens_per_s")
        ys, yerr = spread(rows, "decode_gap_ms_p95")
        label = policy + (f", pool {pages} pages" if pages else "")
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o-", capsize=3, label=label)
        for x, y, row in zip(xs, ys, rows):
            ax.annotate(point_label(row), (x, y), textcoords="offset points", xytext=(6, 6),
                        fontsize=8)  # fmt: skip
    if len(series) > 1:
        ax.legend(fontsize=8)
    settings, host = report["settings"], report["host"]
    model = settings["model"]
    ax.set(xlabel="output throughput (tokens/s)", ylabel="p95 decode gap (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{model['name']} ({model['num_layers']} layers, {settings['dtype']}), "
        f"{settings['trace']['num_requests']} requests, "
        f"batch {settings['arguments']['batch_size']}\n{host['machine']}, {host['cpu_count']} "
        f"CPUs, {', '.join(host['blas']['runs'])}, MLX {host['mlx']['version']}",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    if unplotted:
        fig.text(0.01, 0.01, "not plotted: " + "; ".join(unplotted), fontsize=7, wrap=True)
    return harness.save_figure(fig, path, rect=(0, 0.05 if unplotted else 0, 1, 1))


def spread(rows: list[dict[str, Any]], metric: str) -> tuple[list[float], list[list[float]]]:
    """The medians of `metric`, and how far below and above them the runs' min and max lie."""
    mid = [r["median"][metric] for r in rows]
    low = [m - r["min"][metric] for m, r in zip(mid, rows)]
    return mid, [low, [r["max"][metric] - m for m, r in zip(mid, rows)]]


def point_label(row: dict[str, Any]) -> str:
    """A point's budget, and its refused and preempted requests where there were any."""
    m = row["median"]
    counts = [f"{m[k]:.0f} {word}" for k, word in (("refused", "refused"),
              ("preemptions", "preempted")) if m[k]]  # fmt: skip
    return ", ".join([str(row["prefill_step"]), *counts])
