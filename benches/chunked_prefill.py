"""The fairness trade-off of chunked prefill: decode stalls against throughput.

One seeded request trace (random prompt token ids, a fixed output budget per request) is
served with several prefill budgets (`--prefill-steps`, prompt tokens per scheduler
iteration). The scheduler is the solution's own `batch_generate` (`--solution ref` or
`tiny_llm`), given the prompts as token ids, the budgets as `max_new_tokens` and
`ignore_eos=True` (random weights would stop at random places), so every budget does the same
work; the bench watches it only through `on_step` (tiny_llm_support.batch_recorder). Every
(budget, repeat) runs in a fresh process, after warm-up runs in that process; repeats alternate
forward and reverse budget order, so slow drift of a shared machine does not favour one budget.

Measured per run: output tokens/s, requests/s, wall time; the time of each decode step; the
decode gap, the wall time between two consecutive decode completions while at least one
request is decoding (prefill chunks in between count, stretches with no decoding request do
not); time to first token (every request arrives at time 0); prefill chunks. Each budget's row
is the median over its runs.

    pdm run bench-chunked-prefill --model tiny --prefill-steps 16 64 --num-seqs 4
    pdm run bench-chunked-prefill --model qwen3-0.6b --num-layers 4 --prefill-steps 32 128 512

Writes JSON (the trace itself and its SHA-256, host, MLX, BLAS, model, arguments, raw runs,
per-budget medians) and a PNG of p95 decode gap against output throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import common
import mlx.core as mx
from chunked_prefill_report import plot, summary_table
from trace_run import Trace, WrongOutput, make_trace, serve, serve_mlx_lm, warmup_trace

from tiny_llm_support import choose_device, mlx_lm_qwen3
from tiny_llm_support.batch_recorder import StepError
from tiny_llm_support.cli import SOLUTIONS, float_at_least, int_at_least, load_solution

SCHEMA = "tiny-llm/bench-chunked-prefill/v1"
POLICIES = ("alternate", "hybrid", "mlx-lm")  # batch_generate's policies, and mlx-lm's server

# The per-run numbers that are aggregated (median over runs) for each budget.
SCALAR_METRICS = (
    "output_tokens_per_s",
    "requests_per_s",
    "wall_s",
    "decode_step_ms_median",
    "decode_step_ms_p95",
    "decode_step_ms_max",
    "decode_gap_ms_median",
    "decode_gap_ms_p95",
    "decode_gap_ms_max",
    "ttft_ms_median",
    "ttft_ms_p95",
    "prefill_chunks",
    "decode_steps",
    "preemptions",
    "recomputed_tokens",
    "refused",
    "peak_pages",
)

DESCRIPTION = (  # what --help says first
    "Decode stalls against throughput for several chunked-prefill budgets. Each (budget, "
    "repeat) runs in a fresh process; repeats alternate forward and reverse budget order."
)


# --- one run: the settings and the child process ------------------------------------------


def batch_options(args: argparse.Namespace, setting: dict[str, Any]) -> dict[str, Any]:
    """The scheduler settings of one run, as batch_generate keywords. A new setting of the
    solution's scheduler joins here."""
    options = {"batch_size": args.batch_size, "prefill_step": setting["prefill_step"]}
    if setting["policy"] != "alternate":  # a solution before Week 3 Day 4 has no policy keyword
        options["policy"] = setting["policy"]
    return options


def make_pools(model: Any, args: argparse.Namespace, setting: dict[str, Any]) -> list | None:
    """Paged pools of --page-size pages (setting's max_pages, None: unbounded), or None for
    dense caches."""
    if not args.page_size:
        return None
    kwargs = {"read_in_place": True} if args.read_in_place else {}
    return model.create_kv_pools(args.page_size, setting["max_pages"], **kwargs)


def child_main(spec_path: str) -> int:
    """Load the model, warm up, serve the trace once, write the run's JSON."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    scheduler = f"{SOLUTIONS[args.solution]}.batch_generate: "
    with common.child_errors(args.solution, (StepError, WrongOutput), scheduler):
        result = measure_one(spec, args)
    common.write_json(spec["output"], result)
    return 0


def measure_one(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The run a spec describes: its result, with what it ran on."""
    t0 = time.perf_counter()
    device = choose_device(args.device)
    api = load_solution(args.solution)
    trace = Trace(**spec["trace"])
    if trace.sha256() != spec["trace_sha256"]:
        raise RuntimeError("the trace handed to this process does not match its SHA-256")
    warm = Trace(**spec["warmup_trace"])
    _, ckpt = common.load_weights(spec["model"], args.dtype)
    setting = spec["setting"]
    if setting["policy"] == "mlx-lm":
        model = mlx_lm_qwen3(ckpt)
        run = lambda t: serve_mlx_lm(model, t, args.batch_size, setting["prefill_step"])
        options, pools = {}, None
    else:
        seq_len = max(trace.max_seq_len, warm.max_seq_len)
        model = api.Qwen3Model(
            ckpt, max_seq_len=seq_len, **({"compiled": True} if args.compile else {})
        )
        options = batch_options(args, setting)
        pools = make_pools(model, args, setting)
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
    result.update(
        {
            **setting,
            "batch_generate": options,
            **common.planned_run(spec),
            "device": device,
            "blas": common.blas_info(),
            "peak_memory_bytes": mx.get_peak_memory(),
            "load_s": load_s,
            "warmup_s": warmup_s,
        }
    )
    return result


# --- the parent: plan, launch, aggregate, report -------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.bench_parser("bench-chunked-prefill", DESCRIPTION)
    common.add_model_arguments(p, "tiny")
    t = p.add_argument_group("trace and schedule")
    t.add_argument(
        "--prefill-steps",
        type=int_at_least(1),
        nargs="+",
        default=[32, 128, 512],
        metavar="N",
        help="prefill budgets to compare (prompt tokens per iteration)",
    )
    t.add_argument("--num-seqs", type=int_at_least(1), default=8, help="requests in the trace")
    t.add_argument("--batch-size", type=int_at_least(1), default=4, help="decode slots")
    t.add_argument("--min-input-len", type=int_at_least(1), default=64)
    t.add_argument("--max-input-len", type=int_at_least(1), default=512)
    t.add_argument("--min-output-len", type=int_at_least(1), default=32)
    t.add_argument("--max-output-len", type=int_at_least(1), default=32)
    t.add_argument("--seed", type=int_at_least(0), default=0, help="the trace (and random weights)")
    t.add_argument(
        "--policy",
        nargs="+",
        choices=POLICIES,
        default=["alternate"],
        help="schedulers to compare: batch_generate's policies (hybrid: Week 3 Day 4), and "
        "mlx-lm's BatchGenerator on the same weights (one prompt at a time, its "
        "prefill_step_size set to the budget)",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="Qwen3Model(compiled=True): compiled token-parallel halves, padded passes (Week 3 Day 3)",
    )
    t.add_argument(
        "--page-size", type=int_at_least(0), default=0, help="0: dense caches; N: N-token pages"
    )
    t.add_argument(
        "--pool-fractions",
        type=float_at_least(0.01),
        nargs="+",
        default=None,
        metavar="F",
        help="with --page-size: pool sizes as fractions of the pages the trace holds at its "
        "peak, measured first by a run with an unbounded pool (Week 3 Day 6)",
    )
    t.add_argument(
        "--read-in-place",
        action="store_true",
        help="paged pools read their pages in place (Week 3 Day 5)",
    )
    r = p.add_argument_group("runs and output")
    r.add_argument(
        "--warmup", type=int_at_least(0), default=1, help="warm-up runs per process, unmeasured"
    )
    common.add_repeats_argument(r, "budget", 2)
    r.add_argument(
        "--cooldown-seconds", type=float_at_least(0), default=0.0, help="pause between runs"
    )
    common.add_output_arguments(r, "chunked-prefill-<model>.json", plot=True)
    common.add_child_spec_argument(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> common.BenchModel:
    """Every check that needs no weights; errors exit through argparse before any run."""
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
    dupes = sorted({s for s in args.prefill_steps if args.prefill_steps.count(s) > 1})
    if dupes:
        p.error(f"--prefill-steps lists {', '.join(map(str, dupes))} more than once")
    model = common.bench_model_from_args(p, args)
    longest = args.max_input_len + args.max_output_len
    limit = int(model.config["max_position_embeddings"])
    if longest > limit:
        p.error(
            f"--max-input-len + --max-output-len = {longest} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    return model


def settings_of(policies, budgets, pool_sizes) -> list[dict[str, Any]]:
    """Every (policy, budget, pool size) to run, policies first in the order given."""
    return [
        {"policy": policy, "prefill_step": budget, "max_pages": pages}
        for policy in policies
        for pages in pool_sizes
        for budget in budgets
    ]


def aggregate(runs: list[dict[str, Any]], settings: Sequence[dict]) -> list[dict[str, Any]]:
    """Per setting: the median, min and max over its runs of every scalar metric."""
    rows = []
    for setting in settings:
        mine = [run["metrics"] for run in runs if all(run[k] == v for k, v in setting.items())]
        row: dict[str, Any] = {**setting, "runs": len(mine)}
        for stat, fn in (
            ("median", common.median),
            ("min", common.least),
            ("max", common.greatest),
        ):
            row[stat] = {k: fn(m.get(k) for m in mine) for k in SCALAR_METRICS}
        rows.append(row)
    return rows


def default_json_path(model: common.BenchModel) -> Path:
    slug = common.model_slug(model)
    if model.num_layers != model.original_num_layers:
        slug += f"-{model.num_layers}l"
    if model.random_weights and model.source != "tiny":
        slug += "-random"
    return common.RESULTS / f"chunked-prefill-{slug}.json"


def run_benchmark(args: argparse.Namespace, model: common.BenchModel) -> dict[str, Any]:
    """Launch one child process per (budget, repeat), then assemble the report."""
    started = time.time()
    trace = make_trace(
        args.seed,
        args.num_seqs,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        model.token_ids,
        model.excluded_ids,
    )
    warm = warmup_trace(args, model)
    sha = trace.sha256()
    env, preloaded = common.runs_environment(args.no_openblas)
    settings = settings_of(args.policy, args.prefill_steps, [None])
    plan = common.plan_runs(settings, args.repeats)
    common.log_model(model, args)
    common.log(
        f"trace seed {args.seed}: {args.num_seqs} requests, {trace.prompt_tokens} prompt tokens, "
        f"{trace.output_tokens} output tokens, sha256 {sha[:16]}..."
    )
    common.log_runs_blas(preloaded)
    common.log(
        f"{len(plan)} runs: policies {args.policy} x budgets {args.prefill_steps} x "
        f"{args.repeats} repeats, "
        f"{args.warmup} warm-up run(s) each"
    )

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-chunked-prefill-") as tmp:
        common.write_random_weights(model, Path(tmp), args.dtype)
        shared = {
            "args": common.arguments_json(args, leave_out=("child_spec",)),
            "model": model.to_dict(),
            "trace": trace.to_dict(),
            "trace_sha256": sha,
            "warmup_trace": warm.to_dict(),
        }
        launch = lambda n, setting, repeat, order: run_child(
            Path(tmp), n, len(plan), env, {**shared, "setting": setting, "repeat": repeat, "order": order}
        )  # fmt: skip
        peak = None
        if args.pool_fractions:  # how many pages the trace holds at its peak, pool unbounded
            probe = {
                "policy": args.policy[0],
                "prefill_step": args.prefill_steps[0],
                "max_pages": None,
            }
            peak = launch(-1, probe, 0, "probe")["metrics"]["peak_pages"]
            sizes = [max(1, math.ceil(f * peak)) for f in args.pool_fractions]
            common.log(f"the trace holds {peak} pages at its peak: pools of {sizes} pages")
            settings = settings_of(args.policy, args.prefill_steps, sizes)
            plan = common.plan_runs(settings, args.repeats)
        for k, (repeat, order, setting) in enumerate(plan):
            if k and args.cooldown_seconds:
                time.sleep(args.cooldown_seconds)
            runs.append(launch(k, setting, repeat, order))
        model_description = model.describe()

    return {
        **common.report_start(
            SCHEMA, started, common.arguments_json(args, leave_out=("child_spec",))
        ),
        **common.runs_settings(args, runs),
        "blas": {
            "parent": common.blas_info(),
            "runs": sorted({run["blas"]["blas"] for run in runs}),
            "preloaded_by_bench": preloaded,
            "ld_preload": env.get("LD_PRELOAD"),  # what the runs were started with
        },
        "environment": common.environment(
            ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD")
        ),
        "model": model_description,
        "trace": {
            "seed": args.seed,
            "sha256": sha,
            "num_requests": len(trace.prompts),
            "prompt_lengths": [len(p) for p in trace.prompts],
            "output_budgets": trace.output_budgets,
            "prompt_tokens": trace.prompt_tokens,
            "output_tokens": trace.output_tokens,
            "prompts": trace.prompts,
        },
        "warmup_trace": {"sha256": warm.sha256(), **warm.to_dict()},
        "peak_pages_unbounded": peak,
        "plan": [{"repeat": r, "order": o, **setting} for r, o, setting in plan],
        "runs": runs,
        "budgets": aggregate(runs, settings),
    }


def run_child(
    tmp: Path, k: int, total: int, env: dict[str, str], spec: dict[str, Any]
) -> dict[str, Any]:
    """One run in a fresh process: its result, with the time the whole process took."""
    setting, repeat = spec["setting"], spec["repeat"]
    what = f"{setting['policy']} prefill step {setting['prefill_step']}" + (
        f" pool {setting['max_pages']}" if setting["max_pages"] else ""
    )
    run = common.run_fresh(
        Path(__file__).resolve(), tmp, k, total, env, spec, f"{what}, repeat {repeat + 1}"
    )
    mt = run["metrics"]
    gap = _ms(mt["decode_gap_ms_p95"])
    common.log(
        f"[{k + 1}/{total}] {what}  repeat {repeat + 1} ({spec['order']})  "
        f"{run['process_s']:6.1f} s in process, run {mt['wall_s']:6.2f} s  "
        f"{mt['output_tokens_per_s']:7.2f} tok/s  p95 gap {gap}  blas {run['blas']['blas']}"
    )
    return run


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:7.1f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_args_or_run(parser, argv, child_main)
    model = check_args(parser, args)
    common.set_output_paths(parser, args, default_json_path(model))
    report = run_benchmark(args, model)
    common.write_report(args, report, summary_table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))
