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
        raise NotImplementedError("Week 2 Day 1, Task 2: attention with a KV cache and an offset")


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
        raise NotImplementedError("Week 2 Day 1, Task 3: the model forward pass with a cache")
