"""The course's Qwen3 model against mlx-lm's, and both against the machine's limits.

One process builds one set of weights (by default the Qwen3-0.6B config with random weights:
the same shapes, so the same FLOPs and bytes as the real checkpoint, no download) and hands the
very same arrays to two implementations:

    ref      tiny_llm_ref.Qwen3Model (or your tiny_llm with --solution tiny_llm) with its dense
             TinyKvFullCache; a decode batch of B rows uses one dense cache of batch B per
             layer whose rows all hold the same context (--batch-cache batching: a
             BatchingKvCache over B one-row dense caches instead)
    mlx-lm   mlx_lm.models.qwen3.Model holding the same arrays, with its own KVCache from
             mlx_lm.models.cache.make_prompt_cache

Measured, interleaved between the two (repeat 1 runs ref then mlx-lm, repeat 2 mlx-lm then
ref, and so on, so a machine that slowly speeds up or slows down favours neither):

    prefill  tokens/s for a prompt of --prefill-lens tokens on an empty cache: the whole
             forward pass plus the logits of the last position (what a server needs)
    decode   ms per step at a context of --decode-contexts tokens for --decode-batches rows:
             the cache gets random keys/values of that length through its own
             update_and_fetch (the state a prefill leaves), then --decode-warmup untimed and
             --decode-steps timed greedy steps, each synchronized with mx.eval

and, in the same run, the machine's limits through MLX: fp32 and bf16 matmul GFLOP/s, copy
GB/s and the GB/s of one large matrix-vector product. Prefill is reported as a fraction of
the matmul ceiling (model FLOPs / time), decode as a fraction of the bandwidth ceiling
(bytes of weights and KV one step must read / time).

--ablate adds two ablations. Single operations at the model's shapes, the course's against
mx.fast / mlx-lm, each timed as one graph of several calls as in a forward pass (and the KV
cache append: the course's cache and a concatenating one against mlx-lm's KVCache). And the
course's model with mx.fast.scaled_dot_product_attention, with mx.fast.rms_norm + mx.fast.rope,
and with both, timed interleaved with the plain model and mlx-lm.

On Linux the mlx[cpu] wheel runs matmuls on its bundled reference BLAS; when Debian's
OpenBLAS is installed the script restarts itself with it preloaded
(tiny_llm_support.reexec_with_openblas; --no-openblas keeps the bundled one). The JSON
records which BLAS ran.

The code: ceilings.py (the machine's limits), model_impls.py (the two implementations and the
parts the ablation swaps in), model_harness.py (the timed measurements), model_ablation.py,
model_report.py (the tables); this file is the command line.

    pdm run bench-model                               # the full run: a few minutes
    pdm run bench-model --ablate                      # and the ablations: a few more
    pdm run bench-model --model tiny --prefill-lens 32 --decode-contexts 32
    pdm run bench-model --num-layers 2 --prefill-lens 128 512 --ablate
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from ceilings import measure_ceilings
from common import (
    RESULTS,
    add_model_arguments,
    add_output_arguments,
    arguments_json,
    bench_model_from_args,
    bench_parser,
    blas_info,
    host_info,
    log,
    mlx_info,
    restart_with_openblas,
    set_output_paths,
    slug,
    write_report,
)
from model_ablation import ablate_models, ablate_ops
from model_harness import Workload, check_agreement, measure_decode, measure_prefill
from model_impls import MLX_LM, MlxLmImpl, RefImpl
from model_report import markdown_table

from tiny_llm_support import choose_device
from tiny_llm_support.cli import DTYPES, SOLUTIONS, int_at_least, load_solution, unfinished_message

# --- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    pos, nonneg = int_at_least(1), int_at_least(0)
    p = bench_parser(
        "bench-model",
        "Prefill and decode speed of the course's Qwen3 against mlx-lm's on the same weights, "
        "and both against this machine's matmul and bandwidth limits.",
    )
    m = add_model_arguments(p, "qwen3-0.6b")
    m.add_argument(
        "--batch-cache",
        choices=("dense", "batching", "ragged"),
        default="dense",
        help="the course's cache for decode batches > 1: one dense cache of batch B "
        "per layer, a BatchingKvCache over B one-row dense caches (alternate policy), or B "
        "one-row caches read by forward_ragged (hybrid policy, Week 3 Day 4)",
    )
    w = p.add_argument_group("workload")
    for flag, default, what in (
        ("--prefill-lens", [128, 512, 2048], "prompt lengths (none: no prefill measurements)"),
        (
            "--decode-contexts",
            [128, 1024],
            "cached tokens at the timed decode steps (none: no decode measurements)",
        ),
    ):
        w.add_argument(flag, type=pos, nargs="*", default=default, metavar="N", help=what)
    w.add_argument(
        "--decode-batches",
        type=pos,
        nargs="+",
        default=[1, 4],
        metavar="B",
        help="rows decoded together",
    )
    w.add_argument("--decode-steps", type=pos, default=6, help="timed decode steps per repeat")
    w.add_argument(
        "--decode-warmup",
        type=nonneg,
        default=1,
        help="untimed decode steps before them (the caches grow on the first)",
    )
    w.add_argument(
        "--repeats",
        type=pos,
        default=3,
        help="repeats of each measurement; the order of the models alternates",
    )
    w.add_argument(
        "--long-repeats",
        type=pos,
        default=2,
        help="repeats for prompts of --long-from tokens or more, which get no warm-up "
        "run of their own (the shorter prompts warmed the kernels up)",
    )
    w.add_argument("--long-from", type=pos, default=1024)
    w.add_argument(
        "--quick",
        action="store_true",
        help="prompts up to 512 tokens only, at most 2 repeats, 4 decode steps",
    )
    w.add_argument("--seed", type=nonneg, default=0, help="weights and tokens")
    a = p.add_argument_group("ablation")
    a.add_argument(
        "--ablate",
        action="store_true",
        help="time single operations against mx.fast / mlx-lm, and the course's "
        "model with mx.fast attention, norms and RoPE",
    )
    a.add_argument(
        "--ablate-len", type=pos, default=512, help="prompt length of the prefill ablations"
    )
    a.add_argument(
        "--ablate-repeats", type=pos, default=2, help="repeats of each whole-model variant"
    )
    c = p.add_argument_group("ceilings")
    c.add_argument("--matmul-size", type=pos, default=2048)
    c.add_argument(
        "--copy-mb", type=pos, default=256, help="MB copied for the bandwidth measurement"
    )
    c.add_argument("--ceiling-repeats", type=pos, default=3)
    add_output_arguments(p.add_argument_group("output"), "bench-model-<host>-<date>-<time>.json")
    return p


def default_json_path() -> Path:
    host = slug(platform.node()) or "host"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    return RESULTS / f"bench-model-{host}-{stamp}.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    restart_with_openblas(args)
    started = time.time()
    if args.quick:
        args.prefill_lens = [n for n in args.prefill_lens if n <= 512] or [128]
        args.repeats, args.long_repeats = min(args.repeats, 2), min(args.long_repeats, 2)
        args.decode_steps = min(args.decode_steps, 4)
    try:
        import mlx_lm
    except ImportError:
        parser.error("mlx-lm is not installed (it is in the dev group: pdm sync -G dev)")
    model = bench_model_from_args(parser, args)
    set_output_paths(parser, args, default_json_path())
    contexts = args.decode_contexts or ([1024] if args.ablate else [])
    longest = max(
        [
            *args.prefill_lens,
            16,
            args.ablate_len if args.ablate else 0,
            *[c + args.decode_warmup + args.decode_steps + 1 for c in contexts],
        ]
    )
    if longest > int(model.config["max_position_embeddings"]):
        parser.error(
            f"{longest} positions exceed the model's max_position_embeddings "
            f"({model.config['max_position_embeddings']})"
        )

    device = choose_device(args.device)
    dtype = DTYPES[args.dtype]
    blas = blas_info()
    unused = blas["openblas_path"] and "openblas" not in blas["blas"]
    log(
        f"BLAS: {blas['blas']}"
        + (f" (OpenBLAS at {blas['openblas_path']} not used)" if unused else "")
    )
    if device == "cpu" and "reference" in blas["blas"]:
        log(
            "warning: the bundled reference BLAS runs fp32 matmuls 20-40x slower than "
            "OpenBLAS: `sudo apt-get install libopenblas0-pthread` (see the Performance "
            "appendix), or expect a long run"
        )

    t = time.perf_counter()
    ckpt = model.load(args.dtype)
    cfg = ckpt.config
    label = args.solution
    try:
        impls = {
            label: RefImpl(load_solution(label), ckpt, args.batch_cache),
            MLX_LM: MlxLmImpl(ckpt),
        }
        work = Workload(model, cfg, dtype, random.Random(args.seed))
        agreement = check_agreement(impls, work)
    except NotImplementedError as e:
        log(unfinished_message(label, e))
        return 1
    log(
        f"model {model.name}: {model.num_layers} layers, {model.parameter_count() / 1e6:.1f}M "
        f"parameters ({'random' if model.random_weights else 'checkpoint'} weights), "
        f"{args.dtype} on {device}, ready in {time.perf_counter() - t:.1f} s"
    )
    log(
        f"same 16 tokens through both: max |logit diff| {agreement[label]['max_abs_diff']:.2e} "
        f"(largest logit {agreement['max_abs_logit_mlx_lm']:.2f}), same argmax: "
        f"{agreement[label]['same_argmax']}"
    )

    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    ceilings = measure_ceilings(args.matmul_size, args.copy_mb, args.ceiling_repeats, dtype)
    work.ceilings = ceilings
    prefill = measure_prefill(
        impls, args.prefill_lens, args.repeats, args.long_repeats, args.long_from, work
    )
    points = [(c, b) for c in args.decode_contexts for b in args.decode_batches]
    decode = measure_decode(
        impls, points, args.repeats, args.decode_warmup, args.decode_steps, work
    )
    ablation = None
    if args.ablate:
        log("ablation, single operations (median time of one call):")
        ops = ablate_ops(
            impls[label].pkg, cfg, dtype, args.ablate_len, max(contexts), max(args.repeats, 5)
        )
        log("ablation, the course's model with mx.fast operations:")
        models = ablate_models(args, ckpt, impls, work)
        ablation = {"ops": ops, "models": models}

    report = {
        "benchmark": "bench-model",
        "command": " ".join(sys.orig_argv),
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "host": host_info(),
        "mlx": mlx_info(),
        "mlx_lm_version": getattr(mlx_lm, "__version__", "unknown"),
        "blas": {
            **blas,
            "no_openblas": args.no_openblas,
            "reexecuted_with_openblas": os.environ.get("TINY_LLM_OPENBLAS_PRELOADED") == "1",
        },
        "env": {
            k: os.environ.get(k)
            for k in (
                "LD_PRELOAD",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS",
                "TINY_LLM_NO_OPENBLAS",
            )
        },
        "device": device,
        "dtype": args.dtype,
        "solution": SOLUTIONS[label],
        "solution_label": label,
        "ref_batch_cache": {
            "dense": "one dense TinyKvFullCache of batch B per layer",
            "batching": "BatchingKvCache over B one-row TinyKvFullCaches per layer",
            "ragged": "B one-row TinyKvFullCaches read by forward_ragged (the hybrid pass)",
        }[args.batch_cache],
        "mlx_lm_cache": "make_prompt_cache: KVCache, preallocated 256 positions at a time",
        "model": model.describe(),
        "settings": arguments_json(args),
        "ceilings": ceilings,
        "agreement": agreement,
        "prefill": prefill,
        "decode": decode,
        "ablation": ablation,
        "notes": [
            "ratio_over_mlx_lm is a throughput ratio: above 1 that model is faster than mlx-lm",
            "prefill FLOPs: 2 per matmul parameter per token, the causal half of QK^T and PV, "
            "and the lm_head for the last position only; share of ceiling = GFLOP/s over the "
            "matmul GFLOP/s of the run's dtype",
            "decode bytes: every weight once per step (embedding: only the rows looked up) "
            "plus keys and values of context + 1 positions per row and layer; share of "
            "ceiling = GB/s over the larger of copy and gemv GB/s",
        ],
    }
    report["runtime_s"] = time.time() - started
    write_report(args, report, markdown_table, seconds=report["runtime_s"])
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))
