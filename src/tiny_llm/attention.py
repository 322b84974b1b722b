"""Attention: Week 1 Day 1 (scaled dot-product, multi-head), Week 1 Day 3 (grouped-query),
Week 3 Day 2 (rectangular causal masks for chunked prefill)."""

import math

import mlx.core as mx

from .basics import linear, softmax


def scaled_dot_product_attention_simple(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """query [..., L, D], key/value [..., S, D], additive mask broadcastable to [..., L, S]."""
    raise NotImplementedError("Week 1 Day 1, Task 3: implement scaled dot-product attention")


class SimpleMultiHeadAttention:
    """Multi-head attention with square projections, weights in [out, in] layout."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        wq: mx.array,
        wk: mx.array,
        wv: mx.array,
        wo: mx.array,
    ):
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}"
            )
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo

    def __call__(
        self, query: mx.array, key: mx.array, value: mx.array, mask: mx.array | None = None
    ) -> mx.array:
        raise NotImplementedError("Week 1 Day 1, Task 4: implement multi-head attention")


def causal_mask(L: int, S: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """[L, S] additive mask for L new queries at the end of S keys (diagonal offset S - L).

    Query row i sits at absolute position S - L + i and may see keys 0 ..= S - L + i.
    """
    raise NotImplementedError("Week 3 Day 2, Task 2: build the rectangular L x S causal mask")


def scaled_dot_product_attention_grouped(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    mask: mx.array | str | None = None,
) -> mx.array:
    """Grouped-query attention without copying K/V.

    query [..., H_q, L, D]; key/value [..., H, S, D] with H_q a multiple of H.
    mask: None, an additive array broadcastable to [..., H_q, L, S], or "causal". "causal" puts
    the L queries at the last L positions of the S keys (bottom-right, as
    mx.fast.scaled_dot_product_attention does), so query i sees keys 0 ..= S - L + i; it needs
    L <= S. Week 1 Day 3 builds the square one, Week 3 Day 2 the rectangles (L < S).
    """
    l_q, s = query.shape[-2], key.shape[-2]
    if isinstance(mask, str) and mask == "causal" and l_q < s:
        raise NotImplementedError(
            "Week 3 Day 2, Task 2: accept the causal mask string for fewer queries than keys"
        )
    raise NotImplementedError(
        "Week 1 Day 3, Task 1: implement grouped-query attention with a square causal mask"
    )
