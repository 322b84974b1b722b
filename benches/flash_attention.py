"""Week 3 Day 5: what flash attention and pages read in place save, and what they cost.

Two experiments on the shapes of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128):

attention  One layer's causal attention over a whole prompt (L = S), random inputs: the course's
           grouped attention (the whole [H, L, S] score array), flash_attention at each
           --block-sizes, and mx.fast.scaled_dot_product_attention (MLX's fused kernel).
           Median time, and peak memory above the inputs (mx.reset_peak_memory /
           mx.get_peak_memory around one call).

decode     One batched decode step of a random-weight model with the 0.6B config cut to
           --num-layers layers, every request's cache filled to the context with random keys
           and values (the state a prefill leaves): paged caches read through the Week 2 gather
           path (update_and_fetch, then attention over the dense copy), paged caches read in
           place through one padded page table (the course's choice), the same one request at a
           time, the course's dense cache, and mlx-lm's Qwen3 with its own KV cache on the same
           weights. Every step is rewound afterwards, so each one runs at the same context.
           Median step time and peak memory of a step.

Methods take turns within every repeat, so a machine that drifts favours none of them.

    pdm run bench-flash-attention                                    # the full run
    pdm run bench-flash-attention --lengths 256 --contexts 128 --batches 1 2 \\
        --num-layers 1 --repeats 2 --warmup 1                        # a smoke run

Writes JSON (host, MLX, BLAS, arguments, every sample, medians, the goals checked) and a PNG.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import mlx.core as mx
from common import (
    RESULTS,
    BenchModel,
    arguments_json,
    bench_model_or_exit,
    bench_parser,
    check_outputs,
    host_info,
    log,
    log_blas,
    mlx_info,
    pyplot,
    restart_with_openblas,
    save_figure,
    write_json,
)

from tiny_llm_support import CheckpointError, blas_info, choose_device, mlx_lm_qwen3
from tiny_llm_support.cli import DTYPES, int_at_least

SCHEMA = "tiny-llm/bench-flash-attention/v1"
H_Q, H_KV, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention


# --- measuring -------------------------------------------------------------------------------


def peak_bytes(run: Callable[[], Any]) -> int:
    """Peak memory of one call above what was in use before it."""
    mx.eval(run())  # nothing left pending from before
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(run())
    return mx.get_peak_memory() - before


def take_turns(
    runs: dict[str, Callable[[], Any]], warmup: int, repeats: int, after: Callable[[str], None]
) -> dict[str, list[float]]:
    """Seconds per call of every run; in each repeat every run goes once, the order rotated."""
    names = list(runs)
    for name in names:
        for _ in range(warmup):
            mx.eval(runs[name]())
            after(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            mx.eval(runs[name]())
            samples[name].append(time.perf_counter() - start)
            after(name)
    return samples


def row(samples: list[float], peak: int) -> dict[str, Any]:
    return {
        "median_ms": statistics.median(samples) * 1000,
        "min_ms": min(samples) * 1000,
        "samples_ms": [s * 1000 for s in samples],
        "peak_bytes": peak,
        "peak_mib": peak / 2**20,
    }


# --- attention alone -------------------------------------------------------------------------


def attention_runs(pkg, q, k, v, block_sizes: Sequence[int]) -> dict[str, Callable[[], Any]]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    runs = {"dense": lambda: pkg.scaled_dot_product_attention_grouped(q, k, v, mask="causal")}
    for size in block_sizes:
        runs[f"flash-{size}"] = lambda size=size: pkg.flash_attention(q, k, v, block_size=size)
    runs["mx.fast"] = lambda: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask="causal"
    )
    return runs


def bench_attention(pkg, args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype = DTYPES[args.dtype]
    rows = []
    for length in args.lengths:
        key = mx.random.key(length)
        kq, kk, kv = mx.random.split(key, 3)
        q = mx.random.normal((1, H_Q, length, HEAD_DIM), key=kq).astype(dtype)
        k = mx.random.normal((1, H_KV, length, HEAD_DIM), key=kk).astype(dtype)
        v = mx.random.normal((1, H_KV, length, HEAD_DIM), key=kv).astype(dtype)
        mx.eval(q, k, v)
        runs = attention_runs(pkg, q, k, v, args.block_sizes)
        want = runs["mx.fast"]()
        errors = {name: mx.abs(run() - want).max().item() for name, run in runs.items()}
        peaks = {name: peak_bytes(run) for name, run in runs.items()}
        samples = take_turns(runs, args.warmup, args.repeats, lambda name: None)
        score_bytes = H_Q * length * length * q.itemsize
        for name in runs:
            rows.append(
                {
                    "length": length,
                    "method": name,
                    "max_abs_error_vs_mx_fast": errors[name],
                    "score_matrix_bytes": score_bytes,
                    **row(samples[name], peaks[name]),
                }
            )
            log(f"attention L=S={length:5d} {name:10s} {rows[-1]['median_ms']:9.1f} ms "
                f"peak {rows[-1]['peak_mib']:8.1f} MiB")  # fmt: skip
        del q, k, v, runs, want
        mx.clear_cache()
    return rows


# --- decode steps ----------------------------------------------------------------------------


def per_request_batching_cache(pkg):
    """The batching cache with the other choice for paged decode: each request walks its own
    page table, one after the other, instead of all of them through one padded table."""

    class PerRequest(pkg.BatchingKvCache):
        def attend(self, query, key, value):
            caches = [self.slots[i] for i in self.active_slots]
            rows = [slice(b, b + 1) for b in range(len(caches))]
            outs = [c.attend(query[r], key[r], value[r]) for c, r in zip(caches, rows)]
            return mx.concatenate(outs, axis=0)  # [B, H_q, 1, D]

    return PerRequest


class CourseDecode:
    """A batched decode step of the course's model over B request caches at one context."""

    def __init__(self, pkg, model, kv, kind: str, page_size: int, block: int):
        self.model = model
        batch = len(kv)
        self.context = kv[0][0][0].shape[2]
        self.pools = None
        if kind == "dense":
            requests = [model.create_kv_cache() for _ in range(batch)]
        else:
            # the pages every request needs for one more token, allocated up front as a server
            # would (a pool left to grow doubles, and would hold twice what it uses)
            pages = batch * -(-(self.context + 1) // page_size)
            in_place = kind != "paged-gather"
            self.pools = model.create_kv_pools(page_size, pages, read_in_place=in_place)
            for pool in self.pools:
                pool.attention_block = block
            requests = [model.create_paged_kv_cache(self.pools) for _ in range(batch)]
        for request, layers in zip(requests, kv):
            for layer_cache, (k, v) in zip(request, layers):
                layer_cache.update_and_fetch(k, v)  # the state a prefill leaves
        per_request = kind == "paged-in-place-per-request"
        batching = per_request_batching_cache(pkg) if per_request else pkg.BatchingKvCache
        self.batch = [batching(batch) for _ in range(model.num_hidden_layers)]
        for slot, request in enumerate(requests):
            for layer, layer_cache in zip(self.batch, request):
                layer.add_request(layer_cache, slot)
        for layer in self.batch:
            layer.materialize()
        self.tokens = mx.array([[1 + b] for b in range(batch)])

    def step(self) -> mx.array:
        offsets = [self.context] * self.tokens.shape[0]
        logits = self.model(self.tokens, offsets, self.batch)
        mx.eval(logits)
        return logits

    def rewind(self) -> None:
        for layer in self.batch:
            layer.rewind([self.context] * self.tokens.shape[0])


class MlxLmDecode:
    """The same step with mlx-lm's Qwen3 and its KVCache on the same weights."""

    def __init__(self, ckpt, kv):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = mlx_lm_qwen3(ckpt)
        self.cache = make_prompt_cache(self.model)
        for layer, layer_cache in enumerate(self.cache):
            keys = mx.concatenate([request[layer][0] for request in kv], axis=0)
            values = mx.concatenate([request[layer][1] for request in kv], axis=0)
            layer_cache.update_and_fetch(keys, values)  # [B, H_kv, S, D]
        mx.eval([c.state for c in self.cache])
        self.context = kv[0][0][0].shape[2]
        self.tokens = mx.array([[1 + b] for b in range(len(kv))])

    def step(self) -> mx.array:
        logits = self.model(self.tokens, cache=self.cache)
        mx.eval(logits)
        return logits

    def rewind(self) -> None:
        for layer_cache in self.cache:
            layer_cache.trim(layer_cache.offset - self.context)


def random_kv(config, batch: int, context: int, dtype, seed: int) -> list[list[tuple]]:
    """[request][layer] -> (keys, values), each [1, H_kv, context, D]."""
    key = mx.random.key(seed)
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    out = []
    for _ in range(batch):
        layers = []
        for _ in range(config.num_hidden_layers):
            key, a, b = mx.random.split(key, 3)
            pair = (mx.random.normal(shape, key=a).astype(dtype), mx.random.normal(shape, key=b).astype(dtype))  # fmt: skip
            mx.eval(*pair)
            layers.append(pair)
        out.append(layers)
    return out


def held_after_one_step(make: Callable[[], Any]) -> tuple[Any, int]:
    """A decode state, and the memory it holds once built and stepped once: its caches, plus
    whatever a step keeps from one call to the next (the batching cache's padded buffer)."""
    mx.clear_cache()
    before = mx.get_active_memory()
    state = make()
    state.step()
    state.rewind()
    mx.clear_cache()
    return state, mx.get_active_memory() - before


def decode_states(pkg, model, ckpt, kv, args: argparse.Namespace) -> tuple[dict, dict]:
    """Every method's decode state over the same keys/values, and the memory each holds."""
    kinds = [k for k in DECODE_KINDS if len(kv) > 1 or k != "paged-in-place-per-request"]
    makers = {
        k: lambda k=k: CourseDecode(pkg, model, kv, k, args.page_size, args.paged_block)
        for k in kinds
    }
    if not args.no_mlx_lm:
        makers["mlx-lm"] = lambda: MlxLmDecode(ckpt, kv)
    states, held = {}, {}
    for name, make in makers.items():
        states[name], held[name] = held_after_one_step(make)
    return states, held


def measure_decode(states: dict[str, Any], args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Each method's largest logit difference from the gather path, peak bytes of one step and
    step times; every step is rewound to the context after it ran."""
    runs = {name: state.step for name, state in states.items()}

    def rewind(name: str) -> None:
        states[name].rewind()

    def step_and_rewind(name: str) -> mx.array:
        logits = runs[name]()
        rewind(name)
        return logits

    want = step_and_rewind("paged-gather")
    errors = {name: mx.abs(step_and_rewind(name) - want).max().item() for name in runs}
    peaks = {name: peak_bytes(lambda name=name: step_and_rewind(name)) for name in runs}
    return errors, peaks, take_turns(runs, args.warmup, args.repeats, rewind)


DECODE_KINDS = ("paged-gather", "paged-in-place", "paged-in-place-per-request", "dense")


def bench_decode(
    pkg, args: argparse.Namespace, bench_model: BenchModel
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ckpt = bench_model.load(args.dtype)
    model = pkg.Qwen3Model(ckpt)
    # one throwaway step, so that what the model builds on first use (its RoPE table) counts
    # in no method's held memory
    mx.eval(model(mx.array([[1]]), 0, model.create_kv_cache()))
    dtype = DTYPES[args.dtype]
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            kv = random_kv(ckpt.config, batch, context, dtype, seed=context + batch)
            states, held = decode_states(pkg, model, ckpt, kv, args)
            del kv
            errors, peaks, samples = measure_decode(states, args)
            for name in states:
                rows.append(
                    {
                        "context": context,
                        "batch": batch,
                        "method": name,
                        "max_abs_logit_diff_vs_gather": errors[name],
                        "held_bytes": held[name],
                        "held_mib": held[name] / 2**20,
                        **row(samples[name], peaks[name]),
                    }
                )
                log(f"decode context {context:5d} batch {batch} {name:27s} "
                    f"{rows[-1]['median_ms']:8.1f} ms peak {rows[-1]['peak_mib']:8.1f} MiB "
                    f"held {rows[-1]['held_mib']:8.1f} MiB")  # fmt: skip
            del states
            mx.clear_cache()
    return rows, bench_model.describe()


# --- report ----------------------------------------------------------------------------------


def goals(attention: list[dict], decode: list[dict]) -> dict[str, Any]:
    """The issue's two goals, computed from the rows: flash peak memory at the longest length
    at most a quarter of the dense path's; in-place decode at the longest context no slower
    than the gather path."""
    out: dict[str, Any] = {}
    if attention:
        longest = max(r["length"] for r in attention)
        at = {r["method"]: r for r in attention if r["length"] == longest}
        out["attention_length"] = longest
        out["flash_peak_over_dense"] = {
            m: at[m]["peak_bytes"] / at["dense"]["peak_bytes"] for m in at if m.startswith("flash")
        }
        out["flash_time_over_dense"] = {
            m: at[m]["median_ms"] / at["dense"]["median_ms"] for m in at if m.startswith("flash")
        }
    if decode:
        longest = max(r["context"] for r in decode)
        out["decode_context"] = longest
        out["in_place_time_over_gather"] = {}
        for batch in sorted({r["batch"] for r in decode}):
            at = {r["method"]: r for r in decode if (r["context"], r["batch"]) == (longest, batch)}
            out["in_place_time_over_gather"][f"batch {batch}"] = (
                at["paged-in-place"]["median_ms"] / at["paged-gather"]["median_ms"]
            )
    return out


def plot(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    attention = report["attention"]
    for method in dict.fromkeys(r["method"] for r in attention):
        rows = [r for r in attention if r["method"] == method]
        left.plot([r["length"] for r in rows], [r["peak_mib"] for r in rows], "o-", label=method)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("prompt length L = S (tokens)")
    left.set_ylabel("peak memory above the inputs (MiB)")
    left.set_title("one layer's attention, Qwen3-0.6B shape")
    left.legend(fontsize=8)
    decode = report["decode"]
    cases = list(dict.fromkeys((r["context"], r["batch"]) for r in decode))
    methods = list(dict.fromkeys(r["method"] for r in decode))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        xs, ys = [], []
        for c, case in enumerate(cases):
            hit = [
                r for r in decode if (r["context"], r["batch"]) == case and r["method"] == method
            ]
            if hit:
                xs.append(c + i * width)
                ys.append(hit[0]["median_ms"])
        right.bar(xs, ys, width=width, label=method)
    right.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    right.set_xticklabels([f"ctx {c}\nbatch {b}" for c, b in cases], fontsize=8)
    right.set_ylabel("decode step (ms, median)")
    right.set_title(f"decode step, {report['decode_model']['num_layers']} layers")
    right.legend(fontsize=7)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("bench-flash-attention", __doc__.split("\n\n")[0])
    p.add_argument("--solution", choices=("ref", "tiny_llm"), default="ref")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="cpu")
    p.add_argument(
        "--no-openblas", action="store_true",
        help="keep the wheel's bundled BLAS (on Linux the script otherwise restarts itself "
        "with Debian's OpenBLAS preloaded, when installed)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--lengths", type=int_at_least(1), nargs="+", default=[1024, 2048, 4096],
        help="attention: prompt lengths L = S",
    )  # fmt: skip
    p.add_argument("--block-sizes", type=int_at_least(1), nargs="+", default=[128, 512])
    p.add_argument("--contexts", type=int_at_least(1), nargs="+", default=[1024, 4096])
    p.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 4])
    p.add_argument(
        "--model", default="qwen3-0.6b",
        help="decode: qwen3-0.6b (its config, random weights), tiny, or a checkpoint directory",
    )  # fmt: skip
    p.add_argument("--num-layers", type=int_at_least(1), default=8, help="decode model layers")
    p.add_argument("--page-size", type=int_at_least(1), default=16)
    p.add_argument(
        "--paged-block", type=int_at_least(1), default=128,
        help="token slots the paged walk reads per block (pool.attention_block)",
    )  # fmt: skip
    p.add_argument("--no-mlx-lm", action="store_true", help="leave mlx-lm out of the decode runs")
    p.add_argument("--skip", choices=("attention", "decode"), default=None)
    p.add_argument("--warmup", type=int_at_least(0), default=2)
    p.add_argument("--repeats", type=int_at_least(1), default=7)
    p.add_argument("--json-output", type=Path, default=RESULTS / "flash-attention.json")
    p.add_argument("--plot-output", type=Path, default=None, help="default: the JSON with .png")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    restart_with_openblas(args)
    bench_model = bench_model_or_exit(parser, args.model, num_layers=args.num_layers)
    png = args.plot_output or args.json_output.with_suffix(".png")
    check_outputs(parser, args.json_output, None if args.no_plot else png)
    device = choose_device(args.device)
    pkg = __import__({"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}[args.solution])
    log(
        f"attention: H_q {H_Q}, H_kv {H_KV}, head_dim {HEAD_DIM}; decode: model "
        f"{bench_model.name} ({bench_model.num_layers} layers, "
        f"{'random' if bench_model.random_weights else 'checkpoint'} weights); "
        f"{args.dtype} on {device}, solution {pkg.__name__}"
    )
    log_blas()
    started = time.time()
    attention = [] if args.skip == "attention" else bench_attention(pkg, args)
    decoding = args.skip != "decode"
    try:
        decode, decode_model = bench_decode(pkg, args, bench_model) if decoding else ([], None)
    except CheckpointError as e:  # weights that resolving the model could not check unread
        raise SystemExit(f"error: {e}") from None
    report = {
        "schema": SCHEMA,
        "host": host_info(),
        "mlx": mlx_info(),
        "blas": blas_info(),
        "device": device,
        "args": arguments_json(args),
        "attention_shape": {"H_q": H_Q, "H_kv": H_KV, "head_dim": HEAD_DIM, "batch": 1},
        "decode_model": decode_model,
        "attention": attention,
        "decode": decode,
        "goals": goals(attention, decode),
        "wall_s": time.time() - started,
    }
    write_json(args.json_output, report)
    log(f"wrote {args.json_output}")
    if not args.no_plot and attention and decode and plot(report, png):
        log(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))
