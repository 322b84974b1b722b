"""Week 4 Day 7: long context on Qwen3-0.6B's shape (random weights, 2 layers by default), every
run in a fresh process. Part "window": at each --prompt-lens length, full attention over a paged
cache against a sliding --window on every layer (pages that leave the window go back to the
pool): a prefill in --chunk chunks, then --decode-steps steps; times and the KV pages at the
peak. Part "ring": ring_prefill on each --ranks count (more than 1: mlx.launch on this machine):
the prefill, KV and peak memory per rank, one ring step and the ring's arithmetic (a run that
would not fit in memory is skipped). Logits are checked against explicit banded masks and one
process: a relative difference over 1e-3 stops the benchmark before it writes anything.

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-long-context   # 4k and 8k tokens, ~10 min, 2 cores
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness
from benches.ceilings import timed
from tiny_llm_ref.kv_cache import TinyKvFullCache
from tiny_llm_ref.ring_attention import split_sequence
from tiny_llm_support import Qwen3Config, choose_device
from tiny_llm_support.cli import DTYPES, int_at_least, load_solution

DEFAULT_LAYERS = 2  # for a shortcut with an embedded config
VARIANTS = ("full", "window")
ORACLE = "banded-mask"  # the explicit-mask run the windowed one is checked against
AGREEMENT_RTOL = 1e-3  # max |a - b| / max |b|, at most
MEMORY_SHARE = 0.8  # a ring run must fit its estimated peak into this share of the memory
LINK_BYTES_PER_S = 1.25e9  # a 10 Gbit/s network, for the arithmetic of two machines
RING_STEP_REPEATS = 5  # ring steps timed, after a warm-up


def kv_bytes_per_token(config: Qwen3Config, dtype_size: int) -> int:
    """Keys and values of one token in one layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_size


def load(spec: dict[str, Any]) -> tuple[harness.BenchModel, Any, Any, list[int]]:
    """The model, its weights, the solution, and random ordinary prompt and decode ids."""
    s = spec["settings"]
    choose_device(s["device"])
    bench_model, ckpt = harness.load_weights(spec["model"], s["dtype"])
    low, high = bench_model.token_ids
    allowed = np.setdiff1d(np.arange(low, high), bench_model.excluded_ids)
    ids = np.random.RandomState(s["seed"]).choice(
        allowed, spec["prompt_len"] + s["decode_steps"] + 1
    )
    return bench_model, ckpt, load_solution(s["solution"]), ids.tolist()


class BandedMaskCache(TinyKvFullCache):
    """The window's oracle: a dense cache that hands attention every key with an explicit [L, S]
    banded mask (0 where a query sees the key, -inf elsewhere), nothing skipped or paged."""

    def __init__(self, band: int):
        super().__init__()
        self.band = band

    def update_and_fetch(self, key: mx.array, value: mx.array):
        keys, values, _ = super().update_and_fetch(key, value)  # [1, H_kv, S, D]
        l, s = key.shape[2], keys.shape[2]
        query_pos, key_pos = mx.arange(s - l, s)[:, None], mx.arange(s)[None, :]  # [L, 1], [1, S]
        seen = (key_pos <= query_pos) & (key_pos > query_pos - self.band)  # [L, S]
        return keys, values, mx.where(seen, 0.0, -mx.inf).astype(key.dtype)


def forward_each(model, caches, pieces: list[list[int]], start: int) -> tuple[list, mx.array]:
    """Each piece of ids through the model in turn from position `start` (prefill chunks, or
    decode steps of one id): the seconds of each, and the last position's logits [V]."""
    times = []
    for piece in pieces:
        t = time.perf_counter()
        logits = model(mx.array([piece]), start, caches, logits_to_keep=1)  # [1, 1, V]
        mx.eval(logits)
        for cache in caches:
            cache.materialize()
        times.append(time.perf_counter() - t)
        start += len(piece)
    return times, logits[0, -1]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in its own process (`--child-spec FILE`): a window variant or a ring rank."""
    return window_run(spec) if spec["part"] == "window" else ring_run(spec)


def window_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One window variant at one length: chunked prefill, then decode steps (the first untimed);
    its logits (last prompt token, last step) go to spec["logits"]."""
    t0 = time.perf_counter()
    s, variant, length = spec["settings"], spec["variant"], spec["prompt_len"]
    bench_model, ckpt, api, ids = load(spec)
    if variant == "window":  # the same weights, a window on every layer (transformers' fields)
        layers = bench_model.config["num_hidden_layers"]
        raw = {**bench_model.config, "use_sliding_window": True, "sliding_window": s["window"],
               "layer_types": ["sliding_attention"] * layers}  # fmt: skip
        config = Qwen3Config.from_dict(raw, source="the windowed config")
        ckpt = dataclasses.replace(ckpt, config=config)
    model = api.Qwen3Model(ckpt, max_seq_len=len(ids))
    pools = None
    if variant == ORACLE:
        caches = [BandedMaskCache(s["window"]) for _ in range(model.num_hidden_layers)]
    else:
        pools = model.create_kv_pools(s["page_size"], None, read_in_place=True)
        caches = model.create_paged_kv_cache(pools)
    load_s = time.perf_counter() - t0
    mx.clear_cache()
    weights_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    chunks = [ids[i : min(i + s["chunk"], length)] for i in range(0, length, s["chunk"])]
    chunk_s, prefill_logits = forward_each(model, caches, chunks, 0)
    step_s, decode_logits = forward_each(model, caches, [[i] for i in ids[length:]], length)
    np.savez(spec["logits"], prefill=np.array(prefill_logits), decode=np.array(decode_logits))
    per_token = kv_bytes_per_token(ckpt.config, DTYPES[s["dtype"]].size)
    record = {"part": "window", "variant": variant, "prompt_len": length,
              "blas": harness.process_blas(), "load_s": load_s, "chunk_s": chunk_s,
              "prefill_s": sum(chunk_s), "prefill_tokens_per_s": length / sum(chunk_s),
              "last_chunk_s": chunk_s[-1], "decode_step_s": step_s[1:],
              "decode_ms": harness.median(step_s[1:]) * 1000, "weights_bytes": weights_bytes,
              "peak_memory_bytes": mx.get_peak_memory(),
              "dense_kv_bytes": len(ids) * per_token * bench_model.num_layers}  # fmt: skip
    if pools is None:  # the oracle: dense buffers
        dense = sum(c.keys.nbytes + c.values.nbytes for c in caches)
        return {**record, "kv_dense_buffer_bytes": dense}
    # the most pages in use at once in each pool, summed; the pools' storage at the end (a pool
    # grows and never shrinks)
    page_bytes = s["page_size"] * per_token
    peak_pages = sum(pool.peak_in_use for pool in pools)
    return {**record, "page_bytes": page_bytes, "peak_pages": peak_pages,
            "kv_peak_bytes": peak_pages * page_bytes,
            "kv_pool_bytes": sum(pool.nbytes for pool in pools),
            "pages_in_use_end": sum(pool.num_in_use for pool in pools),
            "pages_released": sum(getattr(cache, "released", 0) for cache in caches)}  # fmt: skip


def ring_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a ring prefill (a group of one for 1 rank); rank 0 writes the logits of the
    last prompt token to spec["logits"]; one ring step timed after it (median of several)."""
    t0 = time.perf_counter()
    ranks, length = spec["ranks"], spec["prompt_len"]
    group = harness.join_group(spec)
    _, ckpt, api, ids = load(spec)
    model = api.Qwen3Model(ckpt, max_seq_len=length)
    load_s = time.perf_counter() - t0
    mx.clear_cache()
    weights_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    caches, logits = api.ring_prefill(model, ids[:length], group)  # logits [1, V] on every rank
    mx.eval(logits)
    prefill_s = time.perf_counter() - t
    peak = mx.get_peak_memory()
    config, dtype = ckpt.config, DTYPES[spec["settings"]["dtype"]]
    step_s = None
    if ranks > 1:  # one layer's ring step: the largest part's keys and values [1, H_kv, l, D]
        ring = importlib.import_module(f"{api.__name__}.ring_attention")
        shape = (1, config.num_key_value_heads, -(-length // ranks), config.head_dim)
        kv = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        mx.eval(*kv)
        step_s = [timed(lambda: ring.pass_along(*kv, group, shape))
                  for _ in range(RING_STEP_REPEATS + 1)][1:]  # fmt: skip
    if group.rank() == 0:
        np.savez(spec["logits"], prefill=np.array(logits[0]))
    return {"part": "ring", "ranks": ranks, "rank": group.rank(), "prompt_len": length,
            "blas": harness.process_blas(),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "load_s": load_s,
            "prefill_s": prefill_s, "tokens_held": caches[0].holds,
            "kv_bytes": sum(c.holds for c in caches) * kv_bytes_per_token(config, dtype.size),
            "kv_buffer_bytes": sum(c.local.keys.nbytes + c.local.values.nbytes for c in caches),
            "weights_bytes": weights_bytes, "peak_memory_bytes": peak, "ring_step_s": step_s,
            "ring_step_s_median": harness.median(step_s) if step_s else None}  # fmt: skip


def ring_row(model: harness.BenchModel, dtype: str, length: int, ranks: int) -> dict[str, Any]:
    """A planned ring run: what the ring passes and computes per layer (attention FLOPs as the
    reference computes them: a rank's own part as a full [l, l] square plus every earlier part's
    block), its estimated peak per rank (the weights, three [H_q, l, l] arrays of the own part's
    attention and the logits [l, V]) and why it is skipped (None: it runs)."""
    config, size = model.qwen3_config, DTYPES[dtype].size
    sizes = [stop - start for start, stop in split_sequence(length, ranks)]  # the ranks' parts
    h_q, d = config.num_attention_heads, config.head_dim
    part = max(sizes)
    step = part * kv_bytes_per_token(config, size)  # one part's keys and values
    estimate = model.parameter_count() * size + (3 * h_q * part + config.vocab_size) * part * size
    memory = harness.memory_bytes()
    skipped = None
    if ranks * estimate > MEMORY_SHARE * memory:
        skipped = (f"{ranks} x {estimate / 1e9:.1f} GB estimated, more than {MEMORY_SHARE:.0%} "
                   f"of this machine's {memory / 1e9:.1f} GB")  # fmt: skip
    arithmetic = {"part_tokens": sizes, "steps": ranks - 1, "bytes_per_step_per_layer": step,
                  "bytes_sent_per_rank_per_layer": (ranks - 1) * step,
                  "bytes_sent_per_rank": (ranks - 1) * step * config.num_hidden_layers,
                  "attention_flops_per_layer_by_rank": [
                      4 * h_q * d * l * (l + sum(sizes[:r])) for r, l in enumerate(sizes)],
                  "block_flops_per_byte": 4 * h_q * d * part**2 / step,  # a block of another part
                  "seconds_per_step_at_10gbit": step / LINK_BYTES_PER_S if ranks > 1 else None}  # fmt: skip
    return {"part": "ring", "prompt_len": length, "ranks": ranks, "skipped": skipped,
            "estimated_peak_bytes_per_rank": estimate, "arithmetic": arithmetic}  # fmt: skip


def agreement(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The window against the oracle; the ring on N ranks against 1 rank and the full run."""
    window = {(s["prompt_len"], s["variant"]): np.load(s["logits"])
              for s in specs if s["part"] == "window"}  # fmt: skip
    ring = {(s["prompt_len"], s["ranks"]): np.load(s["logits"])["prefill"]
            for s in specs if s["part"] == "ring"}  # fmt: skip
    pairs = []  # (what, length, got, want)
    for (length, variant), oracle in window.items():
        for key in ("prefill", "decode") if variant == ORACLE else ():
            what = f"window vs explicit banded masks, {key} logits"
            pairs.append((what, length, window[(length, "window")][key], oracle[key]))
    for (length, ranks), got in ring.items():
        if ranks > 1 and (length, 1) in ring:
            pairs.append((f"ring prefill, {ranks} ranks vs 1 rank", length, got, ring[(length, 1)]))
        if ranks > 1 and (length, "full") in window:
            what = f"ring prefill, {ranks} ranks vs the full chunked prefill in one process"
            pairs.append((what, length, got, window[(length, "full")]["prefill"]))
    checks = []
    for what, length, got, want in pairs:
        diff, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
        relative = diff / scale if scale else diff
        checks.append({"what": what, "prompt_len": length, "max_abs_diff": diff,
                       "max_abs_reference": scale, "relative_diff": relative,
                       "ok": relative <= AGREEMENT_RTOL})  # fmt: skip
    return checks


def run_label(run: dict[str, Any]) -> str:
    what = run.get("variant") or f"{run['ranks']} rank(s)"
    return f"{run['part']}, {run['prompt_len']} tokens, {what}"


def run_all(args, model: harness.BenchModel, tmp: Path, settings: dict) -> tuple[list, list]:
    """Every run, window part first: the rows (skipped ring runs too) and the agreement checks."""
    shared = {"model": model.to_dict(), "settings": settings, "solution": args.solution}
    lengths, specs = args.prompt_lens, []
    if "window" in args.parts:  # the order of the variants swapped from one length to the next,
        # the explicit-mask oracle after the shortest length's runs
        plan = [(lengths[i], v) for i, _, v in harness.plan_runs(VARIANTS, len(lengths))]
        plan.insert(len(VARIANTS), (lengths[0], ORACLE))
        specs = [{**shared, "part": "window", "prompt_len": n, "variant": v, "ranks": 1}
                 for n, v in plan]  # fmt: skip
    windows = len(specs)
    # every rank count at each length, the order swapped from one length to the next
    ring_plan = harness.plan_runs(args.ranks, len(lengths)) if "ring" in args.parts else []
    rings = [ring_row(model, args.dtype, lengths[i], n) for i, _, n in ring_plan]
    for row in (row for row in rings if row["skipped"]):
        harness.log(f"ring, {row['prompt_len']} tokens, {row['ranks']} rank(s): skipped, "
                    f"{row['skipped']}")  # fmt: skip
    measured = [row for row in rings if not row["skipped"]]
    specs += [{**shared, "part": "ring", "prompt_len": row["prompt_len"], "ranks": row["ranks"]}
              for row in measured]  # fmt: skip
    for k, spec in enumerate(specs):
        spec["logits"] = str(tmp / f"logits-{k}.npz")
    line = lambda rs: f"{run_label(rs[0])}: prefill {max(r['prefill_s'] for r in rs):.1f} s"
    runs = harness.run_rank_plan(__name__, specs, tmp, run_label, line)
    for row, records in zip(measured, runs[windows:]):
        # the slowest rank's prefill: every rank waits for it in the final all_sum
        row["by_rank"] = records
        row["prefill_s"] = max(r["prefill_s"] for r in records)
        row["prefill_tokens_per_s"] = row["prompt_len"] / row["prefill_s"]
        row["kv_bytes_by_rank"] = [r["kv_bytes"] for r in records]
        row["peak_memory_bytes_by_rank"] = [r["peak_memory_bytes"] for r in records]
        step = row["ring_step_s"] = records[0]["ring_step_s_median"]
        steps = row["arithmetic"]["steps"] * model.num_layers  # ring steps of one prefill
        row["ring_steps_share_of_prefill"] = step * steps / row["prefill_s"] if step else None
    return [records[0] for records in runs[:windows]] + rings, agreement(specs)


def summary_table(report: dict[str, Any]) -> str:
    s, runs = report["settings"], report["runs"]
    mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"
    name = {"window": f"window {s['window']}", ORACLE: "banded mask", "full": "full"}
    window = [(str(r["prompt_len"]), name[r["variant"]], f"{r['prefill_s']:.1f}",
               f"{r['last_chunk_s']:.2f}", f"{r['decode_ms']:.0f}", mib(r.get("kv_peak_bytes")),
               mib(r.get("kv_pool_bytes")), str(r.get("pages_released", "-")))
              for r in runs if r["part"] == "window"]  # fmt: skip
    ring = [(str(r["prompt_len"]), str(r["ranks"]), "skipped") if r["skipped"] else
            (str(r["prompt_len"]), str(r["ranks"]), f"{r['prefill_s']:.1f}",
             " ".join(mib(b) for b in r["kv_bytes_by_rank"]),
             " ".join(mib(b) for b in r["peak_memory_bytes_by_rank"]),
             "-" if r["ring_step_s"] is None else f"{r['ring_step_s'] * 1000:.1f}")
            for r in runs if r["part"] == "ring"]  # fmt: skip
    lines = []
    if window:
        head = ("prompt", "attention", "prefill s", "last chunk s", "decode ms", "peak KV MiB",
                "pool MiB", "pages back")  # fmt: skip
        title = f"sliding window: chunks of {s['chunk']}, pages of {s['page_size']} tokens"
        lines.append(harness.table(head, window, title))
    if ring:
        head = ("prompt", "ranks", "prefill s", "KV MiB/rank", "peak MiB/rank", "ring step ms")
        lines.append(harness.table(head, ring, "ring prefill (prefill s: the slowest rank)"))
    lines += [f"skipped {r['prompt_len']} x {r['ranks']}: {r['skipped']}"
              for r in runs if r["part"] == "ring" and r["skipped"]]  # fmt: skip
    lines += [f"agreement, {c['prompt_len']} tokens, {c['what']}: relative difference "
              f"{c['relative_diff']:.1e}" for c in report["summary"]["agreement"]["checks"]]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-long-context", "Long context (Week 4 Day 7): a sliding "
                             "window against full attention, and ring prefill on 1 and 2 ranks.")  # fmt: skip
    harness.add_model_arguments(p, "qwen3-0.6b", default_layers=DEFAULT_LAYERS)
    r = p.add_argument_group("runs")
    r.add_argument("--parts", nargs="+", choices=("window", "ring"), default=["window", "ring"])
    r.add_argument("--prompt-lens", type=int_at_least(1), nargs="+", default=[4096, 8192],
                   help="prompt tokens, in both parts (16384: --parts window, the ring part "
                   "does not fit in 24 GB)")  # fmt: skip
    r.add_argument("--window", type=int_at_least(1), default=1024, help="positions")
    r.add_argument("--chunk", type=int_at_least(1), default=512, help="prefill chunk (tokens)")
    r.add_argument("--page-size", type=int_at_least(1), default=16, help="tokens per page")
    r.add_argument("--decode-steps", type=int_at_least(1), default=16, help="after one untimed")
    r.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[1, 2], help="ring part")
    r.add_argument("--seed", type=int_at_least(0), default=0, help="random weights, prompt ids")
    harness.add_output_arguments(r, "long-context-<model>-<N>layers-<os>-<arch>-<N>cpu.json")
    args = p.parse_args(argv)
    args.prompt_lens, args.ranks = sorted(set(args.prompt_lens)), sorted(set(args.ranks))
    args.parts = list(dict.fromkeys(args.parts))
    model = harness.bench_model_from_args(p, args, default_layers=DEFAULT_LAYERS)
    if model.qwen3_config.layer_windows:
        p.error(f"--model {args.model} has sliding windows of its own: use a model without")
    longest = args.prompt_lens[-1] + args.decode_steps + 1
    if longest > (limit := model.config["max_position_embeddings"]):
        p.error(f"{longest} positions (the longest prompt and the decode steps) exceed {limit}")
    if "ring" in args.parts and (shortest := args.prompt_lens[0]) < (most := args.ranks[-1]):
        p.error(f"a prompt of {shortest} tokens cannot be split over {most} ranks")
    name = f"{harness.model_slug(model)}-{model.num_layers}layers-{harness.host_slug()}"
    harness.set_output_paths(p, args, harness.RESULTS / f"long-context-{name}.json")

    started = time.time()
    harness.log_model(model, args)
    core = harness.log_blas()
    settings = {**harness.arguments_json(args, ["json_output"]), "read_in_place": True,
                "window_check_len": args.prompt_lens[0], "device": harness.device_name(args.device)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-long-context-") as tmp:
        harness.write_random_weights(model, Path(tmp), args.dtype)
        rows, checks = run_all(args, model, Path(tmp), settings)
    for c in (c for c in checks if not c["ok"]):
        harness.log(f"error: {c['what']} at {c['prompt_len']} tokens: relative difference "
                    f"{c['relative_diff']:.2e} > {AGREEMENT_RTOL} (max |diff| {c['max_abs_diff']:.3g})")  # fmt: skip
    if not all(c["ok"] for c in checks):
        return 1
    ran = {r["blas"]["blas"] for row in rows for r in row.get("by_rank", [row]) if "blas" in r}
    blas = {"parent": harness.blas_info(), "openblas_core": core, "runs": sorted(ran)}
    settings = {**settings, "model": model.describe(), "memory_bytes": harness.memory_bytes()}
    summary = {"agreement": harness.agreement_summary(checks, AGREEMENT_RTOL)}
    report = harness.report("long-context", started, settings, rows, summary, blas=blas)
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0
