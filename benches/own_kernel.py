"""5.1: the course's own quantized matvec (kernels.quantized_matvec) against what it replaces.
Every run in a fresh process, in plan_runs' order (forward, then reversed, ...):

- kernel: the machine's weight-reading bandwidth (numpy's float32 sgemv on a [151936, 1024]
  weight), then three weights of the Qwen3-0.6B shape (N x K, 4 bits, groups of 64, float32, x
  one row) timed one after the other: the fast kernel, the plain loop (3072x1024 only), MLX's
  mx.quantized_matmul and a float32 matmul with the dequantized weight; and the 3072x1024 weight
  at 1 to 64 rows, the kernel against dequantizing for the call (the OWN_KERNEL_MAX_ROWS
  crossover).
- decode: batch 1 greedy decode of --decode-tokens tokens after an 8-token prompt on the
  Qwen3-0.6B shape (--num-layers, random float32 weights): float32, 4-bit on the own kernel
  (quantized_linear="own-kernel"), 4-bit on MLX's kernel ("kernel") and mlx-lm's model on the
  same 4-bit weights.

Targets (the issue): own-kernel decode >= 2.5x float32's tokens/s and >= 5x mlx-lm 4-bit's, and
its weight reading at >= 70% of the machine's bandwidth.

    pdm run bench-own-kernel [--num-layers 8] [--decode-tokens 32] [--repeats 3] [--iters 20]
    pdm run bench-own-kernel --quick          # a smoke run: 1 layer, 4 tokens, 1 repeat

Writes benches/results/own-kernel-<model>-<N>layers-<host>.json (or --json-output).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benches import harness
from tiny_llm_support.cli import int_at_least

BITS, GROUP_SIZE = 4, 64
SHAPES = ((3072, 1024), (1024, 3072), (151936, 1024))  # gate/up, down, the tied head
ROWS = (1, 2, 4, 8, 16, 32, 64)
BANDWIDTH_SHAPE = (151936, 1024)
VARIANTS = {"float32": None, "own-kernel-4bit": "own-kernel", "mlx-kernel-4bit": "kernel",
            "mlx-lm-4bit": None}  # fmt: skip
PROMPT_TOKENS, WARMUP_STEPS = 8, 2
SETTLE_S = 0.5  # before each kernel's timings: OpenBLAS's threads stop spinning
TARGETS = {"own_vs_float32": 2.5, "own_vs_mlx_lm_4bit": 5.0, "own_bandwidth_fraction": 0.7}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    record = measure_kernel(spec) if spec["part"] == "kernel" else measure_decode(spec)
    return {**record, "blas": harness.process_blas()}


def timings(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median ms of each fn (built and evaluated): each in a block of its own, after a pause and
    two warm-up calls. Not in turns: after a float32 matmul OpenBLAS's threads spin for a while
    and take the second core from the kernel's helper thread (measured: the 151936x1024 kernel
    takes 2x as long right after one)."""
    import mlx.core as mx

    from benches.ceilings import timed

    times: dict[str, list[float]] = {}
    for name, fn in fns.items():
        time.sleep(SETTLE_S)
        timed(fn), timed(fn)
        times[name] = [timed(fn) for _ in range(iters)]
    mx.clear_cache()
    return {name: 1000 * harness.median(ts) for name, ts in times.items()}


def bandwidth_gbs(iters: int) -> float:
    """numpy's float32 sgemv, w [151936, 1024] @ x: the weight's bytes over the median time."""
    import numpy as np

    w = np.random.default_rng(0).standard_normal(BANDWIDTH_SHAPE, dtype=np.float32)
    x = np.ones(BANDWIDTH_SHAPE[1], dtype=np.float32)
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        w @ x
        times += [time.perf_counter() - start] * (i >= 2)
    return w.nbytes / harness.median(times) / 1e9


def quantized(n: int, k: int):
    """A random weight [n, k] quantized (codes, scales, biases) and its dequantized float32."""
    import mlx.core as mx

    w = 0.02 * mx.random.normal((n, k), key=mx.random.key(n + k))
    parts = mx.quantize(w, group_size=GROUP_SIZE, bits=BITS)
    wf = mx.dequantize(*parts, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(*parts, wf)
    return parts, wf


def measure_kernel(spec: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from tiny_llm_ref.kernels import quantized_matvec

    iters, kernel = spec["iters"], {}
    bandwidth = bandwidth_gbs(iters)
    gc.collect()
    for n, k in SHAPES:
        (codes, scales, biases), wf = quantized(n, k)
        x = mx.random.normal((1, k), key=mx.random.key(1))
        q = (x, codes, scales, biases, GROUP_SIZE, BITS)
        fns = {"fast": lambda q=q: quantized_matvec(*q, True),
               "mlx_quantized_matmul": lambda q=q: mx.quantized_matmul(
                   *q[:4], transpose=True, group_size=GROUP_SIZE, bits=BITS),
               "float32_matmul": lambda x=x, wf=wf: x @ wf.T}  # fmt: skip
        if (n, k) == SHAPES[0]:
            fns["plain"] = lambda q=q: quantized_matvec(*q, False)
        ms = timings(fns, iters)
        packed = codes.nbytes + scales.nbytes + biases.nbytes
        kernel[f"{n}x{k}"] = {
            "packed_mb": packed / 1e6, "float32_mb": wf.nbytes / 1e6, "fast_ms": ms["fast"],
            "plain_ms": ms.get("plain"), "mlx_quantized_matmul_ms": ms["mlx_quantized_matmul"],
            "float32_matmul_ms": ms["float32_matmul"], "fast_gbs": packed / ms["fast"] / 1e6,
            "float32_gbs": wf.nbytes / ms["float32_matmul"] / 1e6,
            "fast_vs_mlx": ms["mlx_quantized_matmul"] / ms["fast"],
            "fast_vs_float32": ms["float32_matmul"] / ms["fast"],
        }  # fmt: skip
        del codes, scales, biases, wf, fns, q
        gc.collect()
    (codes, scales, biases), _ = quantized(*SHAPES[0])
    rows = []
    for m in ROWS:
        x = mx.random.normal((m, SHAPES[0][1]), key=mx.random.key(m))
        ms = timings({
            "kernel": lambda x=x: quantized_matvec(x, codes, scales, biases, GROUP_SIZE, BITS),
            "dequantize_matmul": lambda x=x: x @ mx.dequantize(
                codes, scales, biases, group_size=GROUP_SIZE, bits=BITS).T,
        }, iters)  # fmt: skip
        rows.append({"rows": m, "kernel_ms": ms["kernel"],
                     "dequantize_matmul_ms": ms["dequantize_matmul"]})  # fmt: skip
    return {"part": "kernel", "iters": iters, "bandwidth_gbs": bandwidth, "kernel": kernel,
            "rows": rows}  # fmt: skip


def rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return None


def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Load (and quantize), then the prompt, WARMUP_STEPS untimed steps and the timed ones."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import tiny_llm_ref as ref
    from benches.model_impls import MlxLmImpl
    from benches.quantization import model_bytes
    from tiny_llm_support import quantize_checkpoint

    variant = spec["variant"]
    _, ckpt = harness.load_weights(spec["model"], "float32")
    if variant != "float32":
        ckpt = quantize_checkpoint(ckpt, BITS, GROUP_SIZE)  # the float arrays go with the old one
        mx.eval(list(ckpt.weights.values()))
    gc.collect()
    mx.clear_cache()
    prompt = mx.arange(PROMPT_TOKENS)[None] + 100  # [1, T], ordinary Qwen3 ids
    if variant == "mlx-lm-4bit":
        impl = MlxLmImpl(ckpt)
        weights = sum(v.nbytes for _, v in tree_flatten(impl.model.parameters()))
        held = weights
        logits, cache = impl.prefill(prompt)
        step = lambda token, pos: impl.decode_step(token, cache, pos)[0]  # noqa: E731
    else:
        model = ref.Qwen3Model(ckpt, quantized_linear=VARIANTS[variant])
        held, cache = model_bytes(model), model.create_kv_cache()  # weights and RoPE tables
        weights = sum({id(w): w.nbytes for w in ckpt.weights.values()}.values())  # tied: once
        logits = model(prompt, 0, cache, logits_to_keep=1)
        step = lambda token, pos: model(token, pos, cache)  # noqa: E731
    del ckpt
    gc.collect()
    resident = rss_mb()
    token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    mx.eval(token)
    times, tokens = [], []
    for i in range(WARMUP_STEPS + spec["decode_tokens"]):
        start = time.perf_counter()
        logits = step(token, PROMPT_TOKENS + i)
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(token)
        times += [time.perf_counter() - start] * (i >= WARMUP_STEPS)
        tokens.append(token.item())
    step_s = harness.median(times)
    return {"part": "decode", "variant": variant, "weights_bytes": weights, "held_bytes": held,
            "rss_mb": resident,
            "step_ms": harness.summarize(times, 1000), "tokens_per_s": 1 / step_s,
            "gbs": weights / step_s / 1e9, "tokens": tokens}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-own-kernel", "The own quantized matvec kernel against MLX's, "
                             "float32 and mlx-lm, per weight and per decode step (chapter 5.1).")  # fmt: skip
    p.add_argument("--model", default="qwen3-0.6b", help="a shortcut with an embedded config")
    p.add_argument("--num-layers", type=int_at_least(1), default=8)
    p.add_argument("--decode-tokens", type=int_at_least(1), default=32, help="timed, a run")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timings of each kernel")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="runs of each part")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 layer, 4 tokens, 3 timings, 1 repeat")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    harness.add_output_arguments(p, "own-kernel-<model>-<N>layers-<host>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_layers, args.decode_tokens, args.iters, args.repeats = 1, 4, 3, 1
    model = harness.bench_model_or_exit(p, args.model, random=True, num_layers=args.num_layers,
                                        weight_seed=args.seed)  # fmt: skip
    name = f"own-kernel-{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"{name}.json")
    started, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-own-kernel-") as tmp:
        harness.write_random_weights(model, Path(tmp), "float32")
        items = [{"part": "kernel", "iters": args.iters}]
        items += [{"part": "decode", "variant": v, "model": model.to_dict(),
                   "decode_tokens": args.decode_tokens} for v in VARIANTS]  # fmt: skip
        specs = [{**item, "repeat": r, "order": order}
                 for r, order, item in harness.plan_runs(items, args.repeats)]  # fmt: skip
        runs = harness.run_plan(__name__, specs, Path(tmp), dict(os.environ), label, run_line)
    for run in runs:
        run.pop("model", None)  # the config is in settings, once
    summary = summarize(runs)
    settings = {**harness.arguments_json(args, ("json_output",)), "model": model.describe(),
                "bits": BITS, "group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS,
                "warmup_steps": WARMUP_STEPS, "rows": list(ROWS),
                "bandwidth_shape": list(BANDWIDTH_SHAPE), "loadavg_at_start": list(load),
                "own_kernel_max_rows": own_kernel_max_rows()}  # fmt: skip
    report = harness.report("own-kernel", started, settings, runs, summary, targets(summary))
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0


def own_kernel_max_rows() -> int:
    from tiny_llm_ref.quantize import OWN_KERNEL_MAX_ROWS

    return OWN_KERNEL_MAX_ROWS


def label(spec: dict[str, Any]) -> str:
    return "kernel timings" if spec["part"] == "kernel" else f"decode {spec['variant']}"


def run_line(run: dict[str, Any]) -> str:
    if run["part"] == "kernel":
        head = run["kernel"]["151936x1024"]
        return (f"bandwidth {run['bandwidth_gbs']:.1f} GB/s; head: fast {head['fast_ms']:.2f} ms, "
                f"mlx {head['mlx_quantized_matmul_ms']:.2f}, float32 {head['float32_matmul_ms']:.2f}")  # fmt: skip
    return (f"decode {run['variant']}: {run['step_ms']['median']:.1f} ms a step, "
            f"{run['tokens_per_s']:.1f} tokens/s, {run['gbs']:.1f} GB/s")  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of each run's medians, and the ratios the targets read."""
    kernels = [r for r in runs if r["part"] == "kernel"]
    med = lambda values: harness.median(list(values))  # noqa: E731
    kernel = {shape: {key: med(r["kernel"][shape][key] for r in kernels)
                      if kernels[0]["kernel"][shape][key] is not None else None
                      for key in row} for shape, row in kernels[0]["kernel"].items()}  # fmt: skip
    rows = [{key: med(r["rows"][i][key] for r in kernels) for key in row}
            for i, row in enumerate(kernels[0]["rows"])]  # fmt: skip
    decode = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["part"] == "decode" and r["variant"] == variant]
        decode[variant] = {"tokens_per_s": med(r["tokens_per_s"] for r in mine),
                           "step_ms": med(r["step_ms"]["median"] for r in mine),
                           "weights_mb": mine[0]["weights_bytes"] / 1e6,
                           "gbs": med(r["gbs"] for r in mine),
                           "rss_mb": med(r["rss_mb"] for r in mine)}  # fmt: skip
    bandwidth = med(r["bandwidth_gbs"] for r in kernels)
    own, f32, lm = (decode[v] for v in ("own-kernel-4bit", "float32", "mlx-lm-4bit"))
    ratios = {"own_vs_float32": own["tokens_per_s"] / f32["tokens_per_s"],
              "own_vs_mlx_lm_4bit": own["tokens_per_s"] / lm["tokens_per_s"],
              "own_bandwidth_fraction": own["gbs"] / bandwidth,
              "own_weights_vs_float32": own["weights_mb"] / f32["weights_mb"]}  # fmt: skip
    return {"bandwidth_gbs": bandwidth, "kernel": kernel, "rows": rows, "decode": decode,
            "ratios": ratios}  # fmt: skip


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    value = summary["ratios"]
    return {k: {"target": t, "value": value[k], "met": value[k] >= t} for k, t in TARGETS.items()}


def summary_table(report: dict[str, Any]) -> str:
    s, n = report["summary"], harness.number
    kernel = [[shape, f"{r['packed_mb']:.2f}", f"{r['float32_mb']:.1f}", f"{r['fast_ms']:.3f}",
               n(r["plain_ms"], ".2f"), f"{r['mlx_quantized_matmul_ms']:.3f}",
               f"{r['float32_matmul_ms']:.3f}", f"{r['fast_gbs']:.1f}", f"{r['float32_gbs']:.1f}",
               f"{r['fast_vs_mlx']:.2f}", f"{r['fast_vs_float32']:.2f}"]
              for shape, r in s["kernel"].items()]  # fmt: skip
    rows = [[str(r["rows"]), f"{r['kernel_ms']:.3f}", f"{r['dequantize_matmul_ms']:.3f}"]
            for r in s["rows"]]  # fmt: skip
    decode = [[v, f"{r['tokens_per_s']:.2f}", f"{r['step_ms']:.1f}", f"{r['weights_mb']:.0f}",
               f"{r['gbs']:.2f}", n(r["rss_mb"])] for v, r in s["decode"].items()]  # fmt: skip
    goals = [f"{k} >= {t['target']}: {t['value']:.2f}, {harness.met(t['met'])}"
             for k, t in report["targets"].items()]  # fmt: skip
    return "\n".join([
        f"bandwidth (numpy sgemv): {s['bandwidth_gbs']:.1f} GB/s",
        harness.table(["N x K", "packed MB", "float32 MB", "fast ms", "plain ms", "mlx ms",
                       "float32 ms", "fast GB/s", "float32 GB/s", "vs mlx", "vs float32"], kernel),
        harness.table(["rows", "kernel ms", "dequantize+matmul ms"], rows),
        harness.table(["decode", "tokens/s", "step ms", "weights MB", "GB/s", "RSS MB"], decode),
        *goals,
        f"own weights / float32: {s['ratios']['own_weights_vs_float32']:.3f}",
    ])  # fmt: skip
