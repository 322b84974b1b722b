"""The course's Qwen3 model against mlx-lm's, and both against the machine's limits.

One process builds one set of weights (by default the Qwen3-0.6B config with random weights:
the same shapes, so the same FLOPs and bytes as the real checkpoint, no download) and hands the
very same arrays to two implementations:

    ref      tiny_llm_ref.Qwen3Model (or your tiny_llm with --solution tiny_llm), its dense
             TinyKvFullCache; batch-4 decode uses one dense cache of batch 4 whose rows all
             hold the same context (--batch-cache batching uses BatchingKvCache instead)
    mlx-lm   mlx_lm.models.qwen3.Model with the same arrays, its own preallocated KVCache
             from mlx_lm.models.cache.make_prompt_cache

Measured, interleaved between the two (one repeat runs ref then mlx-lm, the next mlx-lm
then ref, so a machine that slowly speeds up or slows down favours neither):

    prefill  tokens/s for prompts of --prefill-lens tokens on an empty cache: the whole
             forward pass plus the logits of the last position (what a server needs)
    decode   ms per step at a context of --decode-contexts tokens for --decode-batches rows;
             the cache is filled with random keys/values of that length through the cache's
             own update_and_fetch (the state a prefill would leave), then one warm-up step
             and --decode-steps timed steps, each synchronized with mx.eval

and the machine's limits in the same run: fp32 and bf16 matmul GFLOP/s, memory copy GB/s
and a large matrix-vector product (weight-streaming) GB/s, all through MLX. Prefill is
reported as a fraction of the matmul ceiling (model FLOPs / time), decode as a fraction of
the bandwidth ceiling (bytes of weights and KV read per step / time). --ablate times single
operations, plain ops (the course) against mx.fast / mlx-lm, at the model's shapes.

On Linux the mlx[cpu] wheel runs matmuls on its bundled reference BLAS; when Debian's
OpenBLAS is installed the script re-executes itself with it in LD_PRELOAD (--no-openblas
keeps the bundled one). The JSON records which BLAS ran.

    pdm run bench-model                                  # the full run (minutes)
    pdm run bench-model --model tiny --prefill-lens 32 --decode-contexts 32
    pdm run bench-model --num-layers 2 --prefill-lens 128 512 --ablate
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
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
    median,
    mlx_info,
    openblas_preload_env,
    resolve_bench_model,
    write_json,
)

from tiny_llm_support import choose_device, expected_shapes, gpu_available  # noqa: E402

REEXEC_GUARD = "TINY_LLM_BENCH_MODEL_REEXEC"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
MLX_LM = "mlx-lm"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- BLAS --------------------------------------------------------------------------------


def reexec_with_openblas(no_openblas: bool) -> None:
    """Replace this process by the same command with Debian's OpenBLAS preloaded, once.

    Nothing happens with --no-openblas, off Linux, without OpenBLAS installed, when it is
    already loaded, or in the re-executed process itself (the guard variable stops loops).
    """
    if no_openblas or os.environ.get(REEXEC_GUARD):
        return
    env, lib = openblas_preload_env()
    if lib is None:  # not Linux, not installed, or already running on it
        return
    env[REEXEC_GUARD] = "1"
    log(f"re-running with OpenBLAS preloaded: LD_PRELOAD={env['LD_PRELOAD']}")
    sys.stdout.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


# --- the machine's limits ----------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0


def _best_times(fn: Callable[[], Any], repeats: int, budget_s: float) -> list[float]:
    """One untimed call, then up to `repeats` timed ones (at least 2, stopping after budget_s)."""
    mx.eval(fn())
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        times.append(_timed(fn))
    return times


def measure_ceilings(size: int, copy_mb: int, repeats: int, dtype: mx.Dtype) -> dict[str, Any]:
    """Matmul GFLOP/s (fp32, bf16 and the benchmark's dtype), copy and gemv GB/s, via MLX."""
    out: dict[str, Any] = {"matmul_size": size}
    key = mx.random.key(1)
    flops = 2.0 * size**3
    for name, dt in (("float32", mx.float32), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        if name == "float16" and dt != dtype:
            continue  # fp16 only when the benchmark runs in it
        a = mx.random.uniform(-1, 1, (size, size), key=key).astype(dt)
        b = mx.random.uniform(-1, 1, (size, size), key=mx.random.split(key)[0]).astype(dt)
        mx.eval(a, b)
        times = _best_times(lambda a=a, b=b: a @ b, repeats, budget_s=6.0)
        out[f"matmul_{name}_gflops"] = _stats([flops / t / 1e9 for t in times])
        log(f"  matmul {size}x{size} {name}: {out[f'matmul_{name}_gflops']['max']:.1f} GFLOP/s "
            f"(best of {len(times)})")

    # Copy: a source larger than the caches, copied in 8 MB pieces. One large output would be
    # a fresh mmap each time on Linux (malloc hands out big blocks that way), and the page
    # faults of touching it would be timed too; that is recorded separately below.
    piece = 2 * 1024 * 1024  # float32 elements = 8 MB
    pieces = max(1, copy_mb * 1024 * 1024 // 4 // piece)
    src = mx.random.uniform(-1, 1, (pieces, piece), key=key)
    mx.eval(src)
    rows = [src[i] for i in range(pieces)]  # views, no copies

    def copy_all() -> float:
        t0 = time.perf_counter()
        for r in rows:
            y = r + 0  # read 4 bytes and write 4 bytes per element
            mx.eval(y)
            del y
        return time.perf_counter() - t0

    copy_all()
    nbytes = 2 * src.nbytes
    copy_times = [copy_all() for _ in range(max(2, repeats))]
    out["copy_gbs"] = _stats([nbytes / t / 1e9 for t in copy_times])
    out["copy_bytes"] = nbytes
    whole = src.reshape(-1)
    fresh = [_timed(lambda: whole + 0) for _ in range(2)]
    out["copy_fresh_allocation_gbs"] = _stats([nbytes / t / 1e9 for t in fresh])

    # gemv: one row times a weight matrix larger than the caches, the shape of decode.
    rows_w, cols_w = 16384, 4096
    w = mx.random.uniform(-1, 1, (rows_w, cols_w), key=key).astype(dtype)
    v = mx.random.uniform(-1, 1, (1, cols_w), key=key).astype(dtype)
    mx.eval(w, v)
    times = _best_times(lambda: v @ w.T, max(3, repeats), budget_s=4.0)
    out["gemv_gbs"] = _stats([w.nbytes / t / 1e9 for t in times])
    out["gemv_shape"] = [rows_w, cols_w]
    out["bandwidth_ceiling_gbs"] = max(out["copy_gbs"]["max"], out["gemv_gbs"]["max"])
    dname = _dtype_name(dtype)
    out["matmul_ceiling_gflops"] = out[f"matmul_{dname}_gflops"]["max"]
    out["ceiling_dtype"] = dname
    log(f"  copy {out['copy_gbs']['max']:.1f} GB/s (read+write, 8 MB pieces; "
        f"{out['copy_fresh_allocation_gbs']['max']:.1f} GB/s into one fresh "
        f"{nbytes // 2 >> 20} MB array), gemv {out['gemv_gbs']['max']:.1f} GB/s")
    return out


# --- the two implementations -------------------------------------------------------------


class RefImpl:
    """The course's model and dense cache (tiny_llm_ref, or the student's tiny_llm)."""

    def __init__(self, package: str, ckpt, max_seq_len: int, batch_cache: str):
        self.pkg = importlib.import_module(package)
        self.model = self.pkg.Qwen3Model(ckpt, max_seq_len=max_seq_len)
        self.batch_cache = batch_cache

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self.model.create_kv_cache()
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
            c.update_and_fetch(k, v)  # [B, H_kv, S, D]: the state a prefill would leave
        return caches, s

    def decode_step(self, tokens: mx.array, cache: list, offset: int | list[int]):
        logits = self.model(tokens, offset, cache)  # [B, 1, V]
        nxt = offset + 1 if isinstance(offset, int) else [o + 1 for o in offset]
        return logits, nxt


class MlxLmImpl:
    """mlx-lm's Qwen3 with the same weight arrays and its own KV cache."""

    def __init__(self, ckpt):
        from mlx_lm.models import qwen3
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        c = ckpt.config
        args = qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            vocab_size=c.vocab_size,
            num_key_value_heads=c.num_key_value_heads,
            max_position_embeddings=c.max_position_embeddings,
            rope_theta=c.rope_theta,
            head_dim=c.head_dim,
            tie_word_embeddings=c.tie_word_embeddings,
        )
        self.model = qwen3.Model(args)
        names = expected_shapes(c)  # a checkpoint cut to fewer layers keeps extra tensors
        weights = {k: ckpt.weights[k] for k in names}
        weights = self.model.sanitize(weights)  # drops lm_head when it is tied
        self.model.load_weights(list(weights.items()), strict=True)  # the same arrays, no copy
        self._make_cache = make_prompt_cache
        self._kv_cache = KVCache

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self._make_cache(self.model)
        h = self.model.model(tokens, cache)[:, -1:, :]  # final-normed hidden states
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
    """The storage of every layer cache (dense, batching or mlx-lm), to evaluate with a step."""
    found: list[mx.array] = []
    for c in cache:
        parts = [c] if not hasattr(c, "slots") else [s for s in c.slots if s is not None]
        for p in parts:
            found += [a for a in (getattr(p, "keys", None), getattr(p, "values", None))
                      if isinstance(a, mx.array)]
    return found


# --- FLOPs and bytes ---------------------------------------------------------------------


def layer_matmul_params(cfg) -> int:
    e, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return e * q + 2 * e * kv + q * e + 3 * e * i


def prefill_flops(cfg, length: int) -> float:
    """Matmul FLOPs of the projections and MLP for every token, the causal half of the
    attention scores and weighted sums, and the lm_head for the one kept row."""
    per_layer = 2.0 * length * layer_matmul_params(cfg)
    attention = 2.0 * cfg.num_attention_heads * cfg.head_dim * length * (length + 1)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    return cfg.num_hidden_layers * (per_layer + attention) + head


def decode_bytes(cfg, batch: int, context: int, itemsize: int) -> float:
    """Bytes one decode step must read at least: every weight once (the embedding table only
    its `batch` rows) and, per layer, the keys and values of context + 1 positions per row."""
    e, d = cfg.hidden_size, cfg.head_dim
    weights = cfg.num_hidden_layers * (layer_matmul_params(cfg) + 2 * e + 2 * d)
    weights += e * cfg.vocab_size + e + batch * e  # lm_head, final norm, embedding rows
    kv = cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * (context + 1) * d
    return float((weights + kv) * itemsize)


# --- the measurements --------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"median": median(values), "min": min(values), "max": max(values),
            "values": list(values)}


def _order(repeat: int, impls: dict[str, Any]) -> list[str]:
    names = list(impls)
    return names if repeat % 2 == 0 else names[::-1]


def random_tokens(rng: random.Random, model: BenchModel, shape: tuple[int, int]) -> mx.array:
    low, high = model.token_ids
    excluded = set(model.excluded_ids)
    ids = []
    while len(ids) < shape[0] * shape[1]:
        t = rng.randrange(low, high)
        if t not in excluded:
            ids.append(t)
    return mx.array(ids, dtype=mx.int32).reshape(shape)


def run_prefill(impl, tokens: mx.array) -> float:
    t0 = time.perf_counter()
    logits, cache = impl.prefill(tokens)
    mx.eval(logits, *cache_arrays(cache))
    dt = time.perf_counter() - t0
    del logits, cache
    return dt


def measure_prefill(impls, lengths, repeats, long_repeats, long_from, rng, model, cfg, ceil):
    rows = []
    for length in lengths:
        tokens = random_tokens(rng, model, (1, length))
        is_long = length >= long_from
        reps = long_repeats if is_long else repeats
        if not is_long:
            for name in impls:  # warm-up at this shape
                run_prefill(impls[name], tokens)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(reps):
            for name in _order(r, impls):
                t = run_prefill(impls[name], tokens)
                times[name].append(t)
                log(f"  prefill {length:>5} tokens  {name:<8} repeat {r + 1}/{reps}: "
                    f"{length / t:8.1f} tok/s ({t:.2f} s)")
        flops = prefill_flops(cfg, length)
        row: dict[str, Any] = {"kind": "prefill", "prompt_len": length, "repeats": reps,
                               "warmup": 0 if is_long else 1, "flops": flops, "impls": {}}
        for name, ts in times.items():
            tps = [length / t for t in ts]
            gflops = [flops / t / 1e9 for t in ts]
            row["impls"][name] = {
                "tokens_per_s": _stats(tps),
                "seconds": _stats(ts),
                "gflops": _stats(gflops),
                "fraction_of_matmul_ceiling": median(gflops) / ceil["matmul_ceiling_gflops"],
            }
        row["ratio_ref_over_mlx_lm"] = _ratio(row, "tokens_per_s", higher_is_better=True)
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
    del cache, logits
    return times


def measure_decode(impls, contexts, batches, repeats, warmup, steps, rng, model, cfg, dtype,
                   ceil):
    rows = []
    key = mx.random.key(2)
    shape_kv = (cfg.num_key_value_heads, cfg.head_dim)
    for context in contexts:
        for batch in batches:
            kv = []
            for _ in range(cfg.num_hidden_layers):  # the same random context for both models
                key, k1, k2 = mx.random.split(key, 3)
                shape = (batch, shape_kv[0], context, shape_kv[1])
                kv.append((mx.random.uniform(-1, 1, shape, key=k1).astype(dtype),
                           mx.random.uniform(-1, 1, shape, key=k2).astype(dtype)))
                mx.eval(kv[-1])
            tokens = random_tokens(rng, model, (batch, 1))
            per_step: dict[str, list[float]] = {name: [] for name in impls}
            for r in range(repeats):
                for name in _order(r, impls):
                    ts = run_decode(impls[name], kv, tokens, warmup, steps)
                    per_step[name].append(sum(ts) / len(ts))
                    log(f"  decode ctx {context:>5} batch {batch}  {name:<8} repeat "
                        f"{r + 1}/{repeats}: {1000 * per_step[name][-1]:8.1f} ms/step")
            del kv
            nbytes = decode_bytes(cfg, batch, context, dtype.size)
            row: dict[str, Any] = {"kind": "decode", "context": context, "batch": batch,
                                   "repeats": repeats, "warmup_steps": warmup,
                                   "timed_steps": steps, "bytes_per_step": nbytes, "impls": {}}
            for name, ts in per_step.items():
                gbs = [nbytes / t / 1e9 for t in ts]
                row["impls"][name] = {
                    "ms_per_step": _stats([1000 * t for t in ts]),
                    "tokens_per_s": _stats([batch / t for t in ts]),
                    "gbs": _stats(gbs),
                    "fraction_of_bandwidth_ceiling": median(gbs) / ceil["bandwidth_ceiling_gbs"],
                }
            row["ratio_ref_over_mlx_lm"] = _ratio(row, "ms_per_step", higher_is_better=False)
            rows.append(row)
    return rows


def _ratio(row: dict[str, Any], metric: str, higher_is_better: bool) -> float:
    """Throughput of the course's model over mlx-lm's: above 1, the course's is faster."""
    ref_name = next(n for n in row["impls"] if n != MLX_LM)
    ref = row["impls"][ref_name][metric]["median"]
    other = row["impls"][MLX_LM][metric]["median"]
    return ref / other if higher_is_better else other / ref


def check_agreement(impls, rng, model) -> dict[str, Any]:
    """Both models on the same 16 tokens: the last logits must match (same weights)."""
    tokens = random_tokens(rng, model, (1, 16))
    outs = {}
    for name, impl in impls.items():
        logits, _ = impl.prefill(tokens)
        outs[name] = logits.astype(mx.float32)
    a, b = outs.values()
    diff = mx.max(mx.abs(a - b)).item()
    scale = mx.max(mx.abs(b)).item()
    same_argmax = bool(mx.all(mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).item())
    return {"max_abs_diff": diff, "max_abs_logit": scale, "same_argmax": same_argmax}


# --- ablation: single operations, plain ops against mx.fast / mlx-lm ------------------------


def ablate(pkg, cfg, dtype: mx.Dtype, prefill_len: int, context: int, repeats: int):
    """Time each operation the two models do differently, at the model's shapes, in two
    regimes: prefill (1 x prefill_len tokens, empty cache) and decode (1 token, `context`
    cached). Per forward pass it happens once per layer (RMSNorm of the hidden state:
    twice). The estimate multiplies the difference by the number of calls per forward pass;
    ops fuse and overlap differently inside a whole model, so it is a guide, not a sum."""
    from mlx_lm.models.activations import swiglu
    from mlx_lm.models.cache import KVCache

    hq, hkv, d, e, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.hidden_size, cfg.intermediate_size)
    eps, theta, layers = cfg.rms_norm_eps, cfg.rope_theta, cfg.num_hidden_layers
    scale = 1.0 / math.sqrt(d)
    key = mx.random.key(3)

    def rnd(*shape):
        nonlocal key
        key, sub = mx.random.split(key)
        return mx.random.uniform(-1, 1, shape, key=sub).astype(dtype)

    norm_w, head_w = mx.ones((e,), dtype=dtype), mx.ones((d,), dtype=dtype)
    rms_hidden, rms_head = pkg.RMSNorm(e, norm_w, eps), pkg.RMSNorm(d, head_w, eps)
    rope = pkg.RoPE(d, prefill_len + context + repeats + 8, theta)
    results = []

    def add(name, regime, calls, plain, fast, tokens, note):
        mx.eval(plain(), fast())  # warm-up, and a check that both compute the same thing
        p_out, f_out = plain(), fast()
        diff = mx.max(mx.abs(p_out.astype(mx.float32) - f_out.astype(mx.float32))).item()
        times = {"plain": [], "fast": []}
        for r in range(repeats):
            for which in ("plain", "fast") if r % 2 == 0 else ("fast", "plain"):
                times[which].append(_timed(plain if which == "plain" else fast))
        p_ms, f_ms = 1000 * median(times["plain"]), 1000 * median(times["fast"])
        saved = (p_ms - f_ms) * calls * layers / tokens
        results.append({"op": name, "regime": regime, "plain_ms": p_ms, "fast_ms": f_ms,
                        "speedup": p_ms / f_ms if f_ms > 0 else None, "calls_per_layer": calls,
                        "est_ms_saved_per_token": saved, "max_abs_diff": diff, "note": note})
        log(f"  ablate {regime:<7} {name:<22} plain {p_ms:8.3f} ms  fast {f_ms:8.3f} ms  "
            f"-> {saved:+8.2f} ms per token over {layers} layers")

    for regime, length in (("prefill", prefill_len), ("decode", 1)):
        offset = 0 if regime == "prefill" else context
        tokens = length
        x = rnd(1, length, e)
        q, k = rnd(1, length, hq, d), rnd(1, length, hkv, d)
        add("rmsnorm hidden", regime, 2, lambda x=x: rms_hidden(x),
            lambda x=x: mx.fast.rms_norm(x, norm_w, eps), tokens,
            "course RMSNorm vs mx.fast.rms_norm on [1, L, E]")
        add("rmsnorm q+k heads", regime, 1,
            lambda q=q, k=k: mx.concatenate([rms_head(q), rms_head(k)], axis=2),
            lambda q=q, k=k: mx.concatenate(
                [mx.fast.rms_norm(q, head_w, eps), mx.fast.rms_norm(k, head_w, eps)], axis=2),
            tokens, "QK-norm on [1, L, H, D]")
        add("rope q+k", regime, 1,
            lambda q=q, k=k, o=offset: mx.concatenate(
                [rope(q, o).swapaxes(1, 2), rope(k, o).swapaxes(1, 2)], axis=1),
            lambda q=q, k=k, o=offset: mx.concatenate(
                [mx.fast.rope(q.swapaxes(1, 2), d, traditional=False, base=theta, scale=1.0,
                              offset=o),
                 mx.fast.rope(k.swapaxes(1, 2), d, traditional=False, base=theta, scale=1.0,
                              offset=o)], axis=1),
            tokens, "course RoPE (table lookup, split, concat) vs mx.fast.rope")
        g, u = rnd(1, length, inter), rnd(1, length, inter)
        add("silu(gate) * up", regime, 1, lambda g=g, u=u: pkg.silu(g) * u,
            lambda g=g, u=u: swiglu(g, u), tokens, "plain ops vs mlx-lm's compiled swiglu")
        if regime == "prefill":
            qa, ka, va = rnd(1, hq, length, d), rnd(1, hkv, length, d), rnd(1, hkv, length, d)
            mask = "causal"
        else:
            qa, ka, va = rnd(1, hq, 1, d), rnd(1, hkv, context + 1, d), rnd(1, hkv, context + 1, d)
            mask = None
        add("attention core", regime, 1,
            lambda q=qa, k=ka, v=va, m=mask: pkg.scaled_dot_product_attention_grouped(
                q, k, v, scale=scale, mask=m),
            lambda q=qa, k=ka, v=va, m=mask: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=scale, mask=m),
            tokens, "grouped matmul + softmax vs mx.fast.scaled_dot_product_attention")

    # The KV cache at decode: append one position to `context` cached ones, fetch all.
    ks, vs = rnd(1, hkv, context, d), rnd(1, hkv, context, d)
    kn, vn = rnd(1, hkv, 1, d), rnd(1, hkv, 1, d)
    dense, pre = pkg.TinyKvFullCache(), KVCache()
    dense.update_and_fetch(ks, vs)
    pre.update_and_fetch(ks, vs)
    mx.eval(*cache_arrays([dense, pre]))

    def append(cache):
        def fn():
            keys, values = cache.update_and_fetch(kn, vn)[:2]
            return keys, values
        return fn

    times = {"plain": [], "fast": []}
    for _ in range(2):  # warm-up (mlx-lm grows its buffer by 256 positions on the first one)
        mx.eval(append(dense)(), append(pre)())
    for r in range(max(repeats, 8)):
        for which in ("plain", "fast") if r % 2 == 0 else ("fast", "plain"):
            times[which].append(_timed(append(dense if which == "plain" else pre)))
    p_ms, f_ms = 1000 * median(times["plain"]), 1000 * median(times["fast"])
    saved = (p_ms - f_ms) * layers
    results.append({"op": "kv cache append", "regime": "decode", "plain_ms": p_ms,
                    "fast_ms": f_ms, "speedup": p_ms / f_ms if f_ms > 0 else None,
                    "calls_per_layer": 1, "est_ms_saved_per_token": saved,
                    "max_abs_diff": None,
                    "note": f"TinyKvFullCache (concatenate) vs mlx-lm KVCache (preallocated, "
                            f"slice update), batch 1, context {context}"})
    log(f"  ablate decode  {'kv cache append':<22} plain {p_ms:8.3f} ms  fast {f_ms:8.3f} ms  "
        f"-> {saved:+8.2f} ms per token over {layers} layers")
    return results


# --- report ------------------------------------------------------------------------------


def _fmt_spread(stats: dict[str, Any], digits: int) -> str:
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def markdown_table(report: dict[str, Any]) -> str:
    ref = report["solution_label"]
    lines = [
        f"| Measurement | {ref} | mlx-lm | {ref} / mlx-lm | {ref} of ceiling | mlx-lm of ceiling |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["prefill"]:
        a, b = row["impls"][ref], row["impls"][MLX_LM]
        lines.append(
            f"| prefill {row['prompt_len']} tokens (tokens/s) | "
            f"{_fmt_spread(a['tokens_per_s'], 1)} | {_fmt_spread(b['tokens_per_s'], 1)} | "
            f"{row['ratio_ref_over_mlx_lm']:.2f} | "
            f"{100 * a['fraction_of_matmul_ceiling']:.0f}% | "
            f"{100 * b['fraction_of_matmul_ceiling']:.0f}% |"
        )
    for row in report["decode"]:
        a, b = row["impls"][ref], row["impls"][MLX_LM]
        lines.append(
            f"| decode context {row['context']}, batch {row['batch']} (ms/step) | "
            f"{_fmt_spread(a['ms_per_step'], 1)} | {_fmt_spread(b['ms_per_step'], 1)} | "
            f"{row['ratio_ref_over_mlx_lm']:.2f} | "
            f"{100 * a['fraction_of_bandwidth_ceiling']:.0f}% | "
            f"{100 * b['fraction_of_bandwidth_ceiling']:.0f}% |"
        )
    c = report["ceilings"]
    m = report["model"]
    lines += [
        "",
        f"Ceilings (same run): matmul {c['matmul_size']}x{c['matmul_size']} "
        f"fp32 {c['matmul_float32_gflops']['max']:.1f} GFLOP/s, "
        f"bf16 {c['matmul_bfloat16_gflops']['max']:.1f} GFLOP/s; "
        f"copy {c['copy_gbs']['max']:.1f} GB/s, gemv {c['gemv_gbs']['max']:.1f} GB/s "
        f"(bandwidth ceiling {c['bandwidth_ceiling_gbs']:.1f} GB/s). "
        f"Model: {m['name']}, {m['num_layers']} layers, {m['parameters'] / 1e6:.0f}M parameters"
        f"{', random weights' if m['random_weights'] else ''}, {report['dtype']} on "
        f"{report['device']}; BLAS: {report['blas']['blas']}; MLX {report['mlx']['version']}, "
        f"mlx-lm {report['mlx_lm_version']}; {report['host']['cpu_count']} CPUs "
        f"({report['host']['machine']}). Median (min-max) of {report['settings']['repeats']} "
        f"repeats ({report['settings']['long_repeats']} for prompts of "
        f"{report['settings']['long_from']}+ tokens).",
    ]
    if report.get("ablation"):
        lines += ["", "| Operation | regime | plain ms | fast ms | est. ms saved per token |",
                  "|---|---|---:|---:|---:|"]
        for a in report["ablation"]:
            lines.append(f"| {a['op']} | {a['regime']} | {a['plain_ms']:.3f} | "
                         f"{a['fast_ms']:.3f} | {a['est_ms_saved_per_token']:.2f} |")
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench-model",
        description="Prefill and decode speed of the course's Qwen3 against mlx-lm's on the "
        "same weights, and both against this machine's matmul and bandwidth limits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="qwen3-0.6b",
                   help="tiny, a shortcut (qwen3-0.6b: embedded config, random weights), a "
                   "checkpoint directory, or the path of a config.json")
    m.add_argument("--random-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="random weights with the model's shapes; default: on for shortcuts with "
                   "an embedded config and config.json paths, off for checkpoints")
    m.add_argument("--num-layers", type=positive_int, default=None,
                   help="keep only this many layers (quick runs)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on the CPU, bfloat16 on a GPU")
    m.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    m.add_argument("--solution", choices=sorted(SOLUTIONS), default="ref",
                   help="ref: tiny_llm_ref; tiny_llm: your own solution")
    m.add_argument("--batch-cache", choices=("dense", "batching"), default="dense",
                   help="the course's cache for decode batches > 1: one dense cache of batch B, "
                   "or BatchingKvCache over B one-row dense caches")
    m.add_argument("--offline", action="store_true",
                   help="never download: real weights must be in the Hugging Face cache")
    m.add_argument("--no-openblas", action="store_true",
                   help="on Linux, keep the bundled reference BLAS of the mlx[cpu] wheel")
    w = p.add_argument_group("workload")
    w.add_argument("--prefill-lens", type=positive_int, nargs="*", default=[128, 512, 2048],
                   metavar="N", help="prompt lengths (none: skip prefill)")
    w.add_argument("--decode-contexts", type=positive_int, nargs="*", default=[128, 1024],
                   metavar="N", help="cached tokens before the timed decode steps (none: skip)")
    w.add_argument("--decode-batches", type=positive_int, nargs="+", default=[1, 4],
                   metavar="B", help="rows decoded together")
    w.add_argument("--decode-steps", type=positive_int, default=8,
                   help="timed decode steps per repeat (after --decode-warmup ones)")
    w.add_argument("--decode-warmup", type=non_negative_int, default=1)
    w.add_argument("--repeats", type=positive_int, default=3,
                   help="repeats of every measurement, alternating which model goes first")
    w.add_argument("--long-repeats", type=positive_int, default=2,
                   help="repeats for prompts of --long-from tokens or more (no warm-up of "
                   "their own: the shorter prompts warmed the kernels up)")
    w.add_argument("--long-from", type=positive_int, default=1024)
    w.add_argument("--quick", action="store_true",
                   help="prompts 128 and 512 only, 2 repeats, 4 decode steps")
    w.add_argument("--ablate", action="store_true",
                   help="also time single operations, plain ops vs mx.fast / mlx-lm")
    w.add_argument("--ablate-len", type=positive_int, default=512,
                   help="prompt length of the prefill ablation")
    w.add_argument("--seed", type=non_negative_int, default=0, help="weights and tokens")
    c = p.add_argument_group("ceilings")
    c.add_argument("--matmul-size", type=positive_int, default=2048)
    c.add_argument("--copy-mb", type=positive_int, default=256,
                   help="MB copied for the bandwidth measurement")
    c.add_argument("--ceiling-repeats", type=positive_int, default=3)
    o = p.add_argument_group("output")
    o.add_argument("--json-output", type=Path, default=None,
                   help="default: benches/results/bench-model-<host>-<date>.json")
    return p


def default_json_path() -> Path:
    host = re.sub(r"[^A-Za-z0-9.]+", "-", platform.node()).strip("-").lower() or "host"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    return HERE / "results" / f"bench-model-{host}-{stamp}.json"


def mlx_lm_version() -> str:
    import mlx_lm

    return getattr(mlx_lm, "__version__", "unknown")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.prefill_lens = [n for n in args.prefill_lens if n <= 512] or [128]
        args.repeats, args.long_repeats = min(args.repeats, 2), min(args.long_repeats, 2)
        args.decode_steps = min(args.decode_steps, 4)
    if args.json_output is not None and args.json_output.is_dir():
        parser.error(f"{args.json_output} is a directory; give a file name")
    if args.device == "gpu" and not gpu_available():
        parser.error("--device gpu: MLX has no Metal or CUDA device here")
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        parser.error("mlx-lm is not installed (it is in the dev group: pdm sync -G dev)")
    try:
        model = resolve_bench_model(args.model, args.random_weights, args.num_layers,
                                    args.seed, args.offline or None)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(f"--model {args.model}: {e}")
    longest = max([*args.prefill_lens, *[c + args.decode_warmup + args.decode_steps + 1
                                         for c in args.decode_contexts], 1])
    if args.ablate:
        longest = max(longest, args.ablate_len + max(args.decode_contexts or [128]) + 16)
    if longest > int(model.config["max_position_embeddings"]):
        parser.error(f"{longest} positions exceed the model's max_position_embeddings")

    reexec_with_openblas(args.no_openblas)  # returns only when no re-exec is needed

    started = time.time()
    device = choose_device(args.device)
    if args.dtype is None:
        args.dtype = "bfloat16" if device == "gpu" else "float32"
    dtype = DTYPES[args.dtype]
    blas = blas_info()
    log(f"BLAS: {blas['blas']}" + (f" (OpenBLAS at {blas['openblas_path']} not used)"
                                   if blas["openblas_path"] and "openblas" not in blas["blas"]
                                   else ""))
    if device == "cpu" and "reference" in blas["blas"]:
        log("warning: the bundled reference BLAS is 20-40x slower than OpenBLAS for fp32 "
            "matmuls; `sudo apt-get install libopenblas0-pthread` (see the Performance "
            "appendix), or expect a long run")

    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    ceilings = measure_ceilings(args.matmul_size, args.copy_mb, args.ceiling_repeats, dtype)

    t = time.perf_counter()
    ckpt = model.load(args.dtype)
    cfg = ckpt.config
    label = args.solution
    impls = {
        label: RefImpl(SOLUTIONS[args.solution], ckpt, longest + 16, args.batch_cache),
        MLX_LM: MlxLmImpl(ckpt),
    }
    mx.eval(list(ckpt.weights.values()))
    log(f"model {model.name}: {model.num_layers} layers, {model.parameter_count() / 1e6:.1f}M "
        f"parameters ({'random' if model.random_weights else 'checkpoint'} weights), "
        f"{args.dtype} on {device}, built in {time.perf_counter() - t:.1f} s")

    rng = random.Random(args.seed)
    agreement = check_agreement(impls, rng, model)
    log(f"same 16 tokens through both: max |logit diff| {agreement['max_abs_diff']:.2e} "
        f"(largest logit {agreement['max_abs_logit']:.2f}), same argmax: "
        f"{agreement['same_argmax']}")

    prefill = measure_prefill(impls, args.prefill_lens, args.repeats, args.long_repeats,
                              args.long_from, rng, model, cfg, ceilings)
    decode = measure_decode(impls, args.decode_contexts, args.decode_batches, args.repeats,
                            args.decode_warmup, args.decode_steps, rng, model, cfg, dtype,
                            ceilings)
    ablation = None
    if args.ablate:
        log("ablation (median of single operations):")
        ablation = ablate(impls[label].pkg, cfg, dtype, args.ablate_len,
                          max(args.decode_contexts or [1024]), max(args.repeats, 5))

    report = {
        "benchmark": "bench-model",
        "command": " ".join(sys.orig_argv),
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "runtime_s": time.time() - started,
        "host": host_info(),
        "mlx": mlx_info(),
        "mlx_lm_version": mlx_lm_version(),
        "blas": {**blas, "reexecuted_with_openblas": bool(os.environ.get(REEXEC_GUARD)),
                 "no_openblas": args.no_openblas},
        "env": {k: os.environ.get(k) for k in ("LD_PRELOAD", "OMP_NUM_THREADS",
                                               "OPENBLAS_NUM_THREADS")},
        "device": device,
        "dtype": args.dtype,
        "solution": SOLUTIONS[args.solution],
        "solution_label": label,
        "ref_batch_cache": ("one dense TinyKvFullCache of batch B per layer"
                            if args.batch_cache == "dense"
                            else "BatchingKvCache over B one-row TinyKvFullCaches per layer"),
        "mlx_lm_cache": "mlx_lm.models.cache.make_prompt_cache (KVCache, preallocated in "
                        "steps of 256 positions)",
        "model": model.describe(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ceilings": ceilings,
        "agreement": agreement,
        "prefill": prefill,
        "decode": decode,
        "ablation": ablation,
        "notes": [
            "ratio_ref_over_mlx_lm is a throughput ratio: above 1 the course's model is faster",
            "prefill FLOPs: 2 x matmul parameters per token, the causal half of QK^T and PV, "
            "and the lm_head for the last position only",
            "decode bytes: every weight once per step (embedding: only the rows looked up) "
            "plus the keys and values of context + 1 positions per row and layer",
            "bandwidth ceiling: the larger of copy (read + write) and gemv GB/s",
        ],
    }
    report["runtime_s"] = time.time() - started
    path = args.json_output or default_json_path()
    write_json(path, report)
    log(f"wrote {path} ({report['runtime_s']:.0f} s)")
    print(markdown_table(report))
    return 0


def _dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, dt in DTYPES.items() if dt == dtype)


if __name__ == "__main__":
    sys.exit(main())
