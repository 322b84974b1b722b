"""5.1: the course's own quantized matvec (kernels.quantized_matvec) against what it replaces, each
run in a fresh process. Part "kernel": numpy's float32 sgemv (the machine's bandwidth), then three
Qwen3-0.6B weights at 4 bits x one row (the fast kernel, the plain loop, mx.quantized_matmul, a
float32 matmul) and 1 to 64 rows (the kernel against dequantizing: the OWN_KERNEL_MAX_ROWS
crossover). Part "decode": batch 1 greedy decode on the Qwen3-0.6B shape (random weights) in
float32, 4-bit on the own kernel, on MLX's kernel, and mlx-lm's model on the same 4-bit weights.

    pdm run bench-own-kernel [--num-layers 8] [--decode-tokens 32] [--repeats 3] [--quick]
"""

import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import tiny_llm_ref as ref
from benches import harness
from benches.ceilings import timed
from tiny_llm_ref.kernels import quantized_matvec
from tiny_llm_ref.quantize import OWN_KERNEL_MAX_ROWS
from tiny_llm_support import quantize_checkpoint
from tiny_llm_support.cli import int_at_least

BITS, GROUP_SIZE = 4, 64
SHAPES = ((3072, 1024), (1024, 3072), (151936, 1024))  # gate/up, down, the tied head
ROWS = (1, 2, 4, 8, 16, 32, 64)
BANDWIDTH_SHAPE = (151936, 1024)
VARIANTS = {"float32": None, "own-kernel-4bit": "own-kernel", "mlx-kernel-4bit": "kernel",
            "mlx-lm-4bit": None}  # fmt: skip
PROMPT_TOKENS, WARMUP_STEPS = 8, 2
SETTLE_S = 0.5  # before each kernel's timings: OpenBLAS's threads stop spinning
# own-kernel decode against float32's and mlx-lm 4-bit's tokens/s, its share of the bandwidth
TARGETS = {"own_vs_float32": 2.5, "own_vs_mlx_lm_4bit": 5.0, "own_bandwidth_fraction": 0.7}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    record = measure_kernel(spec) if spec["part"] == "kernel" else measure_decode(spec)
    return {**record, "blas": harness.process_blas()}


def timings(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median ms of each fn (built and evaluated), each in a block of its own after a pause and two
    warm-ups. Not in turns: OpenBLAS's threads spin a while after a float32 matmul and take the
    second core from the kernel's helper thread (the 151936x1024 kernel took 2x as long)."""
    times: dict[str, list[float]] = {}
    for name, fn in fns.items():
        time.sleep(SETTLE_S)
        timed(fn), timed(fn)
        times[name] = [timed(fn) for _ in range(iters)]
    mx.clear_cache()
    return {name: 1000 * harness.median(ts) for name, ts in times.items()}


def numpy_s(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds of a numpy call, after two warm-up calls."""
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        fn()
        times += [time.perf_counter() - start] * (i >= 2)
    return harness.median(times)


def bandwidth_gbs(iters: int) -> float:
    """numpy's float32 sgemv, w [151936, 1024] @ x: the weight's bytes over the median time."""
    w = np.random.default_rng(0).standard_normal(BANDWIDTH_SHAPE, dtype=np.float32)
    x = np.ones(BANDWIDTH_SHAPE[1], dtype=np.float32)
    return w.nbytes / numpy_s(lambda: w @ x, iters) / 1e9


def quantized(n: int, k: int):
    """A random weight [n, k] quantized (codes, scales, biases) and its dequantized float32."""
    w = 0.02 * mx.random.normal((n, k), key=mx.random.key(n + k))
    parts = mx.quantize(w, group_size=GROUP_SIZE, bits=BITS)
    wf = mx.dequantize(*parts, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(*parts, wf)
    return parts, wf


def measure_kernel(spec: dict[str, Any]) -> dict[str, Any]:
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


def load_weights(spec: dict[str, Any], quantize: bool):
    """The run's random float32 weights (4-bit with `quantize`) and their bytes (tied: once)."""
    _, ckpt = harness.load_weights(spec["model"], "float32")
    if quantize:
        ckpt = quantize_checkpoint(ckpt, BITS, GROUP_SIZE)  # the float arrays go with the old one
        mx.eval(list(ckpt.weights.values()))
    return ckpt, sum({id(w): w.nbytes for w in ckpt.weights.values()}.values())


def decode_times(step: Callable, logits, steps: int) -> tuple[list[float], list]:
    """Greedy decode, step(token, position) -> logits: the seconds of `steps` steps after
    WARMUP_STEPS untimed ones, and every step's tokens [B, 1]."""
    token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    mx.eval(token)
    times, tokens = [], []
    for i in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        token = mx.argmax(step(token, PROMPT_TOKENS + i)[:, -1, :], axis=-1)[:, None]
        mx.eval(token)
        times += [time.perf_counter() - start] * (i >= WARMUP_STEPS)
        tokens.append(token)
    return times, tokens


def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    from benches.model_impls import MlxLmImpl
    from benches.quantization import model_bytes

    variant = spec["variant"]
    ckpt, weights = load_weights(spec, quantize=variant != "float32")
    gc.collect()
    mx.clear_cache()
    prompt = mx.arange(PROMPT_TOKENS)[None] + 100  # [1, T], ordinary Qwen3 ids
    if variant == "mlx-lm-4bit":
        impl = MlxLmImpl(ckpt)
        weights = held = sum(v.nbytes for _, v in tree_flatten(impl.model.parameters()))
        logits, cache = impl.prefill(prompt)
        step = lambda token, pos: impl.decode_step(token, cache, pos)[0]
    else:
        model = ref.Qwen3Model(ckpt, quantized_linear=VARIANTS[variant])
        held, cache = model_bytes(model), model.create_kv_cache()  # weights and RoPE tables
        logits = model(prompt, 0, cache, logits_to_keep=1)
        step = lambda token, pos: model(token, pos, cache)
    del ckpt
    gc.collect()
    resident = harness.rss_bytes(os.getpid())
    times, tokens = decode_times(step, logits, spec["decode_tokens"])
    step_s = harness.median(times)
    return {"part": "decode", "variant": variant, "weights_bytes": weights, "held_bytes": held,
            "rss_mb": resident / 1e6 if resident else None,
            "step_ms": harness.summarize(times, 1000), "tokens_per_s": 1 / step_s,
            "gbs": weights / step_s / 1e9, "tokens": [t.item() for t in tokens]}  # fmt: skip


def parse_args(bench: str, description: str, argv, decode: dict[str, dict], quick: str):
    """bench-own-kernel's and bench-few-row's command line, and the model it names."""
    p = harness.bench_parser(f"bench-{bench}", description)
    p.add_argument("--model", default="qwen3-0.6b", help="a shortcut with an embedded config")
    counts = {"--num-layers": {"default": 8}, **decode,
              "--iters": {"default": 20, "help": "timings of each kernel"},
              "--repeats": {"default": 3, "help": "runs of each part"}}  # fmt: skip
    for flag, options in counts.items():
        p.add_argument(flag, type=int_at_least(1), **options)
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    harness.add_output_arguments(p, f"{bench}-<model>-<N>layers-<host>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_layers, args.decode_tokens, args.iters, args.repeats = 1, 4, 3, 1
    model = harness.bench_model_or_exit(p, args.model, random=True, num_layers=args.num_layers,
                                        weight_seed=args.seed)  # fmt: skip
    name = f"{bench}-{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"{name}.json")
    return args, model


def run_parts(module: ModuleType, args, model, decodes: list[dict], settings: dict) -> int:
    """The kernel part and each of `decodes` in fresh processes, then the report of `module`
    (its label, run_line, summarize, targets and summary_table) with `settings` after the
    arguments and the model."""
    bench = module.__name__.rpartition(".")[2].replace("_", "-")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"bench-{bench}-") as tmp:
        harness.write_random_weights(model, Path(tmp), "float32")
        items = [{"part": "kernel", "iters": args.iters}]
        items += [{"part": "decode", **decode, "model": model.to_dict(),
                   "decode_tokens": args.decode_tokens} for decode in decodes]  # fmt: skip
        specs = [{**item, "repeat": r, "order": order}
                 for r, order, item in harness.plan_runs(items, args.repeats)]  # fmt: skip
        runs = harness.run_plan(module.__name__, specs, Path(tmp), dict(os.environ),
                                module.label, module.run_line)  # fmt: skip
    summary = module.summarize(runs)
    settings = {**harness.arguments_json(args, ("json_output",)), "model": model.describe(),
                **settings}  # fmt: skip
    report = harness.report(bench, started, settings, runs, summary, module.targets(summary))
    harness.write_report(args, report, module.summary_table, seconds=report["host"]["duration_s"])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, model = parse_args(
        "own-kernel", "The own quantized matvec kernel against MLX's, float32 and mlx-lm, per "
        "weight and per decode step (chapter 5.1).", argv,
        {"--decode-tokens": {"default": 32, "help": "timed, a run"}},
        "1 layer, 4 tokens, 3 timings, 1 repeat")  # fmt: skip
    settings = {"bits": BITS, "group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS,
                "warmup_steps": WARMUP_STEPS, "rows": list(ROWS),
                "bandwidth_shape": list(BANDWIDTH_SHAPE), "loadavg_at_start": list(os.getloadavg()),
                "own_kernel_max_rows": OWN_KERNEL_MAX_ROWS}  # fmt: skip
    decodes = [{"variant": v} for v in VARIANTS]
    return run_parts(sys.modules[__name__], args, model, decodes, settings)


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
    med = harness.median  # None values left out: plain_ms is None but on the first weight
    kernel = {shape: {key: med(r["kernel"][shape][key] for r in kernels) for key in row}
              for shape, row in kernels[0]["kernel"].items()}  # fmt: skip
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
