"""The two implementations bench-model times on the same weight arrays, and the fast parts
its ablation swaps into the course's model.

    RefImpl    the course's Qwen3Model and caches (tiny_llm_ref, or your tiny_llm); parts of the
               model can be replaced by others passed in (attention core, norms, RoPE)
    MlxLmImpl  mlx-lm's Qwen3 holding the same arrays, with its own KV cache

Both offer prefill(tokens), decode_cache(kv) and decode_step(tokens, cache, offset).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx

from tiny_llm_support import Checkpoint, mlx_lm_qwen3

MLX_LM = "mlx-lm"


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


# The whole-model ablation: the parts each variant swaps into the course's model.
VARIANTS: dict[str, dict[str, Any]] = {
    "+fast-attention": {"attention": fast_attention},
    "+fast-norm-rope": {"norm": FastRMSNorm, "rope": FastRoPE},
    "+all-fast": {"attention": fast_attention, "norm": FastRMSNorm, "rope": FastRoPE},
}


class SwappedAttention:
    """A model's attention layer with another attention core: the layer's own projections,
    QK-norm, RoPE and cache, then core(q, keys, values, mask=...) and its output projection."""

    def __init__(self, layer: Any, core: Callable[..., mx.array], linear: Callable[..., mx.array]):
        self.layer, self.core, self.linear = layer, core, linear

    def __call__(self, x: mx.array, offset: Any, cache: Any, mask: Any = None) -> mx.array:
        q, k, v = self.layer.qkv(x, offset)  # q [B, H, L, D]; k, v [B, H_kv, L, D]
        keys, values, cache_mask = cache.update_and_fetch(k, v)  # [B, H_kv, S, D]
        out = self.core(q, keys, values, mask=mask if cache_mask is None else cache_mask)
        b, _, length, _ = out.shape  # [B, H, L, D]
        return self.linear(out.swapaxes(1, 2).reshape(b, length, -1), self.layer.wo)  # [B, L, E]


class RefImpl:
    """The course's model and caches, from `pkg` (tiny_llm_ref or tiny_llm).

    For the ablation, parts of the model are replaced by what is passed in:
        attention  core(q, keys, values, mask=...) instead of the package's grouped attention
        norm       norm(course RMSNorm) -> the norm to use instead, for every RMSNorm
        rope       rope(course RoPE, base) -> the RoPE to use instead
    The package's own modules are never changed.
    """

    def __init__(
        self,
        pkg: ModuleType,
        ckpt: Checkpoint,
        batch_cache: str,
        attention: Callable[..., mx.array] | None = None,
        norm: Callable[[Any], Any] | None = None,
        rope: Callable[[Any, float], Any] | None = None,
    ):
        self.pkg = pkg
        self.model = pkg.Qwen3Model(ckpt)
        self.batch_cache = batch_cache
        if norm is not None:
            for layer in self.model.layers:
                attn = layer.self_attn
                layer.input_layernorm = norm(layer.input_layernorm)
                layer.post_attention_layernorm = norm(layer.post_attention_layernorm)
                attn.q_norm, attn.k_norm = norm(attn.q_norm), norm(attn.k_norm)
            self.model.norm = norm(self.model.norm)
        if rope is not None:
            shared = rope(self.model.layers[0].self_attn.rope, ckpt.config.rope_theta)
            for layer in self.model.layers:
                layer.self_attn.rope = shared
        if attention is not None:
            for layer in self.model.layers:
                layer.self_attn = SwappedAttention(layer.self_attn, attention, pkg.linear)

    def prefill(self, tokens: mx.array) -> tuple[mx.array, list]:
        cache = self.model.create_kv_cache()
        logits = self.model(tokens, 0, cache, logits_to_keep=1)  # [1, 1, V]
        return logits, cache

    def decode_cache(self, kv: list[tuple[mx.array, mx.array]]) -> tuple[list, int | list[int]]:
        b, s = kv[0][0].shape[0], kv[0][0].shape[2]
        if self.batch_cache == "ragged":  # one dense cache per row, read by forward_ragged
            rows = [self.model.create_kv_cache() for _ in range(b)]
            for layer, (k, v) in enumerate(kv):
                for row in range(b):
                    rows[row][layer].update_and_fetch(k[row : row + 1], v[row : row + 1])
            return rows, [s] * b
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
        if self.batch_cache == "ragged":  # the hybrid policy's pass: rows side by side
            segments = [self.pkg.Segment(rows, b, 1) for b, rows in enumerate(cache)]
            logits = self.pkg.forward_ragged(self.model, tokens.reshape(1, -1), segments)
            return logits.swapaxes(0, 1), [o + 1 for o in offset]  # [B, 1, V]
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
    if cache and isinstance(cache[0], list):  # ragged: one list of layer caches per row
        return [a for rows in cache for a in cache_arrays(rows)]
    for c in cache:
        parts = [s for s in c.slots if s is not None] if hasattr(c, "slots") else [c]
        for p in parts:
            found += [
                a
                for a in (getattr(p, "keys", None), getattr(p, "values", None))
                if isinstance(a, mx.array)
            ]
    return found
