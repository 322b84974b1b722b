"""5.4: the few-row matmul (kernels.few_row_matmul) against MLX's matmul and the machine's limits,
each run in a fresh process. Part "kernel": the bandwidth ceilings (MLX's copy; numpy's float32
sgemv), then the Qwen3-0.6B weights at 1 to 16 rows of x: the few-row kernel, MLX's matmul and, at
one row, numpy's sgemv on the same matrix; at 4 bits, the few-row kernel against Day 1's
quantized_matvec. Part "decode": one step of B rows (--decode-rows) on the Qwen3-0.6B shape, float32
with MLX's matmul and with the few-row kernel, 4-bit on Day 1's kernel and on the few-row one.

    pdm run bench-few-row [--num-layers 8] [--decode-rows 1 8] [--repeats 3] [--quick]
"""

import gc
import os
import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

import tiny_llm_ref as ref
from benches import harness, own_kernel
from benches.ceilings import copy_gbs
from benches.own_kernel import PROMPT_TOKENS, SHAPES, WARMUP_STEPS
from tiny_llm_ref.kernels import few_row_matmul, few_row_quantized_matmul, quantized_matvec

ROWS = (1, 2, 4, 8, 16)
HEAD = "151936x1024"
VARIANTS = {  # name: (linear_kernel, quantized_linear; None: float32 weights)
    "float32-mlx": ("mlx", None), "float32-few-row": ("few-row", None),
    "4bit-own-kernel": ("mlx", "own-kernel"), "4bit-few-row": ("few-row", "own-kernel"),
}  # fmt: skip
# at least: the head at 1 row against numpy's sgemv GB/s, at 8 rows against MLX's matmul
TARGETS = {"one_row_vs_sgemv": 0.8, "eight_rows_vs_mlx": 3.0}
FLOOR_TARGET = 1.3  # a step of 8 rows, at most this many times the bandwidth floor


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    record = measure_kernel(spec) if spec["part"] == "kernel" else measure_decode(spec)
    return {**record, "blas": harness.process_blas()}


def measure_kernel(spec: dict[str, Any]) -> dict[str, Any]:
    """GB/s of every (weight, rows, implementation), from the median of `iters` timings."""
    iters, table = spec["iters"], {}
    ceilings = {"sgemv_gbs": own_kernel.bandwidth_gbs(iters),
                "copy_gbs": copy_gbs(512, 3, mx.random.key(0))["copy_gbs"]["max"]}  # fmt: skip
    for n, k in SHAPES:
        parts, w = own_kernel.quantized(n, k)
        packed = sum(a.nbytes for a in parts)
        rows = {}
        for m in ROWS:
            x = mx.random.normal((m, k), key=mx.random.key(m))
            fns = {"few_row": lambda x=x, w=w: few_row_matmul(x, w),
                   "mlx_matmul": lambda x=x, w=w: x @ w.T,
                   "few_row_4bit": lambda x=x, q=parts: few_row_quantized_matmul(x, *q),
                   "day1_4bit": lambda x=x, q=parts: quantized_matvec(x, *q)}  # fmt: skip
            ms = own_kernel.timings(fns, iters)
            if m == 1:
                wn, xn = np.array(w), np.array(x[0])
                ms["numpy_sgemv"] = 1000 * own_kernel.numpy_s(lambda wn=wn, xn=xn: wn @ xn, iters)
                del wn
            rows[str(m)] = {f"{name}_gbs": (packed if "4bit" in name else w.nbytes) / t / 1e6
                            for name, t in ms.items()}  # fmt: skip
        table[f"{n}x{k}"] = {"float32_mb": w.nbytes / 1e6, "packed_mb": packed / 1e6, "rows": rows}
        del parts, w
        gc.collect()
    return {"part": "kernel", "iters": iters, "ceilings": ceilings, "kernel": table}


def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    kernel, path = VARIANTS[spec["variant"]]
    ckpt, weights = own_kernel.load_weights(spec, quantize=path is not None)
    model = ref.Qwen3Model(ckpt, quantized_linear=path, linear_kernel=kernel)
    del ckpt
    gc.collect()
    b = spec["rows"]
    cache = model.create_kv_cache()
    prompt = mx.broadcast_to(mx.arange(PROMPT_TOKENS) + 100, (b, PROMPT_TOKENS))  # [B, T]
    logits = model(prompt, 0, cache, logits_to_keep=1)
    step = lambda token, pos: model(token, pos, cache)
    times, _ = own_kernel.decode_times(step, logits, spec["decode_tokens"])
    step_s = harness.median(times)
    return {"part": "decode", "variant": spec["variant"], "rows": b, "weights_bytes": weights,
            "step_ms": harness.summarize(times, 1000), "tokens_per_s": b / step_s,
            "gbs": weights / step_s / 1e9}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args, model = own_kernel.parse_args(
        "few-row", "The few-row matmul against MLX's matmul, numpy's sgemv and the bandwidth, "
        "per weight and per decode step (5.4).", argv,
        {"--decode-rows": {"nargs": "+", "default": [1, 8]},
         "--decode-tokens": {"default": 16, "help": "timed steps, a run"}},
        "1 layer, 4 steps, 3 timings, 1 repeat")  # fmt: skip
    settings = {"rows": list(ROWS), "prompt_tokens": PROMPT_TOKENS, "warmup_steps": WARMUP_STEPS,
                "loadavg_at_start": list(os.getloadavg())}  # fmt: skip
    decodes = [{"variant": v, "rows": b} for b in args.decode_rows for v in VARIANTS]
    return own_kernel.run_parts(sys.modules[__name__], args, model, decodes, settings)


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
    """Medians over the repeats, the bandwidth floor of each step, the ratios the targets read."""
    med = harness.median
    kernels = [r for r in runs if r["part"] == "kernel"]
    kernel = {shape: {m: {key: med(r["kernel"][shape]["rows"][m][key] for r in kernels)
                          for key in row} for m, row in entry["rows"].items()}
              for shape, entry in kernels[0]["kernel"].items()}  # fmt: skip
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
    if "float32-few-row x8" in decode:
        ratios["step_of_8_vs_floor"] = decode["float32-few-row x8"]["vs_floor"]
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
