"""bench-long-context's runs, each in a process of its own (long_context.measure picks one).
window_run: one attention variant at one length, a chunked prefill then decode steps, on paged
caches (full, or a sliding window that gives pages back) or on the oracle's dense caches with
explicit banded masks. ring_run: one rank of ring_prefill, and one ring step timed after it.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness
from benches.ceilings import timed
from tiny_llm_ref.kv_cache import TinyKvFullCache
from tiny_llm_support import Checkpoint, Qwen3Config, choose_device
from tiny_llm_support.cli import DTYPES, load_solution

ORACLE = "banded-mask"  # the explicit-mask run the windowed one is checked against
RING_STEP_REPEATS = 5  # ring steps timed, after a warm-up


def kv_bytes_per_token(config: Qwen3Config, dtype_size: int) -> int:
    """Keys and values of one token in one layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_size


def load(spec: dict[str, Any]) -> tuple[harness.BenchModel, Checkpoint, Any, list[int]]:
    """The spec's model (weights read now), the solution, and its prompt and decode ids: random
    ordinary ids, the same for every run of one length."""
    s = spec["settings"]
    choose_device(s["device"])
    bench_model, ckpt = harness.load_weights(spec["model"], s["dtype"])
    low, high = bench_model.token_ids
    allowed = np.setdiff1d(np.arange(low, high), bench_model.excluded_ids)
    count = spec["prompt_len"] + s["decode_steps"] + 1
    ids = np.random.RandomState(s["seed"]).choice(allowed, count)
    return bench_model, ckpt, load_solution(s["solution"]), ids.tolist()


def windowed(ckpt: Checkpoint, config: dict[str, Any], window: int) -> Checkpoint:
    """The same weights with a sliding window of `window` positions on every layer, in the
    config fields transformers reads."""
    raw = {**config, "use_sliding_window": True, "sliding_window": window,
           "layer_types": ["sliding_attention"] * config["num_hidden_layers"]}  # fmt: skip
    windowed_config = Qwen3Config.from_dict(raw, source="the windowed config")
    return Checkpoint(ckpt.path, windowed_config, ckpt.weights, ckpt.tokenizer)


class BandedMaskCache(TinyKvFullCache):
    """The oracle of the window: a dense cache that hands attention every key with an explicit
    [L, S] banded mask (0 where a query sees the key, -inf elsewhere): nothing skipped, nothing
    paged, the dense attention of Week 2 Day 1 with another mask."""

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


def kv_memory(config: Qwen3Config, pools, caches, dtype_size: int, page_size: int) -> dict:
    """The KV numbers of a run: pages for the paged variants, the dense buffers for the oracle.
    kv_peak_bytes: the most pages in use at once in each pool, summed, times a page's bytes;
    kv_pool_bytes: the pools' storage at the end (a pool grows and never shrinks)."""
    if pools is None:
        return {"kv_dense_buffer_bytes": sum(c.keys.nbytes + c.values.nbytes for c in caches)}
    page_bytes = page_size * kv_bytes_per_token(config, dtype_size)
    peak_pages = sum(pool.peak_in_use for pool in pools)
    return {"page_bytes": page_bytes, "peak_pages": peak_pages,
            "kv_peak_bytes": peak_pages * page_bytes,
            "kv_pool_bytes": sum(pool.nbytes for pool in pools),
            "pages_in_use_end": sum(pool.num_in_use for pool in pools),
            "pages_released": sum(getattr(cache, "released", 0) for cache in caches)}  # fmt: skip


def window_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant at one length: chunked prefill, then decode steps (the first one untimed);
    its logits (last prompt token, last step) go to spec["logits"]."""
    t0 = time.perf_counter()
    s, variant, length = spec["settings"], spec["variant"], spec["prompt_len"]
    bench_model, ckpt, api, ids = load(spec)
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
    chunks = [ids[i : min(i + s["chunk"], length)] for i in range(0, length, s["chunk"])]
    chunk_s, prefill_logits = forward_each(model, caches, chunks, 0)
    step_s, decode_logits = forward_each(model, caches, [[i] for i in ids[length:]], length)
    np.savez(spec["logits"], prefill=np.array(prefill_logits), decode=np.array(decode_logits))
    return {"part": "window", "variant": variant, "prompt_len": length,
            "blas": harness.process_blas(), "load_s": load_s, "chunk_s": chunk_s,
            "prefill_s": sum(chunk_s), "last_chunk_s": chunk_s[-1], "decode_step_s": step_s[1:],
            "decode_ms": harness.median(step_s[1:]) * 1000, "weights_bytes": weights_bytes,
            "peak_memory_bytes": mx.get_peak_memory(),
            **kv_memory(ckpt.config, pools, caches, DTYPES[s["dtype"]].size, s["page_size"])}  # fmt: skip


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
        steps = [
            timed(lambda: ring.pass_along(*kv, group, shape)) for _ in range(RING_STEP_REPEATS + 1)
        ]
        step_s = steps[1:]  # the first is a warm-up
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
