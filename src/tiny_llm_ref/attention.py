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
    # BEGIN TASK Week 1 Day 1, Task 3: implement scaled dot-product attention
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.swapaxes(-2, -1)) * factor  # [..., L, S]
    if mask is not None:
        scores = scores + mask
    return softmax(scores, axis=-1) @ value  # [..., L, D]
    # END TASK


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
        # BEGIN TASK Week 1 Day 1, Task 4: implement multi-head attention
        n, l_q, _ = query.shape  # query [N, L, E]; key/value [N, S, E]
        s = key.shape[1]
        h, d = self.num_heads, self.head_dim
        q = linear(query, self.wq).reshape(n, l_q, h, d).swapaxes(1, 2)  # [N, H, L, D]
        k = linear(key, self.wk).reshape(n, s, h, d).swapaxes(1, 2)  # [N, H, S, D]
        v = linear(value, self.wv).reshape(n, s, h, d).swapaxes(1, 2)  # [N, H, S, D]
        out = scaled_dot_product_attention_simple(q, k, v, mask=mask)  # [N, H, L, D]
        out = out.swapaxes(1, 2).reshape(n, l_q, h * d)  # [N, L, E]
        return linear(out, self.wo)
        # END TASK


def causal_mask(L: int, S: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """[L, S] additive mask for L new queries at the end of S keys (diagonal offset S - L).

    Query row i sits at absolute position S - L + i and may see keys 0 ..= S - L + i.
    """
    # BEGIN TASK Week 3 Day 2, Task 2: build the rectangular L x S causal mask
    if L < 1 or S < L:
        raise ValueError(f"a causal mask needs 1 <= L <= S, got L={L}, S={S}")
    blocked = mx.triu(mx.ones((L, S), dtype=mx.bool_), k=S - L + 1)  # True above the diagonal
    return mx.where(blocked, mx.array(-mx.inf, dtype=dtype), mx.array(0, dtype=dtype))
    # END TASK


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
        # BEGIN TASK Week 3 Day 2, Task 2: accept the causal mask string for fewer queries than keys
        mask = causal_mask(l_q, s, query.dtype)  # [L, S], diagonal offset S - L
        # END TASK
    # BEGIN TASK Week 1 Day 3, Task 1: implement grouped-query attention with a square causal mask
    *batch, h_q, l_q, d = query.shape
    h, s = key.shape[-3], key.shape[-2]
    if h_q % h != 0:
        raise ValueError(f"query heads {h_q} are not a multiple of key/value heads {h}")
    n_rep = h_q // h
    factor = 1.0 / math.sqrt(d) if scale is None else scale

    q = query.reshape(*batch, h, n_rep, l_q, d)  # [..., H, n_rep, L, D]
    k = mx.expand_dims(key, -3)  # [..., H, 1, S, D]
    v = mx.expand_dims(value, -3)  # [..., H, 1, S, D]
    scores = (q @ k.swapaxes(-2, -1)) * factor  # [..., H, n_rep, L, S]

    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}: use 'causal', None or an array")
        if l_q > s:  # a query before the first key would see nothing
            raise ValueError(
                f"the 'causal' mask needs no more queries than keys (L <= S), got L={l_q} and S={s}"
            )
        # square here: a rectangle (L < S) became an array above (Week 3 Day 2)
        blocked = mx.triu(mx.ones((l_q, s), dtype=mx.bool_), k=1)  # [L, S]
        scores = mx.where(blocked, mx.array(-mx.inf, dtype=scores.dtype), scores)
    elif mask is not None:
        full = mx.broadcast_to(mask, (*batch, h_q, l_q, s))
        scores = scores + full.reshape(*batch, h, n_rep, l_q, s)

    out = softmax(scores, axis=-1) @ v  # [..., H, n_rep, L, D]
    return out.reshape(*batch, h_q, l_q, d)
    # END TASK
