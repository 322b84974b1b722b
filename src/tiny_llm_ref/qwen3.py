"""Week 2 Day 1: the Qwen3 model with a KV cache and a position offset.

Week 3 uses the same model: offsets may be one int per row (continuous batching), and a
prompt may arrive in chunks (chunked prefill), so a call with L > 1 may find tokens cached.
"""

import mlx.core as mx

from .attention import causal_mask, scaled_dot_product_attention_grouped
from .basics import linear
from .kv_cache import TinyKvCache, TinyKvFullCache
from .paged_kv_cache import TinyKvPagedCache, TinyKvPagedPool
from .qwen3_week1 import Qwen3ModelWeek1, Qwen3MultiHeadAttention


def attention_mask(L: int, S: int, dtype: mx.Dtype) -> mx.array | str | None:
    """The mask for L new queries over S cached keys (the new ones included)."""
    if L == 1:
        return None  # one new token may see everything in the cache
    if L == S:
        return "causal"  # a whole prompt on an empty cache: the square mask of Week 1 Day 3
    return causal_mask(L, S, dtype)  # a chunk after earlier tokens: Week 3 Day 2


class Qwen3AttentionWithCache(Qwen3MultiHeadAttention):
    """Qwen3 attention that appends its keys/values to a cache and attends over all of it."""

    def __call__(self, x: mx.array, offset: int | list[int], cache: TinyKvCache) -> mx.array:
        b, l, _ = x.shape  # x [B, L, E]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(linear(x, self.wq).reshape(b, l, h, d))  # [B, L, H, D]
        k = self.k_norm(linear(x, self.wk).reshape(b, l, h_kv, d))  # [B, L, H_kv, D]
        v = linear(x, self.wv).reshape(b, l, h_kv, d)
        q = self.rope(q, offset).swapaxes(1, 2)  # [B, H, L, D], positions start at offset
        k = self.rope(k, offset).swapaxes(1, 2)  # [B, H_kv, L, D]
        keys, values, mask = cache.update_and_fetch(k, v.swapaxes(1, 2))  # [B, H_kv, S, D]
        if mask is None:
            mask = attention_mask(l, keys.shape[2], q.dtype)
        out = scaled_dot_product_attention_grouped(q, keys, values, mask=mask)  # [B, H, L, D]
        return linear(out.swapaxes(1, 2).reshape(b, l, h * d), self.wo)  # [B, L, E]


class Qwen3Model(Qwen3ModelWeek1):
    """tokens [B, L] at position offset -> logits [B, L or logits_to_keep, vocab]."""

    attention_cls = Qwen3AttentionWithCache

    def create_kv_cache(self) -> list[TinyKvFullCache]:
        return [TinyKvFullCache() for _ in range(self.num_hidden_layers)]

    def create_kv_pools(
        self, page_size: int = 16, max_pages: int | None = None
    ) -> list[TinyKvPagedPool]:
        c = self.config
        return [
            TinyKvPagedPool(c.num_key_value_heads, c.head_dim, page_size, max_pages, self.dtype)
            for _ in range(self.num_hidden_layers)
        ]

    def create_paged_kv_cache(self, pools: list[TinyKvPagedPool]) -> list[TinyKvPagedCache]:
        if len(pools) != self.num_hidden_layers:
            raise ValueError(f"{len(pools)} pools for {self.num_hidden_layers} layers")
        return [TinyKvPagedCache(pool) for pool in pools]

    def __call__(
        self,
        tokens: mx.array,
        offset: int | list[int],
        cache: list[TinyKvCache],
        logits_to_keep: int | None = None,
    ) -> mx.array:
        if len(cache) != self.num_hidden_layers:
            raise ValueError(f"{len(cache)} layer caches for {self.num_hidden_layers} layers")
        if offset != cache[0].offset:
            raise ValueError(f"offset {offset} does not match the cache offset {cache[0].offset}")
        h = self.embed_tokens[tokens]  # [B, L, E]
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, offset, layer_cache)
        if logits_to_keep is not None:
            h = h[:, -logits_to_keep:, :]  # only the rows whose logits the caller needs
        return linear(self.norm(h), self.lm_head)  # [B, L', V]
