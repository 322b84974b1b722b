"""Week 4 Day 4: what a prefix cache saves on an agent-like trace (chapter 4.4).

Each mode serves the committed trace (benches/traces/prefix-agent.json: conversations on a shared
system prompt, each turn sent whole the moment the previous answer is complete) in a fresh process
after a short warm-up: off (the Engine on paged pools), on (prefix_cache=True) and mlx-lm (its
LRUPromptCache, as mlx_lm.server serves). Per mode: prompt tokens prefilled and cached, TTFT of
the first and the later turns, peak pages, whether the ids equal cache-off's; the issue's targets.

    pdm run bench-prefix-cache [--conversations 2 --turns 2 --system-tokens 128]
    pdm run bench-prefix-cache --write-trace PATH [--seed N ...]    # make a trace, run nothing
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness, trace_run
from benches.prefix_cache_trace import AgentTrace, run_metrics, serve_engine, serve_mlx_lm
from tiny_llm_support import choose_device, mlx_lm_qwen3
from tiny_llm_support.cli import int_at_least, load_solution

MODES = ("off", "on", "mlx-lm")
DEFAULT_LAYERS = 8  # for a shortcut with an embedded config: "the 8-layer Qwen3-0.6B shape"
NEW_TRACE = {"conversations": 8, "turns": 4, "system_tokens": 1024, "max_tokens": 16}
WARMUP_TOKENS, WARMUP_SEED = 256, 1_000_003  # the warm-up's system prompt (at most), its ids
RUN_ERRORS = (trace_run.WrongOutput,)  # a run that generated the wrong number of tokens
TARGET_PREFILL_FRACTION = 0.20  # the issue: prompt tokens computed, on / off, at most
TARGET_TTFT_SPEEDUP = 5.0  # the issue: p50 TTFT of turns 2.., off / on, at least
TRACE_SCHEMA = "tiny-llm/prefix-trace/v1"
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "prefix-agent.json"
# The SHA-256 of the committed trace's bytes: a changed file is refused, so that results under
# one name always come from one trace. Update it together with the file (--write-trace).
DEFAULT_TRACE_SHA256 = "98be1060f03384c4282cb17c4fd3990c74aaf66327885ddc2bb2244908009bf6"
COLUMNS = {"prefilled": "prefill_tokens", "cached": "cached_tokens",
           "TTFT t1 p50": "ttft_turn1_ms_p50", "p95": "ttft_turn1_ms_p95",
           "TTFT t2+ p50": "ttft_later_ms_p50", "p95 ": "ttft_later_ms_p95", "wall s": "wall_s",
           "tok/s": "generated_tokens_per_s", "peak pages": "peak_pages"}  # fmt: skip


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In a run's own process: load, a warm-up (two short turns, ids of its own), the trace."""
    t0 = time.perf_counter()
    device = choose_device(spec["device"])
    trace = AgentTrace(**spec["trace"])
    bench_model, ckpt = harness.load_weights(spec["model"], spec["dtype"])
    n = min(WARMUP_TOKENS, len(trace.system))
    vocab = (bench_model.token_ids, bench_model.excluded_ids)
    ids = trace_run.make_trace(WARMUP_SEED, 1, (n + 40,) * 2, (1, 1), *vocab).prompts[0]
    warm = AgentTrace(ids[: n - 8] or ids[:1], [[ids[n - 8 : n], ids[n:]]], 2)
    if spec["mode"] == "mlx-lm":
        model = mlx_lm_qwen3(ckpt)
        serve = lambda t: serve_mlx_lm(model, t)
    else:
        api = load_solution(spec["solution"])
        model = api.Qwen3Model(ckpt, max_seq_len=max(trace.max_seq_len, warm.max_seq_len))
        tokenizer = ckpt.tokenizer or trace_run.NoTextTokenizer()
        serve = lambda t: serve_engine(api, model, tokenizer, t, spec)
    load_s, t = time.perf_counter() - t0, time.perf_counter()
    serve(warm)
    warmup_s = time.perf_counter() - t
    mx.clear_cache()
    mx.reset_peak_memory()
    records, counts = serve(trace)
    return {"mode": spec["mode"], "device": device, "blas": harness.process_blas(),
            "load_s": load_s, "warmup_s": warmup_s, "peak_memory_bytes": mx.get_peak_memory(),
            "metrics": run_metrics(records, counts), "counts": counts,
            "requests": records}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = harness.bench_parser("bench-prefix-cache", __doc__.split("\n\n")[0])
    harness.add_model_arguments(p, "qwen3-0.6b", default_layers=DEFAULT_LAYERS)
    t = p.add_argument_group("trace: how much of it to use (default: all of it, its max-tokens)")
    t.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="the trace file (the committed one: checked by its SHA-256)")  # fmt: skip
    for name, default in NEW_TRACE.items():
        t.add_argument(f"--{name.replace('_', '-')}", type=int_at_least(1), default=None,
                       help=f"with --write-trace, how much to make: {default}")  # fmt: skip
    t.add_argument("--write-trace", type=Path, default=None, metavar="PATH",
                   help="write a new trace for --model's ordinary token ids and exit")  # fmt: skip
    t.add_argument("--user-tokens", type=int_at_least(1), nargs=2, default=[32, 64],
                   metavar=("MIN", "MAX"), help="with --write-trace: message lengths")  # fmt: skip
    t.add_argument("--seed", type=int_at_least(0), default=0, help="random weights, a new trace")
    e = p.add_argument_group("engine (both engine modes, hybrid policy)")
    e.add_argument("--page-size", type=int_at_least(1), default=16,
                   help="tokens per page (only full pages are shared)")  # fmt: skip
    e.add_argument("--batch-size", type=int_at_least(1), default=8, help="decode slots")
    e.add_argument("--prefill-step", type=int_at_least(1), default=128,
                   help="rows per iteration, decode rows included")  # fmt: skip
    r = p.add_argument_group("runs and output")
    harness.add_repeats_argument(r, "mode", 1)
    harness.add_output_arguments(r, "prefix-cache-<model>-<layers>layers-<host>.json", plot=True)
    return p


def new_trace_text(args: argparse.Namespace, model: harness.BenchModel) -> str:
    """A new trace file: system prompt from --seed, user messages from --seed + 1, a list a line."""
    (low, high), n, turns = args.user_tokens, args.conversations, args.turns
    vocab = (model.token_ids, model.excluded_ids)
    system = trace_run.make_trace(args.seed, 1, (args.system_tokens,) * 2, (1, 1), *vocab)
    messages = trace_run.make_trace(args.seed + 1, n * turns, (low, high), (1, 1), *vocab).prompts
    sizes = f"--system-tokens {args.system_tokens} --conversations {n} --turns {turns}"
    command = (f"python benches/prefix_cache.py --write-trace PATH --model {model.name} --seed "
               f"{args.seed} {sizes} --user-tokens {low} {high} --max-tokens "
               f"{args.max_tokens}")  # fmt: skip
    generator = {"seed": args.seed, "token_ids": list(model.token_ids),
                 "excluded_ids": model.excluded_ids, "system_tokens": args.system_tokens,
                 "conversations": n, "turns": turns, "user_tokens": [low, high],
                 "model": model.name, "command": command}  # fmt: skip
    about = (
        "an agent-like trace for bench-prefix-cache: a system prompt shared by every "
        "conversation; per conversation, the new user message of each turn (token ids). Each "
        "turn's prompt is the system prompt, then every earlier user message followed by the "
        "server's own answer to it, then the turn's user message."
    )
    head = {"schema": TRACE_SCHEMA, "about": about, "generator": generator,
            "max_tokens": args.max_tokens}  # fmt: skip
    ids = lambda xs: json.dumps(xs, separators=(",", ":"))
    conversations = [messages[c * turns : (c + 1) * turns] for c in range(n)]
    rows = [",\n".join(f"      {ids(u)}" for u in c) for c in conversations]
    rows = ",\n".join(f"    [\n{c}\n    ]" for c in rows)
    body = {"system": ids(system.prompts[0]), "conversations": f"[\n{rows}\n  ]"}
    return trace_run.trace_text(head, body)


def read_trace(path: Path) -> tuple[AgentTrace, dict[str, Any], str]:
    """The trace in a file, the file's other fields, and the SHA-256 of its bytes."""
    data, sha = trace_run.read_trace_file(path, TRACE_SCHEMA, trace_problem)
    other = {k: v for k, v in data.items() if k not in ("system", "conversations", "about")}
    return AgentTrace(data["system"], data["conversations"], data["max_tokens"]), other, sha


def trace_problem(data: dict[str, Any]) -> str | None:
    nonempty = lambda xs, ok: isinstance(xs, list) and xs and all(ok(x) for x in xs)
    turns = lambda c: nonempty(c, trace_run.is_token_ids)
    if trace_run.is_token_ids(data.get("system")) and nonempty(data.get("conversations"), turns):
        return None
    return (
        "'system' must be a non-empty list of token ids, 'conversations' a non-empty list of "
        "conversations, each a non-empty list of user messages (ids)"
    )


def load_trace(p: argparse.ArgumentParser, args, model: harness.BenchModel):
    """The file's trace cut as asked, and what the report says of it; argparse's error if unfit."""
    default, remake = (DEFAULT_TRACE, DEFAULT_TRACE_SHA256), "regenerate it with --write-trace"
    full, other, sha, committed = trace_run.load_trace(p, args.trace, read_trace, default, remake)
    system, max_tokens = full.system[: args.system_tokens], args.max_tokens or full.max_tokens
    conversations = [c[: args.turns] for c in full.conversations[: args.conversations]]
    trace = AgentTrace(system, conversations, max_tokens)
    vocab, limit = model.config["vocab_size"], model.config["max_position_embeddings"]
    high = max([*trace.system, *(t for c in conversations for u in c for t in u)])
    if high >= vocab:
        p.error(f"the trace has token id {high}, outside the vocabulary of {model.name} "
                f"({vocab} ids); make a trace for it with --write-trace")  # fmt: skip
    if trace.max_seq_len > limit:
        p.error(f"the trace's longest request ({trace.max_seq_len} tokens) exceeds {limit}")
    about = {"path": harness.relative_path(args.trace), "file_sha256": sha,
             "is_committed_trace": committed, "file": other, "used": trace.describe()}  # fmt: skip
    return trace, about


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.user_tokens[0] > args.user_tokens[1]:
        p.error(f"--user-tokens: MIN {args.user_tokens[0]} > MAX {args.user_tokens[1]}")
    model = harness.bench_model_from_args(p, args, default_layers=DEFAULT_LAYERS)
    if args.write_trace is not None:
        harness.check_outputs(p, args.write_trace)
        for name, default in NEW_TRACE.items():
            setattr(args, name, getattr(args, name) or default)
        trace_run.write_trace_file(args.write_trace, new_trace_text(args, model))
        return 0
    if args.user_tokens != [32, 64]:
        p.error("--user-tokens only applies with --write-trace")
    trace, about = load_trace(p, args, model)
    name = f"{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"prefix-cache-{name}.json")
    started, used = time.time(), about["used"]
    env, preloaded = harness.runs_environment(args.no_openblas)
    core = harness.runs_openblas_core(env, preloaded)
    harness.log_model(model, args)
    harness.log(f"trace {about['path']}: system {used['system_tokens']} tokens, "
                f"{used['conversations']} conversations x {used['turns']} turns, answers of "
                f"{used['max_tokens']} tokens")  # fmt: skip
    harness.log_runs_blas(preloaded, core)
    engine = {k: getattr(args, k) for k in ("page_size", "batch_size", "prefill_step")}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        harness.write_random_weights(model, Path(tmp), args.dtype)
        shared = {"model": model.to_dict(), "trace": trace.to_dict(), "dtype": args.dtype,
                  "device": args.device, "solution": args.solution, **engine}  # fmt: skip
        plan = harness.plan_runs(MODES, args.repeats)
        specs = [{**shared, "mode": mode, "repeat": r, "order": order} for r, order, mode in plan]
        label = lambda spec: f"mode {spec['mode']}, repeat {spec['repeat'] + 1}"
        runs = harness.run_plan(__name__, specs, Path(tmp), env, label, run_line)
    token_agreement(runs)
    summary = {mode: aggregate([r for r in runs if r["mode"] == mode]) for mode in MODES}
    leave_out = ("model", "trace", "write_trace", "user_tokens", "json_output", "plot_output")
    settings = {**harness.arguments_json(args, leave_out), "policy": "hybrid",
                "max_seq_len": trace.max_seq_len, "model": model.describe(), "trace": about,
                "mlx_lm_version": harness.package_version("mlx-lm")}  # fmt: skip
    goals, blas = targets(summary), harness.runs_blas(runs, env, preloaded, core)
    report = harness.report("prefix-cache", started, settings, runs, summary, goals, blas)
    harness.write_report(args, report, table, plot)
    return 0


def run_line(run: dict[str, Any]) -> str:
    m = run["metrics"]
    first, later = harness.number(m["ttft_turn1_ms_p50"]), harness.number(m["ttft_later_ms_p50"])
    return (f"mode {run['mode']}: {run['process_s']:.1f} s (load {run['load_s']:.1f}, warm-up "
            f"{run['warmup_s']:.1f}, trace {m['wall_s']:.1f}), prefilled {m['prefill_tokens']} of "
            f"{m['prompt_tokens']} prompt tokens, TTFT p50 turn 1 {first} ms, later {later} "
            "ms")  # fmt: skip


def token_agreement(runs: list[dict[str, Any]]) -> None:
    """Add to every run whether its ids (and text) equal the first cache-off run's, where not."""
    off = next(r for r in runs if r["mode"] == "off")["requests"]
    want = {(q["conversation"], q["turn"]): q for q in off}
    for run in runs:
        requests = run["requests"]
        reference = [want[q["conversation"], q["turn"]] for q in requests]
        found, first = trace_run.compare_answers(requests, reference), None
        if found["first"] is not None:
            q, token = requests[found["first"][0]], found["first"][1]
            first = {"conversation": q["conversation"], "turn": q["turn"], "token": token}
        run["agreement_with_off"] = {"same_token_ids": found["ids"] == 0,
            "same_text": found["texts"] == 0, "requests_same": len(requests) - found["ids"],
            "requests_different": found["ids"], "first_difference": first}  # fmt: skip


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs: medians (and min, max of the scalars); ids (and text) all as off's?"""
    metrics = [r["metrics"] for r in runs]
    scalars = [k for k in metrics[0] if k not in ("requests", "by_turn")]
    stats = {"median": harness.median, "min": harness.least, "max": harness.greatest}
    turns = lambda key: zip(*(m["by_turn"][key] for m in metrics))  # per turn, a value per run
    by_turn = {key: [harness.median(vs) for vs in turns(key)] for key in metrics[0]["by_turn"]}
    return {
        "runs": len(runs),
        **{stat: {k: f(m[k] for m in metrics) for k in scalars} for stat, f in stats.items()},
        "by_turn_median": by_turn,
        "same_token_ids_as_off": all(r["agreement_with_off"]["same_token_ids"] for r in runs),
        "same_text_as_off": all(r["agreement_with_off"]["same_text"] for r in runs),
    }


def targets(modes: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, cache on against cache off; mlx-lm beside them, not one of them."""
    off, on, ml = (modes[mode]["median"] for mode in MODES)
    ratio = lambda a, b: a / b if a is not None and b else None
    fraction = on["prefill_tokens"] / off["prefill_tokens"]
    speedup = ratio(off["ttft_later_ms_p50"], on["ttft_later_ms_p50"])
    same = modes["on"]["same_token_ids_as_off"]
    fast = speedup is not None and speedup >= TARGET_TTFT_SPEEDUP
    small = fraction <= TARGET_PREFILL_FRACTION
    return {
        "checked": True,
        "prefill_tokens_on_over_off": {"value": fraction, "at_most": TARGET_PREFILL_FRACTION,
                                       "met": small},
        "ttft_later_turns_p50_off_over_on": {"value": speedup, "at_least": TARGET_TTFT_SPEEDUP,
                                             "met": fast},
        "generated_ids_on_equal_off": {"value": same, "met": same},
        "all_met": small and fast and same,
        "mlx_lm_for_comparison": {
            "prefill_tokens_over_off": ml["prefill_tokens"] / off["prefill_tokens"],
            "ttft_later_turns_p50_over_on": ratio(ml["ttft_later_ms_p50"], on["ttft_later_ms_p50"]),
            "same_token_ids_as_off": modes["mlx-lm"]["same_token_ids_as_off"],
        },
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """Per mode the medians (TTFT in ms), then each target, met or not."""
    rows = []
    for mode, row in report["summary"].items():
        m = row["median"]
        numbers = [
            harness.number(m[k], ".2f" if k.endswith("_s") else ".0f") for k in COLUMNS.values()
        ]
        same = str(row["same_token_ids_as_off"])
        rows.append([mode, f"{m['prefill_fraction']:.1%}", *numbers, same])
    head = ["mode", "of prompt", *COLUMNS, "ids = off"]
    lines = [harness.table(head, rows, "medians over runs; TTFT in ms, t2+: turns 2 and later")]
    for name, v in report["targets"].items():
        if isinstance(v, dict) and "met" in v:
            bound = [f" ({k.replace('_', ' ')} {v[k]})" for k in ("at_most", "at_least") if k in v]
            value = f"{v['value']:.3f}" if isinstance(v["value"], float) else str(v["value"])
            lines.append(f"target {name}: {value}{''.join(bound)}: {harness.met(v['met'])}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Left: p50 TTFT per turn (bars to p95) per mode. Right: prompt tokens computed per turn."""
    plt = harness.pyplot()
    if plt is None:
        return None
    modes, s = report["summary"], report["settings"]
    colors = {"off": "tab:red", "on": "tab:green", "mlx-lm": "tab:blue"}
    labels = {"off": "engine, cache off", "on": "engine, prefix cache",
              "mlx-lm": "mlx-lm prompt cache"}  # fmt: skip
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for mode, row in modes.items():
        p50, p95 = row["by_turn_median"]["ttft_ms_p50"], row["by_turn_median"]["ttft_ms_p95"]
        turns = list(range(1, len(p50) + 1))
        err = [[0] * len(p50), [(b - a) / 1000 for a, b in zip(p50, p95)]]
        left.errorbar(turns, [v / 1000 for v in p50], yerr=err, fmt="o-", capsize=3,
                      color=colors[mode], label=labels[mode])  # fmt: skip
    left.set(yscale="log", xlabel="turn", xticks=turns, ylabel="time to first token (s): p50, "
             "bar to p95", title="TTFT per turn (a turn's clock starts on arrival)")  # fmt: skip
    left.legend(fontsize=8, loc="best")
    width = 0.8 / (len(modes) + 1)
    sent = modes["off"]["by_turn_median"]["prompt_tokens"]  # mlx-lm's own answers may differ
    xs = range(len(sent))
    right.bar(list(xs), sent, width=width, color="lightgray", label="prompt tokens sent (off)")
    for i, mode in enumerate(modes, start=1):
        right.bar([x + i * width for x in xs], modes[mode]["by_turn_median"]["prefill_tokens"],
                  width=width, color=colors[mode], label=f"computed: {labels[mode]}")  # fmt: skip
    right.set_xticks([x + width * len(modes) / 2 for x in xs], [f"turn {x + 1}" for x in xs])
    right.set(yscale="log", ylabel="prompt tokens, all conversations (log)",
              title="prompt tokens prefilled per turn")  # fmt: skip
    right.set_ylim(top=max(sent) * 12)  # room for the legend above the bars
    right.legend(fontsize=7, loc="upper center", ncol=2)
    used = s["trace"]["used"]
    title = (f"prefix caching: {s['model']['name']} ({s['model']['num_layers']} layers), "
             f"{s['dtype']}, {used['conversations']} conversations x {used['turns']} turns, "
             f"system {used['system_tokens']} tokens, policy {s['policy']}")  # fmt: skip
    return harness.save_figure(fig, path, title)
