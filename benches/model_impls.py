"""The two implementations bench-model times on the same weight arrays (bench-moe and
bench-flash-attention use them too), RefImpl and MlxLmImpl, each with prefill(tokens),
decode_cache(kv) and decode_step(tokens, cache, offset); and the mx.fast parts of its ablation."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from tiny_llm_support import Checkpoint, mlx_lm_qwen3

MLX_LM = "mlx-lm"
KV = list[tuple[mx.array, mx.array]]  # per layer: keys, values [B, H_kv, S, D]


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
        y = mx.fast.rope(x.swapaxes(1, 2), self.dims, traditional=self.traditional,
                         base=self.base, scale=1.0, offset=off)  # fmt: skip  # [B, H, L, D]
        return y.swapaxes(1, 2)


def fast_attention(query, key, value, scale=None, mask=None):
    """The course's grouped attention signature on mx.fast.scaled_dot_product_attention."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return mx.fast.scaled_dot_product_attention(query, key, value, scale=scale, mask=mask)


# The whole-model ablation: the parts each variant swaps into the course's model.
VARIANTS: dict[str, dict[str, Any]] = {
    "+fast-attention": {"attention": fast_attention},
    "+fast-norm-rope": {"norm": FastRMSNorm, "rope": FastRoPE},
    "+all-fast": {"attention": fast_attention, "norm": FastRMSNorm, "rope": FastRoPE},
}


class SwappedAttention:
    """A model's attention layer with another attention core: the layer's projections, QK-norm,
    RoPE and cache (every attribute is the layer's), but `attend` runs core(q, keys, values,
    mask=...), so that every forward pass that attends through the layer uses the core."""

    def __init__(self, layer: Any, core: Callable[..., mx.array]):
        self.layer, self.core = layer, core

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, x: mx.array, offset: Any, cache: Any, mask: Any = None) -> mx.array:
        q, k, v = self.layer.qkv(x, offset)  # q [B, H, L, D]; k, v [B, H_kv, L, D]
        return self.layer.project(self.attend(q, k, v, cache, mask))  # [B, L, E]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: Any) -> mx.array:
        keys, values, cache_mask = cache.update_and_fetch(k, v)  # [B, H_kv, S, D]
        return self.core(q, keys, values, mask=mask if cache_mask is None else cache_mask)


class RefImpl:
    """The course's model and caches, from `pkg` (tiny_llm_ref or tiny_llm). batch_cache: how a
    decode batch of B rows is cached: "dense" (one cache of batch B per layer), "batching" (a
    BatchingKvCache over B one-row caches) or "ragged" (B one-row caches, forward_ragged).
    attention, norm, rope: parts that replace the model's (VARIANTS; the package is unchanged)."""

    def __init__(self, pkg, ckpt: Checkpoint, batch_cache: str, attention=None, norm=None,
                 rope=None, linear_kernel: str = "mlx"):  # fmt: skip
        self.pkg, self.batch_cache = pkg, batch_cache
        self.model = pkg.Qwen3Model(ckpt, linear_kernel=linear_kernel)  # Week 5 Day 4
        layers = self.model.layers
        if norm is not None:
            for layer in layers:
                attn = layer.self_attn
                layer.input_layernorm = norm(layer.input_layernorm)
                layer.post_attention_layernorm = norm(layer.post_attention_layernorm)
                attn.q_norm, attn.k_norm = norm(attn.q_norm), norm(attn.k_norm)
            self.model.norm = norm(self.model.norm)
        if rope is not None:
            shared = rope(layers[0].self_attn.rope, ckpt.config.rope_theta)
            for layer in layers:
                layer.self_attn.rope = shared
        if attention is not None:
            for layer in layers:
                layer.self_attn = SwappedAttention(layer.self_attn, attention)

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self.model.create_kv_cache()
        return self.model(tokens, 0, cache, logits_to_keep=1), cache  # logits [1, 1, V]

    def decode_cache(self, kv: KV) -> tuple[list, int | list[int]]:
        """Caches holding `kv` (the state a prefill leaves), and the offset of the next step."""
        b, s = kv[0][0].shape[0], kv[0][0].shape[2]
        if self.batch_cache == "dense" or (self.batch_cache == "batching" and b == 1):
            caches = self.model.create_kv_cache()
            for c, (k, v) in zip(caches, kv):
                c.update_and_fetch(k, v)
            return caches, s
        rows = [self.model.create_kv_cache() for _ in range(b)]  # [row][layer], one row each
        fill_rows(rows, kv)
        if self.batch_cache == "ragged":
            return rows, [s] * b
        return batching_caches(self.pkg.BatchingKvCache, rows), [s] * b

    def decode_step(self, tokens: mx.array, cache: list, offset: int | list[int]):
        """One step of tokens [B, 1] -> logits [B, 1, V], the next offset."""
        if self.batch_cache == "ragged":  # the hybrid policy's pass: rows side by side
            segments = [self.pkg.Segment(rows, b, 1) for b, rows in enumerate(cache)]
            logits = self.pkg.forward_ragged(self.model, tokens.reshape(1, -1), segments)
            return logits.swapaxes(0, 1), [o + 1 for o in offset]
        logits = self.model(tokens, offset, cache)
        return logits, offset + 1 if isinstance(offset, int) else [o + 1 for o in offset]


class MlxLmImpl:
    """mlx-lm's Qwen3 holding the same weight arrays (no copy), with its own KV cache."""

    def __init__(self, ckpt: Checkpoint):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.make_cache = mlx_lm_qwen3(ckpt), make_prompt_cache

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self.make_cache(self.model)
        h = self.model.model(tokens, cache)[:, -1:, :]  # final-normed hidden state, last row
        if self.model.args.tie_word_embeddings:
            return self.model.model.embed_tokens.as_linear(h), cache
        return self.model.lm_head(h), cache

    def decode_cache(self, kv: KV) -> tuple[list, int]:
        caches = self.make_cache(self.model)
        for c, (k, v) in zip(caches, kv):
            c.update_and_fetch(k, v)
        return caches, kv[0][0].shape[2]

    def decode_step(self, tokens: mx.array, cache: list, offset: int):
        return self.model(tokens, cache=cache), offset + 1


def random_ids(rng: random.Random, model, n: int) -> list[int]:
    """`n` random ordinary token ids of a BenchModel (its token_ids less its excluded_ids)."""
    (low, high), excluded = model.token_ids, set(model.excluded_ids)
    return rng.choices([t for t in range(low, high) if t not in excluded], k=n)


def random_context(cfg, batch: int, context: int, dtype: mx.Dtype, seed: int) -> KV:
    """Random keys/values [batch, H_kv, context, D] for every layer, shared by all models."""
    key = mx.random.key(seed)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    kv = []
    for _ in range(cfg.num_hidden_layers):
        key, k1, k2 = mx.random.split(key, 3)
        pair = tuple(mx.random.uniform(-1, 1, shape, key=k).astype(dtype) for k in (k1, k2))
        mx.eval(pair)
        kv.append(pair)
    return kv


def fill_rows(requests: list[list], kv: KV) -> None:
    """Give request b's layer caches row b of every layer's keys and values."""
    for row, request in enumerate(requests):
        for layer_cache, (k, v) in zip(request, kv):
            layer_cache.update_and_fetch(k[row : row + 1], v[row : row + 1])


def batching_caches(batching: Callable[[int], Any], requests: list[list]) -> list:
    """One batching cache per layer (of B slots) over the B requests' caches, request b in slot b."""
    layers = [batching(len(requests)) for _ in requests[0]]
    for slot, request in enumerate(requests):
        for layer, layer_cache in zip(layers, request):
            layer.add_request(layer_cache, slot)
    return layers


def cache_arrays(cache: list) -> list[mx.array]:
    """The storage of every layer cache (dense, batching, ragged or mlx-lm)."""
    if cache and isinstance(cache[0], list):  # ragged: one list of layer caches per row
        return [a for rows in cache for a in cache_arrays(rows)]
    parts = [p for c in cache for p in (c.slots if hasattr(c, "slots") else [c]) if p is not None]
    arrays = [getattr(p, name, None) for p in parts for name in ("keys", "values")]
    return [a for a in arrays if isinstance(a, mx.array)]
