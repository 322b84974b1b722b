"""bench-model --ablate, single operations: the course's against mx.fast / mlx-lm at the model's
shapes (the whole-model variants are in model.py)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from benches.ceilings import take_turns
from benches.harness import log, median
from benches.model_impls import cache_arrays


class ConcatKvCache:
    """A dense cache whose every append copies everything cached so far (what TinyKvFullCache's
    preallocation avoids)."""

    keys = values = None

    def update_and_fetch(self, key: mx.array, value: mx.array):  # [B, H_kv, L, D]
        if self.keys is not None:
            key = mx.concatenate([self.keys, key], axis=2)
            value = mx.concatenate([self.values, value], axis=2)
        self.keys, self.values = key, value
        return key, value, None


def op_cases(pkg, cfg, dtype, rnd, regime: str, length: int, context: int, calls: int) -> list:
    """(op, calls per layer, inputs of each call, course fn, fast fn, note) of one regime:
    prefill (one prompt of `length` tokens) or decode (one token over `context` cached)."""
    from mlx_lm.models.activations import swiglu

    hq, hkv, d, e, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.hidden_size, cfg.intermediate_size)  # fmt: skip
    eps, theta, scale = cfg.rms_norm_eps, cfg.rope_theta, 1.0 / math.sqrt(d)
    norm_w, head_w = mx.ones((e,), dtype=dtype), mx.ones((d,), dtype=dtype)
    rms_hidden, rms_head = pkg.RMSNorm(e, norm_w, eps), pkg.RMSNorm(d, head_w, eps)
    rope = pkg.RoPE(d, length + context + 64, theta)
    offset = 0 if regime == "prefill" else context
    s, mask = (length, "causal") if regime == "prefill" else (context + 1, None)

    def fast_rope(x):  # x [B, L, H, D] -> [B, H, L, D], as mlx-lm applies it
        return mx.fast.rope(x.swapaxes(1, 2), d, traditional=False, base=theta, scale=1.0,
                            offset=offset)  # fmt: skip

    def inputs(*shapes):  # `calls` inputs, each a tuple of arrays of these shapes
        return [tuple(rnd(*shape) for shape in shapes) for _ in range(calls)]

    qk = inputs((1, length, hq, d), (1, length, hkv, d))
    return [
        ("rmsnorm hidden", 2, inputs((1, length, e)), rms_hidden,
         lambda x: mx.fast.rms_norm(x, norm_w, eps),
         "course RMSNorm vs mx.fast.rms_norm on [1, L, E]"),
        ("rmsnorm q,k", 1, qk, lambda q, k: (rms_head(q), rms_head(k)),
         lambda q, k: (mx.fast.rms_norm(q, head_w, eps), mx.fast.rms_norm(k, head_w, eps)),
         "QK-norm of [1, L, H, D] queries and keys"),
        ("rope q,k", 1, qk,
         lambda q, k: (rope(q, offset).swapaxes(1, 2), rope(k, offset).swapaxes(1, 2)),
         lambda q, k: (fast_rope(q), fast_rope(k)),
         "course RoPE (table gather, halves, concatenate) vs mx.fast.rope"),
        ("silu(gate) * up", 1, inputs((1, length, inter), (1, length, inter)),
         lambda g, u: pkg.silu(g) * u, swiglu, "plain ops vs mlx-lm's compiled swiglu"),
        ("attention core", 1, inputs((1, hq, length, d), (1, hkv, s, d), (1, hkv, s, d)),
         lambda q, k, v: pkg.scaled_dot_product_attention_grouped(q, k, v, scale, mask),
         lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
         "grouped matmul + softmax vs mx.fast.scaled_dot_product_attention"),
    ]  # fmt: skip


def every_call(fn, inputs: list[tuple]):  # the calls of `fn` on every input, as one graph
    return lambda: [fn(*x) for x in inputs]


def ablate_ops(
    pkg, cfg, dtype: mx.Dtype, prefill_len: int, context: int, repeats: int, calls: int = 8
) -> list[dict[str, Any]]:
    """The course's ops against mx.fast / mlx-lm, in prefill and decode, then the KV cache
    append. Each timing evaluates `calls` independent calls in one graph, as a forward pass
    does, so per-eval overhead does not swamp small operations. The ms saved per token is a
    guide: inside a model, operations overlap and fuse differently."""
    key = mx.random.key(3)

    def rnd(*shape):
        nonlocal key
        key, sub = mx.random.split(key)
        out = mx.random.uniform(-1, 1, shape, key=sub).astype(dtype)
        mx.eval(out)
        return out

    results = []

    def record(name, regime, per_layer, tokens, plain, fast, diff, note):
        times = take_turns({"plain": plain, "fast": fast}, repeats)
        p_ms, f_ms = (1000 * median(times[which]) / calls for which in ("plain", "fast"))
        saved = (p_ms - f_ms) * per_layer * cfg.num_hidden_layers / tokens
        results.append({"op": name, "regime": regime, "plain_ms": p_ms, "fast_ms": f_ms,
                        "speedup": p_ms / f_ms if f_ms > 0 else None, "calls_per_layer": per_layer,
                        "est_ms_saved_per_token": saved, "max_abs_diff": diff,
                        "note": note})  # fmt: skip
        log(f"  {regime:<7} {name:<22} course {p_ms:8.3f} ms  fast {f_ms:8.3f} ms  "
            f"(x{p_ms / max(f_ms, 1e-9):4.1f}) -> {saved:+7.2f} ms/token")  # fmt: skip

    for regime, length in (("prefill", prefill_len), ("decode", 1)):
        cases = op_cases(pkg, cfg, dtype, rnd, regime, length, context, calls)
        for name, per_layer, inputs, plain, fast, note in cases:
            plain_fn, fast_fn = every_call(plain, inputs), every_call(fast, inputs)
            mx.eval(plain_fn(), fast_fn())  # warm-up (mx.compile traces here)
            p0, f0 = plain(*inputs[0]), fast(*inputs[0])
            pairs = zip(p0, f0) if isinstance(p0, tuple) else [(p0, f0)]
            diff = max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                       for a, b in pairs)  # fmt: skip
            record(name, regime, per_layer, length, plain_fn, fast_fn, diff, note)
    for name, plain, fast, note in kv_append_cases(pkg, cfg, rnd, context, calls):
        record(name, "decode", 1, 1, plain, fast, None, note)
    return results


def kv_append_cases(pkg, cfg, rnd, context: int, calls: int) -> list:
    """The KV cache at decode: each of `calls` layer caches holds `context` positions and gets
    one more; the step then reads all of them (keys and values returned)."""
    from mlx_lm.models.cache import KVCache

    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    base = [(rnd(1, hkv, context, d), rnd(1, hkv, context, d)) for _ in range(calls)]
    new = [(rnd(1, hkv, 1, d), rnd(1, hkv, 1, d)) for _ in range(calls)]
    kinds = {"course": pkg.TinyKvFullCache, "concat": ConcatKvCache, "mlx-lm": KVCache}
    groups = {name: [kind() for _ in range(calls)] for name, kind in kinds.items()}
    for group in groups.values():
        for c, (k, v) in zip(group, base):
            c.update_and_fetch(k, v)
        mx.eval(*cache_arrays(group))

    def appender(group):
        return lambda: [c.update_and_fetch(k, v)[:2] for c, (k, v) in zip(group, new)]

    for _ in range(2):  # warm-up: the preallocated caches grow by 256 positions on the first
        mx.eval(*[appender(g)() for g in groups.values()])
    mlx_lm = appender(groups["mlx-lm"])
    return [
        ("kv cache append", appender(groups["course"]), mlx_lm, "TinyKvFullCache vs mlx-lm "
         f"KVCache (both preallocated, slice update) at context {context}, batch 1"),
        ("kv append, concatenating", appender(groups["concat"]), mlx_lm,
         f"a cache that concatenates (copies all {context} positions) vs mlx-lm KVCache"),
    ]  # fmt: skip
