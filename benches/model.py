"""The course's Qwen3 model against mlx-lm's, and both against the machine's limits.

One process builds one set of weights (by default the Qwen3-0.6B config with random weights:
the same shapes, so the same FLOPs and bytes as the real checkpoint, no download) and hands the
very same arrays to two implementations:

    ref      tiny_llm_ref.Qwen3Model (or your tiny_llm with --solution tiny_llm) with its dense
             TinyKvFullCache; a decode batch of B rows uses one dense cache of batch B per
             layer whose rows all hold the same context (--batch-cache batching: a
             BatchingKvCache over B one-row dense caches instead)
    mlx-lm   mlx_lm.models.qwen3.Model holding the same arrays, with its own KVCache from
             mlx_lm.models.cache.make_prompt_cache

Measured, interleaved between the two (repeat 1 runs ref then mlx-lm, repeat 2 mlx-lm then
ref, and so on, so a machine that slowly speeds up or slows down favours neither):

    prefill  tokens/s for a prompt of --prefill-lens tokens on an empty cache: the whole
             forward pass plus the logits of the last position (what a server needs)
    decode   ms per step at a context of --decode-contexts tokens for --decode-batches rows:
             the cache gets random keys/values of that length through its own
             update_and_fetch (the state a prefill leaves), then --decode-warmup untimed and
             --decode-steps timed greedy steps, each synchronized with mx.eval

and, in the same run, the machine's limits through MLX: fp32 and bf16 matmul GFLOP/s, copy
GB/s and the GB/s of one large matrix-vector product. Prefill is reported as a fraction of
the matmul ceiling (model FLOPs / time), decode as a fraction of the bandwidth ceiling
(bytes of weights and KV one step must read / time).

--ablate adds two ablations. Single operations at the model's shapes, the course's against
mx.fast / mlx-lm, each timed as one graph of several calls as in a forward pass (and the KV
cache append: the course's cache and a concatenating one against mlx-lm's KVCache). And the
course's model with mx.fast.scaled_dot_product_attention, with mx.fast.rms_norm + mx.fast.rope,
and with both, timed interleaved with the plain model and mlx-lm.

On Linux the mlx[cpu] wheel runs matmuls on its bundled reference BLAS; when Debian's
OpenBLAS is installed the script restarts itself with it preloaded
(tiny_llm_support.reexec_with_openblas; --no-openblas keeps the bundled one). The JSON
records which BLAS ran.

    pdm run bench-model                               # the full run: a few minutes
    pdm run bench-model --ablate                      # and the ablations: a few more
    pdm run bench-model --model tiny --prefill-lens 32 --decode-contexts 32
    pdm run bench-model --num-layers 2 --prefill-lens 128 512 --ablate
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import math
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `common` sits beside this file
    sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from common import (  # noqa: E402
    BenchModel,
    blas_info,
    host_info,
    int_at_least,
    median,
    mlx_info,
    resolve_bench_model,
    write_json,
)

from tiny_llm_support import (  # noqa: E402
    choose_device,
    gpu_available,
    mlx_lm_qwen3,
    reexec_with_openblas,
)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
MLX_LM = "mlx-lm"
# Whole-model ablation variants: (suffix, fast attention, fast norm + rope)
VARIANTS = (
    ("+fast-attention", True, False),
    ("+fast-norm-rope", False, True),
    ("+all-fast", True, True),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the machine's limits ----------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0


def _sample(fn: Callable[[], Any], repeats: int, budget_s: float) -> list[float]:
    """Times of `fn`: an untimed warm-up call, then up to `repeats` timed calls (at least 2,
    fewer once budget_s is spent). A warm-up call over 1.5 s counts as a sample itself: a
    kernel that slow gains nothing from warming up."""
    first = _timed(fn)
    times = [first] if first > 1.5 else []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        times.append(_timed(fn))
    return times


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {
        "median": median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def measure_ceilings(size: int, copy_mb: int, repeats: int, dtype: mx.Dtype) -> dict[str, Any]:
    """Matmul GFLOP/s (fp32, bf16, and fp16 if that is the dtype), copy and gemv GB/s."""
    out: dict[str, Any] = {"matmul_size": size}
    ka, kb = mx.random.split(mx.random.key(1))
    for name, dt in DTYPES.items():
        if name == "float16" and dt != dtype:
            continue
        a = mx.random.uniform(-1, 1, (size, size), key=ka).astype(dt)
        b = mx.random.uniform(-1, 1, (size, size), key=kb).astype(dt)
        mx.eval(a, b)
        times = _sample(lambda a=a, b=b: a @ b, repeats, budget_s=5.0)
        out[f"matmul_{name}_gflops"] = _stats([2.0 * size**3 / t / 1e9 for t in times])
        log(
            f"  matmul {size}x{size} {name}: {out[f'matmul_{name}_gflops']['max']:.1f} GFLOP/s "
            f"(best of {len(times)})"
        )

    # Copy: a float32 source larger than the caches, copied in 8 MB pieces. A single large
    # output would come from a fresh mmap every time on Linux, and the page faults of first
    # touching it would be timed as well; that number is recorded separately.
    piece = 2 * 1024 * 1024
    src = mx.random.uniform(-1, 1, (max(1, copy_mb * 1024 * 1024 // 4 // piece), piece), key=ka)
    mx.eval(src)
    views = [src[i] for i in range(src.shape[0])]  # slices of a contiguous array: no copies

    def copy_all() -> float:
        t0 = time.perf_counter()
        for view in views:
            mx.eval(view + 0)  # reads 4 bytes and writes 4 bytes per element
        return time.perf_counter() - t0

    copy_all()
    nbytes = 2 * src.nbytes
    out["copy_bytes"] = nbytes
    out["copy_gbs"] = _stats([nbytes / copy_all() / 1e9 for _ in range(max(2, repeats))])
    flat = src.reshape(-1)
    out["copy_fresh_allocation_gbs"] = _stats(
        [nbytes / _timed(lambda: flat + 0) / 1e9 for _ in range(2)]
    )

    # gemv: one row times a weight matrix far larger than the caches: the shape of decode.
    shape = (16384, 4096)
    w = mx.random.uniform(-1, 1, shape, key=ka).astype(dtype)
    v = mx.random.uniform(-1, 1, (1, shape[1]), key=kb).astype(dtype)
    mx.eval(w, v)
    times = _sample(lambda: v @ w.T, max(3, repeats), budget_s=4.0)
    out["gemv_gbs"] = _stats([w.nbytes / t / 1e9 for t in times])
    out["gemv_shape"] = list(shape)
    out["bandwidth_ceiling_gbs"] = max(out["copy_gbs"]["max"], out["gemv_gbs"]["max"])
    dname = next(name for name, dt in DTYPES.items() if dt == dtype)
    out["matmul_ceiling_gflops"] = out[f"matmul_{dname}_gflops"]["max"]
    out["ceiling_dtype"] = dname
    log(
        f"  copy {out['copy_gbs']['max']:.1f} GB/s (read+write, 8 MB pieces; "
        f"{out['copy_fresh_allocation_gbs']['max']:.1f} GB/s into one fresh "
        f"{nbytes // 2 >> 20} MB array), gemv {dname} {out['gemv_gbs']['max']:.1f} GB/s"
    )
    return out


# --- the implementations -----------------------------------------------------------------


class FastRMSNorm:
    """mx.fast.rms_norm with the weight and eps of a course RMSNorm."""

    def __init__(self, norm):
        self.weight, self.eps = norm.weight, norm.eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class FastRoPE:
    """mx.fast.rope behind the course's RoPE call: x [B, L, H, D], offset int or per row."""

    def __init__(self, rope, base: float):
        self.dims, self.traditional, self.base = rope.dims, rope.traditional, base

    def __call__(self, x: mx.array, offset: int | list[int] = 0) -> mx.array:
        off = offset if isinstance(offset, int) else mx.array(offset)
        y = mx.fast.rope(
            x.swapaxes(1, 2),
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=1.0,
            offset=off,
        )  # rope rotates [B, H, L, D]
        return y.swapaxes(1, 2)


def fast_attention(query, key, value, scale=None, mask=None):
    """The course's grouped attention signature on mx.fast.scaled_dot_product_attention."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return mx.fast.scaled_dot_product_attention(query, key, value, scale=scale, mask=mask)


class ConcatKvCache:
    """A dense cache done the obvious way: every append concatenates, so it copies everything
    cached so far (what TinyKvFullCache's preallocation avoids)."""

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, key: mx.array, value: mx.array):
        if self.keys is not None:
            key = mx.concatenate([self.keys, key], axis=2)
            value = mx.concatenate([self.values, value], axis=2)
        self.keys, self.values = key, value
        return key, value, None


class RefImpl:
    """The course's model and caches (tiny_llm_ref, or the student's tiny_llm); for the
    ablation, with attention or norms and RoPE swapped for mx.fast operations."""

    def __init__(
        self,
        package: str,
        ckpt,
        batch_cache: str,
        fast_attn: bool = False,
        fast_norm_rope: bool = False,
    ):
        self.pkg = importlib.import_module(package)
        self.model = self.pkg.Qwen3Model(ckpt)
        self.batch_cache = batch_cache
        self.attention_module = None
        if fast_attn:
            module = sys.modules[type(self.model.layers[0].self_attn).__module__]
            if not hasattr(module, "scaled_dot_product_attention_grouped"):
                raise RuntimeError(
                    f"{module.__name__} does not call "
                    "scaled_dot_product_attention_grouped: cannot swap it"
                )
            self.attention_module = module
        if fast_norm_rope:
            rope = FastRoPE(self.model.layers[0].self_attn.rope, ckpt.config.rope_theta)
            for layer in self.model.layers:
                attn = layer.self_attn
                layer.input_layernorm = FastRMSNorm(layer.input_layernorm)
                layer.post_attention_layernorm = FastRMSNorm(layer.post_attention_layernorm)
                attn.q_norm, attn.k_norm = FastRMSNorm(attn.q_norm), FastRMSNorm(attn.k_norm)
                attn.rope = rope
            self.model.norm = FastRMSNorm(self.model.norm)

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        """While the graph is built, the attention module calls fast_attention instead."""
        module, name = self.attention_module, "scaled_dot_product_attention_grouped"
        plain = getattr(module, name, None)
        if module is not None:
            setattr(module, name, fast_attention)
        try:
            yield
        finally:
            if module is not None:
                setattr(module, name, plain)

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self.model.create_kv_cache()
        with self._swapped():
            logits = self.model(tokens, 0, cache, logits_to_keep=1)  # [1, 1, V]
        return logits, cache

    def decode_cache(self, kv: list[tuple[mx.array, mx.array]]) -> tuple[list, int | list[int]]:
        b, s = kv[0][0].shape[0], kv[0][0].shape[2]
        if self.batch_cache == "batching" and b > 1:
            caches = []
            for k, v in kv:
                layer = self.pkg.BatchingKvCache(b)
                for row in range(b):
                    row_cache = self.pkg.TinyKvFullCache()
                    row_cache.update_and_fetch(k[row : row + 1], v[row : row + 1])
                    layer.add_request(row_cache, row)
                caches.append(layer)
            return caches, [s] * b
        caches = self.model.create_kv_cache()
        for c, (k, v) in zip(caches, kv):
            c.update_and_fetch(k, v)  # [B, H_kv, S, D]: the state a prefill leaves
        return caches, s

    def decode_step(self, tokens: mx.array, cache: list, offset: int | list[int]):
        with self._swapped():
            logits = self.model(tokens, offset, cache)  # [B, 1, V]
        nxt = offset + 1 if isinstance(offset, int) else [o + 1 for o in offset]
        return logits, nxt


class MlxLmImpl:
    """mlx-lm's Qwen3 holding the same weight arrays, with its own KV cache."""

    def __init__(self, ckpt):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = mlx_lm_qwen3(ckpt)  # the same weight arrays, no copy
        self._make_cache = make_prompt_cache

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self._make_cache(self.model)
        h = self.model.model(tokens, cache)[:, -1:, :]  # final-normed hidden state, last row
        if self.model.args.tie_word_embeddings:
            logits = self.model.model.embed_tokens.as_linear(h)
        else:
            logits = self.model.lm_head(h)
        return logits, cache

    def decode_cache(self, kv: list[tuple[mx.array, mx.array]]) -> tuple[list, int]:
        caches = self._make_cache(self.model)
        for c, (k, v) in zip(caches, kv):
            c.update_and_fetch(k, v)
        return caches, kv[0][0].shape[2]

    def decode_step(self, tokens: mx.array, cache: list, offset: int):
        return self.model(tokens, cache=cache), offset + 1


def cache_arrays(cache: list) -> list[mx.array]:
    """The storage of every layer cache (dense, batching or mlx-lm), evaluated with a step."""
    found: list[mx.array] = []
    for c in cache:
        parts = [s for s in c.slots if s is not None] if hasattr(c, "slots") else [c]
        for p in parts:
            found += [
                a
                for a in (getattr(p, "keys", None), getattr(p, "values", None))
                if isinstance(a, mx.array)
            ]
    return found


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


def measure_prefill(impls, lengths, repeats, long_repeats, long_from, rng, model, cfg, ceil):
    rows = []
    for length in lengths:
        tokens = random_tokens(rng, model, (1, length))
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
        flops = prefill_flops(cfg, length)
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
                "tokens_per_s": _stats([length / t for t in ts]),
                "seconds": _stats(ts),
                "gflops": _stats(gflops),
                "fraction_of_matmul_ceiling": median(gflops) / ceil["matmul_ceiling_gflops"],
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


def measure_decode(impls, points, repeats, warmup, steps, rng, model, cfg, dtype, ceil):
    rows = []
    for context, batch in points:
        kv = random_context(cfg, batch, context, dtype, seed=context * 16 + batch)
        tokens = random_tokens(rng, model, (batch, 1))
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
        nbytes = decode_bytes(cfg, batch, context, dtype.size)
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
                "ms_per_step": _stats([1000 * t for t in ts]),
                "tokens_per_s": _stats([batch / t for t in ts]),
                "gbs": _stats(gbs),
                "fraction_of_bandwidth_ceiling": median(gbs) / ceil["bandwidth_ceiling_gbs"],
                "fraction_of_gemv": median(gbs) / ceil["gemv_gbs"]["max"],
            }
        row["ratio_over_mlx_lm"] = _ratios(row, "ms_per_step", higher_is_better=False)
        rows.append(row)
    return rows


def check_agreement(impls, rng, model) -> dict[str, Any]:
    """Every model on the same 16 tokens: with the same weights the last logits must match
    mlx-lm's (this is also everyone's first, compiling, call)."""
    tokens = random_tokens(rng, model, (1, 16))
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


# --- ablation: single operations ---------------------------------------------------------


def ablate_ops(
    pkg, cfg, dtype: mx.Dtype, prefill_len: int, context: int, repeats: int, calls: int = 8
) -> list[dict[str, Any]]:
    """The course's ops against mx.fast / mlx-lm for each operation the two models do
    differently, in two regimes: prefill (one prompt of prefill_len tokens) and decode (one
    token over `context` cached ones). Each timing evaluates `calls` independent calls in one
    graph, as a forward pass does, so per-eval overhead does not swamp small operations. The
    estimate scales the difference by the calls per forward pass (RMSNorm of the hidden state
    twice per layer, the others once) per token; inside a model, operations overlap and fuse
    differently, so it is a guide, not an exact share of the step."""
    from mlx_lm.models.activations import swiglu
    from mlx_lm.models.cache import KVCache

    hq, hkv, d, e, inter = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    eps, theta, layers = cfg.rms_norm_eps, cfg.rope_theta, cfg.num_hidden_layers
    scale = 1.0 / math.sqrt(d)
    key = mx.random.key(3)

    def rnd(*shape):
        nonlocal key
        key, sub = mx.random.split(key)
        out = mx.random.uniform(-1, 1, shape, key=sub).astype(dtype)
        mx.eval(out)
        return out

    norm_w, head_w = mx.ones((e,), dtype=dtype), mx.ones((d,), dtype=dtype)
    rms_hidden, rms_head = pkg.RMSNorm(e, norm_w, eps), pkg.RMSNorm(d, head_w, eps)
    rope = pkg.RoPE(d, prefill_len + context + 64, theta)
    results: list[dict[str, Any]] = []

    def fast_rope(x, offset):  # x [B, L, H, D] -> [B, H, L, D], as mlx-lm applies it
        return mx.fast.rope(
            x.swapaxes(1, 2), d, traditional=False, base=theta, scale=1.0, offset=offset
        )

    def record(name, regime, per_layer, tokens, plain_fn, fast_fn, diff, note):
        times = {"plain": [], "fast": []}
        for r in range(repeats):
            for which in ("plain", "fast") if r % 2 == 0 else ("fast", "plain"):
                times[which].append(_timed(plain_fn if which == "plain" else fast_fn) / calls)
        p_ms, f_ms = 1000 * median(times["plain"]), 1000 * median(times["fast"])
        saved = (p_ms - f_ms) * per_layer * layers / tokens
        results.append(
            {
                "op": name,
                "regime": regime,
                "plain_ms": p_ms,
                "fast_ms": f_ms,
                "speedup": p_ms / f_ms if f_ms > 0 else None,
                "calls_per_layer": per_layer,
                "est_ms_saved_per_token": saved,
                "max_abs_diff": diff,
                "note": note,
            }
        )
        log(
            f"  {regime:<7} {name:<22} course {p_ms:8.3f} ms  fast {f_ms:8.3f} ms  "
            f"(x{p_ms / max(f_ms, 1e-9):4.1f}) -> {saved:+7.2f} ms/token over {layers} layers"
        )

    def add(name, regime, per_layer, tokens, inputs, plain, fast, note):
        plain_fn = lambda: [plain(*x) for x in inputs]
        fast_fn = lambda: [fast(*x) for x in inputs]
        mx.eval(plain_fn(), fast_fn())  # warm-up (mx.compile traces here)
        p0, f0 = plain(*inputs[0]), fast(*inputs[0])
        pairs = zip(p0, f0) if isinstance(p0, tuple) else [(p0, f0)]
        diff = max(
            mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item() for a, b in pairs
        )
        record(name, regime, per_layer, tokens, plain_fn, fast_fn, diff, note)

    for regime, length in (("prefill", prefill_len), ("decode", 1)):
        offset = 0 if regime == "prefill" else context
        s = length if regime == "prefill" else context + 1
        mask = "causal" if regime == "prefill" else None
        add(
            "rmsnorm hidden",
            regime,
            2,
            length,
            [(rnd(1, length, e),) for _ in range(calls)],
            rms_hidden,
            lambda x: mx.fast.rms_norm(x, norm_w, eps),
            "course RMSNorm vs mx.fast.rms_norm on [1, L, E]",
        )
        qk = [(rnd(1, length, hq, d), rnd(1, length, hkv, d)) for _ in range(calls)]
        add(
            "rmsnorm q,k",
            regime,
            1,
            length,
            qk,
            lambda q, k: (rms_head(q), rms_head(k)),
            lambda q, k: (mx.fast.rms_norm(q, head_w, eps), mx.fast.rms_norm(k, head_w, eps)),
            "QK-norm of [1, L, H, D] queries and keys",
        )
        add(
            "rope q,k",
            regime,
            1,
            length,
            qk,
            lambda q, k, o=offset: (rope(q, o).swapaxes(1, 2), rope(k, o).swapaxes(1, 2)),
            lambda q, k, o=offset: (fast_rope(q, o), fast_rope(k, o)),
            "course RoPE (table gather, halves, concatenate) vs mx.fast.rope",
        )
        add(
            "silu(gate) * up",
            regime,
            1,
            length,
            [(rnd(1, length, inter), rnd(1, length, inter)) for _ in range(calls)],
            lambda g, u: pkg.silu(g) * u,
            swiglu,
            "plain ops vs mlx-lm's compiled swiglu",
        )
        add(
            "attention core",
            regime,
            1,
            length,
            [(rnd(1, hq, length, d), rnd(1, hkv, s, d), rnd(1, hkv, s, d)) for _ in range(calls)],
            lambda q, k, v, m=mask: pkg.scaled_dot_product_attention_grouped(q, k, v, scale, m),
            lambda q, k, v, m=mask: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=scale, mask=m
            ),
            "grouped matmul + softmax vs mx.fast.scaled_dot_product_attention",
        )

    # The KV cache at decode: each of `calls` layer caches holds `context` positions and gets
    # one more; the step then reads all of them (keys and values returned).
    base = [(rnd(1, hkv, context, d), rnd(1, hkv, context, d)) for _ in range(calls)]
    new = [(rnd(1, hkv, 1, d), rnd(1, hkv, 1, d)) for _ in range(calls)]
    groups = {
        "course": [pkg.TinyKvFullCache() for _ in range(calls)],
        "concat": [ConcatKvCache() for _ in range(calls)],
        "mlx-lm": [KVCache() for _ in range(calls)],
    }
    for group in groups.values():
        for c, (k, v) in zip(group, base):
            c.update_and_fetch(k, v)
        mx.eval(*cache_arrays(group))

    def appender(group):
        return lambda: [c.update_and_fetch(k, v)[:2] for c, (k, v) in zip(group, new)]

    for _ in range(2):  # warm-up: the preallocated caches grow by 256 positions on the first
        mx.eval(*[appender(g)() for g in groups.values()])
    record(
        "kv cache append",
        "decode",
        1,
        1,
        appender(groups["course"]),
        appender(groups["mlx-lm"]),
        None,
        f"TinyKvFullCache vs mlx-lm KVCache (both preallocated, slice update) at context "
        f"{context}, batch 1",
    )
    record(
        "kv append, concatenating",
        "decode",
        1,
        1,
        appender(groups["concat"]),
        appender(groups["mlx-lm"]),
        None,
        f"a cache that concatenates (copies all {context} positions) vs mlx-lm KVCache",
    )
    return results


# --- ablation: whole-model variants ------------------------------------------------------


def ablate_models(args, ckpt, base_impls, rng, model, cfg, dtype, ceilings):
    """The course's model with mx.fast attention, norms + RoPE, or both, next to the plain
    model and mlx-lm: prefill at --ablate-len, decode at the largest context and batch."""
    impls = dict(base_impls)
    for suffix, fast_attn, fast_norm_rope in VARIANTS:
        impls[args.solution + suffix] = RefImpl(
            SOLUTIONS[args.solution], ckpt, args.batch_cache, fast_attn, fast_norm_rope
        )
    agreement = check_agreement(impls, rng, model)
    for name in impls:
        if name not in base_impls:
            log(f"  {name}: max |logit diff| vs mlx-lm {agreement[name]['max_abs_diff']:.2e}")
    reps = args.ablate_repeats
    prefill = measure_prefill(
        impls, [args.ablate_len], reps, reps, 10**9, rng, model, cfg, ceilings
    )
    point = (max(args.decode_contexts or [1024]), max(args.decode_batches))
    decode = measure_decode(
        impls,
        [point],
        reps,
        args.decode_warmup,
        args.decode_steps,
        rng,
        model,
        cfg,
        dtype,
        ceilings,
    )
    return {
        "agreement": agreement,
        "prefill": prefill,
        "decode": decode,
        "variants": {
            args.solution + s: {"fast_attention": a, "fast_rms_norm_and_rope": n}
            for s, a, n in VARIANTS
        },
    }


# --- report ------------------------------------------------------------------------------


def _spread(stats: dict[str, Any], digits: int = 1) -> str:
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def markdown_table(report: dict[str, Any]) -> str:
    ref = report["solution_label"]
    lines = [
        f"| Measurement | {ref} | mlx-lm | {ref} / mlx-lm | {ref}, share of ceiling "
        f"| mlx-lm, share of ceiling |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["prefill"] + report["decode"]:
        a, b = row["impls"][ref], row["impls"][MLX_LM]
        if row["kind"] == "prefill":
            what, metric, share = (
                f"prefill {row['prompt_len']} tokens (tokens/s)",
                "tokens_per_s",
                "fraction_of_matmul_ceiling",
            )
        else:
            what, metric, share = (
                f"decode context {row['context']}, batch {row['batch']} (ms/step)",
                "ms_per_step",
                "fraction_of_bandwidth_ceiling",
            )
        lines.append(
            f"| {what} | {_spread(a[metric])} | {_spread(b[metric])} "
            f"| {row['ratio_over_mlx_lm'][ref]:.2f} | {100 * a[share]:.0f}% "
            f"| {100 * b[share]:.0f}% |"
        )
    c, m, s = report["ceilings"], report["model"], report["settings"]
    lines += [
        "",
        f"Ceilings, same run: matmul {c['matmul_size']}x{c['matmul_size']} fp32 "
        f"{c['matmul_float32_gflops']['max']:.1f} GFLOP/s, bf16 "
        f"{c['matmul_bfloat16_gflops']['max']:.1f} GFLOP/s; copy {c['copy_gbs']['max']:.1f} "
        f"GB/s, gemv {c['gemv_gbs']['max']:.1f} GB/s (bandwidth ceiling "
        f"{c['bandwidth_ceiling_gbs']:.1f} GB/s). Model {m['name']}, {m['num_layers']} layers, "
        f"{m['parameters'] / 1e6:.1f}M parameters{', random weights' if m['random_weights'] else ''}"
        f", {report['dtype']} on {report['device']}; BLAS {report['blas']['blas']}; MLX "
        f"{report['mlx']['version']}, mlx-lm {report['mlx_lm_version']}; "
        f"{report['host']['cpu_count']} CPUs ({report['host']['machine']}); {ref} decode cache "
        f"at batch > 1: {s['batch_cache']}. Median (min-max) of {s['repeats']} repeats "
        f"({s['long_repeats']} for prompts of {s['long_from']}+ tokens); decode: "
        f"{s['decode_steps']} timed steps per repeat. Total runtime "
        f"{report['runtime_s'] / 60:.1f} min.",
    ]
    ab = report.get("ablation")
    if ab:
        lines += [
            "",
            "| Operation | regime | course ms | mx.fast / mlx-lm ms | est. ms per token |",
            "|---|---|---:|---:|---:|",
        ]
        for a in ab["ops"]:
            lines.append(
                f"| {a['op']} | {a['regime']} | {a['plain_ms']:.3f} | "
                f"{a['fast_ms']:.3f} | {a['est_ms_saved_per_token']:+.2f} |"
            )
        pre, dec = ab["models"]["prefill"][0], ab["models"]["decode"][0]
        lines += [
            "",
            f"| Model | prefill {pre['prompt_len']} (tokens/s) | decode context "
            f"{dec['context']}, batch {dec['batch']} (ms/step) | vs mlx-lm "
            f"(prefill / decode) |",
            "|---|---:|---:|---:|",
        ]
        for name in dec["impls"]:
            rp, rd = pre["ratio_over_mlx_lm"].get(name), dec["ratio_over_mlx_lm"].get(name)
            lines.append(
                f"| {name} | {_spread(pre['impls'][name]['tokens_per_s'])} "
                f"| {_spread(dec['impls'][name]['ms_per_step'])} "
                f"| {f'{rp:.2f} / {rd:.2f}' if rp else '-'} |"
            )
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    pos, nonneg = int_at_least(1), int_at_least(0)
    p = argparse.ArgumentParser(
        prog="bench-model",
        description="Prefill and decode speed of the course's Qwen3 against mlx-lm's on the "
        "same weights, and both against this machine's matmul and bandwidth limits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="tiny, a shortcut (qwen3-0.6b, qwen3-1.7b: embedded config, random "
        "weights), a checkpoint directory, or the path of a config.json",
    )
    m.add_argument(
        "--random-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random weights with the model's shapes; default: on for shortcuts with "
        "an embedded config and config.json paths, off for checkpoints",
    )
    m.add_argument(
        "--num-layers", type=pos, default=None, help="keep only this many layers (quick runs)"
    )
    m.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: float32 on the CPU, bfloat16 on a GPU",
    )
    m.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    m.add_argument(
        "--solution",
        choices=sorted(SOLUTIONS),
        default="ref",
        help="ref: tiny_llm_ref; tiny_llm: your own solution",
    )
    m.add_argument(
        "--batch-cache",
        choices=("dense", "batching"),
        default="dense",
        help="the course's cache for decode batches > 1: one dense cache of batch B "
        "per layer, or a BatchingKvCache over B one-row dense caches",
    )
    m.add_argument(
        "--offline",
        action="store_true",
        help="never download: real weights must be in the Hugging Face cache",
    )
    m.add_argument(
        "--no-openblas",
        action="store_true",
        help="on Linux, keep the bundled reference BLAS of the mlx[cpu] wheel",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--prefill-lens",
        type=pos,
        nargs="*",
        default=[128, 512, 2048],
        metavar="N",
        help="prompt lengths (none: no prefill measurements)",
    )
    w.add_argument(
        "--decode-contexts",
        type=pos,
        nargs="*",
        default=[128, 1024],
        metavar="N",
        help="cached tokens at the timed decode steps (none: no decode measurements)",
    )
    w.add_argument(
        "--decode-batches",
        type=pos,
        nargs="+",
        default=[1, 4],
        metavar="B",
        help="rows decoded together",
    )
    w.add_argument("--decode-steps", type=pos, default=6, help="timed decode steps per repeat")
    w.add_argument(
        "--decode-warmup",
        type=nonneg,
        default=1,
        help="untimed decode steps before them (the caches grow on the first)",
    )
    w.add_argument(
        "--repeats",
        type=pos,
        default=3,
        help="repeats of each measurement; the order of the models alternates",
    )
    w.add_argument(
        "--long-repeats",
        type=pos,
        default=2,
        help="repeats for prompts of --long-from tokens or more, which get no warm-up "
        "run of their own (the shorter prompts warmed the kernels up)",
    )
    w.add_argument("--long-from", type=pos, default=1024)
    w.add_argument(
        "--quick",
        action="store_true",
        help="prompts up to 512 tokens only, at most 2 repeats, 4 decode steps",
    )
    w.add_argument("--seed", type=nonneg, default=0, help="weights and tokens")
    a = p.add_argument_group("ablation")
    a.add_argument(
        "--ablate",
        action="store_true",
        help="time single operations against mx.fast / mlx-lm, and the course's "
        "model with mx.fast attention, norms and RoPE",
    )
    a.add_argument(
        "--ablate-len", type=pos, default=512, help="prompt length of the prefill ablations"
    )
    a.add_argument(
        "--ablate-repeats", type=pos, default=2, help="repeats of each whole-model variant"
    )
    c = p.add_argument_group("ceilings")
    c.add_argument("--matmul-size", type=pos, default=2048)
    c.add_argument(
        "--copy-mb", type=pos, default=256, help="MB copied for the bandwidth measurement"
    )
    c.add_argument("--ceiling-repeats", type=pos, default=3)
    o = p.add_argument_group("output")
    o.add_argument(
        "--json-output",
        type=Path,
        default=None,
        help="default: benches/results/bench-model-<host>-<date>-<time>.json",
    )
    return p


def default_json_path() -> Path:
    host = re.sub(r"[^A-Za-z0-9.]+", "-", platform.node()).strip("-").lower() or "host"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    return HERE / "results" / f"bench-model-{host}-{stamp}.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.no_openblas:
        reexec_with_openblas()  # returns only where no restart is needed
    started = time.time()
    if args.quick:
        args.prefill_lens = [n for n in args.prefill_lens if n <= 512] or [128]
        args.repeats, args.long_repeats = min(args.repeats, 2), min(args.long_repeats, 2)
        args.decode_steps = min(args.decode_steps, 4)
    if args.json_output is not None and args.json_output.is_dir():
        parser.error(f"{args.json_output} is a directory; give a file name")
    if args.device == "gpu" and not gpu_available():
        parser.error("--device gpu: MLX has no Metal or CUDA device here")
    try:
        import mlx_lm
    except ImportError:
        parser.error("mlx-lm is not installed (it is in the dev group: pdm sync -G dev)")
    try:
        model = resolve_bench_model(
            args.model, args.random_weights, args.num_layers, args.seed, args.offline or None
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(f"--model {args.model}: {e}")
    contexts = args.decode_contexts or ([1024] if args.ablate else [])
    longest = max(
        [
            *args.prefill_lens,
            16,
            args.ablate_len if args.ablate else 0,
            *[c + args.decode_warmup + args.decode_steps + 1 for c in contexts],
        ]
    )
    if longest > int(model.config["max_position_embeddings"]):
        parser.error(
            f"{longest} positions exceed the model's max_position_embeddings "
            f"({model.config['max_position_embeddings']})"
        )

    device = choose_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device == "gpu" else "float32")
    dtype = DTYPES[args.dtype]
    blas = blas_info()
    unused = blas["openblas_path"] and "openblas" not in blas["blas"]
    log(
        f"BLAS: {blas['blas']}"
        + (f" (OpenBLAS at {blas['openblas_path']} not used)" if unused else "")
    )
    if device == "cpu" and "reference" in blas["blas"]:
        log(
            "warning: the bundled reference BLAS runs fp32 matmuls 20-40x slower than "
            "OpenBLAS: `sudo apt-get install libopenblas0-pthread` (see the Performance "
            "appendix), or expect a long run"
        )

    t = time.perf_counter()
    ckpt = model.load(args.dtype)
    cfg = ckpt.config
    label = args.solution
    try:
        impls = {label: RefImpl(SOLUTIONS[label], ckpt, args.batch_cache), MLX_LM: MlxLmImpl(ckpt)}
        rng = random.Random(args.seed)
        agreement = check_agreement(impls, rng, model)
    except NotImplementedError as e:
        log(f"error: {SOLUTIONS[label]} is not complete yet: {e}")
        return 1
    log(
        f"model {model.name}: {model.num_layers} layers, {model.parameter_count() / 1e6:.1f}M "
        f"parameters ({'random' if model.random_weights else 'checkpoint'} weights), "
        f"{args.dtype} on {device}, ready in {time.perf_counter() - t:.1f} s"
    )
    log(
        f"same 16 tokens through both: max |logit diff| {agreement[label]['max_abs_diff']:.2e} "
        f"(largest logit {agreement['max_abs_logit_mlx_lm']:.2f}), same argmax: "
        f"{agreement[label]['same_argmax']}"
    )

    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    ceilings = measure_ceilings(args.matmul_size, args.copy_mb, args.ceiling_repeats, dtype)
    prefill = measure_prefill(
        impls,
        args.prefill_lens,
        args.repeats,
        args.long_repeats,
        args.long_from,
        rng,
        model,
        cfg,
        ceilings,
    )
    points = [(c, b) for c in args.decode_contexts for b in args.decode_batches]
    decode = measure_decode(
        impls,
        points,
        args.repeats,
        args.decode_warmup,
        args.decode_steps,
        rng,
        model,
        cfg,
        dtype,
        ceilings,
    )
    ablation = None
    if args.ablate:
        log("ablation, single operations (median time of one call):")
        ops = ablate_ops(
            impls[label].pkg, cfg, dtype, args.ablate_len, max(contexts), max(args.repeats, 5)
        )
        log("ablation, the course's model with mx.fast operations:")
        models = ablate_models(args, ckpt, impls, rng, model, cfg, dtype, ceilings)
        ablation = {"ops": ops, "models": models}

    report = {
        "benchmark": "bench-model",
        "command": " ".join(sys.orig_argv),
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "host": host_info(),
        "mlx": mlx_info(),
        "mlx_lm_version": getattr(mlx_lm, "__version__", "unknown"),
        "blas": {
            **blas,
            "no_openblas": args.no_openblas,
            "reexecuted_with_openblas": os.environ.get("TINY_LLM_OPENBLAS_PRELOADED") == "1",
        },
        "env": {
            k: os.environ.get(k)
            for k in (
                "LD_PRELOAD",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS",
                "TINY_LLM_NO_OPENBLAS",
            )
        },
        "device": device,
        "dtype": args.dtype,
        "solution": SOLUTIONS[label],
        "solution_label": label,
        "ref_batch_cache": (
            "one dense TinyKvFullCache of batch B per layer"
            if args.batch_cache == "dense"
            else "BatchingKvCache over B one-row TinyKvFullCaches per layer"
        ),
        "mlx_lm_cache": "make_prompt_cache: KVCache, preallocated 256 positions at a time",
        "model": model.describe(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ceilings": ceilings,
        "agreement": agreement,
        "prefill": prefill,
        "decode": decode,
        "ablation": ablation,
        "notes": [
            "ratio_over_mlx_lm is a throughput ratio: above 1 that model is faster than mlx-lm",
            "prefill FLOPs: 2 per matmul parameter per token, the causal half of QK^T and PV, "
            "and the lm_head for the last position only; share of ceiling = GFLOP/s over the "
            "matmul GFLOP/s of the run's dtype",
            "decode bytes: every weight once per step (embedding: only the rows looked up) "
            "plus keys and values of context + 1 positions per row and layer; share of "
            "ceiling = GB/s over the larger of copy and gemv GB/s",
        ],
    }
    report["runtime_s"] = time.time() - started
    path = args.json_output or default_json_path()
    write_json(path, report)
    log(f"wrote {path} (total {report['runtime_s']:.0f} s)")
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
