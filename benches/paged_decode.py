"""5.2: fused paged decode attention (kernels.paged_decode_attention) against what it replaces.

One decode step's attention of one layer, Qwen3-0.6B's shape (16 query heads, 8 KV heads, head
dim 128, float32), --batch rows that each hold --contexts positions in a page pool whose pages are
handed out in shuffled order (as a pool that has served a while holds them). Variants, on the
same pool and the same queries, taking turns (the order reversed every round) until each has
--iters timings:

- own-kernel: own_decode_attention, the path the model takes with use_own_decode_kernel (the
  tables padded into one int32 array, then the fused kernel: Tasks 2 and 3);
- own-plain: the plain walk of Task 1 (one query head, one position at a time);
- paged-attention: Week 3 Day 5's in-place walk with MLX ops (today's path);
- gather-sdpa: the pages gathered into [B, H_kv, S, D], then MLX's attention (Week 2's way);
- dense-sdpa: mx.fast.scaled_dot_product_attention on a contiguous cache of the same length.

Every output is checked against dense-sdpa's first (over 1e-4: an error). Reports the median
ms, the KV bytes a call must read over that time (GB/s), and the ratios the targets read.

Targets (issue 45): at 4096 positions, batch 8: own-kernel >= 1.5x faster than paged-attention,
and at most 1.2x dense-sdpa's time.

    pdm run bench-paged-decode [--batch 8] [--contexts 512 1024 2048 4096] [--iters 15]
    pdm run bench-paged-decode --quick        # a smoke run: batch 2, 256 positions, 3 timings

Writes benches/results/paged-decode-<host>.json (or --json-output).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from benches import harness
from tiny_llm_support.cli import int_at_least

H_Q, H_KV, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention
VARIANTS = ("own-kernel", "own-plain", "paged-attention", "gather-sdpa", "dense-sdpa")
AGREEMENT_ATOL = 1e-4
TARGET_CONTEXT = 4096
TARGETS = {"own_vs_paged_attention": 1.5, "own_over_dense_sdpa": 1.2}  # at least, at most


class Disagreement(RuntimeError):
    """A variant's output differs from dense-sdpa's by more than AGREEMENT_ATOL."""


class Pool:
    """What paged_attention and own_decode_attention read of a TinyKvPagedPool."""

    def __init__(self, key_pages, value_pages, page_size: int):
        self.key_pages, self.value_pages, self.page_size = key_pages, value_pages, page_size
        self.num_kv_heads, self.head_dim = key_pages.shape[1], key_pages.shape[3]
        self.decode_kernel = None  # paged_attention's own walk


def problem(batch: int, context: int, page_size: int, seed: int):
    """The pool, its page tables (shuffled pages), the dense cache of the same keys and values,
    and the queries [B, H_q, 1, D]."""
    import mlx.core as mx
    import numpy as np

    pages_per_row = -(-context // page_size)
    num_pages = batch * pages_per_row
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    dense_k = mx.random.normal((batch, H_KV, pages_per_row * page_size, HEAD_DIM), key=k1)
    dense_v = mx.random.normal((batch, H_KV, pages_per_row * page_size, HEAD_DIM), key=k2)
    query = mx.random.normal((batch, H_Q, 1, HEAD_DIM), key=k3)
    order = np.random.RandomState(seed).permutation(num_pages)
    tables = [order[b * pages_per_row : (b + 1) * pages_per_row].tolist() for b in range(batch)]

    def paged(dense):  # [B, H_kv, n * P, D] -> pool [num_pages, H_kv, P, D], pages per table
        blocks = dense.reshape(batch, H_KV, pages_per_row, page_size, HEAD_DIM)
        blocks = blocks.transpose(0, 2, 1, 3, 4).reshape(num_pages, H_KV, page_size, HEAD_DIM)
        where = mx.array(np.argsort(order))  # pool page p holds the flat block where[p]
        return blocks[where]

    pool = Pool(paged(dense_k), paged(dense_v), page_size)
    dense_k, dense_v = dense_k[:, :, :context], dense_v[:, :, :context]
    dense_k, dense_v = mx.contiguous(dense_k), mx.contiguous(dense_v)
    mx.eval(pool.key_pages, pool.value_pages, dense_k, dense_v, query)
    return pool, tables, dense_k, dense_v, query


def variants(pool, tables, lengths, dense_k, dense_v, query) -> dict[str, Callable[[], Any]]:
    import mlx.core as mx

    from tiny_llm_ref.flash_attention import paged_attention
    from tiny_llm_ref.kernels import paged_decode_attention
    from tiny_llm_ref.paged_decode import own_decode_attention

    scale = 1.0 / math.sqrt(HEAD_DIM)
    context, batch = lengths[0], len(lengths)

    def plain():
        table = mx.array(tables, dtype=mx.int32)
        out = paged_decode_attention(
            query[:, :, 0], pool.key_pages, pool.value_pages, table,
            mx.array(lengths, dtype=mx.int32), scale, fast=False)  # fmt: skip
        return out[:, :, None]

    def gather_sdpa():
        table = mx.array(tables)  # [B, n]
        k = pool.key_pages[table].swapaxes(1, 2).reshape(batch, H_KV, -1, HEAD_DIM)
        v = pool.value_pages[table].swapaxes(1, 2).reshape(batch, H_KV, -1, HEAD_DIM)
        return mx.fast.scaled_dot_product_attention(
            query, k[:, :, :context], v[:, :, :context], scale=scale)  # fmt: skip

    return {
        "own-kernel": lambda: own_decode_attention(query, pool, tables, lengths, scale),
        "own-plain": plain,
        "paged-attention": lambda: paged_attention(query, pool, tables, lengths, scale),
        "gather-sdpa": gather_sdpa,
        "dense-sdpa": lambda: mx.fast.scaled_dot_product_attention(
            query, dense_k, dense_v, scale=scale
        ),  # fmt: skip
    }


def timed(fn: Callable[[], Any]) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def measure_context(batch: int, context: int, page_size: int, iters: int, seed: int) -> dict:
    """Every variant at one context: checked, warmed up, then in turns, iters timings each."""
    import mlx.core as mx

    pool, tables, dense_k, dense_v, query = problem(batch, context, page_size, seed)
    lengths = [context] * batch
    fns = variants(pool, tables, lengths, dense_k, dense_v, query)
    want = fns["dense-sdpa"]()
    for name, fn in fns.items():
        err = mx.abs(fn() - want).max().item()
        if err > AGREEMENT_ATOL:
            raise Disagreement(f"{name} at {context} positions: off by {err:.3g} from dense-sdpa")
        timed(fn)  # a warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(iters):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(timed(fns[name]))
    kv_bytes = 2 * batch * H_KV * context * HEAD_DIM * 4
    record: dict[str, Any] = {"context": context, "kv_mb": kv_bytes / 1e6}
    for name, ts in times.items():
        ms = 1000 * harness.median(ts)
        record[name] = {"ms": ms, "gbs": kv_bytes / ms / 1e6, "timings_ms": [1000 * t for t in ts]}
    own, paged, dense = (record[v]["ms"] for v in ("own-kernel", "paged-attention", "dense-sdpa"))
    record["own_vs_paged_attention"] = paged / own
    record["own_over_dense_sdpa"] = own / dense
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
    summary = summarize(runs)
    settings = {**harness.arguments_json(args, ("json_output",)), "heads": H_Q,
                "kv_heads": H_KV, "head_dim": HEAD_DIM, "dtype": "float32",
                "threads": os.cpu_count(), "loadavg_at_start": list(load)}  # fmt: skip
    report = harness.report("paged-decode", started, settings, runs, summary, targets(summary))
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per context: each variant's median ms and GB/s, and the two ratios."""
    return {str(r["context"]): {**{v: {"ms": r[v]["ms"], "gbs": r[v]["gbs"]} for v in VARIANTS},
                                "kv_mb": r["kv_mb"],
                                "own_vs_paged_attention": r["own_vs_paged_attention"],
                                "own_over_dense_sdpa": r["own_over_dense_sdpa"]}
            for r in runs}  # fmt: skip


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """At TARGET_CONTEXT (the longest context measured, if it was not)."""
    context = str(TARGET_CONTEXT) if str(TARGET_CONTEXT) in summary else max(summary, key=int)
    row = summary[context]
    speedup, over = row["own_vs_paged_attention"], row["own_over_dense_sdpa"]
    return {
        "own_vs_paged_attention": {"target": TARGETS["own_vs_paged_attention"], "value": speedup,
                                   "met": speedup >= TARGETS["own_vs_paged_attention"],
                                   "context": int(context)},
        "own_over_dense_sdpa": {"target": TARGETS["own_over_dense_sdpa"], "value": over,
                                "met": over <= TARGETS["own_over_dense_sdpa"],
                                "context": int(context)},
    }  # fmt: skip


def summary_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    rows = [[context, f"{r['kv_mb']:.0f}",
             *(f"{r[v]['ms']:.2f} ({r[v]['gbs']:.1f})" for v in VARIANTS),
             f"{r['own_vs_paged_attention']:.2f}", f"{r['own_over_dense_sdpa']:.2f}"]
            for context, r in s.items()]  # fmt: skip
    t = report["targets"]
    goals = [f"own_vs_paged_attention >= {t['own_vs_paged_attention']['target']}: "
             f"{t['own_vs_paged_attention']['value']:.2f}, "
             f"{harness.met(t['own_vs_paged_attention']['met'])}",
             f"own_over_dense_sdpa <= {t['own_over_dense_sdpa']['target']}: "
             f"{t['own_over_dense_sdpa']['value']:.2f}, "
             f"{harness.met(t['own_over_dense_sdpa']['met'])}"]  # fmt: skip
    head = ["positions", "KV MB", *(f"{v} ms (GB/s)" for v in VARIANTS), "vs paged", "/ dense"]
    return "\n".join([harness.table(head, rows), *goals])
