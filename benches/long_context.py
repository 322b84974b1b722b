"""Week 4 Day 7: long context. A sliding window that gives pages back, and a prompt prefilled by
two ranks at once (ring attention).

The model is Qwen3-0.6B's shape (hidden 1024, 16 query heads, 8 KV heads, head_dim 128, MLP 3072,
vocabulary 151936) with random weights, cut to --num-layers layers (2 by default), float32 on the
CPU. Prompts are random ordinary token ids, the same ids for every run of one length. Every run
is a fresh process.

Part "window", at each prompt length two variants, the order swapped from one length to the next:

- full    every layer attends over the whole prompt, from a paged cache (pages of --page-size
          tokens, read in place by flash attention over the pages, Week 3 Day 5);
- window  every layer has a sliding window of --window positions (layer_types all
          "sliding_attention"): TinyKvWindowedPagedCache, which gives every page that left the
          window back to its pool.

The prompt goes through the model in chunks of --chunk tokens (chunked prefill, Week 3 Day 2), so
that the windowed run's memory stays bounded during the prefill as well; then --decode-steps
decode steps of one token each (fixed ids, after one untimed step). Reported: the prefill time,
the last chunk's time, the median decode step, and the KV memory: the most pages in use at once
(summed over the layers' pools, times the bytes of a page), the pools' storage at the end, and
the dense cache of every token for comparison.

Part "ring": the prompt prefilled by ring_prefill on 1 rank (a group of one: a single part, a
plain causal prefill, nothing exchanged) and on 2 ranks under mlx.launch (ring backend over
127.0.0.1, each rank cores / ranks OpenBLAS threads). Reported per rank: the prefill time, the
KV bytes it holds and its peak memory; the bytes each ring step passes (one part's keys and
values, per layer, n - 1 steps) against the attention FLOPs a part computes; one ring step
timed on this machine's loopback. A run whose estimated peak memory does not fit in this
machine's memory is skipped, and the report says so.

Agreement, as max |a - b| / max |b| over the logits (over 1e-3 the benchmark stops with an
error and writes no JSON): the windowed run's logits (last prompt token, last decode step)
against a run with explicit banded [L, S] masks over dense caches (no blocks skipped, no pages)
at the shortest prompt; the 2-rank logits of the last prompt token against the 1-rank ones and
against the full run's of part "window".

What two processes on one 2-core machine can show, and what two machines would change, is
written into the JSON ("notes") and under the table.

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-long-context       # the default run: 4k and 8k
                                  # tokens, about 10 minutes on 2 cores (7 of them the ring part)
    OPENBLAS_CORETYPE=SkylakeX pdm run bench-long-context --parts window --prompt-lens 16384
                                  # 16k tokens, the window part alone (the full variant's prefill
                                  # takes minutes; the ring part at 16k needs more than 24 GB)
    pdm run bench-long-context --model tiny --prompt-lens 64 96 --window 16 --chunk 32 \\
        --decode-steps 2                                         # a smoke run, seconds

Writes JSON (host, MLX, BLAS, model, settings, every run, the ring arithmetic, the agreement
checks, the notes) to benches/results/long-context-<model>-<N>layers-<os>-<arch>-<N>cpu.json,
and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import common
import mlx.core as mx
import numpy as np

from tiny_llm_ref.kv_cache import TinyKvFullCache
from tiny_llm_support import Checkpoint, Qwen3Config, choose_device
from tiny_llm_support.cli import DTYPES, SOLUTIONS, int_at_least, load_solution
from tiny_llm_support.launch import launch

SCHEMA = "tiny-llm/bench-long-context/v1"
DEFAULT_LAYERS = 2  # for a shortcut with an embedded config
VARIANTS = ("full", "window")
ORACLE = "banded-mask"  # the explicit-mask run the windowed one is checked against
AGREEMENT_RTOL = 1e-3  # max |a - b| / max |b|, at most
MEMORY_SHARE = 0.8  # a ring run must fit its estimated peak into this share of the memory
RANKS_TIMEOUT_S = 3600
RING_STEP_REPEATS = 5
LINK_BYTES_PER_S = 1.25e9  # a 10 Gbit/s network, for the arithmetic of two machines

DEFINITIONS = {
    "prefill_s": "the whole chunked prefill (window part) or the ring_prefill call (ring part), "
    "logits evaluated",
    "last_chunk_s": "the last prefill chunk: its attention reads the most keys",
    "decode_ms": "the median decode step (batch 1, one token), after one untimed step",
    "page_bytes": "one page of one layer: keys and values of page_size tokens",
    "kv_peak_bytes": "the most pages in use at once in each layer's pool, summed over the "
    "layers, times page_bytes",
    "kv_pool_bytes": "the storage arrays of every pool at the end (their capacity: a pool grows "
    "and never shrinks, and reuses pages given back before it grows)",
    "dense_kv_bytes": "what a dense cache of every token (prompt and decoded) holds, all layers",
    "kv_bytes": "ring: the keys and values of the tokens a rank holds, all layers",
    "peak_memory_bytes": "MLX's peak memory in the run's process, from just before the prefill "
    "(weights included)",
    "ring_step_s": "one pass_along of one part's keys and values (one layer's ring step), "
    "median of several, on this machine's loopback",
    "attention_flops": "per layer, 2 per multiply-add of QK^T and of PV as the reference computes "
    "them: a rank's own part as a full [l, l] square (masked afterwards), plus every earlier "
    "part's block",
    "relative_diff": "max |a - b| / max |b| over the logits",
}

NOTES = {
    "one_machine": "The ranks run as processes on this one machine: they share its cores (each "
    "rank gets cores / ranks OpenBLAS threads, the 1-rank run all of them) and its memory "
    "bandwidth; a rank that waits in a receive or in the final all_sum is not idle (the ring "
    "backend polls: about half a core, measured here), so it slows the rank still computing; "
    "and a ring step is a copy through loopback TCP, not a network. So the 2-rank prefill is no "
    "faster here, and may be slower. What it does show is real: each rank holds only its own "
    "part's keys and values, the own part's attention temporaries shrink with the square of "
    "the part (the peak per rank), the logits equal the 1-rank ones, and a ring step costs "
    "what ring_step_s says.",
    "imbalance": "With contiguous parts and a causal mask rank r computes its own part and every "
    "earlier part's block, so the last rank does the most attention (2 ranks: rank 1 twice "
    "rank 0's FLOPs as the reference computes them, three times the unmasked ones) and every "
    "rank waits for it in the final all_sum. A zig-zag split (each rank one early and one late "
    "chunk) evens this out.",
    "two_machines": "On two machines each rank would have a whole machine's cores and memory "
    "bandwidth: the prefill would take about the slowest rank's share of the compute, and each "
    "ring step would move bytes_per_step_per_layer over the network (seconds_per_step_at_10gbit) "
    "against block_flops_per_byte FLOPs of attention per byte. The reference passes a block and "
    "only then computes with it, so there the exchange would add to the time instead of hiding "
    "behind the previous block's attention.",
}

DESCRIPTION = (  # what --help says first
    "Long context (Week 4 Day 7): a sliding window that gives pages back against full "
    "attention, and a ring prefill on 1 and 2 ranks. Every run is a fresh process."
)


# --- the model and the prompt ------------------------------------------------------------------


def windowed(ckpt: Checkpoint, config: dict[str, Any], window: int) -> Checkpoint:
    """The same weights with a sliding window of `window` positions on every layer, in the
    config fields transformers reads (use_sliding_window, sliding_window, layer_types)."""
    raw = {
        **config,
        "use_sliding_window": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention"] * config["num_hidden_layers"],
    }
    windowed_config = Qwen3Config.from_dict(raw, source="the windowed config")
    return Checkpoint(ckpt.path, windowed_config, ckpt.weights, ckpt.tokenizer)


def token_ids(model: common.BenchModel, n: int, seed: int) -> list[int]:
    """n ordinary token ids, uniform (the same list for the same n and seed)."""
    low, high = model.token_ids
    allowed = np.setdiff1d(np.arange(low, high), model.excluded_ids)
    return np.random.RandomState(seed).choice(allowed, n).tolist()


def load_model(spec: dict[str, Any]) -> tuple[common.BenchModel, Checkpoint]:
    """The spec's model on the spec's device, weights read now."""
    s = spec["settings"]
    choose_device(s["device"])
    return common.load_weights(spec["model"], s["dtype"])


def kv_bytes_per_token(config: Qwen3Config, dtype_size: int) -> int:
    """Keys and values of one token in one layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_size


# --- part "window": one run ------------------------------------------------------------------


class BandedMaskCache(TinyKvFullCache):
    """The oracle of the window: a dense cache that keeps every key and hands attention all of
    them with an explicit [L, S] banded mask (0 where a query sees the key, -inf elsewhere).
    Nothing is skipped and nothing is paged: the dense attention of Week 2 Day 1, another mask."""

    def __init__(self, band: int):
        super().__init__()
        self.band = band

    def update_and_fetch(self, key: mx.array, value: mx.array):
        keys, values, _ = super().update_and_fetch(key, value)  # [1, H_kv, S, D]
        l, s = key.shape[2], keys.shape[2]
        query_pos = mx.arange(s - l, s)[:, None]  # [L, 1]
        key_pos = mx.arange(s)[None, :]  # [1, S]
        seen = (key_pos <= query_pos) & (key_pos > query_pos - self.band)  # [L, S]
        return keys, values, mx.where(seen, 0.0, -mx.inf).astype(key.dtype)


def prefill_in_chunks(model, caches, prompt: list[int], chunk: int) -> tuple[list[float], mx.array]:
    """The prompt through the model `chunk` tokens at a time: each chunk's seconds, and the
    logits [V] of the last prompt token."""
    times = []
    for start in range(0, len(prompt), chunk):
        t = time.perf_counter()
        tokens = mx.array([prompt[start : start + chunk]])  # [1, chunk]
        logits = model(tokens, start, caches, logits_to_keep=1)  # [1, 1, V]
        mx.eval(logits)
        for cache in caches:
            cache.materialize()
        times.append(time.perf_counter() - t)
    return times, logits[0, -1]


def decode(model, caches, ids: list[int], offset: int) -> tuple[list[float], mx.array]:
    """One decode step per id (fixed ids, so every variant sees the same ones): the seconds of
    every step after the first (a warm-up), and the last step's logits [V]."""
    times = []
    for i, token in enumerate(ids):
        t = time.perf_counter()
        logits = model(mx.array([[token]]), offset + i, caches)  # [1, 1, V]
        mx.eval(logits)
        for cache in caches:
            cache.materialize()
        times.append(time.perf_counter() - t)
    return times[1:], logits[0, -1]


def kv_memory(config: Qwen3Config, pools, caches, dtype_size: int, page_size: int) -> dict:
    """The KV numbers of a run (see DEFINITIONS): pages for the paged variants, the dense
    buffers for the oracle."""
    if pools is None:
        return {"kv_dense_buffer_bytes": sum(c.keys.nbytes + c.values.nbytes for c in caches)}
    page_bytes = page_size * kv_bytes_per_token(config, dtype_size)
    peak_pages = sum(pool.peak_in_use for pool in pools)
    return {
        "page_bytes": page_bytes,
        "peak_pages": peak_pages,
        "kv_peak_bytes": peak_pages * page_bytes,
        "kv_pool_bytes": sum(pool.nbytes for pool in pools),
        "pages_in_use_end": sum(pool.num_in_use for pool in pools),
        "pages_released": sum(getattr(cache, "released", 0) for cache in caches),
    }


def window_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, build the variant's model and caches, prefill in chunks, decode; the run's numbers
    (its logits go to spec["logits"])."""
    t0 = time.perf_counter()
    s, variant, length = spec["settings"], spec["variant"], spec["prompt_len"]
    bench_model, ckpt = load_model(spec)
    api = load_solution(s["solution"])
    ids = token_ids(bench_model, length + s["decode_steps"] + 1, s["seed"])
    if variant == "window":
        ckpt = windowed(ckpt, bench_model.config, s["window"])
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
    chunk_s, prefill_logits = prefill_in_chunks(model, caches, ids[:length], s["chunk"])
    step_s, decode_logits = decode(model, caches, ids[length:], length)
    np.savez(spec["logits"], prefill=np.array(prefill_logits), decode=np.array(decode_logits))
    dtype_size = DTYPES[s["dtype"]].size
    return {
        "part": "window",
        "variant": variant,
        "prompt_len": length,
        "sequence": spec["sequence"],
        "pid": os.getpid(),
        "blas": common.process_blas(),
        "load_s": load_s,
        "chunk_s": chunk_s,
        "prefill_s": sum(chunk_s),
        "last_chunk_s": chunk_s[-1],
        "decode_step_s": step_s,
        "decode_ms": common.median(step_s) * 1000,
        "weights_bytes": weights_bytes,
        "peak_memory_bytes": mx.get_peak_memory(),
        **kv_memory(ckpt.config, pools, caches, dtype_size, s["page_size"]),
    }


# --- part "ring": one rank -------------------------------------------------------------------


def ring_step_seconds(ring_module, group, shape: tuple[int, ...], dtype: mx.Dtype) -> list[float]:
    """Seconds of one pass_along of keys and values of `shape` (one layer's ring step),
    RING_STEP_REPEATS times after a warm-up."""
    keys, values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
    mx.eval(keys, values)
    times = []
    for _ in range(RING_STEP_REPEATS + 1):
        t = time.perf_counter()
        mx.eval(*ring_module.pass_along(keys, values, group, shape))
        times.append(time.perf_counter() - t)
    return times[1:]


def ring_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a ring prefill (a group of one when spec["ranks"] is 1): its numbers, written
    to spec["output"] with {rank} filled in; rank 0 writes the logits to spec["logits"]."""
    t0 = time.perf_counter()
    s, ranks, length = spec["settings"], spec["ranks"], spec["prompt_len"]
    group = mx.distributed.init(strict=True, backend="ring") if ranks > 1 else mx.distributed.init()
    bench_model, ckpt = load_model(spec)
    api = load_solution(s["solution"])
    # the prompt of the window part's runs of this length (the same draw, then cut)
    prompt = token_ids(bench_model, length + s["decode_steps"] + 1, s["seed"])[:length]
    model = api.Qwen3Model(ckpt, max_seq_len=length)
    load_s = time.perf_counter() - t0
    mx.clear_cache()
    weights_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    caches, logits = api.ring_prefill(model, prompt, group)  # logits [1, V], alike on every rank
    mx.eval(logits)
    prefill_s = time.perf_counter() - t
    peak = mx.get_peak_memory()
    config, dtype = ckpt.config, DTYPES[s["dtype"]]
    step_s = None
    if ranks > 1:
        ring_module = importlib.import_module(f"{api.__name__}.ring_attention")
        part = -(-length // ranks)  # the largest part
        shape = (1, config.num_key_value_heads, part, config.head_dim)
        step_s = ring_step_seconds(ring_module, group, shape, dtype)
    if group.rank() == 0:
        np.savez(spec["logits"], prefill=np.array(logits[0]))
    return {
        "part": "ring",
        "ranks": ranks,
        "rank": group.rank(),
        "prompt_len": length,
        "pid": os.getpid(),
        "blas": common.process_blas(),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "load_s": load_s,
        "prefill_s": prefill_s,
        "tokens_held": caches[0].holds,
        "kv_bytes": sum(c.holds for c in caches) * kv_bytes_per_token(config, dtype.size),
        "kv_buffer_bytes": sum(c.local.keys.nbytes + c.local.values.nbytes for c in caches),
        "weights_bytes": weights_bytes,
        "peak_memory_bytes": peak,
        "ring_step_s": step_s,
        "ring_step_s_median": common.median(step_s) if step_s else None,
    }


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    with common.child_errors(spec["settings"]["solution"]):
        result = window_run(spec) if spec["part"] == "window" else ring_run(spec)
    common.write_json(spec["output"].format(rank=result.get("rank", 0)), result)
    return 0


# --- the arithmetic of the ring --------------------------------------------------------------


def part_sizes(length: int, ranks: int) -> list[int]:
    """The tokens of each rank's part (split_sequence: the first parts take the extra ones)."""
    size, extra = divmod(length, ranks)
    return [size + (r < extra) for r in range(ranks)]


def ring_arithmetic(config: Qwen3Config, length: int, ranks: int, dtype_size: int) -> dict:
    """What the ring passes and computes, per layer (arithmetic, not measured)."""
    sizes = part_sizes(length, ranks)
    h_q, d = config.num_attention_heads, config.head_dim
    per_token = kv_bytes_per_token(config, dtype_size)
    step = max(sizes) * per_token  # one part's keys and values
    flops = [4 * h_q * d * l * (l + sum(sizes[:r])) for r, l in enumerate(sizes)]
    block = 4 * h_q * d * max(sizes) ** 2  # one visible block of another part
    return {
        "part_tokens": sizes,
        "steps": ranks - 1,
        "bytes_per_step_per_layer": step,
        "bytes_sent_per_rank_per_layer": (ranks - 1) * step,
        "bytes_sent_per_rank": (ranks - 1) * step * config.num_hidden_layers,
        "attention_flops_per_layer_by_rank": flops,
        "block_flops_per_byte": block / step,
        "seconds_per_step_at_10gbit": step / LINK_BYTES_PER_S if ranks > 1 else None,
    }


def ring_rank_estimate(config: Qwen3Config, part: int, dtype_size: int, weights: int) -> int:
    """An upper estimate of one rank's peak memory: the weights, three [H_q, l, l] arrays of the
    own part's attention (scores, masked, exponentials) and logits [l, V] (ring_prefill keeps
    only the last position's but computes every position's)."""
    attention = 3 * config.num_attention_heads * part * part * dtype_size
    return weights + attention + part * config.vocab_size * dtype_size


# --- the parent: plan and launch ---------------------------------------------------------------


def window_plan(lengths: list[int], check_len: int | None) -> list[tuple[int, str]]:
    """(prompt length, variant) in launch order: both variants at each length, the order swapped
    from one length to the next; the explicit-mask oracle after the runs of check_len."""
    plan = []
    for i, length in enumerate(lengths):
        plan += [(length, v) for v in (VARIANTS if i % 2 == 0 else VARIANTS[::-1])]
        if length == check_len:
            plan.append((length, ORACLE))
    return plan


def ring_plan(lengths: list[int], ranks: list[int]) -> list[tuple[int, int]]:
    """(prompt length, ranks) in launch order, the rank counts' order swapped every length."""
    return [(n, r) for i, n in enumerate(lengths) for r in (ranks if i % 2 == 0 else ranks[::-1])]


def run_window(tmp: Path, k: int, total: int, spec: dict) -> dict[str, Any]:
    what = f"window part, {spec['prompt_len']} tokens, {spec['variant']}"
    common.log(f"[{k + 1}/{total}] {what} ...")
    spec = {**spec, "logits": str(tmp / f"logits-{k}.npz")}
    run = common.run_fresh(Path(__file__).resolve(), tmp, k, total, dict(os.environ), spec, what)
    run["logits"] = spec["logits"]
    common.log(
        f"[{k + 1}/{total}] {what}: prefill {run['prefill_s']:.1f} s "
        f"({spec['prompt_len'] / run['prefill_s']:.0f} tokens/s), last chunk "
        f"{run['last_chunk_s']:.2f} s, decode {run['decode_ms']:.0f} ms/token, "
        + (
            f"peak KV {run['kv_peak_bytes'] / 2**20:.1f} MiB, "
            if "kv_peak_bytes" in run
            else f"dense KV {run['kv_dense_buffer_bytes'] / 2**20:.1f} MiB, "
        )
        + f"process peak {run['peak_memory_bytes'] / 2**20:.0f} MiB ({run['process_s']:.0f} s)"
    )
    return run


def run_ring(tmp: Path, k: int, total: int, spec: dict) -> list[dict[str, Any]]:
    """One ring prefill in fresh processes (one plain process for 1 rank, mlx.launch for more):
    every rank's result, in rank order."""
    ranks, what = spec["ranks"], f"ring part, {spec['prompt_len']} tokens, {spec['ranks']} rank(s)"
    common.log(f"[{k + 1}/{total}] {what} ...")
    spec = {**spec, "output": str(tmp / f"result-{k}-rank{{rank}}.json")}
    spec["logits"] = str(tmp / f"logits-{k}.npz")
    spec_path = tmp / f"run-{k}.json"
    spec_path.write_text(json.dumps(spec))
    command = [str(Path(__file__).resolve()), "--child-spec", str(spec_path)]
    t = time.perf_counter()
    if ranks == 1:
        done = subprocess.run([sys.executable, *command], stdout=subprocess.DEVNULL)
        status = done.returncode
    else:
        status = launch(command, ranks, timeout=RANKS_TIMEOUT_S)
    found = [Path(spec["output"].format(rank=r)) for r in range(ranks)]
    if status != 0 or not all(p.is_file() for p in found):
        raise SystemExit(f"run {k + 1}/{total} ({what}) failed with exit status {status}")
    runs = [json.loads(p.read_text()) for p in found]
    for run in runs:
        run["logits"] = spec["logits"]
    step = runs[0]["ring_step_s_median"]
    kv = ", ".join(mib(r["kv_bytes"]) for r in runs)
    peak = ", ".join(mib(r["peak_memory_bytes"]) for r in runs)
    common.log(
        f"[{k + 1}/{total}] {what}: prefill {max(r['prefill_s'] for r in runs):.1f} s (slowest "
        f"rank), KV per rank {kv} MiB, peak per rank {peak} MiB"
        + (f", ring step {step * 1000:.1f} ms" if step else "")
        + f" ({time.perf_counter() - t:.0f} s)"
    )
    return runs


# --- the parent: agreement and the rows --------------------------------------------------------


def compare(what: str, length: int, got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    relative = diff / scale if scale else diff
    return {
        "what": what,
        "prompt_len": length,
        "max_abs_diff": diff,
        "max_abs_reference": scale,
        "relative_diff": relative,
        "ok": relative <= AGREEMENT_RTOL,
    }


def agreement(window_runs: list[dict], ring_rows: list[dict]) -> list[dict[str, Any]]:
    """The checks of the docstring, wherever both sides ran."""
    logits = {(r["prompt_len"], r["variant"]): np.load(r["logits"]) for r in window_runs}
    checks = []
    for (length, variant), oracle in logits.items():
        if variant == ORACLE:
            for key in ("prefill", "decode"):
                what = f"window vs explicit banded masks, {key} logits"
                checks.append(compare(what, length, logits[(length, "window")][key], oracle[key]))
    rings = {
        (row["prompt_len"], row["ranks"]): np.load(row["logits"])["prefill"]
        for row in ring_rows
        if not row["skipped"]
    }
    for (length, ranks), got in rings.items():
        if ranks > 1 and (length, 1) in rings:
            what = f"ring prefill, {ranks} ranks vs 1 rank"
            checks.append(compare(what, length, got, rings[(length, 1)]))
        if ranks > 1 and (length, "full") in logits:
            what = f"ring prefill, {ranks} ranks vs the full chunked prefill in one process"
            checks.append(compare(what, length, got, logits[(length, "full")]["prefill"]))
    return checks


def window_rows(runs: list[dict], model: common.BenchModel, args) -> list[dict[str, Any]]:
    """The runs, with their speed and the dense cache they compare to; logits paths dropped."""
    per_token = kv_bytes_per_token(model.qwen3_config, DTYPES[args.dtype].size)
    rows = []
    for run in runs:
        tokens = run["prompt_len"] + args.decode_steps + 1
        row = {k: v for k, v in run.items() if k != "logits"}
        row["prefill_tokens_per_s"] = run["prompt_len"] / run["prefill_s"]
        row["dense_kv_bytes"] = tokens * per_token * model.num_layers
        rows.append(row)
    return rows


def ring_row(model: common.BenchModel, args: argparse.Namespace, length: int, ranks: int) -> dict:
    """A planned ring run: its arithmetic, its estimated peak per rank, and why it is skipped
    (None: it runs)."""
    config, size = model.qwen3_config, DTYPES[args.dtype].size
    weights = model.parameter_count() * size
    estimate = ring_rank_estimate(config, max(part_sizes(length, ranks)), size, weights)
    skipped = None
    if ranks * estimate > MEMORY_SHARE * common.memory_bytes():
        skipped = (
            f"{ranks} x {estimate / 1e9:.1f} GB estimated, more than {MEMORY_SHARE:.0%} of "
            f"this machine's {common.memory_bytes() / 1e9:.1f} GB"
        )
    return {
        "prompt_len": length,
        "ranks": ranks,
        "skipped": skipped,
        "estimated_peak_bytes_per_rank": estimate,
        "arithmetic": ring_arithmetic(config, length, ranks, size),
    }


def add_measured(row: dict[str, Any], runs: list[dict[str, Any]], layers: int) -> None:
    """A ring run's measurements into its row: every rank's under by_rank, the slowest rank's
    prefill (each waits for it in the final all_sum), the measured ring step."""
    row["by_rank"] = [{k: v for k, v in r.items() if k != "logits"} for r in runs]
    row["logits"] = runs[0]["logits"]  # until the agreement checks have read it
    row["prefill_s"] = max(r["prefill_s"] for r in runs)
    row["prefill_tokens_per_s"] = row["prompt_len"] / row["prefill_s"]
    row["kv_bytes_by_rank"] = [r["kv_bytes"] for r in runs]
    row["peak_memory_bytes_by_rank"] = [r["peak_memory_bytes"] for r in runs]
    step = runs[0]["ring_step_s_median"]
    row["ring_step_s"] = step
    steps = row["arithmetic"]["steps"] * layers  # ring steps of one prefill, every layer
    row["ring_steps_share_of_prefill"] = step * steps / row["prefill_s"] if step else None


def run_parts(args, model: common.BenchModel, tmp: Path, settings: dict) -> tuple[list, list, list]:
    """Every run of both parts in fresh processes: the window runs, the ring rows, and the
    agreement checks (read from the logits the runs left in tmp)."""
    check_len = args.prompt_lens[0]
    plan = window_plan(args.prompt_lens, check_len) if "window" in args.parts else []
    rings = []
    if "ring" in args.parts:
        rings = [ring_row(model, args, n, r) for n, r in ring_plan(args.prompt_lens, args.ranks)]
    total = len(plan) + sum(not row["skipped"] for row in rings)
    common.log(f"{total} runs, each in a fresh process")
    shared = {"model": model.to_dict(), "settings": settings}
    window_runs = []
    for k, (length, variant) in enumerate(plan):
        spec = {**shared, "part": "window", "variant": variant, "prompt_len": length}
        window_runs.append(run_window(tmp, k, total, spec))
    k = len(plan)
    for row in rings:
        if row["skipped"]:
            common.log(f"ring part, {row['prompt_len']} tokens, {row['ranks']} rank(s): skipped, "
                f"{row['skipped']}")  # fmt: skip
            continue
        spec = {**shared, "part": "ring", "ranks": row["ranks"], "prompt_len": row["prompt_len"]}
        add_measured(row, run_ring(tmp, k, total, {**spec, "sequence": k}), model.num_layers)
        k += 1
    checks = agreement(window_runs, rings)
    for row in rings:
        row.pop("logits", None)
    return window_runs, rings, checks


def run_benchmark(args: argparse.Namespace, model: common.BenchModel) -> dict[str, Any]:
    started = time.time()
    common.log_model(model, args)
    core = common.log_blas()
    settings = {
        "prompt_lens": args.prompt_lens,
        "window": args.window,
        "chunk": args.chunk,
        "page_size": args.page_size,
        "read_in_place": True,
        "decode_steps": args.decode_steps,
        "window_check_len": args.prompt_lens[0],
        "ranks": args.ranks,
        "seed": args.seed,
        "dtype": args.dtype,
        "device": args.device,
        "solution": args.solution,
    }
    with tempfile.TemporaryDirectory(prefix="bench-long-context-") as tmp:
        common.write_random_weights(model, Path(tmp), args.dtype)
        window_runs, rings, checks = run_parts(args, model, Path(tmp), settings)
        description = model.describe()
    blas_seen = {r["blas"]["blas"] for r in window_runs}
    blas_seen |= {r["blas"]["blas"] for row in rings for r in row.get("by_rank", [])}
    return {
        **common.report_start(SCHEMA, started, common.arguments_json(args)),
        "memory_bytes": common.memory_bytes(),
        "device": common.device_name(args.device),
        "dtype": args.dtype,
        "solution": SOLUTIONS[args.solution],
        "blas": {"parent": common.blas_info(), "openblas_core": core, "runs": sorted(blas_seen)},
        "environment": common.environment(),
        "model": description,
        "settings": settings,
        "definitions": DEFINITIONS,
        "window": {"rows": window_rows(window_runs, model, args)},
        "ring": {"rows": rings},
        "agreement": common.agreement_summary(checks, AGREEMENT_RTOL),
        "notes": NOTES,
    }


# --- the table -------------------------------------------------------------------------------


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def window_table(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    head = ("prompt", "attention", "prefill s", "tokens/s", "last chunk s", "decode ms",
            "peak KV MiB", "pool MiB", "dense KV MiB", "pages back", "process peak MiB")  # fmt: skip
    rows = []
    for r in report["window"]["rows"]:
        name = {"window": f"window {s['window']}", ORACLE: "banded mask"}.get(r["variant"], "full")
        rows.append(
            (str(r["prompt_len"]), name, f"{r['prefill_s']:.1f}",
             f"{r['prefill_tokens_per_s']:.0f}", f"{r['last_chunk_s']:.2f}",
             f"{r['decode_ms']:.0f}", mib(r.get("kv_peak_bytes")), mib(r.get("kv_pool_bytes")),
             mib(r["dense_kv_bytes"]), str(r.get("pages_released", "-")),
             f"{r['peak_memory_bytes'] / 2**20:.0f}")
        )  # fmt: skip
    title = (
        f"sliding window: chunks of {s['chunk']}, pages of {s['page_size']} tokens, "
        f"{s['decode_steps']} decode steps (banded mask: the dense explicit-mask check)"
    )
    return [title, *common.columns(head, rows)]


def ring_table(report: dict[str, Any]) -> list[str]:
    head = ("prompt", "ranks", "prefill s", "tokens/s", "KV MiB/rank", "peak MiB/rank",
            "sent MiB/layer", "attn GFLOP/layer by rank", "ring step ms", "at 10 Gbit/s ms")  # fmt: skip
    rows = []
    for r in report["ring"]["rows"]:
        a = r["arithmetic"]
        flops = " ".join(f"{f / 1e9:.0f}" for f in a["attention_flops_per_layer_by_rank"])
        at_link = a["seconds_per_step_at_10gbit"]
        link = "-" if at_link is None else f"{at_link * 1000:.1f}"
        if r["skipped"]:
            rows.append((str(r["prompt_len"]), str(r["ranks"]), "skipped", "", "", "",
                         mib(a["bytes_sent_per_rank_per_layer"]), flops, "", link))  # fmt: skip
            continue
        step = "-" if r["ring_step_s"] is None else f"{r['ring_step_s'] * 1000:.1f}"
        rows.append(
            (str(r["prompt_len"]), str(r["ranks"]), f"{r['prefill_s']:.1f}",
             f"{r['prefill_tokens_per_s']:.0f}", " ".join(mib(b) for b in r["kv_bytes_by_rank"]),
             " ".join(f"{b / 2**20:.0f}" for b in r["peak_memory_bytes_by_rank"]),
             mib(a["bytes_sent_per_rank_per_layer"]), flops, step, link)
        )  # fmt: skip
    lines = ["ring prefill (prefill s: the slowest rank; sent: per rank, per layer, all steps)"]
    lines += common.columns(head, rows)
    lines += [f"skipped {r['prompt_len']} x {r['ranks']}: {r['skipped']}"
              for r in report["ring"]["rows"] if r["skipped"]]  # fmt: skip
    return lines


def summary_table(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [
        f"{m['name']}, {m['num_layers']} layers, {report['dtype']} on {report['device']}, "
        f"OpenBLAS kernels {report['blas']['openblas_core']}"
    ]
    if report["window"]["rows"]:
        lines += window_table(report)
    if report["ring"]["rows"]:
        lines += ring_table(report)
    for c in report["agreement"]["checks"]:
        lines.append(
            f"agreement, {c['prompt_len']} tokens, {c['what']}: relative difference "
            f"{c['relative_diff']:.1e} ({'ok' if c['ok'] else 'TOO LARGE'})"
        )
    if report["ring"]["rows"]:
        lines += [f"note ({k}): {v}" for k, v in report["notes"].items()]
    return "\n".join(lines)


# --- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.bench_parser("bench-long-context", DESCRIPTION)
    common.add_model_arguments(p, "qwen3-0.6b", default_layers=DEFAULT_LAYERS)
    r = p.add_argument_group("runs")
    r.add_argument("--parts", nargs="+", choices=("window", "ring"), default=["window", "ring"])
    r.add_argument(
        "--prompt-lens", type=int_at_least(1), nargs="+", default=[4096, 8192],
        help="prompt tokens, in both parts; 16384 adds minutes to the window part (its full "
        "variant), and the ring part at 16384 does not fit in 24 GB: --parts window "
        "--prompt-lens 16384",
    )  # fmt: skip
    for flag, default, what in (
        ("--window", 1024, "the sliding window of every layer in the window variant (positions)"),
        ("--chunk", 512, "prefill chunk (tokens)"),
        ("--page-size", 16, "tokens per page"),
        ("--decode-steps", 16, "timed decode steps after the prefill (one untimed step first)"),
    ):
        r.add_argument(flag, type=int_at_least(1), default=default, help=what)
    r.add_argument(
        "--ranks", type=int_at_least(1), nargs="+", default=[1, 2],
        help="ring part: rank counts (1: a plain process; more: mlx.launch on this machine)",
    )  # fmt: skip
    r.add_argument("--seed", type=int_at_least(0), default=0, help="random weights, prompt ids")
    common.add_output_arguments(r, "long-context-<model>-<N>layers-<os>-<arch>-<N>cpu.json")
    common.add_child_spec_argument(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> common.BenchModel:
    """Every check that needs no weights; errors exit through argparse before any run."""
    args.prompt_lens, args.ranks = sorted(set(args.prompt_lens)), sorted(set(args.ranks))
    args.parts = list(dict.fromkeys(args.parts))
    model = common.bench_model_from_args(p, args, default_layers=DEFAULT_LAYERS)
    if model.qwen3_config.layer_windows:
        p.error(f"--model {args.model} has sliding windows of its own: use a model without")
    longest = args.prompt_lens[-1] + args.decode_steps + 1
    limit = int(model.config["max_position_embeddings"])
    if longest > limit:
        p.error(f"{longest} positions (the longest prompt and the decode steps) exceed {limit}")
    if "ring" in args.parts and args.prompt_lens[0] < args.ranks[-1]:
        p.error(f"a prompt of {args.prompt_lens[0]} tokens cannot be split over "
                f"{args.ranks[-1]} ranks")  # fmt: skip
    return model


def default_json_path(model: common.BenchModel) -> Path:
    return (
        common.RESULTS
        / f"long-context-{common.model_slug(model)}-{model.num_layers}layers-{common.host_slug()}.json"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_args_or_run(parser, argv, child_main)
    model = check_args(parser, args)
    common.restart_with_openblas(args)
    common.set_output_paths(parser, args, default_json_path(model))
    report = run_benchmark(args, model)
    bad = [c for c in report["agreement"]["checks"] if not c["ok"]]
    for c in bad:
        common.log(
            f"error: {c['what']} at {c['prompt_len']} tokens: relative difference "
            f"{c['relative_diff']:.2e} > {AGREEMENT_RTOL} (max |diff| {c['max_abs_diff']:.3g})"
        )
    if bad:
        return 1
    common.write_report(args, report, summary_table, seconds=report["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))
