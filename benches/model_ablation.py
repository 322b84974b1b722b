"""bench-model's ablations: single operations of the course against mx.fast / mlx-lm at the
model's shapes, and the course's model with mx.fast parts swapped in (model_impls.VARIANTS)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from ceilings import timed
from common import log, median
from model_harness import Workload, check_agreement, measure_decode, measure_prefill
from model_impls import VARIANTS, RefImpl, cache_arrays


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
                times[which].append(timed(plain_fn if which == "plain" else fast_fn) / calls)
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
    compared = {
        "course": (
            "kv cache append",
            "TinyKvFullCache vs mlx-lm KVCache (both preallocated, slice update) at context "
            f"{context}, batch 1",
        ),
        "concat": (
            "kv append, concatenating",
            f"a cache that concatenates (copies all {context} positions) vs mlx-lm KVCache",
        ),
    }
    for group, (name, note) in compared.items():
        plain, fast = appender(groups[group]), appender(groups["mlx-lm"])
        record(name, "decode", 1, 1, plain, fast, None, note)
    return results


# --- ablation: whole-model variants ------------------------------------------------------


def ablate_models(args, ckpt, base_impls: dict[str, Any], w: Workload) -> dict[str, Any]:
    """The course's model with mx.fast attention, norms + RoPE, or both, next to the plain
    model and mlx-lm: prefill at --ablate-len, decode at the largest context and batch."""
    impls = dict(base_impls)
    pkg = base_impls[args.solution].pkg
    for suffix, parts in VARIANTS.items():
        impls[args.solution + suffix] = RefImpl(pkg, ckpt, args.batch_cache, **parts)
    agreement = check_agreement(impls, w)
    for name in impls:
        if name not in base_impls:
            log(f"  {name}: max |logit diff| vs mlx-lm {agreement[name]['max_abs_diff']:.2e}")
    reps = args.ablate_repeats
    prefill = measure_prefill(impls, [args.ablate_len], reps, reps, 10**9, w)
    point = (max(args.decode_contexts or [1024]), max(args.decode_batches))
    decode = measure_decode(impls, [point], reps, args.decode_warmup, args.decode_steps, w)
    return {
        "agreement": agreement,
        "prefill": prefill,
        "decode": decode,
        "variants": {
            args.solution + suffix: {
                "fast_attention": "attention" in parts,
                "fast_rms_norm_and_rope": "norm" in parts,
            }
            for suffix, parts in VARIANTS.items()
        },
    }
