"""bench-model: the course's Qwen3 against mlx-lm's on the very same weight arrays, and both
against this machine's limits, all in one process.

Prefill tokens/s (a share of the matmul ceiling) and decode ms per step from random keys/values
(a share of the bandwidth ceiling, ceilings.py), the models taking turns in every repeat.
--ablate: single operations against mx.fast / mlx-lm (model_ablation.py) and the model with
mx.fast parts; --anchors: llama.cpp and vLLM's CPU build (model_anchors.py).

    pdm run bench-model --model tiny --prefill-lens 32 --decode-contexts 32
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

from benches import harness, model_anchors, model_impls
from benches.ceilings import measure_ceilings, stats
from benches.harness import BenchModel, log, median, plan_runs
from benches.model_ablation import ablate_ops
from benches.model_anchors import spread
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

    def tokens(self, rows: int, length: int) -> mx.array:
        ids = model_impls.random_ids(self.rng, self.model, rows * length)
        return mx.array(ids, dtype=mx.int32).reshape(rows, length)


def layer_matmul_params(cfg) -> int:
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return e * q + 2 * e * kv + q * e + 3 * e * i


def prefill_flops(cfg, length: int) -> float:
    """2 FLOPs per matmul parameter per token, the causal half of the attention scores and
    weighted sums, and the lm_head for the one kept row."""
    matmuls = 2.0 * length * layer_matmul_params(cfg)
    attention = 2.0 * cfg.num_attention_heads * cfg.head_dim * length * (length + 1)
    return cfg.num_hidden_layers * (matmuls + attention) + 2.0 * cfg.hidden_size * cfg.vocab_size


def decode_bytes(cfg, batch: int, context: int, itemsize: int) -> float:
    """Every weight once (of the embedding only the rows looked up) and, per layer and row, the
    keys and values of context + 1 positions."""
    e, d = cfg.hidden_size, cfg.head_dim
    weights = cfg.num_hidden_layers * (layer_matmul_params(cfg) + 2 * e + 2 * d)
    weights += e * cfg.vocab_size + e + batch * e  # lm_head, final norm, embedding rows
    kv = cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * (context + 1) * d
    return float((weights + kv) * itemsize)


def timed_row(row: dict, impls: dict, run: Callable, what: str, per_run: dict, shares: dict):
    """The row, completed: each implementation's seconds of run(impl), in turns (plan_runs), as
    the stats of every per_run(seconds); the first of them compared with mlx-lm's (above 1:
    faster), the last (a rate) as a share of each ceiling in `shares`."""
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r, _, name in plan_runs(list(impls), row["repeats"]):
        times[name].append(run(impls[name]))
        log(f"  {what:<26} {name:<20} {r + 1}/{row['repeats']}: {1000 * times[name][-1]:9.1f} ms")
    row["impls"] = {}
    for name, ts in times.items():
        m = {key: stats([f(t) for t in ts]) for key, f in per_run.items()}
        rate = median(m[list(per_run)[-1]]["values"])
        row["impls"][name] = m | {share: rate / ceiling for share, ceiling in shares.items()}
    metric = next(iter(per_run))  # prefill: tokens/s, higher is better; decode: ms/step, lower
    base = row["impls"][MLX_LM][metric]["median"]
    row["ratio_over_mlx_lm"] = {
        name: m[metric]["median"] / base if row["kind"] == "prefill" else base / m[metric]["median"]
        for name, m in row["impls"].items()
        if name != MLX_LM
    }
    return row


def run_prefill(impl, tokens: mx.array) -> float:
    t0 = time.perf_counter()
    logits, cache = impl.prefill(tokens)  # tokens [1, L] -> logits [1, 1, V]
    mx.eval(logits, *cache_arrays(cache))
    return time.perf_counter() - t0


def prefill_row(impls: dict, length: int, repeats: int, warm_up: bool, w: Workload) -> dict:
    tokens, flops = w.tokens(1, length), prefill_flops(w.cfg, length)
    for impl in impls.values() if warm_up else []:  # at this shape
        run_prefill(impl, tokens)
    row = {"kind": "prefill", "prompt_len": length, "repeats": repeats,
           "warmup_runs": int(warm_up), "flops": flops}  # fmt: skip
    per_run = {"tokens_per_s": lambda t: length / t, "seconds": lambda t: t,
               "gflops": lambda t: flops / t / 1e9}  # fmt: skip
    shares = {"fraction_of_matmul_ceiling": w.ceilings["matmul_ceiling_gflops"]}
    run = partial(run_prefill, tokens=tokens)
    return timed_row(row, impls, run, f"prefill {length}", per_run, shares)


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


def decode_row(impls: dict, context: int, batch: int, repeats: int, args, w: Workload) -> dict:
    """The row of one decode point; the steps of each repeat: args.decode_warmup, decode_steps."""
    warmup, steps = args.decode_warmup, args.decode_steps
    kv = random_context(w.cfg, batch, context, w.dtype, seed=context * 16 + batch)
    run = partial(run_decode, kv=kv, tokens=w.tokens(batch, 1), warmup=warmup, steps=steps)
    nbytes = decode_bytes(w.cfg, batch, context, w.dtype.size)
    row = {"kind": "decode", "context": context, "batch": batch, "repeats": repeats,
           "warmup_steps": warmup, "timed_steps": steps, "bytes_per_step": nbytes}  # fmt: skip
    per_run = {"ms_per_step": lambda t: 1000 * t, "tokens_per_s": lambda t: batch / t,
               "gbs": lambda t: nbytes / t / 1e9}  # fmt: skip
    shares = {"fraction_of_bandwidth_ceiling": w.ceilings["bandwidth_ceiling_gbs"],
              "fraction_of_gemv": w.ceilings["gemv_gbs"]["max"]}  # fmt: skip
    return timed_row(row, impls, run, f"decode ctx {context} batch {batch}", per_run, shares)


def check_agreement(impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """Every model on the same 16 tokens: with the same weights the last logits must match
    mlx-lm's (this is also everyone's first, compiling, call)."""
    tokens = w.tokens(1, 16)
    outs = {name: impl.prefill(tokens)[0].astype(mx.float32) for name, impl in impls.items()}
    base = outs.pop(MLX_LM)  # [1, 1, V]
    report: dict[str, Any] = {"max_abs_logit_mlx_lm": mx.abs(base).max().item()}
    for name, out in outs.items():
        same = mx.all(mx.argmax(out, -1) == mx.argmax(base, -1)).item()
        report[name] = {"max_abs_diff": mx.abs(out - base).max().item(), "same_argmax": same}
    return report


def ablate_models(args, ckpt, base_impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """The course's model with mx.fast parts (VARIANTS) next to the plain model and mlx-lm:
    prefill at --ablate-len, decode at the largest context and batch."""
    impls, pkg = dict(base_impls), base_impls[args.solution].pkg
    for suffix, parts in VARIANTS.items():
        impls[args.solution + suffix] = RefImpl(pkg, ckpt, args.batch_cache, **parts,
                                                linear_kernel=args.linear_kernel)  # fmt: skip
    agreement = check_agreement(impls, w)
    for suffix in VARIANTS:
        diff = agreement[args.solution + suffix]["max_abs_diff"]
        log(f"  {args.solution + suffix}: max |logit diff| vs mlx-lm {diff:.2e}")
    reps, context = args.ablate_repeats, max(args.decode_contexts or [1024])
    return {
        "agreement": agreement,
        "prefill": [prefill_row(impls, args.ablate_len, reps, True, w)],
        "decode": [decode_row(impls, context, max(args.decode_batches), reps, args, w)],
    }


def measure(args: argparse.Namespace, model: BenchModel) -> tuple[dict, list, dict]:
    """The whole run: its settings, runs (the prefill and decode rows) and summary."""
    t = time.perf_counter()
    ckpt, pkg = model.load(args.dtype), load_solution(args.solution)
    impls = {args.solution: RefImpl(pkg, ckpt, args.batch_cache, linear_kernel=args.linear_kernel),
             MLX_LM: MlxLmImpl(ckpt)}  # fmt: skip
    work = Workload(model, ckpt.config, DTYPES[args.dtype], random.Random(args.seed))
    agreement = check_agreement(impls, work)
    ours = agreement[args.solution]
    harness.log_model(model, args, f", ready in {time.perf_counter() - t:.1f} s")
    log(f"same 16 tokens through both: max |logit diff| {ours['max_abs_diff']:.2e} (largest "
        f"logit {agreement['max_abs_logit_mlx_lm']:.2f}), same argmax: {ours['same_argmax']}")  # fmt: skip
    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    work.ceilings = measure_ceilings(args.matmul_size, args.copy_mb, args.ceiling_repeats,
                                     work.dtype)  # fmt: skip
    runs, reps = [], args.repeats
    for n in args.prefill_lens:  # from --long-from on: --long-repeats, no warm-up of its own
        long = n >= args.long_from
        runs.append(prefill_row(impls, n, args.long_repeats if long else reps, not long, work))
    for c in args.decode_contexts:
        runs += [decode_row(impls, c, b, reps, args, work) for b in args.decode_batches]
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
    settings = {"arguments": harness.arguments_json(args),
                "device": harness.device_name(args.device), "dtype": args.dtype,
                "solution": SOLUTIONS[args.solution], "solution_label": args.solution,
                "model": model.describe(),
                "linear_kernel": impls[args.solution].model.linear_kernel}  # fmt: skip
    return settings, runs, summary


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
    """The measurements, the anchors and the ceilings (the ablations are logged)."""
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
    m.add_argument("--batch-cache", choices=("dense", "batching", "ragged"), default="dense",
                   help="the course's cache for decode batches > 1: one dense cache of batch B per "
                   "layer, a BatchingKvCache over B one-row caches (alternate policy), or B "
                   "one-row caches read by forward_ragged (hybrid policy, Week 3 Day 4)")  # fmt: skip
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
    output = "bench-model-<host>-<date>-<time>.json"
    harness.add_output_arguments(p.add_argument_group("output"), output)
    model_anchors.add_arguments(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> BenchModel:
    """--quick applied, mlx-lm installed, the model and the outputs checked: the model."""
    if args.quick:
        args.prefill_lens = [n for n in args.prefill_lens if n <= 512] or [128]
        args.repeats, args.long_repeats = min(args.repeats, 2), min(args.long_repeats, 2)
        args.decode_steps = min(args.decode_steps, 4)
    if args.ablate and args.batch_cache == "ragged":  # mx.fast.rope: one start per row
        p.error("--ablate swaps in mx.fast.rope, which takes one start position per row, not a "
                "ragged pass's position per token: use --batch-cache dense or batching")  # fmt: skip
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
        log("warning: the bundled reference BLAS runs fp32 matmuls 20-40x slower than OpenBLAS "
            "(`sudo apt-get install libopenblas0-pthread`, see the Performance appendix)")  # fmt: skip
    with harness.OneLineErrors(args.solution, model_anchors.AnchorError) as errors:
        settings, runs, summary = measure(args, model)
        reexecuted = os.environ.get("TINY_LLM_OPENBLAS_PRELOADED") == "1"  # by python -m benches
        blas = {**harness.process_blas(), "reexecuted_with_openblas": reexecuted,
                "env": harness.environment()}  # fmt: skip
        report = harness.report("bench-model", started, settings, runs, summary, blas=blas)
        report["host"]["mlx_lm_version"] = harness.package_version("mlx-lm")
        harness.write_report(args, report, tables, seconds=report["host"]["duration_s"])
    return errors.status
