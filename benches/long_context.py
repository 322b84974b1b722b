"""Week 4 Day 7: long context on Qwen3-0.6B's shape (random weights, 2 layers by default),
every run in a fresh process; the chapter explains what the numbers show.

Part "window": at each --prompt-lens length, full attention over a paged cache against a sliding
--window on every layer (pages that leave the window go back to the pool): a prefill in --chunk
chunks, then --decode-steps steps; times and the KV pages at the peak. Part "ring": ring_prefill
on each --ranks count (more than 1: mlx.launch on this machine): the prefill, KV and peak memory
per rank, one ring step and the ring's arithmetic (a run that would not fit in memory is
skipped). Logits are checked against explicit banded masks and one process: a relative
difference over 1e-3 stops the benchmark before it writes anything.

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-long-context   # 4k and 8k tokens, ~10 min, 2 cores
    pdm run bench-long-context --model tiny --prompt-lens 64 96 --window 16 --chunk 32 \\
        --decode-steps 2                                     # a smoke run, seconds

Writes benches/results/long-context-<model>-<N>layers-<os>-<arch>-<N>cpu.json, prints a table.
What each run does in its own process is in benches/long_context_runs.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benches import harness
from benches.long_context_runs import ORACLE, kv_bytes_per_token, ring_run, window_run
from tiny_llm_ref.ring_attention import split_sequence
from tiny_llm_support.cli import DTYPES, int_at_least

DEFAULT_LAYERS = 2  # for a shortcut with an embedded config
VARIANTS = ("full", "window")
AGREEMENT_RTOL = 1e-3  # max |a - b| / max |b|, at most
MEMORY_SHARE = 0.8  # a ring run must fit its estimated peak into this share of the memory
LINK_BYTES_PER_S = 1.25e9  # a 10 Gbit/s network, for the arithmetic of two machines


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """`python -m benches long-context --child-spec FILE`: one run of either part."""
    return window_run(spec) if spec["part"] == "window" else ring_run(spec)


# --- the plan: the runs, the ring's arithmetic ------------------------------------------------


def window_plan(lengths: list[int]) -> list[tuple[int, str]]:
    """(prompt length, variant) in launch order: both variants at each length, the order swapped
    from one length to the next (plan_runs); the explicit-mask oracle after the shortest
    length's runs."""
    plan = [(lengths[i], v) for i, _, v in harness.plan_runs(VARIANTS, len(lengths))]
    return [*plan[: len(VARIANTS)], (lengths[0], ORACLE), *plan[len(VARIANTS) :]]


def ring_row(model: harness.BenchModel, dtype: str, length: int, ranks: int) -> dict[str, Any]:
    """A planned ring run: what the ring passes and computes per layer (arithmetic: attention
    FLOPs as the reference computes them, a rank's own part as a full [l, l] square plus every
    earlier part's block), its estimated peak per rank, and why it is skipped (None: it runs).
    The estimate: the weights, three [H_q, l, l] arrays of the own part's attention and the
    logits [l, V] (ring_prefill computes every position's)."""
    config, size = model.qwen3_config, DTYPES[dtype].size
    sizes = [stop - start for start, stop in split_sequence(length, ranks)]  # the ranks' parts
    h_q, d = config.num_attention_heads, config.head_dim
    part = max(sizes)
    step = part * kv_bytes_per_token(config, size)  # one part's keys and values
    estimate = model.parameter_count() * size + (3 * h_q * part + config.vocab_size) * part * size
    memory = harness.memory_bytes()
    skipped = None
    if ranks * estimate > MEMORY_SHARE * memory:
        skipped = (f"{ranks} x {estimate / 1e9:.1f} GB estimated, more than {MEMORY_SHARE:.0%} "
                   f"of this machine's {memory / 1e9:.1f} GB")  # fmt: skip
    arithmetic = {"part_tokens": sizes, "steps": ranks - 1, "bytes_per_step_per_layer": step,
                  "bytes_sent_per_rank_per_layer": (ranks - 1) * step,
                  "bytes_sent_per_rank": (ranks - 1) * step * config.num_hidden_layers,
                  "attention_flops_per_layer_by_rank": [
                      4 * h_q * d * l * (l + sum(sizes[:r])) for r, l in enumerate(sizes)],
                  "block_flops_per_byte": 4 * h_q * d * part**2 / step,  # a block of another part
                  "seconds_per_step_at_10gbit": step / LINK_BYTES_PER_S if ranks > 1 else None}  # fmt: skip
    return {"part": "ring", "prompt_len": length, "ranks": ranks, "skipped": skipped,
            "estimated_peak_bytes_per_rank": estimate, "arithmetic": arithmetic}  # fmt: skip


def add_measured(row: dict[str, Any], runs: list[dict[str, Any]], layers: int) -> None:
    """A ring run's ranks into its row: the slowest rank's prefill (every rank waits for it in
    the final all_sum), each rank's memory, and the measured ring step."""
    row["by_rank"] = runs
    row["prefill_s"] = max(r["prefill_s"] for r in runs)
    row["prefill_tokens_per_s"] = row["prompt_len"] / row["prefill_s"]
    row["kv_bytes_by_rank"] = [r["kv_bytes"] for r in runs]
    row["peak_memory_bytes_by_rank"] = [r["peak_memory_bytes"] for r in runs]
    step = row["ring_step_s"] = runs[0]["ring_step_s_median"]
    steps = row["arithmetic"]["steps"] * layers  # ring steps of one prefill, every layer
    row["ring_steps_share_of_prefill"] = step * steps / row["prefill_s"] if step else None


# --- the parent --------------------------------------------------------------------------------


def compare(what: str, length: int, got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    diff, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    relative = diff / scale if scale else diff
    return {"what": what, "prompt_len": length, "max_abs_diff": diff, "max_abs_reference": scale,
            "relative_diff": relative, "ok": relative <= AGREEMENT_RTOL}  # fmt: skip


def agreement(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The window against the oracle; the ring on N ranks against 1 rank and the full run (the
    logits each run saved where its spec says)."""
    window = {(s["prompt_len"], s["variant"]): np.load(s["logits"])
              for s in specs if s["part"] == "window"}  # fmt: skip
    ring = {(s["prompt_len"], s["ranks"]): np.load(s["logits"])["prefill"]
            for s in specs if s["part"] == "ring"}  # fmt: skip
    checks = []
    for (length, variant), oracle in window.items():
        for key in ("prefill", "decode") if variant == ORACLE else ():
            what = f"window vs explicit banded masks, {key} logits"
            checks.append(compare(what, length, window[(length, "window")][key], oracle[key]))
    for (length, ranks), got in ring.items():
        if ranks > 1 and (length, 1) in ring:
            what = f"ring prefill, {ranks} ranks vs 1 rank"
            checks.append(compare(what, length, got, ring[(length, 1)]))
        if ranks > 1 and (length, "full") in window:
            what = f"ring prefill, {ranks} ranks vs the full chunked prefill in one process"
            checks.append(compare(what, length, got, window[(length, "full")]["prefill"]))
    return checks


def run_label(run: dict[str, Any]) -> str:
    """A run (its spec, or a record of it) in the progress lines."""
    what = run.get("variant") or f"{run['ranks']} rank(s)"
    return f"{run['part']}, {run['prompt_len']} tokens, {what}"


def run_line(records: list[dict[str, Any]]) -> str:
    """What a run measured, for the progress lines: the slowest rank's prefill."""
    return f"{run_label(records[0])}: prefill {max(r['prefill_s'] for r in records):.1f} s"


def run_all(args, model: harness.BenchModel, tmp: Path, settings: dict) -> tuple[list, list]:
    """Every run of both parts, each in fresh processes, window first: the rows (skipped ring
    runs included) and the agreement checks."""
    shared = {"model": model.to_dict(), "settings": settings, "solution": args.solution}
    lengths = args.prompt_lens
    variants = window_plan(lengths) if "window" in args.parts else []
    window_specs = [{**shared, "part": "window", "prompt_len": n, "variant": v, "ranks": 1}
                    for n, v in variants]  # fmt: skip
    # every rank count at each length, the order swapped from one length to the next
    ring_plan = harness.plan_runs(args.ranks, len(lengths)) if "ring" in args.parts else []
    rings = [ring_row(model, args.dtype, lengths[i], n) for i, _, n in ring_plan]
    for row in (row for row in rings if row["skipped"]):
        harness.log(f"ring, {row['prompt_len']} tokens, {row['ranks']} rank(s): skipped, "
                    f"{row['skipped']}")  # fmt: skip
    measured = [row for row in rings if not row["skipped"]]
    specs = window_specs + [{**shared, "part": "ring", "prompt_len": row["prompt_len"],
                             "ranks": row["ranks"]} for row in measured]  # fmt: skip
    for k, spec in enumerate(specs):
        spec["logits"] = str(tmp / f"logits-{k}.npz")
    runs = harness.run_rank_plan(__name__, specs, tmp, run_label, run_line)
    for row, records in zip(measured, runs[len(window_specs) :]):
        add_measured(row, records, model.num_layers)
    windows = [records[0] for records in runs[: len(window_specs)]]
    per_token = kv_bytes_per_token(model.qwen3_config, DTYPES[args.dtype].size) * model.num_layers
    for row in windows:
        row["prefill_tokens_per_s"] = row["prompt_len"] / row["prefill_s"]
        row["dense_kv_bytes"] = (row["prompt_len"] + args.decode_steps + 1) * per_token
    return windows + rings, agreement(specs)


# --- the table and the command line ------------------------------------------------------------


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def summary_table(report: dict[str, Any]) -> str:
    s, runs = report["settings"], report["runs"]
    name = {"window": f"window {s['window']}", ORACLE: "banded mask", "full": "full"}
    window = [(str(r["prompt_len"]), name[r["variant"]], f"{r['prefill_s']:.1f}",
               f"{r['last_chunk_s']:.2f}", f"{r['decode_ms']:.0f}", mib(r.get("kv_peak_bytes")),
               mib(r.get("kv_pool_bytes")), str(r.get("pages_released", "-")))
              for r in runs if r["part"] == "window"]  # fmt: skip
    ring = [(str(r["prompt_len"]), str(r["ranks"]), "skipped") if r["skipped"] else
            (str(r["prompt_len"]), str(r["ranks"]), f"{r['prefill_s']:.1f}",
             " ".join(mib(b) for b in r["kv_bytes_by_rank"]),
             " ".join(mib(b) for b in r["peak_memory_bytes_by_rank"]),
             "-" if r["ring_step_s"] is None else f"{r['ring_step_s'] * 1000:.1f}")
            for r in runs if r["part"] == "ring"]  # fmt: skip
    lines = []
    if window:
        head = ("prompt", "attention", "prefill s", "last chunk s", "decode ms", "peak KV MiB",
                "pool MiB", "pages back")  # fmt: skip
        title = f"sliding window: chunks of {s['chunk']}, pages of {s['page_size']} tokens"
        lines.append(harness.table(head, window, title))
    if ring:
        head = ("prompt", "ranks", "prefill s", "KV MiB/rank", "peak MiB/rank", "ring step ms")
        lines.append(harness.table(head, ring, "ring prefill (prefill s: the slowest rank)"))
    lines += [f"skipped {r['prompt_len']} x {r['ranks']}: {r['skipped']}"
              for r in runs if r["part"] == "ring" and r["skipped"]]  # fmt: skip
    lines += [f"agreement, {c['prompt_len']} tokens, {c['what']}: relative difference "
              f"{c['relative_diff']:.1e}" for c in report["summary"]["agreement"]["checks"]]  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, harness.BenchModel]:
    """The arguments and the model they name; every check that needs no weights, before any
    run (errors exit through argparse)."""
    p = harness.bench_parser("bench-long-context", "Long context (Week 4 Day 7): a sliding "
                             "window against full attention, and ring prefill on 1 and 2 ranks.")  # fmt: skip
    harness.add_model_arguments(p, "qwen3-0.6b", default_layers=DEFAULT_LAYERS)
    r = p.add_argument_group("runs")
    r.add_argument("--parts", nargs="+", choices=("window", "ring"), default=["window", "ring"])
    r.add_argument("--prompt-lens", type=int_at_least(1), nargs="+", default=[4096, 8192],
                   help="prompt tokens, in both parts (16384: --parts window, the ring part "
                   "does not fit in 24 GB)")  # fmt: skip
    r.add_argument("--window", type=int_at_least(1), default=1024, help="positions")
    r.add_argument("--chunk", type=int_at_least(1), default=512, help="prefill chunk (tokens)")
    r.add_argument("--page-size", type=int_at_least(1), default=16, help="tokens per page")
    r.add_argument("--decode-steps", type=int_at_least(1), default=16, help="after one untimed")
    r.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[1, 2], help="ring part")
    r.add_argument("--seed", type=int_at_least(0), default=0, help="random weights, prompt ids")
    harness.add_output_arguments(r, "long-context-<model>-<N>layers-<os>-<arch>-<N>cpu.json")
    args = p.parse_args(argv)
    args.prompt_lens, args.ranks = sorted(set(args.prompt_lens)), sorted(set(args.ranks))
    args.parts = list(dict.fromkeys(args.parts))
    model = harness.bench_model_from_args(p, args, default_layers=DEFAULT_LAYERS)
    if model.qwen3_config.layer_windows:
        p.error(f"--model {args.model} has sliding windows of its own: use a model without")
    longest = args.prompt_lens[-1] + args.decode_steps + 1
    if longest > (limit := model.config["max_position_embeddings"]):
        p.error(f"{longest} positions (the longest prompt and the decode steps) exceed {limit}")
    shortest, most = args.prompt_lens[0], args.ranks[-1]
    if "ring" in args.parts and shortest < most:
        p.error(f"a prompt of {shortest} tokens cannot be split over {most} ranks")
    name = f"{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"long-context-{name}.json")
    return args, model


def main(argv: Sequence[str] | None = None) -> int:
    args, model = parse_args(argv)
    started = time.time()
    harness.log_model(model, args)
    core = harness.log_blas()
    settings = {**harness.arguments_json(args, ["json_output"]), "read_in_place": True,
                "window_check_len": args.prompt_lens[0], "device": harness.device_name(args.device)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-long-context-") as tmp:
        harness.write_random_weights(model, Path(tmp), args.dtype)
        rows, checks = run_all(args, model, Path(tmp), settings)
    for c in (c for c in checks if not c["ok"]):
        harness.log(f"error: {c['what']} at {c['prompt_len']} tokens: relative difference "
                    f"{c['relative_diff']:.2e} > {AGREEMENT_RTOL} (max |diff| {c['max_abs_diff']:.3g})")  # fmt: skip
    if not all(c["ok"] for c in checks):
        return 1
    ran = {r["blas"]["blas"] for row in rows for r in row.get("by_rank", [row]) if "blas" in r}
    blas = {"parent": harness.blas_info(), "openblas_core": core, "runs": sorted(ran)}
    settings = {**settings, "model": model.describe(), "memory_bytes": harness.memory_bytes()}
    summary = {"agreement": harness.agreement_summary(checks, AGREEMENT_RTOL)}
    report = harness.report("long-context", started, settings, rows, summary, blas=blas)
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0
