"""5.2: fused paged decode attention (kernels.paged_decode_attention) against what it replaces, on
one decode step of one layer of Qwen3-0.6B's shape (float32): own-kernel (the model's path),
own-plain (Task 1's walk), paged-attention (Week 3 Day 5's), gather-sdpa (MLX's attention on the
gathered pages) and dense-sdpa (on a contiguous cache), taking turns on the same pool of shuffled
pages, each checked against dense-sdpa: the median ms and the KV bytes read per second.

    pdm run bench-paged-decode [--batch 8] [--contexts 512 1024 2048 4096] [--iters 15] [--quick]
"""

import math
import os
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness
from benches.ceilings import take_turns, timed
from tiny_llm_support.cli import int_at_least

H_Q, H_KV, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention
VARIANTS = ("own-kernel", "own-plain", "paged-attention", "gather-sdpa", "dense-sdpa")
AGREEMENT_ATOL = 1e-4
TARGET_CONTEXT = 4096
TARGETS = {"own_vs_paged_attention": 1.5, "own_over_dense_sdpa": 1.2}
AT_LEAST = {"own_vs_paged_attention"}  # the other target is a bound from above


class Disagreement(RuntimeError):
    """A variant's output differs from dense-sdpa's by more than AGREEMENT_ATOL."""


def problem(batch: int, context: int, page_size: int, seed: int):
    """The pool, its page tables (shuffled pages), the dense cache of the same keys and values,
    and the queries [B, H_q, 1, D]."""
    n = -(-context // page_size)  # pages a row
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    dense = [mx.random.normal((batch, H_KV, n * page_size, HEAD_DIM), key=k) for k in (k1, k2)]
    query = mx.random.normal((batch, H_Q, 1, HEAD_DIM), key=k3)
    order = np.random.RandomState(seed).permutation(batch * n)
    tables = [order[b * n : (b + 1) * n].tolist() for b in range(batch)]
    where = mx.array(np.argsort(order))  # pool page p holds the flat block where[p]

    def paged(d):  # [B, H_kv, n * P, D] -> the pool [B * n, H_kv, P, D]
        blocks = d.reshape(batch, H_KV, n, page_size, HEAD_DIM).transpose(0, 2, 1, 3, 4)
        return blocks.reshape(batch * n, H_KV, page_size, HEAD_DIM)[where]

    pool = SimpleNamespace(  # what paged_attention and own_decode_attention read of a pool
        key_pages=paged(dense[0]), value_pages=paged(dense[1]), page_size=page_size,
        num_kv_heads=H_KV, head_dim=HEAD_DIM, decode_kernel=None)  # fmt: skip
    dense_k, dense_v = (mx.contiguous(d[:, :, :context]) for d in dense)
    mx.eval(pool.key_pages, pool.value_pages, dense_k, dense_v, query)
    return pool, tables, dense_k, dense_v, query


def variants(pool, tables, lengths, dense_k, dense_v, query) -> dict[str, Callable[[], Any]]:
    from tiny_llm_ref.flash_attention import paged_attention
    from tiny_llm_ref.kernels import paged_decode_attention
    from tiny_llm_ref.paged_decode import own_decode_attention

    scale, sdpa = 1.0 / math.sqrt(HEAD_DIM), mx.fast.scaled_dot_product_attention
    context, batch = lengths[0], len(lengths)

    def plain():
        table, sizes = mx.array(tables, dtype=mx.int32), mx.array(lengths, dtype=mx.int32)
        out = paged_decode_attention(query[:, :, 0], pool.key_pages, pool.value_pages, table,
                                     sizes, scale, fast=False)  # fmt: skip
        return out[:, :, None]

    def gather_sdpa():
        table = mx.array(tables)  # [B, n]
        k, v = (pages[table].swapaxes(1, 2).reshape(batch, H_KV, -1, HEAD_DIM)[:, :, :context]
                for pages in (pool.key_pages, pool.value_pages))  # fmt: skip
        return sdpa(query, k, v, scale=scale)

    return {
        "own-kernel": lambda: own_decode_attention(query, pool, tables, lengths, scale),
        "own-plain": plain,
        "paged-attention": lambda: paged_attention(query, pool, tables, lengths, scale),
        "gather-sdpa": gather_sdpa,
        "dense-sdpa": lambda: sdpa(query, dense_k, dense_v, scale=scale),
    }


def measure_context(batch: int, context: int, page_size: int, iters: int, seed: int) -> dict:
    """Every variant at one context: checked, warmed up, then in turns, iters timings each."""
    pool, tables, dense_k, dense_v, query = problem(batch, context, page_size, seed)
    fns = variants(pool, tables, [context] * batch, dense_k, dense_v, query)
    want = fns["dense-sdpa"]()
    for name, fn in fns.items():
        err = mx.abs(fn() - want).max().item()
        if err > AGREEMENT_ATOL:
            raise Disagreement(f"{name} at {context} positions: off by {err:.3g} from dense-sdpa")
        timed(fn)  # a warm-up
    times = take_turns(fns, iters)  # the order reversed every round
    kv_bytes = 2 * batch * H_KV * context * HEAD_DIM * 4
    record: dict[str, Any] = {"context": context, "kv_mb": kv_bytes / 1e6}
    for name, ts in times.items():
        ms = 1000 * harness.median(ts)
        record[name] = {"ms": ms, "gbs": kv_bytes / ms / 1e6, "timings_ms": [1000 * t for t in ts]}
    own, paged, dense = (record[v]["ms"] for v in ("own-kernel", "paged-attention", "dense-sdpa"))
    record["own_vs_paged_attention"], record["own_over_dense_sdpa"] = paged / own, own / dense
    del pool, dense_k, dense_v, fns
    mx.clear_cache()
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-paged-decode", "Fused paged decode attention against "
                             "paged_attention and MLX's attention, per layer (chapter 5.2).")  # fmt: skip
    p.add_argument("--batch", type=int_at_least(1), default=8, help="decode rows")
    p.add_argument("--contexts", type=int_at_least(1), nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--page-size", type=int_at_least(1), default=16)
    p.add_argument("--iters", type=int_at_least(1), default=15, help="timings of each variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: batch 2, 256, 3 timings")
    harness.add_output_arguments(p, "paged-decode-<host>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.contexts, args.iters = 2, [256], 3
    harness.set_output_paths(p, args, harness.RESULTS / f"paged-decode-{harness.host_slug()}.json")
    started, load = time.time(), os.getloadavg()
    runs = []
    for context in args.contexts:
        harness.log(f"{context} positions, batch {args.batch}")
        runs.append(measure_context(args.batch, context, args.page_size, args.iters, args.seed))
    summary = {str(r["context"]): {**{v: {"ms": r[v]["ms"], "gbs": r[v]["gbs"]} for v in VARIANTS},
                                   "kv_mb": r["kv_mb"], **{k: r[k] for k in TARGETS}}
               for r in runs}  # fmt: skip
    settings = {**harness.arguments_json(args, ("json_output",)), "heads": H_Q,
                "kv_heads": H_KV, "head_dim": HEAD_DIM, "dtype": "float32",
                "threads": os.cpu_count(), "loadavg_at_start": list(load)}  # fmt: skip
    report = harness.report("paged-decode", started, settings, runs, summary, targets(summary))
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """At TARGET_CONTEXT (the longest context measured, if it was not)."""
    context = str(TARGET_CONTEXT) if str(TARGET_CONTEXT) in summary else max(summary, key=int)
    out = {}
    for key, bound in TARGETS.items():
        value = summary[context][key]
        met = value >= bound if key in AT_LEAST else value <= bound
        out[key] = {"target": bound, "value": value, "met": met, "context": int(context)}
    return out


def summary_table(report: dict[str, Any]) -> str:
    rows = [[context, f"{r['kv_mb']:.0f}",
             *(f"{r[v]['ms']:.2f} ({r[v]['gbs']:.1f})" for v in VARIANTS),
             f"{r['own_vs_paged_attention']:.2f}", f"{r['own_over_dense_sdpa']:.2f}"]
            for context, r in report["summary"].items()]  # fmt: skip
    goals = [f"{k} {'>=' if k in AT_LEAST else '<='} {t['target']}: "
             f"{t['value']:.2f}, {harness.met(t['met'])}"
             for k, t in report["targets"].items()]  # fmt: skip
    head = ["positions", "KV MB", *(f"{v} ms (GB/s)" for v in VARIANTS), "vs paged", "/ dense"]
    return "\n".join([harness.table(head, rows), *goals])
