"""5.4: the few-row matmul (kernels.few_row_matmul) against MLX's matmul and the machine's limits.
Every run in a fresh process, in plan_runs' order (forward, then reversed, ...):

- kernel: the machine's bandwidth ceilings (MLX's copy in 8 MB pieces, read + write; numpy's
  float32 sgemv on a [151936, 1024] weight, read only), then the Qwen3-0.6B weights (N x K,
  float32) at 1 to 16 rows of x: the few-row kernel, MLX's matmul (x @ w.T) and, at one row,
  numpy's sgemv on the same matrix; and the same weights at 4 bits (groups of 64): the few-row
  kernel against Day 1's quantized_matvec.
- decode: one step of B rows (--decode-rows) on the Qwen3-0.6B shape (--num-layers, random
  float32 weights), a dense cache after an 8-token prompt: float32 with MLX's matmul and with
  the kernel (linear_kernel="few-row"), 4-bit on Day 1's kernel and on the few-row one.

Targets (the issue): the kernel at 1 row >= 80% of numpy's sgemv GB/s on the same matrix and at 8
rows >= 3x MLX's matmul (the head); a decode step of 8 rows within 1.3x of the bandwidth floor
(weight bytes / the copy and sgemv ceiling).

    pdm run bench-few-row [--num-layers 8] [--decode-rows 1 8] [--repeats 3] [--iters 20]
    pdm run bench-few-row --quick          # a smoke run: 1 layer, 1 repeat, 3 timings

Writes benches/results/few-row-<model>-<N>layers-<host>.json (or --json-output).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benches import harness
from benches.own_kernel import bandwidth_gbs, quantized, timings
from tiny_llm_support.cli import int_at_least

SHAPES = ((3072, 1024), (1024, 3072), (151936, 1024))  # gate/up, down, the tied head
ROWS = (1, 2, 4, 8, 16)
HEAD = "151936x1024"
VARIANTS = {  # name: (linear_kernel, quantized_linear; None: float32 weights)
    "float32-mlx": ("mlx", None),
    "float32-few-row": ("few-row", None),
    "4bit-own-kernel": ("mlx", "own-kernel"),
    "4bit-few-row": ("few-row", "own-kernel"),
}
PROMPT_TOKENS, WARMUP_STEPS = 8, 2
TARGETS = {"one_row_vs_sgemv": 0.8, "eight_rows_vs_mlx": 3.0}
FLOOR_TARGET = 1.3  # a step of 8 rows, at most this many times the bandwidth floor


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    record = measure_kernel(spec) if spec["part"] == "kernel" else measure_decode(spec)
    return {**record, "blas": harness.process_blas()}


def measure_kernel(spec: dict[str, Any]) -> dict[str, Any]:
    """GB/s of every (weight, rows, implementation), from the median of `iters` timings."""
    import mlx.core as mx
    import numpy as np

    from benches.ceilings import copy_gbs
    from tiny_llm_ref.kernels import few_row_matmul, few_row_quantized_matmul, quantized_matvec

    iters, table = spec["iters"], {}
    ceilings = {"sgemv_gbs": bandwidth_gbs(iters),
                "copy_gbs": copy_gbs(512, 3, mx.random.key(0))["copy_gbs"]["max"]}  # fmt: skip
    for n, k in SHAPES:
        parts, w = quantized(n, k)
        packed = sum(a.nbytes for a in parts)
        rows = {}
        for m in ROWS:
            x = mx.random.normal((m, k), key=mx.random.key(m))
            fns = {"few_row": lambda x=x, w=w: few_row_matmul(x, w),
                   "mlx_matmul": lambda x=x, w=w: x @ w.T,
                   "few_row_4bit": lambda x=x, q=parts: few_row_quantized_matmul(x, *q),
                   "day1_4bit": lambda x=x, q=parts: quantized_matvec(x, *q)}  # fmt: skip
            ms = timings(fns, iters)
            if m == 1:
                wn, xn = np.array(w), np.array(x[0])
                ms["numpy_sgemv"] = numpy_ms(lambda wn=wn, xn=xn: wn @ xn, iters)
                del wn
            rows[str(m)] = {f"{name}_gbs": (packed if "4bit" in name else w.nbytes) / t / 1e6
                            for name, t in ms.items()}  # fmt: skip
        table[f"{n}x{k}"] = {"float32_mb": w.nbytes / 1e6, "packed_mb": packed / 1e6, "rows": rows}
        del parts, w
        gc.collect()
    return {"part": "kernel", "iters": iters, "ceilings": ceilings, "kernel": table}


def numpy_ms(fn, iters: int) -> float:
    """Median ms of fn() after two warm-up calls."""
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        fn()
        times += [time.perf_counter() - start] * (i >= 2)
    return 1000 * harness.median(times)


def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Load (and quantize), prefill B copies of an 8-token prompt, then time decode steps."""
    import mlx.core as mx

    import tiny_llm_ref as ref
    from tiny_llm_support import quantize_checkpoint

    kernel, path = VARIANTS[spec["variant"]]
    _, ckpt = harness.load_weights(spec["model"], "float32")
    if path is not None:
        ckpt = quantize_checkpoint(ckpt, 4, 64)
        mx.eval(list(ckpt.weights.values()))
    weights = sum({id(w): w.nbytes for w in ckpt.weights.values()}.values())  # tied: once
    model = ref.Qwen3Model(ckpt, quantized_linear=path, linear_kernel=kernel)
    del ckpt
    gc.collect()
    b = spec["rows"]
    cache = model.create_kv_cache()
    prompt = mx.broadcast_to(mx.arange(PROMPT_TOKENS) + 100, (b, PROMPT_TOKENS))  # [B, T]
    logits = model(prompt, 0, cache, logits_to_keep=1)
    token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]  # [B, 1]
    mx.eval(token)
    times = []
    for i in range(WARMUP_STEPS + spec["decode_tokens"]):
        start = time.perf_counter()
        token = mx.argmax(model(token, PROMPT_TOKENS + i, cache)[:, -1, :], axis=-1)[:, None]
        mx.eval(token)
        times += [time.perf_counter() - start] * (i >= WARMUP_STEPS)
    step_s = harness.median(times)
    return {"part": "decode", "variant": spec["variant"], "rows": b, "weights_bytes": weights,
            "step_ms": harness.summarize(times, 1000), "tokens_per_s": b / step_s,
            "gbs": weights / step_s / 1e9}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-few-row", "The few-row matmul against MLX's matmul, numpy's "
                             "sgemv and the bandwidth, per weight and per decode step (5.4).")  # fmt: skip
    p.add_argument("--model", default="qwen3-0.6b", help="a shortcut with an embedded config")
    p.add_argument("--num-layers", type=int_at_least(1), default=8)
    p.add_argument("--decode-rows", type=int_at_least(1), nargs="+", default=[1, 8])
    p.add_argument("--decode-tokens", type=int_at_least(1), default=16, help="timed steps, a run")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timings of each kernel")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="runs of each part")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 layer, 4 steps, 3 timings, 1 repeat")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    harness.add_output_arguments(p, "few-row-<model>-<N>layers-<host>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_layers, args.decode_tokens, args.iters, args.repeats = 1, 4, 3, 1
    model = harness.bench_model_or_exit(p, args.model, random=True, num_layers=args.num_layers,
                                        weight_seed=args.seed)  # fmt: skip
    name = f"few-row-{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"{name}.json")
    started, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-few-row-") as tmp:
        harness.write_random_weights(model, Path(tmp), "float32")
        items = [{"part": "kernel", "iters": args.iters}]
        items += [{"part": "decode", "variant": v, "rows": b, "model": model.to_dict(),
                   "decode_tokens": args.decode_tokens}
                  for b in args.decode_rows for v in VARIANTS]  # fmt: skip
        specs = [{**item, "repeat": r, "order": order}
                 for r, order, item in harness.plan_runs(items, args.repeats)]  # fmt: skip
        runs = harness.run_plan(__name__, specs, Path(tmp), dict(os.environ), label, run_line)
    for run in runs:
        run.pop("model", None)  # the config is in settings, once
    summary = summarize(runs)
    settings = {**harness.arguments_json(args, ("json_output",)), "model": model.describe(),
                "rows": list(ROWS), "prompt_tokens": PROMPT_TOKENS,
                "warmup_steps": WARMUP_STEPS, "loadavg_at_start": list(load)}  # fmt: skip
    report = harness.report("few-row", started, settings, runs, summary, targets(summary))
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0


def label(spec: dict[str, Any]) -> str:
    if spec["part"] == "kernel":
        return "kernel timings"
    return f"decode {spec['variant']} x{spec['rows']}"


def run_line(run: dict[str, Any]) -> str:
    if run["part"] == "kernel":
        head = run["kernel"][HEAD]["rows"]
        return (f"head at 1 row: few-row {head['1']['few_row_gbs']:.1f} GB/s, numpy sgemv "
                f"{head['1']['numpy_sgemv_gbs']:.1f}; at 8 rows few-row "
                f"{head['8']['few_row_gbs']:.1f}, mlx {head['8']['mlx_matmul_gbs']:.1f}")  # fmt: skip
    return (f"decode {run['variant']} x{run['rows']}: {run['step_ms']['median']:.1f} ms a step, "
            f"{run['tokens_per_s']:.1f} tokens/s, {run['gbs']:.1f} GB/s")  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats, the bandwidth floor of each step and the ratios the targets
    read."""
    med = lambda values: harness.median(list(values))  # noqa: E731
    kernels = [r for r in runs if r["part"] == "kernel"]
    first = kernels[0]["kernel"]
    kernel = {shape: {m: {key: med(r["kernel"][shape]["rows"][m][key] for r in kernels)
                          for key in row} for m, row in entry["rows"].items()}
              for shape, entry in first.items()}  # fmt: skip
    ceilings = {key: med(r["ceilings"][key] for r in kernels) for key in kernels[0]["ceilings"]}
    bandwidth = max(ceilings.values())
    decode = {}
    for run in (r for r in runs if r["part"] == "decode"):
        decode.setdefault(f"{run['variant']} x{run['rows']}", []).append(run)
    decode = {key: {"variant": rs[0]["variant"], "rows": rs[0]["rows"],
                    "step_ms": med(r["step_ms"]["median"] for r in rs),
                    "tokens_per_s": med(r["tokens_per_s"] for r in rs),
                    "weights_mb": rs[0]["weights_bytes"] / 1e6,
                    "floor_ms": rs[0]["weights_bytes"] / bandwidth / 1e6}
              for key, rs in decode.items()}  # fmt: skip
    for row in decode.values():
        row["vs_floor"] = row["step_ms"] / row["floor_ms"]
    head = kernel[HEAD]
    ratios = {"one_row_vs_sgemv": head["1"]["few_row_gbs"] / head["1"]["numpy_sgemv_gbs"],
              "eight_rows_vs_mlx": head["8"]["few_row_gbs"] / head["8"]["mlx_matmul_gbs"]}  # fmt: skip
    eight = decode.get("float32-few-row x8")
    if eight:
        ratios["step_of_8_vs_floor"] = eight["vs_floor"]
    return {"ceilings": ceilings, "bandwidth_gbs": bandwidth, "kernel": kernel,
            "decode": decode, "ratios": ratios}  # fmt: skip


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    value = summary["ratios"]
    out = {k: {"target": t, "value": value[k], "met": value[k] >= t} for k, t in TARGETS.items()}
    if "step_of_8_vs_floor" in value:
        v = value["step_of_8_vs_floor"]
        out["step_of_8_vs_floor"] = {"target": FLOOR_TARGET, "value": v, "met": v <= FLOOR_TARGET}
    return out


def summary_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    names = ("few_row", "mlx_matmul", "numpy_sgemv", "few_row_4bit", "day1_4bit")
    kernel = [[shape, m, *(harness.number(r.get(f"{n}_gbs"), ".1f") for n in names)]
              for shape, rows in s["kernel"].items() for m, r in rows.items()]  # fmt: skip
    decode = [[key, f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.1f}", f"{r['floor_ms']:.1f}",
               f"{r['vs_floor']:.2f}"] for key, r in s["decode"].items()]  # fmt: skip
    goals = [f"{k} {'<=' if k.endswith('floor') else '>='} {t['target']}: {t['value']:.2f}, "
             f"{harness.met(t['met'])}" for k, t in report["targets"].items()]  # fmt: skip
    ceilings = ", ".join(f"{k} {v:.1f}" for k, v in s["ceilings"].items())
    return "\n".join([
        f"bandwidth ceilings (GB/s): {ceilings}",
        harness.table(["N x K", "rows", "few-row", "mlx", "numpy sgemv", "few-row 4-bit",
                       "day 1 4-bit"], kernel, title="GB/s of weights read"),
        harness.table(["decode", "step ms", "tokens/s", "floor ms", "vs floor"], decode),
        *goals,
    ])  # fmt: skip
