"""The timed harness of bench-model: prefill and decode measured on every implementation,
interleaved (repeat 1 in one order, repeat 2 in the reverse, ...), each set against the
machine's ceilings through the FLOPs and bytes one pass needs."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from ceilings import stats
from common import BenchModel, log, median
from model_impls import MLX_LM, cache_arrays

from tiny_llm_support import Qwen3Config


@dataclass
class Workload:
    """What every measurement of a run shares."""

    model: BenchModel
    cfg: Qwen3Config
    dtype: mx.Dtype
    rng: random.Random  # the prompts' token ids
    ceilings: dict[str, Any] = field(default_factory=dict)  # the machine's, once measured


# --- FLOPs and bytes ---------------------------------------------------------------------


def layer_matmul_params(cfg) -> int:
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return e * q + 2 * e * kv + q * e + 3 * e * i


def prefill_flops(cfg, length: int) -> float:
    """2 FLOPs per matmul parameter per token (projections and MLP), the causal half of the
    attention scores and weighted sums, and the lm_head for the one kept row."""
    matmuls = 2.0 * length * layer_matmul_params(cfg)
    attention = 2.0 * cfg.num_attention_heads * cfg.head_dim * length * (length + 1)
    return cfg.num_hidden_layers * (matmuls + attention) + 2.0 * cfg.hidden_size * cfg.vocab_size


def decode_bytes(cfg, batch: int, context: int, itemsize: int) -> float:
    """The bytes one decode step has to read: every weight once (of the embedding table only
    the rows looked up) and, per layer and row, the keys and values of context + 1 positions."""
    e, d = cfg.hidden_size, cfg.head_dim
    weights = cfg.num_hidden_layers * (layer_matmul_params(cfg) + 2 * e + 2 * d)
    weights += e * cfg.vocab_size + e + batch * e  # lm_head, final norm, embedding rows
    kv = cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * (context + 1) * d
    return float((weights + kv) * itemsize)


# --- the measurements --------------------------------------------------------------------


def _order(repeat: int, names: Sequence[str]) -> list[str]:
    return list(names) if repeat % 2 == 0 else list(names)[::-1]


def random_tokens(rng: random.Random, model: BenchModel, shape: tuple[int, int]) -> mx.array:
    low, high = model.token_ids
    excluded = set(model.excluded_ids)
    ids: list[int] = []
    while len(ids) < shape[0] * shape[1]:
        t = rng.randrange(low, high)
        if t not in excluded:
            ids.append(t)
    return mx.array(ids, dtype=mx.int32).reshape(shape)


def _ratios(row: dict[str, Any], metric: str, higher_is_better: bool) -> dict[str, float]:
    """Throughput of each implementation over mlx-lm's: above 1, it is faster than mlx-lm."""
    base = row["impls"][MLX_LM][metric]["median"]
    return {
        name: m[metric]["median"] / base if higher_is_better else base / m[metric]["median"]
        for name, m in row["impls"].items()
        if name != MLX_LM
    }


def run_prefill(impl, tokens: mx.array) -> float:
    t0 = time.perf_counter()
    logits, cache = impl.prefill(tokens)
    mx.eval(logits, *cache_arrays(cache))
    return time.perf_counter() - t0


def measure_prefill(impls, lengths, repeats, long_repeats, long_from, w: Workload) -> list:
    rows = []
    for length in lengths:
        tokens = random_tokens(w.rng, w.model, (1, length))
        is_long = length >= long_from
        reps = long_repeats if is_long else repeats
        if not is_long:
            for impl in impls.values():  # warm-up at this shape
                run_prefill(impl, tokens)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(reps):
            for name in _order(r, impls):
                t = run_prefill(impls[name], tokens)
                times[name].append(t)
                log(
                    f"  prefill {length:>5} tokens  {name:<20} {r + 1}/{reps}: "
                    f"{length / t:8.1f} tok/s ({t:.2f} s)"
                )
        flops = prefill_flops(w.cfg, length)
        row: dict[str, Any] = {
            "kind": "prefill",
            "prompt_len": length,
            "repeats": reps,
            "warmup_runs": 0 if is_long else 1,
            "flops": flops,
            "impls": {},
        }
        for name, ts in times.items():
            gflops = [flops / t / 1e9 for t in ts]
            row["impls"][name] = {
                "tokens_per_s": stats([length / t for t in ts]),
                "seconds": stats(ts),
                "gflops": stats(gflops),
                "fraction_of_matmul_ceiling": median(gflops) / w.ceilings["matmul_ceiling_gflops"],
            }
        row["ratio_over_mlx_lm"] = _ratios(row, "tokens_per_s", higher_is_better=True)
        rows.append(row)
    return rows


def run_decode(impl, kv, tokens: mx.array, warmup: int, steps: int) -> list[float]:
    cache, offset = impl.decode_cache(kv)
    mx.eval(*cache_arrays(cache))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits, offset = impl.decode_step(tokens, cache, offset)
        tokens = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)[:, None]  # greedy
        mx.eval(tokens, *cache_arrays(cache))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def random_context(cfg, batch: int, context: int, dtype: mx.Dtype, seed: int):
    """Random keys/values [batch, H_kv, context, D] for every layer, shared by all models."""
    key = mx.random.key(seed)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    kv = []
    for _ in range(cfg.num_hidden_layers):
        key, k1, k2 = mx.random.split(key, 3)
        pair = (
            mx.random.uniform(-1, 1, shape, key=k1).astype(dtype),
            mx.random.uniform(-1, 1, shape, key=k2).astype(dtype),
        )
        mx.eval(pair)
        kv.append(pair)
    return kv


def measure_decode(impls, points, repeats, warmup, steps, w: Workload) -> list:
    rows = []
    for context, batch in points:
        kv = random_context(w.cfg, batch, context, w.dtype, seed=context * 16 + batch)
        tokens = random_tokens(w.rng, w.model, (batch, 1))
        per_step: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(repeats):
            for name in _order(r, impls):
                ts = run_decode(impls[name], kv, tokens, warmup, steps)
                per_step[name].append(sum(ts) / len(ts))
                log(
                    f"  decode ctx {context:>5} batch {batch}  {name:<20} {r + 1}/{repeats}: "
                    f"{1000 * per_step[name][-1]:8.1f} ms/step"
                )
        del kv
        nbytes = decode_bytes(w.cfg, batch, context, w.dtype.size)
        row: dict[str, Any] = {
            "kind": "decode",
            "context": context,
            "batch": batch,
            "repeats": repeats,
            "warmup_steps": warmup,
            "timed_steps": steps,
            "bytes_per_step": nbytes,
            "impls": {},
        }
        for name, ts in per_step.items():
            gbs = [nbytes / t / 1e9 for t in ts]
            row["impls"][name] = {
                "ms_per_step": stats([1000 * t for t in ts]),
                "tokens_per_s": stats([batch / t for t in ts]),
                "gbs": stats(gbs),
                "fraction_of_bandwidth_ceiling": median(gbs) / w.ceilings["bandwidth_ceiling_gbs"],
                "fraction_of_gemv": median(gbs) / w.ceilings["gemv_gbs"]["max"],
            }
        row["ratio_over_mlx_lm"] = _ratios(row, "ms_per_step", higher_is_better=False)
        rows.append(row)
    return rows


def check_agreement(impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """Every model on the same 16 tokens: with the same weights the last logits must match
    mlx-lm's (this is also everyone's first, compiling, call)."""
    tokens = random_tokens(w.rng, w.model, (1, 16))
    outs = {name: impl.prefill(tokens)[0].astype(mx.float32) for name, impl in impls.items()}
    base = outs[MLX_LM]
    report: dict[str, Any] = {"max_abs_logit_mlx_lm": mx.max(mx.abs(base)).item()}
    for name, out in outs.items():
        if name != MLX_LM:
            report[name] = {
                "max_abs_diff": mx.max(mx.abs(out - base)).item(),
                "same_argmax": bool(mx.all(mx.argmax(out, -1) == mx.argmax(base, -1)).item()),
            }
    return report
