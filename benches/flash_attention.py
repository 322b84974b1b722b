"""bench-flash-attention (Week 3 Day 5): what flash attention and pages read in place save, and
what they cost, on the shapes of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128).

attention  one layer's causal attention over L = S random tokens: grouped attention (the whole
           [H, L, S] scores), flash_attention at each --block-sizes, and mx.fast.
decode     one batched decode step of the model over random caches: paged (gather, in place
           through one padded page table or a request at a time), dense, and mlx-lm.
Median times and the peak memory of one call; the methods take turns, decode steps rewound.

    pdm run bench-flash-attention --lengths 256 --contexts 128 --batches 1 2 --num-layers 1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness
from benches import model_impls as impls
from benches.ceilings import take_turns
from benches.harness import log
from benches.model_impls import KV
from tiny_llm_support import choose_device
from tiny_llm_support.cli import DTYPES, int_at_least, load_solution

H_Q, H_KV, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention
DECODE_KINDS = ("paged-gather", "paged-in-place", "paged-in-place-per-request", "dense")


def peak_bytes(run: Callable[[], Any]) -> int:
    """Peak memory of one call above what was in use before it."""
    mx.eval(run())  # nothing left pending from before
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(run())
    return mx.get_peak_memory() - before


def measure(runs: dict[str, Callable], reference: str, args, after=lambda name: None) -> dict:
    """name -> (the largest difference of its output from `reference`'s, its peak memory and
    the times of --repeats calls after --warmup, taking turns in plan_runs' order). after(name)
    follows every call (a decode step is rewound)."""

    def once(name: str) -> mx.array:
        out = runs[name]()
        after(name)
        return out

    want = once(reference)
    errors = {name: mx.abs(once(name) - want).max().item() for name in runs}
    peaks = {name: peak_bytes(partial(once, name)) for name in runs}
    samples = take_turns(runs, args.repeats, args.warmup, after)
    return {name: (errors[name], timing(samples[name], peaks[name])) for name in runs}


def timing(samples: list[float], peak: int) -> dict[str, Any]:
    return {"median_ms": statistics.median(samples) * 1000, "min_ms": min(samples) * 1000,
            "samples_ms": [s * 1000 for s in samples], "peak_bytes": peak,
            "peak_mib": peak / 2**20}  # fmt: skip


def attention_rows(pkg, length: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method on q [1, H_q, L, D], k and v [1, H_kv, L, D]."""
    kq, kk, kv = mx.random.split(mx.random.key(length), 3)
    dtype, shape = DTYPES[args.dtype], (1, H_KV, length, HEAD_DIM)
    q = mx.random.normal((1, H_Q, length, HEAD_DIM), key=kq).astype(dtype)
    k, v = (mx.random.normal(shape, key=key).astype(dtype) for key in (kk, kv))
    mx.eval(q, k, v)
    runs = {"dense": lambda: pkg.scaled_dot_product_attention_grouped(q, k, v, mask="causal")}
    for size in args.block_sizes:
        runs[f"flash-{size}"] = lambda size=size: pkg.flash_attention(q, k, v, block_size=size)
    runs["mx.fast"] = lambda: impls.fast_attention(q, k, v, mask="causal")  # scale: 1 / sqrt(D)
    rows, score_bytes = [], H_Q * length * length * q.itemsize  # the [H_q, L, S] scores
    for name, (error, times) in measure(runs, "mx.fast", args).items():
        rows.append({"kind": "attention", "length": length, "method": name,
                     "max_abs_error_vs_mx_fast": error, "score_matrix_bytes": score_bytes,
                     **times})  # fmt: skip
        log(f"attention L=S={length:5d} {name:10s} {times['median_ms']:9.1f} ms "
            f"peak {times['peak_mib']:8.1f} MiB")  # fmt: skip
    return rows


def per_request_batching_cache(pkg):
    """The batching cache whose paged decode walks each request's own page table in turn."""

    class PerRequest(pkg.BatchingKvCache):
        def attend(self, query, key, value):  # [B, H_q, 1, D], [B, H_kv, 1, D] x 2
            caches = [self.slots[i] for i in self.active_slots]
            rows = [slice(b, b + 1) for b in range(len(caches))]
            outs = [c.attend(query[r], key[r], value[r]) for c, r in zip(caches, rows)]
            return mx.concatenate(outs, axis=0)  # [B, H_q, 1, D]

    return PerRequest


class CourseDecode:
    """A batched decode step of the course's model over B request caches at one context."""

    def __init__(self, pkg, model, kv: KV, kind: str, page_size: int, block: int):
        self.model, (batch, _, self.context, _) = model, kv[0][0].shape  # [B, H_kv, S, D]
        if kind == "dense":
            requests = [model.create_kv_cache() for _ in range(batch)]
        else:  # the pages for one more token, allocated up front as a server would (a pool
            # left to grow doubles, and would hold twice what it uses)
            pages = batch * -(-(self.context + 1) // page_size)
            pools = model.create_kv_pools(page_size, pages, read_in_place=kind != "paged-gather")
            for pool in pools:
                pool.attention_block = block
            requests = [model.create_paged_kv_cache(pools) for _ in range(batch)]
        impls.fill_rows(requests, kv)  # the state a prefill leaves
        per_request = kind == "paged-in-place-per-request"
        batching = per_request_batching_cache(pkg) if per_request else pkg.BatchingKvCache
        self.batch = impls.batching_caches(batching, requests)
        for layer in self.batch:
            layer.materialize()
        self.tokens = mx.array([[1 + b] for b in range(batch)])  # [B, 1]

    def step(self) -> mx.array:
        logits = self.model(self.tokens, [self.context] * self.tokens.shape[0], self.batch)
        mx.eval(logits)
        return logits  # [B, 1, V]

    def rewind(self) -> None:
        for layer in self.batch:
            layer.rewind([self.context] * self.tokens.shape[0])


class MlxLmDecode:
    """The same step with mlx-lm's Qwen3 and its KVCache on the same weights."""

    def __init__(self, ckpt, kv: KV):
        impl = impls.MlxLmImpl(ckpt)
        self.model, (self.cache, self.context) = impl.model, impl.decode_cache(kv)
        mx.eval([c.state for c in self.cache])
        self.tokens = mx.array([[1 + b] for b in range(kv[0][0].shape[0])])

    def step(self) -> mx.array:
        logits = self.model(self.tokens, cache=self.cache)
        mx.eval(logits)
        return logits

    def rewind(self) -> None:
        for layer_cache in self.cache:
            layer_cache.trim(layer_cache.offset - self.context)


def held_after_one_step(make: Callable[[], Any]) -> tuple[Any, int]:
    """A decode state, and what it holds once stepped: its caches and any buffer a step keeps.
    Garbage in reference cycles is collected first: arrays it holds, freed whenever Python's
    collector happens to run inside make(), would otherwise come off this state's count."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    state = make()
    state.step()
    state.rewind()
    mx.clear_cache()
    return state, mx.get_active_memory() - before


def decode_rows(pkg, model, ckpt, context: int, batch: int, args) -> list[dict[str, Any]]:
    """Every method on `batch` requests with `context` cached tokens each."""
    kv = impls.random_context(ckpt.config, batch, context, DTYPES[args.dtype], seed=context + batch)
    kinds = [k for k in DECODE_KINDS if batch > 1 or k != "paged-in-place-per-request"]
    makers = {k: partial(CourseDecode, pkg, model, kv, k, args.page_size, args.paged_block)
              for k in kinds}  # fmt: skip
    makers["mlx-lm"] = partial(MlxLmDecode, ckpt, kv)
    states, held = {}, {}
    for name, make in makers.items():
        states[name], held[name] = held_after_one_step(make)
    del kv, makers
    runs = {name: state.step for name, state in states.items()}
    rows = []
    measured = measure(runs, "paged-gather", args, after=lambda name: states[name].rewind())
    for name, (error, times) in measured.items():
        rows.append({"kind": "decode", "context": context, "batch": batch, "method": name,
                     "max_abs_logit_diff_vs_gather": error, "held_bytes": held[name],
                     "held_mib": held[name] / 2**20, **times})  # fmt: skip
        log(f"decode context {context:5d} batch {batch} {name:27s} {times['median_ms']:8.1f} ms "
            f"peak {times['peak_mib']:8.1f} MiB held {held[name] / 2**20:8.1f} MiB")  # fmt: skip
    return rows


def bench(pkg, args: argparse.Namespace, bench_model) -> tuple[list, list]:
    """The attention rows and the decode rows, each point's arrays freed before the next."""
    attention, decode = [], []
    for length in [] if args.skip == "attention" else args.lengths:
        attention += attention_rows(pkg, length, args)
        mx.clear_cache()
    if args.skip == "decode":
        return attention, decode
    ckpt = bench_model.load(args.dtype)
    model = pkg.Qwen3Model(ckpt)
    # one throwaway step, so that what the model builds on first use (its RoPE table) counts
    # in no method's held memory
    mx.eval(model(mx.array([[1]]), 0, model.create_kv_cache()))
    for context in args.contexts:
        for batch in args.batches:
            decode += decode_rows(pkg, model, ckpt, context, batch, args)
            mx.clear_cache()
    return attention, decode


def summarize(attention: list[dict], decode: list[dict]) -> dict[str, Any]:
    """The chapter's checks: flash attention's peak memory and time over dense attention's at the
    longest length; the in-place decode step's time over the gather path's at the longest
    context."""
    out: dict[str, Any] = {}
    if attention:
        longest = max(r["length"] for r in attention)
        at = {r["method"]: r for r in attention if r["length"] == longest}
        flash = [m for m in at if m.startswith("flash")]
        over_dense = lambda what: {m: at[m][what] / at["dense"][what] for m in flash}
        out["attention_length"] = longest
        out["flash_peak_over_dense"] = over_dense("peak_bytes")
        out["flash_time_over_dense"] = over_dense("median_ms")
    if decode:
        longest = out["decode_context"] = max(r["context"] for r in decode)
        at = {(r["batch"], r["method"]): r["median_ms"] for r in decode if r["context"] == longest}
        out["in_place_time_over_gather"] = {
            f"batch {b}": at[b, "paged-in-place"] / at[b, "paged-gather"]
            for b in sorted({r["batch"] for r in decode})
        }
    return out


def plot(report: dict[str, Any], path: Path) -> Path | None:
    attention = [r for r in report["runs"] if r["kind"] == "attention"]
    decode = [r for r in report["runs"] if r["kind"] == "decode"]
    if not (attention and decode) or (plt := harness.pyplot()) is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for method in dict.fromkeys(r["method"] for r in attention):
        rows = [r for r in attention if r["method"] == method]
        left.plot([r["length"] for r in rows], [r["peak_mib"] for r in rows], "o-", label=method)
    left.set_xscale("log", base=2)
    left.set(yscale="log", xlabel="prompt length L = S (tokens)",
             ylabel="peak memory above the inputs (MiB)",
             title="one layer's attention, Qwen3-0.6B shape")  # fmt: skip
    left.legend(fontsize=8)
    cases = list(dict.fromkeys((r["context"], r["batch"]) for r in decode))
    methods = list(dict.fromkeys(r["method"] for r in decode))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ms = {(r["context"], r["batch"]): r["median_ms"] for r in decode if r["method"] == method}
        xs = [c + i * width for c, case in enumerate(cases) if case in ms]
        right.bar(xs, [ms[case] for case in cases if case in ms], width=width, label=method)
    right.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    right.set_xticklabels([f"ctx {c}\nbatch {b}" for c, b in cases], fontsize=8)
    layers = report["settings"]["model"]["num_layers"]
    right.set(ylabel="decode step (ms, median)", title=f"decode step, {layers} layers")
    right.legend(fontsize=7)
    return harness.save_figure(fig, path)


def table(report: dict[str, Any]) -> str:
    head = ["run", "L or context", "batch", "method", "median ms", "peak MiB"]
    rows = [[r["kind"], str(r.get("length", r.get("context"))), str(r.get("batch", 1)),
             r["method"], f"{r['median_ms']:.1f}", f"{r['peak_mib']:.1f}"]
            for r in report["runs"]]  # fmt: skip
    return harness.table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    pos = int_at_least(1)
    p = harness.bench_parser("bench-flash-attention", __doc__.split("\n\n")[0])
    harness.add_model_arguments(p, "qwen3-0.6b", default_layers=8)
    p.set_defaults(device="cpu", seed=0)
    p.add_argument("--lengths", type=pos, nargs="+", default=[1024, 2048, 4096], help="L = S")
    p.add_argument("--block-sizes", type=pos, nargs="+", default=[128, 512])
    p.add_argument("--contexts", type=pos, nargs="+", default=[1024, 4096])
    p.add_argument("--batches", type=pos, nargs="+", default=[1, 4])
    p.add_argument("--page-size", type=pos, default=16)
    p.add_argument("--paged-block", type=pos, default=128, help="pool.attention_block")
    p.add_argument("--skip", choices=("attention", "decode"), default=None)
    p.add_argument("--warmup", type=int_at_least(0), default=2)
    p.add_argument("--repeats", type=pos, default=7)
    harness.add_output_arguments(p, "flash-attention.json", plot=True)
    args = p.parse_args(argv)
    harness.set_output_paths(p, args, harness.RESULTS / "flash-attention.json")
    model = harness.bench_model_from_args(p, args, default_layers=8)
    started, device = time.time(), choose_device(args.device)
    harness.log_model(model, args, f"; attention: H_q {H_Q}, H_kv {H_KV}, head_dim {HEAD_DIM}")
    harness.log_blas()
    with harness.OneLineErrors(args.solution) as errors:  # a checkpoint's weights: read here
        attention, decode = bench(load_solution(args.solution), args, model)
    if errors.status:
        return errors.status
    settings = {"arguments": harness.arguments_json(args), "device": device,
                "attention_shape": {"H_q": H_Q, "H_kv": H_KV, "head_dim": HEAD_DIM, "batch": 1},
                "model": model.describe() if decode else None}  # fmt: skip
    summary = summarize(attention, decode)
    report = harness.report("bench-flash-attention", started, settings, attention + decode, summary)
    harness.write_report(args, report, table, plot)
    return 0
